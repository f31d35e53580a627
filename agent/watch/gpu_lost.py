"""GPUs that stop answering: fallen off the bus (NVML GPU_IS_LOST) or needing a reset (RESET_REQUIRED).

The collector marks such a GPU `up=False` and records the kind in `read_errors`. A lost GPU cannot
even name itself, so the watcher remembers each index's UUID from earlier loops. Transitions:
up -> lost: GPU_LOST (fatal; only a reboot brings a GPU back from Xid 79 territory), up -> reset
required: GPU_RESET_REQUIRED (critical, reset the GPU), either -> up: GPU_RECOVERED. A GPU already
lost at the first look is reported too. A GPU that is down for another reason (its identity call
timed out, say) is not called lost: that is the collector's staleness to report, not a verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from agent.backend.errors import GpuErrorKind
from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.state import GpuSample


class _Condition(str, Enum):
    UP = "up"
    LOST = "gpu_lost"
    RESET_REQUIRED = "reset_required"


@dataclass
class _GpuState:
    uuid: str
    pci_bus_id: str
    condition: _Condition


def _condition(sample: GpuSample) -> _Condition | None:
    """What the sample says about the GPU; None when it is down for a reason that proves nothing."""
    if sample.up:
        return _Condition.UP
    kinds = set(sample.read_errors.values())
    if GpuErrorKind.GPU_LOST.value in kinds:
        return _Condition.LOST
    if GpuErrorKind.RESET_REQUIRED.value in kinds:
        return _Condition.RESET_REQUIRED
    return None


class GpuLostWatcher:
    name = "gpu_lost"

    def __init__(self) -> None:
        self._gpus: dict[int, _GpuState] = {}

    def observe(self, samples: Sequence[GpuSample], now_seconds: float) -> list[Event]:
        events: list[Event] = []
        for sample in samples:
            condition = _condition(sample)
            if condition is None:
                continue
            state = self._gpus.get(sample.index)
            if state is None or (sample.uuid and state.uuid and sample.uuid != state.uuid):
                # First look, or another board now answers at this index: nothing to compare with.
                previous = _Condition.UP
                state = self._gpus[sample.index] = _GpuState(sample.uuid, sample.pci_bus_id, condition)
            else:
                previous = state.condition
                state.condition = condition
                if sample.uuid:
                    state.uuid = sample.uuid
                if sample.pci_bus_id:
                    state.pci_bus_id = sample.pci_bus_id
            if condition is not previous:
                events.append(self._event(sample.index, state, sample, now_seconds))
        return events

    def health(self, gpu: int) -> Health:
        state = self._gpus.get(gpu)
        if state is None or state.condition is _Condition.UP:
            return Health.healthy()
        if state.condition is _Condition.LOST:
            return Health(
                HealthState.UNHEALTHY, "GPU has fallen off the bus", SuggestedAction.REBOOT, (FaultCause.GPU_LOST,)
            )
        return Health(
            HealthState.UNHEALTHY, "GPU requires a reset", SuggestedAction.RESET_GPU, (FaultCause.RESET_REQUIRED,)
        )

    @staticmethod
    def _event(gpu: int, state: _GpuState, sample: GpuSample, now_seconds: float) -> Event:
        where = f"GPU {gpu} ({state.pci_bus_id})" if state.pci_bus_id else f"GPU {gpu}"
        if state.condition is _Condition.LOST:
            kind, severity, action = EventKind.GPU_LOST, Severity.FATAL, SuggestedAction.REBOOT
            message = f"{where} has fallen off the bus; reboot the node"
        elif state.condition is _Condition.RESET_REQUIRED:
            kind, severity, action = EventKind.GPU_RESET_REQUIRED, Severity.CRITICAL, SuggestedAction.RESET_GPU
            message = f"{where} requires a reset"
        else:
            kind, severity, action = EventKind.GPU_RECOVERED, Severity.INFO, SuggestedAction.NONE
            message = f"{where} answers again"
        return Event(
            kind=kind,
            severity=severity,
            gpu=gpu,
            uuid=state.uuid or None,
            message=message,
            timestamp_seconds=now_seconds,
            source="poll",
            key=f"{kind.value}:{state.uuid or state.pci_bus_id or gpu}",
            data={"pci_bus_id": state.pci_bus_id, "read_errors": dict(sample.read_errors)},
            suggested_action=action,
        )
