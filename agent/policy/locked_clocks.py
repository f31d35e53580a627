"""Locked GPU and memory clocks (nvidia-smi -lgc / -lmc): steady clocks give steady latency,
and a lower graphics lock keeps a dense node under its power and thermal budget."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from agent.backend.base import ClockDomain
from agent.backend.errors import GpuError, GpuErrorKind
from agent.config.desired import LockedClocks
from agent.policy.base import GpuContext
from agent.policy.gpu_item import ProfileGpuItem, not_applicable_plan, run_restore
from agent.policy.item import Planned, RestorableGpuItem, compared, planned
from agent.policy.plan import ItemPlan, ItemResult, PlanStatus

# The domains this item manages, with what nvidia-smi calls their lock and reset flags.
_DOMAINS: tuple[tuple[ClockDomain, str, str, str], ...] = (
    (ClockDomain.GRAPHICS, "graphics", "-lgc", "-rgc"),
    (ClockDomain.MEMORY, "memory", "-lmc", "-rmc"),
)

_MhzRange = tuple[int, int]


def _wanted(want: LockedClocks) -> dict[ClockDomain, _MhzRange]:
    ranges = {ClockDomain.GRAPHICS: want.gpu_mhz, ClockDomain.MEMORY: want.memory_mhz}
    return {domain: mhz for domain, mhz in ranges.items() if mhz is not None}


def _range_text(mhz: _MhzRange | None) -> str:
    return "unlocked" if mhz is None else f"{mhz[0]}-{mhz[1]} MHz"


def _domains_text(ranges: Mapping[ClockDomain, _MhzRange | None]) -> str:
    return ", ".join(f"{label} {_range_text(ranges[domain])}" for domain, label, _, _ in _DOMAINS if domain in ranges)


def _nearest_mhz(supported: list[int], mhz: int) -> list[int]:
    """The supported clocks just below and just above `mhz` (one of them at the ends)."""
    ordered = sorted(set(supported))
    at = bisect.bisect_left(ordered, mhz)
    return ordered[max(at - 1, 0) : at + 1]


def _mhz_list(values: list[int]) -> str:
    return ", ".join(str(v) for v in values) + " MHz"


def _problems(ctx: GpuContext, wanted: dict[ClockDomain, _MhzRange]) -> list[str]:
    """Why the device cannot take `wanted`; never clamp: NVML would round to a clock the operator did not pick."""
    problems: list[str] = []
    memory_supported = ctx.backend.supported_memory_clocks_mhz(ctx.gpu)
    memory_want = wanted.get(ClockDomain.MEMORY)
    if memory_want is not None:
        unsupported = [mhz for mhz in sorted(set(memory_want)) if mhz not in memory_supported]
        if unsupported:
            clocks, verb = ("clock", "is") if len(unsupported) == 1 else ("clocks", "are")
            problems.append(
                f"memory {clocks} {_mhz_list(unsupported)} {verb} not supported by this board;"
                f" supported: {_mhz_list(memory_supported)}"
            )
    graphics_want = wanted.get(ClockDomain.GRAPHICS)
    if graphics_want is not None and memory_supported:
        # Graphics clocks are listed per memory clock: check against the memory clock the lock will run
        # with, else the highest one (what an unlocked board runs under load).
        memory_mhz = (
            memory_want[1] if memory_want is not None and memory_want[1] in memory_supported else max(memory_supported)
        )
        graphics_supported = ctx.backend.supported_graphics_clocks_mhz(ctx.gpu, memory_mhz)
        for mhz in sorted(set(graphics_want)):
            if mhz not in graphics_supported:
                problems.append(
                    f"graphics clock {mhz} MHz is not supported at memory clock {memory_mhz} MHz;"
                    f" nearest supported: {_mhz_list(_nearest_mhz(graphics_supported, mhz))}"
                    f" (range {min(graphics_supported)}-{max(graphics_supported)} MHz)"
                )
    return problems


@dataclass(frozen=True)
class SetClockLock:
    """Lock one domain's clocks to `to_mhz`, or unlock them (`to_mhz` None)."""

    gpu: int
    domain: ClockDomain
    from_mhz: _MhzRange | None
    to_mhz: _MhzRange | None

    @property
    def text(self) -> str:
        label, lock_flag, reset_flag = next(
            (label, lock, reset) for d, label, lock, reset in _DOMAINS if d is self.domain
        )
        if self.to_mhz is None:
            return f"reset locked {label} clocks of GPU {self.gpu} (nvidia-smi -i {self.gpu} {reset_flag})"
        low, high = self.to_mhz
        return (
            f"lock {label} clocks of GPU {self.gpu} to {_range_text(self.to_mhz)}"
            f" (nvidia-smi -i {self.gpu} {lock_flag} {low},{high})"
        )


class LockedClocksItem(ProfileGpuItem[LockedClocks, SetClockLock], RestorableGpuItem[LockedClocks, SetClockLock]):
    def want_text(self, want: LockedClocks) -> str:
        return _domains_text(_wanted(want))

    def read(self, ctx: GpuContext, want: LockedClocks) -> Planned[SetClockLock]:
        wanted = _wanted(want)
        want_text = _domains_text(wanted)
        actual = {domain: ctx.backend.locked_clocks_mhz(ctx.gpu, domain) for domain in wanted}
        actual_text = _domains_text(actual)
        problems = _problems(ctx, wanted)
        if problems:
            detail = "; ".join(problems)
            return planned(ItemPlan(self.name, ctx.gpu, PlanStatus.ERROR, want_text, actual_text, detail))
        changes = [SetClockLock(ctx.gpu, d, actual[d], mhz) for d, mhz in wanted.items() if actual[d] != mhz]
        return compared(self.name, ctx.gpu, want_text, actual_text, changes)

    def apply(self, ctx: GpuContext, changes: Sequence[SetClockLock]) -> str:
        for change in changes:
            if change.to_mhz is None:
                ctx.backend.reset_locked_clocks(change.gpu, change.domain)
            else:
                ctx.backend.set_locked_clocks_mhz(change.gpu, change.domain, *change.to_mhz)
        return "clocks " + ", ".join(
            f"{_domains_text({c.domain: c.from_mhz})} -> {_range_text(c.to_mhz)}" for c in changes
        )

    def restore(self, ctx: GpuContext) -> ItemResult:
        """Unlock graphics and memory clocks."""

        def read() -> Planned[SetClockLock]:
            locks = _read_locks(ctx)
            if not locks:
                return planned(not_applicable_plan(self.name, ctx, "unlocked", self.missing))
            changes = [SetClockLock(ctx.gpu, domain, mhz, None) for domain, mhz in locks.items() if mhz is not None]
            return compared(self.name, ctx.gpu, _domains_text(dict.fromkeys(locks)), _domains_text(locks), changes)

        return run_restore(self, ctx, read, "unlocked")


def _read_locks(ctx: GpuContext) -> dict[ClockDomain, _MhzRange | None]:
    """Both domains' locks, leaving out a domain the board cannot lock (some lock graphics only)."""
    locks: dict[ClockDomain, _MhzRange | None] = {}
    for domain, _, _, _ in _DOMAINS:
        try:
            locks[domain] = ctx.backend.locked_clocks_mhz(ctx.gpu, domain)
        except GpuError as exc:
            if exc.kind is not GpuErrorKind.NOT_SUPPORTED:
                raise
    return locks


ITEM: Final = LockedClocksItem(
    "locked_clocks", lambda profile: profile.locked_clocks, missing="does not support locked clocks"
)
