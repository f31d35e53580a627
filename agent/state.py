"""Frozen snapshots of what the agent read: the one thing metrics, status and rules look at."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.events import Event, Health
from agent.policy.base import ItemPlan
from agent.readings.table import GpuSample as GpuSample  # the reading table: one GPU at one instant

if TYPE_CHECKING:
    # Annotations only: the snapshot types stay importable without psutil, the config models or the
    # Prometheus parser (bench/h200_telemetry_compare.py runs where only nvidia-ml-py is installed).
    from agent.services.attribution import GpuAttribution
    from agent.services.window import ServiceFigures


@dataclass(frozen=True)
class CollectorStatus:
    """Per-collector bookkeeping, exported like node_exporter's scrape_collector_* metrics."""

    name: str  # "gpu", "policy", "xid_nvml", "kmsg", "services", ...
    success: bool
    duration_seconds: float
    last_error: str = ""


@dataclass(frozen=True)
class XidCount:
    gpu: int | None
    uuid: str
    xid: int
    count: int
    last_seen_seconds: float


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    unit: str
    up: bool | None  # None: not probed yet
    consecutive_failures: int = 0
    last_latency_seconds: float | None = None
    detail: str = ""


@dataclass(frozen=True)
class RemediationCount:
    rule: str
    action: str
    outcome: str
    count: int


@dataclass(frozen=True)
class RemediationFailing:
    """A rule that cannot fix its fault now: its last attempt on some target failed or was refused,
    or its attempts ran out (the circuit is open until `gpu-agent ack RULE`)."""

    rule: str
    cause: str  # "failed" | "refused" | "exhausted"


@dataclass(frozen=True)
class RecentRemediation:
    """One decision of the remediator, for the status screen ("3m ago: would restart sglang")."""

    started_seconds: float
    rule: str
    action: str
    target: str  # "service:sglang", "gpu:GPU-...", "node"
    outcome: str
    detail: str


@dataclass(frozen=True)
class SloBreachNow:
    """A service missing a latency objective right now, and the cause the agent names for it."""

    service: str
    objective: str  # "e2e_p95" | "ttft_p95"
    observed_seconds: float
    limit_seconds: float
    cause: str  # one of agent.services.latency_cause.CAUSES
    cause_summary: str  # "GPU 1 thermal slowdown for 42 s at 91 C"


@dataclass(frozen=True)
class NodeSnapshot:
    """Everything the daemon knows after one loop. Metrics, the status API and rules read only this."""

    timestamp_seconds: float
    started_seconds: float
    version: str
    backend: str
    driver_version: str | None
    gpus: tuple[GpuSample, ...]
    stale_gpus: frozenset[int] = frozenset()  # a call hung or timed out: readings are from an earlier loop
    health: dict[int, Health] = field(default_factory=dict)
    policy: tuple[ItemPlan, ...] = ()
    item_modes: dict[str, str] = field(default_factory=dict)
    clock_event_seconds: dict[tuple[int, str], float] = field(default_factory=dict)  # (gpu, reason) -> total
    throttle_active_since: dict[tuple[int, str], float] = field(default_factory=dict)  # slowdown reasons active now
    # How long each of those has been held, on CLOCK_BOOTTIME: what a rule's held_seconds compares with.
    throttle_held_seconds: dict[tuple[int, str], float] = field(default_factory=dict)
    xids: tuple[XidCount, ...] = ()
    # (GPU, Xid) of the Xids that hold a GPU's health now: not fixed by the agent, not acknowledged,
    # within the health window (agent/watch/xid.py); what the Xid alerts fire on
    open_xids: frozenset[tuple[int, int]] = frozenset()
    services: tuple[ServiceStatus, ...] = ()
    remediations: tuple[RemediationCount, ...] = ()
    remediation_failing: tuple[RemediationFailing, ...] = ()
    collectors: tuple[CollectorStatus, ...] = ()
    recent_events: tuple[Event, ...] = ()
    collect_duration_seconds: float = 0.0
    service_figures: dict[str, ServiceFigures] = field(default_factory=dict)  # the servers' own view
    gpu_attribution: GpuAttribution | None = None  # GPU processes per service; None until mapped
    # service -> latency kind ("e2e", "ttft") -> its p95 objective (`services[].slo`), for dashboards
    service_slo_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    # the daemon's verdicts beyond per-GPU health (see agent/verdict.py)
    backend_error: str = ""  # why the GPU backend cannot be read; "" while it can
    pcie_degraded: frozenset[int] = frozenset()  # GPUs whose link the PCIe watcher judges degraded
    reboot_recommended: str | None = None  # the reason in state_dir/reboot-recommended, for this boot
    reboot_recommended_cause: str = ""  # the kind of event that led to it (a bounded code for /metrics)
    hostname: str = ""  # the node's own host name (set by the publisher), what dashboards call Hostname
    expected_gpus: int | None = None  # how many GPUs this node should show (set by the publisher)
    recent_remediations: tuple[RecentRemediation, ...] = ()
    rules_sources: tuple[str, ...] = ()  # `/usr/share/.../10-xid.yaml`, `... (overrides ...)`, `...: masked (...)`
    # How many remediation rules the daemon runs with, from `rules_dirs`; None: no daemon (a direct
    # read), or remediation turned off (`remediation.rules_dirs: []`).
    rules_loaded: int | None = None
    rules_dirs: tuple[str, ...] = ()
    slo_breaches: tuple[SloBreachNow, ...] = ()  # services over a latency objective now
    # the last reload (set by the publisher): why it was refused ("" when it was applied), and the
    # settings whose change only a restart applies, so the running config was kept whole
    reload_error: str = ""
    config_pending_restart: tuple[str, ...] = ()
    # When the loop published it, on the monotonic clock (set by the publisher): how old it is, which
    # no wall-clock step can hide (`/healthz` staleness); None for a snapshot no loop published.
    published_monotonic_seconds: float | None = None
