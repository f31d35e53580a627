"""Why a service is slow: an SLO breach on the server's own latency, and the most likely cause
among what the agent saw on that service's GPUs over the same window.

`check_slo` compares the window's p95s with `services[].slo`; `attribute_cause` is a pure function
of the GPU samples, the Xid events and the server's queue over the window, and names one cause:

| cause | evidence (any of the service's GPUs, inside the window) |
|---|---|
| `xid` | an Xid event on the GPU |
| `thermal_slowdown` | hw_slowdown / hw_thermal_slowdown / sw_thermal_slowdown active |
| `power_cap` | sw_power_cap / hw_power_brake_slowdown active |
| `clocks_below_expected` | busy, no slowdown reason, under 90 % of the expected (locked) clock in half the samples |
| `kv_cache_full` | the server's KV cache at >= 95 % while its waiting queue grew or its queue time rose |
| `memory_near_full` | memory used >= 98 % of total |
| `queueing` | the GPUs were clean and the server's waiting queue grew or its queue time rose |
| `unknown` | none of the above: the GPUs look clean and nothing queued |

A server preallocates ~90 % of memory for its KV cache, so only the last percents count as full.
A KV cache past ~95 % makes the scheduler hold new requests back (no room for their tokens): the
queue grows although the GPUs are clean and fast, which is capacity, not load alone. Queue time
"rises" when the newer half of the window waited at least 1.5 times longer on average than the
older half (agent.services.window.QueueTimeTrend).
The order is the priority when several hold: an Xid is a fault, thermal and power reasons explain
a clock drop better than the drop itself, a full KV cache explains the queue behind it, and a
queue that grows on clean GPUs is load.
`regression_event` wraps the verdict into a `service_latency_regression` event whose `data` holds
the evidence; `SloWatch` emits it once per breach (again when the cause changes), never per loop.

`strain` judges the server as it is now with the same figures (a KV cache at >= 95 %, a waiting
queue still growing over the last minute), for what must not start on a strained service: a
`gpu-agent tune` sweep would measure the strain, not the setting.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.config.service_entry import ServiceSlo
from agent.events import Event, EventKind, Severity, SuggestedAction
from agent.names.policy_items import FAN_CURVE
from agent.state import GpuSample, QueueTimeTrend, ServiceFigures, SloBreachNow
from agent.watch.clock_events import decode

THERMAL_REASONS = frozenset({"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown"})
POWER_REASONS = frozenset({"sw_power_cap", "hw_power_brake_slowdown"})
CLOCK_BELOW_EXPECTED_RATIO = 0.9
MEMORY_NEAR_FULL_RATIO = 0.98
KV_CACHE_FULL_RATIO = 0.95
CAUSES = (
    "xid",
    "thermal_slowdown",
    "power_cap",
    "clocks_below_expected",
    "kv_cache_full",
    "memory_near_full",
    "queueing",
    "unknown",
)


@dataclass(frozen=True)
class SloBreach:
    """One objective missed over the window: `e2e_p95` or `ttft_p95`."""

    objective: str
    observed_seconds: float
    limit_seconds: float
    requests: float


@dataclass(frozen=True)
class CauseFinding:
    cause: str  # one of CAUSES
    gpu: int | None  # the GPU the evidence points at (None for queueing / unknown)
    uuid: str | None
    summary: str  # "GPU 4 thermal slowdown for 42 s at 91 C"
    evidence: dict[str, Any] = field(default_factory=dict)


def check_slo(slo: ServiceSlo | None, figures: ServiceFigures | None) -> list[SloBreach]:
    """The objectives the window misses; none without an SLO, without figures or with fewer
    requests in the window than `slo.min_requests` (a p95 of three requests is noise)."""
    if slo is None or figures is None:
        return []
    breaches: list[SloBreach] = []
    for objective, kind, limit in (
        ("e2e_p95", "e2e", slo.e2e_p95_seconds),
        ("ttft_p95", "ttft", slo.ttft_p95_seconds),
    ):
        latency = figures.latency.get(kind)
        if limit is None or latency is None or latency.requests < slo.min_requests:
            continue
        observed = latency.quantiles.get(0.95)
        if observed is not None and observed > limit:
            breaches.append(SloBreach(objective, observed, limit, latency.requests))
    return breaches


@dataclass
class _GpuWindow:
    """One GPU's samples over the window, reduced to the figures the causes need."""

    gpu: int
    uuid: str
    reason_seconds: dict[str, float] = field(default_factory=dict)
    max_temperature_celsius: int | None = None
    slowdown_temperature_celsius: int | None = None
    max_power_watts: float | None = None
    power_limit_watts: float | None = None
    busy_clocks_mhz: list[int] = field(default_factory=list)
    max_memory_ratio: float | None = None
    samples: int = 0

    def seconds(self, reasons: frozenset[str]) -> float:
        return sum(s for r, s in self.reason_seconds.items() if r in reasons)

    def reasons(self, reasons: frozenset[str]) -> dict[str, float]:
        """The seconds of each of `reasons` this GPU was held by, rounded for the evidence."""
        return _rounded({r: s for r, s in self.reason_seconds.items() if r in reasons})


