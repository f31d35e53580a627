"""A server's pages kept as counters Prometheus can add up (agent.services.counters): the counter
histogram against hand-computed totals through resets, TP copies and new buckets, and the energy
of a service's GPUs."""

from __future__ import annotations

import math
import textwrap
from dataclasses import replace

import pytest
from snapshots import h200_sample

from agent.services.counters import FORGET_AFTER_SECONDS, MAX_COUNTER_SERIES, CounterBook, ServiceEnergy
from agent.services.scrape import Histogram, ServerReading, parse_reading

INF = math.inf
BOUNDS = (0.5, 1.0, INF)


def reading(
    t: float, *series: tuple[tuple[tuple[str, str], ...], tuple[float, ...]], tokens: float = 0.0
) -> ServerReading:
    """A page with e2e histograms per series (counts per bound, cumulative; sum = count / 2)."""
    histograms = {key: Histogram(BOUNDS, counts, counts[-1], counts[-1] / 2) for key, counts in series}
    return ServerReading(t, "sglang", histograms={"e2e": histograms}, generation_tokens={(): tokens})


ENGINE_0 = (("engine", "0"),)
ENGINE_1 = (("engine", "1"),)


def test_one_series_is_the_servers_own_counters() -> None:
    """A server of one series and the agent's histogram hold the same numbers: a fleet's PromQL over
    either gives the same rates."""
    book = CounterBook()
    book.add(reading(10.0, (ENGINE_0, (4, 9, 10)), tokens=400))
    book.add(reading(15.0, (ENGINE_0, (10, 20, 22)), tokens=900))
    found = book.counters()
    e2e = found.histograms["e2e"]
    assert (e2e.bounds, e2e.bucket_counts, e2e.count, e2e.sum) == (BOUNDS, (10, 20, 22), 22, 11)
    assert found.generated_tokens == 900


def test_engines_add_up_and_one_restarting_counts_from_zero() -> None:
    """Two engines (vLLM) add up; engine 1 restarting (its counters went down) adds all it holds
    since, as increase() reads a reset, and never makes the total go down."""
    book = CounterBook()
    book.add(reading(0.0, (ENGINE_0, (1, 2, 2)), (ENGINE_1, (3, 3, 4))))
    book.add(reading(5.0, (ENGINE_0, (2, 4, 5)), (ENGINE_1, (5, 6, 8))))
    assert book.counters().histograms["e2e"].bucket_counts == (7, 10, 13)
    book.add(reading(10.0, (ENGINE_0, (3, 5, 6)), (ENGINE_1, (1, 1, 2))))  # engine 1 restarted
    totals = book.counters().histograms["e2e"]
    assert totals.bucket_counts == (7 + 1 + 1, 10 + 1 + 1, 13 + 1 + 2)
    assert totals.count == 16


def test_sglang_tp_ranks_count_once_on_the_way_in() -> None:
    """The scraper keeps one copy of a batch all TP ranks export; the counters are of that copy."""
    page = textwrap.dedent(
        """\
        # TYPE sglang:e2e_request_latency_seconds histogram
        sglang:e2e_request_latency_seconds_bucket{le="0.5",model_name="m",tp_rank="0"} 3
        sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m",tp_rank="0"} 4
        sglang:e2e_request_latency_seconds_sum{model_name="m",tp_rank="0"} 1.5
        sglang:e2e_request_latency_seconds_count{model_name="m",tp_rank="0"} 4
        sglang:e2e_request_latency_seconds_bucket{le="0.5",model_name="m",tp_rank="1"} 3
        sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m",tp_rank="1"} 4
        sglang:e2e_request_latency_seconds_sum{model_name="m",tp_rank="1"} 1.5
        sglang:e2e_request_latency_seconds_count{model_name="m",tp_rank="1"} 4
        """
    )
    book = CounterBook()
    book.add(parse_reading(page, "sglang", 1.0))
    e2e = book.counters().histograms["e2e"]
    assert (e2e.bucket_counts, e2e.count, e2e.sum) == ((3, 4), 4, 1.5)


