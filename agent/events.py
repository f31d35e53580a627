"""The typed event stream and per-GPU health that watchers produce and rules, metrics and the
store consume."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Severity(str, Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"
    FATAL = "fatal"


class EventKind(str, Enum):
    XID = "xid"
    THROTTLE_STARTED = "throttle_started"
    THROTTLE_ENDED = "throttle_ended"
    TEMPERATURE_MARGIN_LOW = "temperature_margin_low"
    ECC_CORRECTED = "ecc_corrected"
    ECC_UNCORRECTED = "ecc_uncorrected"
    ROW_REMAP_PENDING = "row_remap_pending"
    ROW_REMAP_FAILED = "row_remap_failed"
    RETIRED_PAGES_PENDING = "retired_pages_pending"
    GPU_LOST = "gpu_lost"
    GPU_RESET_REQUIRED = "gpu_reset_required"
    GPU_RECOVERED = "gpu_recovered"
    GPU_ADDED = "gpu_added"
    GPU_REMOVED = "gpu_removed"
    PCIE_DEGRADED = "pcie_degraded"
    PCIE_RESTORED = "pcie_restored"
    RECOVERY_ACTION = "recovery_action"  # Xid 154: the driver says what recovery the GPU needs
    SERVICE_UNHEALTHY = "service_unhealthy"
    SERVICE_HEALTHY = "service_healthy"
    SERVICE_LATENCY_REGRESSION = "service_latency_regression"  # a service's own p95 misses its SLO
    POLICY_DRIFT = "policy_drift"


#: Which condition events a clearing event ends (for alert resolution and fault episodes).
CLEARS: dict[EventKind, frozenset[EventKind]] = {
    EventKind.SERVICE_HEALTHY: frozenset({EventKind.SERVICE_UNHEALTHY}),
    EventKind.THROTTLE_ENDED: frozenset({EventKind.THROTTLE_STARTED}),
    EventKind.PCIE_RESTORED: frozenset({EventKind.PCIE_DEGRADED}),
    EventKind.GPU_RECOVERED: frozenset({EventKind.GPU_LOST, EventKind.GPU_RESET_REQUIRED}),
}


class HealthState(str, Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"  # works, but something needs attention (throttling, correctable errors)
    UNHEALTHY = "unhealthy"  # cannot be trusted with work until acted on


class SuggestedAction(str, Enum):
    NONE = "none"
    ALERT = "alert"
    RESTART_SERVICE = "restart_service"
    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"
    CHECK_MECHANICALS = "check_mechanicals"  # cooling, power, seating
    CONTACT_SUPPORT = "contact_support"


@dataclass(frozen=True)
class Event:
    kind: EventKind
    severity: Severity
    gpu: int | None
    uuid: str | None
    message: str
    timestamp_seconds: float
    source: str  # "nvml", "kmsg", "journal", "poll", "udev", "probe", "policy"
    #: Identity of the fault: two events with the same key within the dedupe window are one fault.
    key: str
    data: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    suggested_action: SuggestedAction = SuggestedAction.NONE


@dataclass(frozen=True)
class Health:
    state: HealthState
    reason: str = ""
    suggested_action: SuggestedAction = SuggestedAction.NONE

    @classmethod
    def healthy(cls) -> Health:
        return cls(HealthState.HEALTHY)
