"""The readings of the table that are more than one value: how the fans are read, and how a state,
the held-back time per reason and the NVLink error counters per link become series."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from agent.backend.base import FabricState, GpuBackend, NvLinkErrors, RecoveryAction
from agent.backend.errors import GpuError, GpuErrorKind
from agent.readings.row import Labels, Shape


class _ViolationStatus(Protocol):
    """What the held-back time falls back to where the driver has no per-reason durations."""

    @property
    def power_violation_ns(self) -> int | None: ...
    @property
    def thermal_violation_ns(self) -> int | None: ...


def read_fans(backend: GpuBackend, gpu: int) -> tuple[int, ...]:
    count = backend.fan_count(gpu)
    if count == 0:  # fan-less (SXM) board: the same as NVML's NOT_SUPPORTED for the speed
        raise GpuError(GpuErrorKind.NOT_SUPPORTED, "board has no fans", gpu, "fan_count")
    return tuple(backend.fan_speed_percent(gpu, fan) for fan in range(count))


def recovery_actions(value: int) -> tuple[list[str], str]:
    """The known actions and the current one; a value newer than this code gets its own `unknown_N` series."""
    names = [action.name.lower() for action in RecoveryAction]
    try:
        current = RecoveryAction(value).name.lower()
    except ValueError:
        current = f"unknown_{value}"
        names.append(current)
    return names, current


def fabric_states(value: int) -> tuple[list[str], str | None]:
    """The registration states and the current one (none of them for a state newer than this code)."""
    names = {state.value: state.name.lower() for state in FabricState}
    return list(names.values()), names.get(value)


def _violations(by_reason: Mapping[str, int] | None, sample: _ViolationStatus) -> Iterator[tuple[Labels, int | None]]:
    """Per reason from the field values; where the driver has none, power and thermal from the violation status."""
    held: list[tuple[str, int | None]] = sorted((by_reason or {}).items())
    for reason, ns in held or [("power", sample.power_violation_ns), ("thermal", sample.thermal_violation_ns)]:
        yield (("reason", reason),), ns


def _nvlink_errors(links: Sequence[NvLinkErrors] | None, _sample: object) -> Iterator[tuple[Labels, int]]:
    for errors in links or ():
        for name, count in sorted(errors.counts.items()):
            yield (("link", str(errors.link)), ("counter", name)), count


VIOLATIONS = Shape(("reason",), _violations)
NVLINK_ERRORS = Shape(("link", "counter"), _nvlink_errors)
