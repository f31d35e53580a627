"""What one service's server can make the agent keep is bounded in every dimension: label sets per
family on a page (histograms, counters and gauges alike), series across the window, and the memory
the window's points take. A server whose generated-token counter took new label values on every
scrape grew the daemon from 74 to 960 MiB in 60 s at 1 s scrapes, and nothing was reported: the
window kept every series for its 300 s. Past a bound the page is the service's `unreadable page`
error and the last good figures stay."""

from __future__ import annotations

import math
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from slow_endpoint import SlowEndpoint

from agent.config.service_entry import ServiceConfig
from agent.services.drain import wait_until_idle
from agent.services.scrape import MAX_SERIES_PER_FAMILY, Histogram, ScrapeError, ServerReading, parse_reading
from agent.services.window import MAX_WINDOW_BYTES, MAX_WINDOW_SERIES, LatencyWindow
from agent.state import ServiceFigures

INF = math.inf
E2E = "sglang:e2e_request_latency_seconds"
BOUNDS = (0.5, 1.0, INF)


def family_lines(name: str, series: int, kind: str) -> list[str]:
    """`series` label sets of one family (engines: separate batches, each read)."""
    if kind == "histogram":
        return [f'{name}_bucket{{engine="{i}",le="{le}"}} 1' for i in range(series) for le in ("1", "+Inf")]
    return [f'{name}{{engine="{i}"}} 1' for i in range(series)]


FAMILIES = [
    (E2E, "histogram"),
    ("sglang:generation_tokens_total", "counter"),
    ("sglang:num_running_reqs", "gauge"),
    ("sglang:num_queue_reqs", "gauge"),
    ("sglang:token_usage", "gauge"),
    ("sglang:gen_throughput", "gauge"),
]


@pytest.mark.parametrize(("name", "kind"), FAMILIES)
def test_more_label_sets_than_a_family_may_have_are_an_unreadable_page(name: str, kind: str) -> None:
    """Only histograms had the cap: a counter or a gauge with a label set per request was read whole."""
    assert parse_reading("\n".join(family_lines(name, MAX_SERIES_PER_FAMILY, kind)) + "\n", "sglang")
    text = "\n".join(family_lines(name, MAX_SERIES_PER_FAMILY + 1, kind)) + "\n"
    with pytest.raises(ScrapeError, match=f"^unreadable page: .* has more than {MAX_SERIES_PER_FAMILY} label sets$"):
        parse_reading(text, "sglang")


def test_the_drain_reads_its_gauge_alone_so_other_families_past_their_bounds_do_not_stop_it(tmp_path: Path) -> None:
    page = tmp_path / "page"
    lines = family_lines("sglang:generation_tokens_total", MAX_SERIES_PER_FAMILY + 1, "counter")
    page.write_text("sglang:num_running_reqs 0\n" + "\n".join(lines) + "\n")
    with pytest.raises(ScrapeError, match="label sets"):
        parse_reading(page.read_text(), "sglang")
    assert parse_reading(page.read_text(), "sglang", figures=("running",)).running == 0
    with SlowEndpoint("file", "--body", str(page)) as server:
        service = ServiceConfig.model_validate({"name": "llm", "health_url": server.url("/health"), "kind": "sglang"})
        waited = wait_until_idle(
            service, 5.0, monotonic=time.monotonic, sleep=time.sleep, cancel=threading.Event(), poll_seconds=0.1
        )
    assert waited.outcome == "idle", waited


def histogram(step: int) -> Histogram:
    counts = (float(step), float(2 * step), float(2 * step))
    return Histogram(BOUNDS, counts, counts[-1], float(step))


def reading(step: int, churned: int = 0) -> ServerReading:
    """One scrape every 5 s: two engines as a real server has them, plus `churned` series of each
    counter family with label values never seen before (a request id in a label)."""
    labels = [(("engine", "0"),), (("engine", "1"),)] + [(("request", f"{step}-{i}"),) for i in range(churned)]
    return ServerReading(
        step * 5.0,
        "sglang",
        {"e2e": {key: histogram(step) for key in labels}},
        running=3,
        generation_tokens={key: 100.0 * step for key in labels},
    )


