"""Reading an inference server's own /metrics: parsing both servers' families (current and renamed
ones), quantiles from histogram deltas against hand-computed values, counter resets, and scrapes
of real server processes: the stand-in of each flavour, one that hangs, one that drips, one that
returns 50 MB."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

from agent.demo.standin_process import StandinServer, free_port, wait_listening
from agent.services import window as window_module
from agent.services.scrape import (
    MAX_HISTOGRAM_BUCKETS,
    MAX_SERIES_PER_FAMILY,
    Histogram,
    ScrapeError,
    ServerReading,
    detect_kind,
    fetch_text,
    parse_reading,
    scrape,
)
from agent.services.window import MAX_WINDOW_POINTS, LatencyWindow, histogram_quantile

INF = math.inf
#: Recorded /metrics pages of the two servers (Prometheus text, kept as data files).
PAGES = Path(__file__).parents[1] / "fixtures" / "service-metrics"


# -- quantiles, by hand ----------------------------------------------------------------------------


def test_histogram_quantile_interpolates_inside_the_bucket_as_promql_does() -> None:
    bounds = (0.1, 0.5, 1.0, INF)
    cumulative = (10, 60, 90, 100)
    # rank 5 of 100 lies in the first bucket, which starts at 0: 0.1 * 5/10
    assert histogram_quantile(0.05, bounds, cumulative) == pytest.approx(0.05)
    # rank 50: bucket (0.1, 0.5] holds ranks 10..60: 0.1 + 0.4 * 40/50
    assert histogram_quantile(0.5, bounds, cumulative) == pytest.approx(0.42)
    # rank 90 is the last of bucket (0.5, 1]: its upper bound
    assert histogram_quantile(0.9, bounds, cumulative) == pytest.approx(1.0)
    # rank 95 falls into +Inf: the largest finite bound, as histogram_quantile answers
    assert histogram_quantile(0.95, bounds, cumulative) == pytest.approx(1.0)


def test_histogram_quantile_without_observations_or_inf_bucket_is_none() -> None:
    assert histogram_quantile(0.5, (0.1, INF), (0, 0)) is None
    assert histogram_quantile(0.5, (0.1, 1.0), (5, 10)) is None


def reading(t: float, counts: tuple[float, ...], *, tokens: float | None = None, waiting: float = 0.0) -> ServerReading:
    bounds = (0.5, 1.0, 2.0, INF)
    histogram = Histogram(bounds, counts, counts[-1], sum(counts) * 0.5)
    generated = {} if tokens is None else {(): tokens}
    return ServerReading(t, "sglang", {"e2e": {(): histogram}}, running=4, waiting=waiting, generation_tokens=generated)


def test_quantiles_come_from_the_delta_over_the_window_not_the_cumulative_counts() -> None:
    window = LatencyWindow("sglang", window_seconds=300)
    window.add(reading(0, (100, 150, 190, 200), tokens=1000))
    window.add(reading(60, (100, 160, 270, 300), tokens=4000))
    figures = window.figures()
    assert figures is not None
    e2e = figures.latency["e2e"]
    # delta buckets: (0, 10, 80, 100). rank 50: bucket (1, 2] holds ranks 10..80: 1 + 1 * 40/70
    assert e2e.requests == 100
    assert e2e.quantiles[0.5] == pytest.approx(1 + 40 / 70)
    # rank 95 falls into the +Inf delta bucket: 2.0
    assert e2e.quantiles[0.95] == pytest.approx(2.0)
    # the cumulative counts would have said 0.5 + 0.5 * 50/60 for the median
    assert e2e.quantiles[0.5] != pytest.approx(0.5 + 0.5 * 50 / 60)
    assert figures.generation_tokens_per_second == pytest.approx(3000 / 60)
    assert figures.window_seconds == pytest.approx(60)


def test_the_window_checks_each_histogram_once_for_all_its_quantiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The buckets were checked once for the histogram and once more for each of its three
    quantiles, every scrape: checked once now, for the same figures."""
    window = LatencyWindow("sglang", window_seconds=300)
    window.add(reading(0, (100, 150, 190, 200)))
    window.add(reading(60, (100, 160, 270, 300)))
    expected = window.figures()
    checked: list[tuple[float, ...]] = []
    readable = window_module.readable_buckets

    def counted(bounds: tuple[float, ...], counts: tuple[float, ...]) -> bool:
        checked.append(tuple(counts))
        return readable(bounds, counts)

    monkeypatch.setattr(window_module, "readable_buckets", counted)
    assert window.figures() == expected
    assert checked == [(0, 10, 80, 100)]


