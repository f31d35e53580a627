"""A service's figures as counters Prometheus can add up across a fleet.

The window (agent.services.window) turns a server's histograms into quantiles over five minutes:
right for `gpu-agent status`, useless to a fleet, since quantiles of nodes cannot be added. Here
the same pages are kept as counters that only grow while the agent runs:

    gpu_agent_service_request_duration_seconds_bucket{service,kind,le}, _sum, _count
    gpu_agent_service_generated_tokens_total{service}
    gpu_agent_service_gpu_energy_joules_total{service}

`CounterBook` rebuilds a counter histogram per latency kind from the server's own buckets: each
series of the page (sglang's TP ranks already counted once by the scraper, agent.services.scrape)
adds its increase since the previous page, and a series that went down started again from zero
(one engine restarting), so its new value is all increase, as PromQL's `increase()` reads a reset.
A series seen for the first time adds all it holds, so a server page of one series and the
agent's histogram hold the same numbers until the server restarts. Series with other bucket
boundaries than the kind's are left out (they cannot be added bucket by bucket); when no series of
the page has the kind's boundaries any more (a server upgraded to new buckets), the kind starts
over on the new ones. What a service's counters follow is bounded (MAX_COUNTER_SERIES series, as its
window): a page that would bring more, a label that takes a new value on every scrape, is not
counted. `ServiceEnergy` adds the energy counters' increases of each service's GPUs.

With these, `histogram_quantile(0.95, sum by (le) (rate(..._bucket[5m])))` is a fleet's p95 and
`rate(tokens) / rate(joules)` its tokens per joule, per model or per any label a fleet adds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from agent.readings.table import GpuSample
from agent.services.scrape import SeriesKey, ServerReading
from agent.state import CounterHistogram, ServiceCounters

#: A series of the page not seen for this long is forgotten (an engine removed).
FORGET_AFTER_SECONDS = 600.0
#: Series one service's counters follow at most, as its latency window (a real page has a few dozen;
#: a label that takes a new value on every scrape would make a new series each time): a page that
#: would take them past it is not counted, and the counters keep the values of the pages before.
MAX_COUNTER_SERIES = 1024


def _increase(raw: tuple[float, ...], last: tuple[float, ...] | None) -> tuple[float, ...]:
    """What a cumulative series added since `last`: all of it when new or when it went down (a reset)."""
    if last is None or len(last) != len(raw) or any(now < before for now, before in zip(raw, last)):
        return raw
    return tuple(now - before for now, before in zip(raw, last))


class _Accumulated:
    """One kind's (or the token counter's) totals and the last raw value of each series."""

    def __init__(self, shape: tuple[float, ...] = ()) -> None:
        self.shape = shape
        self.totals: list[float] = []
        self.last: dict[SeriesKey, tuple[float, tuple[float, ...]]] = {}  # series -> (seen at, raw)

    def add(self, timestamp_seconds: float, series: Iterable[tuple[SeriesKey, tuple[float, ...]]]) -> None:
        for key, raw in series:
            seen = self.last.get(key)
            increase = _increase(raw, None if seen is None else seen[1])
            self.totals = [t + d for t, d in zip(self.totals, increase)] if self.totals else list(increase)
            self.last[key] = (timestamp_seconds, raw)
        for key in [k for k, (seen_at, _) in self.last.items() if timestamp_seconds - seen_at > FORGET_AFTER_SECONDS]:
            del self.last[key]


class CounterBook:
    """One service's pages as counters (not thread-safe by itself: one scraper feeds it)."""

    def __init__(self) -> None:
        self._kinds: dict[str, _Accumulated] = {}
        self._tokens = _Accumulated()

    def _series(self) -> int:
        return sum(len(kept.last) for kept in (*self._kinds.values(), self._tokens))

    def _new_series(self, reading: ServerReading) -> int:
        """How many series of `reading` the counters do not follow yet."""
        new = sum(
            1
            for kind, by_series in reading.histograms.items()
            for key in by_series
            if kind not in self._kinds or key not in self._kinds[kind].last
        )
        return new + sum(1 for key in reading.generation_tokens if key not in self._tokens.last)

    def add(self, reading: ServerReading) -> bool:
        """Count one page; False (nothing counted) when it would take the counters past
        MAX_COUNTER_SERIES series."""
        if self._series() + self._new_series(reading) > MAX_COUNTER_SERIES:
            return False
        now = reading.timestamp_seconds
        for kind, by_series in reading.histograms.items():
            kept = self._kinds.get(kind)
            shapes = {histogram.bounds for histogram in by_series.values()}
            if kept is None or kept.shape not in shapes:
                # The first page, or no series with the kind's boundaries any more: start on the first series'.
                kept = self._kinds[kind] = _Accumulated(next(iter(by_series.values())).bounds)
            kept.add(
                now,
                (
                    (key, (histogram.count, histogram.sum, *histogram.bucket_counts))
                    for key, histogram in by_series.items()
                    if histogram.bounds == kept.shape
                ),
            )
        if reading.generation_tokens:
            self._tokens.add(now, ((key, (value,)) for key, value in reading.generation_tokens.items()))
        return True

    def counters(self) -> ServiceCounters:
        histograms = {
            kind: CounterHistogram(kept.shape, tuple(kept.totals[2:]), kept.totals[0], kept.totals[1])
            for kind, kept in self._kinds.items()
            if kept.totals
        }
        tokens = self._tokens.totals[0] if self._tokens.totals else None
        return ServiceCounters(histograms, tokens)


class ServiceEnergy:
    """Per service, the energy its GPUs used while the agent watched: each GPU's energy counter
    differenced between fresh readings (a counter that went down, a driver reload, counts from 0),
    the increases of the service's GPUs added up."""

    def __init__(self) -> None:
        self._last: dict[int, float] = {}  # GPU -> its last energy reading
        self._totals: dict[str, float] = {}

    def add(self, samples: Sequence[GpuSample], gpus_by_service: Mapping[str, Sequence[int]]) -> None:
        increases: dict[int, float] = {}
        for sample in samples:
            if not sample.up or sample.energy_joules is None:
                continue
            last = self._last.get(sample.index)
            self._last[sample.index] = sample.energy_joules
            if last is not None:
                now = sample.energy_joules
                increases[sample.index] = now - last if now >= last else now
        for service, gpus in gpus_by_service.items():
            self._totals[service] = self._totals.get(service, 0.0) + sum(increases.get(gpu, 0.0) for gpu in gpus)

    def joules(self, service: str) -> float | None:
        return self._totals.get(service)
