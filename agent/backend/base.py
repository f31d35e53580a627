"""The GPU backend contract: typed, unit-named readings and setters, one method per NVML call.

Both backends (`nvml`, `simulated`) implement `GpuBackend`. Devices are addressed by their
NVML index. Every method raises `GpuError` (never a backend-specific exception). Setters are
guarded: a backend holds a `write_guard` with the set of policy items it may change
(`writable_items`) and raises `WriteRefused` for any other, so observe mode cannot reach the
hardware. The daemon replaces `write_guard` when a reload changes the mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Protocol, runtime_checkable

from agent.backend.errors import WriteRefused
from agent.names.policy_items import GPU_RESET_ITEM, GpuItemName, GpuResetName


class ClockDomain(IntEnum):
    """nvmlClockType_t values."""

    GRAPHICS = 0
    SM = 1
    MEMORY = 2


class TemperatureThreshold(IntEnum):
    """nvmlTemperatureThresholds_t values."""

    SHUTDOWN = 0
    SLOWDOWN = 1
    MEM_MAX = 2
    GPU_MAX = 3


class ViolationPolicy(IntEnum):
    """nvmlPerfPolicyType_t values (nvmlDeviceGetViolationStatus)."""

    POWER = 0
    THERMAL = 1
    SYNC_BOOST = 2
    BOARD_LIMIT = 3
    LOW_UTILIZATION = 4
    RELIABILITY = 5
    TOTAL_APP_CLOCKS = 10
    TOTAL_BASE_CLOCKS = 11


class EccCounter(IntEnum):
    """nvmlEccCounterType_t values."""

    VOLATILE = 0
    AGGREGATE = 1


class EccErrorType(IntEnum):
    """nvmlMemoryErrorType_t values."""

    CORRECTED = 0
    UNCORRECTED = 1


class RecoveryAction(IntEnum):
    """nvmlDeviceGpuRecoveryAction_t values."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4


#: The largest Xid code the driver reports (codes run 1-999): the kernel-log parser, `gpu-agent ack
#: xid:CODE@N` and the simulator's injected faults take no other.
MAX_XID = 999


class GpuEventKind(str, Enum):
    XID = "xid"
    SINGLE_BIT_ECC = "single_bit_ecc"
    DOUBLE_BIT_ECC = "double_bit_ecc"


@dataclass(frozen=True)
class GpuIdentity:
    index: int
    uuid: str
    name: str
    pci_bus_id: str  # NVML form: "00000000:3B:00.0" (8-digit domain)
    serial: str
    vbios_version: str
    minor_number: int


@dataclass(frozen=True)
class MemoryInfo:
    """nvidia-smi's Total/Reserved/Used/Free: `used` excludes the driver's reserved memory
    (nvmlDeviceGetMemoryInfo_v2); `reserved_bytes` is None where only the v1 call answers (then
    `used` includes the reserved memory, as v1 counts it)."""

    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int | None = None


@dataclass(frozen=True)
class Utilization:
    gpu_percent: int
    memory_percent: int


@dataclass(frozen=True)
class EnabledPending:
    """A mode with a current and a pending value (ECC, MIG): pending takes effect after reboot/reset."""

    current: bool
    pending: bool


@dataclass(frozen=True)
class RemappedRows:
    correctable: int
    uncorrectable: int
    pending: bool
    failed: bool


@dataclass(frozen=True)
class PcieLink:
    current_generation: int
    current_width: int
    max_generation: int
    max_width: int


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int | None
    name: str | None = None  # nvmlSystemGetProcessName (nvidia-smi's "Process name"); None: unknown


@dataclass(frozen=True)
class GpmActivity:
    """GPM activity over the interval between two samples (nvmlGpmMetricsGet), in base units:
    ratios 0..1 (NVML's percent / 100) and bytes per second (NVML's MiB/s x 2^20)."""

    sm_active_ratio: float
    sm_occupancy_ratio: float
    tensor_active_ratio: float
    dram_active_ratio: float
    pcie_tx_bytes_per_second: float
    pcie_rx_bytes_per_second: float
    nvlink_tx_bytes_per_second: float
    nvlink_rx_bytes_per_second: float
    graphics_active_ratio: float | None = None  # NVML_GPM_METRIC_GRAPHICS_UTIL; None where not given


@dataclass(frozen=True)
class FastFields:
    """The fast tier's nvmlDeviceGetFieldValues batch; a field that answered NOT_SUPPORTED is None."""

    power_instant_watts: float | None  # NVML_FI_DEV_POWER_INSTANT (mW)
    memory_temperature_celsius: int | None  # NVML_FI_DEV_MEMORY_TEMP (HBM; None on GDDR boards)


#: NVML's clock-event ("throttle") reason bits (nvmlClocksEventReason*) and their names.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

#: Clock-event reasons with a duration field (NVML_FI_DEV_CLOCKS_EVENT_REASON_*), by label.
VIOLATION_REASONS: tuple[str, ...] = ("sw_power_cap", "sync_boost", "sw_thermal", "hw_thermal", "hw_power_brake")
#: NVLink error counters kept per link (NVML_FI_DEV_NVLINK_<COUNTER>_ERROR_COUNT_L<n>), by label.
NVLINK_ERROR_COUNTERS: tuple[str, ...] = ("crc_flit", "crc_data", "replay", "recovery")