def test_points_older_than_the_window_drop_out() -> None:
    window = LatencyWindow("sglang", window_seconds=300)
    window.add(reading(0, (0, 0, 0, 1000)))  # a slow start, then fast requests only
    window.add(reading(200, (0, 0, 0, 1000)))
    window.add(reading(400, (100, 100, 100, 1100)))
    figures = window.figures()
    assert figures is not None
    # baseline is the point at t=200: all 100 new requests were under 0.5 s: median 0.25
    assert figures.latency["e2e"].quantiles[0.5] == pytest.approx(0.25)
    assert figures.window_seconds == pytest.approx(200)


def test_a_counter_reset_counts_the_new_values_as_increase() -> None:
    window = LatencyWindow("sglang", window_seconds=300)
    window.add(reading(0, (0, 0, 0, 0), tokens=1000))
    window.add(reading(60, (0, 10, 10, 10), tokens=4000))  # 10 requests in (0.5, 1]
    window.add(reading(120, (5, 5, 5, 5), tokens=500))  # restarted: 5 requests under 0.5 s since
    figures = window.figures()
    assert figures is not None
    e2e = figures.latency["e2e"]
    assert e2e.requests == 15
    # delta buckets (5, 15, 15, 15): median rank 7.5 lies in (0.5, 1], 2.5 into its 10
    assert e2e.quantiles[0.5] == pytest.approx(0.5 + 0.5 * 2.5 / 10)
    assert e2e.quantiles[0.95] == pytest.approx(0.5 + 0.5 * 9.25 / 10)
    assert figures.generation_tokens_per_second == pytest.approx((3000 + 500) / 120)
    assert figures.resets == 1


def test_one_scrape_gives_gauges_but_no_latency_yet() -> None:
    window = LatencyWindow("sglang")
    window.add(reading(0, (1, 2, 3, 4), waiting=3))
    figures = window.figures()
    assert figures is not None
    assert figures.latency == {}
    assert (figures.running, figures.waiting) == (4, 3)
    window.add_error("timed out after 2 s")
    after_error = window.figures()
    assert after_error is not None
    assert after_error.error == "timed out after 2 s"
    assert after_error.running == 4


# -- parsing the servers' pages ------------------------------------------------------------------------

SGLANG_TWO_RANKS = (PAGES / "sglang-two-ranks.txt").read_text()


def test_sglang_tp_ranks_are_copies_counted_once_but_the_fullest_cache_counts() -> None:
    parsed = parse_reading(SGLANG_TWO_RANKS, timestamp_seconds=5.0)
    assert parsed.kind == "sglang"
    # tp_rank 0 and 1 export the batch they run together: the lowest rank stands for it
    assert (parsed.running, parsed.waiting) == (3, 1)
    assert parsed.kv_cache_usage_ratio == 0.75
    assert parsed.generation_tokens_total == 800
    e2e = parsed.histogram("e2e")
    assert e2e is not None
    assert e2e.bounds == (1.0, INF)
    assert e2e.bucket_counts == (2, 3)
    assert (e2e.count, e2e.sum) == (3, 4.0)


@pytest.mark.parametrize("rank", ["²", "9" * 5000, "-1", "a"])
def test_a_tp_rank_that_is_no_small_number_ranks_after_the_numbered_ones(rank: str) -> None:
    """`²` is a digit to str.isdigit and not to int(), and int() refuses 4300 digits: either raised
    ValueError out of parse_reading (and so out of a drain's read of the server)."""
    text = f'sglang:num_running_reqs{{tp_rank="{rank}"}} 9\nsglang:num_running_reqs{{tp_rank="1"}} 3\n'
    assert parse_reading(text, "sglang").running == 3


VLLM_CURRENT_AND_DEPRECATED = (PAGES / "vllm-current-and-deprecated.txt").read_text()


