"""A service's scrapes over a sliding window, turned into quantiles, gauges and rates.

`LatencyWindow` keeps each scrape's cumulative counters (histogram buckets, count and sum, the
token counter) per series, each made monotonic across its own resets the way PromQL's
`increase()` does: a counter that went down started again from zero, so its new value is all
increase, and one engine restarting leaves the others' series alone. Each series is differenced
newest point against oldest inside the window and the increases are added; quantiles interpolate
linearly inside the bucket that holds the rank, as `histogram_quantile` does. The window also
keeps the waiting queue, the KV cache usage and the generated-token total per scrape, and splits
the queue-time histogram into the window's older and newer half (`QueueTimeTrend`). Deltas that
are not finite leave their figure out with an "unreadable page" error.

What one service keeps is bounded in every dimension: at most MAX_WINDOW_POINTS points a series,
MAX_WINDOW_SERIES series (a reading that would bring more, as a label that takes a new value on
every scrape does, is not kept: it is the service's "unreadable page" error and the figures stay
those of the readings before it), and MAX_WINDOW_BYTES of them (past it the oldest readings go and
the figures cover a shorter span, which they say). Each point is one array of 8-byte numbers.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import sys
from array import array
from collections import deque
from collections.abc import Sequence

from agent.services.scrape import UNREADABLE, SeriesKey, ServerReading
from agent.state import LatencyFigures, QueueTimeTrend, ServiceFigures

QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
DEFAULT_WINDOW_SECONDS = 300.0
# Points per counter series: a window of 300 s scraped every 0.5 s or slower keeps them all; a
# faster scrape keeps the newest ones (the figures say the shorter span they cover).
MAX_WINDOW_POINTS = 600
# What one service's window keeps, whatever its server writes: counter series (histogram series and
# generated-token counters, across the window: a label that takes a new value on every scrape makes
# a new series each time) and the memory they take. A real page has a few dozen series (sglang at
# DP=8: 40); a window of such pages scraped every second takes about 4 MB.
MAX_WINDOW_SERIES = 1024
MAX_WINDOW_BYTES = 8 * 1024 * 1024
_MIB = 1024 * 1024


# -- quantiles -----------------------------------------------------------------------------------


def histogram_quantile(q: float, bounds: Sequence[float], bucket_counts: Sequence[float]) -> float | None:
    """The q-quantile of cumulative buckets, as PromQL's histogram_quantile: linear inside the
    bucket holding the rank (the first bucket starts at 0); a rank in the +Inf bucket gives the
    largest finite bound. None when there are no observations or no +Inf bucket, and when the
    buckets cannot be believed (`readable_buckets`): a quantile of them would be made up."""
    return _readable_quantile(q, bounds, bucket_counts) if readable_buckets(bounds, bucket_counts) else None


def _readable_quantile(q: float, bounds: Sequence[float], bucket_counts: Sequence[float]) -> float | None:
    """histogram_quantile of buckets `readable_buckets` has passed (`LatencyWindow.figures` checks
    each histogram once for all its quantiles)."""
    if not bounds or not math.isinf(bounds[-1]) or not 0.0 <= q <= 1.0 or len(bounds) != len(bucket_counts):
        return None
    counts = list(bucket_counts)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    index = next((i for i, c in enumerate(counts) if c >= rank), len(counts) - 1)
    if index == len(bounds) - 1:
        return bounds[-2] if len(bounds) >= 2 else None
    upper = bounds[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = bounds[index - 1], counts[index - 1]
    in_bucket = counts[index] - below
    if in_bucket <= 0:
        return upper
    found = lower + (upper - lower) * (rank - below) / in_bucket
    return found if math.isfinite(found) else None  # bounds near the float limit: no made-up figure


def readable_buckets(bounds: Sequence[float], bucket_counts: Sequence[float]) -> bool:
    """Finite, non-negative counts that never go down, under bounds that are numbers and go up."""
    # map and starmap run in C: this is per bucket, for every histogram every scrape
    return (
        all(map(math.isfinite, bucket_counts))
        and min(bucket_counts, default=0.0) >= 0
        and all(itertools.starmap(operator.le, itertools.pairwise(bucket_counts)))
        and not any(map(math.isnan, bounds))
        and all(itertools.starmap(operator.lt, itertools.pairwise(bounds)))
    )


# -- the window ----------------------------------------------------------------------------------


class _CounterSeries:
    """One series' cumulative counters made monotonic across its resets: each point one array of
    its scrape time and its counters (8 bytes a number, where a tuple of floats takes 32)."""

    __slots__ = ("fixed_bytes", "label_bytes", "last_raw", "point_bytes", "points", "resets", "shape")

    def __init__(self, key: SeriesKey) -> None:
        self.shape: tuple[float, ...] | None = None
        self.points: deque[array[float]] = deque()
        self.last_raw: array[float] | None = None
        self.resets = 0
        self.label_bytes = _series_bytes(key)
        # What it keeps (`bytes`): worked out again only when the bounds or the width change.
        self.fixed_bytes = self.label_bytes
        self.point_bytes = 0

    def add(self, timestamp_seconds: float, raw: tuple[float, ...], shape: tuple[float, ...] = ()) -> None:
        last = self.last_raw
        if shape != self.shape or last is None or len(raw) != len(last) or not self.points:
            # New bucket boundaries cannot be differenced against the old ones: start over.
            self.shape = shape
            self.points.clear()
            self.points.append(array("d", (timestamp_seconds, *raw)))
            self.last_raw = array("d", raw)
            self.fixed_bytes = self.label_bytes + _numbers_bytes(len(shape), len(raw))
            self.point_bytes = _point_bytes(len(raw))
            return
        previous = itertools.islice(self.points[-1], 1, None)
        # map over operators runs in C: this is per bucket, for every series every scrape
        if any(map(operator.lt, raw, last)):
            self.resets += 1
            adjusted = map(operator.add, previous, raw)
        else:
            adjusted = map(operator.add, previous, map(operator.sub, raw, last))
        self.points.append(array("d", [timestamp_seconds, *adjusted]))
        self.last_raw = array("d", raw)
        while len(self.points) > MAX_WINDOW_POINTS:
            self.points.popleft()

    @property
    def bytes(self) -> int:
        """What this series keeps, as `_series_bytes`, `_numbers_bytes` and `_point_bytes` count it."""
        return self.fixed_bytes + len(self.points) * self.point_bytes

    def prune(self, oldest_seconds: float) -> None:
        while self.points and self.points[0][0] < oldest_seconds:
            self.points.popleft()

    def delta(self) -> tuple[float, tuple[float, ...]] | None:
        """(seconds covered, increase per counter) between the oldest and newest point kept."""
        if len(self.points) < 2:
            return None
        first, last = self.points[0], self.points[-1]
        return last[0] - first[0], _increase(first, last)

    def split(self, middle_seconds: float) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """The increase before and after `middle_seconds` (the newest point at or before it divides)."""
        if len(self.points) < 2:
            return None
        first, last = self.points[0], self.points[-1]
        after = bisect.bisect_right(self.points, middle_seconds, key=operator.itemgetter(0))
        divide = self.points[after - 1] if after > 0 else first
        return _increase(first, divide), _increase(divide, last)


def _increase(earlier: array[float], later: array[float]) -> tuple[float, ...]:
    """The counters' increase from one point to a later one (the scrape times left out)."""
    return tuple(itertools.islice(map(operator.sub, later, earlier), 1, None))