@dataclass(frozen=True)
class NvLinkErrors:
    """One link's error counters, keyed by NVLINK_ERROR_COUNTERS."""

    link: int
    counts: Mapping[str, int]


@dataclass(frozen=True)
class SlowFields:
    """The slow tier's nvmlDeviceGetFieldValues batch; a field that answered NOT_SUPPORTED is None."""

    # The energy counter is here, not in the fast batch: an H200 takes ~3 ms to answer it (the
    # other fast fields ~3 us), which alone was two thirds of the fast poll; a counter read every
    # slow tier still gives rate() its joules.
    energy_joules: float | None  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ since the driver loaded)
    pcie_correctable_errors: int | None  # NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS
    pcie_fatal_errors: int | None  # NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR
    violation_ns: Mapping[str, int]  # reason (VIOLATION_REASONS) -> ns held back; unsupported reasons left out
    nvlink_errors: tuple[NvLinkErrors, ...] | None  # None: the GPU has no NVLink (NOT_SUPPORTED)

    @property
    def nvlink_error_totals(self) -> dict[str, int] | None:
        """Each counter added up over the links (None: no NVLink), what a fleet watches per GPU."""
        if self.nvlink_errors is None:
            return None
        totals: dict[str, int] = {}
        for link in self.nvlink_errors:
            for counter, count in link.counts.items():
                totals[counter] = totals.get(counter, 0) + count
        return totals


class FabricState(IntEnum):
    """nvmlGpuFabricState_t."""

    NOT_SUPPORTED = 0
    NOT_STARTED = 1
    IN_PROGRESS = 2
    COMPLETED = 3


@dataclass(frozen=True)
class FabricInfo:
    """nvmlDeviceGetGpuFabricInfo(V): CUDA runs only once the state is COMPLETED with status 0 (success)."""

    state: FabricState
    status: int  # nvmlReturn_t of the registration
    clique_id: int
    cluster_uuid: str


@dataclass(frozen=True)
class GpuEvent:
    """One event from the NVML event set (nvmlEventSetWait_v2)."""

    gpu: int
    kind: GpuEventKind
    data: int  # the Xid number for XID events
    timestamp_seconds: float