def test_vllm_prefers_the_current_names_when_both_are_exported() -> None:
    parsed = parse_reading(VLLM_CURRENT_AND_DEPRECATED)
    assert parsed.kind == "vllm"
    assert (parsed.running, parsed.waiting) == (6, 2)
    assert parsed.kv_cache_usage_ratio == 0.4
    assert parsed.families["kv_cache_usage"] == "vllm:kv_cache_usage_perc"
    assert parsed.families["itl"] == "vllm:inter_token_latency_seconds"
    itl = parsed.histogram("itl")
    assert itl is not None and itl.count == 9
    # exposed without a TYPE line: the parser keeps the `_total` name, found all the same
    assert parsed.generation_tokens_total == 64


def test_vllm_older_names_are_read_when_the_current_ones_are_absent() -> None:
    older = "\n".join(
        line
        for line in VLLM_CURRENT_AND_DEPRECATED.splitlines()
        if "kv_cache_usage_perc" not in line and "inter_token_latency" not in line
    )
    parsed = parse_reading(older + "\n")
    assert parsed.kv_cache_usage_ratio == 0.1
    assert parsed.families["itl"] == "vllm:time_per_output_token_seconds"
    itl = parsed.histogram("itl")
    assert itl is not None and itl.count == 1


def test_kind_is_detected_from_the_families() -> None:
    assert detect_kind(["process_cpu_seconds_total", "sglang:num_running_reqs"]) == "sglang"
    assert detect_kind(["vllm:num_requests_running"]) == "vllm"
    assert detect_kind(["http_requests_total"]) == "generic"
    generic = parse_reading("# TYPE up gauge\nup 1\n")
    assert generic.kind == "generic"
    assert generic.histograms == {}
    assert generic.running is None


def test_a_configured_kind_wins_over_detection() -> None:
    parsed = parse_reading(SGLANG_TWO_RANKS, kind="vllm")
    assert parsed.kind == "vllm"
    assert parsed.running is None


def test_a_page_that_is_not_prometheus_text_is_a_scrape_error() -> None:
    with pytest.raises(ScrapeError, match="not Prometheus text"):
        parse_reading('sglang:num_running_reqs{model_name="m"} many\n')


# -- real servers --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flavor", "extra", "itl_family"),
    [
        ("sglang", (), "sglang:inter_token_latency_seconds"),
        ("vllm", (), "vllm:inter_token_latency_seconds"),
        ("vllm", ("--metric-names", "legacy"), "vllm:time_per_output_token_seconds"),
    ],
)
def test_scraping_the_standin_of_each_flavour(
    tmp_path: Path, flavor: str, extra: tuple[str, ...], itl_family: str
) -> None:
    with StandinServer(tmp_path, extra_args=("--flavor", flavor, *extra)) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        window = LatencyWindow("svc")
        window.add(scrape(url, timeout_seconds=2.0))
        time.sleep(1.5)
        last = scrape(url, timeout_seconds=2.0)
        window.add(last)
    assert last.kind == flavor
    assert last.families["itl"] == itl_family
    figures = window.figures()
    assert figures is not None
    assert set(figures.latency) >= {"e2e", "ttft", "itl"}
    assert figures.latency["e2e"].requests > 0
    # healthy stand-in requests take 0.5-0.7 s end to end
    p50 = figures.quantile("e2e", 0.5)
    assert p50 is not None
    assert 0.3 < p50 < 1.0
    assert figures.running is not None
    assert figures.running > 0
    assert figures.waiting == 0
    assert figures.kv_cache_usage_ratio is not None
    assert 0 < figures.kv_cache_usage_ratio < 1
    assert figures.generation_tokens_per_second is not None
    assert figures.generation_tokens_per_second > 0


def test_a_hanging_server_is_cut_off_at_the_deadline(tmp_path: Path) -> None:
    with StandinServer(tmp_path) as server:
        server.set_mode("hang")
        started = time.monotonic()
        with pytest.raises(ScrapeError, match=r"timed out after 0\.5 s"):
            scrape(f"http://127.0.0.1:{server.port}/metrics", timeout_seconds=0.5)
        assert time.monotonic() - started < 1.5


