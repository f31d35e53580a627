"""Reads GPU samples through the backend, one field at a time, so one failing call costs one field.

NOT_SUPPORTED leaves the field None silently (a fan-less board); any other failure is recorded
in `read_errors`; GPU_LOST stops reading that GPU and marks it down. The profiling telemetry
readers (GPM, field values, NVLink, fabric, ...) remember a NOT_SUPPORTED answer per GPU in the
caller's `unsupported` set and are not asked again: an older GPU costs one call, never a loop of them.

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
    remember_unsupported: bool = False  # a NOT_SUPPORTED answer stands for this GPU from then on
    when_unsupported: tuple[tuple[str, Any], ...] = ()  # sample values while NOT_SUPPORTED
    when_answered: tuple[tuple[str, Any], ...] = ()  # sample values whenever the call answers

    def values(self, reading: Any) -> dict[str, Any]:
        answered = dict(self.when_answered)
        if reading is None and self.fields:  # e.g. the first GPM sample: nothing to difference yet
            return answered
        if not self.fields:
            return {**answered, self.name: reading}
        return {**answered, **{field: getattr(reading, attribute) for field, attribute in self.fields}}

    def field_names(self) -> tuple[str, ...]:
        return tuple(field for field, _ in self.fields) or (self.name,)


def _fans(backend: GpuBackend, gpu: int) -> tuple[int, ...]:
    count = backend.fan_count(gpu)
    if count == 0:  # fan-less (SXM) board: the same as NVML's NOT_SUPPORTED for the speed
        raise GpuError(GpuErrorKind.NOT_SUPPORTED, "board has no fans", gpu, "fan_count")
    return tuple(backend.fan_speed_percent(gpu, fan) for fan in range(count))


def _named(*attributes: str, prefix: str = "") -> tuple[tuple[str, str], ...]:
    """`fields` where each sample field is the reading's attribute of that name after `prefix`."""
    return tuple((prefix + attribute, attribute) for attribute in attributes)


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
        _named("used_bytes", "total_bytes", "free_bytes", "reserved_bytes", prefix="memory_"),
    ),
    _Reader("performance_state", lambda b, gpu: b.performance_state(gpu)),
    _Reader("fan_speeds_percent", _fans),
    _Reader("persistence_enabled", lambda b, gpu: b.persistence_enabled(gpu)),
    _Reader("ecc", lambda b, gpu: b.ecc_mode(gpu), (("ecc_enabled", "current"), ("ecc_pending", "pending"))),
    _Reader(
        "gpm_activity",
        lambda b, gpu: b.gpm_activity(gpu),
        _named(
            "sm_active_ratio",
            "sm_occupancy_ratio",
            "tensor_active_ratio",
            "dram_active_ratio",
            "pcie_tx_bytes_per_second",
            "pcie_rx_bytes_per_second",
            "nvlink_tx_bytes_per_second",
            "nvlink_rx_bytes_per_second",
        ),
        remember_unsupported=True,
        when_unsupported=(("activity_supported", False),),
        when_answered=(("activity_supported", True),),
    ),
    _Reader(
        "fast_fields",
        lambda b, gpu: b.fast_fields(gpu),
        _named("power_instant_watts", "memory_temperature_celsius"),
        remember_unsupported=True,
    ),
)

