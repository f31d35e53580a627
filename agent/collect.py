"""Reads GPU samples through the backend, one field at a time, so one failing call costs one field.

NOT_SUPPORTED leaves the field None silently (a fan-less board); any other failure is recorded
in `read_errors`; GPU_LOST stops reading that GPU and marks it down.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.backend.base import ClockDomain, GpuBackend, GpuIdentity
from agent.backend.errors import GpuError, GpuErrorKind
from agent.state import GpuSample

_LOST_KINDS = frozenset({GpuErrorKind.GPU_LOST, GpuErrorKind.RESET_REQUIRED})


def _fans(backend: GpuBackend, gpu: int) -> tuple[int, ...]:
    return tuple(backend.fan_speed_percent(gpu, fan) for fan in range(backend.fan_count(gpu)))


def _readers(backend: GpuBackend, gpu: int) -> list[tuple[str, Callable[[], Any]]]:
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


def sample_gpu(backend: GpuBackend, gpu: int, clock: Callable[[], float] = time.time) -> GpuSample:
    try:
        identity = backend.identity(gpu)
    except GpuError as exc:
        return GpuSample(gpu, "", "", "", up=False, timestamp_seconds=clock(), read_errors={"identity": exc.kind.value})
    return _sample_identified(backend, identity, clock)


def _sample_identified(backend: GpuBackend, identity: GpuIdentity, clock: Callable[[], float]) -> GpuSample:
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    up = True
    for name, read in _readers(backend, identity.index):
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