#: A series' own cost besides its numbers: the object, its deque's first block (760 bytes), the
#: slot in its group.
_SERIES_OVERHEAD_BYTES = 1024


def _series_bytes(key: SeriesKey) -> int:
    """A series' fixed cost: its overhead and its labels (the key's strings and tuples)."""
    labels = sum(sys.getsizeof(name) + sys.getsizeof(value) + 56 for name, value in key)
    return _SERIES_OVERHEAD_BYTES + labels + 40 + 8 * len(key)


def _numbers_bytes(bounds: int, width: int) -> int:
    """The bucket bounds (a tuple of floats: 32 bytes a bound) and the last raw counters (an array)."""
    return (40 + 32 * bounds if bounds else 0) + (80 + 8 * width if width else 0)


def _point_bytes(width: int) -> int:
    """One point of `width` counters: an array of them and its time, and its slot in the deque."""
    return 80 + 8 * (width + 1) + 8


SeriesGroup = dict[SeriesKey, _CounterSeries]


def _series(group: SeriesGroup, key: SeriesKey) -> _CounterSeries:
    found = group.get(key)
    if found is None:
        found = group[key] = _CounterSeries(key)
    return found


def _added_increase(group: SeriesGroup) -> tuple[float, float, tuple[float, ...], tuple[float, ...]] | None:
    """(start, end, bucket bounds, increase) of a histogram's series added up, each series
    differenced on its own so that one engine restarting resets only its own series; series with
    other bucket boundaries than the first are left out (they cannot be added bucket by bucket)."""
    shape: tuple[float, ...] | None = None
    start, end = math.inf, -math.inf
    total: list[float] = []
    for series in group.values():
        found = series.delta()
        if found is None or series.shape is None:
            continue
        if shape is None:
            shape, total = series.shape, [0.0] * len(found[1])
        if series.shape != shape:
            continue
        total = [t + d for t, d in zip(total, found[1])]
        start, end = min(start, series.points[0][0]), max(end, series.points[-1][0])
    if shape is None:
        return None
    return start, end, shape, tuple(total)


