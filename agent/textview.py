"""Rendering that needs nothing but the standard library: `gpu-agent status` against a running
daemon imports only this, the socket client and what the daemon published of its socket, so it
starts fast (agent/cli/fast_start.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from agent import TYPE_CHECKING
from agent.printable import printable, printable_document
from agent.services.text import service_figures_line, unattributed_lines

if TYPE_CHECKING:
    from typing import IO, Any, Final

    from agent.names.policy_items import NodeItemName

#: The report-only items the screen gives lines of their own, named here rather than imported: the
#: names module loads `typing` (mypy holds each to the item names all the same).
NEXT_BOOT: Final[NodeItemName] = "next_boot"
DRIVER: Final[NodeItemName] = "driver"

JSON_SCHEMA_VERSION = 1


_MIN_WRAP_COLUMNS = 8  # a wrapping table column is never narrower than this


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return "\n".join(line for block in table_blocks(headers, rows) for line in block)


def table_blocks(
    headers: Sequence[str], rows: Sequence[Sequence[str]], width: int | None = None, wrap: Sequence[int] = ()
) -> list[list[str]]:
    """The header line, then each row's lines: when the table is wider than `width`, the `wrap`
    columns share what the others leave and their text wraps within them (nothing is cut)."""
    # Escaped before measuring: a cell's escapes are part of its width.
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    gaps = 2 * (len(widths) - 1)
    if width is not None and wrap and sum(widths) + gaps > width:
        room = width - gaps - sum(w for i, w in enumerate(widths) if i not in wrap)
        # Narrow columns keep their width; the rest share what is left evenly.
        for count, column in enumerate(sorted(wrap, key=lambda i: widths[i])):
            share = max(_MIN_WRAP_COLUMNS, room // (len(wrap) - count))
            widths[column] = min(widths[column], share)
            room -= widths[column]
    blocks = [["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]]
    for row in rows:
        cells = [_wrapped(cell, w) if i in wrap else [cell] for i, (cell, w) in enumerate(zip(row, widths))]
        height = max(len(c) for c in cells)
        blocks.append(
            [
                "  ".join((c[n] if n < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip()
                for n in range(height)
            ]
        )
    return blocks


def _wrapped(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` (one line when it fits: textwrap, a few regular expressions
    compiled at import, loads only for a screen too narrow)."""
    if len(text) <= width:
        return [text]
    import textwrap

    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


def dumps(document: dict[str, Any]) -> str:
    return json.dumps({"schema": JSON_SCHEMA_VERSION, **document}, indent=2, sort_keys=False)


