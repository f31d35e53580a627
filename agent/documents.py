"""Stable JSON documents: `status --json` (from the daemon or a direct read), plan, apply, events.
The daemon serves them over its socket and the CLI prints them. JSON carries `schema` so consumers can pin it."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from agent.events import event_json as event_json  # `render.event_json`: the CLI's events --json
from agent.policy.engine import ApplyReport, NodePlan
from agent.policy.plan import ItemPlan, ItemResult
from agent.services.window import QUANTILES
from agent.state import GpuAttribution, GpuSample, NodeSnapshot, ServiceFigures, ServiceStatus
from agent.verdict import attention_items, drifted, node_problem, throttled_reasons
from agent.watch.clock_events import decode

if TYPE_CHECKING:  # the store (sqlite3) only for `events --json`
    from agent.store.database import StoredRemediation


def _gpu(gpu: int | None) -> str:
    return "-" if gpu is None else str(gpu)


def plan_item_json(plan: ItemPlan, mode: str) -> dict[str, Any]:
    return {
        "item": plan.item,
        "gpu": plan.gpu,
        "status": plan.status.value,
        "mode": mode,
        "desired": plan.desired,
        "actual": plan.actual,
        "detail": plan.detail,
        "changes": list(plan.changes),
        "error_kind": plan.error_kind,
        "facts": dict(plan.facts),
    }


def plan_json(plan: NodePlan) -> dict[str, Any]:
    return {
        "mode": plan.mode.value,
        "in_sync": plan.exit_code == 0,
        "exit_code": plan.exit_code,
        "profiles": {str(gpu): number for gpu, number in sorted(plan.profiles.items())},
        # per GPU: the settings in force and where each came from (a profile, or an override's FILE:LINE)
        "profile_sources": {
            str(gpu): {"profile": resolved.number, "settings": dict(sorted(resolved.sources.items()))}
            for gpu, resolved in sorted(plan.resolved.items())
        },
        "items": [plan_item_json(p, plan.item_modes.get(p.item, plan.mode).value) for p in plan.items],
    }


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


def snapshot_document(snapshot: NodeSnapshot, source: str, note: str = "", mode: str = "observe") -> dict[str, Any]:
    """`gpu-agent status --json`: the same document from the daemon and from a direct read."""
    gpus = []
    for sample in snapshot.gpus:
        health = snapshot.health.get(sample.index)
        entry = sample_json(sample)
        entry["stale"] = sample.index in snapshot.stale_gpus
        entry["health"] = (
            {
                "state": health.state.value,
                "reason": health.reason,
                "suggested_action": health.suggested_action.value,
                "causes": [cause.value for cause in health.causes],  # the codes /metrics labels by
            }
            if health is not None
            else None
        )
        entry["throttling"] = sorted(reason for (gpu, reason) in snapshot.throttle_active_since if gpu == sample.index)
        entry["throttled"] = throttled_reasons(snapshot, sample.index)
        entry["pcie_degraded"] = sample.index in snapshot.pcie_degraded
        gpus.append(entry)
    policy_items = [plan_item_json(p, snapshot.item_modes.get(p.item, mode)) for p in snapshot.policy]
    problem = node_problem(snapshot)
    needs = attention_items(snapshot, mode)
    return {
        # the daemon's verdict: the same one STATUS=, /healthz and /metrics carry (agent/verdict.py)
        "verdict": {
            "exit_code": 2 if needs else 0,
            "attention": [item.text for item in needs],
            "causes": [item.cause.value for item in needs],  # one per attention line, in order
            "problem": None if problem is None else {"cause": problem.cause.value, "detail": problem.detail},
            "reboot_recommended": snapshot.reboot_recommended,
            # the bounded code /metrics labels it with (the kind of event behind it)
            "reboot_recommended_cause": snapshot.reboot_recommended_cause or None,
            "expected_gpus": snapshot.expected_gpus,
            "drift": [{"item": p.item, "gpu": p.gpu} for p in drifted(snapshot)],
            "slo_breaches": [asdict(b) for b in snapshot.slo_breaches],
        },
        "source": source,
        "note": note,
        "version": snapshot.version,
        "backend": snapshot.backend,
        "driver_version": snapshot.driver_version,
        "timestamp_seconds": snapshot.timestamp_seconds,
        "uptime_seconds": round(snapshot.timestamp_seconds - snapshot.started_seconds, 3),
        "gpus": gpus,
        "policy": {
            "in_sync": all(p.in_sync for p in snapshot.policy),
            "items": policy_items,
        },
        "xids": [asdict(x) for x in snapshot.xids],
        **services_json(snapshot),
        "remediations": [asdict(r) for r in snapshot.remediations],
        "recent_remediations": [asdict(r) for r in snapshot.recent_remediations],
        "rules": list(snapshot.rules_sources),
        "recent_events": [event_json(e) for e in snapshot.recent_events[-20:]],
        "collectors": [asdict(c) for c in snapshot.collectors],
    }


def services_json(snapshot: NodeSnapshot) -> dict[str, Any]:
    """`services` (each with its server's `metrics` when scraped) and `unattributed_gpu_processes`.

    A one-off read probes no service: a service whose server answered its scrape is listed as not
    probed, with its metrics."""
    listed = [*snapshot.services]
    listed += [
        ServiceStatus(name, "", None) for name in snapshot.service_figures if name not in {s.name for s in listed}
    ]
    return {
        "services": [
            {**asdict(s), "metrics": status_document(snapshot.service_figures[s.name], snapshot.timestamp_seconds)}
            if s.name in snapshot.service_figures
            else asdict(s)
            for s in listed
        ],
        "unattributed_gpu_processes": unattributed_document(snapshot.gpu_attribution),
    }


def result_json(result: ItemResult, mode: str) -> dict[str, Any]:
    return {**plan_item_json(result.plan, mode), "outcome": result.outcome.value, "outcome_detail": result.detail}


def apply_json(report: ApplyReport) -> dict[str, Any]:
    modes = report.plan.item_modes
    return {
        "mode": report.plan.mode.value,
        "dry_run": report.dry_run,
        "exit_code": report.exit_code,
        "results": [result_json(r, modes.get(r.plan.item, report.plan.mode).value) for r in report.results],
    }


def sample_json(sample: GpuSample) -> dict[str, Any]:
    data = asdict(sample)
    data["fan_speeds_percent"] = list(sample.fan_speeds_percent) if sample.fan_speeds_percent is not None else None
    mask = sample.clock_event_reasons
    data["clock_event_reasons_active"] = decode(mask) if mask is not None else None
    return data


def remediation_json(r: StoredRemediation) -> dict[str, Any]:
    data = asdict(r)
    data["outcome"] = r.outcome.value
    return data
