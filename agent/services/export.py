"""The inference figures as the agent exports them: Prometheus families for `/metrics`, and the
JSON of `gpu-agent status` (its text lines: `agent.services.text`). Pure functions of
`ServiceFigures` and `GpuAttribution`, so the exporter and the status view stay one call each.

    gpu_agent_service_request_latency_seconds{service,kind="e2e|ttft|itl|queue",quantile="0.5|0.95|0.99"}
    gpu_agent_service_requests_running{service}
    gpu_agent_service_requests_waiting{service}
    gpu_agent_service_kv_cache_usage_ratio{service}
    gpu_agent_service_generation_tokens_per_second{service}
    gpu_agent_service_tokens_per_joule{service}    generated tokens / energy of its GPUs, same window
    gpu_agent_service_metrics_up{service}          1 when the last scrape of its /metrics worked
    gpu_agent_service_latency_slo_seconds{service,kind="e2e|ttft"}   the p95 objective (services[].slo)
    gpu_agent_service_gpu_memory_bytes{service,gpu,uuid}
    gpu_agent_gpu_unattributed_memory_bytes{gpu,uuid}   GPU memory of processes no service owns

The latency family is typed `summary` (quantile-labelled series are summaries to Prometheus).
A figure the server did not give (no traffic in the window, a family it lacks) is absent, not 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from agent.services.attribution import GpuAttribution
from agent.services.scrape import LATENCY_KINDS
from agent.services.window import QUANTILES, ServiceFigures

if TYPE_CHECKING:  # prometheus_client for the exporter; `status` documents need none of it
    from prometheus_client.core import Metric


def service_metric_families(
    figures: Mapping[str, ServiceFigures],
    attribution: GpuAttribution | None = None,
    uuids: Mapping[int, str] | None = None,
    slo_seconds: Mapping[str, Mapping[str, float]] | None = None,
) -> list[Metric]:
    from prometheus_client.core import GaugeMetricFamily, Metric

    # A summary's quantiles, as client-side summaries give them over a sliding window; without
    # _count/_sum, which for a server's requests are its own histograms' to give.
    latency = Metric(
        "gpu_agent_service_request_latency_seconds",
        "Request latency quantiles from the server's own histograms over the sliding window.",
        "summary",
    )
    gauges = {
        name: GaugeMetricFamily(name, text, labels=["service"])
        for name, text in (
            ("gpu_agent_service_requests_running", "Requests the server is running now."),
            ("gpu_agent_service_requests_waiting", "Requests waiting in the server's queue now."),
            ("gpu_agent_service_kv_cache_usage_ratio", "The server's KV cache usage (0-1; the fullest pool)."),
            ("gpu_agent_service_generation_tokens_per_second", "Generated tokens per second over the window."),
            (
                "gpu_agent_service_tokens_per_joule",
                "Generated tokens per joule the service's GPUs used, over the same window.",
            ),
            ("gpu_agent_service_metrics_up", "1 when the last scrape of the server's /metrics worked."),
            (
                "gpu_agent_service_metrics_read_timestamp_seconds",
                "When the figures above were read from the server (its last readable /metrics), Unix time.",
            ),
        )
    }
    for service, found in sorted(figures.items()):
        for kind in LATENCY_KINDS:
            for q in QUANTILES:
                value = found.quantile(kind, q)
                if value is not None:
                    labels = {"service": service, "kind": kind, "quantile": f"{q:g}"}
                    latency.add_sample("gpu_agent_service_request_latency_seconds", labels, value)
        values = {
            "gpu_agent_service_requests_running": found.running,
            "gpu_agent_service_requests_waiting": found.waiting,
            "gpu_agent_service_kv_cache_usage_ratio": found.kv_cache_usage_ratio,
            "gpu_agent_service_generation_tokens_per_second": found.generation_tokens_per_second,
            "gpu_agent_service_tokens_per_joule": found.tokens_per_joule,
            "gpu_agent_service_metrics_up": 0.0 if found.error else 1.0,
            "gpu_agent_service_metrics_read_timestamp_seconds": found.timestamp_seconds or None,
        }
        for name, value in values.items():
            if value is not None:
                gauges[name].add_metric([service], value)
    # Next to the p95 it bounds, so a dashboard draws both and an alert compares them.
    slo = GaugeMetricFamily(
        "gpu_agent_service_latency_slo_seconds",
        "The service's p95 latency objective (services[].slo in agent.yaml).",
        labels=["service", "kind"],
    )
    for service, objectives in sorted((slo_seconds or {}).items()):
        for objective, seconds in sorted(objectives.items()):
            slo.add_metric([service, objective], seconds)
    memory = GaugeMetricFamily(
        "gpu_agent_service_gpu_memory_bytes",
        "GPU memory held by the service's processes (NVML running processes).",
        labels=["service", "gpu", "uuid"],
    )
    unattributed = GaugeMetricFamily(
        "gpu_agent_gpu_unattributed_memory_bytes",
        "GPU memory held by processes that belong to no configured service.",
        labels=["gpu", "uuid"],
    )
    if attribution is not None:
        names = uuids or {}
        for service, per_gpu in sorted(attribution.memory_bytes.items()):
            for gpu, used in sorted(per_gpu.items()):
                memory.add_metric([service, str(gpu), names.get(gpu, "")], used)
        stray: dict[int, int] = {}
        for process in attribution.unattributed:
            stray[process.gpu] = stray.get(process.gpu, 0) + (process.used_memory_bytes or 0)
        for gpu, used in sorted(stray.items()):
            unattributed.add_metric([str(gpu), names.get(gpu, "")], used)
    # Empty families are not exposed, as in the rest of the exporter.
    return [family for family in (latency, *gauges.values(), slo, memory, unattributed) if family.samples]


def status_document(figures: ServiceFigures, now_seconds: float) -> dict[str, Any]:
    """One service's figures for `status --json` (the `metrics` of each service), with how long ago
    they were read: a long `scrape_interval_seconds`, or scrapes failing since, leave them old."""
    latency = sorted(figures.latency.items())
    read_ago = round(max(0.0, now_seconds - figures.timestamp_seconds), 1) if figures.timestamp_seconds else None
    return {
        "kind": figures.kind or None,
        "read_seconds_ago": read_ago,
        "window_seconds": round(figures.window_seconds, 1),
        "latency_seconds": {kind: {f"{q:g}": found.quantiles.get(q) for q in QUANTILES} for kind, found in latency},
        "requests_in_window": {kind: found.requests for kind, found in latency},
        "requests_running": figures.running,
        "requests_waiting": figures.waiting,
        "kv_cache_usage_ratio": figures.kv_cache_usage_ratio,
        "generation_tokens_per_second": figures.generation_tokens_per_second,
        "tokens_per_joule": None if figures.tokens_per_joule is None else round(figures.tokens_per_joule, 4),
        "metrics_error": figures.error or None,
    }


def unattributed_document(attribution: GpuAttribution | None) -> list[dict[str, Any]]:
    """GPU processes of no configured service, for `status --json`."""
    return [asdict(process) for process in (() if attribution is None else attribution.unattributed)]
