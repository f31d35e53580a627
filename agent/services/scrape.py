"""An inference server's own view of its latency: scrape its Prometheus `/metrics`, keep the
cumulative histograms over a sliding window, and turn their deltas into quantiles.

Scraping
--------
`scrape(url, ...)` GETs the page with a total deadline (not a per-read timeout: a server that
drips one byte a second is cut off too) and a size cap (a 50 MB page is an error, never read
whole), parses it with prometheus-client's text parser and returns one `ServerReading`. Only the
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
linearly inside the bucket that holds the rank, as `histogram_quantile` does.
"""

from __future__ import annotations

import http.client
import math
import re
import time
import urllib.parse
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

ServerKind = Literal["sglang", "vllm", "generic"]
LatencyKind = Literal["e2e", "ttft", "itl"]

LATENCY_KINDS: tuple[LatencyKind, ...] = ("e2e", "ttft", "itl")
QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
DEFAULT_WINDOW_SECONDS = 300.0
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_TIMEOUT_SECONDS = 2.0
_READ_CHUNK_BYTES = 64 * 1024


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
    """GET url within `timeout_seconds` in total, reading at most `max_bytes`; ScrapeError otherwise.

    No proxy from the environment is used: the server is local to the node.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeError(f"not an http(s) URL: {url}")
    deadline = time.monotonic() + timeout_seconds
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=timeout_seconds)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    try:
        connection.request(
            "GET", target, headers={"User-Agent": "gpu-agent", "Accept": "text/plain", "Accept-Encoding": "identity"}
        )
        _remaining(deadline, timeout_seconds, connection)
        response = connection.getresponse()
        if not 200 <= response.status < 300:
            raise ScrapeError(f"HTTP {response.status}")
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise ScrapeError(f"response is {int(length)} bytes, more than the {max_bytes} byte limit")
        chunks: list[bytes] = []
        size = 0
        while True:
            _remaining(deadline, timeout_seconds, connection)
            # read1: at most one read from the socket, so the deadline is checked between reads.
            chunk = response.read1(_READ_CHUNK_BYTES)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise ScrapeError(f"response larger than the {max_bytes} byte limit")
            chunks.append(chunk)
    except ScrapeError:
        raise
    except TimeoutError:
        raise ScrapeError(f"timed out after {timeout_seconds:g} s") from None
    except (OSError, http.client.HTTPException) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise ScrapeError(detail.lower() if isinstance(exc, OSError) else f"{type(exc).__name__}: {detail}") from None
    finally:
        connection.close()
    return b"".join(chunks).decode("utf-8", "replace")


def _remaining(deadline: float, timeout_seconds: float, connection: http.client.HTTPConnection) -> None:
    """Give the next socket operation only what is left of the total deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ScrapeError(f"timed out after {timeout_seconds:g} s")
    if connection.sock is not None:
        connection.sock.settimeout(left)


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
    mostly families we do not read (per-stage latencies, process metrics)."""
    # str.startswith with a tuple runs in C: a cheap first cut, confirmed on the exact name below.
    prefixes = tuple(prefix + name for name in wanted for prefix in ("", "# HELP ", "# TYPE "))
    kept: list[str] = []
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        name = line.split(maxsplit=3)[2] if line.startswith("#") else _metric_name(line)
        if name in wanted or _base_name(name) in wanted:
            kept.append(line)
    return "\n".join(kept) + "\n"


#: One sample of a page: its name, labels and value.
SampleRow = tuple[str, dict[str, str], float]

# A sample line as servers write them: no escapes in label values, a plain number. Anything else
# (escapes, odd spacing, a bad line) goes to prometheus_client's parser, which judges it.
_LABEL_PAIR = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
_SAMPLE_LINE = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)"
    rf"(?:\{{((?:{_LABEL_PAIR}(?:,{_LABEL_PAIR})*,?)?)\}})?"
    r"[ \t]+([-+]?(?:[0-9]+\.?[0-9]*(?:[eE][-+]?[0-9]+)?|\.[0-9]+(?:[eE][-+]?[0-9]+)?|Inf|NaN))"
    r"(?:[ \t]+-?[0-9]+)?[ \t]*"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
#: The sample names prometheus_client's parser files under a family of each type.
_TYPE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("",),
    "gauge": ("",),
    "summary": ("_count", "_sum", ""),
    "histogram": ("_count", "_sum", "_bucket"),
}


def _parse_families(text: str) -> dict[str, list[SampleRow]]:
    """Family name -> its samples, as prometheus_client's parser files them (a counter under its
    name without `_total`, its samples with it). A page as servers write it (each family's HELP
    and TYPE, then its samples, plain label values and numbers) is read here at a fraction of that
    parser's cost (every service is scraped every loop); any other page goes to that parser, which
    judges it. ScrapeError when the text is not Prometheus text."""
    parsed: dict[str, list[SampleRow]] = {}
    opened: set[str] = set()
    name, kind = "", "untyped"
    allowed: tuple[str, ...] = ("",)
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE") or not _METRIC_NAME.fullmatch(parts[2]):
                return _parse_families_slowly(text)
            if parts[2] != name:
                if parts[2] in opened:  # a family seen before: the parser keeps only its last block
                    return _parse_families_slowly(text)
                opened.add(parts[2])
                name, kind, allowed = parts[2], "untyped", ("",)
            if parts[1] == "TYPE":
                if len(parts) < 4:
                    return _parse_families_slowly(text)
                kind = parts[3].strip()
                allowed = _TYPE_SUFFIXES.get(kind, ("",))
            continue
        match = _SAMPLE_LINE.fullmatch(line)
        if match is None or not name:  # not plain, or a sample with no HELP or TYPE before it
            return _parse_families_slowly(text)
        sample, labels, value = match.groups()
        if not sample.startswith(name) or sample[len(name) :] not in allowed:
            return _parse_families_slowly(text)  # the parser makes it a family of its own
        family = name
        if kind == "counter":
            if name.endswith("_total"):
                family = name[: -len("_total")]
            else:
                sample += "_total"
        parsed.setdefault(family, []).append((sample, dict(_LABEL.findall(labels)) if labels else {}, float(value)))
    return parsed


def _parse_families_slowly(text: str) -> dict[str, list[SampleRow]]:
    from prometheus_client.parser import text_string_to_metric_families  # only for pages out of the plain shape

    try:
        return {
            family.name: [(s.name, s.labels, float(s.value)) for s in family.samples]
            for family in text_string_to_metric_families(text)
        }
    except (ValueError, IndexError, KeyError) as exc:
        raise ScrapeError(f"not Prometheus text: {exc}") from None


def _sum_histogram(samples: Sequence[SampleRow], family: str) -> Histogram | None:
    by_series: dict[tuple[tuple[str, str], ...], dict[float, float]] = {}
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    sums: dict[tuple[tuple[str, str], ...], float] = {}
    for name, labels, value in samples:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        if name == family + "_bucket" and "le" in labels:
            by_series.setdefault(key, {})[float(labels["le"])] = value
        elif name == family + "_count":
            counts[key] = value
        elif name == family + "_sum":
            sums[key] = value
    if not by_series:
        return None
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
    parsed = _parse_families(_select_lines(text, wanted))

    found: dict[str, str] = {}

    def samples_of(figure: str, candidates: tuple[str, ...]) -> tuple[str, list[SampleRow]]:
        for name in candidates:
            samples = parsed.get(name) or parsed.get(name + "_total")
            if samples:
                found[figure] = name
                return name, samples
        return "", []

    def summed(figure: str, candidates: tuple[str, ...], suffix: str = "") -> float | None:
        name, samples = samples_of(figure, candidates)
        values = [v for n, _, v in samples if n in (name, name + suffix) and not math.isnan(v)]
        return sum(values) if values else None

    def fullest(figure: str, candidates: tuple[str, ...]) -> float | None:
        name, samples = samples_of(figure, candidates)
        values = [v for n, _, v in samples if n == name and not math.isnan(v)]
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
    largest finite bound. None when there are no observations or no +Inf bucket."""
    if not bounds or not math.isinf(bounds[-1]) or not 0.0 <= q <= 1.0:
        return None
    counts = list(bucket_counts)
    for i in range(1, len(counts)):  # tolerate non-monotonic buckets, as Prometheus does
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    index = next(i for i, c in enumerate(counts) if c >= rank)
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
    return lower + (upper - lower) * (rank - below) / in_bucket


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
        oldest = now - self.window_seconds
        for series in (*self._histograms.values(), self._tokens):
            series.prune(oldest)
        while self._waiting and self._waiting[0][0] < oldest:
            self._waiting.popleft()
        self._last = reading
        self._error = ""

    def add_error(self, error: str) -> None:
        """A failed scrape: the figures keep the last good data and carry the error."""
        self._error = error

    def figures(self) -> ServiceFigures | None:
        last = self._last
        if last is None:
            # Never read: only the error says why (a server without metrics enabled, a hang).
            return ServiceFigures(self.service, "", 0.0, 0.0, error=self._error) if self._error else None
        latency: dict[str, LatencyFigures] = {}
        covered = 0.0
        for kind, series in self._histograms.items():
            found = series.delta()
            if found is None or series.shape is None:
                continue
            seconds, increase = found
            covered = max(covered, seconds)
            count, total, buckets = increase[0], increase[1], increase[2:]
            latency[kind] = LatencyFigures(
                requests=count,
                mean_seconds=total / count if count > 0 else None,
                quantiles={q: histogram_quantile(q, series.shape, buckets) for q in QUANTILES},
            )
        tokens_per_second: float | None = None
        found_tokens = self._tokens.delta()
        if found_tokens is not None and found_tokens[0] > 0:
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
            error=self._error,
        )