def without_error(figures: ServiceFigures | None) -> ServiceFigures:
    assert figures is not None
    return ServiceFigures(**{**figures.__dict__, "error": ""})


def test_label_churn_past_the_series_cap_is_an_unreadable_page_and_the_last_figures_stay() -> None:
    window = LatencyWindow("llm")
    for step in range(10):
        window.add(reading(step))
    good = window.figures()
    assert good is not None and good.error == "" and good.latency["e2e"].requests == 2 * 18
    churned = MAX_WINDOW_SERIES // 4 - 2  # a histogram and a counter series each: two scrapes fit, not three
    window.add(reading(10, churned))
    window.add(reading(11, churned))
    kept = without_error(window.figures())
    window.add(reading(12, churned))
    refused = window.figures()
    assert refused is not None
    assert refused.error == (
        f"unreadable page: {4 + 6 * churned} series over the window, more than the {MAX_WINDOW_SERIES} kept"
        " (labels that take new values on every scrape?)"
    )
    assert without_error(refused) == kept  # nothing of the refused page was kept
    # Once the churned series have left the window (300 s), a page like the first ones is read again.
    window.add(reading(80))
    assert window.figures() is not None and window.figures().error == ""  # type: ignore[union-attr]
    assert sum(1 for key in window._tokens if key[0][0] == "request") == 0


def churned_reading(step: int, series: int, buckets: int) -> ServerReading:
    """Every histogram kind and the token counter, each with `series` label values never seen before."""
    bounds = (*(float(i) for i in range(1, buckets)), INF)
    counts = tuple(float(step + i) for i in range(buckets))
    labels = [(("request", f"{step}-{i}"),) for i in range(series)]
    by_kind = {kind: {key: Histogram(bounds, counts, counts[-1], 1.0) for key in labels} for kind in ("e2e", "ttft")}
    return ServerReading(step * 1.0, "sglang", by_kind, generation_tokens=dict.fromkeys(labels, float(step)))


@pytest.mark.parametrize(
    ("series", "buckets", "scrapes"),
    [
        (MAX_WINDOW_SERIES // 8, 128, 60),  # wide histograms: the memory bound trims before the series cap
        (MAX_SERIES_PER_FAMILY, 4, 60),  # as many series as a page may carry: the series cap refuses
        (20, 128, 400),  # a few new series a scrape, for longer than the window
    ],
)
def test_what_a_churning_server_makes_a_window_keep_stays_under_its_bound(
    series: int, buckets: int, scrapes: int
) -> None:
    window = LatencyWindow("llm", window_seconds=300)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for step in range(scrapes):
            window.add(churned_reading(step, series, buckets))
            assert window.bytes <= MAX_WINDOW_BYTES
            assert sum(len(group) for group in window._groups()) <= MAX_WINDOW_SERIES
        figures = window.figures()
        kept = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    # What the window holds is what it counts (more, where series share their bucket bounds as
    # here), give or take the allocator's rounding, with the last reading on top.
    assert kept < window.bytes * 1.15 + 2 * 1024 * 1024, (kept, window.bytes)
    assert kept < MAX_WINDOW_BYTES * 1.15 + 2 * 1024 * 1024, kept
    assert figures is not None and figures.window_seconds < 300


def test_past_the_memory_bound_the_oldest_readings_go_and_the_figures_say_the_shorter_span() -> None:
    """Wide histograms of many engines, scraped every second: the whole window would not fit."""
    bounds = (*(float(i) for i in range(1, 128)), INF)
    labels = [(("engine", str(i)),) for i in range(24)]
    window = LatencyWindow("llm", window_seconds=300)
    for step in range(300):
        counts = tuple(float(step * 10 + i) for i in range(len(bounds)))
        by_kind = {kind: dict.fromkeys(labels, Histogram(bounds, counts, counts[-1], 1.0)) for kind in ("e2e", "itl")}
        window.add(ServerReading(float(step), "sglang", by_kind))
    figures = window.figures()
    assert figures is not None and figures.error == ""
    assert window.bytes <= MAX_WINDOW_BYTES
    assert 10 < figures.window_seconds < 299
    assert figures.latency["e2e"].requests == pytest.approx(figures.window_seconds * 10 * len(labels))