SERVER = textwrap.dedent(
    """
    import sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    MODE = sys.argv[2]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            if MODE == "big-declared":
                self.send_header("Content-Length", str(50 * 1024 * 1024))
            self.end_headers()
            line = b"# filler line of a page far larger than any real /metrics page\\n"
            try:
                if MODE == "drip":
                    while True:
                        self.wfile.write(b"#\\n")
                        self.wfile.flush()
                        time.sleep(0.1)
                for _ in range(50 * 1024 * 1024 // len(line)):
                    self.wfile.write(line)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


@pytest.fixture
def odd_server(tmp_path: Path):  # type: ignore[no-untyped-def]
    script = tmp_path / "odd_server.py"
    script.write_text(SERVER)
    started: list[subprocess.Popen[bytes]] = []

    def start(mode: str) -> str:
        port = free_port()
        started.append(subprocess.Popen([sys.executable, str(script), str(port), mode]))
        assert wait_listening(port)
        return f"http://127.0.0.1:{port}/metrics"

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("mode", ["big-streamed", "big-declared"])
def test_a_50_mb_page_is_refused_without_reading_it_whole(odd_server, mode: str) -> None:  # type: ignore[no-untyped-def]
    url = odd_server(mode)
    started = time.monotonic()
    with pytest.raises(ScrapeError, match="byte limit"):
        fetch_text(url, timeout_seconds=5.0, max_bytes=8 * 1024 * 1024)
    assert time.monotonic() - started < 3.0


def test_a_server_that_drips_is_cut_off_at_the_total_deadline(odd_server) -> None:  # type: ignore[no-untyped-def]
    url = odd_server("drip")
    started = time.monotonic()
    with pytest.raises(ScrapeError, match="timed out after 1 s"):
        fetch_text(url, timeout_seconds=1.0)
    assert time.monotonic() - started < 1.6


def test_http_errors_and_refused_connections_are_reported(tmp_path: Path) -> None:
    with StandinServer(tmp_path) as server, pytest.raises(ScrapeError, match="HTTP 404"):
        scrape(f"http://127.0.0.1:{server.port}/nothing-here")
    with pytest.raises(ScrapeError, match="refused"):
        scrape(f"http://127.0.0.1:{free_port()}/metrics")


# -- pages that cannot be believed -----------------------------------------------------------------

E2E = "sglang:e2e_request_latency_seconds"


def page(buckets: dict[str, str], count: str = "10", total: str = "5", extra: str = "") -> str:
    lines = [f"# TYPE {E2E} histogram"]
    lines += [f'{E2E}_bucket{{le="{le}"}} {value}' for le, value in buckets.items()]
    lines += [f"{E2E}_count {count}", f"{E2E}_sum {total}", extra]
    return "\n".join(lines) + "\n"


GOOD = {"0.5": "4", "1.0": "8", "+Inf": "10"}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (page({"0.5": "NaN", "1.0": "8", "+Inf": "10"}), "not a finite count"),
        (page({"0.5": "4", "1.0": "+Inf", "+Inf": "+Inf"}), "not a finite count"),
        (page({"0.5": "-1", "1.0": "8", "+Inf": "10"}), "not a finite count"),
        (page(GOOD, count="NaN"), "count or sum that is not a finite number"),
        (page(GOOD, total="+Inf"), "count or sum that is not a finite number"),
        (page({"0.5": "9", "1.0": "8", "+Inf": "10"}), "buckets that are not cumulative"),
        (page({"abc": "4", "1.0": "8", "+Inf": "10"}), "bucket le='abc'"),
        (page({"NaN": "4", "1.0": "8", "+Inf": "10"}), "bucket le=NaN"),
    ],
)
def test_a_histogram_that_cannot_be_believed_is_an_unreadable_page(text: str, why: str) -> None:
    with pytest.raises(ScrapeError, match=r"^unreadable page: sglang:e2e_request_latency_seconds has .*") as caught:
        parse_reading(text, "sglang")
    assert why in str(caught.value)
    assert parse_reading(page(GOOD), "sglang").histograms["e2e"][()].bucket_counts == (4, 8, 10)


def test_gauges_that_are_not_finite_numbers_are_absent() -> None:
    text = page(GOOD, extra="sglang:num_running_reqs +Inf\nsglang:num_queue_reqs NaN\nsglang:token_usage -Inf")
    parsed = parse_reading(text, "sglang")
    assert (parsed.running, parsed.waiting, parsed.kv_cache_usage_ratio) == (None, None, None)


def test_histogram_quantile_over_data_it_cannot_believe_is_none_never_an_exception() -> None:
    bounds = (0.5, 1.0, INF)
    for counts in [(math.nan,) * 3, (1, math.nan, 3), (1, 2, math.inf), (5, 3, 6), (-1, 2, 3), (1, 2)]:
        assert histogram_quantile(0.95, bounds, counts) is None, counts
    assert histogram_quantile(0.5, (1.0, 0.5, INF), (1, 2, 3)) is None
    assert histogram_quantile(0.5, bounds, (2, 4, 4)) == pytest.approx(0.5)


def test_a_window_whose_deltas_overflow_says_unreadable_page_and_keeps_the_gauges() -> None:
    """Finite pages can still add up to infinity (a counter near the float limit that resets):
    the figure is left out and the error says why; figures() never raises."""
    window = LatencyWindow("sglang")
    window.add(reading(0, (1e308, 1e308, 1e308, 1e308)))
    window.add(reading(10, (1.7e308, 1.7e308, 1.7e308, 1.7e308)))
    window.add(reading(20, (1e308, 1e308, 1e308, 1e308)))  # a reset: the new values add on
    figures = window.figures()
    assert figures is not None
    assert figures.latency == {}
    assert figures.error == "unreadable page: e2e histogram over the window"
    assert figures.running == 4


def test_a_legal_page_of_120k_buckets_is_refused_before_the_parser_and_nothing_is_kept() -> None:
    bounds = [f"{0.001 * i:.3f}" for i in range(1, 120_000)] + ["+Inf"]
    text = page({le: str(i) for i, le in enumerate(bounds)}, count=str(len(bounds)))
    assert 3_000_000 < len(text) < 8 * 1024 * 1024  # legal: under the page's size limit
    started = time.monotonic()
    with pytest.raises(ScrapeError, match=r"^unreadable page: more than 20000 lines of the families read$"):
        parse_reading(text, "sglang")
    assert time.monotonic() - started < 2.0


def test_too_many_buckets_or_label_sets_are_unreadable_pages() -> None:
    many = {f"{i}": str(i) for i in range(1, MAX_HISTOGRAM_BUCKETS + 1)} | {"+Inf": "1000"}
    with pytest.raises(ScrapeError, match=f"has {MAX_HISTOGRAM_BUCKETS + 1} buckets, more than the"):
        parse_reading(page(many), "sglang")
    # engines, not TP ranks: a TP rank's copies of one batch are read once
    series = [f'{E2E}_bucket{{le="+Inf",engine="{i}"}} 1' for i in range(MAX_SERIES_PER_FAMILY + 1)]
    with pytest.raises(ScrapeError, match=f"more than {MAX_SERIES_PER_FAMILY} label sets"):
        parse_reading(f"# TYPE {E2E} histogram\n" + "\n".join(series) + "\n", "sglang")


def test_the_window_keeps_a_bounded_number_of_points_of_bounded_size() -> None:
    """The largest histogram a page may carry, scraped every 0.1 s (the fastest interval) for the
    whole window, three kinds of it: what one service keeps stays under 16 MB."""
    bounds = (*(float(i) for i in range(1, MAX_HISTOGRAM_BUCKETS)), INF)
    window = LatencyWindow("sglang", window_seconds=300)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for step in range(3000):
            counts = tuple(float(step * 1000 + i) for i in range(len(bounds)))
            histogram = Histogram(bounds, counts, counts[-1], 1.0)
            window.add(
                ServerReading(
                    step * 0.1, "sglang", {kind: {(): histogram} for kind in ("e2e", "ttft", "itl")}, waiting=1
                )
            )
        kept = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    figures = window.figures()
    assert figures is not None and figures.latency["e2e"].requests > 0
    assert figures.window_seconds == pytest.approx((MAX_WINDOW_POINTS - 1) * 0.1)
    assert kept < 16 * 1024 * 1024, kept
