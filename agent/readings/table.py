"""The reading table: `GpuSample`, one GPU at one instant, whose reading fields are its rows.

Each reading is declared once, as a field with `reading(...)`: the backend call it comes from and
that call's tier, its `/metrics` family (name, help, type, unit, labels, shape), its family name,
and its dcgm-exporter field. From the rows follow the collector's calls (`agent/collect.py`), the
sample that carries them and its `status --json` entry (`agent/documents.py`), the per-GPU families
of `/metrics` (`agent/metrics/gpu.py`) and the dcgm compatibility rules (`agent/metrics/dcgm.py`).
The fields are in `/metrics` order; the calls are made in the order of their first row, fast tier
first. How to add one: docs/architecture.md, "Adding a reading".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.backend.base import (
    CLOCK_EVENT_REASONS,
    ClockDomain,
    EccCounter,
    EccErrorType,
    GpuProcess,
    NvLinkErrors,
    TemperatureThreshold,
    ViolationPolicy,
)
from agent.readings.composite import NVLINK_ERRORS, VIOLATIONS, fabric_states, read_fans, recovery_actions
from agent.readings.row import (
    BYTES,
    BYTES_PER_SECOND,
    CELSIUS,
    FLAG,
    JOULES,
    MHZ,
    NANOSECONDS,
    PERCENT,
    RATIO,
    WATTS,
    Dcgm,
    Section,
    Tier,
    bit_flags,
    counter,
    current_except,
    fast,
    gauge,
    nonzero,
    one_hot,
    per_key,
    per_position,
    readers,
    reading,
    rows_of,
    slow,
    zero,
)
from agent.readings.shared import (
    CLOCK,
    ECC_MODE,
    FABRIC,
    FAST_FIELDS,
    GPM,
    MEMORY,
    MIG,
    PCIE_ERRORS,
    PCIE_LINK,
    REMAPPED,
    REMAPPED_ROWS,
    SLOW_FIELDS,
    TEMPERATURE_THRESHOLD,
    UTILIZATION,
    applications_clock,
    ecc_counter,
    max_clock,
)

TELEMETRY = Section.TELEMETRY


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant: its identity, then one field per reading, each a row of the table
    (`reading(...)`). A reading is None when the board does not support it or its call failed;
    `read_errors` says which call failed and how (call -> GpuErrorKind value)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    up: bool  # False: lost, or not even its identity could be read
    timestamp_seconds: float

    # -- the device section of /metrics --------------------------------------------------------
    temperature_celsius: int | None = reading(
        fast(lambda b, gpu: b.temperature_celsius(gpu)),
        family="temperature",
        metric=gauge("gpu_agent_gpu_temperature_celsius", "GPU core temperature."),
        unit=CELSIUS,
        dcgm=Dcgm("DCGM_FI_DEV_GPU_TEMP", "C"),
    )
    slowdown_temperature_celsius: int | None = reading(
        slow(lambda b, gpu: b.temperature_threshold_celsius(gpu, TemperatureThreshold.SLOWDOWN)),
        family="temperature_thresholds",
        metric=TEMPERATURE_THRESHOLD,
        labels={"threshold": "slowdown"},
        unit=CELSIUS,
    )
    shutdown_temperature_celsius: int | None = reading(
        slow(lambda b, gpu: b.temperature_threshold_celsius(gpu, TemperatureThreshold.SHUTDOWN)),
        family="temperature_thresholds",
        metric=TEMPERATURE_THRESHOLD,
        labels={"threshold": "shutdown"},
        unit=CELSIUS,
    )
    power_usage_watts: float | None = reading(
        fast(lambda b, gpu: b.power_usage_watts(gpu)),
        family="power",
        metric=gauge("gpu_agent_gpu_power_usage_watts", "GPU board power draw."),
        unit=WATTS,
        dcgm=Dcgm("DCGM_FI_DEV_POWER_USAGE", "W"),
    )
    power_limit_watts: float | None = reading(
        fast(lambda b, gpu: b.power_limit_watts(gpu)),
        family="power",
        metric=gauge("gpu_agent_gpu_power_limit_watts", "Power management limit in force."),
        unit=WATTS,
        dcgm=Dcgm("DCGM_FI_DEV_POWER_MGMT_LIMIT", "W"),
    )
    graphics_clock_mhz: int | None = reading(
        fast(lambda b, gpu: b.clock_mhz(gpu, ClockDomain.GRAPHICS)),
        family="clock_details",
        metric=CLOCK,
        labels={"clock": "graphics"},
        unit=MHZ,
    )
    sm_clock_mhz: int | None = reading(
        fast(lambda b, gpu: b.clock_mhz(gpu, ClockDomain.SM)),
        family="clocks",
        metric=CLOCK,
        labels={"clock": "sm"},
        unit=MHZ,
        dcgm=Dcgm("DCGM_FI_DEV_SM_CLOCK", "MHz"),
    )
    memory_clock_mhz: int | None = reading(
        fast(lambda b, gpu: b.clock_mhz(gpu, ClockDomain.MEMORY)),
        family="clocks",
        metric=CLOCK,
        labels={"clock": "memory"},
        unit=MHZ,
        dcgm=Dcgm("DCGM_FI_DEV_MEM_CLOCK", "MHz"),
    )
    gpu_utilization_percent: int | None = reading(
        UTILIZATION,
        "gpu_percent",
        family="utilization",
        metric=gauge(
            "gpu_agent_gpu_utilization_ratio", "Fraction of the last sample period in which a kernel ran on the GPU."
        ),
        unit=PERCENT,
        dcgm=Dcgm("DCGM_FI_DEV_GPU_UTIL", "%"),
    )
    memory_utilization_percent: int | None = reading(
        UTILIZATION,
        "memory_percent",
        family="utilization",
        metric=gauge(
            "gpu_agent_gpu_memory_utilization_ratio",
            "Fraction of the last sample period in which device memory was read or written.",
        ),
        unit=PERCENT,
        dcgm=Dcgm("DCGM_FI_DEV_MEM_COPY_UTIL", "%"),
    )
    memory_used_bytes: int | None = reading(
        MEMORY,
        "used_bytes",
        family="memory",
        metric=gauge("gpu_agent_gpu_memory_used_bytes", "Device memory in use."),
        unit=BYTES,
        dcgm=Dcgm("DCGM_FI_DEV_FB_USED", "MiB", ", without the driver's reserved memory (as DCGM 3.3+ and nvidia-smi)"),
    )
    memory_total_bytes: int | None = reading(
        MEMORY,
        "total_bytes",
        family="memory",
        metric=gauge("gpu_agent_gpu_memory_total_bytes", "Device memory installed."),
        unit=BYTES,
        dcgm=Dcgm("DCGM_FI_DEV_FB_TOTAL", "MiB"),
    )
    performance_state: int | None = reading(
        fast(lambda b, gpu: b.performance_state(gpu)),
        family="clock_details",
        metric=gauge(
            "gpu_agent_gpu_performance_state", "Performance state (0 = P0, maximum performance; 15 = P15, minimum)."
        ),
    )
    persistence_enabled: bool | None = reading(
        fast(lambda b, gpu: b.persistence_enabled(gpu)),
        family="modes",
        metric=gauge("gpu_agent_gpu_persistence_mode_enabled", "1 when persistence mode is on."),
        unit=FLAG,
    )
    ecc_enabled: bool | None = reading(
        ECC_MODE,
        "current",
        family="modes",
        metric=gauge("gpu_agent_gpu_ecc_enabled", "1 when ECC is on now."),
        unit=FLAG,
    )
    ecc_pending: bool | None = reading(
        ECC_MODE,
        "pending",
        family="modes",
        metric=gauge("gpu_agent_gpu_ecc_pending_enabled", "1 when ECC will be on after the next reboot or GPU reset."),
        unit=FLAG,
    )
    ecc_corrected_aggregate: int | None = ecc_counter(
        EccErrorType.CORRECTED, EccCounter.AGGREGATE, "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"
    )
    ecc_uncorrected_aggregate: int | None = ecc_counter(
        EccErrorType.UNCORRECTED, EccCounter.AGGREGATE, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"
    )
    ecc_corrected_volatile: int | None = ecc_counter(
        EccErrorType.CORRECTED, EccCounter.VOLATILE, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
    )
    ecc_uncorrected_volatile: int | None = ecc_counter(
        EccErrorType.UNCORRECTED, EccCounter.VOLATILE, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
    )
    remapped_rows_correctable: int | None = reading(
        REMAPPED_ROWS,
        "correctable",
        family="row_remap",
        metric=REMAPPED,
        labels={"cause": "correctable"},
        dcgm=Dcgm("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "count"),
        notable=nonzero,
    )
    remapped_rows_uncorrectable: int | None = reading(
        REMAPPED_ROWS,
        "uncorrectable",
        family="row_remap",
        metric=REMAPPED,
        labels={"cause": "uncorrectable"},
        dcgm=Dcgm("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "count"),
        notable=nonzero,
    )
    remap_pending: bool | None = reading(
        REMAPPED_ROWS,
        "pending",
        family="row_remap",
        metric=gauge("gpu_agent_gpu_row_remap_pending", "1 when a row remap waits for a GPU reset or reboot."),
        unit=FLAG,
        dcgm=Dcgm("DCGM_FI_DEV_ROW_REMAP_PENDING", "flag"),
        notable=nonzero,
    )
    remap_failed: bool | None = reading(
        REMAPPED_ROWS,
        "failed",
        family="row_remap",
        metric=gauge("gpu_agent_gpu_row_remap_failed", "1 when a row remap failed (the GPU needs service)."),
        unit=FLAG,
        dcgm=Dcgm("DCGM_FI_DEV_ROW_REMAP_FAILURE", "flag"),
        notable=nonzero,
    )
    retired_pages_pending: bool | None = reading(
        slow(lambda b, gpu: b.retired_pages_pending(gpu)),
        family="row_remap",
        metric=gauge(
            "gpu_agent_gpu_retired_pages_pending", "1 when a page retirement waits for a reboot (pre-Ampere boards)."
        ),
        unit=FLAG,
        dcgm=Dcgm("DCGM_FI_DEV_RETIRED_PENDING", "flag"),
        notable=nonzero,
    )
    pcie_generation: int | None = reading(
        PCIE_LINK,
        "current_generation",
        family="pcie_link",
        metric=gauge("gpu_agent_gpu_pcie_link_generation", "Current PCIe link generation."),
    )
    pcie_max_generation: int | None = reading(
        PCIE_LINK,
        "max_generation",
        family="pcie_link",
        metric=gauge("gpu_agent_gpu_pcie_link_max_generation", "Highest PCIe generation of GPU and slot."),
    )
    pcie_width: int | None = reading(
        PCIE_LINK,
        "current_width",
        family="pcie_link",
        metric=gauge("gpu_agent_gpu_pcie_link_width", "Current PCIe link width (lanes)."),
    )
    pcie_max_width: int | None = reading(
        PCIE_LINK,
        "max_width",
        family="pcie_link",
        metric=gauge("gpu_agent_gpu_pcie_link_max_width", "Widest PCIe link of GPU and slot."),
    )
    pcie_replay_count: int | None = reading(
        slow(lambda b, gpu: b.pcie_replay_counter(gpu)),
        family="pcie_errors",
        metric=counter("gpu_agent_gpu_pcie_replays_total", "PCIe replays (link-level retransmissions)."),
        dcgm=Dcgm("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "count"),
        notable=nonzero,
    )
    fan_speeds_percent: tuple[int, ...] | None = reading(
        fast(read_fans),
        family="fans",
        metric=gauge("gpu_agent_gpu_fan_speed_ratio", "Fan speed as a fraction of its maximum."),
        shape=per_position("fan"),
        unit=PERCENT,
    )
    clock_event_reasons: int | None = reading(
        fast(lambda b, gpu: b.clock_event_reasons(gpu)),
        family="clock_events",
        metric=gauge(
            "gpu_agent_gpu_clock_event_active", "1 while a clock-event (throttle) reason holds the clocks down."
        ),
        shape=bit_flags("reason", CLOCK_EVENT_REASONS),
        unit=FLAG,
        dcgm=Dcgm(
            "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
            "bitmask",
            " of NVML's clock-event reasons",
            bits=tuple((name, bit) for bit, name in CLOCK_EVENT_REASONS.items()),
        ),
        notable=nonzero,
    )
    recovery_action: int | None = reading(  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (R550+)
        slow(lambda b, gpu: b.recovery_action(gpu)),
        family="recovery",
        metric=gauge(
            "gpu_agent_gpu_recovery_action",
            "What the driver says the GPU needs (NVML GPU recovery action), one series per action, "
            "1 for the current one.",
        ),
        shape=one_hot("action", recovery_actions),
        unit=FLAG,
        notable=current_except("action", "none"),
    )

    # -- the telemetry section of /metrics: GPM, field values, memory v2, NVLink, fabric, modes ----
    # GPM activity since the previous loop (None: first loop, or no GPM); activity_supported False
    # once the GPU answered NOT_SUPPORTED (status: "activity: not supported")
    activity_supported: bool | None = None
    graphics_active_ratio: float | None = reading(
        GPM,
        "graphics_active_ratio",
        family="activity",
        metric=gauge(
            "gpu_agent_gpu_graphics_active_ratio",
            "Fraction of time the graphics or compute engine was busy (GPM, since the last loop).",
        ),
        unit=RATIO,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "ratio 0-1", " (GPM graphics utilization)"),
    )
    sm_active_ratio: float | None = reading(
        GPM,
        "sm_active_ratio",
        family="activity",
        metric=gauge(
            "gpu_agent_gpu_sm_active_ratio",
            "Fraction of time at least one warp was resident on an SM, averaged over SMs (GPM, since the last loop).",
        ),
        unit=RATIO,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_PROF_SM_ACTIVE", "ratio 0-1"),
    )
    sm_occupancy_ratio: float | None = reading(
        GPM,
        "sm_occupancy_ratio",
        family="activity",
        metric=gauge(
            "gpu_agent_gpu_sm_occupancy_ratio",
            "Resident warps as a fraction of the SMs' maximum (GPM, since the last loop).",
        ),
        unit=RATIO,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_PROF_SM_OCCUPANCY", "ratio 0-1"),
    )
    tensor_active_ratio: float | None = reading(
        GPM,
        "tensor_active_ratio",
        family="activity",
        metric=gauge(
            "gpu_agent_gpu_tensor_active_ratio",
            "Fraction of time any tensor pipe was active (GPM, since the last loop).",
        ),
        unit=RATIO,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "ratio 0-1", " (GPM: any tensor pipe)"),
    )
    dram_active_ratio: float | None = reading(
        GPM,
        "dram_active_ratio",
        family="activity",
        metric=gauge(
            "gpu_agent_gpu_dram_active_ratio",
            "Device memory bandwidth used as a fraction of the maximum (GPM, since the last loop).",
        ),
        unit=RATIO,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_PROF_DRAM_ACTIVE", "ratio 0-1"),
    )
    pcie_tx_bytes_per_second: float | None = reading(
        GPM,
        "pcie_tx_bytes_per_second",
        family="throughput",
        metric=gauge(
            "gpu_agent_gpu_pcie_tx_bytes_per_second", "PCIe traffic sent by the GPU (GPM, since the last loop)."
        ),
        unit=BYTES_PER_SECOND,
        section=TELEMETRY,
        dcgm=(
            Dcgm("DCGM_FI_PROF_PCIE_TX_BYTES", "bytes/s"),
            Dcgm("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "KB/s", " (GPM: the same bytes over the last loop)"),
        ),
    )
    pcie_rx_bytes_per_second: float | None = reading(
        GPM,
        "pcie_rx_bytes_per_second",
        family="throughput",
        metric=gauge(
            "gpu_agent_gpu_pcie_rx_bytes_per_second", "PCIe traffic received by the GPU (GPM, since the last loop)."
        ),
        unit=BYTES_PER_SECOND,
        section=TELEMETRY,
        dcgm=(
            Dcgm("DCGM_FI_PROF_PCIE_RX_BYTES", "bytes/s"),
            Dcgm("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "KB/s", " (GPM: the same bytes over the last loop)"),
        ),
    )
    nvlink_tx_bytes_per_second: float | None = reading(
        GPM,
        "nvlink_tx_bytes_per_second",
        family="throughput",
        metric=gauge(
            "gpu_agent_gpu_nvlink_tx_bytes_per_second",
            "NVLink traffic sent by the GPU over all links (GPM, since the last loop).",
        ),
        unit=BYTES_PER_SECOND,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_PROF_NVLINK_TX_BYTES", "bytes/s"),
    )
    nvlink_rx_bytes_per_second: float | None = reading(
        GPM,
        "nvlink_rx_bytes_per_second",
        family="throughput",
        metric=gauge(
            "gpu_agent_gpu_nvlink_rx_bytes_per_second",
            "NVLink traffic received by the GPU over all links (GPM, since the last loop).",
        ),
        unit=BYTES_PER_SECOND,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_PROF_NVLINK_RX_BYTES", "bytes/s"),
    )
    # The energy counter is in the slow field-value batch, not the fast one: an H200 takes ~3 ms to
    # answer it (the other fast fields ~3 us); a counter read every slow tier still gives rate() its joules.
    energy_joules: float | None = reading(  # since the driver loaded
        SLOW_FIELDS,
        "energy_joules",
        family="power",
        metric=counter("gpu_agent_gpu_energy_joules_total", "Energy the GPU used since the driver loaded."),
        unit=JOULES,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "mJ", " since the driver loaded"),
    )
    power_instant_watts: float | None = reading(
        FAST_FIELDS,
        "power_instant_watts",
        family="power_instant",
        metric=gauge("gpu_agent_gpu_power_instant_watts", "GPU board power draw right now (not averaged)."),
        unit=WATTS,
        section=TELEMETRY,
    )
    memory_temperature_celsius: int | None = reading(  # HBM
        FAST_FIELDS,
        "memory_temperature_celsius",
        family="temperature",
        metric=gauge("gpu_agent_gpu_memory_temperature_celsius", "Device memory (HBM) temperature."),
        unit=CELSIUS,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_DEV_MEMORY_TEMP", "C", " (HBM)"),
    )
    memory_max_temperature_celsius: int | None = reading(
        slow(
            lambda b, gpu: b.temperature_threshold_celsius(gpu, TemperatureThreshold.MEM_MAX),
            remember_unsupported=True,
        ),
        family="temperature_thresholds",
        metric=gauge(
            "gpu_agent_gpu_memory_temperature_max_celsius",
            "Device memory temperature at which the GPU slows down (memory max threshold).",
        ),
        unit=CELSIUS,
        section=TELEMETRY,
    )
    memory_free_bytes: int | None = reading(
        MEMORY,
        "free_bytes",
        family="memory",
        metric=gauge("gpu_agent_gpu_memory_free_bytes", "Device memory free for allocations."),
        unit=BYTES,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_DEV_FB_FREE", "MiB"),
    )
    # the driver's; not in memory_used_bytes (nvidia-smi's "Used"); None where only memory info v1 answers
    memory_reserved_bytes: int | None = reading(
        MEMORY,
        "reserved_bytes",
        family="memory",
        metric=gauge(
            "gpu_agent_gpu_memory_reserved_bytes",
            "Device memory the driver reserves for itself (not in gpu_agent_gpu_memory_used_bytes).",
        ),
        unit=BYTES,
        section=TELEMETRY,
        dcgm=Dcgm("DCGM_FI_DEV_FB_RESERVED", "MiB"),
    )
    pcie_correctable_errors: int | None = reading(
        SLOW_FIELDS,
        "pcie_correctable_errors",
        family="pcie_errors",
        metric=PCIE_ERRORS,
        labels={"type": "correctable"},
        section=TELEMETRY,
        notable=nonzero,
    )
    pcie_fatal_errors: int | None = reading(
        SLOW_FIELDS,
        "pcie_fatal_errors",
        family="pcie_errors",
        metric=PCIE_ERRORS,
        labels={"type": "fatal"},
        section=TELEMETRY,
        notable=nonzero,
    )
    mig_enabled: bool | None = reading(
        MIG,
        "current",
        family="modes",
        metric=gauge("gpu_agent_gpu_mig_mode_enabled", "1 when MIG mode is on now."),
        unit=FLAG,
        section=TELEMETRY,
    )
    mig_pending: bool | None = reading(
        MIG,
        "pending",
        family="modes",
        metric=gauge("gpu_agent_gpu_mig_mode_pending_enabled", "1 when MIG mode will be on after the next GPU reset."),
        unit=FLAG,
        section=TELEMETRY,
    )
    max_graphics_clock_mhz: int | None = max_clock(ClockDomain.GRAPHICS)
    max_sm_clock_mhz: int | None = max_clock(ClockDomain.SM)
    max_memory_clock_mhz: int | None = max_clock(ClockDomain.MEMORY)
    applications_graphics_clock_mhz: int | None = applications_clock(ClockDomain.GRAPHICS)
    applications_memory_clock_mhz: int | None = applications_clock(ClockDomain.MEMORY)
    # exported as gpu_agent_gpu_violation_seconds_total where the driver has no per-reason durations
    power_violation_ns: int | None = reading(
        slow(lambda b, gpu: b.violation_time_ns(gpu, ViolationPolicy.POWER)), family="clock_events"
    )
    thermal_violation_ns: int | None = reading(
        slow(lambda b, gpu: b.violation_time_ns(gpu, ViolationPolicy.THERMAL)), family="clock_events"
    )
    violation_reason_ns: Mapping[str, int] | None = reading(  # VIOLATION_REASONS label -> ns held back
        SLOW_FIELDS,
        "violation_ns",
        family="clock_events",
        metric=counter(
            "gpu_agent_gpu_violation_seconds_total",
            "Time the GPU was held below its target clocks, per reason (NVML clock-event reason durations; "
            "power and thermal from the violation status where the driver has no per-reason fields).",
        ),
        shape=VIOLATIONS,
        unit=NANOSECONDS,
        section=TELEMETRY,
        notable=nonzero,
        dcgm=(
            Dcgm("DCGM_FI_DEV_POWER_VIOLATION", "us", select='reason=~"sw_power_cap|power"'),
            Dcgm("DCGM_FI_DEV_THERMAL_VIOLATION", "us", select='reason=~"sw_thermal|hw_thermal|thermal"'),
        ),
    )
    # Per GPU, every link added up: the counters a fleet watches. A link with errors shows in the
    # per-link family below whether that family is on or not.
    nvlink_error_totals: Mapping[str, int] | None = reading(  # counter -> errors over all links; None: no NVLink
        SLOW_FIELDS,
        "nvlink_error_totals",
        family="nvlink",
        metric=counter(
            "gpu_agent_gpu_nvlink_errors_total",
            "NVLink errors of all links per counter (CRC flit, CRC data, replay, recovery) since the driver loaded.",
        ),
        shape=per_key("counter"),
        section=TELEMETRY,
        notable=nonzero,
        dcgm=tuple(
            Dcgm(f"DCGM_FI_DEV_NVLINK_{name.upper()}_ERROR_COUNT_TOTAL", "count", ", all links", f'counter="{name}"')
            for name in ("crc_flit", "crc_data", "replay", "recovery")
        ),
    )
    nvlink_errors: tuple[NvLinkErrors, ...] | None = reading(  # None: no NVLink
        SLOW_FIELDS,
        "nvlink_errors",
        family="nvlink_links",
        metric=counter(
            "gpu_agent_gpu_nvlink_link_errors_total",
            "NVLink errors per link and counter since the driver loaded (with the family off: the counters that "
            "are not 0).",
        ),
        shape=NVLINK_ERRORS,
        section=TELEMETRY,
        notable=nonzero,
    )
    nvlink_up: tuple[bool, ...] | None = reading(  # per link
        slow(lambda b, gpu: b.nvlink_states(gpu), remember_unsupported=True),
        family="nvlink_links",
        metric=gauge("gpu_agent_gpu_nvlink_up", "1 while an NVLink link is active (with the family off: links down)."),
        shape=per_position("link"),
        unit=FLAG,
        section=TELEMETRY,
        notable=zero,
    )
    fabric_state: int | None = reading(  # FabricState; None: no NVSwitch fabric
        FABRIC,
        "state",
        family="fabric",
        metric=gauge(
            "gpu_agent_gpu_fabric_state",
            "NVSwitch fabric registration state, one series per state, 1 for the current one; CUDA runs "
            "only once it is completed.",
        ),
        shape=one_hot("state", fabric_states),
        unit=FLAG,
        section=TELEMETRY,
        notable=current_except("state", "completed", "not_supported"),
    )
    fabric_status: int | None = reading(  # nvmlReturn_t of the fabric registration
        FABRIC,
        "status",
        family="fabric",
        metric=gauge("gpu_agent_gpu_fabric_status", "NVML return code of the fabric registration (0: success)."),
        section=TELEMETRY,
        notable=nonzero,
    )
    # Compute processes with their GPU memory, for `status` and the attribution to services; not a
    # metric: a pid label would add a series per process incarnation. /metrics has the memory per
    # service and, for processes of no service, per command name (agent/metrics/services.py).
    processes: tuple[GpuProcess, ...] | None = reading(
        slow(lambda b, gpu: tuple(b.compute_processes(gpu)), remember_unsupported=True), family="processes"
    )

    read_errors: dict[str, str] = field(default_factory=dict)


#: Every row, in /metrics order.
ROWS = rows_of(GpuSample)
#: The calls of each tier, each once, in the order of their first row.
FAST_READERS = readers(ROWS, Tier.FAST)
SLOW_READERS = readers(ROWS, Tier.SLOW)
#: The GpuSample fields only the slow tier reads.
SLOW_TIER_FIELDS: tuple[str, ...] = tuple(name for reader in SLOW_READERS for name, _ in reader.fields)
