"""`NvmlBackend`: the NVML session (init, shutdown, the GPU reset that restarts it) and the parts it
is composed of: `reads`, `profiling`, `events`, `setters`, all calling NVML through `calls`.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterable
from typing import Any

from agent.backend.base import ClockDomain, WriteGuard
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.nvml.events import EventWait
from agent.backend.nvml.profiling import ProfilingReads
from agent.backend.nvml.reads import DeviceReads
from agent.backend.nvml.setters import DeviceSetters
from agent.host.processes import run_process

# nvidia-smi --gpu-reset takes seconds; a reset that hangs is a fault of its own.
_RESET_TIMEOUT_SECONDS = 120.0


def _reset_error(output: str, gpu: int, call: str) -> GpuError:
    """A failed nvidia-smi --gpu-reset as a GpuError, from the words nvidia-smi prints."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    text = output.lower()
    if "in use" in text or "being used" in text:
        message = "GPU is held by another client (persistence mode, DCGM, a monitor or an application)"
        return GpuError(GpuErrorKind.IN_USE, message, gpu=gpu, call=call)
    if "insufficient permissions" in text or "root" in text:
        return GpuError(GpuErrorKind.NO_PERMISSION, "permission denied: a GPU reset needs root", gpu=gpu, call=call)
    if "not supported" in text:
        return GpuError(GpuErrorKind.NOT_SUPPORTED, "GPU reset is not supported on this GPU", gpu=gpu, call=call)
    detail = lines[0] if lines else "no output"
    return GpuError(GpuErrorKind.UNKNOWN, f"GPU reset failed: {detail}", gpu=gpu, call=call)


class NvmlBackend(DeviceReads, ProfilingReads, EventWait, DeviceSetters):
    """GpuBackend over NVML. Devices are addressed by NVML index.

    Setters first ask the WriteGuard built from `writable_items`, so a setter for an item in
    observe mode raises WriteRefused before any NVML call is made.
    """

    name = "nvml"

    def __init__(self, writable_items: Iterable[str] = ()) -> None:
        self.write_guard = WriteGuard(writable_items)
        self._initialised = False
        self._handles: dict[int, Any] = {}
        self._unlocked_ranges: dict[tuple[int, ClockDomain], tuple[int, int]] = {}
        self._event_set: Any = None
        self._event_gpu_by_address: dict[int, int] = {}
        # Held while waiting for events, so the set is never freed (shutdown, reset) mid-wait.
        self._event_lock = threading.Lock()
        self._gpm_supported: dict[int, bool] = {}
        self._gpm_samples: dict[int, Any] = {}  # the previous loop's GPM sample per GPU
        self._gpm_spare: dict[int, Any] = {}  # the other buffer, sampled into next
        self._unsupported_fields: dict[int, set[int]] = {}  # field ids a GPU answered NOT_SUPPORTED
        self._nvlink_counts: dict[int, int] = {}
        self._memory_v1_only: set[int] = set()  # GPUs whose driver has no nvmlDeviceGetMemoryInfo_v2

    def _forget_device_state(self) -> None:
        self._free_gpm_samples()
        self._gpm_supported.clear()
        self._unsupported_fields.clear()
        self._nvlink_counts.clear()
        self._memory_v1_only.clear()
        self._handles.clear()
        self._unlocked_ranges.clear()
        self._event_set = None
        self._event_gpu_by_address.clear()

    # -- library -------------------------------------------------------------------------------

    def init(self) -> None:
        """nvmlInit. Raises GpuError(LIBRARY_NOT_FOUND | DRIVER_NOT_LOADED | VERSION_MISMATCH | ...)."""
        if self._initialised:
            return
        self._call(None, "nvmlInit")
        self._forget_device_state()
        self._initialised = True

    def shutdown(self) -> None:
        """nvmlShutdown; a second call (or one without init) does nothing.

        Waits for a wait_events call in progress to return (at most its timeout).
        """
        with self._event_lock:
            if not self._initialised:
                return
            self._initialised = False
            event_set = self._event_set
            self._forget_device_state()
            if event_set is not None:
                self._free_event_set(event_set)
            self._call(None, "nvmlShutdown")

    def reset_gpu(self, gpu: int) -> None:
        """nvidia-smi --gpu-reset -i BUS_ID: NVML has no public reset call.

        Refused (IN_USE) while NVML lists compute processes on the GPU. nvidia-smi also refuses
        while any other client holds the device: persistence mode (nvidia-persistenced),
        DCGM, another monitor, and this process's own NVML session, which is therefore shut
        down for the reset and started again afterwards (also when the reset fails), so other
        threads' NVML calls fail with UNINITIALIZED meanwhile. Settings return to defaults:
        the caller re-applies the policy.
        """
        call = "nvidia-smi --gpu-reset"
        self.write_guard.check("reset_gpu")
        pids = [process.pid for process in self.compute_processes(gpu)]
        if pids:
            message = f"processes {pids} are using the GPU; stop them first"
            raise GpuError(GpuErrorKind.IN_USE, message, gpu=gpu, call=call)
        bus_id = str(self._device(gpu, "nvmlDeviceGetPciInfo").busId)
        nvidia_smi = shutil.which("nvidia-smi")
        if nvidia_smi is None:
            raise GpuError(GpuErrorKind.NOT_SUPPORTED, "nvidia-smi not found: a GPU reset needs it", gpu=gpu, call=call)
        self.shutdown()
        try:
            result = run_process([nvidia_smi, "--gpu-reset", "-i", bus_id], _RESET_TIMEOUT_SECONDS)
        finally:
            self.init()
        if result.timed_out:
            message = f"nvidia-smi --gpu-reset did not finish in {_RESET_TIMEOUT_SECONDS:g} s"
            raise GpuError(GpuErrorKind.TIMEOUT, message, gpu=gpu, call=call)
        if result.returncode != 0:
            raise _reset_error(result.output, gpu, call)