def _fmt(value: object, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


EXIT_HEALTHY = 0
EXIT_COULD_NOT_TELL = 1
EXIT_ATTENTION = 2

_NAME_COLUMNS = 16  # "NVIDIA RTX PRO 6~": the reason column needs the room more
_MIN_NAME_COLUMNS = 8
_ATTENTION_LINES = 8  # on a terminal; a pipe or a file gets every line
_MIN_REASON_COLUMNS = 12
_MIN_SCREEN_COLUMNS = 40
_COLOURS = {"healthy": "32", "degraded": "33", "unhealthy": "31", "LOST": "31", "problem": "1;31", "reboot": "1;33"}


def use_colour(stream: IO[str]) -> bool:
    """Colour only on a terminal, and never with NO_COLOR set (https://no-color.org)."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def screen_width(stream: IO[str]) -> int | None:
    """The terminal's width when `stream` is one; None (every line whole) for a pipe or a file, where
    nobody could scroll sideways to the rest of a cut line."""
    if not stream.isatty():
        return None
    # shutil.get_terminal_size's order ($COLUMNS, then the terminal) without shutil's imports
    columns = os.environ.get("COLUMNS", "")
    if columns.isdecimal() and int(columns) > 0:
        return max(_MIN_SCREEN_COLUMNS, int(columns))
    try:
        return max(_MIN_SCREEN_COLUMNS, os.get_terminal_size(stream.fileno()).columns)
    except (OSError, ValueError):
        return 80


def fit(line: str, width: int | None) -> list[str]:
    """`line` as a screen `width` columns wide shows it: wrapped at spaces, the continuation indented
    under its text; whole when there is no width (a pipe, a file)."""
    if width is None or len(line) <= width:
        return [line]
    import textwrap

    indent = " " * (len(line) - len(line.lstrip(" ")) + 2)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_on_hyphens=False) or [line]


def status_exit_code(document: dict[str, Any]) -> int:
    """Like `plan`: 0 all healthy, 2 attention needed, 1 could not tell (no verdict in the answer)."""
    verdict = document.get("verdict")
    if not isinstance(verdict, dict) or verdict.get("exit_code") not in (EXIT_HEALTHY, EXIT_ATTENTION):
        return EXIT_COULD_NOT_TELL
    return int(verdict["exit_code"])


def ago(seconds: float | None, now: float) -> str:
    """When something happened, relative to now, as "3m ago"."""
    if seconds is None:
        return "-"
    elapsed = max(0, int(now - seconds))
    if elapsed < 60:
        return f"{elapsed}s ago"
    if elapsed < 3600:
        return f"{elapsed // 60}m ago"
    if elapsed < 86400:
        return f"{elapsed // 3600}h{elapsed % 3600 // 60:02d}m ago"
    return f"{elapsed // 86400}d ago"


def _gib(used: int | None, total: int | None) -> str:
    if used is None or total is None:
        return "-"
    return f"{used / 2**30:.0f}/{total / 2**30:.0f}G"


def _clip(text: str, width: int) -> str:
    """A table cell cut to its column (only cells are ever cut: the same text is in a line below)."""
    return text if len(text) <= width else text[: max(0, width - 1)] + "~"


class _Paint:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, key: str) -> str:
        code = _COLOURS.get(key)
        return f"\033[{code}m{text}\033[0m" if self.enabled and code else text


class _Screen:
    """Lines for a screen `width` wide (None: no limit): each line wrapped, never cut, then painted."""

    def __init__(self, width: int | None, paint: _Paint) -> None:
        self.width = width
        self.paint = paint
        self.lines: list[str] = []

    def add(self, *lines: str, key: str = "") -> None:
        for line in lines:
            self.lines.extend(self.paint(part, key) if key else part for part in fit(line, self.width))

    def add_fitted(self, lines: Sequence[str]) -> None:
        """Lines already made to fit (the GPU table)."""
        self.lines.extend(lines)


def _tune_line(tune: dict[str, Any], now: float) -> str:
    """The last `gpu-agent tune`, in one line."""
    unit = "W" if tune.get("kind") == "power" else "MHz"
    when = ago(tune["finished_seconds"] or tune["started_seconds"], now)
    line = f"last tune: {tune['kind']} sweep {tune['id']} of {tune['service']} ({when}): {tune['state']}"
    if tune.get("recommended") is not None:
        changes = [
            f"{change * 100:+.1f} % {what}"
            for change, what in (
                (tune.get("tokens_per_joule_change_ratio"), "tokens/J"),
                (tune.get("tokens_per_second_change_ratio"), "tokens/s"),
            )
            if change is not None
        ]
        line += f", recommends {tune['recommended']:g} {unit}" + (f" ({', '.join(changes)})" if changes else "")
    return line + " (gpu-agent tune --last)"


def status_text(
    document: dict[str, Any], *, now: float | None = None, width: int | None = None, colour: bool = False
) -> str:
    """The operator's one screen of a status document (daemon or direct): the verdict first, then the
    GPUs, policy, Xids, services, remediations and events with how long ago they happened.

    `width`: the terminal's columns. Lines wrap at it and only the GPU table's cells are cut (their
    text is in the verdict's lines too); None (a pipe, a file) keeps every line whole."""
    now = time.time() if now is None else now
    # Every string in it may carry a process name or kernel text: escaped before any colour is added.
    document = printable_document(document)
    paint = _Paint(colour)
    screen = _Screen(width, paint)
    verdict = document.get("verdict") or {}
    header = (
        f"gpu-agent {document['version']} ({document['source']}); backend {document['backend']}, "
        f"driver {document['driver_version'] or '-'}"
        + (f", up {_duration(document['uptime_seconds'])}" if document["source"] == "daemon" else "")
    )
    screen.add(header)
    if document.get("note"):
        screen.add(document["note"])
    problem = verdict.get("problem")
    if problem:
        screen.add(f"PROBLEM: {problem['detail']}", key="problem")
    if verdict.get("reboot_recommended"):
        screen.add(f"REBOOT RECOMMENDED: {verdict['reboot_recommended']}", key="reboot")
        screen.add("  (after the reboot it clears; `gpu-agent ack reboot` withdraws it once dealt with otherwise)")
    screen.add("")
    screen.add_fitted(_gpu_table(document, width, paint))
    screen.add(*(_telemetry_line(g) for g in document["gpus"] if g["up"]))
    screen.add(*_policy_lines(document))
    screen.add(*_readiness_lines(document["policy"]["items"]))
    if document["xids"]:
        screen.add("", "Xids:")
        screen.add(
            *(
                f"  GPU {_or_dash(x['gpu'])} Xid {x['xid']} x{x['count']}, last {ago(x['last_seen_seconds'], now)}"
                for x in document["xids"]
            )
        )
    services = service_lines(document)
    if services:
        screen.add("", *services)
    screen.add(*_rules_lines(document.get("rules") or []))
    recent_remediations = document.get("recent_remediations") or []
    if recent_remediations:
        screen.add("", "remediations:")
        screen.add(*(f"  {ago(r['started_seconds'], now):>8}  {_remediation(r)}" for r in recent_remediations[-5:]))
    last_tune = document.get("last_tune")
    if last_tune:
        screen.add("", _tune_line(last_tune, now))
    recent = document["recent_events"][-5:]
    if recent:
        screen.add("", "recent events:")
        screen.add(*(f"  {ago(e['timestamp_seconds'], now):>8}  [{e['severity']}] {e['message']}" for e in recent))
    attention = verdict.get("attention")
    screen.add("")
    if attention is None:
        screen.add("verdict: unknown (the daemon sent no verdict)")
    elif attention:
        shown = attention if width is None else attention[:_ATTENTION_LINES]
        screen.add(f"ATTENTION NEEDED ({len(attention)}):", key="problem")
        screen.add(*(f"  - {line}" for line in shown))
        if len(attention) > len(shown):
            screen.add(f"  ... and {len(attention) - len(shown)} more (status --json lists all)")
    else:
        screen.add("all healthy", key="healthy")
    return "\n".join(screen.lines)


def _rules_lines(sources: list[str]) -> list[str]:
    """How many rules files the daemon read; the admin's overrides and masks by name."""
    if not sources:
        return []
    read = [s for s in sources if ": masked" not in s]
    changed = [s for s in sources if "(overrides " in s or ": masked" in s]
    return ["", f"rules: {len(read)} file(s) read", *(f"  {s}" for s in changed)]


def _readiness_lines(items: Sequence[dict[str, Any]]) -> list[str]:
    """`next boot: 6.8.0-50-generic — nvidia 580.159.04 module missing` and the driver, when checked."""
    lines = []
    for item in items:
        facts = item.get("facts") or {}
        if item["item"] == NEXT_BOOT and facts.get("summary"):
            lines.append(f"next boot: {facts['summary']}")
        elif item["item"] == DRIVER and facts.get("version"):
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
            lines.append(f"  {s['name']}: {service_figures_line(s['metrics'])}")
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


def _remediation(r: dict[str, Any]) -> str:
    """A decision in a line; a dry run (observe mode) is what the agent would have done."""
    if r["outcome"] == "dry_run" and r["detail"]:
        return str(r["detail"])
    return f"{r['rule']}: {r['action']} {r['target']} -> {r['outcome']}" + (f" ({r['detail']})" if r["detail"] else "")


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _gpu_table(document: dict[str, Any], width: int | None, paint: _Paint) -> list[str]:
    if not document["gpus"]:
        return ["no GPUs"]
    headers = ["GPU", "NAME", "HEALTH", "TEMP", "POWER", "MEMORY", "UTIL", "SM MHZ", "REASON"]
    rows: list[list[str]] = []
    states: list[str] = []
    for g in document["gpus"]:
        health = g.get("health") or {}
        state = health.get("state") or "unknown"
        if not g["up"]:
            state = "LOST"
        states.append(state)
        reason = health.get("reason") or ", ".join(f"{k}: {v}" for k, v in g["read_errors"].items())
        throttled = g.get("throttled") or []
        if throttled and ", ".join(throttled) not in reason:
            reason = f"{reason}; throttled: {', '.join(throttled)}" if reason else f"throttled: {', '.join(throttled)}"
        rows.append(
            [
                str(g["index"]),
                _clip(g["name"] or "?", _NAME_COLUMNS) if width is not None else g["name"] or "?",
                ("STALE " if g.get("stale") else "") + state,
                _fmt(g["temperature_celsius"], " C"),
                f"{_fmt(g['power_usage_watts'], '', 0)}/{_fmt(g['power_limit_watts'], ' W', 0)}",
                _gib(g["memory_used_bytes"], g["memory_total_bytes"]),
                _fmt(g["gpu_utilization_percent"], "%"),
                _fmt(g["sm_clock_mhz"]),
                reason or "-",
            ]
        )
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    if width is not None:
        # Every column but the name and the reason keeps its width; the reason gets what is left of
        # the screen, and on a narrow one the name gives up room first.
        name_column = headers.index("NAME")
        fixed = sum(widths[:-1]) + 2 * (len(widths) - 1)
        short_by = fixed + min(widths[-1], _MIN_REASON_COLUMNS) - width
        if short_by > 0:
            narrower = max(_MIN_NAME_COLUMNS, widths[name_column] - short_by)
            fixed -= widths[name_column] - narrower
            widths[name_column] = narrower
        widths[-1] = max(_MIN_REASON_COLUMNS, min(widths[-1], width - fixed))
    health_column = headers.index("HEALTH")
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for row, state in zip(rows, states):
        cells = [_clip(cell, w).ljust(w) for cell, w in zip(row, widths)]
        cells[health_column] = paint(cells[health_column], state)
        lines.append("  ".join(cells).rstrip())
    return lines


def _policy_lines(document: dict[str, Any]) -> list[str]:
    items = document["policy"]["items"]
    off = [i for i in items if i["status"] not in ("in_sync", "not_applicable")]
    lines = ["", f"policy: {len(items) - len(off)}/{len(items)} items in sync"]
    lines.extend(
        f"  {i['item']}{'' if i['gpu'] is None else ' GPU ' + str(i['gpu'])} ({i['mode']}): {i['status']} "
        f"(want {i['desired']}, have {i['actual']}){' - ' + i['detail'] if i['detail'] else ''}"
        for i in off
    )
    return lines


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
