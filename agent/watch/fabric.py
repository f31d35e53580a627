"""NVSwitch fabric registration (HGX H100/H200 and later): a GPU whose registration with the fabric
manager has not completed cannot run CUDA work at all.

On nodes with NVSwitches, nvidia-fabricmanager programs the switches and registers every GPU; until
it has (state NOT_STARTED or IN_PROGRESS), or when registration finished with an error (state
COMPLETED, status not NVML_SUCCESS), CUDA initialisation fails on that GPU. After `sustain_loops`
consecutive such readings (registration takes a few seconds at boot) the watcher emits
FABRIC_UNREGISTERED (critical) and the GPU is unhealthy, with the suggested action to restart the
fabric manager service; FABRIC_REGISTERED when it completes. GPUs without a fabric read None.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.backend.base import FabricState
from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.state import GpuSample
from agent.watch.boards import SustainedWatcher, sample_event

#: The systemd unit that registers GPUs with the NVSwitch fabric.
FABRIC_MANAGER_SERVICE = "nvidia-fabricmanager"


@dataclass
class _GpuState:
    consecutive: int = 0
    reported: str | None = None  # what was wrong, once reported


def _problem(state: int, status: int | None) -> str | None:
    """What keeps the GPU off the fabric, None when it is registered."""
    name = FabricState(state).name.lower() if state in set(FabricState) else f"unknown_{state}"
    if state == FabricState.COMPLETED:
        return None if not status else f"fabric registration failed (NVML status {status})"
    return f"fabric registration {name}"


class FabricWatcher(SustainedWatcher[_GpuState]):
    name = "fabric"

    def _new_state(self) -> _GpuState:
        return _GpuState()

    def _board_event(self, sample: GpuSample, state: _GpuState, now_seconds: float) -> Event | None:
        if sample.fabric_state is None:
            return None
        problem = _problem(sample.fabric_state, sample.fabric_status)
        data = {
            "state": sample.fabric_state,
            "status": sample.fabric_status,
            "service": FABRIC_MANAGER_SERVICE,
        }
        if problem is None:
            state.consecutive = 0
            if state.reported is None:
                return None
            state.reported = None
            text = "registered with the NVSwitch fabric"
            return sample_event(sample, EventKind.FABRIC_REGISTERED, Severity.INFO, text, now_seconds, data=data)
        state.consecutive += 1
        if state.reported is not None or state.consecutive < self.sustain_loops:
            return None
        state.reported = problem
        return sample_event(
            sample,
            EventKind.FABRIC_UNREGISTERED,
            Severity.CRITICAL,
            f"{problem}: CUDA cannot run on this GPU; check {FABRIC_MANAGER_SERVICE}",
            now_seconds,
            data=data,
            suggested_action=SuggestedAction.RESTART_SERVICE,
        )

    def health(self, gpu: int) -> Health:
        state = self._gpus.get(gpu)
        if state is None or state.reported is None:
            return Health.healthy()
        return Health(
            HealthState.UNHEALTHY,
            f"{state.reported}: CUDA cannot run; restart {FABRIC_MANAGER_SERVICE} "
            f"(systemctl restart {FABRIC_MANAGER_SERVICE}) and check its log",
            SuggestedAction.RESTART_SERVICE,
            (FaultCause.FABRIC,),
        )
