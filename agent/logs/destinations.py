"""Structured logging: journal entries with fields under systemd, JSON lines on a pipe, readable
console output in a terminal.

Under systemd (JOURNAL_STREAM set) each event becomes a journal entry whose structlog keys are
journal fields (`gpu_uuid` -> GPU_UUID, `xid` -> XID, `rule` -> RULE, `action` -> ACTION), so
`journalctl -u gpu-agent XID=79` works. systemd-python's `journal.send` is used when importable
(the packages depend on python3-systemd); otherwise the same datagram is written to journald's
native socket directly.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import structlog

from agent.printable import printable

JOURNAL_SOCKET = "/run/systemd/journal/socket"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_PRIORITY = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}
_FIELD_OK = re.compile(r"[^A-Z0-9_]")


def journal_field(key: str) -> str:
    name = _FIELD_OK.sub("_", key.upper()).lstrip("_")
    return name or "FIELD"


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def journal_fields(event_dict: Mapping[str, Any]) -> dict[str, str]:
    fields = {"SYSLOG_IDENTIFIER": "gpu-agent"}
    for key, value in event_dict.items():
        if key in ("event", "level", "timestamp") or value is None:
            continue
        fields[journal_field(key)] = _text(value)
    extra = " ".join(f"{k}={_text(v)}" for k, v in event_dict.items() if k not in ("event", "level", "timestamp"))
    fields["MESSAGE"] = f"{event_dict.get('event', '')} {extra}".strip()
    fields["PRIORITY"] = str(_PRIORITY.get(str(event_dict.get("level", "info")), 6))
    return fields


def _native_datagram(fields: Mapping[str, str]) -> bytes:
    out = bytearray()
    for key, value in fields.items():
        data = value.encode()
        if b"\n" in data:
            out += key.encode() + b"\n" + len(data).to_bytes(8, "little") + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


def _journal_sender() -> Callable[[dict[str, str]], None]:
    try:
        # imported by name: the repo's own systemd/ folder would otherwise shadow it for type checkers
        journal = importlib.import_module("systemd.journal")

        def send(fields: dict[str, str]) -> None:
            journal.send(fields.pop("MESSAGE"), **fields)

        return send
    except ImportError:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

        def send_native(fields: dict[str, str]) -> None:
            try:
                sock.sendto(_native_datagram(fields), JOURNAL_SOCKET)
            except OSError:
                sys.stderr.write(fields["MESSAGE"] + "\n")

        return send_native


class JournalRenderer:
    """Final structlog processor: sends the entry to the journal and drops it."""

    def __init__(self) -> None:
        self._send = _journal_sender()

    def __call__(self, _logger: object, _name: str, event_dict: MutableMapping[str, Any]) -> str:
        self._send(journal_fields(event_dict))
        raise structlog.DropEvent


def under_journal() -> bool:
    return bool(os.environ.get("JOURNAL_STREAM")) and os.path.exists(JOURNAL_SOCKET)


class _StdlibToStructlog(logging.Handler):
    """Libraries log through stdlib `logging` (the standard library's own modules, third-party
    ones); their records join the same journal/JSON stream, with the library's logger name as
    `logger`. The agent's own modules log through structlog directly (tests/logs/test_logs.py holds them
    to it), so their key=value fields become journal fields."""

    def emit(self, record: logging.LogRecord) -> None:
        fields: dict[str, Any] = {"logger": record.name}
        if record.exc_info:
            fields["exc_info"] = record.exc_info
        structlog.get_logger("gpu-agent").log(record.levelno, record.getMessage(), **fields)


def escape_text(keep_newlines: bool = False) -> Callable[[object, str, MutableMapping[str, Any]], Any]:
    """A processor putting every string field of a log line through `printable`: a process name or
    kernel text with a terminal escape cannot act on a terminal, nor a newline forge a second line.
    The journal's native protocol frames each field by its length, so there a newline may stay."""

    def escape(_logger: object, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in event_dict.items():
            if isinstance(value, str):
                event_dict[key] = printable(value, keep_newlines)
        return event_dict

    return escape


class _CurrentStream:
    """`sys.stdout` or `sys.stderr` as it is when a line is written, not when logging was configured:
    a caller that swaps the stream (an embedding process, a test capturing output) must not leave
    the agent writing to one that has since been closed."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        written: int = getattr(sys, self.name).write(text)
        return written

    def flush(self) -> None:
        getattr(sys, self.name).flush()


def configure_cli_logging() -> None:
    """One-shot commands (`events --json`, `plan`, ...): stdout is the answer, so the agent's own log
    lines go to stderr, and only warnings and worse (not "state database migrated")."""
    structlog.configure(
        processors=[escape_text(), structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(_CurrentStream("stderr")),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def configure_logging(level: str = "info", output: str = "auto") -> str:
    """output: auto | journal | json | console. Returns the one chosen."""
    if output == "auto":
        output = "journal" if under_journal() else ("console" if sys.stderr.isatty() else "json")
    renderer: Any
    # Escaped before the traceback is formatted: its own line breaks stay.
    processors: list[Any] = [
        escape_text(keep_newlines=output == "journal"),
        structlog.processors.add_log_level,
        structlog.processors.format_exc_info,
    ]
    if output == "journal":
        renderer = JournalRenderer()
    elif output == "console":
        processors.insert(0, structlog.processors.TimeStamper(fmt="%H:%M:%S"))
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        processors.insert(0, structlog.processors.TimeStamper(fmt="iso"))
        renderer = structlog.processors.JSONRenderer(default=str)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        logger_factory=structlog.PrintLoggerFactory(
            _CurrentStream("stderr" if output == "console" else "stdout")  # type: ignore[arg-type]
        ),
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    root.handlers = [_StdlibToStructlog()]
    root.setLevel(_LEVELS[level.lower()])
    return output
