"""The inference figures in `/metrics`: the families of each configured service, a pure function of
the snapshot's `ServiceFigures` and `GpuAttribution` (their JSON for `gpu-agent status` is in
agent/documents.py, its text lines in agent/services/text.py).

    gpu_agent_service_request_duration_seconds_bucket{service,kind,le}   the server's histograms as
        _sum, _count                                                    counters (agent.services.counters)
    gpu_agent_service_generated_tokens_total{service}
    gpu_agent_service_gpu_energy_joules_total{service}   energy of the service's GPUs while the agent ran
    gpu_agent_service_requests_running{service}
    gpu_agent_service_requests_waiting{service}
    gpu_agent_service_kv_cache_usage_ratio{service}
    gpu_agent_service_metrics_up{service}          1 when the last scrape of its /metrics worked
    gpu_agent_service_latency_slo_seconds{service,kind="e2e|ttft"}   the p95 objective (services[].slo)
    gpu_agent_service_gpu_memory_bytes{service,gpu,uuid}
    gpu_agent_gpu_unattributed_memory_bytes{gpu,uuid,process}   GPU memory of processes no service owns,
        by command name (at most UNATTRIBUTED_NAMES a GPU, the rest as "other")
    gpu_agent_service_request_latency_seconds{service,kind,quantile}   the window's p50/p95/p99, what
        `gpu-agent status` shows (family service_latency_quantiles, off by default)

Rates are left to PromQL: `rate(..._generated_tokens_total[5m])` is tokens/s, and divided by
`rate(..._gpu_energy_joules_total[5m])` tokens per joule; `histogram_quantile` over the buckets a
p95 of any set of services. A figure the server did not give (no traffic yet, a family it lacks)
is absent, not 0.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.metrics.families import Families
from agent.services.scrape import LATENCY_KINDS
from agent.services.window import QUANTILES
from agent.state import GpuAttribution, ServiceFigures

#: The latency kinds whose histograms a default scrape shows (what services[].slo bounds); the
#: others are in the service_latency_detail family.
OBJECTIVE_KINDS = frozenset({"e2e", "ttft"})
#: Command names of unattributed GPU processes listed per GPU; the rest add up as "other".
UNATTRIBUTED_NAMES = 4
OTHER_PROCESSES = "other"


def service_metric_families(
    out: Families,
    figures: Mapping[str, ServiceFigures],
    attribution: GpuAttribution | None = None,
    uuids: Mapping[int, str] | None = None,
    slo_seconds: Mapping[str, Mapping[str, float]] | None = None,
) -> None:
    """The inference families of one scrape, into `out` (after the node's, in this order)."""
    for service, found in sorted(figures.items()):
        counters = found.counters
        for kind, histogram in sorted(counters.histograms.items()) if counters is not None else ():
            out.histogram(
                "gpu_agent_service_request_duration_seconds",
                "Requests by duration, from the server's own histograms kept as counters (kind e2e: end to end, "
                "ttft: to the first token, itl: between tokens, queue: waiting).",
                {"service": service, "kind": kind},
                list(zip(histogram.bounds, histogram.bucket_counts)),
                histogram.sum,
                family="service_latency" if kind in OBJECTIVE_KINDS else "service_latency_detail",
            )
        labels = {"service": service}
        for name, text, value in (
            (
                "gpu_agent_service_generated_tokens",
                "Tokens the server generated (its own counter, resets of its engines added up).",
                None if counters is None else counters.generated_tokens,
            ),
            (
                "gpu_agent_service_gpu_energy_joules",
                "Energy the service's GPUs used while the agent watched them (their energy counters).",
                None if counters is None else counters.gpu_energy_joules,
            ),
        ):
            out.counter(name, text, labels, value, family="services")
        for name, text, gauge in (
            ("gpu_agent_service_requests_running", "Requests the server is running now.", found.running),
            ("gpu_agent_service_requests_waiting", "Requests waiting in the server's queue now.", found.waiting),
            (
                "gpu_agent_service_kv_cache_usage_ratio",
                "The server's KV cache usage (0-1; the fullest pool).",
                found.kv_cache_usage_ratio,
            ),
            (
                "gpu_agent_service_metrics_up",
                "1 when the last scrape of the server's /metrics worked.",
                0.0 if found.error else 1.0,
            ),
            (
                "gpu_agent_service_metrics_read_timestamp_seconds",
                "When the figures above were read from the server (its last readable /metrics), Unix time.",
                found.timestamp_seconds or None,
            ),
        ):
            out.gauge(name, text, labels, gauge, family="services")
        for kind in LATENCY_KINDS:
            for q in QUANTILES:
                out.quantile(
                    "gpu_agent_service_request_latency_seconds",
                    "Request latency quantiles from the server's own histograms over the agent's 5-minute window.",
                    {"service": service, "kind": kind, "quantile": f"{q:g}"},
                    found.quantile(kind, q),
                    family="service_latency_quantiles",
                )
    # Next to the p95 it bounds, so a dashboard draws both and an alert compares them.
    for service, objectives in sorted((slo_seconds or {}).items()):
        for objective, seconds in sorted(objectives.items()):
            out.gauge(
                "gpu_agent_service_latency_slo_seconds",
                "The service's p95 latency objective (services[].slo in agent.yaml).",
                {"service": service, "kind": objective},
                seconds,
                family="services",
            )
    if attribution is None:
        return
    names = uuids or {}
    for service, per_gpu in sorted(attribution.memory_bytes.items()):
        for gpu, used in sorted(per_gpu.items()):
            if gpu in names:
                out.gauge(
                    "gpu_agent_service_gpu_memory_bytes",
                    "GPU memory held by the service's processes (NVML running processes).",
                    {"service": service, "gpu": str(gpu), "uuid": names[gpu]},
                    used,
                    family="services",
                )
    for (gpu, command), used in sorted(unattributed_by_command(attribution, names).items()):
        out.gauge(
            "gpu_agent_gpu_unattributed_memory_bytes",
            "GPU memory held by processes that belong to no configured service, by command name (the "
            f"{UNATTRIBUTED_NAMES} largest per GPU; the rest as other).",
            {"gpu": str(gpu), "uuid": names[gpu], "process": command},
            used,
            family="services",
        )


def unattributed_by_command(attribution: GpuAttribution, gpus: Mapping[int, str]) -> dict[tuple[int, str], int]:
    """(GPU, command name) -> GPU memory of the processes of no service: the largest
    UNATTRIBUTED_NAMES names of each GPU, the rest added up as "other". A pid never makes a series,
    and however many processes come and go, a GPU has at most UNATTRIBUTED_NAMES + 1."""
    by_name: dict[int, dict[str, int]] = {}
    for process in attribution.unattributed:
        if process.gpu in gpus:
            names = by_name.setdefault(process.gpu, {})
            command = process.command or OTHER_PROCESSES
            names[command] = names.get(command, 0) + (process.used_memory_bytes or 0)
    found: dict[tuple[int, str], int] = {}
    for gpu, names in by_name.items():
        ranked = sorted(names.items(), key=lambda item: (-item[1], item[0]))
        for command, used in ranked[:UNATTRIBUTED_NAMES]:
            found[(gpu, command)] = found.get((gpu, command), 0) + used
        rest = sum(used for _, used in ranked[UNATTRIBUTED_NAMES:])
        if rest:
            found[(gpu, OTHER_PROCESSES)] = found.get((gpu, OTHER_PROCESSES), 0) + rest
    return found
