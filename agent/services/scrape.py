"""An inference server's own view of its latency: scrape its Prometheus `/metrics`, keep the
cumulative histograms over a sliding window, and turn their deltas into quantiles.

Scraping
--------
`scrape(url, ...)` GETs the page with a total deadline covering connect, headers and body (not a
per-read timeout: a server that drips its headers or body one byte a second is cut off too;
`agent.host.http_read`) and a size cap (a 50 MB page is an error, never read whole), parses it
with prometheus-client's text parser and returns one `ServerReading`. A page that cannot be
believed is a ScrapeError starting "unreadable page": a histogram with NaN, infinite, negative or
non-cumulative counts, an `le` that is not a number, more than MAX_HISTOGRAM_BUCKETS buckets or
MAX_SERIES_PER_FAMILY label sets, more than MAX_SELECTED_LINES lines of the families read. Only the
lines of the families we read are handed to the parser, which keeps a real sglang page (hundreds
of lines of process and per-stage families) well under a millisecond or two of parsing.

The families, checked against the servers' sources (sglang `srt/metrics/collector.py`, vLLM
`v1/metrics/loggers.py`); where a family was renamed the current name is tried first:

| figure | sglang | vLLM |
|---|---|---|
| e2e latency | `sglang:e2e_request_latency_seconds` | `vllm:e2e_request_latency_seconds` |
| TTFT | `sglang:time_to_first_token_seconds` | `vllm:time_to_first_token_seconds` |
| ITL | `sglang:inter_token_latency_seconds` | `vllm:inter_token_latency_seconds` |
| ITL, older name | `sglang:time_per_output_token_seconds` | `vllm:time_per_output_token_seconds` (< 0.11) |
| running | `sglang:num_running_reqs` | `vllm:num_requests_running` |
| waiting | `sglang:num_queue_reqs` | `vllm:num_requests_waiting` |
| KV cache usage 0..1 | `sglang:token_usage` | `vllm:kv_cache_usage_perc` (before 0.9: `gpu_cache_usage_perc`) |
| generated tokens | `sglang:generation_tokens_total` | `vllm:generation_tokens_total` |

Both servers label every series (`model_name`, vLLM's `engine`, sglang's `tp_rank` in
multi-process mode): counts are summed over label sets, usage ratios take the fullest one.
The parser names a counter family without its `_total` suffix; both spellings are looked up.

Windows
-------
`LatencyWindow` keeps each scrape's cumulative counters (histogram buckets, count and sum, the
token counter), made monotonic across server restarts the way PromQL's `increase()` does: a
counter that went down started again from zero, so its new value is all increase. The figures
difference the newest point against the oldest one inside the window; quantiles interpolate
linearly inside the bucket that holds the rank, as `histogram_quantile` does. A series keeps at
most MAX_WINDOW_POINTS points, so what one service keeps is bounded; deltas that are not finite
leave their figure out with an "unreadable page" error.
"""

from __future__ import annotations

import itertools
import math
import time
import urllib.parse
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from agent.host import http_read

ServerKind = Literal["sglang", "vllm", "generic"]
LatencyKind = Literal["e2e", "ttft", "itl"]

LATENCY_KINDS: tuple[LatencyKind, ...] = ("e2e", "ttft", "itl")
QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
DEFAULT_WINDOW_SECONDS = 300.0
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_TIMEOUT_SECONDS = 2.0
# What one service may keep (the window's memory bound): a real server's histograms have a few
# dozen buckets and a few label sets per family. More is refused as an unreadable page, before
# the parser builds an object per line.
MAX_HISTOGRAM_BUCKETS = 128
MAX_SERIES_PER_FAMILY = 256
MAX_SELECTED_LINES = 20_000
# Points per counter series: a window of 300 s scraped every 0.5 s or slower keeps them all; a
# faster scrape keeps the newest ones (the figures say the shorter span they cover).
MAX_WINDOW_POINTS = 600
UNREADABLE = "unreadable page"


@dataclass(frozen=True)
class Families:
    """The family names one kind of server uses for each figure, current name first."""

    histograms: Mapping[LatencyKind, tuple[str, ...]]
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_cache_usage: tuple[str, ...]
    generation_tokens: tuple[str, ...]  # counter families, without `_total`
    generation_throughput: tuple[str, ...] = ()  # the server's own tokens/s gauge, where it has one

    def names(self) -> frozenset[str]:
        groups: list[Iterable[str]] = [
            *self.histograms.values(),
            self.running,
            self.waiting,
            self.kv_cache_usage,
            self.generation_tokens,
            self.generation_throughput,
        ]
        return frozenset(name for group in groups for name in group)


