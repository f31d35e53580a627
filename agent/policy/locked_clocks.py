"""Locked GPU and memory clocks (nvidia-smi -lgc / -lmc): steady clocks give steady latency,
and a lower graphics lock keeps a dense node under its power and thermal budget."""

from __future__ import annotations

import bisect
from collections.abc import Mapping

from agent.backend.base import ClockDomain
from agent.backend.errors import GpuError, GpuErrorKind
from agent.config import GpuProfile, LockedClocks
from agent.policy.base import GpuContext, ItemPlan, ItemResult, Outcome, PlanStatus
from agent.policy.gpu_item import guarded_apply, guarded_plan, guarded_restore, not_applicable_plan

NAME = "locked_clocks"
_MISSING = "does not support locked clocks"

# The domains this item manages, with what nvidia-smi calls their lock and reset flags.
_DOMAINS: tuple[tuple[ClockDomain, str, str, str], ...] = (
    (ClockDomain.GRAPHICS, "graphics", "-lgc", "-rgc"),
    (ClockDomain.MEMORY, "memory", "-lmc", "-rmc"),
)

_MhzRange = tuple[int, int]


def desired(profile: GpuProfile) -> LockedClocks | None:
    return profile.locked_clocks


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


def _lock_change(gpu: int, domain: ClockDomain, mhz: _MhzRange) -> str:
    label, flag = next((label, flag) for d, label, flag, _ in _DOMAINS if d is domain)
    return f"lock {label} clocks of GPU {gpu} to {_range_text(mhz)} (nvidia-smi -i {gpu} {flag} {mhz[0]},{mhz[1]})"


def plan(ctx: GpuContext, want: LockedClocks) -> ItemPlan:
    wanted = _wanted(want)
    want_text = _domains_text(wanted)

    def read() -> ItemPlan:
        actual = {domain: ctx.backend.locked_clocks_mhz(ctx.gpu, domain) for domain in wanted}
        actual_text = _domains_text(actual)
        problems = _problems(ctx, wanted)
        if problems:
            return ItemPlan(NAME, ctx.gpu, PlanStatus.ERROR, want_text, actual_text, detail="; ".join(problems))
        changes = tuple(_lock_change(ctx.gpu, d, mhz) for d, mhz in wanted.items() if actual[d] != mhz)
        status = PlanStatus.DRIFT if changes else PlanStatus.IN_SYNC
        return ItemPlan(NAME, ctx.gpu, status, want_text, actual_text, changes=changes)

    return guarded_plan(NAME, ctx, want_text, _MISSING, read)


def apply(ctx: GpuContext, want: LockedClocks, plan: ItemPlan) -> ItemResult:
    wanted = _wanted(want)

    def write() -> ItemResult:
        for domain, mhz in wanted.items():
            if ctx.backend.locked_clocks_mhz(ctx.gpu, domain) != mhz:
                ctx.backend.set_locked_clocks_mhz(ctx.gpu, domain, mhz[0], mhz[1])
        now = {domain: ctx.backend.locked_clocks_mhz(ctx.gpu, domain) for domain in wanted}
        if now != wanted:
            return ItemResult(
                plan, Outcome.FAILED, f"locked {plan.desired} but GPU {ctx.gpu} reports {_domains_text(now)}"
            )
        return ItemResult(plan, Outcome.APPLIED, f"clocks {plan.actual} -> {_domains_text(now)}")

    return guarded_apply(plan, write)


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


def restore(ctx: GpuContext) -> ItemResult:
    """Unlock graphics and memory clocks; reads first, so an unlocked board is not written."""

    def read() -> ItemPlan:
        locks = _read_locks(ctx)
        if not locks:
            return not_applicable_plan(NAME, ctx, "unlocked", _MISSING)
        changes = tuple(
            f"reset locked {label} clocks of GPU {ctx.gpu} (nvidia-smi -i {ctx.gpu} {reset_flag})"
            for domain, label, _, reset_flag in _DOMAINS
            if locks.get(domain) is not None
        )
        status = PlanStatus.DRIFT if changes else PlanStatus.IN_SYNC
        return ItemPlan(
            NAME, ctx.gpu, status, _domains_text(dict.fromkeys(locks)), _domains_text(locks), changes=changes
        )

    restore_plan = guarded_plan(NAME, ctx, "unlocked", _MISSING, read)

    def write() -> ItemResult:
        for domain, mhz in _read_locks(ctx).items():
            if mhz is not None:
                ctx.backend.reset_locked_clocks(ctx.gpu, domain)
        now = _read_locks(ctx)
        if any(mhz is not None for mhz in now.values()):
            return ItemResult(
                restore_plan, Outcome.FAILED, f"reset clocks but GPU {ctx.gpu} reports {_domains_text(now)}"
            )
        return ItemResult(restore_plan, Outcome.APPLIED, f"clocks {restore_plan.actual} -> {_domains_text(now)}")

    return guarded_restore(restore_plan, write)
