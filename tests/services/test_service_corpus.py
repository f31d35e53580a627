"""The corpus of server pages (tests/service_pages.py builds it from the servers' own metric
definitions) read as the servers mean their series: every figure the window draws from three
scrapes equals what a real Prometheus computes from the same samples (promtool evaluates PromQL's
`increase`, per-series resets and `histogram_quantile`), and the layout facts hold: TP copies
counted once, DP ranks and engines added, one engine's restart resetting only its own series,
an OpenMetrics answer keeping the token counter, the older vLLM names read."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families
from service_pages import CASES, SCRAPE_SECONDS, Case

from agent.config import AgentConfig
from agent.demo.standin_process import StandinServer
from agent.services import scrape as scrape_module
from agent.services.monitor import LatencyRegressionWatch
from agent.services.scrape import ScrapeError, fetch_text, parse_reading
from agent.services.window import QUANTILES, LatencyWindow
from agent.state import GpuSample, ServiceFigures

PROMTOOL = shutil.which("promtool")
BY_NAME = {case.name: case for case in CASES}


def window_figures(case: Case) -> ServiceFigures:
    window = LatencyWindow(case.name, window_seconds=300)
    for t, page in case.pages():
        window.add(parse_reading(page, timestamp_seconds=float(t)))
    figures = window.figures()
    assert figures is not None
    return figures


def test_every_page_names_its_source() -> None:
    for case in CASES:
        source = (case.folder / "SOURCE").read_text()
        assert "loggers.py" in source or "collector.py" in source, case.name
        assert "vLLM 0.1" in source or "commit" in source, case.name
        for _, page in case.pages():
            assert case.openmetrics or page.startswith(f"# Built from {case.source}"), case.name


def test_sglang_tp_ranks_are_one_batch() -> None:
    figures = window_figures(BY_NAME["sglang-tp2-all-schedulers"])
    # both TP ranks export running 12 / waiting 5: one batch, not 24 / 10
    assert (figures.running, figures.waiting) == (12, 5)
    assert figures.kv_cache_usage_ratio == 0.97
    # every rank observed each request's queue time: counted once, as many as finished requests
    assert figures.latency["queue"].requests == figures.latency["e2e"].requests == 220


def test_sglang_dp_ranks_are_added_and_their_tp_copies_counted_once() -> None:
    figures = window_figures(BY_NAME["sglang-dp2-tp4-all-schedulers"])
    assert (figures.running, figures.waiting) == (12 + 9, 5 + 1)
    assert figures.kv_cache_usage_ratio == 0.97  # the fullest batch's pool turns requests away
    assert figures.latency["queue"].requests == figures.latency["e2e"].requests == 120 + 90 + 100 + 80


def test_one_engine_restarting_resets_only_its_own_series() -> None:
    figures = window_figures(BY_NAME["vllm-dp2-engine-restart"])
    # engine 0: 100 + 100; engine 1: 100, then restarted with 20 since
    assert figures.latency["e2e"].requests == 320
    assert figures.resets == 1
    # the 20 slow requests of the restarted engine are in the window's tail, not drowned
    p99 = figures.quantile("e2e", 0.99)
    assert p99 is not None and p99 > 5.0


def test_an_openmetrics_answer_keeps_the_token_counter() -> None:
    figures = window_figures(BY_NAME["vllm-openmetrics"])
    assert figures.generation_tokens_per_second is not None and figures.generation_tokens_per_second > 0
    history = figures.generated_tokens_history
    assert len(history) == 3 and history[-1][1] == pytest.approx(figures.generation_tokens_per_second * 300)
    assert set(figures.latency) == {"e2e", "ttft", "itl", "queue"}


def test_the_older_vllm_names_are_read() -> None:
    case = BY_NAME["vllm-0.10-names"]
    last = parse_reading(case.pages()[-1][1])
    assert last.families["itl"] == "vllm:time_per_output_token_seconds"
    assert last.families["kv_cache_usage"] == "vllm:kv_cache_usage_perc"
    assert set(window_figures(case).latency) == {"e2e", "ttft", "itl", "queue"}


# -- against a real Prometheus ---------------------------------------------------------------------


def _series(case: Case, families: set[str]) -> list[dict[str, str]]:
    """promtool input series: every sample of `families` over the scrapes, parsed by
    prometheus-client's own parser of the page's format (not the agent's line selection)."""
    values: dict[str, list[str]] = {}
    for _, page in case.pages():
        parse = openmetrics_families if case.openmetrics else text_string_to_metric_families
        for family in parse(page):
            for sample in family.samples:
                if sample.name.endswith("_created") or not any(sample.name.startswith(f) for f in families):
                    continue
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                values.setdefault(f"{sample.name}{{{labels}}}", []).append(repr(float(sample.value)))
    return [{"series": name, "values": " ".join(v)} for name, v in sorted(values.items())]


def _checks(case: Case, figures: ServiceFigures) -> list[tuple[str, float]]:
    """(PromQL, the agent's figure) pairs. `max without (tp_rank)` is how PromQL takes one copy of
    a batch its TP ranks all export; DP ranks and engines are separate series that `sum` adds."""
    last = parse_reading(case.pages()[-1][1])
    window = f"{SCRAPE_SECONDS[-1] - SCRAPE_SECONDS[0]}s"
    one = "max without (tp_rank)"
    checks: list[tuple[str, float]] = []
    for kind, found in figures.latency.items():
        family = last.families[kind]
        checks.append((f"sum({one} (increase({family}_count[{window}])))", found.requests))
        for q in QUANTILES:
            value = found.quantiles[q]
            assert value is not None, (case.name, kind, q)
            promql = f"histogram_quantile({q}, sum by (le) ({one} (increase({family}_bucket[{window}]))))"
            checks.append((promql, value))
    assert figures.generation_tokens_per_second is not None
    tokens = f"{last.families['generation_tokens']}_total"
    checks.append((f"sum({one} (increase({tokens}[{window}]))) / 300", figures.generation_tokens_per_second))
    assert figures.running is not None and figures.waiting is not None and figures.kv_cache_usage_ratio is not None
    checks.append((f"sum({one} ({last.families['running']}))", figures.running))
    checks.append((f"sum({one} ({last.families['waiting']}))", figures.waiting))
    checks.append((f"max({last.families['kv_cache_usage']})", figures.kv_cache_usage_ratio))
    return checks


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_figure_equals_what_prometheus_computes(tmp_path: Path, case: Case) -> None:
    figures = window_figures(case)
    assert set(figures.latency) == {"e2e", "ttft", "itl", "queue"}
    checks = _checks(case, figures)
    families = {promql.split("(")[-1].split("[")[0].split(")")[0].removesuffix("_count") for promql, _ in checks}
    families = {name.removesuffix("_bucket").removesuffix("_total") for name in families}
    tests: list[dict[str, Any]] = [
        {
            # `bool`: 1 when PromQL's value and the agent's agree to 1e-9, whatever their last bits
            "expr": f"abs(({promql}) - {value!r}) < bool 1e-9",
            "eval_time": f"{SCRAPE_SECONDS[-1]}s",
            "exp_samples": [{"labels": "{}", "value": 1}],
        }
        for promql, value in checks
    ]
    document = {
        "rule_files": [],
        "evaluation_interval": "150s",
        "tests": [
            {"interval": "150s", "input_series": _series(case, families), "promql_expr_test": tests},
        ],
    }
    path = tmp_path / "corpus-test.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(tests) >= 4 * (1 + len(QUANTILES)) + 4


def test_a_full_kv_cache_behind_a_growing_queue_is_named_from_the_pages() -> None:
    """The sglang TP=2 pages end with one batch's KV cache at 97 %, its queue growing (0, 2, 5) and
    its queue time up from ~0.1 s to ~2.5 s: on clean GPUs the breach's cause is kv_cache_full."""
    figures = window_figures(BY_NAME["sglang-tp2-all-schedulers"])
    trend = figures.queue_time_trend
    assert trend is not None and trend.rose
    assert trend.earlier_mean_seconds is not None and trend.earlier_mean_seconds < 0.3
    config = AgentConfig.model_validate(
        {
            "services": [
                {
                    "name": "sglang",
                    "health_url": "http://127.0.0.1:30000/health",
                    "gpus": [0, 1],
                    "slo": {"e2e_p95_seconds": 2.0},
                }
            ]
        }
    )
    watch = LatencyRegressionWatch(config, clock=lambda: 300.0)
    clean = [
        GpuSample(gpu, f"GPU-{gpu}", "NVIDIA H200", "00000000:18:00.0", True, float(t), gpu_utilization_percent=95)
        for gpu in (0, 1)
        for t in range(0, 301, 30)
    ]
    watch.observe(clean, [])
    (event,) = watch.evaluate({"sglang": figures})
    assert event.data["cause"] == "kv_cache_full"
    assert event.data["evidence"]["kv_cache_usage_peak_ratio"] == 0.97
    assert event.data["evidence"]["queue"]["waiting_peak"] == 5
    assert "queue_time_p95_seconds" in event.data["evidence"]["queue"]
    assert "likely cause: KV cache 97% full, waiting requests grew from 0 to 5 and queue time rose" in event.message


def test_steady_queue_time_does_not_rise() -> None:
    trend = window_figures(BY_NAME["vllm-0.10-names"]).queue_time_trend
    assert trend is not None and not trend.rose


def test_a_live_stand_in_with_tp_copies_and_dp_ranks_reads_as_one_batch_per_dp_rank(tmp_path: Path) -> None:
    """The stand-in exporting every TP rank of two DP ranks (sglang with all schedulers, TP=2 DP=2),
    scraped over HTTP: running and waiting are the DP ranks' sum with each TP copy counted once,
    and the queue-time histogram counts each request once, as many as finished."""
    args = ("--flavor", "sglang", "--tp-ranks", "2", "--dp-ranks", "2", "--request-rate", "30")
    with StandinServer(tmp_path, extra_args=args) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        window = LatencyWindow("sglang", window_seconds=300)
        window.add(parse_reading(fetch_text(url), timestamp_seconds=0.0))
        time.sleep(1.5)
        page = fetch_text(url)
    reading = parse_reading(page, timestamp_seconds=1.5)
    window.add(reading)
    by_rank = {
        (s.labels["dp_rank"], s.labels["tp_rank"]): s.value
        for family in text_string_to_metric_families(page)
        if family.name == "sglang:num_running_reqs"
        for s in family.samples
    }
    assert set(by_rank) == {("0", "0"), ("0", "1"), ("1", "2"), ("1", "3")}
    assert by_rank[("0", "0")] == by_rank[("0", "1")] > 0  # TP copies of one batch
    assert reading.running == by_rank[("0", "0")] + by_rank[("1", "2")]
    figures = window.figures()
    assert figures is not None
    assert figures.latency["queue"].requests == figures.latency["e2e"].requests > 0


@pytest.mark.parametrize("case", [c for c in CASES if not c.openmetrics], ids=lambda case: case.name)
def test_the_plain_reader_reads_what_prometheus_client_reads(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scrape reads the text format as servers write it with a regular expression per line;
    every corpus page reads the same through prometheus-client's own parser."""
    pages = [page for _, page in case.pages()]
    fast = [parse_reading(page, timestamp_seconds=1.0) for page in pages]

    def refuse(selected: str) -> dict[str, object]:
        raise scrape_module._NotPlain(selected[:40])

    monkeypatch.setattr(scrape_module, "_plain_samples", refuse)
    assert [parse_reading(page, timestamp_seconds=1.0) for page in pages] == fast


def test_escaped_label_values_go_to_prometheus_client() -> None:
    page = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="a \\"quoted\\" model"} 3\n'
        'vllm:num_requests_running{engine="1",model_name="a \\"quoted\\" model"} 4\n'
    )
    assert parse_reading(page).running == 7


