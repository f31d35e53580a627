"""The NVML backend: the only module that imports `pynvml` (package nvidia-ml-py).

Every NVML call goes through `NvmlBackend._call`, which looks the function up on the
`pynvml` module at call time and turns every `pynvml.NVMLError` into a `GpuError` whose
kind comes from `classify` (the one place NVML return codes are interpreted). Units are
converted here, at the boundary: NVML's milliwatts become watts; MHz, Celsius, percent,
bytes and nanoseconds pass through unchanged.

Where NVML renamed or versioned a call, the modern name is tried first and the older one
is used when nvidia-ml-py lacks the new name or the driver lacks the symbol
(NVML_ERROR_FUNCTION_NOT_FOUND), so one agent build runs on old and new drivers alike.

The one thing NVML cannot do, a GPU reset, runs `nvidia-smi --gpu-reset` (reset_gpu).
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import pynvml

from agent.backend.base import (
    ClockDomain,
    EccCounter,
    EccErrorType,
    EnabledPending,
    FabricInfo,
    FabricState,
    FastFields,
    GpmActivity,
    GpuEvent,
    GpuEventKind,
    GpuIdentity,
    GpuProcess,
    MemoryInfo,
    NvLinkErrors,
    PcieLink,
    RemappedRows,
    SlowFields,
    TemperatureThreshold,
    Utilization,
    ViolationPolicy,
    WriteGuard,
)
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

_ENABLED: int = pynvml.NVML_FEATURE_ENABLED
_DISABLED: int = pynvml.NVML_FEATURE_DISABLED
_MIG_ENABLED: int = pynvml.NVML_DEVICE_MIG_ENABLE
_FAN_MANUAL: int = pynvml.NVML_FAN_POLICY_MANUAL

_EVENT_KINDS: dict[int, GpuEventKind] = {
    pynvml.nvmlEventTypeXidCriticalError: GpuEventKind.XID,
    pynvml.nvmlEventTypeSingleBitEccError: GpuEventKind.SINGLE_BIT_ECC,
    pynvml.nvmlEventTypeDoubleBitEccError: GpuEventKind.DOUBLE_BIT_ECC,
}
_EVENT_MASK = (
    pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
)

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: field ids are fixed in nvml.h; older nvidia-ml-py lack the name.
_FIELD_RECOVERY_ACTION = 230

# Field ids are fixed in nvml.h (older nvidia-ml-py lack some names).
_FIELD_MEMORY_TEMP = 82  # NVML_FI_DEV_MEMORY_TEMP, Celsius
_FIELD_TOTAL_ENERGY = 83  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, mJ
_FIELD_POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT, mW
_FIELD_PCIE_CORRECTABLE = 173  # NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS
_FIELD_PCIE_FATAL = 180  # NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR
#: NVML_FI_DEV_CLOCKS_EVENT_REASON_* (ns the reason held the clocks), by VIOLATION_REASONS label.
_VIOLATION_FIELDS: dict[str, int] = {
    "sw_power_cap": 74,  # = NVML_FI_DEV_PERF_POLICY_POWER
    "sync_boost": 76,  # = NVML_FI_DEV_PERF_POLICY_SYNC_BOOST
    "sw_thermal": 269,
    "hw_thermal": 270,
    "hw_power_brake": 271,
}
#: NVML_FI_DEV_NVLINK_<COUNTER>_ERROR_COUNT_L<n>: links 0-5 and 6-11 each number consecutively.
#: nvml.h names per-link ids for links 0-11 only; later links (12-17 on an H200 SXM) have state, not counters.
_NVLINK_FIELD_START: dict[str, tuple[int, int]] = {
    "crc_flit": (32, 96),
    "crc_data": (39, 102),
    "replay": (46, 108),
    "recovery": (53, 114),
}
_NVLINK_COUNTED_LINKS = 12
#: An unknown field id answers INVALID_ARGUMENT in its own nvmlReturn on older drivers.
_FIELD_ABSENT = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT})

#: nvmlGpmMetricId_t of each GpmActivity reading; NVML gives percent and MiB/s.
_GPM_METRICS: dict[str, int] = {
    "sm_active_ratio": 2,  # NVML_GPM_METRIC_SM_UTIL
    "sm_occupancy_ratio": 3,  # NVML_GPM_METRIC_SM_OCCUPANCY
    "tensor_active_ratio": 5,  # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    "dram_active_ratio": 10,  # NVML_GPM_METRIC_DRAM_BW_UTIL
    "pcie_tx_bytes_per_second": 20,  # NVML_GPM_METRIC_PCIE_TX_PER_SEC
    "pcie_rx_bytes_per_second": 21,  # NVML_GPM_METRIC_PCIE_RX_PER_SEC
    "nvlink_tx_bytes_per_second": 61,  # NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
    "nvlink_rx_bytes_per_second": 60,  # NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
}
_MIB = 1 << 20

# nvidia-smi --gpu-reset takes seconds; a reset that hangs is a fault of its own.
_RESET_TIMEOUT_SECONDS = 120.0

# A storm of ECC events must not keep one wait_events call draining forever.
_MAX_EVENTS_PER_WAIT = 256

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


def _field_number(field: Any) -> float:
    """The value of one nvmlFieldValue_t, read through the member its valueType names."""
    member = {
        pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }.get(int(field.valueType), "uiVal")
    return float(getattr(field.value, member))


def _address(handle: Any) -> int:
    """The address an NVML device handle points at: ctypes pointers to one device compare unequal."""
    value = ctypes.cast(handle, ctypes.c_void_p).value
    return int(value) if value is not None else 0


class NvmlBackend:
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

    # -- the one way NVML is called ------------------------------------------------------------

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

    def driver_version(self) -> str:
        """nvidia-smi --query-gpu=driver_version"""
        return str(self._call(None, "nvmlSystemGetDriverVersion"))

    def cuda_driver_version(self) -> int:
        """nvidia-smi -q: CUDA Version"""
        return int(self._call(None, "nvmlSystemGetCudaDriverVersion"))

    def device_count(self) -> int:
        """nvidia-smi --query-gpu=count"""
        return int(self._call(None, "nvmlDeviceGetCount"))

    def identity(self, gpu: int) -> GpuIdentity:
        """nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,serial,vbios_version

        `serial` is "" on boards that do not report one (NOT_SUPPORTED, e.g. GeForce).
        """
        try:
            serial = str(self._device(gpu, "nvmlDeviceGetSerial"))
        except GpuError as exc:
            if exc.kind is not GpuErrorKind.NOT_SUPPORTED:
                raise
            serial = ""
        return GpuIdentity(
            index=gpu,
            uuid=str(self._device(gpu, "nvmlDeviceGetUUID")),
            name=str(self._device(gpu, "nvmlDeviceGetName")),
            pci_bus_id=str(self._device(gpu, "nvmlDeviceGetPciInfo").busId),
            serial=serial,
            vbios_version=str(self._device(gpu, "nvmlDeviceGetVbiosVersion")),
            minor_number=int(self._device(gpu, "nvmlDeviceGetMinorNumber")),
        )

    # -- hot readings --------------------------------------------------------------------------

    def temperature_celsius(self, gpu: int) -> int:
        """nvidia-smi --query-gpu=temperature.gpu"""
        handle = self._handle(gpu)
        names = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
        return int(self._call_first(gpu, names, handle, pynvml.NVML_TEMPERATURE_GPU))

    def power_usage_watts(self, gpu: int) -> float:
        """nvidia-smi --query-gpu=power.draw (NVML: milliwatts)"""
        return int(self._device(gpu, "nvmlDeviceGetPowerUsage")) / 1000.0

    def clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        """nvidia-smi --query-gpu=clocks.gr,clocks.sm,clocks.mem"""
        return int(self._device(gpu, "nvmlDeviceGetClockInfo", int(domain)))

    def clock_event_reasons(self, gpu: int) -> int:
        """Bit mask, nvidia-smi --query-gpu=clocks_event_reasons.active (older: clocks_throttle_reasons.active)"""
        names = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        return int(self._call_first(gpu, names, self._handle(gpu)))

    def utilization(self, gpu: int) -> Utilization:
        """nvidia-smi --query-gpu=utilization.gpu,utilization.memory"""
        rates = self._device(gpu, "nvmlDeviceGetUtilizationRates")
        return Utilization(gpu_percent=int(rates.gpu), memory_percent=int(rates.memory))

    def memory_info(self, gpu: int) -> MemoryInfo:
        """nvidia-smi --query-gpu=memory.total,memory.reserved,memory.used,memory.free (bytes; nvidia-smi: MiB)

        nvmlDeviceGetMemoryInfo_v2, whose `used` leaves out the driver's reserved memory as nvidia-smi
        does (an idle H200: v2 used 0, v1 used 615 MiB); v1 where the driver predates v2.
        """
        if gpu not in self._memory_v1_only:
            try:
                memory = self._device(gpu, "nvmlDeviceGetMemoryInfo", pynvml.nvmlMemory_v2)
            except GpuError as exc:
                if exc.kind is not GpuErrorKind.NOT_SUPPORTED:
                    raise
                self._memory_v1_only.add(gpu)  # an older driver: ask v1 straight away from now on
            else:
                return MemoryInfo(
                    total_bytes=int(memory.total),
                    used_bytes=int(memory.used),
                    free_bytes=int(memory.free),
                    reserved_bytes=int(memory.reserved),
                )
        memory = self._device(gpu, "nvmlDeviceGetMemoryInfo")
        return MemoryInfo(total_bytes=int(memory.total), used_bytes=int(memory.used), free_bytes=int(memory.free))

    def performance_state(self, gpu: int) -> int:
        """nvidia-smi --query-gpu=pstate (0 for P0)"""
        return int(self._device(gpu, "nvmlDeviceGetPerformanceState"))

    # -- slower readings -----------------------------------------------------------------------

    def temperature_threshold_celsius(self, gpu: int, threshold: TemperatureThreshold) -> int:
        """nvidia-smi -q -d TEMPERATURE (shutdown, slowdown, memory max, GPU max operating temperature)"""
        return int(self._device(gpu, "nvmlDeviceGetTemperatureThreshold", int(threshold)))

    def power_limit_watts(self, gpu: int) -> float:
        """nvidia-smi --query-gpu=power.limit"""
        return int(self._device(gpu, "nvmlDeviceGetPowerManagementLimit")) / 1000.0

    def power_limit_constraints_watts(self, gpu: int) -> tuple[float, float]:
        """(min, max): nvidia-smi --query-gpu=power.min_limit,power.max_limit"""
        min_mw, max_mw = self._device(gpu, "nvmlDeviceGetPowerManagementLimitConstraints")
        return int(min_mw) / 1000.0, int(max_mw) / 1000.0

    def default_power_limit_watts(self, gpu: int) -> float:
        """nvidia-smi --query-gpu=power.default_limit"""
        return int(self._device(gpu, "nvmlDeviceGetPowerManagementDefaultLimit")) / 1000.0

    def max_clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        """nvidia-smi --query-gpu=clocks.max.gr,clocks.max.sm,clocks.max.mem"""
        return int(self._device(gpu, "nvmlDeviceGetMaxClockInfo", int(domain)))

    def supported_memory_clocks_mhz(self, gpu: int) -> list[int]:
        """nvidia-smi --query-supported-clocks=mem"""
        return [int(mhz) for mhz in self._device(gpu, "nvmlDeviceGetSupportedMemoryClocks")]

    def supported_graphics_clocks_mhz(self, gpu: int, memory_mhz: int) -> list[int]:
        """nvidia-smi --query-supported-clocks=mem,gr (the graphics clocks listed for one memory clock)"""
        return [int(mhz) for mhz in self._device(gpu, "nvmlDeviceGetSupportedGraphicsClocks", memory_mhz)]

    def locked_clocks_mhz(self, gpu: int, domain: ClockDomain) -> tuple[int, int] | None:
        """The locked (min, max) range of GRAPHICS or MEMORY clocks, None when unlocked.

        NVML has no getter for locked clocks. The closest read-back is the P0 range,
        nvmlDeviceGetMinMaxClockOfPState(domain, P0), the range the driver may pick clocks
        from in P0, which a lock set with nvmlDeviceSetGpuLockedClocks / SetMemoryLockedClocks
        narrows. It is compared with what P0 spans when nothing is locked: for graphics the
        whole supported graphics clock list (at the top memory clock), for memory the top
        memory clock alone (lower memory clocks belong to lower P-states). When P0 spans at
        least that much the clocks are unlocked (None); otherwise the P0 range is the lock.

        Read on an H200 (driver 580.159.04) with nothing locked: P0 graphics (345, 1980) =
        the supported list's range, P0 memory (3201, 3201) while 2201 MHz is P2's.

        Limitations: an inference, not a read of the lock itself. A lock that restricts
        nothing P0 allows reads as None. That a lock narrows the P0 range is NVML's documented
        model but still to be confirmed per architecture (it needs a write to test): where it
        does not, a lock reads as None and the policy sees drift it cannot confirm as fixed.
        SM is not a lockable domain (INVALID_ARGUMENT).
        """
        self._lock_calls(gpu, domain)
        # Fresh out-parameters: pynvml's default ones are module-level objects shared between threads.
        p0_min, p0_max = self._device(
            gpu, "nvmlDeviceGetMinMaxClockOfPState", int(domain), pynvml.NVML_PSTATE_0, ctypes.c_uint(), ctypes.c_uint()
        )
        unlocked_min, unlocked_max = self._unlocked_p0_range(gpu, domain)
        if int(p0_min) <= unlocked_min and int(p0_max) >= unlocked_max:
            return None
        return int(p0_min), int(p0_max)

    def _unlocked_p0_range(self, gpu: int, domain: ClockDomain) -> tuple[int, int]:
        """What P0 spans with nothing locked, from the supported clock lists; cached per board."""
        cached = self._unlocked_ranges.get((gpu, domain))
        if cached is not None:
            return cached
        top_memory = max(self.supported_memory_clocks_mhz(gpu))
        unlocked = (top_memory, top_memory)
        if domain is ClockDomain.GRAPHICS:
            graphics = self.supported_graphics_clocks_mhz(gpu, top_memory)
            unlocked = (min(graphics), max(graphics))
        self._unlocked_ranges[(gpu, domain)] = unlocked
        return unlocked

    def fan_count(self, gpu: int) -> int:
        """0 on fan-less boards (SXM). nvidia-smi has no field; -q lists one Fan Speed per fan."""
        return int(self._device(gpu, "nvmlDeviceGetNumFans"))

    def fan_speed_percent(self, gpu: int, fan: int) -> int:
        """nvidia-smi --query-gpu=fan.speed; NOT_SUPPORTED on fan-less boards."""
        return int(self._fan_call(gpu, fan, "nvmlDeviceGetFanSpeed_v2", fan))

    def fan_manual(self, gpu: int, fan: int) -> bool:
        """True when the fan runs at a speed set by software (nvmlDeviceGetFanControlPolicy_v2).

        No nvidia-smi equivalent.
        """
        policy = self._fan_call(gpu, fan, "nvmlDeviceGetFanControlPolicy_v2", fan, ctypes.c_uint())
        return int(policy) == _FAN_MANUAL

    def fan_speed_range_percent(self, gpu: int) -> tuple[int, int]:
        """(min, max) settable speed (nvmlDeviceGetMinMaxFanSpeed). No nvidia-smi equivalent."""
        min_percent, max_percent = self._fan_call(
            gpu, None, "nvmlDeviceGetMinMaxFanSpeed", ctypes.c_uint(), ctypes.c_uint()
        )
        return int(min_percent), int(max_percent)

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
            fans = self.fan_count(gpu)
            if fans == 0:
                raise GpuError(GpuErrorKind.NOT_SUPPORTED, "this GPU has no fans", gpu=gpu, call=name) from exc
            if fan is not None and fan >= fans:
                message = f"no fan {fan}: this GPU has {fans}"
                raise GpuError(GpuErrorKind.INVALID_ARGUMENT, message, gpu=gpu, call=name) from exc
            raise

    def persistence_enabled(self, gpu: int) -> bool:
        """nvidia-smi --query-gpu=persistence_mode"""
        return int(self._device(gpu, "nvmlDeviceGetPersistenceMode")) == _ENABLED

    def ecc_mode(self, gpu: int) -> EnabledPending:
        """nvidia-smi --query-gpu=ecc.mode.current,ecc.mode.pending"""
        current, pending = self._device(gpu, "nvmlDeviceGetEccMode")
        return EnabledPending(current=int(current) == _ENABLED, pending=int(pending) == _ENABLED)

    def ecc_errors(self, gpu: int, error_type: EccErrorType, counter: EccCounter) -> int:
        """nvidia-smi --query-gpu=ecc.errors.{corrected,uncorrected}.{volatile,aggregate}.total"""
        return int(self._device(gpu, "nvmlDeviceGetTotalEccErrors", int(error_type), int(counter)))

    def remapped_rows(self, gpu: int) -> RemappedRows:
        """nvidia-smi -q -d ROW_REMAPPER (correctable, uncorrectable, pending, remapping failure)"""
        correctable, uncorrectable, pending, failed = self._device(gpu, "nvmlDeviceGetRemappedRows")
        return RemappedRows(
            correctable=int(correctable), uncorrectable=int(uncorrectable), pending=bool(pending), failed=bool(failed)
        )

    def retired_pages_pending(self, gpu: int) -> bool:
        """nvidia-smi --query-gpu=retired_pages.pending; NOT_SUPPORTED where row remapping replaced it (A100+)."""
        return int(self._device(gpu, "nvmlDeviceGetRetiredPagesPendingStatus")) == _ENABLED

    def pcie_link(self, gpu: int) -> PcieLink:
        """nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max"""
        return PcieLink(
            current_generation=int(self._device(gpu, "nvmlDeviceGetCurrPcieLinkGeneration")),
            current_width=int(self._device(gpu, "nvmlDeviceGetCurrPcieLinkWidth")),
            max_generation=int(self._device(gpu, "nvmlDeviceGetMaxPcieLinkGeneration")),
            max_width=int(self._device(gpu, "nvmlDeviceGetMaxPcieLinkWidth")),
        )

    def pcie_replay_counter(self, gpu: int) -> int:
        """nvidia-smi -q -d PCIE (Replays Since Reset)"""
        return int(self._device(gpu, "nvmlDeviceGetPcieReplayCounter"))

    def violation_time_ns(self, gpu: int, policy: ViolationPolicy) -> int:
        """Time clocks were held back by `policy`, in ns since driver load (NVML's violationTime, as given).

        No nvidia-smi query field; DCGM exposes it as DCGM_FI_DEV_POWER_VIOLATION, ..._THERMAL_VIOLATION.
        """
        return int(self._device(gpu, "nvmlDeviceGetViolationStatus", int(policy)).violationTime)

    def mig_mode(self, gpu: int) -> EnabledPending:
        """nvidia-smi --query-gpu=mig.mode.current,mig.mode.pending"""
        current, pending = self._device(gpu, "nvmlDeviceGetMigMode")
        return EnabledPending(current=int(current) == _MIG_ENABLED, pending=int(pending) == _MIG_ENABLED)

    def recovery_action(self, gpu: int) -> int:
        """What the driver says the GPU needs, a `RecoveryAction` value (nvidia-smi -q: GPU Recovery Action).

        Read as field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION of nvmlDeviceGetFieldValues; a driver
        that predates the field (before R550) answers INVALID_ARGUMENT for it: NOT_SUPPORTED here.
        An H200 on driver 580.159.04 answered 0 (NONE) as an unsigned int.
        """
        call = "nvmlDeviceGetFieldValues"
        (field,) = self._device(gpu, call, [_FIELD_RECOVERY_ACTION])
        status = int(field.nvmlReturn)
        if status == pynvml.NVML_ERROR_INVALID_ARGUMENT:
            raise GpuError(
                GpuErrorKind.NOT_SUPPORTED, "this NVIDIA driver reports no recovery action", gpu=gpu, call=call
            )
        if status != pynvml.NVML_SUCCESS:
            raise to_gpu_error(pynvml.NVMLError(status), gpu, call)
        return int(field.value.uiVal)

    def compute_processes(self, gpu: int) -> list[GpuProcess]:
        """nvidia-smi --query-compute-apps=pid,process_name,used_memory (used memory None where NVML cannot
        tell; the name None where the process is gone or hidden from this one)"""
        names = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
        processes = self._call_first(gpu, names, self._handle(gpu))
        return [
            GpuProcess(
                pid=int(process.pid),
                used_memory_bytes=None if process.usedGpuMemory is None else int(process.usedGpuMemory),
                name=self._process_name(int(process.pid)),
            )
            for process in processes
        ]

    def _process_name(self, pid: int) -> str | None:
        try:
            name = self._call(None, "nvmlSystemGetProcessName", pid)
        except GpuError:
            return None
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def applications_clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        """nvidia-smi --query-gpu=clocks.applications.graphics,clocks.applications.memory"""
        return int(self._device(gpu, "nvmlDeviceGetApplicationsClock", int(domain)))

    # -- profiling-grade telemetry ---------------------------------------------------------------

    def gpm_activity(self, gpu: int) -> GpmActivity | None:
        """nvmlGpmSampleGet now, nvmlGpmMetricsGet against the previous call's sample (None on the
        first call). Two sample buffers per GPU take turns, so a loop allocates nothing. NOT_SUPPORTED
        where nvmlGpmQueryDeviceSupport says so.

        No nvidia-smi equivalent (dcgmi dmon -e 1002,1003,1004,1005,1009,1010).
        """
        handle = self._handle(gpu)
        if not self._gpm_device_supported(gpu, handle):
            raise GpuError(GpuErrorKind.NOT_SUPPORTED, "GPM is not supported on this GPU", gpu=gpu, call="gpm")
        sample = self._gpm_spare.pop(gpu, None) or self._call(gpu, "nvmlGpmSampleAlloc")
        try:
            self._call(gpu, "nvmlGpmSampleGet", handle, sample)
        except GpuError:
            self._free_gpm_sample(sample)
            raise
        previous = self._gpm_samples.pop(gpu, None)
        self._gpm_samples[gpu] = sample
        if previous is None:
            return None
        self._gpm_spare[gpu] = previous  # the buffer the next call samples into
        return self._gpm_metrics(gpu, previous, sample)

    def _gpm_device_supported(self, gpu: int, handle: Any) -> bool:
        supported = self._gpm_supported.get(gpu)
        if supported is None:
            supported = bool(self._call(gpu, "nvmlGpmQueryDeviceSupport", handle).isSupportedDevice)
            self._gpm_supported[gpu] = supported
        return supported

    def _gpm_metrics(self, gpu: int, earlier: Any, later: Any) -> GpmActivity:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_METRICS)
        request.sample1 = earlier
        request.sample2 = later
        for position, metric_id in enumerate(_GPM_METRICS.values()):
            request.metrics[position].metricId = metric_id
        answer = self._call(gpu, "nvmlGpmMetricsGet", request)
        values: dict[str, float] = {}
        for position, name in enumerate(_GPM_METRICS):
            metric = answer.metrics[position]
            if int(metric.nvmlReturn) != pynvml.NVML_SUCCESS:
                raise to_gpu_error(pynvml.NVMLError(int(metric.nvmlReturn)), gpu, "nvmlGpmMetricsGet")
            value = float(metric.value)
            values[name] = value / 100.0 if name.endswith("_ratio") else value * _MIB
        return GpmActivity(**values)

    def _free_gpm_sample(self, sample: Any) -> None:
        # A sample that cannot be freed (the GPU is lost) is released with the library at shutdown.
        with contextlib.suppress(GpuError):
            self._call(None, "nvmlGpmSampleFree", sample)

    def _free_gpm_samples(self) -> None:
        samples = [*self._gpm_samples.values(), *self._gpm_spare.values()]
        self._gpm_samples, self._gpm_spare = {}, {}
        for sample in samples:
            self._free_gpm_sample(sample)

    def _field_values(self, gpu: int, field_ids: Sequence[int]) -> dict[int, float]:
        """One nvmlDeviceGetFieldValues call for `field_ids`; fields the GPU answers NOT_SUPPORTED are
        left out of the result, and out of later calls for this GPU."""
        unsupported = self._unsupported_fields.setdefault(gpu, set())
        asked = [field_id for field_id in field_ids if field_id not in unsupported]
        if not asked:
            return {}
        call = "nvmlDeviceGetFieldValues"
        values: dict[int, float] = {}
        for field in self._device(gpu, call, asked):
            status = int(field.nvmlReturn)
            field_id = int(field.fieldId)
            if status in _FIELD_ABSENT:
                unsupported.add(field_id)
            elif status != pynvml.NVML_SUCCESS:
                raise to_gpu_error(pynvml.NVMLError(status), gpu, call)
            else:
                values[field_id] = _field_number(field)
        return values

    def fast_fields(self, gpu: int) -> FastFields:
        """nvidia-smi --query-gpu=power.draw.instant,temperature.memory (energy: -q, "Total Energy Consumption")"""
        values = self._field_values(gpu, (_FIELD_TOTAL_ENERGY, _FIELD_POWER_INSTANT, _FIELD_MEMORY_TEMP))
        energy = values.get(_FIELD_TOTAL_ENERGY)
        power = values.get(_FIELD_POWER_INSTANT)
        temperature = values.get(_FIELD_MEMORY_TEMP)
        return FastFields(
            energy_joules=None if energy is None else energy / 1000.0,
            power_instant_watts=None if power is None else power / 1000.0,
            memory_temperature_celsius=None if temperature is None else int(temperature),
        )

    def slow_fields(self, gpu: int) -> SlowFields:
        """nvidia-smi -q -d PCIE,PERFORMANCE and nvidia-smi nvlink -e, in one field-value call."""
        links = min(self._nvlink_count(gpu), _NVLINK_COUNTED_LINKS)
        link_fields = {
            (counter, link): (first if link < 6 else second) + link % 6
            for counter, (first, second) in _NVLINK_FIELD_START.items()
            for link in range(links)
        }
        asked = [_FIELD_PCIE_CORRECTABLE, _FIELD_PCIE_FATAL, *_VIOLATION_FIELDS.values(), *link_fields.values()]
        values = self._field_values(gpu, asked)
        correctable = values.get(_FIELD_PCIE_CORRECTABLE)
        fatal = values.get(_FIELD_PCIE_FATAL)
        nvlinks = None
        if links:
            nvlinks = tuple(
                NvLinkErrors(
                    link,
                    {
                        counter: int(values[link_fields[(counter, link)]])
                        for counter in _NVLINK_FIELD_START
                        if link_fields[(counter, link)] in values
                    },
                )
                for link in range(links)
            )
        return SlowFields(
            pcie_correctable_errors=None if correctable is None else int(correctable),
            pcie_fatal_errors=None if fatal is None else int(fatal),
            violation_ns={
                reason: int(values[field_id]) for reason, field_id in _VIOLATION_FIELDS.items() if field_id in values
            },
            nvlink_errors=nvlinks,
        )

    def _nvlink_count(self, gpu: int) -> int:
        """How many NVLink links the GPU has: those nvmlDeviceGetNvLinkState answers for (counted once)."""
        count = self._nvlink_counts.get(gpu)
        if count is None:
            count = 0
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    self._device(gpu, "nvmlDeviceGetNvLinkState", link)
                except GpuError as exc:
                    if exc.kind not in (GpuErrorKind.NOT_SUPPORTED, GpuErrorKind.INVALID_ARGUMENT):
                        raise
                    break
                count += 1
            self._nvlink_counts[gpu] = count
        return count

    def nvlink_states(self, gpu: int) -> tuple[bool, ...]:
        """nvidia-smi nvlink -s (a speed per active link, <inactive> for one that is down)"""
        count = self._nvlink_count(gpu)
        if count == 0:
            message = "this GPU has no NVLink"
            raise GpuError(GpuErrorKind.NOT_SUPPORTED, message, gpu=gpu, call="nvmlDeviceGetNvLinkState")
        return tuple(int(self._device(gpu, "nvmlDeviceGetNvLinkState", link)) == _ENABLED for link in range(count))

    def fabric_info(self, gpu: int) -> FabricInfo:
        """nvidia-smi -q (Fabric: State, Status, CliqueId, ClusterUUID); NOT_SUPPORTED off NVSwitch systems."""
        handle = self._handle(gpu)
        # Both calls fill the struct they are given (by reference) and return NVML_SUCCESS.
        info: Any = pynvml.c_nvmlGpuFabricInfo_v2_t()
        try:
            self._call(gpu, "nvmlDeviceGetGpuFabricInfoV", handle, ctypes.byref(info))
        except GpuError as exc:
            if exc.kind is not GpuErrorKind.NOT_SUPPORTED:
                raise
            info = pynvml.c_nvmlGpuFabricInfo_t()
            self._call(gpu, "nvmlDeviceGetGpuFabricInfo", handle, ctypes.byref(info))
        state = FabricState(int(info.state))
        if state is FabricState.NOT_SUPPORTED:
            message = "no NVSwitch fabric"
            raise GpuError(GpuErrorKind.NOT_SUPPORTED, message, gpu=gpu, call="nvmlDeviceGetGpuFabricInfoV")
        return FabricInfo(
            state=state,
            status=int(info.status),
            clique_id=int(info.cliqueId),
            cluster_uuid=str(uuid.UUID(bytes=bytes(info.clusterUuid))),
        )

    # -- events --------------------------------------------------------------------------------

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

    # -- setters -------------------------------------------------------------------------------

    def set_power_limit_watts(self, gpu: int, watts: float) -> None:
        """nvidia-smi -pl WATTS (NVML takes milliwatts)."""
        self.write_guard.check("set_power_limit_watts")
        self._device(gpu, "nvmlDeviceSetPowerManagementLimit", round(watts * 1000))

    def set_locked_clocks_mhz(self, gpu: int, domain: ClockDomain, min_mhz: int, max_mhz: int) -> None:
        """nvidia-smi -lgc MIN,MAX (GRAPHICS: nvmlDeviceSetGpuLockedClocks) / -lmc MIN,MAX (MEMORY)."""
        self.write_guard.check("set_locked_clocks_mhz")
        set_call, _ = self._lock_calls(gpu, domain)
        self._device(gpu, set_call, min_mhz, max_mhz)

    def reset_locked_clocks(self, gpu: int, domain: ClockDomain) -> None:
        """nvidia-smi -rgc (GRAPHICS: nvmlDeviceResetGpuLockedClocks) / -rmc (MEMORY)."""
        self.write_guard.check("reset_locked_clocks")
        _, reset_call = self._lock_calls(gpu, domain)
        self._device(gpu, reset_call)

    def set_fan_speed_percent(self, gpu: int, fan: int, percent: int) -> None:
        """nvmlDeviceSetFanSpeed_v2: switches the fan to manual control at `percent`."""
        self.write_guard.check("set_fan_speed_percent")
        self._fan_call(gpu, fan, "nvmlDeviceSetFanSpeed_v2", fan, percent)

    def set_fan_automatic(self, gpu: int, fan: int) -> None:
        """nvmlDeviceSetDefaultFanSpeed_v2: gives the fan back to the driver's curve."""
        self.write_guard.check("set_fan_automatic")
        self._fan_call(gpu, fan, "nvmlDeviceSetDefaultFanSpeed_v2", fan)

    def set_persistence(self, gpu: int, enabled: bool) -> None:
        """nvidia-smi -pm 1|0."""
        self.write_guard.check("set_persistence")
        mode = _ENABLED if enabled else _DISABLED
        self._device(gpu, "nvmlDeviceSetPersistenceMode", mode)

    def set_ecc_mode(self, gpu: int, enabled: bool) -> None:
        """nvidia-smi -e 1|0 (takes effect after a reboot: ecc_mode().pending shows it)."""
        self.write_guard.check("set_ecc_mode")
        mode = _ENABLED if enabled else _DISABLED
        self._device(gpu, "nvmlDeviceSetEccMode", mode)

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
            result = subprocess.run(
                [nvidia_smi, "--gpu-reset", "-i", bus_id],
                capture_output=True,
                text=True,
                timeout=_RESET_TIMEOUT_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            message = f"nvidia-smi --gpu-reset did not finish in {_RESET_TIMEOUT_SECONDS:.0f} s"
            raise GpuError(GpuErrorKind.TIMEOUT, message, gpu=gpu, call=call) from exc
        finally:
            self.init()
        if result.returncode != 0:
            raise _reset_error(result.stdout + result.stderr, gpu, call)

    @staticmethod
    def _lock_calls(gpu: int, domain: ClockDomain) -> tuple[str, str]:
        """(set, reset) NVML calls for locking `domain`; SM clocks follow the graphics lock."""
        calls = _LOCK_CALLS.get(domain)
        if calls is None:
            raise GpuError(
                GpuErrorKind.INVALID_ARGUMENT,
                f"{domain.name} clocks cannot be locked (only GRAPHICS and MEMORY)",
                gpu=gpu,
            )
        return calls
