"""Follow the NVML event set (Xid and ECC events) on a thread: ``backend.wait_events`` in a loop.

``wait_events`` blocks up to ``timeout_seconds`` and returns [] when quiet, so the thread notices
``stop()`` within about one timeout. A GPU falling off the bus surfaces here first, as
GpuError(GPU_LOST) from the wait: it goes to ``on_lost`` and the loop goes on after a pause (the other
GPUs still report). Any other failure (driver gone, library not initialised) is logged once per
distinct message and retried with a growing pause; ``status()`` reports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from agent.backend.base import GpuBackend, GpuEvent
from agent.backend.errors import GpuError, GpuErrorKind
from agent.logs import get_logger

log = get_logger()
T = TypeVar("T")

BACKOFF_SECONDS = 1.0
# A driver that stays away is retried at this pace, not hammered once a second.
ERROR_BACKOFF_MAX_SECONDS = 30.0


class NvmlEventSource:
    """A thread feeding NVML events to ``sink`` and lost-GPU errors to ``on_lost``; ``start()``/``stop()``."""

    def __init__(
        self,
        backend: GpuBackend,
        sink: Callable[[GpuEvent], object],
        on_lost: Callable[[GpuError], object],
        timeout_seconds: float = 0.5,
        backoff_seconds: float = BACKOFF_SECONDS,
    ) -> None:
        if timeout_seconds <= 0 or backoff_seconds <= 0:
            raise ValueError("timeout_seconds and backoff_seconds must be positive")
        self._backend = backend
        self._sink = sink
        self._on_lost = on_lost
        self._timeout_seconds = timeout_seconds
        self._backoff_seconds = backoff_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self._ok = False
        self._detail = "not started"

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("NvmlEventSource already started")
        self._thread = threading.Thread(target=self._run, name="xid-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and join; returns within about one wait timeout (an NVML call cannot be interrupted)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._timeout_seconds + 1.0)

    def status(self) -> tuple[bool, str]:
        """(ok, detail): ok while waits succeed (a lost GPU does not make the source itself fail)."""
        with self._state_lock:
            return self._ok, self._detail

    def _set_status(self, ok: bool, detail: str) -> None:
        with self._state_lock:
            self._ok, self._detail = ok, detail

    def _run(self) -> None:
        error_backoff_seconds = self._backoff_seconds
        last_error = ""
        while not self._stop.is_set():
            try:
                events = self._backend.wait_events(self._timeout_seconds)
            except GpuError as exc:
                if exc.kind is GpuErrorKind.GPU_LOST:
                    self._set_status(True, f"waiting for NVML events ({exc})")
                    log.warning("NVML event wait: GPU lost", gpu=exc.gpu, error=str(exc))
                    _deliver(self._on_lost, exc)
                    self._stop.wait(self._backoff_seconds)
                    continue
                if exc.kind is GpuErrorKind.TIMEOUT:
                    continue  # a quiet wait, as some drivers report it
                message = str(exc)
                if message != last_error:
                    log.warning("NVML event wait failed; retrying", error=message, retry_seconds=error_backoff_seconds)
                    last_error = message
                self._set_status(False, f"NVML event wait failed: {message}")
                self._stop.wait(error_backoff_seconds)
                error_backoff_seconds = min(error_backoff_seconds * 2, ERROR_BACKOFF_MAX_SECONDS)
                continue
            except Exception as exc:  # a backend bug must not end Xid watching for good
                log.exception("NVML event wait raised")
                self._set_status(False, f"NVML event wait raised: {exc!r}")
                self._stop.wait(error_backoff_seconds)
                error_backoff_seconds = min(error_backoff_seconds * 2, ERROR_BACKOFF_MAX_SECONDS)
                continue
            if last_error:
                log.info("NVML event wait works again")
                last_error = ""
            error_backoff_seconds = self._backoff_seconds
            self._set_status(True, "waiting for NVML events")
            for event in events:
                _deliver(self._sink, event)


def _deliver(consumer: Callable[[T], object], item: T) -> None:
    try:
        consumer(item)
    except Exception:  # a failing consumer must not stop the event thread
        log.exception("NVML event consumer failed")