class LatencyWindow:
    """A service's scrapes over the last `window_seconds`; `figures()` turns them into quantiles,
    gauges and rates. One per service; fed by whoever scrapes (not thread-safe by itself)."""

    def __init__(self, service: str, window_seconds: float = DEFAULT_WINDOW_SECONDS) -> None:
        self.service = service
        self.window_seconds = window_seconds
        self._histograms: dict[str, SeriesGroup] = {}
        self._tokens: SeriesGroup = {}
        self._waiting: deque[tuple[float, float]] = deque()
        self._kv_cache_usage: deque[tuple[float, float]] = deque()
        self._generated_tokens: deque[tuple[float, float]] = deque()  # (time, cumulative increase)
        self._generated_so_far = 0.0
        self._scrapes: deque[float] = deque()  # the times of the readings kept
        self._last: ServerReading | None = None
        self._error = ""

    def add(self, reading: ServerReading) -> None:
        """Keep one scrape's reading. One that would take the window past MAX_WINDOW_SERIES series,
        or whose own series take more than half of MAX_WINDOW_BYTES, is not kept: it is the
        service's `unreadable page` error, and the figures stay those of the readings before it.
        Past MAX_WINDOW_BYTES the oldest readings are dropped: the figures cover a shorter span,
        and say so."""
        now = reading.timestamp_seconds
        self._drop_before(now - self.window_seconds)
        refused = self._refusal(reading)
        if refused:
            self._error = f"{UNREADABLE}: {refused}"
            return
        for kind, by_series in reading.histograms.items():
            group = self._histograms.setdefault(kind, {})
            for key, histogram in by_series.items():
                raw = (histogram.count, histogram.sum, *histogram.bucket_counts)
                _series(group, key).add(now, raw, histogram.bounds)
        increase = 0.0
        for key, value in reading.generation_tokens.items():
            series = _series(self._tokens, key)
            before = series.points[-1][1] if series.points else None
            series.add(now, (value,))
            if before is not None and len(series.points) >= 2:
                increase += series.points[-1][1] - before
        if reading.generation_tokens:
            self._generated_so_far += increase
            self._generated_tokens.append((now, self._generated_so_far))
        if reading.waiting is not None:
            self._waiting.append((now, reading.waiting))
        if reading.kv_cache_usage_ratio is not None:
            self._kv_cache_usage.append((now, reading.kv_cache_usage_ratio))
        self._scrapes.append(now)
        for history in (self._waiting, self._kv_cache_usage, self._generated_tokens, self._scrapes):
            while len(history) > MAX_WINDOW_POINTS:
                history.popleft()
        # The oldest readings go until the rest fit (the newest always stays: it fits on its own).
        while self.bytes > MAX_WINDOW_BYTES and len(self._scrapes) > 1:
            self._scrapes.popleft()
            self._drop_before(self._scrapes[0])
        self._last = reading
        self._error = ""

    def _groups(self) -> tuple[SeriesGroup, ...]:
        return (*self._histograms.values(), self._tokens)

    def _drop_before(self, oldest_seconds: float) -> None:
        """Forget what is older than `oldest_seconds`, and the series left without a point (an
        engine removed, a label value gone)."""
        for group in self._groups():
            for key in list(group):
                group[key].prune(oldest_seconds)
                if not group[key].points:
                    del group[key]
        for history in (self._waiting, self._kv_cache_usage, self._generated_tokens):
            while history and history[0][0] < oldest_seconds:
                history.popleft()
        while self._scrapes and self._scrapes[0] < oldest_seconds:
            self._scrapes.popleft()

    def _refusal(self, reading: ServerReading) -> str:
        """Why `reading` cannot be kept ("" when it can): too many series, or too large a page."""
        kept = sum(len(group) for group in self._groups())
        added = 0
        size = 0
        tokens = [(self._tokens, key, (), 1) for key in reading.generation_tokens]
        histograms = [
            (self._histograms.get(kind, {}), key, histogram.bounds, 2 + len(histogram.bucket_counts))
            for kind, by_series in reading.histograms.items()
            for key, histogram in by_series.items()
        ]
        for group, key, bounds, width in (*histograms, *tokens):
            size += _point_bytes(width)
            if key not in group:
                added += 1
                size += _series_bytes(key) + _numbers_bytes(len(bounds), width)
        if kept + added > MAX_WINDOW_SERIES:
            return (
                f"{kept + added} series over the window, more than the {MAX_WINDOW_SERIES} kept"
                " (labels that take new values on every scrape?)"
            )
        if size > MAX_WINDOW_BYTES // 2:
            return f"its series take {size / _MIB:.1f} MiB, more than half of the {MAX_WINDOW_BYTES / _MIB:g} MiB kept"
        return ""

    @property
    def bytes(self) -> int:
        """What the counter series keep (the memory MAX_WINDOW_BYTES bounds), as counted here."""
        return sum(series.bytes for group in self._groups() for series in group.values())

    def forget(self) -> None:
        """Drop every point kept: what they say cannot be turned into figures."""
        self._histograms.clear()
        self._tokens.clear()
        self._waiting.clear()
        self._kv_cache_usage.clear()
        self._generated_tokens.clear()
        self._generated_so_far = 0.0
        self._scrapes.clear()
        self._last = None

    def add_error(self, error: str) -> None:
        """A failed scrape: the figures keep the last good data and carry the error."""
        self._error = error

    def _queue_time_trend(self) -> QueueTimeTrend | None:
        group = self._histograms.get("queue", {})
        found = _added_increase(group)
        if found is None:
            return None
        start, end, shape, _ = found
        middle = (start + end) / 2
        earlier = [0.0, 0.0]  # count, sum
        later = [0.0, 0.0]
        for series in group.values():
            halves = series.split(middle) if series.shape == shape else None
            if halves is None:
                continue
            for accumulated, half in ((earlier, halves[0]), (later, halves[1])):
                accumulated[0] += half[0]
                accumulated[1] += half[1]

        def mean(count_and_sum: list[float]) -> float | None:
            return count_and_sum[1] / count_and_sum[0] if count_and_sum[0] > 0 else None

        return QueueTimeTrend(mean(earlier), mean(later))

    def figures(self) -> ServiceFigures | None:
        last = self._last
        if last is None:
            # Never read: only the error says why (a server without metrics enabled, a hang).
            return ServiceFigures(self.service, "", 0.0, 0.0, error=self._error) if self._error else None
        latency: dict[str, LatencyFigures] = {}
        unreadable: list[str] = []
        covered = 0.0
        for kind, group in self._histograms.items():
            found = _added_increase(group)
            if found is None:
                continue
            start, end, shape, increase = found
            count, total, buckets = increase[0], increase[1], increase[2:]
            if not (math.isfinite(count) and math.isfinite(total) and readable_buckets(shape, buckets)):
                # Finite pages can still add up to this (a counter near the float limit): no figure.
                unreadable.append(f"{kind} histogram over the window")
                continue
            covered = max(covered, end - start)
            latency[kind] = LatencyFigures(
                requests=count,
                mean_seconds=total / count if count > 0 else None,
                quantiles={q: _readable_quantile(q, shape, buckets) for q in QUANTILES},
            )
        tokens_per_second: float | None = None
        tokens = _added_increase(self._tokens)
        if tokens is not None and tokens[1] > tokens[0] and math.isfinite(tokens[3][0]):
            seconds = tokens[1] - tokens[0]
            tokens_per_second = tokens[3][0] / seconds
            covered = max(covered, seconds)
        elif last.generation_throughput is not None:
            tokens_per_second = last.generation_throughput
        series = [s for group in (*self._histograms.values(), self._tokens) for s in group.values()]
        return ServiceFigures(
            service=self.service,
            kind=last.kind,
            timestamp_seconds=last.timestamp_seconds,
            window_seconds=covered,
            latency=latency,
            running=last.running,
            waiting=last.waiting,
            kv_cache_usage_ratio=last.kv_cache_usage_ratio,
            generation_tokens_per_second=tokens_per_second,
            waiting_history=tuple(self._waiting),
            kv_cache_usage_history=tuple(self._kv_cache_usage),
            queue_time_trend=self._queue_time_trend(),
            generated_tokens_history=tuple(self._generated_tokens),
            resets=max((s.resets for s in series), default=0),
            error=self._error or (f"{UNREADABLE}: " + ", ".join(unreadable) if unreadable else ""),
        )
