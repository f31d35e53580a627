"""What several rows of the reading table (agent/readings/table.py) share: the calls whose one answer
fills several rows, the families whose series several rows give (told apart by a label), and the
rows made alike (an ECC counter, a clock the board reports per domain), each built by one function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.backend.base import ClockDomain, EccCounter, EccErrorType, GpuBackend
from agent.readings.row import MHZ, Dcgm, Metric, Section, counter, fast, gauge, nonzero, reading, slow

# Calls whose answer fills several rows.
UTILIZATION = fast(lambda b, gpu: b.utilization(gpu), "utilization")
MEMORY = fast(lambda b, gpu: b.memory_info(gpu), "memory")
ECC_MODE = fast(lambda b, gpu: b.ecc_mode(gpu), "ecc")
GPM = fast(
    lambda b, gpu: b.gpm_activity(gpu), "gpm_activity", remember_unsupported=True, supported_field="activity_supported"
)
FAST_FIELDS = fast(lambda b, gpu: b.fast_fields(gpu), "fast_fields", remember_unsupported=True)
REMAPPED_ROWS = slow(lambda b, gpu: b.remapped_rows(gpu), "remapped_rows")
PCIE_LINK = slow(lambda b, gpu: b.pcie_link(gpu), "pcie")
SLOW_FIELDS = slow(lambda b, gpu: b.slow_fields(gpu), "slow_fields", remember_unsupported=True)
MIG = slow(lambda b, gpu: b.mig_mode(gpu), "mig", remember_unsupported=True)
FABRIC = slow(lambda b, gpu: b.fabric_info(gpu), "fabric", remember_unsupported=True)

# Families of more than one row: their series differ by a label.
TEMPERATURE_THRESHOLD = gauge(
    "gpu_agent_gpu_temperature_threshold_celsius",
    "Temperature at which the GPU slows down (slowdown) or shuts down (shutdown).",
)
CLOCK = gauge("gpu_agent_gpu_clock_hertz", "Current clock frequency per clock domain.")
# NVML's aggregate counters persist across reboots (a true counter); volatile ones restart at
# every driver load and are exported as a gauge of "errors since the driver loaded".
ECC_ERRORS = counter("gpu_agent_gpu_ecc_errors_total", "ECC errors over the GPU's lifetime (NVML aggregate counter).")
ECC_VOLATILE_ERRORS = gauge(
    "gpu_agent_gpu_ecc_volatile_errors", "ECC errors since the driver was loaded (NVML volatile counter)."
)
REMAPPED = gauge("gpu_agent_gpu_remapped_rows", "Memory rows remapped, by the kind of error that caused the remap.")
PCIE_ERRORS = counter(
    "gpu_agent_gpu_pcie_errors_total", "PCIe errors the GPU counted since the driver loaded, per type."
)
MAX_CLOCK = gauge("gpu_agent_gpu_max_clock_hertz", "Highest clock frequency the GPU supports per clock domain.")
APPLICATIONS_CLOCK = gauge(
    "gpu_agent_gpu_applications_clock_hertz",
    "Applications clock per clock domain (the target clock when nothing holds it back).",
)


def ecc_counter(error: EccErrorType, kept: EccCounter, dcgm_field: str) -> Any:
    """The row of one of NVML's ECC counters: an aggregate one (kept across reboots) in the counter
    family, a volatile one (since the driver loaded) in the gauge family; either labelled by the type."""
    kind, counted = error.name.lower(), kept.name.lower()
    return reading(
        slow(lambda backend, gpu: backend.ecc_errors(gpu, error, kept)),
        family="ecc",
        metric=ECC_ERRORS if kept is EccCounter.AGGREGATE else ECC_VOLATILE_ERRORS,
        labels={"type": kind},
        dcgm=Dcgm(dcgm_field, "count", f" (NVML's {kind} {counted} counter)"),
        notable=nonzero,
    )


def max_clock(domain: ClockDomain) -> Any:
    """The row of the highest clock a domain supports."""
    return _board_clock(MAX_CLOCK, domain, lambda backend, gpu: backend.max_clock_mhz(gpu, domain))


def applications_clock(domain: ClockDomain) -> Any:
    """The row of a domain's applications clock."""
    return _board_clock(APPLICATIONS_CLOCK, domain, lambda backend, gpu: backend.applications_clock_mhz(gpu, domain))


def _board_clock(metric: Metric, domain: ClockDomain, read: Callable[[GpuBackend, int], int]) -> Any:
    """A clock the board reports per domain: asked in the slow tier (once, where the board does not
    answer it), a series of `metric` in the telemetry section labelled by the domain."""
    return reading(
        slow(read, remember_unsupported=True),
        family="clock_details",
        metric=metric,
        labels={"clock": domain.name.lower()},
        unit=MHZ,
        section=Section.TELEMETRY,
    )