def _latency_histograms(prefix: str) -> dict[LatencyKind, tuple[str, ...]]:
    """sglang and vLLM name their latency histograms alike, each under its own prefix."""
    return {
        "e2e": (f"{prefix}e2e_request_latency_seconds",),
        "ttft": (f"{prefix}time_to_first_token_seconds",),
        "itl": (f"{prefix}inter_token_latency_seconds", f"{prefix}time_per_output_token_seconds"),
    }


FAMILIES: dict[str, Families] = {
    "sglang": Families(
        histograms=_latency_histograms("sglang:"),
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_cache_usage=("sglang:token_usage",),
        generation_tokens=("sglang:generation_tokens",),
        generation_throughput=("sglang:gen_throughput",),
    ),
    "vllm": Families(
        histograms=_latency_histograms("vllm:"),
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_cache_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        generation_tokens=("vllm:generation_tokens",),
    ),
}
_PREFIXES: dict[str, str] = {"sglang": "sglang:", "vllm": "vllm:"}


class ScrapeError(Exception):
    """The page could not be fetched or parsed: timed out, too large, HTTP error, not Prometheus text."""


# -- fetching ------------------------------------------------------------------------------------


def fetch_text(url: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """GET url within `timeout_seconds` in total (connect, headers and body), reading at most
    `max_bytes`; ScrapeError otherwise.

    No proxy from the environment is used: the server is local to the node.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeError(f"not an http(s) URL: {url}")
    try:
        answer = http_read.get(url, timeout_seconds, max_bytes)
    except http_read.HttpReadError as exc:
        raise ScrapeError(exc.detail) from None
    if not 200 <= answer.status < 300:
        raise ScrapeError(f"HTTP {answer.status}")
    return answer.body.decode("utf-8", "replace")


# -- parsing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram summed over label sets: `bucket_counts[i]` observations
    at or below `bounds[i]`; the last bound is +Inf."""

    bounds: tuple[float, ...]
    bucket_counts: tuple[float, ...]
    count: float
    sum: float


@dataclass(frozen=True)
class ServerReading:
    """One scrape of a server's `/metrics`: cumulative histograms and counters, current gauges."""

    timestamp_seconds: float
    kind: str
    histograms: dict[str, Histogram] = field(default_factory=dict)  # "e2e" | "ttft" | "itl"
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage_ratio: float | None = None
    generation_tokens_total: float | None = None
    generation_throughput: float | None = None  # the server's own tokens/s gauge (sglang)
    families: dict[str, str] = field(default_factory=dict)  # figure -> the family name found


def _metric_name(line: str) -> str:
    end = len(line)
    for stop in ("{", " ", "\t"):
        position = line.find(stop)
        if 0 <= position < end:
            end = position
    return line[:end]


def _base_name(sample_name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_total", "_created"):
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def detect_kind(names: Iterable[str]) -> ServerKind:
    """sglang or vLLM from the families a page exposes; generic when it shows neither."""
    names = list(names)
    for kind in ("sglang", "vllm"):
        if any(name.startswith(_PREFIXES[kind]) for name in names):
            return "sglang" if kind == "sglang" else "vllm"
    return "generic"


def _select_lines(text: str, wanted: frozenset[str]) -> str:
    """The lines of the wanted families only: the parser's cost is per line, and a real page is
    mostly families we do not read (per-stage latencies, process metrics). ScrapeError when they
    are more lines than any real server writes."""
    # str.startswith with a tuple runs in C: a cheap first cut, confirmed on the exact name below.
    prefixes = tuple(prefix + name for name in wanted for prefix in ("", "# HELP ", "# TYPE "))
    kept: list[str] = []
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        words = line.split(maxsplit=3)
        name = (words[2] if len(words) > 2 else "") if line.startswith("#") else _metric_name(line)
        if name in wanted or _base_name(name) in wanted:
            kept.append(line)
            if len(kept) > MAX_SELECTED_LINES:
                raise ScrapeError(f"{UNREADABLE}: more than {MAX_SELECTED_LINES} lines of the families read")
    return "\n".join(kept) + "\n"


def _unreadable_series(family: str, bounds: Sequence[float], counts: Sequence[float]) -> str:
    """Why one series' cumulative buckets cannot be believed; "" when they can."""
    if len(bounds) > MAX_HISTOGRAM_BUCKETS:
        return f"{family} has {len(bounds)} buckets, more than the {MAX_HISTOGRAM_BUCKETS} read"
    if not all(math.isfinite(c) and c >= 0 for c in counts):
        return f"{family} has a bucket that is not a finite count"
    if any(later < earlier for earlier, later in itertools.pairwise(counts)):
        return f"{family} has buckets that are not cumulative"
    return ""


def _sum_histogram(samples: Sequence[tuple[str, dict[str, str], float]], family: str) -> Histogram | None:
    """The family's series summed; ScrapeError ("unreadable page") when a series' bounds, counts or
    sum cannot be believed (NaN, Inf, a non-number `le`, buckets that go down, too many)."""
    by_series: dict[tuple[tuple[str, str], ...], dict[float, float]] = {}
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    sums: dict[tuple[tuple[str, str], ...], float] = {}
    for name, labels, value in samples:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        if name == family + "_bucket" and "le" in labels:
            try:
                bound = float(labels["le"])
            except ValueError:
                raise ScrapeError(f"{UNREADABLE}: {family} has a bucket le={labels['le'][:40]!r}") from None
            if math.isnan(bound):
                raise ScrapeError(f"{UNREADABLE}: {family} has a bucket le=NaN")
            by_series.setdefault(key, {})[bound] = value
        elif name == family + "_count":
            counts[key] = value
        elif name == family + "_sum":
            sums[key] = value
        if len(by_series) > MAX_SERIES_PER_FAMILY:
            raise ScrapeError(f"{UNREADABLE}: {family} has more than {MAX_SERIES_PER_FAMILY} label sets")
    if not by_series:
        return None
    for buckets in by_series.values():
        ordered = sorted(buckets)
        problem = _unreadable_series(family, ordered, [buckets[b] for b in ordered])
        if problem:
            raise ScrapeError(f"{UNREADABLE}: {problem}")
    if not all(math.isfinite(v) and v >= 0 for v in (*counts.values(), *sums.values())):
        raise ScrapeError(f"{UNREADABLE}: {family} has a count or sum that is not a finite number")
    # Series with other bucket boundaries than the first cannot be added bucket by bucket.
    first = next(iter(by_series.values()))
    bounds = tuple(sorted(first))
    if not bounds or not math.isinf(bounds[-1]):
        return None
    same = [key for key, buckets in by_series.items() if tuple(sorted(buckets)) == bounds]
    bucket_counts = tuple(sum(by_series[key][bound] for key in same) for bound in bounds)
    count = sum(counts.get(key, by_series[key][math.inf]) for key in same)
    total = sum(sums.get(key, 0.0) for key in same)
    return Histogram(bounds, bucket_counts, count, total)


def parse_reading(text: str, kind: str | None = None, timestamp_seconds: float | None = None) -> ServerReading:
    """A page of Prometheus text -> a ServerReading (kind detected when None). ScrapeError when
    the text is not the Prometheus exposition format."""
    now = time.time() if timestamp_seconds is None else timestamp_seconds
    if kind is None:
        kind = detect_kind(_metric_name(line) for line in text.splitlines() if line and not line.startswith("#"))
    families = FAMILIES.get(kind)
    if families is None:
        return ServerReading(now, kind)
    wanted = families.names()
    try:
        parsed = {f.name: f for f in text_string_to_metric_families(_select_lines(text, wanted))}
    except ScrapeError:
        raise
    except Exception as exc:  # the parser's every complaint about untrusted text, whatever its type
        raise ScrapeError(f"not Prometheus text: {str(exc)[:200]}") from None

    found: dict[str, str] = {}

    def samples_of(figure: str, candidates: tuple[str, ...]) -> tuple[str, list[tuple[str, dict[str, str], float]]]:
        for name in candidates:
            family = parsed.get(name) or parsed.get(name + "_total")
            if family is not None and family.samples:
                found[figure] = name
                return name, [(s.name, s.labels, float(s.value)) for s in family.samples]
        return "", []

    def summed(figure: str, candidates: tuple[str, ...], suffix: str = "") -> float | None:
        name, samples = samples_of(figure, candidates)
        # A gauge or counter that is not a finite number says nothing: the figure is absent.
        values = [v for n, _, v in samples if n in (name, name + suffix) and math.isfinite(v)]
        return sum(values) if values else None

    def fullest(figure: str, candidates: tuple[str, ...]) -> float | None:
        name, samples = samples_of(figure, candidates)
        values = [v for n, _, v in samples if n == name and math.isfinite(v)]
        return max(values) if values else None

    histograms: dict[str, Histogram] = {}
    for latency_kind, candidates in families.histograms.items():
        name, samples = samples_of(latency_kind, candidates)
        histogram = _sum_histogram(samples, name) if samples else None
        if histogram is not None:
            histograms[latency_kind] = histogram
    return ServerReading(
        timestamp_seconds=now,
        kind=kind,
        histograms=histograms,
        running=summed("running", families.running),
        waiting=summed("waiting", families.waiting),
        kv_cache_usage_ratio=fullest("kv_cache_usage", families.kv_cache_usage),
        generation_tokens_total=summed("generation_tokens", families.generation_tokens, "_total"),
        generation_throughput=summed("generation_throughput", families.generation_throughput),
        families=found,
    )


def scrape(
    url: str,
    kind: str | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ServerReading:
    """Fetch and parse one server's `/metrics`; ScrapeError when it cannot."""
    text = fetch_text(url, timeout_seconds, max_bytes)
    return parse_reading(text, kind)


# -- quantiles -----------------------------------------------------------------------------------


def histogram_quantile(q: float, bounds: Sequence[float], bucket_counts: Sequence[float]) -> float | None:
    """The q-quantile of cumulative buckets, as PromQL's histogram_quantile: linear inside the
    bucket holding the rank (the first bucket starts at 0); a rank in the +Inf bucket gives the
    largest finite bound. None when there are no observations or no +Inf bucket, and when the
    buckets cannot be believed (`readable_buckets`): a quantile of them would be made up."""
    if not bounds or not math.isinf(bounds[-1]) or not 0.0 <= q <= 1.0 or len(bounds) != len(bucket_counts):
        return None
    if not readable_buckets(bounds, bucket_counts):
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
    return (
        all(math.isfinite(c) and c >= 0 for c in bucket_counts)
        and all(later >= earlier for earlier, later in itertools.pairwise(bucket_counts))
        and not any(math.isnan(b) for b in bounds)
        and all(later > earlier for earlier, later in itertools.pairwise(bounds))
    )


# -- the window ----------------------------------------------------------------------------------


class _CounterSeries:
    """Cumulative counters made monotonic across resets, with their timestamps."""

    def __init__(self) -> None:
        self.shape: tuple[float, ...] | None = None
        self.points: deque[tuple[float, tuple[float, ...]]] = deque()
        self.last_raw: tuple[float, ...] | None = None
        self.resets = 0

    def add(self, timestamp_seconds: float, raw: tuple[float, ...], shape: tuple[float, ...] = ()) -> None:
        if shape != self.shape or self.last_raw is None or len(raw) != len(self.last_raw):
            # New bucket boundaries cannot be differenced against the old ones: start over.
            self.shape = shape
            self.points.clear()
            self.points.append((timestamp_seconds, raw))
            self.last_raw = raw
            return
        previous = self.points[-1][1]
        reset = any(now < before for now, before in zip(raw, self.last_raw))
        if reset:
            self.resets += 1
            adjusted = tuple(p + r for p, r in zip(previous, raw))
        else:
            adjusted = tuple(p + (r - last) for p, r, last in zip(previous, raw, self.last_raw))
        self.points.append((timestamp_seconds, adjusted))
        self.last_raw = raw
        while len(self.points) > MAX_WINDOW_POINTS:
            self.points.popleft()

    def prune(self, oldest_seconds: float) -> None:
        while self.points and self.points[0][0] < oldest_seconds:
            self.points.popleft()

    def delta(self) -> tuple[float, tuple[float, ...]] | None:
        """(seconds covered, increase per counter) between the oldest and newest point kept."""
        if len(self.points) < 2:
            return None
        (t0, first), (t1, last) = self.points[0], self.points[-1]
        return t1 - t0, tuple(b - a for a, b in zip(first, last))


@dataclass(frozen=True)
class LatencyFigures:
    """One latency histogram over the window."""

    requests: float  # observations in the window
    mean_seconds: float | None
    quantiles: dict[float, float | None]  # 0.5 / 0.95 / 0.99 -> seconds


@dataclass(frozen=True)
class ServiceFigures:
    """What a service's server says about itself over the window: the figures status and metrics show."""

    service: str
    kind: str
    timestamp_seconds: float
    window_seconds: float  # the span the deltas cover (shorter than asked right after start)
    latency: dict[str, LatencyFigures] = field(default_factory=dict)  # "e2e" | "ttft" | "itl"
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage_ratio: float | None = None
    generation_tokens_per_second: float | None = None
    waiting_history: tuple[tuple[float, float], ...] = ()  # (timestamp, waiting) inside the window
    resets: int = 0  # counter resets (server restarts) seen so far
    error: str = ""  # the last scrape's error; figures are from earlier scrapes

    def quantile(self, kind: str, q: float) -> float | None:
        figures = self.latency.get(kind)
        return None if figures is None else figures.quantiles.get(q)


class LatencyWindow:
    """A service's scrapes over the last `window_seconds`; `figures()` turns them into quantiles,
    gauges and rates. One per service; fed by whoever scrapes (not thread-safe by itself)."""

    def __init__(self, service: str, window_seconds: float = DEFAULT_WINDOW_SECONDS) -> None:
        self.service = service
        self.window_seconds = window_seconds
        self._histograms: dict[str, _CounterSeries] = {}
        self._tokens = _CounterSeries()
        self._waiting: deque[tuple[float, float]] = deque()
        self._last: ServerReading | None = None
        self._error = ""

    def add(self, reading: ServerReading) -> None:
        now = reading.timestamp_seconds
        for kind, histogram in reading.histograms.items():
            series = self._histograms.setdefault(kind, _CounterSeries())
            series.add(now, (histogram.count, histogram.sum, *histogram.bucket_counts), histogram.bounds)
        if reading.generation_tokens_total is not None:
            self._tokens.add(now, (reading.generation_tokens_total,))
        if reading.waiting is not None:
            self._waiting.append((now, reading.waiting))
            while len(self._waiting) > MAX_WINDOW_POINTS:
                self._waiting.popleft()
        oldest = now - self.window_seconds
        for series in (*self._histograms.values(), self._tokens):
            series.prune(oldest)
        while self._waiting and self._waiting[0][0] < oldest:
            self._waiting.popleft()
        self._last = reading
        self._error = ""

    def forget(self) -> None:
        """Drop every point kept: what they say cannot be turned into figures."""
        self._histograms.clear()
        self._tokens = _CounterSeries()
        self._waiting.clear()
        self._last = None

    def add_error(self, error: str) -> None:
        """A failed scrape: the figures keep the last good data and carry the error."""
        self._error = error

    def figures(self) -> ServiceFigures | None:
        last = self._last
        if last is None:
            # Never read: only the error says why (a server without metrics enabled, a hang).
            return ServiceFigures(self.service, "", 0.0, 0.0, error=self._error) if self._error else None
        latency: dict[str, LatencyFigures] = {}
        unreadable: list[str] = []
        covered = 0.0
        for kind, series in self._histograms.items():
            found = series.delta()
            if found is None or series.shape is None:
                continue
            seconds, increase = found
            count, total, buckets = increase[0], increase[1], increase[2:]
            if not (math.isfinite(count) and math.isfinite(total) and readable_buckets(series.shape, buckets)):
                # Finite pages can still add up to this (a counter near the float limit): no figure.
                unreadable.append(f"{kind} histogram over the window")
                continue
            covered = max(covered, seconds)
            latency[kind] = LatencyFigures(
                requests=count,
                mean_seconds=total / count if count > 0 else None,
                quantiles={q: histogram_quantile(q, series.shape, buckets) for q in QUANTILES},
            )
        tokens_per_second: float | None = None
        found_tokens = self._tokens.delta()
        if found_tokens is not None and found_tokens[0] > 0 and math.isfinite(found_tokens[1][0]):
            tokens_per_second = found_tokens[1][0] / found_tokens[0]
            covered = max(covered, found_tokens[0])
        elif last.generation_throughput is not None:
            tokens_per_second = last.generation_throughput
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
            resets=max((s.resets for s in (*self._histograms.values(), self._tokens)), default=0),
            error=self._error or (f"{UNREADABLE}: " + ", ".join(unreadable) if unreadable else ""),
        )
