"""GPU memory health: ECC error counters, row remapping, page retirement, the driver's recovery action.

Counters (ECC volatile and aggregate) are compared with their previous reading: the first reading
is a baseline, never an event, and a counter that went down was cleared (the volatile ones by a GPU
reset or reboot) and becomes the new baseline. A first volatile uncorrected count above zero is no
event but keeps the GPU unhealthy: those errors happened since its last reset (an agent restart
must not make it look clean). Flags (remap pending/failed, retired pages pending,
recovery action) are conditions: reported when they appear, including on the first reading, and
forgotten when they clear.

- uncorrected ECC errors grew: ECC_UNCORRECTED, critical, reset the GPU (the error killed whatever
  used that memory; on remapping boards the remap it triggers applies at the next reset). The GPU
  stays unhealthy until the volatile counter is cleared by a reset.
- corrected errors grew: ECC_CORRECTED, informational, at most one per GPU per 10 minutes (the
  increments in between are added to the next one). Health is unaffected: correcting is ECC working.
- remap pending: ROW_REMAP_PENDING (degraded, reset the GPU); remap failed: ROW_REMAP_FAILED
  (unhealthy, contact support: the bank has no spare rows left).
- retired pages pending (boards that retire pages instead of remapping rows): RETIRED_PAGES_PENDING
  (degraded, reset the GPU).
- recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, the same value Xid 154 announces) other
  than NONE: RECOVERY_ACTION with the action it asks for, as the Xid catalog maps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.backend.base import RecoveryAction
from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.state import GpuSample
from agent.watch.boards import BoardStates, sample_event
from agent.watch.gpu_health import combine

CORRECTED_EVENT_INTERVAL_SECONDS = 600.0

_UNCORRECTED_FIELDS = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate")
_CORRECTED_FIELDS = ("ecc_corrected_volatile", "ecc_corrected_aggregate")


@dataclass(frozen=True)
class _Recovery:
    label: str
    severity: Severity
    state: HealthState
    action: SuggestedAction


#: Same mapping as the Xid catalog's recovery_actions (Xid 154 names these values in the kernel log).
RECOVERY_ACTIONS: dict[RecoveryAction, _Recovery] = {
    RecoveryAction.GPU_RESET: _Recovery(
        "GPU reset required", Severity.CRITICAL, HealthState.UNHEALTHY, SuggestedAction.RESET_GPU
    ),
    RecoveryAction.NODE_REBOOT: _Recovery(
        "node reboot required", Severity.FATAL, HealthState.UNHEALTHY, SuggestedAction.REBOOT
    ),
    RecoveryAction.DRAIN_P2P: _Recovery(
        "drain peer-to-peer traffic", Severity.WARNING, HealthState.DEGRADED, SuggestedAction.ALERT
    ),
    RecoveryAction.DRAIN_AND_RESET: _Recovery(
        "drain and reset", Severity.CRITICAL, HealthState.UNHEALTHY, SuggestedAction.RESET_GPU
    ),
}
# A value newer than this agent: someone has to look at it.
_UNKNOWN_RECOVERY = _Recovery("unknown recovery action", Severity.WARNING, HealthState.DEGRADED, SuggestedAction.ALERT)


def _recovery(value: int) -> _Recovery:
    try:
        return RECOVERY_ACTIONS[RecoveryAction(value)]
    except ValueError:
        return _UNKNOWN_RECOVERY


#: Flags reported when they appear: (GpuSample and _GpuState field, event kind, severity, message, action).
_FLAGS: tuple[tuple[str, EventKind, Severity, str, SuggestedAction], ...] = (
    (
        "remap_pending",
        EventKind.ROW_REMAP_PENDING,
        Severity.WARNING,
        "row remapping pending ({rows} rows remapped); a GPU reset applies it",
        SuggestedAction.RESET_GPU,
    ),
    (
        "remap_failed",
        EventKind.ROW_REMAP_FAILED,
        Severity.CRITICAL,
        "row remapping failed ({rows} rows remapped): the memory has no spare rows left",
        SuggestedAction.CONTACT_SUPPORT,
    ),
    (
        "retired_pages_pending",
        EventKind.RETIRED_PAGES_PENDING,
        Severity.WARNING,
        "memory pages are pending retirement; a GPU reset retires them",
        SuggestedAction.RESET_GPU,
    ),
)


_UNCORRECTED_HEALTH = Health(
    HealthState.UNHEALTHY,
    "uncorrected ECC errors since the last GPU reset",
    SuggestedAction.RESET_GPU,
    (FaultCause.ECC_UNCORRECTED,),
)


@dataclass
class _GpuState:
    counters: dict[str, int] = field(default_factory=dict)
    uncorrected: Health | None = None
    corrected_unreported: int = 0
    corrected_last_event_seconds: float | None = None
    remap_pending: bool = False
    remap_failed: bool = False
    retired_pages_pending: bool = False
    recovery_action: int = RecoveryAction.NONE


class MemoryWatcher:
    name = "memory"

    def __init__(self) -> None:
        self._gpus = BoardStates(_GpuState)

    def observe(self, samples: Sequence[GpuSample], now_seconds: float) -> list[Event]:
        events: list[Event] = []
        for sample, state in self._gpus.answering(samples):
            if self._was_reset(state, sample):
                state.uncorrected = None
            elif self._first_volatile_uncorrected(state, sample):
                # A baseline, not an event, but not a clean GPU: the volatile counter says these errors
                # happened since the last reset (before an agent restart, say), and the GPU still needs one.
                state.uncorrected = _UNCORRECTED_HEALTH
            uncorrected = self._growth(state, sample, _UNCORRECTED_FIELDS)
            corrected = self._growth(state, sample, _CORRECTED_FIELDS)
            if uncorrected:
                events.append(self._uncorrected(state, sample, uncorrected, now_seconds))
            state.corrected_unreported += corrected
            events += self._corrected(state, sample, now_seconds)
            events += self._flags(state, sample, now_seconds)
            events += self._recovery_action(state, sample, now_seconds)
        return events

    def health(self, gpu: int) -> Health:
        state = self._gpus.get(gpu)
        if state is None:
            return Health.healthy()
        parts: list[Health] = []
        if state.uncorrected is not None:
            parts.append(state.uncorrected)
        if state.remap_failed:
            parts.append(
                Health(
                    HealthState.UNHEALTHY,
                    "row remapping failed: no spare rows",
                    SuggestedAction.CONTACT_SUPPORT,
                    (FaultCause.ROW_REMAP_FAILED,),
                )
            )
        if state.remap_pending:
            parts.append(
                Health(
                    HealthState.DEGRADED,
                    "row remapping pending a reset",
                    SuggestedAction.RESET_GPU,
                    (FaultCause.ROW_REMAP_PENDING,),
                )
            )
        if state.retired_pages_pending:
            parts.append(
                Health(
                    HealthState.DEGRADED,
                    "page retirement pending a reset",
                    SuggestedAction.RESET_GPU,
                    (FaultCause.PAGE_RETIREMENT_PENDING,),
                )
            )
        if state.recovery_action != RecoveryAction.NONE:
            recovery = _recovery(state.recovery_action)
            parts.append(
                Health(
                    recovery.state,
                    f"driver recovery action: {recovery.label}",
                    recovery.action,
                    (FaultCause.RECOVERY_ACTION,),
                )
            )
        return combine(parts)

    # -- counters ---------------------------------------------------------------------------

    @staticmethod
    def _was_reset(state: _GpuState, sample: GpuSample) -> bool:
        """The volatile counters restart from zero at a GPU reset or reboot: the recovery from an
        uncorrected error."""
        value, previous = sample.ecc_uncorrected_volatile, state.counters.get("ecc_uncorrected_volatile")
        return value is not None and previous is not None and value < previous

    @staticmethod
    def _first_volatile_uncorrected(state: _GpuState, sample: GpuSample) -> bool:
        value = sample.ecc_uncorrected_volatile
        return bool(value) and "ecc_uncorrected_volatile" not in state.counters

    @staticmethod
    def _growth(state: _GpuState, sample: GpuSample, fields: tuple[str, str]) -> int:
        """New errors since the previous reading. Volatile and aggregate count the same errors, so the
        larger delta is the number of new ones, whichever counters this board supports."""
        grown = 0
        for name in fields:
            value: int | None = getattr(sample, name)
            if value is None:
                continue
            previous = state.counters.get(name)
            if previous is not None:
                if value > previous:
                    grown = max(grown, value - previous)
                elif value < previous and name.endswith("_volatile"):
                    # Reset since the last reading: whatever it counts now happened after the reset. (A
                    # smaller aggregate count was cleared on purpose and is only a new baseline.)
                    grown = max(grown, value)
            state.counters[name] = value
        return grown

    @staticmethod
    def _counts(sample: GpuSample) -> dict[str, Any]:
        return {name: getattr(sample, name) for name in (*_UNCORRECTED_FIELDS, *_CORRECTED_FIELDS)}

    def _uncorrected(self, state: _GpuState, sample: GpuSample, new: int, now_seconds: float) -> Event:
        state.uncorrected = _UNCORRECTED_HEALTH
        return sample_event(
            sample,
            EventKind.ECC_UNCORRECTED,
            Severity.CRITICAL,
            f"{new} new uncorrected ECC error{'s' if new != 1 else ''}; reset the GPU",
            now_seconds,
            # the counter value tells one occurrence from the next, and stays the same across agent restarts
            key_detail=_occurrence(sample.ecc_uncorrected_aggregate, sample.ecc_uncorrected_volatile),
            data={"new_errors": new, **self._counts(sample), **self._remap_counts(sample)},
            suggested_action=SuggestedAction.RESET_GPU,
        )

    def _corrected(self, state: _GpuState, sample: GpuSample, now_seconds: float) -> list[Event]:
        if state.corrected_unreported == 0:
            return []
        last = state.corrected_last_event_seconds
        if last is not None and now_seconds - last < CORRECTED_EVENT_INTERVAL_SECONDS:
            return []
        new, state.corrected_unreported = state.corrected_unreported, 0
        state.corrected_last_event_seconds = now_seconds
        return [
            sample_event(
                sample,
                EventKind.ECC_CORRECTED,
                Severity.INFO,
                f"{new} corrected ECC error{'s' if new != 1 else ''}",
                now_seconds,
                key_detail=_occurrence(sample.ecc_corrected_aggregate, sample.ecc_corrected_volatile),
                data={"new_errors": new, **self._counts(sample)},
            )
        ]

    # -- flags ------------------------------------------------------------------------------

    @staticmethod
    def _remap_counts(sample: GpuSample) -> dict[str, Any]:
        return {
            "remapped_rows_correctable": sample.remapped_rows_correctable,
            "remapped_rows_uncorrectable": sample.remapped_rows_uncorrectable,
        }

    def _flags(self, state: _GpuState, sample: GpuSample, now_seconds: float) -> list[Event]:
        events: list[Event] = []
        rows = f"{sample.remapped_rows_uncorrectable} uncorrectable, {sample.remapped_rows_correctable} correctable"
        for name, kind, severity, text, action in _FLAGS:
            value: bool | None = getattr(sample, name)
            if value is None:
                continue
            if value and not getattr(state, name):
                events.append(
                    sample_event(
                        sample,
                        kind,
                        severity,
                        text.format(rows=rows),
                        now_seconds,
                        key_detail=f"{sample.remapped_rows_correctable}+{sample.remapped_rows_uncorrectable}",
                        data=self._remap_counts(sample),
                        suggested_action=action,
                    )
                )
            setattr(state, name, value)
        return events

    @staticmethod
    def _recovery_action(state: _GpuState, sample: GpuSample, now_seconds: float) -> list[Event]:
        value = sample.recovery_action
        if value is None or value == state.recovery_action:
            return []
        state.recovery_action = value
        if value == RecoveryAction.NONE:
            return []
        recovery = _recovery(value)
        return [
            sample_event(
                sample,
                EventKind.RECOVERY_ACTION,
                recovery.severity,
                f"the driver asks for recovery: {recovery.label}",
                now_seconds,
                key_detail=str(value),
                data={"recovery_action": value, "label": recovery.label},
                suggested_action=recovery.action,
            )
        ]


def _occurrence(aggregate: int | None, volatile: int | None) -> str:
    return f"a{aggregate}" if aggregate is not None else f"v{volatile}"
