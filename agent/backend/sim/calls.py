"""How every call of the simulated backend reaches a GPU: the checks NVML makes, in its order.

`SimCalls` is the plumbing the protocol's parts (`reads`, `profiling`, `setters`, `backend`)
share: a library call needs init() and no injected failure; a per-GPU call also a valid index, a
GPU on the bus and not waiting for a reset; a setter first the write guard, then root. Injected
hangs sleep outside the lock, so a hung call does not freeze the other threads' calls. The
backend's constructor sets the attributes declared here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from agent.backend.base import WriteGuard
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.sim.physics import Readings, advance
from agent.backend.sim.profiles import NodeProfile
from agent.backend.sim.state import MachineState, StateFile


def sim_error(kind: GpuErrorKind, message: str, gpu: int | None, call: str) -> GpuError:
    return GpuError(kind, message, gpu=gpu, call=call)


class SimCalls:
    """The call checks and the shared state file of one SimulatedBackend."""

    profile: NodeProfile
    write_guard: WriteGuard
    privileged: bool
    _clock: Callable[[], float]
    _counter_clock: Callable[[], float] | None
    _cond: threading.Condition
    _init_count: int
    _file: StateFile

    @property
    def state_path(self) -> Path:
        return self._file.path

    @property
    def _state(self) -> MachineState:
        return self._file.state

    def _now_seconds(self) -> float:
        return self._clock()

    # -- time ---------------------------------------------------------------------------------
    # With a counter clock (the daemon, the demo, `inject`: CLOCK_MONOTONIC, which every process of
    # one boot shares) the counters grow as a GPU's do: energy, violation and reason durations, GPM.
    # Each change first settles the time passed at the readings that held until then; a read sees
    # the counters as of now without writing. Without one (tests) only advance() moves them.

    @staticmethod
    def _seconds_since_settled(machine: MachineState, now: float) -> float | None:
        """None when the state has no usable start: fresh, or from before the clock's epoch (a reboot)."""
        settled = machine.advanced_at_seconds
        return None if settled is None or now < settled else now - settled

    def _advance_all(self, machine: MachineState, seconds: float) -> None:
        for gpu, (model, state) in enumerate(zip(self.profile.models, machine.gpus)):
            if not state.lost:
                advance(Readings(model, state, self.profile.nvlink_links(gpu)), seconds)

    def _settle(self, machine: MachineState) -> None:
        if self._counter_clock is None:
            return
        now = self._counter_clock()
        seconds = self._seconds_since_settled(machine, now)
        if seconds:  # None: no usable start, the clock starts here
            self._advance_all(machine, seconds)
        machine.advanced_at_seconds = now

    def _as_of_now(self, dev: Readings) -> Readings:
        if self._counter_clock is None:
            return dev
        seconds = self._seconds_since_settled(self._state, self._counter_clock())
        if seconds is None:
            # The clock starts (again) here, written once. A reader that may not write the state
            # (another user's `status --direct`) answers from the settled counters now and keeps
            # the start in its own memory only.
            with contextlib.suppress(OSError), self._mutation():
                pass
            return dev
        if seconds == 0.0:
            return dev
        # a copy of what advance() changes; the rest is shared (the copy is never written back)
        counters = {"violation_ns": dict(dev.state.violation_ns), "reason_ns": dict(dev.state.reason_ns)}
        state = dev.state.model_copy(update={**counters, "gpm": dev.state.gpm.model_copy()})
        now = Readings(dev.model, state, dev.nvlink_links)
        advance(now, seconds)
        return now

    # -- state file -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _mutation(self) -> Iterator[MachineState]:
        """Lock, pick up other processes' changes, let the caller change the state, write it, wake waiters."""
        with self._cond, self._file.lock():
            self._file.refresh()
            self._settle(self._file.state)
            yield self._file.state
            self._file.save()
            self._cond.notify_all()

    def reload(self) -> bool:
        """Re-read the state file if another process changed it; True when it did."""
        with self._cond:
            return self._file.refresh()

    # -- checks ---------------------------------------------------------------------------

    def _check_index(self, gpu: int, call: str) -> None:
        if not 0 <= gpu < len(self.profile.models):
            raise sim_error(
                GpuErrorKind.INVALID_ARGUMENT, f"no GPU with index {gpu} ({len(self.profile.models)} GPUs)", gpu, call
            )

    def _hang_seconds(self, gpu: int | None, call: str) -> float:
        with self._cond:
            self._file.refresh()
            if gpu is not None and 0 <= gpu < len(self._state.gpus) and call in self._state.gpus[gpu].hang_calls:
                return self._state.gpus[gpu].hang_calls[call]
            return self._state.hang_calls.get(call, 0.0)

    def _hang(self, gpu: int | None, call: str) -> None:
        seconds = self._hang_seconds(gpu, call)
        if seconds > 0:
            # Outside the lock: a hung call must not freeze the other threads' calls.
            time.sleep(seconds)

    def _require_init(self, call: str) -> None:
        if self._init_count == 0:
            raise sim_error(GpuErrorKind.UNINITIALIZED, "NVML is not initialised (call init() first)", None, call)

    def _library_checks(self, call: str) -> None:
        self._require_init(call)
        kind = self._state.fail_calls.get(call)
        if kind is not None:
            raise sim_error(kind, f"injected failure of {call}", None, call)

    def _device(self, gpu: int, call: str) -> Readings:
        """The device for a per-GPU call, after the checks NVML makes (init, index, lost, reset, injected)."""
        self._require_init(call)
        self._check_index(gpu, call)
        state = self._state.gpus[gpu]
        if state.lost:
            raise sim_error(GpuErrorKind.GPU_LOST, "GPU has fallen off the bus", gpu, call)
        if state.reset_required and call != "identity":
            raise sim_error(GpuErrorKind.RESET_REQUIRED, "GPU requires reset", gpu, call)
        kind = state.fail_calls.get(call, self._state.fail_calls.get(call))
        if kind is not None:
            raise sim_error(kind, f"injected failure of {call}", gpu, call)
        return Readings(self.profile.models[gpu], state, self.profile.nvlink_links(gpu))

    def _check_writable(self, gpu: int, call: str, root_reason: str) -> None:
        """NVML order for a write: the agent's own guard, then root (the device's state comes after)."""
        self.write_guard.check(call)
        if not self.privileged:
            raise sim_error(GpuErrorKind.NO_PERMISSION, root_reason, gpu, call)

    def _check_fan(self, dev: Readings, gpu: int, fan: int | None, call: str) -> None:
        if dev.model.fan_count == 0:
            raise sim_error(GpuErrorKind.NOT_SUPPORTED, f"{dev.model.name} has no fans", gpu, call)
        if fan is not None and not 0 <= fan < dev.model.fan_count:
            raise sim_error(
                GpuErrorKind.INVALID_ARGUMENT, f"no fan {fan} (fans 0-{dev.model.fan_count - 1})", gpu, call
            )

    # -- the three kinds of call ------------------------------------------------------------

    @contextlib.contextmanager
    def _library(self, call: str) -> Iterator[None]:
        """A library-level call (driver version, device count, events)."""
        self._hang(None, call)
        with self._cond:
            self._file.refresh()
            self._library_checks(call)
            yield

    @contextlib.contextmanager
    def _read(self, gpu: int, call: str, counters: bool = False) -> Iterator[Readings]:
        """A per-GPU read; `counters`: the answer includes time-based counters, brought up to now."""
        self._hang(gpu, call)
        with self._cond:
            self._file.refresh()
            dev = self._device(gpu, call)
            yield self._as_of_now(dev) if counters else dev

    @contextlib.contextmanager
    def _write(self, gpu: int, call: str) -> Iterator[Readings]:
        self._check_writable(gpu, call, "insufficient permissions (setters need root)")
        self._hang(gpu, call)
        with self._mutation():
            yield self._device(gpu, call)
