"""An inference server's own view of itself: scrape its Prometheus `/metrics` into one `ServerReading`.

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

The window over these readings, the quantiles and the figures are agent.services.window.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

from agent.host import http_read

ServerKind = Literal["sglang", "vllm", "generic"]
LatencyKind = Literal["e2e", "ttft", "itl", "queue"]

LATENCY_KINDS: tuple[LatencyKind, ...] = ("e2e", "ttft", "itl", "queue")
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_TIMEOUT_SECONDS = 2.0
# What one service may keep (the window's memory bound): a real server's histograms have a few
# dozen buckets and a few label sets per family. More is refused as an unreadable page, before
# the parser builds an object per line.
MAX_HISTOGRAM_BUCKETS = 128
MAX_SERIES_PER_FAMILY = 256
MAX_SELECTED_LINES = 20_000
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

    def only(self, figures: Collection[str]) -> Families:
        """These families with only `figures` (field names) read."""

        def kept(figure: str, names: tuple[str, ...]) -> tuple[str, ...]:
            return names if figure in figures else ()

        return Families(
            histograms=self.histograms if "histograms" in figures else {},
            running=kept("running", self.running),
            waiting=kept("waiting", self.waiting),
            kv_cache_usage=kept("kv_cache_usage", self.kv_cache_usage),
            generation_tokens=kept("generation_tokens", self.generation_tokens),
            generation_throughput=kept("generation_throughput", self.generation_throughput),
        )

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


# Prometheus text first; an OpenMetrics answer (a proxy that insists) is read all the same.
_ACCEPT = "text/plain;version=0.0.4;q=1,application/openmetrics-text;version=1.0.0;q=0.5"


def fetch_text(url: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """GET url within `timeout_seconds` in total (connect, headers and body, every redirect
    included), reading at most `max_bytes`; ScrapeError otherwise, whatever went wrong.

    A redirect to the same scheme, host and port is followed (at most MAX_REDIRECTS, as
    Prometheus follows vLLM's `307 /metrics -> /metrics/`); one anywhere else is an error: the
    agent reads the server it was configured for and nothing else. No proxy from the environment
    is used: the server is local to the node.
    """
    try:
        answer = http_read.get(url, timeout_seconds, max_bytes, accept=_ACCEPT, same_origin_redirects=MAX_REDIRECTS)
    except http_read.HttpReadError as exc:
        raise ScrapeError(exc.detail) from None
    if not 200 <= answer.status < 300:
        raise ScrapeError(f"HTTP {answer.status}")
    return answer.body.decode("utf-8", "replace")


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


#: Besides "\n", what ends a line for str.splitlines, or parts words for str.split, in ASCII text.
_ODD_SEPARATORS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f")
_SUFFIXES = "(?:_bucket|_count|_sum|_total|_created)?"


@functools.lru_cache(maxsize=8)
def _selection(wanted: frozenset[str]) -> re.Pattern[str]:
    """The lines `_select_lines` keeps, each after the "\n" that ends the line before: a HELP or
    TYPE line naming a wanted family, or a sample of one (its name then `{`, a blank or the end of
    the line). The leading "\n" lets the search jump from line to line in C."""
    names = "|".join(re.escape(name) for name in sorted(wanted, key=len, reverse=True))
    return re.compile(
        rf"\n((?:# (?:HELP|TYPE) (?:{names}){_SUFFIXES}(?=[ \t\n])|(?:{names}){_SUFFIXES}(?=[{{ \t\n]))[^\n]*)"
    )


def _select_lines(text: str, wanted: frozenset[str]) -> str:
    """The lines of the wanted families only: the parser's cost is per line, and a real page is
    mostly families we do not read (per-stage latencies, process metrics). ScrapeError when they
    are more lines than any real server writes."""
    if text.isascii() and not any(odd in text for odd in _ODD_SEPARATORS):
        # Lines end at "\n" only and words at a blank or tab: the pattern keeps what the loop of
        # `_select_lines_one_by_one` keeps (tests/services/test_service_corpus.py compares them).
        kept = _selection(wanted).findall("\n" + text + "\n")
        if len(kept) > MAX_SELECTED_LINES:
            raise ScrapeError(f"{UNREADABLE}: more than {MAX_SELECTED_LINES} lines of the families read")
        return "\n".join(kept) + "\n"
    return _select_lines_one_by_one(text, wanted)


def _select_lines_one_by_one(text: str, wanted: frozenset[str]) -> str:
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


#: A series' key and its rank among the copies of one batch (the replica labels' values).
Series = tuple[SeriesKey, tuple[str, ...]]
#: A sample's name, labels and value, and its series where the reader has worked it out already.
Sample = tuple[str, Mapping[str, str], float, Series | None]


def _rank_order(rank: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    # ASCII digits only, and few: int() refuses `²` (a digit to isdigit) and numbers of 4300 digits.
    return tuple(
        (int(value), "") if value.isascii() and value.isdigit() and len(value) < 19 else (1 << 62, value)
        for value in rank
    )


_REPLICA_ORDER = tuple(sorted(REPLICA_LABELS))


def _series_of(labels: Mapping[str, str]) -> Series:
    """The labels' series key (sorted, without `le` and the replica labels) and replica rank."""
    # dict copy and pop run in C: this is per label set, hundreds per page
    rest = dict(labels)
    rest.pop("le", None)
    rank = tuple([rest.pop(label) for label in _REPLICA_ORDER if label in rest])
    return tuple(sorted(rest.items())), rank


def _one_copy_per_batch(samples: Sequence[Sample]) -> list[tuple[str, SeriesKey, Mapping[str, str], float]]:
    """Each sample with its series key; of the copies a replica label tells apart (the same
    batch on every TP rank), only the lowest rank's samples are kept."""
    keyed: list[tuple[str, SeriesKey, tuple[str, ...], Mapping[str, str], float]] = []
    lowest: dict[SeriesKey, tuple[str, ...]] = {}
    for name, labels, value, series in samples:
        key, rank = _series_of(labels) if series is None else series
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
    bucket, count, sum_ = family + "_bucket", family + "_count", family + "_sum"
    for name, key, labels, value in _one_copy_per_batch(samples):
        if name == bucket and "le" in labels:
            try:
                bound = float(labels["le"])
            except ValueError:
                raise ScrapeError(f"{UNREADABLE}: {family} has a bucket le={labels['le'][:40]!r}") from None
            if math.isnan(bound):
                raise ScrapeError(f"{UNREADABLE}: {family} has a bucket le=NaN")
            buckets.setdefault(key, {})[bound] = value
        elif name == count:
            counts[key] = value
        elif name == sum_:
            sums[key] = value
        _at_most_series(family, len(buckets))
    for by_bound in buckets.values():
        bounds = tuple(sorted(by_bound))
        problem = _unreadable_series(family, bounds, [by_bound[b] for b in bounds])
        if problem:
            raise ScrapeError(f"{UNREADABLE}: {problem}")
    if not all(math.isfinite(v) and v >= 0 for v in (*counts.values(), *sums.values())):
        raise ScrapeError(f"{UNREADABLE}: {family} has a count or sum that is not a finite number")
    found: dict[SeriesKey, Histogram] = {}
    for key, by_bound in buckets.items():
        bounds = tuple(sorted(by_bound))
        if not bounds or not math.isinf(bounds[-1]):
            continue  # no +Inf bucket: not a histogram quantiles can be drawn from
        found[key] = Histogram(
            bounds,
            tuple(by_bound[b] for b in bounds),
            counts.get(key, by_bound[math.inf]),
            sums.get(key, 0.0),
        )
    return found


#: A sample line as servers write it, after the "\n" that ends the line before: its name, labels and
#: value (a timestamp is allowed and ignored). The selected lines all begin after a "\n" with that
#: prefixed, so every match is one whole line and a line that does not match is not matched at all.
_SAMPLE_LINES = re.compile(r"\n([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}\n]*)\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*(?=\n)")
_PLAIN_LABELS = re.compile(
    r'(?:[ \t]*[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"[^"\\]*"[ \t]*,)*'
    r'(?:[ \t]*[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"[^"\\]*"[ \t]*)?'
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*)"')


class _NotPlain(Exception):
    """A line the plain reader does not take (escapes, odd spacing): prometheus-client reads the page."""


def _plain_samples(selected: str) -> dict[str, list[Sample]]:
    """The selected lines' samples by family, for the text format as servers write it (no escapes
    in label values): one regular expression over the lines instead of prometheus-client's
    character-by-character reader, which costs ~30 µs a line with sglang's six labels (a DP=8
    page's queue-time histograms alone are ~300 lines). _NotPlain for anything else."""
    lines = "\n" + selected
    samples = _SAMPLE_LINES.findall(lines)
    # Every line that is not a comment must have matched. Blank lines are counted one for each run
    # of them (the selection keeps none): too few, which makes a page read by prometheus-client.
    if len(samples) != lines.count("\n") - 1 - lines.count("\n#") - lines.count("\n\n"):
        raise _NotPlain("a sample line not as servers write it")
    by_family: dict[str, list[Sample]] = {}
    for name, labels, value in samples:
        try:
            number = float(value)
        except ValueError:
            raise _NotPlain(value[:80]) from None
        mapping, series = _plain_labels(labels)
        by_family.setdefault(_family_of(name), []).append((name, mapping, number, series))
    return by_family


#: The family a sample name belongs to; the names of the selected lines are a few dozen at most.
_family_of = functools.lru_cache(maxsize=256)(_base_name)

#: Label sets cached, and the longest one cached: a bound of ~2 MB however hostile the pages (a
#: real sglang page at DP=8 has ~500 label sets of ~120 characters).
_CACHED_LABEL_SETS = 4096
_CACHED_LABELS_MAX_CHARS = 512


def _plain_labels(text: str) -> tuple[Mapping[str, str], Series]:
    """`a="1",b="2"` -> a read-only mapping and its series. A server writes the same label sets
    every scrape, so each short one is read once."""
    return _cached_labels(text) if len(text) <= _CACHED_LABELS_MAX_CHARS else _read_labels(text)


def _read_labels(text: str) -> tuple[Mapping[str, str], Series]:
    if text and _PLAIN_LABELS.fullmatch(text) is None:
        raise _NotPlain(text[:80])
    labels = dict(_LABEL.findall(text))
    return MappingProxyType(labels), _series_of(labels)


_cached_labels = functools.lru_cache(maxsize=_CACHED_LABEL_SETS)(_read_labels)


def _parse_families(selected: str, openmetrics: bool) -> dict[str, list[Sample]]:
    """Samples by family name (prometheus-client's naming: a counter without `_total`)."""
    # prometheus-client's parsers (and the whole client they import: a tenth of `status --direct`)
    # load only for a page the plain reader cannot take.
    if not openmetrics:
        try:
            return _plain_samples(selected)
        except _NotPlain:
            from prometheus_client.parser import text_string_to_metric_families

            families: list[Metric] = list(text_string_to_metric_families(selected))
    else:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

        # Its parser wants the terminator, which the line selection dropped.
        families = list(openmetrics_families(selected + "# EOF\n"))  # type: ignore[no-untyped-call]
    return {f.name: [(s.name, s.labels, float(s.value), None) for s in f.samples] for f in families}


def parse_reading(
    text: str,
    kind: str | None = None,
    timestamp_seconds: float | None = None,
    figures: Collection[str] | None = None,
) -> ServerReading:
    """A page of Prometheus text or OpenMetrics -> a ServerReading (kind detected when None), of
    `figures` only when given (Families' field names: the drain reads `running` alone). ScrapeError
    when the text is neither or cannot be believed, whatever went wrong in reading it."""
    now = time.time() if timestamp_seconds is None else timestamp_seconds
    try:
        return _reading(text, kind, now, figures)
    except ScrapeError:
        raise
    except Exception as exc:  # the parsers' every complaint about untrusted text, whatever its type
        raise ScrapeError(f"not Prometheus text: {http_read.quoted(str(exc), 200)}") from None


def _at_most_series(family: str, series: int) -> None:
    if series > MAX_SERIES_PER_FAMILY:
        raise ScrapeError(f"{UNREADABLE}: {family} has more than {MAX_SERIES_PER_FAMILY} label sets")


def _reading(text: str, kind: str | None, now: float, figures: Collection[str] | None) -> ServerReading:
    if kind is None:
        kind = detect_kind(_metric_name(line) for line in text.splitlines() if line and not line.startswith("#"))
    families = FAMILIES.get(kind)
    if families is None:
        return ServerReading(now, kind)
    if figures is not None:
        families = families.only(figures)
    parsed = _parse_families(_select_lines(text, families.names()), is_openmetrics(text))
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
        values = {
            # A gauge or counter that is not a finite number says nothing: the figure is absent.
            key: v
            for n, key, _, v in _one_copy_per_batch(samples)
            if n in (name, name + suffix) and math.isfinite(v)
        }
        _at_most_series(name, len(values))
        return values

    def summed(figure: str, candidates: tuple[str, ...]) -> float | None:
        values = per_series(figure, candidates)
        return sum(values.values()) if values else None

    def fullest(figure: str, candidates: tuple[str, ...]) -> float | None:
        # Every copy counts here: the fullest pool is the one that turns requests away.
        name, samples = samples_of(figure, candidates)
        values = [v for n, _, v, _ in samples if n == name and math.isfinite(v)]
        _at_most_series(name, len(values))
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
    figures: Collection[str] | None = None,
) -> ServerReading:
    """Fetch and parse one server's `/metrics` (of `figures` only, when given); ScrapeError when it cannot."""
    text = fetch_text(url, timeout_seconds, max_bytes)
    return parse_reading(text, kind, figures=figures)
