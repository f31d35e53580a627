"""Frozen snapshots of what the agent read: the one thing metrics, status and rules look at."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant. A reading is None when the board does not support it or it failed;
    `read_errors` says which failed and how (field -> GpuErrorKind value)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    up: bool  # False: lost, or not even its identity could be read
    timestamp_seconds: float
    temperature_celsius: int | None = None
    power_usage_watts: float | None = None
    power_limit_watts: float | None = None
    graphics_clock_mhz: int | None = None
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    clock_event_reasons: int | None = None
    gpu_utilization_percent: int | None = None
    memory_utilization_percent: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    performance_state: int | None = None
    fan_speeds_percent: tuple[int, ...] | None = None
    persistence_enabled: bool | None = None
    ecc_enabled: bool | None = None
    ecc_pending: bool | None = None
    read_errors: dict[str, str] = field(default_factory=dict)
