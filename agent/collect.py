"""Reads GPU samples through the backend, one field at a time, so one failing call costs one field.

NOT_SUPPORTED leaves the field None silently (a fan-less board); any other failure is recorded
in `read_errors`; GPU_LOST stops reading that GPU and marks it down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.backend.base import (
    ClockDomain,
    EccCounter,
    EccErrorType,
    GpuBackend,
    GpuIdentity,
    TemperatureThreshold,
    ViolationPolicy,
)
from agent.backend.errors import GpuError, GpuErrorKind
from agent.state import GpuSample

_LOST_KINDS = frozenset({GpuErrorKind.GPU_LOST, GpuErrorKind.RESET_REQUIRED})


def _fans(backend: GpuBackend, gpu: int) -> tuple[int, ...]:
    count = backend.fan_count(gpu)
    if count == 0:  # fan-less (SXM) board: the same as NVML's NOT_SUPPORTED for the speed
        raise GpuError(GpuErrorKind.NOT_SUPPORTED, "board has no fans", gpu, "fan_count")
    return tuple(backend.fan_speed_percent(gpu, fan) for fan in range(count))


def _fast_readers(backend: GpuBackend, gpu: int) -> list[tuple[str, Callable[[], Any]]]:
    return [
        ("temperature_celsius", lambda: backend.temperature_celsius(gpu)),
        ("power_usage_watts", lambda: backend.power_usage_watts(gpu)),
        ("power_limit_watts", lambda: backend.power_limit_watts(gpu)),
        ("graphics_clock_mhz", lambda: backend.clock_mhz(gpu, ClockDomain.GRAPHICS)),
        ("sm_clock_mhz", lambda: backend.clock_mhz(gpu, ClockDomain.SM)),
        ("memory_clock_mhz", lambda: backend.clock_mhz(gpu, ClockDomain.MEMORY)),
        ("clock_event_reasons", lambda: backend.clock_event_reasons(gpu)),
        ("utilization", lambda: backend.utilization(gpu)),
        ("memory", lambda: backend.memory_info(gpu)),
        ("performance_state", lambda: backend.performance_state(gpu)),
        ("fan_speeds_percent", lambda: _fans(backend, gpu)),
        ("persistence_enabled", lambda: backend.persistence_enabled(gpu)),
        ("ecc", lambda: backend.ecc_mode(gpu)),
    ]


def _slow_readers(backend: GpuBackend, gpu: int) -> list[tuple[str, Callable[[], Any]]]:
    def ecc(error: EccErrorType, counter: EccCounter) -> Callable[[], int]:
        return lambda: backend.ecc_errors(gpu, error, counter)

    return [
        ("ecc_corrected_volatile", ecc(EccErrorType.CORRECTED, EccCounter.VOLATILE)),
        ("ecc_uncorrected_volatile", ecc(EccErrorType.UNCORRECTED, EccCounter.VOLATILE)),
        ("ecc_corrected_aggregate", ecc(EccErrorType.CORRECTED, EccCounter.AGGREGATE)),
        ("ecc_uncorrected_aggregate", ecc(EccErrorType.UNCORRECTED, EccCounter.AGGREGATE)),
        ("remapped_rows", lambda: backend.remapped_rows(gpu)),
        ("retired_pages_pending", lambda: backend.retired_pages_pending(gpu)),
        ("pcie", lambda: backend.pcie_link(gpu)),
        ("pcie_replay_count", lambda: backend.pcie_replay_counter(gpu)),
        (
            "slowdown_temperature_celsius",
            lambda: backend.temperature_threshold_celsius(gpu, TemperatureThreshold.SLOWDOWN),
        ),
        (
            "shutdown_temperature_celsius",
            lambda: backend.temperature_threshold_celsius(gpu, TemperatureThreshold.SHUTDOWN),
        ),
        ("power_violation_ns", lambda: backend.violation_time_ns(gpu, ViolationPolicy.POWER)),
        ("thermal_violation_ns", lambda: backend.violation_time_ns(gpu, ViolationPolicy.THERMAL)),
        ("recovery_action", lambda: backend.recovery_action(gpu)),
    ]


def sample_gpu(
    backend: GpuBackend, gpu: int, *, slow: bool = True, clock: Callable[[], float] = time.time
) -> GpuSample:
    """All fast readings, and the slow tier too when `slow`."""
    try:
        identity = backend.identity(gpu)
    except GpuError as exc:
        return GpuSample(gpu, "", "", "", up=False, timestamp_seconds=clock(), read_errors={"identity": exc.kind.value})
    return sample_identified(backend, identity, slow=slow, clock=clock)


def sample_identified(
    backend: GpuBackend, identity: GpuIdentity, *, slow: bool = True, clock: Callable[[], float] = time.time
) -> GpuSample:
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    up = True
    readers = _fast_readers(backend, identity.index)
    if slow:
        readers += _slow_readers(backend, identity.index)
    for name, read in readers:
        try:
            value = read()
        except GpuError as exc:
            if exc.kind is GpuErrorKind.NOT_SUPPORTED:
                continue
            errors[name] = exc.kind.value
            if exc.kind in _LOST_KINDS:
                up = False
                break
            continue
        if name == "utilization":
            values["gpu_utilization_percent"] = value.gpu_percent
            values["memory_utilization_percent"] = value.memory_percent
        elif name == "memory":
            values["memory_used_bytes"] = value.used_bytes
            values["memory_total_bytes"] = value.total_bytes
        elif name == "ecc":
            values["ecc_enabled"] = value.current
            values["ecc_pending"] = value.pending
        elif name == "remapped_rows":
            values["remapped_rows_correctable"] = value.correctable
            values["remapped_rows_uncorrectable"] = value.uncorrectable
            values["remap_pending"] = value.pending
            values["remap_failed"] = value.failed
        elif name == "pcie":
            values["pcie_generation"] = value.current_generation
            values["pcie_width"] = value.current_width
            values["pcie_max_generation"] = value.max_generation
            values["pcie_max_width"] = value.max_width
        else:
            values[name] = value
    return GpuSample(
        identity.index,
        identity.uuid,
        identity.name,
        identity.pci_bus_id,
        up=up,
        timestamp_seconds=clock(),
        read_errors=errors,
        **values,
    )


def sample_all(backend: GpuBackend) -> list[GpuSample]:
    return [sample_gpu(backend, gpu) for gpu in range(backend.device_count())]
