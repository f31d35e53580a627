"""The service page reader's plain-line path gives the very reading prometheus_client's parser gives,
takes the common pages without that parser, and leaves every other page to it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client import parser as prometheus_parser

from agent.demo.standin import Traffic
from agent.services import scrape
from agent.services.scrape import ScrapeError, parse_reading

FIXTURES = Path(__file__).parent / "fixtures" / "service-metrics"


def standin_page(flavor: str, legacy_names: bool = False, dp_ranks: int = 1) -> str:
    traffic = Traffic(flavor, request_rate=40.0, max_running=64, legacy_names=legacy_names, dp_ranks=dp_ranks)
    for _ in range(20):
        traffic.tick(0.5, 1.3)
    return traffic.render()


PAGES = {
    "sglang": standin_page("sglang"),
    "sglang-8-ranks": standin_page("sglang", dp_ranks=8),
    "vllm": standin_page("vllm"),
    "vllm-legacy": standin_page("vllm", legacy_names=True),
    **{path.stem: path.read_text() for path in sorted(FIXTURES.glob("*.txt"))},
}


def slow_reading(text: str, kind: str | None, monkeypatch: pytest.MonkeyPatch) -> scrape.ServerReading:
    """The reading with every page sent to prometheus_client's parser."""
    with monkeypatch.context() as patched:
        patched.setattr(scrape, "_SAMPLE_LINE", _NeverMatches())
        return parse_reading(text, kind, timestamp_seconds=1.0)


class _NeverMatches:
    def fullmatch(self, _line: str) -> None:
        return None


def same(a: scrape.ServerReading, b: scrape.ServerReading) -> bool:
    def normal(value: object) -> object:
        return "nan" if isinstance(value, float) and math.isnan(value) else value

    return {k: normal(v) for k, v in vars(a).items()} == {k: normal(v) for k, v in vars(b).items()}


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_page_reads_the_same_as_prometheus_client_reads_it(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    text = PAGES[name]
    fast = parse_reading(text, None, timestamp_seconds=1.0)
    assert fast.histograms, "the page has latency histograms"
    assert same(fast, slow_reading(text, None, monkeypatch))


@pytest.mark.parametrize("name", ["sglang", "sglang-8-ranks", "vllm", "vllm-legacy"])
def test_pages_as_servers_write_them_need_no_prometheus_client(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in writes its page as sglang and vLLM do (prometheus_client's exposition)."""
    calls: list[str] = []
    monkeypatch.setattr(prometheus_parser, "text_string_to_metric_families", lambda t: calls.append(t) or iter(()))
    assert parse_reading(PAGES[name], None, timestamp_seconds=1.0).histograms
    assert calls == []


ODD_LINES = [
    'sglang:num_running_reqs{model_name="a\\"b"} 3',  # an escaped quote in a label value
    "sglang:num_running_reqs  3",  # two spaces
    "sglang:num_running_reqs{} 3",
    'sglang:num_running_reqs{model_name="m",} 3',
    "sglang:num_running_reqs 3 1700000000000",
    "sglang:num_running_reqs +Inf",
    "sglang:num_running_reqs NaN",
    "sglang:num_running_reqs 1_000",  # float() reads it; Prometheus text does not have it
    'sglang:num_running_reqs{model_name="m"model="n"} 3',
    "sglang:num_running_reqs",
    "# TYPE sglang:num_running_reqs",
    "# just a comment",
    "# HELP sglang:num_running_reqs again\nsglang:num_running_reqs 3",  # a family a second time
    '# TYPE sglang:e2e_request_latency_seconds gauge\nsglang:e2e_request_latency_seconds_bucket{le="1"} 1',
]


@pytest.mark.parametrize("line", ODD_LINES)
def test_any_other_line_is_judged_by_prometheus_client(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    text = PAGES["sglang"] + line + "\n"
    try:
        expected: scrape.ServerReading | str = slow_reading(text, "sglang", monkeypatch)
    except ScrapeError:
        expected = "refused"
    try:
        got: scrape.ServerReading | str = parse_reading(text, "sglang", timestamp_seconds=1.0)
    except ScrapeError:
        got = "refused"
    assert got == expected if isinstance(expected, str) or isinstance(got, str) else same(got, expected)
