"""Frozen snapshots of what the agent read: the one thing metrics, status and rules look at.

A data module: its types are made elsewhere (the collector, the watchers, the service prober and
scraper, the advisor) and read everywhere, so it imports only other data (events, the plan types,
the reading table) and no part that makes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.events import Event, Health
from agent.policy.plan import ItemPlan
from agent.readings.table import GpuSample as GpuSample  # the reading table: one GPU at one instant


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
class ProbeStreak:
    """A service's declared state and its current run of failed probes (agent.services.prober), kept
    in the node memory across restarts."""

    service: str
    up: bool | None  # None before the first verdict
    consecutive_failures: int


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
    """One decision of the remediator, for the status screen ("3m ago  observe mode: would run ...")."""

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
class TuneStepFigures:
    """One step of a sweep, as /metrics exports it."""

    setting: float  # W or MHz, as the sweep's kind says
    tokens_per_joule: float | None
    tokens_per_second: float | None
    e2e_p95_seconds: float | None


@dataclass(frozen=True)
class TuneResult:
    """The last sweep of one service and kind that measured to its end (done or stopped early), for /metrics."""

    service: str
    kind: str  # "power" | "clocks"
    gpu_model: str
    finished_seconds: float
    steps: tuple[TuneStepFigures, ...]
    recommended: float | None  # the setting it recommends; None: none


# -- the inference servers' figures (agent/services/) -------------------------------------------


@dataclass(frozen=True)
class GpuProcessInfo:
    """A GPU process that belongs to no configured service (agent.services.attribution)."""

    pid: int
    gpu: int
    uuid: str
    used_memory_bytes: int | None
    unit: str | None  # the systemd unit it runs in, when it runs in one
    command: str  # /proc/PID/comm, "" when unreadable


@dataclass(frozen=True)
class GpuAttribution:
    """Which service holds which GPU, and the GPU processes of none (agent.services.attribution)."""

    memory_bytes: dict[str, dict[int, int]] = field(default_factory=dict)  # service -> GPU index -> bytes
    pids: dict[str, tuple[int, ...]] = field(default_factory=dict)  # service -> its GPU processes
    unattributed: tuple[GpuProcessInfo, ...] = ()


@dataclass(frozen=True)
class LatencyFigures:
    """One latency histogram over the window."""

    requests: float  # observations in the window
    mean_seconds: float | None
    quantiles: dict[float, float | None]  # 0.5 / 0.95 / 0.99 -> seconds


#: Queue time "rises" when the newer half of the window waits this many times longer on average.
QUEUE_TIME_RISE_RATIO = 1.5


@dataclass(frozen=True)
class QueueTimeTrend:
    """The server's mean queue time in the older and the newer half of the window."""

    earlier_mean_seconds: float | None
    later_mean_seconds: float | None

    @property
    def rose(self) -> bool:
        earlier, later = self.earlier_mean_seconds, self.later_mean_seconds
        return (
            earlier is not None and later is not None and later > earlier and later >= earlier * QUEUE_TIME_RISE_RATIO
        )


@dataclass(frozen=True)
class ServiceFigures:
    """What a service's server says about itself over the window (agent.services.window): the figures
    status and metrics show."""

    service: str
    kind: str
    timestamp_seconds: float
    window_seconds: float  # the span the deltas cover (shorter than asked right after start)
    latency: dict[str, LatencyFigures] = field(default_factory=dict)  # LATENCY_KINDS
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage_ratio: float | None = None
    generation_tokens_per_second: float | None = None
    waiting_history: tuple[tuple[float, float], ...] = ()  # (timestamp, waiting) inside the window
    kv_cache_usage_history: tuple[tuple[float, float], ...] = ()  # (timestamp, usage) inside the window
    queue_time_trend: QueueTimeTrend | None = None
    # (scrape time, generated tokens since the window's first scrape): every series' increase added
    # up, resets included; what tokens per joule is drawn from (agent.services.efficiency)
    generated_tokens_history: tuple[tuple[float, float], ...] = ()
    tokens_per_joule: float | None = None  # filled in by whoever knows the GPUs' energy
    resets: int = 0  # counter resets (server restarts) seen so far, on the series that saw most
    counters: ServiceCounters | None = None  # the same pages as counters, for /metrics (agent.services.counters)
    error: str = ""  # the last scrape's error; figures are from earlier scrapes

    def quantile(self, kind: str, q: float) -> float | None:
        figures = self.latency.get(kind)
        return None if figures is None else figures.quantiles.get(q)


@dataclass(frozen=True)
class CounterHistogram:
    """One latency kind as a cumulative histogram: `bucket_counts[i]` requests at or below `bounds[i]`."""

    bounds: tuple[float, ...]  # ends with +Inf
    bucket_counts: tuple[float, ...]
    count: float
    sum: float


@dataclass(frozen=True)
class ServiceCounters:
    """What `/metrics` exports of one service as counters."""

    histograms: Mapping[str, CounterHistogram] = field(default_factory=dict)  # LATENCY_KINDS
    generated_tokens: float | None = None
    gpu_energy_joules: float | None = None  # set by whoever reads the GPUs (agent.services.monitor)


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
    tunes: tuple[TuneResult, ...] = ()  # the last measured sweep per service and kind (agent.tune.runner)
    # When the loop published it, on the monotonic clock (set by the publisher): how old it is, which
    # no wall-clock step can hide (`/healthz` staleness); None for a snapshot no loop published.
    published_monotonic_seconds: float | None = None
