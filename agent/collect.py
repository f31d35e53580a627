"""Reads GPU samples through the backend, one call at a time, so one failing call costs its fields.

The calls and the fields each fills are the reading table's (`agent/readings/table.py`).
NOT_SUPPORTED leaves the fields None silently (a fan-less board); any other failure is recorded
in `read_errors`; GPU_LOST stops reading that GPU and marks it down. The profiling telemetry
calls (GPM, field values, NVLink, fabric, ...) remember a NOT_SUPPORTED answer per GPU in the
caller's `unsupported` set and are not asked again: an older GPU costs one call, never a loop of them.

Two tiers: the fast tier is read every loop; the slow tier (counters and link state, 0.2-1.3 ms
per call on an H200) every few loops, and `SLOW_TIER_FIELDS` names what it fills, so a fast-tier
sample can carry the last slow readings forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from agent.backend.base import GpuBackend, GpuIdentity
from agent.backend.errors import GpuError, GpuErrorKind
from agent.readings.table import FAST_READERS, SLOW_READERS, SLOW_TIER_FIELDS, GpuSample

_LOST_KINDS = frozenset({GpuErrorKind.GPU_LOST, GpuErrorKind.RESET_REQUIRED})


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
        call = reader.call
        if call.name in known_unsupported:
            values.update(reader.unsupported_values())
            continue
        try:
            answer = call.read(backend, identity.index)
        except GpuError as exc:
            if exc.kind is GpuErrorKind.NOT_SUPPORTED:
                values.update(reader.unsupported_values())
                if call.remember_unsupported:
                    known_unsupported.add(call.name)
                continue
            errors[call.name] = exc.kind.value
            if exc.kind in _LOST_KINDS:
                up = False
                break
            continue
        values.update(reader.values(answer))
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
