"""Xid and ECC events from NVML: one event set, made on first use, that every device able to report
them is registered with.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Any

import pynvml

from agent.backend.base import GpuEvent, GpuEventKind
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.nvml.calls import NvmlCalls

_EVENT_KINDS: dict[int, GpuEventKind] = {
    pynvml.nvmlEventTypeXidCriticalError: GpuEventKind.XID,
    pynvml.nvmlEventTypeSingleBitEccError: GpuEventKind.SINGLE_BIT_ECC,
    pynvml.nvmlEventTypeDoubleBitEccError: GpuEventKind.DOUBLE_BIT_ECC,
}
_EVENT_MASK = (
    pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
)

# A storm of ECC events must not keep one wait_events call draining forever.
_MAX_EVENTS_PER_WAIT = 256


def _address(handle: Any) -> int:
    """The address an NVML device handle points at: ctypes pointers to one device compare unequal."""
    value = ctypes.cast(handle, ctypes.c_void_p).value
    return int(value) if value is not None else 0


class EventWait(NvmlCalls):
    """The protocol's wait_events."""

    _event_set: Any
    _event_gpu_by_address: dict[int, int]
    _event_lock: threading.Lock  # held while waiting, so the set is never freed (shutdown, reset) mid-wait

    def wait_events(self, timeout_seconds: float) -> list[GpuEvent]:
        """Block up to timeout for Xid/ECC events on all GPUs; [] when quiet.

        The event set is made on first use and holds every device that supports any of Xid,
        single-bit and double-bit ECC events (devices answering NOT_SUPPORTED, or already lost,
        are left out). Events already queued when the first one arrives come back in the same
        call (up to 256; the rest wait for the next call). Raises GpuError(GPU_LOST) when a
        device falls off the bus while waiting, and GpuError(NOT_SUPPORTED) when no device has
        these events. Meant for one watcher thread.
        """
        with self._event_lock:
            event_set = self._events()
            events: list[GpuEvent] = []
            wait_ms = max(0, round(timeout_seconds * 1000))
            while len(events) < _MAX_EVENTS_PER_WAIT:
                try:
                    data = self._call(None, "nvmlEventSetWait_v2", event_set, wait_ms)
                except GpuError as exc:
                    if exc.kind is GpuErrorKind.TIMEOUT:
                        return events
                    raise
                kind = _EVENT_KINDS.get(int(data.eventType))
                gpu = self._event_gpu_by_address.get(_address(data.device))
                if kind is not None and gpu is not None:
                    event = GpuEvent(gpu=gpu, kind=kind, data=int(data.eventData), timestamp_seconds=time.time())
                    events.append(event)
                wait_ms = 0
            return events

    def _events(self) -> Any:
        """The event set, created and registered on first use."""
        if self._event_set is not None:
            return self._event_set
        event_set = self._call(None, "nvmlEventSetCreate")
        try:
            gpu_by_address = self._register_events(event_set)
        except GpuError:
            self._free_event_set(event_set)
            raise
        if not gpu_by_address:
            self._free_event_set(event_set)
            raise GpuError(
                GpuErrorKind.NOT_SUPPORTED, "no GPU supports Xid/ECC events", call="nvmlDeviceRegisterEvents"
            )
        self._event_set = event_set
        self._event_gpu_by_address = gpu_by_address
        return event_set

    def _register_events(self, event_set: Any) -> dict[int, int]:
        """Register every device that can; the map from handle address to index that events need."""
        gpu_by_address: dict[int, int] = {}
        for gpu in range(self.device_count()):
            try:
                handle = self._handle(gpu)
                mask = _EVENT_MASK & int(self._device(gpu, "nvmlDeviceGetSupportedEventTypes"))
                if mask:
                    self._call(gpu, "nvmlDeviceRegisterEvents", handle, mask, event_set)
                    gpu_by_address[_address(handle)] = gpu
            except GpuError as exc:
                # A lost GPU is the gpu_lost watcher's news; it must not blind the others' events.
                if exc.kind not in (GpuErrorKind.NOT_SUPPORTED, GpuErrorKind.GPU_LOST):
                    raise
        return gpu_by_address

    def _free_event_set(self, event_set: Any) -> None:
        # nvmlShutdown releases the set with the library anyway; a failed free (a lost GPU, say)
        # must not stop a shutdown or hide the error that led here.
        with contextlib.suppress(GpuError):
            self._call(None, "nvmlEventSetFree", event_set)
