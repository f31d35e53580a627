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

from agent.backend.base import FabricState
from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.state import GpuSample
from agent.watch.boards import Sustained, SustainedWatcher, sample_event

#: The systemd unit that registers GPUs with the NVSwitch fabric.
FABRIC_MANAGER_SERVICE = "nvidia-fabricmanager"


def _problem(state: int, status: int | None) -> str | None:
    """What keeps the GPU off the fabric, None when it is registered."""
    name = FabricState(state).name.lower() if state in set(FabricState) else f"unknown_{state}"
    if state == FabricState.COMPLETED:
        return None if not status else f"fabric registration failed (NVML status {status})"
    return f"fabric registration {name}"


class FabricWatcher(SustainedWatcher[Sustained[str]]):  # reported: what keeps the GPU off the fabric
    name = "fabric"

    def _new_state(self) -> Sustained[str]:
        return Sustained()

    def _board_event(self, sample: GpuSample, state: Sustained[str], now_seconds: float) -> Event | None:
        if sample.fabric_state is None:
            return None
        problem = _problem(sample.fabric_state, sample.fabric_status)
        data = {
            "state": sample.fabric_state,
            "status": sample.fabric_status,
            "service": FABRIC_MANAGER_SERVICE,
        }
        if problem is None:
            if not state.gone():
                return None
            text = "registered with the NVSwitch fabric"
            return sample_event(sample, EventKind.FABRIC_REGISTERED, Severity.INFO, text, now_seconds, data=data)
        if not state.seen(problem, self.sustain_loops):
            return None
        return sample_event(
            sample,
            EventKind.FABRIC_UNREGISTERED,
            Severity.CRITICAL,
            f"{problem}: CUDA cannot run on this GPU; check {FABRIC_MANAGER_SERVICE}",
            now_seconds,
            data=data,
            suggested_action=SuggestedAction.RESTART_SERVICE,
        )

    def _open_fault(self, state: Sustained[str]) -> Health:
        text = (
            f"{state.reported}: CUDA cannot run; restart {FABRIC_MANAGER_SERVICE} "
            f"(systemctl restart {FABRIC_MANAGER_SERVICE}) and check its log"
        )
        return Health(HealthState.UNHEALTHY, text, SuggestedAction.RESTART_SERVICE, (FaultCause.FABRIC,))