@runtime_checkable
class GpuBackend(Protocol):
    """What the agent may ask of a GPU stack. Watts, MHz, Celsius, percent and bytes, never mW."""

    name: str
    #: Asked by every setter before the hardware is touched; replaced on a config reload.
    write_guard: WriteGuard

    # -- library ---------------------------------------------------------------------------
    def init(self) -> None:
        """nvmlInit. Raises GpuError(DRIVER_NOT_LOADED | LIBRARY_NOT_FOUND | ...)."""

    def shutdown(self) -> None:
        """nvmlShutdown; safe to call twice."""

    def driver_version(self) -> str: ...
    def cuda_driver_version(self) -> int:
        """The newest CUDA version the driver supports, NVML's integer form (13000 = CUDA 13.0)."""
        ...

    def device_count(self) -> int: ...
    def identity(self, gpu: int) -> GpuIdentity: ...

    # -- hot readings (cheap: every loop) ---------------------------------------------------
    def temperature_celsius(self, gpu: int) -> int:
        """nvidia-smi --query-gpu=temperature.gpu"""

    def power_usage_watts(self, gpu: int) -> float:
        """nvidia-smi --query-gpu=power.draw"""

    def clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        """nvidia-smi --query-gpu=clocks.gr,clocks.sm,clocks.mem"""

    def clock_event_reasons(self, gpu: int) -> int:
        """Bit mask, nvidia-smi --query-gpu=clocks_event_reasons.active"""

    def utilization(self, gpu: int) -> Utilization: ...
    def memory_info(self, gpu: int) -> MemoryInfo: ...
    def performance_state(self, gpu: int) -> int: ...

    # -- slower readings (modes, counters, limits) ------------------------------------------
    def temperature_threshold_celsius(self, gpu: int, threshold: TemperatureThreshold) -> int: ...
    def power_limit_watts(self, gpu: int) -> float:
        """nvidia-smi --query-gpu=power.limit"""

    def power_limit_constraints_watts(self, gpu: int) -> tuple[float, float]:
        """(min, max): nvidia-smi --query-gpu=power.min_limit,power.max_limit"""

    def default_power_limit_watts(self, gpu: int) -> float: ...
    def max_clock_mhz(self, gpu: int, domain: ClockDomain) -> int: ...
    def supported_memory_clocks_mhz(self, gpu: int) -> list[int]: ...
    def supported_graphics_clocks_mhz(self, gpu: int, memory_mhz: int) -> list[int]: ...
    def locked_clocks_mhz(self, gpu: int, domain: ClockDomain) -> tuple[int, int] | None:
        """The locked (min, max) range of GRAPHICS or MEMORY clocks, None when unlocked."""

    def fan_count(self, gpu: int) -> int:
        """0 on fan-less boards (SXM)."""

    def fan_speed_percent(self, gpu: int, fan: int) -> int:
        """nvidia-smi --query-gpu=fan.speed; NOT_SUPPORTED on fan-less boards."""

    def fan_manual(self, gpu: int, fan: int) -> bool:
        """True when the fan runs at a speed set by software (nvmlDeviceGetFanControlPolicy_v2)."""

    def fan_speed_range_percent(self, gpu: int) -> tuple[int, int]:
        """(min, max) settable speed (nvmlDeviceGetMinMaxFanSpeed)."""

    def persistence_enabled(self, gpu: int) -> bool: ...
    def ecc_mode(self, gpu: int) -> EnabledPending: ...
    def ecc_errors(self, gpu: int, error_type: EccErrorType, counter: EccCounter) -> int: ...
    def remapped_rows(self, gpu: int) -> RemappedRows: ...
    def retired_pages_pending(self, gpu: int) -> bool: ...
    def pcie_link(self, gpu: int) -> PcieLink: ...
    def pcie_replay_counter(self, gpu: int) -> int: ...
    def violation_time_ns(self, gpu: int, policy: ViolationPolicy) -> int: ...
    def mig_mode(self, gpu: int) -> EnabledPending: ...
    def recovery_action(self, gpu: int) -> int:
        """What the driver says the GPU needs (nvmlDeviceGetFieldValues NVML_FI_DEV_GET_GPU_RECOVERY_ACTION):
        a `RecoveryAction` value; NOT_SUPPORTED on drivers before R550."""

    def compute_processes(self, gpu: int) -> list[GpuProcess]: ...
    def applications_clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        """nvidia-smi --query-gpu=clocks.applications.graphics,clocks.applications.memory"""

    # -- profiling-grade telemetry ---------------------------------------------------------------
    def gpm_activity(self, gpu: int) -> GpmActivity | None:
        """Takes a GPM sample and returns the activity since the previous call's sample for this GPU
        (None on the first call): one sample per loop, no sleeping. NOT_SUPPORTED without GPM
        (nvmlGpmQueryDeviceSupport; before Hopper)."""

    def fast_fields(self, gpu: int) -> FastFields:
        """Energy, instant power and HBM temperature in one nvmlDeviceGetFieldValues call."""

    def slow_fields(self, gpu: int) -> SlowFields:
        """PCIe error counts, violation time per reason and NVLink per-link error counters in one
        nvmlDeviceGetFieldValues call."""

    def nvlink_states(self, gpu: int) -> tuple[bool, ...]:
        """Up (True) or down per NVLink link (nvmlDeviceGetNvLinkState); NOT_SUPPORTED without NVLink."""

    def fabric_info(self, gpu: int) -> FabricInfo:
        """NVSwitch fabric registration (nvmlDeviceGetGpuFabricInfoV); NOT_SUPPORTED without a fabric."""

    # -- events -----------------------------------------------------------------------------
    def wait_events(self, timeout_seconds: float) -> list[GpuEvent]:
        """Block up to timeout for Xid/ECC events on all GPUs; [] when quiet.

        Raises GpuError(GPU_LOST) when a device falls off the bus while waiting.
        """

    # -- setters (guarded by writable_items) ------------------------------------------------
    def set_power_limit_watts(self, gpu: int, watts: float) -> None: ...
    def set_locked_clocks_mhz(self, gpu: int, domain: ClockDomain, min_mhz: int, max_mhz: int) -> None: ...
    def reset_locked_clocks(self, gpu: int, domain: ClockDomain) -> None: ...
    def set_fan_speed_percent(self, gpu: int, fan: int, percent: int) -> None: ...
    def set_fan_automatic(self, gpu: int, fan: int) -> None: ...
    def set_persistence(self, gpu: int, enabled: bool) -> None: ...
    def set_ecc_mode(self, gpu: int, enabled: bool) -> None: ...
    def reset_gpu(self, gpu: int) -> None:
        """nvidia-smi --gpu-reset: IN_USE while processes hold the GPU; settings return to defaults."""


#: The policy item each setter belongs to; a backend refuses setters outside its writable items.
#: Typed on the item names (agent.names.policy_items), so a misspelt item cannot slip into the guard.
SETTER_ITEMS: dict[str, GpuItemName | GpuResetName] = {
    "set_power_limit_watts": "power_limit",
    "set_locked_clocks_mhz": "locked_clocks",
    "reset_locked_clocks": "locked_clocks",
    "set_fan_speed_percent": "fan_curve",
    "set_fan_automatic": "fan_curve",
    "set_persistence": "persistence",
    "set_ecc_mode": "ecc",
    "reset_gpu": GPU_RESET_ITEM,
}


class WriteGuard:
    """Holds the policy items a backend may change; every setter asks it first."""

    def __init__(self, writable_items: Iterable[str] = ()) -> None:
        self.writable_items = frozenset(writable_items)

    def check(self, setter: str) -> None:
        item = SETTER_ITEMS[setter]
        if item not in self.writable_items:
            raise WriteRefused(item, setter)
