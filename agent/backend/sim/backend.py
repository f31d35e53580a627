"""SimulatedBackend: the GpuBackend protocol over simulated GPUs, with NVML's semantics.

Calls go through the checks NVML makes (init, index, lost, reset required, injected failures
and hangs; `calls`), read the machine state from the shared state file, and answer what
`agent.backend.sim.physics` derives. The backend is built from one part per concern: device
readings (`reads`), the profiling-grade answers (`profiling`), the write side (`setters`) and
the fault injection API (`faults`); this module adds construction, the library calls and events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from agent.backend.base import GpuEvent, WriteGuard
from agent.backend.errors import GpuErrorKind
from agent.backend.sim.calls import sim_error
from agent.backend.sim.faults import FaultInjection
from agent.backend.sim.profiles import load_profile
from agent.backend.sim.profiling import ProfilingReads
from agent.backend.sim.reads import DeviceReads
from agent.backend.sim.setters import DeviceSetters
from agent.backend.sim.state import StateFile

#: How often wait_events looks for injections made by another process.
_POLL_SECONDS = 0.1


class SimulatedBackend(DeviceReads, ProfilingReads, DeviceSetters, FaultInjection):
    """GpuBackend over simulated GPUs described by a profile; state shared through state_dir."""

    name = "simulated"

    def __init__(
        self,
        profile: str | Path,
        state_dir: str | Path,
        writable_items: Iterable[str] = (),
        privileged: bool = True,
        clock: Callable[[], float] = time.time,
        counter_clock: Callable[[], float] | None = None,
    ) -> None:
        self.profile = load_profile(profile)
        self.state_dir = Path(state_dir)
        self.write_guard = WriteGuard(writable_items)
        self.privileged = privileged
        self._clock = clock
        self._counter_clock = counter_clock
        self._cond = threading.Condition(threading.RLock())
        self._init_count = 0
        self._file = StateFile(self.profile, self.state_dir)
        self._gpm_previous = {}
        with self._cond:
            self._file.refresh()

    # -- library --------------------------------------------------------------------------

    def init(self) -> None:
        self._hang(None, "init")
        with self._cond:
            self._file.refresh()
            kind = self._state.fail_calls.get("init")
            if kind is not None:
                raise sim_error(kind, "injected failure of init", None, "init")
            self._init_count += 1

    def shutdown(self) -> None:
        with self._cond:
            self._init_count = max(0, self._init_count - 1)

    def driver_version(self) -> str:
        with self._library("driver_version"):
            return self.profile.driver_version

    def cuda_driver_version(self) -> int:
        with self._library("cuda_driver_version"):
            return self.profile.cuda_driver_version

    def device_count(self) -> int:
        with self._library("device_count"):
            # Lost GPUs still count until the driver reloads, as with NVML.
            return len(self.profile.models)

    # -- events ---------------------------------------------------------------------------

    def wait_events(self, timeout_seconds: float) -> list[GpuEvent]:
        self._hang(None, "wait_events")
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            while True:
                self._file.refresh()
                self._library_checks("wait_events")
                lost = next((i for i, g in enumerate(self._state.gpus) if g.lost and not g.lost_reported), None)
                if lost is not None or self._state.events:
                    return self._take_events(lost)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                # In-process injections notify; another process's only show in the file, so poll it.
                self._cond.wait(min(_POLL_SECONDS, remaining))

    def _take_events(self, lost: int | None) -> list[GpuEvent]:
        if lost is not None:
            with self._mutation() as machine:
                machine.gpus[lost].lost_reported = True
            raise sim_error(GpuErrorKind.GPU_LOST, "GPU has fallen off the bus", lost, "wait_events")
        with self._mutation() as machine:
            events, machine.events = machine.events, []
        return events