SLOW_READERS: tuple[_Reader, ...] = (
    _Reader("ecc_corrected_volatile", _ecc(EccErrorType.CORRECTED, EccCounter.VOLATILE)),
    _Reader("ecc_uncorrected_volatile", _ecc(EccErrorType.UNCORRECTED, EccCounter.VOLATILE)),
    _Reader("ecc_corrected_aggregate", _ecc(EccErrorType.CORRECTED, EccCounter.AGGREGATE)),
    _Reader("ecc_uncorrected_aggregate", _ecc(EccErrorType.UNCORRECTED, EccCounter.AGGREGATE)),
    _Reader(
        "remapped_rows",
        lambda b, gpu: b.remapped_rows(gpu),
        _named("correctable", "uncorrectable", prefix="remapped_rows_") + _named("pending", "failed", prefix="remap_"),
    ),
    _Reader("retired_pages_pending", lambda b, gpu: b.retired_pages_pending(gpu)),
    _Reader(
        "pcie",
        lambda b, gpu: b.pcie_link(gpu),
        (
            ("pcie_generation", "current_generation"),
            ("pcie_width", "current_width"),
            *_named("max_generation", "max_width", prefix="pcie_"),
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
    _Reader(
        "slow_fields",
        lambda b, gpu: b.slow_fields(gpu),
        (
            *_named("energy_joules", "pcie_correctable_errors", "pcie_fatal_errors", "nvlink_errors"),
            ("violation_reason_ns", "violation_ns"),
        ),
        remember_unsupported=True,
    ),
    _Reader("nvlink_up", lambda b, gpu: b.nvlink_states(gpu), remember_unsupported=True),
    _Reader(
        "fabric",
        lambda b, gpu: b.fabric_info(gpu),
        _named("state", "status", prefix="fabric_"),
        remember_unsupported=True,
    ),
    _Reader(
        "memory_max_temperature_celsius",
        lambda b, gpu: b.temperature_threshold_celsius(gpu, TemperatureThreshold.MEM_MAX),
        remember_unsupported=True,
    ),
    _Reader(
        "mig",
        lambda b, gpu: b.mig_mode(gpu),
        (("mig_enabled", "current"), ("mig_pending", "pending")),
        remember_unsupported=True,
    ),
    _Reader(
        "max_graphics_clock_mhz", lambda b, gpu: b.max_clock_mhz(gpu, ClockDomain.GRAPHICS), remember_unsupported=True
    ),
    _Reader("max_sm_clock_mhz", lambda b, gpu: b.max_clock_mhz(gpu, ClockDomain.SM), remember_unsupported=True),
    _Reader("max_memory_clock_mhz", lambda b, gpu: b.max_clock_mhz(gpu, ClockDomain.MEMORY), remember_unsupported=True),
    _Reader(
        "applications_graphics_clock_mhz",
        lambda b, gpu: b.applications_clock_mhz(gpu, ClockDomain.GRAPHICS),
        remember_unsupported=True,
    ),
    _Reader(
        "applications_memory_clock_mhz",
        lambda b, gpu: b.applications_clock_mhz(gpu, ClockDomain.MEMORY),
        remember_unsupported=True,
    ),
    _Reader("processes", lambda b, gpu: tuple(b.compute_processes(gpu)), remember_unsupported=True),
)

#: The GpuSample fields only the slow tier reads.
SLOW_TIER_FIELDS: tuple[str, ...] = tuple(field for reader in SLOW_READERS for field in reader.field_names())


def sample_gpu(
    backend: GpuBackend,
    gpu: int,
    *,
    slow: bool = True,
    clock: Callable[[], float] = time.time,
    unsupported: set[str] | None = None,
) -> GpuSample:
    """All fast readings, and the slow tier too when `slow`."""
    try:
        identity = backend.identity(gpu)
    except GpuError as exc:
        return GpuSample(gpu, "", "", "", up=False, timestamp_seconds=clock(), read_errors={"identity": exc.kind.value})
    return sample_identified(backend, identity, slow=slow, clock=clock, unsupported=unsupported)


def sample_identified(
    backend: GpuBackend,
    identity: GpuIdentity,
    *,
    slow: bool = True,
    clock: Callable[[], float] = time.time,
    unsupported: set[str] | None = None,
) -> GpuSample:
    """`unsupported`: the readers this GPU answered NOT_SUPPORTED before (kept by the caller per
    GPU, and added to here); a one-off read passes none and asks everything once."""
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    up = True
    known_unsupported = unsupported if unsupported is not None else set()
    for reader in FAST_READERS + SLOW_READERS if slow else FAST_READERS:
        if reader.name in known_unsupported:
            values.update(reader.when_unsupported)
            continue
        try:
            reading = reader.read(backend, identity.index)
        except GpuError as exc:
            if exc.kind is GpuErrorKind.NOT_SUPPORTED:
                values.update(reader.when_unsupported)
                if reader.remember_unsupported:
                    known_unsupported.add(reader.name)
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
