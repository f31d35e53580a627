"""The inference figures in /metrics (valid exposition, promtool-clean) and in status."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from snapshots import inference_fields, node_snapshot

from agent.documents import snapshot_document, status_document, unattributed_document
from agent.metrics.families import Families
from agent.metrics.services import UNATTRIBUTED_NAMES, service_metric_families, unattributed_by_command
from agent.names.metric_families import DEFAULT_SWITCHES, FamilySwitches
from agent.services.text import service_figures_line, unattributed_lines
from agent.state import (
    CounterHistogram,
    GpuAttribution,
    GpuProcessInfo,
    LatencyFigures,
    ServiceCounters,
    ServiceFigures,
)
from agent.textview import status_text

GIB = 2**30


def figures(**fields: object) -> ServiceFigures:
    base: dict[str, object] = {
        "service": "sglang",
        "kind": "sglang",
        "timestamp_seconds": 100.0,
        "window_seconds": 300.0,
        "latency": {
            "e2e": LatencyFigures(120, 0.6, {0.5: 0.55, 0.95: 0.72, 0.99: 0.79}),
            "ttft": LatencyFigures(120, 0.11, {0.5: 0.1, 0.95: 0.15, 0.99: None}),
        },
        "running": 9.0,
        "waiting": 0.0,
        "kv_cache_usage_ratio": 0.3,
        "generation_tokens_per_second": 320.0,
        "counters": COUNTERS,
    }
    base.update(fields)
    return ServiceFigures(**base)  # type: ignore[arg-type]


INF = float("inf")
COUNTERS = ServiceCounters(
    histograms={
        "e2e": CounterHistogram((0.5, 1.0, INF), (40.0, 118.0, 120.0), 120.0, 72.0),
        "itl": CounterHistogram((0.01, 0.02, INF), (300.0, 480.0, 480.0), 480.0, 6.0),
    },
    generated_tokens=4800.0,
    gpu_energy_joules=9600.0,
)


ATTRIBUTION = GpuAttribution(
    memory_bytes={"sglang": {0: 120 * GIB, 1: 118 * GIB}},
    pids={"sglang": (10, 11)},
    unattributed=(GpuProcessInfo(4242, 3, "GPU-d", 1 * GIB, "jupyter.service", "python"),),
)


EVERYTHING = FamilySwitches.everything()


def exposition(switches: FamilySwitches = EVERYTHING) -> str:
    class Fixed(Collector):
        def collect(self):  # type: ignore[no-untyped-def]
            out = Families(switches)
            service_metric_families(
                out,
                {
                    "sglang": figures(),
                    "vllm": figures(service="vllm", latency={}, error="HTTP 404", running=None, counters=None),
                },
                ATTRIBUTION,
                {0: "GPU-a", 1: "GPU-b", 3: "GPU-d"},
            )
            return iter(out)

    registry = CollectorRegistry()
    registry.register(Fixed())
    return generate_latest(registry).decode()


def samples(switches: FamilySwitches = EVERYTHING) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition(switches))
        for s in family.samples
    }


def test_latency_quantiles_gauges_and_memory_are_exported() -> None:
    found = samples()
    latency = "gpu_agent_service_request_latency_seconds"
    assert found[(latency, (("kind", "e2e"), ("quantile", "0.95"), ("service", "sglang")))] == 0.72
    assert found[(latency, (("kind", "ttft"), ("quantile", "0.5"), ("service", "sglang")))] == 0.1
    # a quantile the window could not give is absent, and so is everything of a server never read
    assert (latency, (("kind", "ttft"), ("quantile", "0.99"), ("service", "sglang"))) not in found
    assert not any(labels == (("service", "vllm"),) and name.endswith("_running") for name, labels in found)
    assert found[("gpu_agent_service_requests_running", (("service", "sglang"),))] == 9
    assert found[("gpu_agent_service_kv_cache_usage_ratio", (("service", "sglang"),))] == 0.3
    assert found[("gpu_agent_service_metrics_up", (("service", "sglang"),))] == 1
    assert found[("gpu_agent_service_metrics_up", (("service", "vllm"),))] == 0
    # rates are PromQL's: the counters they are taken of are exported, no gauge of a rate
    assert not any(name == "gpu_agent_service_generation_tokens_per_second" for name, _ in found)
    assert not any(name == "gpu_agent_service_tokens_per_joule" for name, _ in found)
    assert found[("gpu_agent_service_generated_tokens_total", (("service", "sglang"),))] == 4800
    assert found[("gpu_agent_service_gpu_energy_joules_total", (("service", "sglang"),))] == 9600
    memory = "gpu_agent_service_gpu_memory_bytes"
    assert found[(memory, (("gpu", "1"), ("service", "sglang"), ("uuid", "GPU-b")))] == 118 * GIB
    unattributed = "gpu_agent_gpu_unattributed_memory_bytes"
    assert found[(unattributed, (("gpu", "3"), ("process", "python"), ("uuid", "GPU-d")))] == GIB


def test_the_servers_histograms_are_counter_histograms() -> None:
    found = samples()
    duration = "gpu_agent_service_request_duration_seconds"
    e2e = (("kind", "e2e"), ("service", "sglang"))
    buckets = {
        dict(labels)["le"]: value
        for (name, labels), value in found.items()
        if name == duration + "_bucket" and set(e2e) <= set(labels)
    }
    assert buckets == {"0.5": 40.0, "1.0": 118.0, "+Inf": 120.0}
    assert found[(duration + "_count", e2e)] == 120
    assert found[(duration + "_sum", e2e)] == 72


def test_the_default_scrape_has_the_objective_kinds_not_the_window_quantiles() -> None:
    found = samples(DEFAULT_SWITCHES)
    kinds = {dict(labels)["kind"] for name, labels in found if name.startswith("gpu_agent_service_request_duration")}
    assert kinds == {"e2e"}  # itl (and queue) are service_latency_detail's
    assert not any(name == "gpu_agent_service_request_latency_seconds" for name, _ in found)


def test_unattributed_processes_by_command_name_are_bounded() -> None:
    """However many processes of no service come and go, a GPU has at most UNATTRIBUTED_NAMES + 1
    series, and no pid is ever a label."""
    many = GpuAttribution(
        unattributed=(
            *(GpuProcessInfo(1000 + i, 0, "GPU-a", (i + 1) * GIB, None, f"worker{i % 9}") for i in range(40)),
            GpuProcessInfo(7, 5, "GPU-gone", GIB, None, "ghost"),
        )
    )
    found = unattributed_by_command(many, {0: "GPU-a"})
    assert len(found) == UNATTRIBUTED_NAMES + 1
    assert sum(found.values()) == sum((i + 1) * GIB for i in range(40))  # nothing lost, the rest is "other"
    assert ("0", "other") in {(str(gpu), name) for gpu, name in found}
    assert all(gpu == 0 for gpu, _ in found)  # a GPU not in the snapshot has none


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_the_exposition_passes_promtool() -> None:
    checked = subprocess.run(
        ["promtool", "check", "metrics"], input=exposition(), capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_service_figures_line_and_document() -> None:
    document = status_document(figures(), now_seconds=101.0)
    assert document["latency_seconds"]["e2e"] == {"0.5": 0.55, "0.95": 0.72, "0.99": 0.79}
    assert document["requests_in_window"] == {"e2e": 120, "ttft": 120}
    assert document["metrics_error"] is None
    assert service_figures_line(document) == "p95 e2e 0.72 s, TTFT 0.15 s; running 9 / waiting 0; 320 tokens/s"
    never_read = status_document(figures(latency={}, error="HTTP 404", timestamp_seconds=0.0), 101.0)
    assert service_figures_line(never_read) == "metrics unavailable (HTTP 404)"
    queue = LatencyFigures(120, 0.01, {0.5: 0.005, 0.95: 0.02, 0.99: 0.04})
    fuller = status_document(figures(latency={**figures().latency, "queue": queue}, tokens_per_joule=0.5234), 101.0)
    assert fuller["latency_seconds"]["queue"]["0.95"] == 0.02
    assert fuller["tokens_per_joule"] == 0.5234
    assert service_figures_line(fuller) == (
        "p95 e2e 0.72 s, TTFT 0.15 s, queue 0.02 s; running 9 / waiting 0; 320 tokens/s (0.52/J)"
    )
    stale = service_figures_line(status_document(figures(error="timed out after 2 s"), 101.0))
    assert stale.endswith("(last scrape: timed out after 2 s)")
    assert list(unattributed_lines(unattributed_document(ATTRIBUTION))) == [
        "GPU 3: pid 4242 python (jupyter.service) 1.0 GiB, in no configured service"
    ]


def test_figures_read_long_ago_say_how_long() -> None:
    """A long `scrape_interval_seconds`, or scrapes failing since, leave the figures old: status says
    how old once that is worth saying, and /metrics carries when they were read."""
    fresh = status_document(figures(), now_seconds=109.94)
    assert fresh["read_seconds_ago"] == 9.9
    assert not service_figures_line(fresh).endswith("ago")
    old = status_document(figures(error="timed out after 2 s"), now_seconds=412.0)
    assert old["read_seconds_ago"] == 312.0
    assert service_figures_line(old) == (
        "p95 e2e 0.72 s, TTFT 0.15 s; running 9 / waiting 0; 320 tokens/s; read 312 s ago"
        " (last scrape: timed out after 2 s)"
    )
    assert (
        status_document(figures(latency={}, error="HTTP 404", timestamp_seconds=0.0), 412.0)["read_seconds_ago"] is None
    )
    read_at = {
        s.labels["service"]: s.value
        for family in text_string_to_metric_families(exposition())
        for s in family.samples
        if s.name == "gpu_agent_service_metrics_read_timestamp_seconds"
    }
    assert read_at == {"sglang": 100.0, "vllm": 100.0}


def test_families_without_samples_are_not_exposed() -> None:
    out = Families()
    service_metric_families(out, {})
    assert list(out) == []


def test_status_shows_each_services_figures_under_its_probe_line() -> None:
    """The whole path a status read takes: snapshot -> status JSON -> text. A service only scraped
    (a one-off read probes nothing) is listed as not probed, with its figures."""
    snapshot = node_snapshot(**inference_fields())
    text = status_text(snapshot_document(snapshot, source="daemon"))
    assert (
        "service sglang (sglang.service): up\n"
        "  sglang: p95 e2e 0.72 s, TTFT 0.15 s, queue 0.02 s; running 9 / waiting 2; 320 tokens/s (0.52/J)\n"
        "service embeddings (embeddings.service): DOWN (HTTP 503)\n"
        "  embeddings: metrics unavailable (timed out after 2 s)\n"
        "service vllm (vllm.service): not probed yet\n"
        "GPU 1: pid 4242 python (jupyter.service) 1.0 GiB, in no configured service\n"
    ) in text
    direct = snapshot_document(replace(snapshot, services=()), source="direct")
    assert [(s["name"], s["up"], "metrics" in s) for s in direct["services"]] == [
        ("sglang", None, True),
        ("embeddings", None, True),
    ]
    assert "service sglang: not probed yet\n  sglang: p95 e2e 0.72 s" in status_text(direct)