def _gpu_windows(samples: Iterable[GpuSample], gpus: set[int] | None) -> dict[int, _GpuWindow]:
    by_gpu: dict[int, list[GpuSample]] = {}
    for sample in samples:
        if sample.up and (gpus is None or sample.index in gpus):
            by_gpu.setdefault(sample.index, []).append(sample)
    windows: dict[int, _GpuWindow] = {}
    for index, series in by_gpu.items():
        series.sort(key=lambda s: s.timestamp_seconds)
        window = _GpuWindow(index, series[-1].uuid)
        spans = [b.timestamp_seconds - a.timestamp_seconds for a, b in itertools.pairwise(series)]
        typical = sorted(spans)[len(spans) // 2] if spans else 0.0
        for position, sample in enumerate(series):
            window.samples += 1
            # A sample stands for the time until the next one (the last: a typical interval).
            span = spans[position] if position < len(spans) else typical
            reasons = decode(sample.clock_event_reasons or 0)
            for reason in reasons:
                window.reason_seconds[reason] = window.reason_seconds.get(reason, 0.0) + span
            if sample.temperature_celsius is not None:
                window.max_temperature_celsius = max(window.max_temperature_celsius or 0, sample.temperature_celsius)
            window.slowdown_temperature_celsius = (
                sample.slowdown_temperature_celsius or window.slowdown_temperature_celsius
            )
            if sample.power_usage_watts is not None:
                window.max_power_watts = max(window.max_power_watts or 0.0, sample.power_usage_watts)
            window.power_limit_watts = sample.power_limit_watts or window.power_limit_watts
            busy = "gpu_idle" not in reasons and (sample.gpu_utilization_percent or 0) > 0
            clock = sample.graphics_clock_mhz
            if busy and clock is not None and not set(reasons) & (THERMAL_REASONS | POWER_REASONS):
                window.busy_clocks_mhz.append(clock)
            if sample.memory_used_bytes is not None and sample.memory_total_bytes:
                ratio = sample.memory_used_bytes / sample.memory_total_bytes
                window.max_memory_ratio = max(window.max_memory_ratio or 0.0, ratio)
        windows[index] = window
    return windows


def _rounded(reason_seconds: Mapping[str, float]) -> dict[str, float]:
    return {reason: round(seconds, 1) for reason, seconds in sorted(reason_seconds.items())}


def _most_held(windows: Mapping[int, _GpuWindow], reasons: frozenset[str]) -> tuple[_GpuWindow, float] | None:
    """The GPU held longest by any of `reasons` and for how many seconds; None when none was."""
    window = max(windows.values(), key=lambda w: w.seconds(reasons), default=None)
    if window is not None and window.seconds(reasons) > 0:
        return window, window.seconds(reasons)
    return None


def _thermal_slowdown(window: _GpuWindow, seconds: float) -> tuple[str, dict[str, Any]]:
    summary = f"GPU {window.gpu} thermal slowdown for {seconds:.0f} s at {window.max_temperature_celsius} C"
    return summary, {
        "temperature_celsius": window.max_temperature_celsius,
        "slowdown_temperature_celsius": window.slowdown_temperature_celsius,
    }


def _power_cap(window: _GpuWindow, seconds: float) -> tuple[str, dict[str, Any]]:
    summary = f"GPU {window.gpu} held at its power cap ({window.power_limit_watts:g} W) for {seconds:.0f} s"
    return summary, {"power_usage_watts": window.max_power_watts, "power_limit_watts": window.power_limit_watts}


#: Causes that are clock-event reasons holding a GPU: the cause, its reasons, its summary and evidence.
_HELD_CAUSES: tuple[tuple[str, frozenset[str], Callable[[_GpuWindow, float], tuple[str, dict[str, Any]]]], ...] = (
    ("thermal_slowdown", THERMAL_REASONS, _thermal_slowdown),
    ("power_cap", POWER_REASONS, _power_cap),
)


def _queue_grew(history: Sequence[tuple[float, float]]) -> tuple[bool, float, float]:
    """(grew, first, peak) of the server's waiting queue over the window."""
    if not history:
        return False, 0.0, 0.0
    first = history[0][1]
    peak = max(v for _, v in history)
    return peak > first and peak > 0, first, peak


#: How far back `strain` looks for a growing queue: the queue as it moves now, not an hour-old burst.
STRAIN_QUEUE_SECONDS = 60.0


def strain(figures: ServiceFigures) -> list[str]:
    """What strains the server now, one line each (none: it serves within its capacity): its KV
    cache at KV_CACHE_FULL_RATIO or more, its waiting queue higher at the last scrape than a minute
    earlier and at its peak of that minute (still growing, not a blip that drained)."""
    found: list[str] = []
    usage = figures.kv_cache_usage_ratio
    if usage is not None and usage >= KV_CACHE_FULL_RATIO:
        found.append(f"KV cache {usage:.0%} full (new requests wait for room)")
    history = figures.waiting_history
    recent = [(t, v) for t, v in history if history and t >= history[-1][0] - STRAIN_QUEUE_SECONDS]
    grew, first, peak = _queue_grew(recent)
    if grew and recent[-1][1] >= peak:
        seconds = recent[-1][0] - recent[0][0]
        found.append(f"waiting queue growing: {first:g} -> {peak:g} requests over the last {seconds:.0f} s")
    return found


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _queue_story(grew: bool, first: float, peak: float, queue_time: QueueTimeTrend | None) -> str:
    """`waiting requests grew from 0 to 40` or `queue time rose from 0.05 s to 2.10 s` (or both)."""
    told = [f"waiting requests grew from {first:g} to {peak:g}"] if grew else []
    if queue_time is not None and queue_time.rose:
        told.append(
            f"queue time rose from {queue_time.earlier_mean_seconds:.2f} s to {queue_time.later_mean_seconds:.2f} s"
        )
    return " and ".join(told)


def attribute_cause(
    samples: Iterable[GpuSample],
    *,
    gpus: Iterable[int] | None,
    xid_events: Iterable[Event] = (),
    waiting_history: Sequence[tuple[float, float]] = (),
    expected_clock_mhz: Mapping[int, int] | None = None,
    window_start_seconds: float | None = None,
    kv_cache_usage_history: Sequence[tuple[float, float]] = (),
    queue_time: QueueTimeTrend | None = None,
    queue_time_p95_seconds: float | None = None,
) -> CauseFinding:
    """The most likely cause of a latency regression, from the window's GPU samples (several per
    GPU, oldest first or not), the Xid events seen, and the server's own view: its (timestamp,
    waiting) queue, its (timestamp, KV cache usage) and its queue time over the window.

    `gpus`: the service's GPUs (None: every GPU sampled); `expected_clock_mhz`: the clock each GPU
    should run at when busy (the locked clock of its policy profile); `window_start_seconds`: Xid
    events before it are ignored; `queue_time`: the mean queue time of the window's older and
    newer half; `queue_time_p95_seconds`: its p95 over the window (evidence only).
    """
    wanted = None if gpus is None else set(gpus)
    windows = _gpu_windows(samples, wanted)
    grew, first_waiting, peak_waiting = _queue_grew(waiting_history)
    queue: dict[str, Any] = {"waiting_first": first_waiting, "waiting_peak": peak_waiting}
    queue_time_rose = queue_time is not None and queue_time.rose
    if queue_time is not None:
        queue["queue_time_mean_earlier_seconds"] = _round(queue_time.earlier_mean_seconds)
        queue["queue_time_mean_later_seconds"] = _round(queue_time.later_mean_seconds)
        queue["queue_time_p95_seconds"] = _round(queue_time_p95_seconds)
    base: dict[str, Any] = {
        "gpus": sorted(windows),
        "queue": queue,
        "temperatures_celsius": {str(g): w.max_temperature_celsius for g, w in sorted(windows.items())},
        "clock_event_seconds": {str(g): _rounded(w.reason_seconds) for g, w in sorted(windows.items())},
    }

    xids = [
        e
        for e in xid_events
        if e.kind is EventKind.XID
        and (wanted is None or e.gpu in wanted)
        and (window_start_seconds is None or e.timestamp_seconds >= window_start_seconds)
    ]
    if xids:
        latest = max(xids, key=lambda e: e.timestamp_seconds)
        codes = sorted({int(e.data.get("xid", 0)) for e in xids if e.data.get("xid") is not None})
        evidence = {**base, "xids": codes, "xid_gpu": latest.gpu, "xid_message": latest.message}
        where = f"GPU {latest.gpu}" if latest.gpu is not None else "a GPU"
        summary = f"{where}: Xid {', '.join(map(str, codes))} in the window"
        return CauseFinding("xid", latest.gpu, latest.uuid, summary, evidence)

    # In the docstring's order of priority.
    for cause, reasons, described in _HELD_CAUSES:
        held = _most_held(windows, reasons)
        if held is not None:
            window, seconds = held
            summary, facts = described(window, seconds)
            evidence = {**base, **facts, "reasons": window.reasons(reasons)}
            return CauseFinding(cause, window.gpu, window.uuid, summary, evidence)

    for window in sorted(windows.values(), key=lambda w: w.gpu):
        expected = (expected_clock_mhz or {}).get(window.gpu)
        clocks = window.busy_clocks_mhz
        if expected is None or not clocks:
            continue
        low = [c for c in clocks if c < expected * CLOCK_BELOW_EXPECTED_RATIO]
        if len(low) * 2 >= len(clocks):
            evidence = {
                **base,
                "expected_clock_mhz": expected,
                "lowest_clock_mhz": min(low),
                "busy_samples": len(clocks),
            }
            summary = f"GPU {window.gpu} ran at {min(low)} MHz, below the expected {expected} MHz, with no reason given"
            return CauseFinding("clocks_below_expected", window.gpu, window.uuid, summary, evidence)

    kv_peak = max((usage for _, usage in kv_cache_usage_history), default=None)
    if kv_peak is not None and kv_peak >= KV_CACHE_FULL_RATIO and (grew or queue_time_rose):
        evidence = {
            **base,
            "kv_cache_usage_peak_ratio": round(kv_peak, 4),
            "kv_cache_usage_last_ratio": round(kv_cache_usage_history[-1][1], 4),
        }
        summary = f"KV cache {kv_peak:.0%} full, {_queue_story(grew, first_waiting, peak_waiting, queue_time)}"
        return CauseFinding("kv_cache_full", None, None, summary, evidence)

    full = max(windows.values(), key=lambda w: w.max_memory_ratio or 0.0, default=None)
    if full is not None and (full.max_memory_ratio or 0.0) >= MEMORY_NEAR_FULL_RATIO:
        ratio = full.max_memory_ratio or 0.0
        evidence = {**base, "memory_used_ratio": round(ratio, 4)}
        summary = f"GPU {full.gpu} memory {ratio:.1%} full"
        return CauseFinding("memory_near_full", full.gpu, full.uuid, summary, evidence)

    if grew or queue_time_rose:
        summary = f"queueing: {_queue_story(grew, first_waiting, peak_waiting, queue_time)} on clean GPUs"
        return CauseFinding("queueing", None, None, summary, base)
    return CauseFinding("unknown", None, None, "no GPU cause seen and nothing queued", base)


def regression_event(
    service: str, breaches: Sequence[SloBreach], finding: CauseFinding, figures: ServiceFigures, now: float
) -> Event:
    """The `service_latency_regression` event for a breach, its cause and evidence in `data`."""
    missed = "; ".join(
        f"{b.objective.replace('_', ' ')} {b.observed_seconds:.2f} s > {b.limit_seconds:g} s" for b in breaches
    )
    thermal = finding.cause == "thermal_slowdown"
    return Event(
        kind=EventKind.SERVICE_LATENCY_REGRESSION,
        severity=Severity.WARNING,
        gpu=finding.gpu,
        uuid=finding.uuid,
        message=f"service {service}: {missed}; likely cause: {finding.summary}",
        timestamp_seconds=now,
        source="metrics",
        key=f"service_latency_regression:{service}:{finding.cause}",
        data={
            "service": service,
            "cause": finding.cause,
            "summary": finding.summary,
            "breaches": [
                {
                    "objective": b.objective,
                    "observed_seconds": round(b.observed_seconds, 4),
                    "limit_seconds": b.limit_seconds,
                    "requests": b.requests,
                }
                for b in breaches
            ],
            "window_seconds": round(figures.window_seconds, 1),
            "running": figures.running,
            "waiting": figures.waiting,
            "kv_cache_usage_ratio": figures.kv_cache_usage_ratio,
            "evidence": finding.evidence,
            # A thermal cause is what the fan curve is for: point the operator at it.
            **({"see_policy": FAN_CURVE} if thermal else {}),
        },
        suggested_action=SuggestedAction.CHECK_MECHANICALS if thermal else SuggestedAction.ALERT,
    )


class SloWatch:
    """Per service: one event when the SLO starts being missed, another only if the cause changes;
    nothing while the breach lasts or after it ends (a later breach is a new one)."""

    def __init__(self) -> None:
        self._breached: dict[str, str] = {}  # service -> cause of the breach in progress
        self._now: dict[str, tuple[list[SloBreach], CauseFinding]] = {}  # service -> its breach, for the verdict

    def update(
        self,
        service: str,
        slo: ServiceSlo | None,
        figures: ServiceFigures | None,
        attribute: Callable[[], CauseFinding],
        now: float,
    ) -> list[Event]:
        """`attribute` names the cause; it is only called while the SLO is missed."""
        breaches = check_slo(slo, figures)
        if not breaches or figures is None:
            self._breached.pop(service, None)
            self._now.pop(service, None)
            return []
        finding = attribute()
        self._now[service] = (breaches, finding)
        if self._breached.get(service) == finding.cause:
            return []
        self._breached[service] = finding.cause
        return [regression_event(service, breaches, finding, figures, now)]

    def breaches(self) -> tuple[SloBreachNow, ...]:
        """Every objective missed at the last update, with the cause named for its service."""
        return tuple(
            SloBreachNow(service, b.objective, b.observed_seconds, b.limit_seconds, finding.cause, finding.summary)
            for service, (missed, finding) in sorted(self._now.items())
            for b in missed
        )