def test_new_bucket_boundaries_start_the_kind_over() -> None:
    """Series of other boundaries cannot be added bucket by bucket: left out while the kind's own
    remain, and the kind starts over on the new ones when none remains (a server upgraded)."""
    book = CounterBook()
    book.add(reading(0.0, (ENGINE_0, (1, 2, 3))))
    other = Histogram((0.1, INF), (5, 5), 5, 1.0)
    mixed = reading(5.0, (ENGINE_0, (2, 3, 4)))
    mixed.histograms["e2e"][ENGINE_1] = other
    book.add(mixed)
    assert book.counters().histograms["e2e"].bucket_counts == (2, 3, 4)
    upgraded = ServerReading(10.0, "sglang", histograms={"e2e": {ENGINE_0: Histogram((0.1, INF), (7, 8), 8, 2.0)}})
    book.add(upgraded)
    e2e = book.counters().histograms["e2e"]
    assert (e2e.bounds, e2e.bucket_counts, e2e.count) == ((0.1, INF), (7, 8), 8)


def test_what_a_service_keeps_is_bounded_by_its_pages() -> None:
    """A series gone for FORGET_AFTER_SECONDS (an engine removed) is forgotten; its counts stay in the total."""
    book = CounterBook()
    book.add(reading(0.0, (ENGINE_0, (1, 1, 1)), (ENGINE_1, (2, 2, 2))))
    book.add(reading(FORGET_AFTER_SECONDS + 1.0, (ENGINE_0, (1, 1, 1))))
    assert book.counters().histograms["e2e"].bucket_counts == (3, 3, 3)
    assert len(book._kinds["e2e"].last) == 1


def test_a_label_that_churns_is_not_counted_past_the_bound() -> None:
    """A server that puts a new label value on every page (a request id) makes a new series each
    scrape: the counters follow at most MAX_COUNTER_SERIES of them, then count no such page, and
    keep the totals they had."""
    book = CounterBook()
    accepted = 0
    for page in range(MAX_COUNTER_SERIES // 10 + 20):
        series = [((("request", f"{page}-{i}"),), (1.0, 1.0, 1.0)) for i in range(10)]
        accepted += book.add(reading(float(page), *series))
    assert accepted == MAX_COUNTER_SERIES // 10
    assert sum(len(kept.last) for kept in (*book._kinds.values(), book._tokens)) <= MAX_COUNTER_SERIES
    assert book.counters().histograms["e2e"].count == accepted * 10


def test_the_energy_of_a_services_gpus_is_a_counter() -> None:
    """Each GPU's energy counter differenced between readings, a GPU's counter that went down (a
    driver reload) counted from 0, the increases of the service's GPUs added up; a GPU that does not
    answer adds nothing."""
    energy = ServiceEnergy()
    gpus = {"sglang": [0, 1], "embed": [1]}

    def samples(j0: float, j1: float, up1: bool = True) -> list[object]:
        return [h200_sample(0, energy_joules=j0), replace(h200_sample(1, energy_joules=j1), up=up1)]

    energy.add(samples(1000.0, 500.0), gpus)  # the first readings: nothing used yet
    assert energy.joules("sglang") == 0.0
    energy.add(samples(1600.0, 800.0), gpus)
    assert (energy.joules("sglang"), energy.joules("embed")) == (900.0, 300.0)
    energy.add(samples(1700.0, 50.0), gpus)  # GPU 1's driver reloaded: 50 J since
    assert (energy.joules("sglang"), energy.joules("embed")) == (1050.0, 350.0)
    energy.add(samples(1800.0, 80.0, up1=False), gpus)
    assert (energy.joules("sglang"), energy.joules("embed")) == (1150.0, 350.0)
    assert energy.joules("vllm") is None


@pytest.mark.parametrize("first", [0.0, 123.0])
def test_the_exported_totals_never_go_down(first: float) -> None:
    """Whatever the pages do (resets, engines coming and going), what /metrics exports only grows."""
    book = CounterBook()
    pages = [
        ((ENGINE_0, (1, 2, 3)),),
        ((ENGINE_0, (0, 1, 1)),),  # reset
        ((ENGINE_0, (2, 2, 2)), (ENGINE_1, (5, 5, 5))),
        ((ENGINE_1, (6, 6, 7)),),
        ((ENGINE_0, (1, 1, 1)), (ENGINE_1, (1, 1, 1))),  # both reset
    ]
    last = (0.0, 0.0, 0.0)
    for step, page in enumerate(pages):
        book.add(reading(first + step * 5.0, *page))
        now = book.counters().histograms["e2e"].bucket_counts
        assert all(a >= b for a, b in zip(now, last)), (step, now, last)
        last = now
