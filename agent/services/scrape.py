"""An inference server's own view of its latency: scrape its Prometheus `/metrics`, keep the
cumulative histograms over a sliding window, and turn their deltas into quantiles.

Scraping
--------
`scrape(url, ...)` GETs the page with a total deadline covering connect, headers and body (not a
per-read timeout: a server that drips its headers or body one byte a second is cut off too;
`agent.host.http_read`) and a size cap (a 50 MB page is an error, never read whole), following a
redirect only to the same scheme, host and port, parses it with prometheus-client's text parser
(its OpenMetrics parser for a page ending in `# EOF`) and returns one `ServerReading`. A page that
cannot be believed is a ScrapeError starting "unreadable page": a histogram with NaN, infinite,
negative or non-cumulative counts, an `le` that is not a number, more than MAX_HISTOGRAM_BUCKETS
buckets or MAX_SERIES_PER_FAMILY label sets, more than MAX_SELECTED_LINES lines of the families
read. Only the
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
| queue time | `sglang:queue_time_seconds` | `vllm:request_queue_time_seconds` |
| running | `sglang:num_running_reqs` | `vllm:num_requests_running` |
| waiting | `sglang:num_queue_reqs` | `vllm:num_requests_waiting` |
| KV cache usage 0..1 | `sglang:token_usage` | `vllm:kv_cache_usage_perc` (before 0.9: `gpu_cache_usage_perc`) |
| generated tokens | `sglang:generation_tokens_total` | `vllm:generation_tokens_total` |

Series are taken as the servers mean them: vLLM's engines (`engine`) and sglang's data-parallel
ranks (`dp_rank`) are separate batches and are added; sglang's TP ranks (`tp_rank`, every one of
them exporting with `--enable-metrics-for-all-schedulers`) are copies of one batch and count once
(REPLICA_LABELS). Usage ratios take the fullest series. The text parser names a counter family
without its `_total` suffix when a TYPE line declares it; both spellings are looked up.

Windows
-------
`LatencyWindow` keeps each scrape's cumulative counters (histogram buckets, count and sum, the
token counter) per series, each made monotonic across its own resets the way PromQL's
`increase()` does: a counter that went down started again from zero, so its new value is all
increase, and one engine restarting leaves the others' series alone. Each series is differenced
newest point against oldest inside the window and the increases are added; quantiles interpolate
linearly inside the bucket that holds the rank, as `histogram_quantile` does. The window also
keeps the waiting queue, the KV cache usage and the generated-token total per scrape, and splits
the queue-time histogram into the window's older and newer half (`QueueTimeTrend`). A series keeps
at most MAX_WINDOW_POINTS points, so what one service keeps is bounded; deltas that are not finite
leave their figure out with an "unreadable page" error.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import re
import time
import urllib.parse
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from agent.host import http_read

ServerKind = Literal["sglang", "vllm", "generic"]
LatencyKind = Literal["e2e", "ttft", "itl", "queue"]

LATENCY_KINDS: tuple[LatencyKind, ...] = ("e2e", "ttft", "itl", "queue")
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


def _latency_histograms(prefix: str, queue: str) -> dict[LatencyKind, tuple[str, ...]]:
    """sglang and vLLM name their latency histograms alike, each under its own prefix; only the
    queue-time histogram is named differently."""
    return {
        "e2e": (f"{prefix}e2e_request_latency_seconds",),
        "ttft": (f"{prefix}time_to_first_token_seconds",),
        "itl": (f"{prefix}inter_token_latency_seconds", f"{prefix}time_per_output_token_seconds"),
        "queue": (f"{prefix}{queue}",),
    }


FAMILIES: dict[str, Families] = {
    "sglang": Families(
        histograms=_latency_histograms("sglang:", "queue_time_seconds"),
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_cache_usage=("sglang:token_usage",),
        generation_tokens=("sglang:generation_tokens",),
        generation_throughput=("sglang:gen_throughput",),
    ),
    "vllm": Families(
        histograms=_latency_histograms("vllm:", "request_queue_time_seconds"),
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


#: Redirects followed per scrape, each within the scrape's one total deadline.
MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


# Prometheus text first; an OpenMetrics answer (a proxy that insists) is read all the same.
_ACCEPT = "text/plain;version=0.0.4;q=1,application/openmetrics-text;version=1.0.0;q=0.5"


def _origin_of(parts: urllib.parse.SplitResult) -> tuple[str, str, int]:
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port


def fetch_text(url: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """GET url within `timeout_seconds` in total (connect, headers and body, every redirect
    included), reading at most `max_bytes`; ScrapeError otherwise.

    A redirect to the same scheme, host and port is followed (at most MAX_REDIRECTS, as
    Prometheus follows vLLM's `307 /metrics -> /metrics/`); one anywhere else is an error: the
    agent reads the server it was configured for and nothing else. No proxy from the environment
    is used: the server is local to the node.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeError(f"not an http(s) URL: {url}")
    origin = _origin_of(parts)
    deadline = time.monotonic() + timeout_seconds
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ScrapeError(f"timed out after {timeout_seconds:g} s")
        try:
            answer = http_read.get(current, left, max_bytes, accept=_ACCEPT)
        except http_read.HttpTimedOut:
            raise ScrapeError(f"timed out after {timeout_seconds:g} s") from None
        except http_read.HttpReadError as exc:
            raise ScrapeError(exc.detail) from None
        if answer.status in _REDIRECT_STATUSES and answer.location:
            target = urllib.parse.urljoin(current, answer.location)
            if _origin_of(urllib.parse.urlsplit(target)) != origin:
                raise ScrapeError(f"redirected to another origin ({target}): not followed")
            current = target
            continue
        if not 200 <= answer.status < 300:
            raise ScrapeError(f"HTTP {answer.status}")
        return answer.body.decode("utf-8", "replace")
    raise ScrapeError(f"more than {MAX_REDIRECTS} redirects")


# -- parsing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram of one series: `bucket_counts[i]` observations at or
    below `bounds[i]`; the last bound is +Inf."""

    bounds: tuple[float, ...]
    bucket_counts: tuple[float, ...]
    count: float
    sum: float


#: A series' labels, sorted, without `le` and without the replica labels.
SeriesKey = tuple[tuple[str, str], ...]

#: Labels that name a copy of the same batch, not a batch of its own: with sglang's
#: `--enable-metrics-for-all-schedulers` every tensor-parallel rank exports the batch its group
#: runs together under its own `tp_rank`. Such copies are counted once (the lowest rank's series
#: stands for its group). Data-parallel ranks (`dp_rank`) and vLLM's engines (`engine`) run
#: separate batches and stay separate series, added up.
REPLICA_LABELS = frozenset({"tp_rank"})


@dataclass(frozen=True)
class ServerReading:
    """One scrape of a server's `/metrics`: cumulative histograms and counters per series (a
    server restarting one engine of several resets only that engine's series), current gauges."""

    timestamp_seconds: float
    kind: str
    histograms: dict[str, dict[SeriesKey, Histogram]] = field(default_factory=dict)  # LATENCY_KINDS
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage_ratio: float | None = None
    generation_tokens: dict[SeriesKey, float] = field(default_factory=dict)  # the counter, per series
    generation_throughput: float | None = None  # the server's own tokens/s gauge (sglang)
    families: dict[str, str] = field(default_factory=dict)  # figure -> the family name found

    def histogram(self, kind: str) -> Histogram | None:
        """`kind`'s series added up (those with the first series' bucket boundaries)."""
        return _added(list(self.histograms.get(kind, {}).values()))

    @property
    def generation_tokens_total(self) -> float | None:
        return sum(self.generation_tokens.values()) if self.generation_tokens else None


def _added(histograms: Sequence[Histogram]) -> Histogram | None:
    if not histograms:
        return None
    bounds = histograms[0].bounds
    same = [h for h in histograms if h.bounds == bounds]
    buckets = tuple(sum(h.bucket_counts[i] for h in same) for i in range(len(bounds)))
    return Histogram(bounds, buckets, sum(h.count for h in same), sum(h.sum for h in same))


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


def is_openmetrics(text: str) -> bool:
    """An OpenMetrics page ends with `# EOF` (mandatory there, absent from the text format)."""
    tail = text[-64:].rstrip()  # only the end: a page is up to megabytes
    return tail.endswith("# EOF") and (len(tail) == len("# EOF") or tail[-len("\n# EOF")] == "\n")


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


Sample = tuple[str, Mapping[str, str], float]


def _rank_order(rank: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    return tuple((int(value), "") if value.isdigit() else (1 << 62, value) for value in rank)


_REPLICA_ORDER = tuple(sorted(REPLICA_LABELS))


def _one_copy_per_batch(samples: Sequence[Sample]) -> list[tuple[str, SeriesKey, Mapping[str, str], float]]:
    """Each sample with its series key; of the copies a replica label tells apart (the same
    batch on every TP rank), only the lowest rank's samples are kept."""
    keyed: list[tuple[str, SeriesKey, tuple[str, ...], Mapping[str, str], float]] = []
    lowest: dict[SeriesKey, tuple[str, ...]] = {}
    for name, labels, value in samples:
        # dict copy and pop run in C: this is per sample, hundreds per page
        rest = dict(labels)
        rest.pop("le", None)
        rank = tuple([rest.pop(label) for label in _REPLICA_ORDER if label in rest])
        key = tuple(sorted(rest.items()))
        keyed.append((name, key, rank, labels, value))
        held = lowest.get(key)
        if held is None or (held != rank and _rank_order(rank) < _rank_order(held)):
            lowest[key] = rank
    return [(name, key, labels, value) for name, key, rank, labels, value in keyed if rank == lowest[key]]


def _unreadable_series(family: str, bounds: Sequence[float], counts: Sequence[float]) -> str:
    """Why one series' cumulative buckets cannot be believed; "" when they can."""
    if len(bounds) > MAX_HISTOGRAM_BUCKETS:
        return f"{family} has {len(bounds)} buckets, more than the {MAX_HISTOGRAM_BUCKETS} read"
    if not all(math.isfinite(c) and c >= 0 for c in counts):
        return f"{family} has a bucket that is not a finite count"
    if any(later < earlier for earlier, later in itertools.pairwise(counts)):
        return f"{family} has buckets that are not cumulative"
    return ""


def _histograms_by_series(samples: Sequence[Sample], family: str) -> dict[SeriesKey, Histogram]:
    """The family's series, each one batch; ScrapeError ("unreadable page") when a series' bounds,
    counts or sum cannot be believed (NaN, Inf, a non-number `le`, buckets that go down, too many)."""
    buckets: dict[SeriesKey, dict[float, float]] = {}
    counts: dict[SeriesKey, float] = {}
    sums: dict[SeriesKey, float] = {}
    for name, key, labels, value in _one_copy_per_batch(samples):
        if name == family + "_bucket" and "le" in labels:
            try:
                bound = float(labels["le"])
            except ValueError:
                raise ScrapeError(f"{UNREADABLE}: {family} has a bucket le={labels['le'][:40]!r}") from None
            if math.isnan(bound):
                raise ScrapeError(f"{UNREADABLE}: {family} has a bucket le=NaN")
            buckets.setdefault(key, {})[bound] = value
        elif name == family + "_count":
            counts[key] = value
        elif name == family + "_sum":
            sums[key] = value
        if len(buckets) > MAX_SERIES_PER_FAMILY:
            raise ScrapeError(f"{UNREADABLE}: {family} has more than {MAX_SERIES_PER_FAMILY} label sets")
    if not all(math.isfinite(v) and v >= 0 for v in (*counts.values(), *sums.values())):
        raise ScrapeError(f"{UNREADABLE}: {family} has a count or sum that is not a finite number")
    found: dict[SeriesKey, Histogram] = {}
    for key, by_bound in buckets.items():
        bounds = tuple(sorted(by_bound))
        problem = _unreadable_series(family, bounds, [by_bound[b] for b in bounds])
        if problem:
            raise ScrapeError(f"{UNREADABLE}: {problem}")
        if not bounds or not math.isinf(bounds[-1]):
            continue  # no +Inf bucket: not a histogram quantiles can be drawn from
        found[key] = Histogram(
            bounds,
            tuple(by_bound[b] for b in bounds),
            counts.get(key, by_bound[math.inf]),
            sums.get(key, 0.0),
        )
    return found


_SAMPLE_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*")
_PLAIN_LABELS = re.compile(
    r'(?:[ \t]*[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"[^"\\]*"[ \t]*,)*'
    r'(?:[ \t]*[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"[^"\\]*"[ \t]*)?'
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*)"')


class _NotPlain(Exception):
    """A line the plain reader does not take (escapes, odd spacing): prometheus-client reads the page."""


def _plain_samples(selected: str) -> dict[str, list[Sample]]:
    """The selected lines' samples by family, for the text format as servers write it (no escapes
    in label values): a regular expression per line instead of prometheus-client's character-by-
    character reader, which costs ~30 µs a line with sglang's six labels (a DP=8 page's queue-time
    histograms alone are ~300 lines). _NotPlain for anything else."""
    by_family: dict[str, list[Sample]] = {}
    for line in selected.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_LINE.fullmatch(line)
        if match is None:
            raise _NotPlain(line)
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            raise _NotPlain(line) from None
        by_family.setdefault(_base_name(name), []).append((name, _plain_labels(labels or ""), number))
    return by_family


#: Label sets cached, and the longest one cached: a bound of ~2 MB however hostile the pages (a
#: real sglang page at DP=8 has ~500 label sets of ~120 characters).
_CACHED_LABEL_SETS = 4096
_CACHED_LABELS_MAX_CHARS = 512


def _plain_labels(text: str) -> Mapping[str, str]:
    """`a="1",b="2"` -> a read-only mapping. A server writes the same label sets every scrape, so
    each short one is read once."""
    return _cached_labels(text) if len(text) <= _CACHED_LABELS_MAX_CHARS else _read_labels(text)


def _read_labels(text: str) -> Mapping[str, str]:
    if text and _PLAIN_LABELS.fullmatch(text) is None:
        raise _NotPlain(text[:80])
    return MappingProxyType(dict(_LABEL.findall(text)))


_cached_labels = functools.lru_cache(maxsize=_CACHED_LABEL_SETS)(_read_labels)


def _parse_families(selected: str, openmetrics: bool) -> dict[str, list[Sample]]:
    """Samples by family name (prometheus-client's naming: a counter without `_total`)."""
    if not openmetrics:
        try:
            return _plain_samples(selected)
        except _NotPlain:
            families: list[Metric] = list(text_string_to_metric_families(selected))
    else:
        # Its parser wants the terminator, which the line selection dropped.
        families = list(openmetrics_families(selected + "# EOF\n"))  # type: ignore[no-untyped-call]
    return {f.name: [(s.name, s.labels, float(s.value)) for s in f.samples] for f in families}


def parse_reading(text: str, kind: str | None = None, timestamp_seconds: float | None = None) -> ServerReading:
    """A page of Prometheus text or OpenMetrics -> a ServerReading (kind detected when None).
    ScrapeError when the text is neither."""
    now = time.time() if timestamp_seconds is None else timestamp_seconds
    if kind is None:
        kind = detect_kind(_metric_name(line) for line in text.splitlines() if line and not line.startswith("#"))
    families = FAMILIES.get(kind)
    if families is None:
        return ServerReading(now, kind)
    wanted = families.names()
    try:
        parsed = _parse_families(_select_lines(text, wanted), is_openmetrics(text))
    except ScrapeError:
        raise
    except Exception as exc:  # the parsers' every complaint about untrusted text, whatever its type
        raise ScrapeError(f"not Prometheus text: {str(exc)[:200]}") from None

    found: dict[str, str] = {}

    def samples_of(figure: str, candidates: tuple[str, ...]) -> tuple[str, list[Sample]]:
        for name in candidates:
            samples = parsed.get(name) or parsed.get(name + "_total")
            if samples:
                found[figure] = name
                return name, samples
        return "", []

    def per_series(figure: str, candidates: tuple[str, ...], suffix: str = "") -> dict[SeriesKey, float]:
        name, samples = samples_of(figure, candidates)
        return {
            # A gauge or counter that is not a finite number says nothing: the figure is absent.
            key: v
            for n, key, _, v in _one_copy_per_batch(samples)
            if n in (name, name + suffix) and math.isfinite(v)
        }

    def summed(figure: str, candidates: tuple[str, ...]) -> float | None:
        values = per_series(figure, candidates)
        return sum(values.values()) if values else None

    def fullest(figure: str, candidates: tuple[str, ...]) -> float | None:
        # Every copy counts here: the fullest pool is the one that turns requests away.
        name, samples = samples_of(figure, candidates)
        values = [v for n, _, v in samples if n == name and math.isfinite(v)]
        return max(values) if values else None

    histograms: dict[str, dict[SeriesKey, Histogram]] = {}
    for latency_kind, candidates in families.histograms.items():
        name, samples = samples_of(latency_kind, candidates)
        series = _histograms_by_series(samples, name) if samples else {}
        if series:
            histograms[latency_kind] = series
    return ServerReading(
        timestamp_seconds=now,
        kind=kind,
        histograms=histograms,
        running=summed("running", families.running),
        waiting=summed("waiting", families.waiting),
        kv_cache_usage_ratio=fullest("kv_cache_usage", families.kv_cache_usage),
        generation_tokens=per_series("generation_tokens", families.generation_tokens, "_total"),
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
    """One series' cumulative counters made monotonic across its resets, with their timestamps."""

    def __init__(self) -> None:
        self.shape: tuple[float, ...] | None = None
        self.points: deque[tuple[float, tuple[float, ...]]] = deque()
        self.last_raw: tuple[float, ...] | None = None
        self.resets = 0

    def add(self, timestamp_seconds: float, raw: tuple[float, ...], shape: tuple[float, ...] = ()) -> None:
        if shape != self.shape or self.last_raw is None or len(raw) != len(self.last_raw) or not self.points:
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

    def split(self, middle_seconds: float) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """The increase before and after `middle_seconds` (the newest point at or before it divides)."""
        if len(self.points) < 2:
            return None
        first, last = self.points[0][1], self.points[-1][1]
        after = bisect.bisect_right(self.points, middle_seconds, key=lambda point: point[0])
        divide = self.points[after - 1][1] if after > 0 else first
        return tuple(b - a for a, b in zip(first, divide)), tuple(b - a for a, b in zip(divide, last))


SeriesGroup = dict[SeriesKey, _CounterSeries]


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
    """What a service's server says about itself over the window: the figures status and metrics show."""

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
        self._histograms: dict[str, SeriesGroup] = {}
        self._tokens: SeriesGroup = {}
        self._waiting: deque[tuple[float, float]] = deque()
        self._kv_cache_usage: deque[tuple[float, float]] = deque()
        self._generated_tokens: deque[tuple[float, float]] = deque()  # (time, cumulative increase)
        self._generated_so_far = 0.0
        self._last: ServerReading | None = None
        self._error = ""

    def add(self, reading: ServerReading) -> None:
        now = reading.timestamp_seconds
        for kind, by_series in reading.histograms.items():
            group = self._histograms.setdefault(kind, {})
            for key, histogram in by_series.items():
                raw = (histogram.count, histogram.sum, *histogram.bucket_counts)
                group.setdefault(key, _CounterSeries()).add(now, raw, histogram.bounds)
        increase = 0.0
        for key, value in reading.generation_tokens.items():
            series = self._tokens.setdefault(key, _CounterSeries())
            before = series.points[-1][1][0] if series.points else None
            series.add(now, (value,))
            if before is not None and len(series.points) >= 2:
                increase += series.points[-1][1][0] - before
        if reading.generation_tokens:
            self._generated_so_far += increase
            self._generated_tokens.append((now, self._generated_so_far))
        if reading.waiting is not None:
            self._waiting.append((now, reading.waiting))
        if reading.kv_cache_usage_ratio is not None:
            self._kv_cache_usage.append((now, reading.kv_cache_usage_ratio))
        oldest = now - self.window_seconds
        for group in (*self._histograms.values(), self._tokens):
            for key in list(group):
                group[key].prune(oldest)
                if not group[key].points:  # a series gone for a whole window (an engine removed)
                    del group[key]
        for history in (self._waiting, self._kv_cache_usage, self._generated_tokens):
            while history and history[0][0] < oldest:
                history.popleft()
            while len(history) > MAX_WINDOW_POINTS:
                history.popleft()
        self._last = reading
        self._error = ""

    def forget(self) -> None:
        """Drop every point kept: what they say cannot be turned into figures."""
        self._histograms.clear()
        self._tokens.clear()
        self._waiting.clear()
        self._kv_cache_usage.clear()
        self._generated_tokens.clear()
        self._generated_so_far = 0.0
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
                quantiles={q: histogram_quantile(q, shape, buckets) for q in QUANTILES},
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