def test_only_short_label_sets_are_cached() -> None:
    """Label sets are cached across scrapes, bounded in count and in each one's length: a page of
    long label values is read, but none of it is kept."""
    cached = scrape_module._cached_labels
    long_name = "m" * 600
    page = "".join(
        f'vllm:num_requests_running{{engine="{engine}",model_name="{long_name}"}} 1\n' for engine in range(50)
    )
    before = cached.cache_info().currsize
    assert parse_reading(page, kind="vllm").running == 50
    assert cached.cache_info().currsize == before
    assert cached.cache_info().maxsize == 4096
    parse_reading(page.replace(long_name, "m"), kind="vllm")
    assert cached.cache_info().currsize > before


def test_a_bucket_bound_that_is_no_number_is_a_scrape_error() -> None:
    page = (
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="soon"} 1\n'
        'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf"} 1\n'
    )
    with pytest.raises(ScrapeError, match=r"unreadable page: .* has a bucket le='soon'"):
        parse_reading(page, kind="vllm")


# Lines that tell the two selections apart if either one slips: names sharing a wanted family's
# start, suffixes, HELP/TYPE spacing, a `{` right after a comment's name, blanks, tabs, no newline.
_SELECTION_EDGES = (
    "# HELP sglang:num_running_reqs running\n"
    "# HELP  sglang:num_queue_reqs two blanks\n"
    "# TYPE sglang:num_queue_reqs\tgauge\n"
    "# TYPE sglang:token_usage{ gauge\n"
    "# HELP sglang:token_usage_extra not ours\n"
    "# EOF sglang:token_usage 1\n"
    "sglang:num_running_reqs 3\n"
    "sglang:num_running_reqs_total 3\n"
    "sglang:num_running_reqs_created 3\n"
    "sglang:num_running_reqs_sum_bucket 3\n"
    "sglang:num_running_reqsx 3\n"
    "sglang:num_queue_reqs\t1\n"
    'sglang:num_queue_reqs{a="1"} 1\n'
    "sglang:token_usage\n"
    "\n"
    " sglang:token_usage 0.5\n"
    'sglang:e2e_request_latency_seconds_bucket{le="+Inf"} 4\n'
    "sglang:gen_throughput 7"
)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_the_page_wide_selection_keeps_the_lines_the_line_by_line_one_keeps(kind: str) -> None:
    """The lines of the families read are picked by one pattern over the page; the loop over
    its lines (still used for text with other line breaks or non-ASCII) keeps the same ones."""
    wanted = scrape_module.FAMILIES[kind].names()
    pages = [page for case in CASES for _, page in case.pages()]
    pages += [_SELECTION_EDGES, _SELECTION_EDGES.replace("sglang:", "vllm:"), "", "\n", "sglang:token_usage 1"]
    for page in pages:
        assert page.isascii()
        assert scrape_module._select_lines(page, wanted) == scrape_module._select_lines_one_by_one(page, wanted)


def test_a_page_with_other_line_breaks_is_selected_line_by_line(monkeypatch: pytest.MonkeyPatch) -> None:
    page = "sglang:num_running_reqs 3\r\nsglang:num_queue_reqs 1\x1csglang:token_usage 0.5\n"
    assert parse_reading(page, kind="sglang").waiting == 1
    monkeypatch.setattr(scrape_module, "_select_lines_one_by_one", lambda *_: "")
    assert parse_reading(page, kind="sglang").waiting is None
    assert parse_reading(page.replace("\x1c", "\n").replace("\r", ""), kind="sglang").waiting == 1


def test_a_label_set_seen_before_is_not_worked_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server writes the same label sets every scrape: each one's mapping, series key and
    replica rank are kept with it, so a later page reads only names and values."""
    (_, page), *_ = BY_NAME["sglang-dp2-tp4-all-schedulers"].pages()
    first = parse_reading(page, timestamp_seconds=1.0)
    worked_out: list[object] = []
    series_of = scrape_module._series_of
    monkeypatch.setattr(scrape_module, "_series_of", lambda labels: worked_out.append(labels) or series_of(labels))
    assert parse_reading(page, timestamp_seconds=1.0) == first
    assert worked_out == []
