"""Human tables and stable JSON documents for the CLI. JSON carries `schema` so consumers can pin it."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from agent.clock_events import decode
from agent.events import Event
from agent.policy.base import ItemPlan, ItemResult
from agent.policy.engine import ApplyReport, NodePlan
from agent.state import GpuSample, NodeSnapshot
from agent.store import StoredEvent, StoredRemediation

JSON_SCHEMA_VERSION = 1


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def dumps(document: dict[str, Any]) -> str:
    return json.dumps({"schema": JSON_SCHEMA_VERSION, **document}, indent=2, sort_keys=False)


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
    }


def plan_json(plan: NodePlan) -> dict[str, Any]:
    return {
        "mode": plan.mode.value,
        "in_sync": plan.exit_code == 0,
        "exit_code": plan.exit_code,
        "profiles": {str(gpu): number for gpu, number in sorted(plan.profiles.items())},
        "items": [plan_item_json(p, plan.item_modes.get(p.item, plan.mode).value) for p in plan.items],
    }


def event_json(event: Event) -> dict[str, Any]:
    return {
        "kind": event.kind.value,
        "severity": event.severity.value,
        "gpu": event.gpu,
        "uuid": event.uuid,
        "message": event.message,
        "timestamp_seconds": event.timestamp_seconds,
        "source": event.source,
        "suggested_action": event.suggested_action.value,
        "data": event.data,
    }


def snapshot_document(snapshot: NodeSnapshot, source: str, note: str = "", mode: str = "observe") -> dict[str, Any]:
    """`gpu-agent status --json`: the same document from the daemon and from a direct read."""
    gpus = []
    for sample in snapshot.gpus:
        health = snapshot.health.get(sample.index)
        entry = sample_json(sample)
        entry["stale"] = sample.index in snapshot.stale_gpus
        entry["health"] = (
            {"state": health.state.value, "reason": health.reason, "suggested_action": health.suggested_action.value}
            if health is not None
            else None
        )
        entry["throttling"] = sorted(reason for (gpu, reason) in snapshot.throttle_active_since if gpu == sample.index)
        gpus.append(entry)
    policy_items = [plan_item_json(p, snapshot.item_modes.get(p.item, mode)) for p in snapshot.policy]
    return {
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
        "services": [asdict(s) for s in snapshot.services],
        "remediations": [asdict(r) for r in snapshot.remediations],
        "recent_events": [event_json(e) for e in snapshot.recent_events[-20:]],
        "collectors": [asdict(c) for c in snapshot.collectors],
    }


def status_text(document: dict[str, Any]) -> str:
    """The human view of a status document (daemon or direct)."""
    lines = [
        f"gpu-agent {document['version']} ({document['source']}"
        + (f": {document['note']}" if document.get("note") else "")
        + f"); backend {document['backend']}, driver {document['driver_version'] or '-'}"
        + (f", up {_duration(document['uptime_seconds'])}" if document["source"] == "daemon" else ""),
        "",
    ]
    rows = []
    for g in document["gpus"]:
        health = g.get("health") or {}
        rows.append(
            [
                str(g["index"]),
                g["name"] or "?",
                ("STALE " if g.get("stale") else "") + (health.get("state") or ("up" if g["up"] else "DOWN")),
                _fmt(g["temperature_celsius"], " C"),
                f"{_fmt(g['power_usage_watts'], '', 0)}/{_fmt(g['power_limit_watts'], ' W', 0)}",
                f"{_fmt(g['sm_clock_mhz'])}/{_fmt(g['memory_clock_mhz'])} MHz",
                _fmt(g["gpu_utilization_percent"], "%"),
                "/".join(f"{f}%" for f in g["fan_speeds_percent"]) if g["fan_speeds_percent"] else "-",
                ", ".join(g["clock_event_reasons_active"] or []) or "-",
                health.get("reason") or ", ".join(f"{k}: {v}" for k, v in g["read_errors"].items()),
            ]
        )
    lines.append(
        table(
            ["GPU", "NAME", "HEALTH", "TEMP", "POWER", "SM/MEM CLOCK", "UTIL", "FANS", "CLOCK EVENTS", "REASON"], rows
        )
    )
    items = document["policy"]["items"]
    off = [i for i in items if i["status"] not in ("in_sync", "not_applicable")]
    lines.append("")
    lines.append(f"policy: {len(items) - len(off)}/{len(items)} items in sync")
    lines.extend(
        f"  {i['item']}{'' if i['gpu'] is None else ' GPU ' + str(i['gpu'])}: {i['status']} "
        f"(want {i['desired']}, have {i['actual']}){' - ' + i['detail'] if i['detail'] else ''}"
        for i in off
    )
    if document["xids"]:
        lines.append("")
        lines.append("Xids: " + ", ".join(f"GPU {x['gpu']} Xid {x['xid']} x{x['count']}" for x in document["xids"]))
    if document["services"]:
        lines.append("")
        lines.extend(
            f"service {s['name']} ({s['unit']}): "
            + ("up" if s["up"] else "not probed yet" if s["up"] is None else f"DOWN ({s['detail']})")
            for s in document["services"]
        )
    if document["remediations"]:
        lines.append("")
        lines.append(
            "remediations: "
            + ", ".join(f"{r['rule']}/{r['action']} {r['outcome']} x{r['count']}" for r in document["remediations"])
        )
    recent = document["recent_events"][-5:]
    if recent:
        lines.append("")
        lines.append("recent events:")
        lines.extend(f"  [{e['severity']}] {e['message']}" for e in recent)
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _why(plan: ItemPlan) -> str:
    if plan.changes and plan.status.value == "drift":
        return "; ".join(plan.changes)
    return plan.detail


def plan_text(plan: NodePlan) -> str:
    if not plan.items:
        return "nothing to enforce: the policy sets no item that applies to this node"
    rows = [
        [
            p.item,
            _gpu(p.gpu),
            p.status.value,
            plan.item_modes.get(p.item, plan.mode).value,
            p.desired,
            p.actual,
            _why(p),
        ]
        for p in plan.items
    ]
    summary = {0: "in sync", 1: "errors", 2: "drift"}[plan.exit_code]
    body = table(["ITEM", "GPU", "STATUS", "MODE", "DESIRED", "ACTUAL", "CHANGE / DETAIL"], rows)
    unmatched = [str(g) for g, n in sorted(plan.profiles.items()) if n is None]
    note = f"\nno GPU profile matches GPU {', '.join(unmatched)}" if unmatched else ""
    return f"{body}{note}\n\nplan: {summary}"


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


def results_text(results: Sequence[ItemResult]) -> str:
    if not results:
        return "nothing to do"
    rows = [[r.plan.item, _gpu(r.plan.gpu), r.outcome.value, r.detail or r.plan.detail] for r in results]
    return table(["ITEM", "GPU", "OUTCOME", "DETAIL"], rows)


def sample_json(sample: GpuSample) -> dict[str, Any]:
    data = asdict(sample)
    data["fan_speeds_percent"] = list(sample.fan_speeds_percent) if sample.fan_speeds_percent is not None else None
    mask = sample.clock_event_reasons
    data["clock_event_reasons_active"] = decode(mask) if mask is not None else None
    return data


def _fmt(value: object, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def remediation_json(r: StoredRemediation) -> dict[str, Any]:
    data = asdict(r)
    data["outcome"] = r.outcome.value
    return data


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def history_text(events: Sequence[StoredEvent], remediations: Sequence[StoredRemediation]) -> str:
    """`gpu-agent events`: one time-ordered list of what happened and what the agent did about it."""
    lines: list[tuple[float, str]] = []
    for stored in events:
        e = stored.event
        where = "" if e.gpu is None else f"GPU {e.gpu} "
        lines.append(
            (e.timestamp_seconds, f"{_when(e.timestamp_seconds)}  event  [{e.severity.value}] {where}{e.message}")
        )
    for r in remediations:
        target = r.service or (f"GPU {r.gpu}" if r.gpu is not None else "node")
        text = f"{r.rule}: {r.action} on {target} -> {r.outcome.value}"
        if r.detail or r.reason:
            text += f" ({r.detail or r.reason})"
        lines.append((r.started_seconds, f"{_when(r.started_seconds)}  action {text}"))
    if not lines:
        return "no events or remediations in that period"
    return "\n".join(text for _, text in sorted(lines))
