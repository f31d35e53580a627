"""Reads GPU samples through the backend, one field at a time, so one failing call costs one field.

NOT_SUPPORTED leaves the field None silently (a fan-less board); any other failure is recorded
in `read_errors`; GPU_LOST stops reading that GPU and marks it down.

Two tiers: the fast tier is read every loop; the slow tier (counters and link state, 0.2-1.3 ms
per call on an H200) every few loops, and `SLOW_TIER_FIELDS` names what it fills, so a fast-tier
sample can carry the last slow readings forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class _Reader:
    """One backend call. `name` keys `read_errors`; the reading fills the sample field `name`, or,
    for a structured reading, each of `fields` from the reading's attribute of the same position."""

    name: str
    read: Callable[[GpuBackend, int], Any]
    fields: tuple[tuple[str, str], ...] = ()  # (sample field, attribute of the reading)

    def values(self, reading: Any) -> dict[str, Any]:
        if not self.fields:
            return {self.name: reading}
        return {field: getattr(reading, attribute) for field, attribute in self.fields}

    def field_names(self) -> tuple[str, ...]:
        return tuple(field for field, _ in self.fields) or (self.name,)


def _fans(backend: GpuBackend, gpu: int) -> tuple[int, ...]:
    count = backend.fan_count(gpu)
    if count == 0:  # fan-less (SXM) board: the same as NVML's NOT_SUPPORTED for the speed
        raise GpuError(GpuErrorKind.NOT_SUPPORTED, "board has no fans", gpu, "fan_count")
    return tuple(backend.fan_speed_percent(gpu, fan) for fan in range(count))


def _ecc(error: EccErrorType, counter: EccCounter) -> Callable[[GpuBackend, int], int]:
    return lambda backend, gpu: backend.ecc_errors(gpu, error, counter)


FAST_READERS: tuple[_Reader, ...] = (
    _Reader("temperature_celsius", lambda b, gpu: b.temperature_celsius(gpu)),
    _Reader("power_usage_watts", lambda b, gpu: b.power_usage_watts(gpu)),
    _Reader("power_limit_watts", lambda b, gpu: b.power_limit_watts(gpu)),
    _Reader("graphics_clock_mhz", lambda b, gpu: b.clock_mhz(gpu, ClockDomain.GRAPHICS)),
    _Reader("sm_clock_mhz", lambda b, gpu: b.clock_mhz(gpu, ClockDomain.SM)),
    _Reader("memory_clock_mhz", lambda b, gpu: b.clock_mhz(gpu, ClockDomain.MEMORY)),
    _Reader("clock_event_reasons", lambda b, gpu: b.clock_event_reasons(gpu)),
    _Reader(
        "utilization",
        lambda b, gpu: b.utilization(gpu),
        (("gpu_utilization_percent", "gpu_percent"), ("memory_utilization_percent", "memory_percent")),
    ),
    _Reader(
        "memory",
        lambda b, gpu: b.memory_info(gpu),
        (("memory_used_bytes", "used_bytes"), ("memory_total_bytes", "total_bytes")),
    ),
    _Reader("performance_state", lambda b, gpu: b.performance_state(gpu)),
    _Reader("fan_speeds_percent", _fans),
    _Reader("persistence_enabled", lambda b, gpu: b.persistence_enabled(gpu)),
    _Reader("ecc", lambda b, gpu: b.ecc_mode(gpu), (("ecc_enabled", "current"), ("ecc_pending", "pending"))),
)

SLOW_READERS: tuple[_Reader, ...] = (
    _Reader("ecc_corrected_volatile", _ecc(EccErrorType.CORRECTED, EccCounter.VOLATILE)),
    _Reader("ecc_uncorrected_volatile", _ecc(EccErrorType.UNCORRECTED, EccCounter.VOLATILE)),
    _Reader("ecc_corrected_aggregate", _ecc(EccErrorType.CORRECTED, EccCounter.AGGREGATE)),
    _Reader("ecc_uncorrected_aggregate", _ecc(EccErrorType.UNCORRECTED, EccCounter.AGGREGATE)),
    _Reader(
        "remapped_rows",
        lambda b, gpu: b.remapped_rows(gpu),
        (
            ("remapped_rows_correctable", "correctable"),
            ("remapped_rows_uncorrectable", "uncorrectable"),
            ("remap_pending", "pending"),
            ("remap_failed", "failed"),
        ),
    ),
    _Reader("retired_pages_pending", lambda b, gpu: b.retired_pages_pending(gpu)),
    _Reader(
        "pcie",
        lambda b, gpu: b.pcie_link(gpu),
        (
            ("pcie_generation", "current_generation"),
            ("pcie_width", "current_width"),
            ("pcie_max_generation", "max_generation"),
            ("pcie_max_width", "max_width"),
        ),
    ),
    _Reader("pcie_replay_count", lambda b, gpu: b.pcie_replay_counter(gpu)),
    _Reader(
        "slowdown_temperature_celsius",
        lambda b, gpu: b.temperature_threshold_celsius(gpu, TemperatureThreshold.SLOWDOWN),
    ),
    _Reader(
        "shutdown_temperature_celsius",
        lambda b, gpu: b.temperature_threshold_celsius(gpu, TemperatureThreshold.SHUTDOWN),
    ),
    _Reader("power_violation_ns", lambda b, gpu: b.violation_time_ns(gpu, ViolationPolicy.POWER)),
    _Reader("thermal_violation_ns", lambda b, gpu: b.violation_time_ns(gpu, ViolationPolicy.THERMAL)),
    _Reader("recovery_action", lambda b, gpu: b.recovery_action(gpu)),
)

#: The GpuSample fields only the slow tier reads.
SLOW_TIER_FIELDS: tuple[str, ...] = tuple(field for reader in SLOW_READERS for field in reader.field_names())


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
    for reader in FAST_READERS + SLOW_READERS if slow else FAST_READERS:
        try:
            reading = reader.read(backend, identity.index)
        except GpuError as exc:
            if exc.kind is GpuErrorKind.NOT_SUPPORTED:
                continue
            errors[reader.name] = exc.kind.value
            if exc.kind in _LOST_KINDS:
                up = False
                break
            continue
        values.update(reader.values(reading))
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


def carry_slow_fields(previous: GpuSample, fresh: GpuSample) -> GpuSample:
    """A fast-tier sample of a GPU that answers keeps the last slow-tier readings, so metrics do not
    flap between slow passes."""
    if not fresh.up:
        return fresh
    return replace(fresh, **{name: getattr(previous, name) for name in SLOW_TIER_FIELDS})


def sample_all(backend: GpuBackend) -> list[GpuSample]:
    return [sample_gpu(backend, gpu) for gpu in range(backend.device_count())]
