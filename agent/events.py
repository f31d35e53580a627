"""The typed event stream and per-GPU health that watchers produce and rules, metrics and the
store consume."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
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
    NVLINK_ERRORS = "nvlink_errors"  # an NVLink error counter grew
    NVLINK_DOWN = "nvlink_down"
    NVLINK_UP = "nvlink_up"
    FABRIC_UNREGISTERED = "fabric_unregistered"  # NVSwitch fabric registration not completed: no CUDA
    FABRIC_REGISTERED = "fabric_registered"
    RECOVERY_ACTION = "recovery_action"  # Xid 154: the driver says what recovery the GPU needs
    SERVICE_UNHEALTHY = "service_unhealthy"
    SERVICE_HEALTHY = "service_healthy"
    SERVICE_LATENCY_REGRESSION = "service_latency_regression"  # a service's own p95 misses its SLO
    POLICY_DRIFT = "policy_drift"
    # An action interrupted on an earlier boot: what it had stopped is reported, never started again.
    REMEDIATION_INTERRUPTED = "remediation_interrupted"


#: Which condition events a clearing event ends (for alert resolution and fault episodes).
CLEARS: dict[EventKind, frozenset[EventKind]] = {
    EventKind.SERVICE_HEALTHY: frozenset({EventKind.SERVICE_UNHEALTHY}),
    EventKind.THROTTLE_ENDED: frozenset({EventKind.THROTTLE_STARTED}),
    EventKind.PCIE_RESTORED: frozenset({EventKind.PCIE_DEGRADED}),
    EventKind.NVLINK_UP: frozenset({EventKind.NVLINK_DOWN}),
    EventKind.FABRIC_REGISTERED: frozenset({EventKind.FABRIC_UNREGISTERED}),
    EventKind.GPU_RECOVERED: frozenset({EventKind.GPU_LOST, EventKind.GPU_RESET_REQUIRED}),
}


class HealthState(str, Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"  # works, but something needs attention (throttling, correctable errors)
    UNHEALTHY = "unhealthy"  # cannot be trusted with work until acted on


class FaultCause(str, Enum):
    """Why a GPU is not healthy, as a bounded code: what `/metrics` puts in a label (the cause of
    `gpu_agent_gpu_health_info`, one series per open fault in `gpu_agent_gpu_fault`), while the
    reason's text, with its readings, stays in `gpu-agent status` and its JSON."""

    XID = "xid"
    GPU_LOST = "gpu_lost"  # fell off the bus
    RESET_REQUIRED = "reset_required"
    GPU_REMOVED = "gpu_removed"  # its device left the node (udev)
    ECC_UNCORRECTED = "ecc_uncorrected"
    ROW_REMAP_FAILED = "row_remap_failed"
    ROW_REMAP_PENDING = "row_remap_pending"
    PAGE_RETIREMENT_PENDING = "page_retirement_pending"
    RECOVERY_ACTION = "recovery_action"  # the driver asks for a reset or reboot
    CLOCKS_SLOWED = "clocks_slowed"  # a thermal or hardware slowdown
    TEMPERATURE_MARGIN = "temperature_margin"  # within a few degrees of the slowdown threshold
    PCIE_DEGRADED = "pcie_degraded"
    NVLINK_DOWN = "nvlink_down"
    NVLINK_ERRORS = "nvlink_errors"
    FABRIC = "fabric"  # NVSwitch fabric registration unfinished or failed
    BACKEND_UNAVAILABLE = "backend_unavailable"
    STALE = "stale"  # NVML calls for the GPU hang


class SuggestedAction(str, Enum):
    """What a fault needs: the one vocabulary of remedies, shared by the Xid catalog (its `action`),
    the watchers' health, rule conditions and the rule actions that carry a remedy out.

    Members are declared least to most drastic, and that order is the one ranking (`rank`,
    `more_drastic`): a reboot also resets every GPU; a reset clears what a support case would first
    ask for; a hardware check (cooling, power, seating) outranks restarting software.
    """

    NONE = "none"
    ALERT = "alert"
    RESTART_SERVICE = "restart_service"
    CHECK_MECHANICALS = "check_mechanicals"  # cooling, power, seating
    CONTACT_SUPPORT = "contact_support"
    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"

    @property
    def rank(self) -> int:
        """0 for NONE, growing with how drastic the remedy is."""
        return ACTION_ORDER.index(self)


#: Least to most drastic.
ACTION_ORDER: tuple[SuggestedAction, ...] = tuple(SuggestedAction)


def more_drastic(a: SuggestedAction, b: SuggestedAction) -> SuggestedAction:
    """The more drastic of two remedies (`a` on a tie)."""
    return a if a.rank >= b.rank else b


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


def event_json(event: Event) -> dict[str, Any]:
    """An event as JSON: `status --json`, `events --json`, hook stdin and webhook bodies."""
    return {
        "kind": event.kind.value,
        "severity": event.severity.value,
        "gpu": event.gpu,
        "uuid": event.uuid,
        "message": event.message,
        "timestamp_seconds": event.timestamp_seconds,
        "source": event.source,
        "suggested_action": event.suggested_action.value,
        "data": event.data,
    }


@dataclass(frozen=True)
class Health:
    state: HealthState
    reason: str = ""
    suggested_action: SuggestedAction = SuggestedAction.NONE
    #: The codes of what is wrong: the watcher's own one; after `combine`, every open fault's, the
    #: worst state's first (the reason's text names only those of the worst state).
    causes: tuple[FaultCause, ...] = ()

    @classmethod
    def healthy(cls) -> Health:
        return cls(HealthState.HEALTHY)


def event_from_json(document: Mapping[str, Any], key: str) -> Event:
    """The inverse of `event_json`."""
    return Event(
        kind=EventKind(document["kind"]),
        severity=Severity(document["severity"]),
        gpu=document["gpu"],
        uuid=document["uuid"],
        message=document["message"],
        timestamp_seconds=document["timestamp_seconds"],
        source=document["source"],
        key=key,
        data=document["data"],
        suggested_action=SuggestedAction(document["suggested_action"]),
    )


def iso_utc(seconds: float) -> str:
    """Wall-clock `seconds` as ISO 8601 in UTC (`2026-12-05T12:00:00Z`): what Alertmanager reads, and
    what the reboot flag records."""
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc).isoformat().replace("+00:00", "Z")
