"""The backend session: the NVML library opened in the library lane, reopened when the driver
went away, the NVML event wait that lives as long as it, and the write guard.

nvmlInit runs in the library lane: on a wedged driver it can hang, and the loop must not. A
missing driver is retried every loop, never fatal. After a driver reload or upgrade the old
session answers DRIVER_NOT_LOADED, VERSION_MISMATCH or UNINITIALIZED for good: every part that
meets such an answer reports it (`note_fault`), and at the end of the loop the session is closed
so that the next loop runs nvmlInit again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from agent.backend import open_backend
from agent.backend.base import GpuBackend, GpuEvent, WriteGuard
from agent.backend.errors import NO_DRIVER_KINDS, GpuError, GpuErrorKind
from agent.config import AgentConfig
from agent.daemon.bounded import BoundedRunner, StaleGpu
from agent.logs import get_logger
from agent.state import CollectorStatus
from agent.watch.nvml_events import NvmlEventSource

log = get_logger()

#: Errors meaning the NVML session itself is gone (driver unloaded or reloaded, library and kernel
#: module now differ after an upgrade): only a fresh nvmlInit can recover, so the backend is reopened.
LIBRARY_FAULT_KINDS = NO_DRIVER_KINDS | {GpuErrorKind.UNINITIALIZED}
_LIBRARY_FAULT_VALUES = frozenset(kind.value for kind in LIBRARY_FAULT_KINDS)

#: Where a reading failed, and how (`BackendSession.note_fault`): the session judges whether NVML is gone.
FaultSink = Callable[[str, GpuErrorKind | str], None]


class BackendSession:
    def __init__(self, runner: BoundedRunner, on_event: Callable[[GpuEvent], None]) -> None:
        self.runner = runner
        self.on_event = on_event
        self.backend: GpuBackend | None = None
        self.error: GpuError | None = None  # why there is no backend now (None while one is open)
        self._opening: Future[GpuBackend] | None = None  # an open_backend still running in the library lane
        self._faults: list[str] = []  # this loop's evidence that the NVML session is gone
        self._events: NvmlEventSource | None = None
        self._driver_version: str | None = None  # of the open session

    def begin_loop(self, config: AgentConfig, wait_seconds: float) -> GpuBackend | None:
        """A loop starts: the open backend, opened first if needed; None while it cannot be opened."""
        self._faults = []
        if self.backend is not None:
            return self.backend
        try:
            if self._opening is None:
                self._opening = self.runner.submit("library", partial(open_backend, config))
            backend = self.runner.result("library", self._opening, wait_seconds)
        except StaleGpu as exc:
            self._unavailable(
                GpuError(GpuErrorKind.TIMEOUT, f"opening the GPU backend has not returned ({exc})", call="init")
            )
            return None
        except GpuError as exc:
            self._opening = None
            self._unavailable(exc)
            return None
        self._opening = None
        # An open started before a reload was built with the old mode's guard: this config's guard wins.
        backend.write_guard = WriteGuard(config.writable_items())
        self.backend = backend
        self.error = None
        self._events = NvmlEventSource(backend, self.on_event, self._on_lost)
        self._events.start()
        log.info("GPU backend open", backend=config.backend, driver=self.driver_version())
        return backend

    def set_writable(self, writable_items: frozenset[str]) -> None:
        """A reload changed what may be written: from now on every setter asks the new guard."""
        if self.backend is not None:
            self.backend.write_guard = WriteGuard(writable_items)

    def note_fault(self, where: str, kind: GpuErrorKind | str) -> None:
        """An answer seen this loop; one that says the NVML session is gone closes it at `end_loop`."""
        value = kind.value if isinstance(kind, GpuErrorKind) else kind
        if value in _LIBRARY_FAULT_VALUES:
            self._faults.append(f"{where}: {value}")

    def end_loop(self) -> bool:
        """Close the session if this loop saw it gone (the next loop opens a fresh one); True if closed."""
        if not self._faults:
            return False
        log.error("NVML session lost (driver unloaded, reloaded or upgraded): re-initialising", seen=self._faults)
        self.close()
        self.error = GpuError(GpuErrorKind.UNINITIALIZED, "re-initialising NVML: " + self._faults[0])
        return True

    def close(self) -> None:
        if self._events is not None:
            self._events.stop()
            self._events = None
        backend = self.backend
        if backend is not None:
            with contextlib.suppress(GpuError, StaleGpu):
                self.runner.run("library", backend.shutdown)
        self.backend = None
        self._driver_version = None

    def driver_version(self) -> str | None:
        """The open session's driver version, read once: a new driver comes with a new session
        (the old one answers VERSION_MISMATCH and is reopened), so it is not asked every loop."""
        if self.backend is None:
            return None
        if self._driver_version is None:
            try:
                self._driver_version = self.runner.run("library", self.backend.driver_version)
            except (GpuError, StaleGpu):
                return None
        return self._driver_version

    def statuses(self) -> list[CollectorStatus]:
        """The NVML event wait while the session is open; the backend itself while it is not."""
        found: list[CollectorStatus] = []
        if self._events is not None:
            ok, detail = self._events.status()
            found.append(CollectorStatus("xid_nvml", ok, 0.0, "" if ok else detail))
        if self.error is not None:
            found.append(CollectorStatus("backend", False, 0.0, str(self.error)))
        return found

    def _unavailable(self, exc: GpuError) -> None:
        if self.error is None or self.error.kind != exc.kind:
            log.error("GPU backend unavailable; retrying every loop", error=str(exc), kind=exc.kind.value)
        self.error = exc

    @staticmethod
    def _on_lost(error: GpuError) -> None:
        log.warning("nvml event wait reports a lost GPU", gpu=error.gpu, error=str(error))
