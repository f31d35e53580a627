"""Rendering that needs nothing but the standard library: `gpu-agent status` against a running
daemon imports only this, the socket client and the config file's `api.socket`, so it starts fast."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agent.service_text import status_line, unattributed_lines

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


def _fmt(value: object, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


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
    lines.extend(_telemetry_line(g) for g in document["gpus"] if g["up"])
    items = document["policy"]["items"]
    off = [i for i in items if i["status"] not in ("in_sync", "not_applicable")]
    lines.append("")
    lines.append(f"policy: {len(items) - len(off)}/{len(items)} items in sync")
    lines.extend(
        f"  {i['item']}{'' if i['gpu'] is None else ' GPU ' + str(i['gpu'])}: {i['status']} "
        f"(want {i['desired']}, have {i['actual']}){' - ' + i['detail'] if i['detail'] else ''}"
        for i in off
    )
    lines.extend(_readiness_lines(items))
    if document["xids"]:
        lines.append("")
        lines.append("Xids: " + ", ".join(f"GPU {x['gpu']} Xid {x['xid']} x{x['count']}" for x in document["xids"]))
    services = service_lines(document)
    if services:
        lines.append("")
        lines.extend(services)
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


def _readiness_lines(items: Sequence[dict[str, Any]]) -> list[str]:
    """`next boot: 6.8.0-50-generic — nvidia 580.159.04 module missing` and the driver, when checked."""
    lines = []
    for item in items:
        facts = item.get("facts") or {}
        if item["item"] == "next_boot" and facts.get("summary"):
            lines.append(f"next boot: {facts['summary']}")
        elif item["item"] == "driver" and facts.get("version"):
            branch = f", {facts['branch']} branch" if facts.get("branch") else ""
            cuda = f", CUDA {facts['cuda_version']}" if facts.get("cuda_version") else ""
            lines.append(f"driver: {facts['version']}{branch}{cuda}")
    return lines


def service_lines(document: dict[str, Any]) -> list[str]:
    """Each service's probe verdict and, under it, its server's figures; then the GPU processes
    that belong to no configured service."""
    lines: list[str] = []
    for s in document["services"]:
        unit = f" ({s['unit']})" if s["unit"] else ""
        verdict = "up" if s["up"] else "not probed yet" if s["up"] is None else f"DOWN ({s['detail']})"
        lines.append(f"service {s['name']}{unit}: {verdict}")
        if s.get("metrics"):
            lines.append(f"  {s['name']}: {status_line(s['metrics'])}")
    lines.extend(unattributed_lines(document.get("unattributed_gpu_processes") or ()))
    return lines


_MIB = 1 << 20


def _activity(g: dict[str, Any]) -> str:
    """ "SM 96% tensor 94% DRAM 17%" from the GPM ratios, as the issue's H200 measured them."""
    if g.get("activity_supported") is False:
        return "activity: not supported"
    if g.get("sm_active_ratio") is None:
        return "activity: - (needs two samples)"
    parts = [("SM", "sm_active_ratio"), ("tensor", "tensor_active_ratio"), ("DRAM", "dram_active_ratio")]
    return " ".join(f"{label} {round(g[key] * 100)}%" for label, key in parts if g.get(key) is not None)


def _memory(g: dict[str, Any]) -> str:
    """Used/total as nvidia-smi prints it (MiB; used without the driver's reserved memory)."""
    used, total = g.get("memory_used_bytes"), g.get("memory_total_bytes")
    if used is None or total is None:
        return "memory -"
    text = f"memory {round(used / _MIB)}/{round(total / _MIB)} MiB"
    reserved = g.get("memory_reserved_bytes")
    return text + (f" ({round(reserved / _MIB)} MiB reserved)" if reserved is not None else "")


def _telemetry_line(g: dict[str, Any]) -> str:
    hbm = g.get("memory_temperature_celsius")
    return f"GPU {g['index']}: {_memory(g)}; {_activity(g)}" + (f"; HBM {hbm} C" if hbm is not None else "")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
