"""Human tables and stable JSON documents for the CLI. JSON carries `schema` so consumers can pin it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from agent.clock_events import decode
from agent.policy.base import ItemPlan, ItemResult
from agent.policy.engine import ApplyReport, NodePlan
from agent.state import GpuSample

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


def samples_text(samples: Sequence[GpuSample]) -> str:
    rows = []
    for s in samples:
        if not s.up:
            rows.append(
                [
                    str(s.index),
                    s.name or "?",
                    "DOWN",
                    *(["-"] * 6),
                    ", ".join(f"{k}: {v}" for k, v in s.read_errors.items()),
                ]
            )
            continue
        memory = (
            f"{s.memory_used_bytes / 2**30:.1f}/{s.memory_total_bytes / 2**30:.0f} GiB"
            if s.memory_used_bytes is not None and s.memory_total_bytes is not None
            else "-"
        )
        power = f"{_fmt(s.power_usage_watts, '', 0)}/{_fmt(s.power_limit_watts, ' W', 0)}"
        fans = "/".join(f"{f}%" for f in s.fan_speeds_percent) if s.fan_speeds_percent else "-"
        reasons = ", ".join(decode(s.clock_event_reasons)) if s.clock_event_reasons is not None else "-"
        rows.append(
            [
                str(s.index),
                s.name,
                _fmt(s.temperature_celsius, " C"),
                power,
                f"{_fmt(s.sm_clock_mhz)}/{_fmt(s.memory_clock_mhz)} MHz",
                _fmt(s.gpu_utilization_percent, "%"),
                memory,
                fans,
                reasons,
                ", ".join(f"{k}: {v}" for k, v in s.read_errors.items()),
            ]
        )
    return table(
        ["GPU", "NAME", "TEMP", "POWER", "SM/MEM CLOCK", "UTIL", "MEMORY", "FANS", "CLOCK EVENTS", "ERRORS"], rows
    )
