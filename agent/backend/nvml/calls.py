"""How NVML is called: every call goes through `NvmlCalls._call`, which looks the function up on
the `pynvml` module at call time and turns every `pynvml.NVMLError` into a `GpuError` whose kind
comes from `classify` (the one place NVML return codes are interpreted).

Where NVML renamed or versioned a call, the modern name is tried first and the older one is used
when nvidia-ml-py lacks the new name or the driver lacks the symbol (NVML_ERROR_FUNCTION_NOT_FOUND).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pynvml

from agent.backend.base import ClockDomain, WriteGuard
from agent.backend.errors import GpuError, GpuErrorKind

_KIND_BY_CODE: dict[int, GpuErrorKind] = {
    pynvml.NVML_ERROR_UNINITIALIZED: GpuErrorKind.UNINITIALIZED,
    pynvml.NVML_ERROR_INVALID_ARGUMENT: GpuErrorKind.INVALID_ARGUMENT,
    pynvml.NVML_ERROR_NOT_SUPPORTED: GpuErrorKind.NOT_SUPPORTED,
    pynvml.NVML_ERROR_NO_PERMISSION: GpuErrorKind.NO_PERMISSION,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: GpuErrorKind.DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_TIMEOUT: GpuErrorKind.TIMEOUT,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: GpuErrorKind.LIBRARY_NOT_FOUND,
    # The driver predates the call: for the agent that is the same as a board without the feature.
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: GpuErrorKind.NOT_SUPPORTED,
    pynvml.NVML_ERROR_GPU_IS_LOST: GpuErrorKind.GPU_LOST,
    pynvml.NVML_ERROR_RESET_REQUIRED: GpuErrorKind.RESET_REQUIRED,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: GpuErrorKind.VERSION_MISMATCH,
    pynvml.NVML_ERROR_IN_USE: GpuErrorKind.IN_USE,
}

# One line each, in words an operator acts on; GpuError adds "GPU n: " and the call name.
_MESSAGE_BY_CODE: dict[int, str] = {
    pynvml.NVML_ERROR_UNINITIALIZED: "NVML is not initialised (init() was not called or shutdown() already ran)",
    pynvml.NVML_ERROR_INVALID_ARGUMENT: "NVML rejected an argument (no such device, or a value out of range)",
    pynvml.NVML_ERROR_NOT_SUPPORTED: "not supported on this GPU",
    pynvml.NVML_ERROR_NO_PERMISSION: "permission denied: changing GPU settings needs root",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "NVIDIA driver not loaded (the nvidia kernel module is not running): is the driver installed?"
    ),
    pynvml.NVML_ERROR_TIMEOUT: "the NVML call timed out",
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "NVIDIA driver not loaded (libnvidia-ml.so.1 not found): is the driver installed?"
    ),
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: "not supported by this NVIDIA driver (NVML function missing: driver too old)",
    pynvml.NVML_ERROR_GPU_IS_LOST: "GPU has fallen off the bus or is otherwise inaccessible",
    pynvml.NVML_ERROR_RESET_REQUIRED: "GPU needs a reset (or a reboot) before it can be used again",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "NVIDIA library and kernel module versions differ (driver upgraded but not reloaded): reboot or reload nvidia"
    ),
    pynvml.NVML_ERROR_IN_USE: "GPU is in use by another process",
}

ENABLED: int = pynvml.NVML_FEATURE_ENABLED
DISABLED: int = pynvml.NVML_FEATURE_DISABLED

#: (set, reset) call per lockable domain: NVML locks the graphics (GPC) and the memory clock.
_LOCK_CALLS: dict[ClockDomain, tuple[str, str]] = {
    ClockDomain.GRAPHICS: ("nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks"),
    ClockDomain.MEMORY: ("nvmlDeviceSetMemoryLockedClocks", "nvmlDeviceResetMemoryLockedClocks"),
}


def classify(exc: pynvml.NVMLError) -> GpuErrorKind:
    """The GpuErrorKind for an NVML error; codes the agent has no use for are UNKNOWN."""
    return _KIND_BY_CODE.get(exc.value, GpuErrorKind.UNKNOWN)


def to_gpu_error(exc: pynvml.NVMLError, gpu: int | None, call: str) -> GpuError:
    """`exc` as a GpuError with a one-line message (never traceback text)."""
    message = _MESSAGE_BY_CODE.get(exc.value)
    if message is None:
        detail = " ".join(str(exc).split())
        message = f"unexpected NVML error {exc.value} ({detail})"
    return GpuError(classify(exc), message, gpu=gpu, call=call)


def lock_calls(gpu: int, domain: ClockDomain) -> tuple[str, str]:
    """(set, reset) NVML calls for locking `domain`; SM clocks follow the graphics lock."""
    calls = _LOCK_CALLS.get(domain)
    if calls is None:
        raise GpuError(
            GpuErrorKind.INVALID_ARGUMENT,
            f"{domain.name} clocks cannot be locked (only GRAPHICS and MEMORY)",
            gpu=gpu,
        )
    return calls


class NvmlCalls:
    """The one way NVML is called, device handles, and the library-level calls; the backend's
    constructor sets the attributes declared here."""

    write_guard: WriteGuard
    _handles: dict[int, Any]

    def _call(self, gpu: int | None, name: str, *args: Any) -> Any:
        """pynvml.<name>(*args); NVMLError becomes GpuError(kind, message, gpu, call=name)."""
        return self._call_first(gpu, (name,), *args)

    def _call_first(self, gpu: int | None, names: Sequence[str], *args: Any) -> Any:
        """The first of `names` that this nvidia-ml-py and this driver both have (newest first)."""
        available = [name for name in names if hasattr(pynvml, name)]
        if not available:
            raise GpuError(
                GpuErrorKind.NOT_SUPPORTED,
                f"this nvidia-ml-py has no {' or '.join(names)}: upgrade nvidia-ml-py",
                gpu=gpu,
                call=names[0],
            )
        for name in available[:-1]:
            try:
                return getattr(pynvml, name)(*args)
            except pynvml.NVMLError as exc:
                if exc.value != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise to_gpu_error(exc, gpu, name) from exc
        try:
            return getattr(pynvml, available[-1])(*args)
        except pynvml.NVMLError as exc:
            raise to_gpu_error(exc, gpu, available[-1]) from exc

    def _handle(self, gpu: int) -> Any:
        handle = self._handles.get(gpu)
        if handle is None:
            handle = self._call(gpu, "nvmlDeviceGetHandleByIndex", gpu)
            self._handles[gpu] = handle
        return handle

    def _device(self, gpu: int, name: str, *args: Any) -> Any:
        """A per-device call: pynvml.<name>(handle of gpu, *args)."""
        return self._call(gpu, name, self._handle(gpu), *args)

    def _fan_call(self, gpu: int, fan: int | None, name: str, *args: Any) -> Any:
        """A fan call; a fan-less board answers NOT_SUPPORTED like the other missing features.

        NVML answers INVALID_ARGUMENT for a fan index the board lacks, so on an SXM H200
        (no fans) every _v2 fan call does that (read on a real one); only the fan count says why.
        """
        try:
            return self._device(gpu, name, *args)
        except GpuError as exc:
            if exc.kind is not GpuErrorKind.INVALID_ARGUMENT:
                raise
            fans = int(self._device(gpu, "nvmlDeviceGetNumFans"))
            if fans == 0:
                raise GpuError(GpuErrorKind.NOT_SUPPORTED, "this GPU has no fans", gpu=gpu, call=name) from exc
            if fan is not None and fan >= fans:
                message = f"no fan {fan}: this GPU has {fans}"
                raise GpuError(GpuErrorKind.INVALID_ARGUMENT, message, gpu=gpu, call=name) from exc
            raise

    def driver_version(self) -> str:
        """nvidia-smi --query-gpu=driver_version"""
        return str(self._call(None, "nvmlSystemGetDriverVersion"))

    def cuda_driver_version(self) -> int:
        """nvidia-smi -q: CUDA Version"""
        return int(self._call(None, "nvmlSystemGetCudaDriverVersion"))

    def device_count(self) -> int:
        """nvidia-smi --query-gpu=count"""
        return int(self._call(None, "nvmlDeviceGetCount"))
