"""Profiling telemetry of every GPU: GPM activity, field values, NVLink, fabric, modes, clocks, processes."""

from __future__ import annotations

from agent.metrics.families import Families, GpuFamily, flag, mhz_to_hertz, ns_to_seconds, single
from agent.state import GpuSample, NodeSnapshot

_VIOLATION_HELP = (
    "Time the GPU was held below its target clocks, per reason (NVML clock-event reason durations; "
    "power and thermal from the violation status where the driver has no per-reason fields)."
)
_FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
_TELEMETRY_FAMILIES: tuple[GpuFamily, ...] = (
    single(
        "gpu_agent_gpu_sm_active_ratio",
        "Fraction of time at least one warp was resident on an SM, averaged over SMs (GPM, since the last loop).",
        lambda s: s.sm_active_ratio,
    ),
    single(
        "gpu_agent_gpu_sm_occupancy_ratio",
        "Resident warps as a fraction of the SMs' maximum (GPM, since the last loop).",
        lambda s: s.sm_occupancy_ratio,
    ),
    single(
        "gpu_agent_gpu_tensor_active_ratio",
        "Fraction of time any tensor pipe was active (GPM, since the last loop).",
        lambda s: s.tensor_active_ratio,
    ),
    single(
        "gpu_agent_gpu_dram_active_ratio",
        "Device memory bandwidth used as a fraction of the maximum (GPM, since the last loop).",
        lambda s: s.dram_active_ratio,
    ),
    single(
        "gpu_agent_gpu_pcie_tx_bytes_per_second",
        "PCIe traffic sent by the GPU (GPM, since the last loop).",
        lambda s: s.pcie_tx_bytes_per_second,
    ),
    single(
        "gpu_agent_gpu_pcie_rx_bytes_per_second",
        "PCIe traffic received by the GPU (GPM, since the last loop).",
        lambda s: s.pcie_rx_bytes_per_second,
    ),
    single(
        "gpu_agent_gpu_nvlink_tx_bytes_per_second",
        "NVLink traffic sent by the GPU over all links (GPM, since the last loop).",
        lambda s: s.nvlink_tx_bytes_per_second,
    ),
    single(
        "gpu_agent_gpu_nvlink_rx_bytes_per_second",
        "NVLink traffic received by the GPU over all links (GPM, since the last loop).",
        lambda s: s.nvlink_rx_bytes_per_second,
    ),
    single(
        "gpu_agent_gpu_energy_joules",
        "Energy the GPU used since the driver loaded.",
        lambda s: s.energy_joules,
        counter=True,
    ),
    single(
        "gpu_agent_gpu_power_instant_watts",
        "GPU board power draw right now (not averaged).",
        lambda s: s.power_instant_watts,
    ),
    single(
        "gpu_agent_gpu_memory_temperature_celsius",
        "Device memory (HBM) temperature.",
        lambda s: s.memory_temperature_celsius,
    ),
    single(
        "gpu_agent_gpu_memory_temperature_max_celsius",
        "Device memory temperature at which the GPU slows down (memory max threshold).",
        lambda s: s.memory_max_temperature_celsius,
    ),
    single(
        "gpu_agent_gpu_memory_free_bytes",
        "Device memory free for allocations.",
        lambda s: s.memory_free_bytes,
    ),
    single(
        "gpu_agent_gpu_memory_reserved_bytes",
        "Device memory the driver reserves for itself (not in gpu_agent_gpu_memory_used_bytes).",
        lambda s: s.memory_reserved_bytes,
    ),
    GpuFamily(
        "gpu_agent_gpu_pcie_errors",
        "PCIe errors the GPU counted since the driver loaded, per type.",
        (
            ((("type", "correctable"),), lambda s: s.pcie_correctable_errors),
            ((("type", "fatal"),), lambda s: s.pcie_fatal_errors),
        ),
        counter=True,
    ),
    single("gpu_agent_gpu_mig_mode_enabled", "1 when MIG mode is on now.", lambda s: flag(s.mig_enabled)),
    single(
        "gpu_agent_gpu_mig_mode_pending_enabled",
        "1 when MIG mode will be on after the next GPU reset.",
        lambda s: flag(s.mig_pending),
    ),
    GpuFamily(
        "gpu_agent_gpu_max_clock_hertz",
        "Highest clock frequency the GPU supports per clock domain.",
        (
            ((("clock", "graphics"),), lambda s: mhz_to_hertz(s.max_graphics_clock_mhz)),
            ((("clock", "sm"),), lambda s: mhz_to_hertz(s.max_sm_clock_mhz)),
            ((("clock", "memory"),), lambda s: mhz_to_hertz(s.max_memory_clock_mhz)),
        ),
    ),
    GpuFamily(
        "gpu_agent_gpu_applications_clock_hertz",
        "Applications clock per clock domain (the target clock when nothing holds it back).",
        (
            ((("clock", "graphics"),), lambda s: mhz_to_hertz(s.applications_graphics_clock_mhz)),
            ((("clock", "memory"),), lambda s: mhz_to_hertz(s.applications_memory_clock_mhz)),
        ),
    ),
)


def _telemetry(out: Families, sample: GpuSample) -> None:
    """The profiling families of one GPU: GPM activity, field values, NVLink, fabric, modes, clocks, processes."""
    ids = {"gpu": str(sample.index), "uuid": sample.uuid}
    for family in _TELEMETRY_FAMILIES:
        for extra, read in family.series:
            out.add(family.name, family.documentation, {**ids, **dict(extra)}, read(sample), family.counter)
    violations: list[tuple[str, int | None]] = sorted((sample.violation_reason_ns or {}).items())
    if not violations:
        violations = [("power", sample.power_violation_ns), ("thermal", sample.thermal_violation_ns)]
    for reason, ns in violations:
        out.counter("gpu_agent_gpu_violation_seconds", _VIOLATION_HELP, {**ids, "reason": reason}, ns_to_seconds(ns))
    for errors in sample.nvlink_errors or ():
        for counter, count in sorted(errors.counts.items()):
            out.counter(
                "gpu_agent_gpu_nvlink_errors",
                "NVLink errors per link and counter (CRC flit, CRC data, replay, recovery) since the driver loaded.",
                {**ids, "link": str(errors.link), "counter": counter},
                count,
            )
    for link, up in enumerate(sample.nvlink_up or ()):
        out.gauge("gpu_agent_gpu_nvlink_up", "1 while an NVLink link is active.", {**ids, "link": str(link)}, float(up))
    if sample.fabric_state is not None:
        out.one_hot(
            "gpu_agent_gpu_fabric_state",
            "NVSwitch fabric registration state, one series per state, 1 for the current one; CUDA runs "
            "only once it is completed.",
            ids,
            "state",
            _FABRIC_STATES.values(),
            _FABRIC_STATES.get(sample.fabric_state),
        )
        out.gauge(
            "gpu_agent_gpu_fabric_status",
            "NVML return code of the fabric registration (0: success).",
            ids,
            sample.fabric_status,
        )
    for process in sample.processes or ():
        out.gauge(
            "gpu_agent_gpu_process_memory_bytes",
            "Device memory used by each compute process.",
            {**ids, "pid": str(process.pid), "name": process.name or ""},
            process.used_memory_bytes,
        )


def every_gpu(out: Families, snap: NodeSnapshot) -> None:
    for sample in snap.gpus:
        _telemetry(out, sample)
