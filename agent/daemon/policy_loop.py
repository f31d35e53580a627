"""The policy loop: every policy interval all items are planned, every loop the fan curve; in
enforce mode drift is applied. The step runs in its own lane and the loop waits for it at most
`step_wait` (a long update-initramfs, a hung NVML call): a later loop takes the result."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from agent.backend.base import GpuBackend
from agent.backend.errors import GpuError
from agent.config import AgentConfig
from agent.daemon.bounded import StaleGpu
from agent.daemon.drift import DriftBook, ItemKey
from agent.daemon.timing import due, timed
from agent.events import Event
from agent.logs import get_logger
from agent.names.policy_items import FAN_CURVE, GPU_RESET_ITEM
from agent.policy import fan_curve
from agent.policy.engine import PolicyEngine
from agent.policy.plan import ApplyOutcome, ItemPlan, PlanStatus
from agent.policy.profiles import resolve_profile
from agent.state import CollectorStatus, GpuSample

if TYPE_CHECKING:
    from agent.daemon.live import Live

log = get_logger()

#: What one policy step hands back: the plans, the items it fixed, and why the others failed to apply.
_PolicyStep = tuple[tuple[ItemPlan, ...], list[ItemPlan], dict[ItemKey, str]]


class PolicyLoop:
    """Reads of the daemon's live parts (agent/daemon/live.py): the config of the moment (a reload's
    is planned whole at the next step), the host, the bounded runner, the backend session (told of
    every GPU fault) and the ledger of GPU items a job drives (planned, never written meanwhile)."""

    def __init__(self, *, live: Live) -> None:
        self.live = live
        self._config = live.config  # the config the last full pass planned against
        self.plans: tuple[ItemPlan, ...] = ()
        self.drift = DriftBook()
        self.status: CollectorStatus | None = None
        self.last_full_seconds = float("-inf")
        self.engine: PolicyEngine | None = None
        self.pending: tuple[Future[_PolicyStep], bool] | None = None  # (step still running, full pass?)
        self._planned_readings: dict[tuple[int, str], object] = {}  # the settings read when last planned

    def forget_backend(self) -> None:
        """The backend was closed: a step still running holds the old one, and its result is dropped."""
        self.engine = None
        self.pending = None

    def step(
        self,
        backend: GpuBackend,
        now: float,
        wait_seconds: float,
        samples: Sequence[GpuSample] = (),
    ) -> list[Event]:
        """Plan (all items every policy interval, the fan curve every loop); apply drift in enforce mode.

        A setting the loop's samples read differently from the last plan (someone ran `nvidia-smi -pl`)
        is planned again in this loop: the screen never shows the new reading beside the old verdict."""
        config = self.live.config
        if config is not self._config:  # a reload: every item is planned again against the new config
            self._config = config
            self.last_full_seconds = float("-inf")
            if self.engine is not None:
                self.engine.config = config
        readings = _planned_readings(samples)
        changed = any(self._planned_readings.get(key, value) != value for key, value in readings.items())
        full = changed or due(now, self.last_full_seconds, config.policy_interval_seconds)
        policy = config.policy
        wants_fans = any(p.fan_curve is not None for p in (*policy.gpus, *policy.gpu_overrides))
        if not full and not wants_fans:
            return []
        if self.engine is None or self.engine.backend is not backend:
            self.engine = PolicyEngine(config, backend, self.live.host, self.live.holds)
            self.pending = None
        try:
            if self.pending is None:  # a step dropped with its backend may still hold the lane: StaleGpu
                self.pending = (self.live.runner.submit("policy", partial(self._run, self.engine, full)), full)
            future, full = self.pending  # possibly a step an earlier loop started
            plans, fixed, failed = timed(
                "policy", partial(self.live.runner.result, "policy", future, wait_seconds), self._record
            )
        except StaleGpu as exc:
            # Still running: the loop goes on and a later loop takes the result; the collector says so.
            self.status = CollectorStatus("policy", False, 0.0, f"step still running: {exc}")
            log.warning("policy step still running; the loop goes on without it", error=str(exc))
            return []
        except (GpuError, OSError) as exc:
            self._failed(exc, full)
            return []
        self.pending = None
        for plan in plans:
            if plan.error_kind is not None:
                self.live.session.note_fault(f"policy {plan.item}", plan.error_kind)
        plans = self.drift.note_apply_failures(plans, failed)
        if full:
            self.last_full_seconds = now
            self.plans = plans
            self._planned_readings.update(readings)
        else:
            self.plans = _merge_plans(self.plans, plans)
        return self.drift.fixed(fixed, self.live.collector.identities, now)

    def fan_gpus(self, config: AgentConfig) -> set[int]:
        """The GPUs whose fans `config` drives from a curve (the fan curve enforced, the GPU's profile has one)."""
        if self.engine is None or FAN_CURVE not in config.writable_items():
            return set()
        identities = self.engine.state.identities
        profiles = {gpu: resolve_profile(config.policy, identity) for gpu, identity in identities.items()}
        return {gpu for gpu, found in profiles.items() if found is not None and found.profile.fan_curve is not None}

    def hand_back_fans(self, new: AgentConfig) -> None:
        """A reload: the GPUs whose fans the running config drove and `new` does not (observe mode,
        `modes.fan_curve: observe`, the curve removed) get automatic control back. Runs before the
        write guard takes the new config, which may no longer allow fan writes."""
        released = self.fan_gpus(self.live.config) - self.fan_gpus(new)
        if released:
            self.restore_fans(released)

    def restore_fans(self, gpus: Collection[int] | None = None) -> None:
        """Fans the agent set to manual go back to automatic: on every exit path (all GPUs, when the
        config lets the agent drive fans), and for `gpus` when a reload stops owning them."""
        if self.engine is None or FAN_CURVE not in self.live.config.writable_items():
            return
        for gpu, ctx in sorted(self.engine.state.contexts.items()):
            if gpus is not None and gpu not in gpus:
                continue
            try:
                result = self.live.runner.run(f"gpu{gpu}", partial(fan_curve.restore, ctx), timeout_seconds=5.0)
            except (StaleGpu, GpuError) as exc:
                log.error("could not restore automatic fan control", gpu=gpu, error=str(exc))
                continue
            if result.outcome is ApplyOutcome.FAILED:
                log.error("could not restore automatic fan control", gpu=gpu, error=result.detail)
            else:
                log.info("fans restored to automatic", gpu=gpu, outcome=result.outcome.value)

    def _run(self, engine: PolicyEngine, full: bool) -> _PolicyStep:
        items = None if full else {FAN_CURVE}
        if not self.live.config.writable_items() - {GPU_RESET_ITEM}:
            return engine.plan(only=items).items, [], {}
        # apply() only writes items whose plan was read completely and says DRIFT: an item with any
        # failed read is an ERROR plan and is skipped, never half-applied.
        report = engine.apply(only=items)
        fixed = [r.plan for r in report.results if r.outcome is ApplyOutcome.APPLIED]
        failed = {(r.plan.item, r.plan.gpu): r.detail for r in report.results if r.outcome is ApplyOutcome.FAILED}
        return report.plan.items, fixed, failed

    def _failed(self, exc: GpuError | OSError, full: bool) -> None:
        self.pending = None
        log.error("policy step failed", error=str(exc))
        if isinstance(exc, GpuError):
            self.live.session.note_fault("policy", exc.kind)
        # What the last pass said is no longer known to hold.
        self.plans = tuple(_unknown_plan(p, exc) if full or p.item == FAN_CURVE else p for p in self.plans)

    def _record(self, status: CollectorStatus) -> None:
        self.status = status


#: The sample fields policy items plan against (power_limit, persistence, ecc).
_PLANNED_FIELDS = ("power_limit_watts", "persistence_enabled", "ecc_enabled", "ecc_pending")


def _planned_readings(samples: Sequence[GpuSample]) -> dict[tuple[int, str], object]:
    """(GPU, field) -> what the loop's samples read of the settings policy items plan against; a
    reading that failed or is not supported is left out (it says nothing changed)."""
    found: dict[tuple[int, str], object] = {}
    for sample in samples:
        if sample.up:
            for name in _PLANNED_FIELDS:
                value = getattr(sample, name)
                if value is not None:
                    found[sample.index, name] = value
    return found


def _unknown_plan(plan: ItemPlan, exc: Exception) -> ItemPlan:
    return replace(
        plan,
        status=PlanStatus.ERROR,
        actual="unknown",
        detail=f"policy step failed: {exc}",
        changes=(),
        error_kind=exc.kind.value if isinstance(exc, GpuError) else None,
    )


def _merge_plans(previous: tuple[ItemPlan, ...], fresh: tuple[ItemPlan, ...]) -> tuple[ItemPlan, ...]:
    replaced = {(p.item, p.gpu): p for p in fresh}
    merged = [replaced.pop((p.item, p.gpu), p) for p in previous]
    return (*merged, *replaced.values())
