"""Structured logs: journal entries carry fields (GPU_UUID, XID, RULE, ACTION); JSON lines elsewhere."""

from __future__ import annotations

import ast
import io
import json
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from agent.logs import destinations as log_destinations


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """configure_logging binds structlog and the root logger to this test's streams: undo it, or
    every later test logs into a closed capture file."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.reset_defaults()
    root.handlers, root.level = handlers, level


def parse_native(datagram: bytes) -> dict[str, str]:
    """journald's native protocol: KEY=value lines, or KEY\\n<le64 size><data>\\n for values with newlines."""
    fields: dict[str, str] = {}
    rest = datagram
    while rest:
        line, _, tail = rest.partition(b"\n")
        if b"=" in line:
            key, _, value = line.partition(b"=")
            fields[key.decode()] = value.decode()
            rest = tail
        else:
            size = int.from_bytes(tail[:8], "little")
            fields[line.decode()] = tail[8 : 8 + size].decode()
            rest = tail[8 + size + 1 :]
    return fields


def test_journal_field_names() -> None:
    assert log_destinations.journal_field("gpu_uuid") == "GPU_UUID"
    assert log_destinations.journal_field("xid") == "XID"
    assert log_destinations.journal_field("rule-name") == "RULE_NAME"
    assert log_destinations.journal_field("_private") == "PRIVATE"


def test_journal_entries_have_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journald = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "journal.sock"
    journald.bind(str(path))
    journald.settimeout(2)
    monkeypatch.setattr(log_destinations, "JOURNAL_SOCKET", str(path))
    monkeypatch.setitem(sys.modules, "systemd", None)  # force the native-socket path
    assert log_destinations.configure_logging("info", "journal") == "journal"
    log = structlog.get_logger("test")
    log.error(
        "action finished", gpu_uuid="GPU-1234", xid=79, rule="reboot-on-79", action="recommend_reboot", detail="a\nb"
    )
    fields = parse_native(journald.recv(65536))
    journald.close()
    expected = {
        "GPU_UUID": "GPU-1234",
        "XID": "79",
        "RULE": "reboot-on-79",
        "ACTION": "recommend_reboot",
        "DETAIL": "a\nb",
        "PRIORITY": "3",
        "SYSLOG_IDENTIFIER": "gpu-agent",
    }
    assert {name: fields.get(name) for name in expected} == expected
    assert fields["MESSAGE"].startswith("action finished")


def test_json_lines_when_not_under_systemd(capsys: pytest.CaptureFixture[str]) -> None:
    assert log_destinations.configure_logging("info", "json") == "json"
    structlog.get_logger("test").info("policy drift corrected", item="power_limit", gpu=0)
    structlog.get_logger("test").debug("not shown at info")
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "policy drift corrected" and record["item"] == "power_limit" and record["level"] == "info"


def test_auto_picks_journal_only_under_systemd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    assert not log_destinations.under_journal()
    sock = tmp_path / "journal.sock"
    sock.touch()
    monkeypatch.setattr(log_destinations, "JOURNAL_SOCKET", str(sock))
    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    assert log_destinations.under_journal()


#: Modules allowed to import stdlib logging, and why. agent/logs/destinations.py bridges third-party
#: libraries that log through `logging` (pyudev, systemd's journal module) into the same structlog stream.
STDLIB_LOGGING_ALLOWED = {
    "agent/logs/destinations.py": "routes third-party libraries' stdlib records into structlog",
}


def _imports_stdlib_logging(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "logging" for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "logging":
            return True
    return False


def test_agent_modules_log_through_structlog_not_stdlib_logging() -> None:
    """Messages logged through stdlib `logging` lose their fields in the journal (GPU_UUID, XID, ...)."""
    root = Path(__file__).resolve().parents[2]
    importing = {
        path.relative_to(root).as_posix() for path in (root / "agent").rglob("*.py") if _imports_stdlib_logging(path)
    }
    assert importing <= set(STDLIB_LOGGING_ALLOWED), sorted(importing - set(STDLIB_LOGGING_ALLOWED))
    assert set(STDLIB_LOGGING_ALLOWED) <= importing, (
        f"stale exceptions: {sorted(set(STDLIB_LOGGING_ALLOWED) - importing)}"
    )


def test_every_module_logs_as_the_daemon_through_get_logger() -> None:
    """Every module logs as "gpu-agent" (the journal's SYSLOG_IDENTIFIER and the JSON lines agree),
    through agent/logs's `get_logger()`, so structlog loads only when a line is logged."""
    root = Path(__file__).resolve().parents[2]
    configuring = {"agent/logs/__init__.py", "agent/logs/destinations.py"}
    for path in (root / "agent").rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom) and relative not in configuring:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] == "structlog" for n in names), f"{relative}:{node.lineno}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "get_logger":
                names = [arg.value for arg in node.args if isinstance(arg, ast.Constant)]
                assert names in ([], ["gpu-agent"]) or relative == "agent/logs/__init__.py", f"{relative}:{node.lineno}"


LAZY_PROBE = """
import sys
from agent.logs import get_logger, log_to_stderr_when_used
log = get_logger()
log_to_stderr_when_used()
assert "structlog" not in sys.modules, "loaded before a line was logged"
log.info("not shown: one-shot commands show warnings and worse")
log.warning("heard on stderr", gpu=0)
assert "structlog" in sys.modules
"""


def test_structlog_loads_on_the_first_line_and_the_cli_configuration_applies_then() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LAZY_PROBE], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2]
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "heard on stderr" in done.stderr and "gpu=0" in done.stderr
    assert "not shown" not in done.stderr


@pytest.mark.parametrize("output", ["json", "console", "cli"])
def test_a_swapped_and_closed_stream_is_never_written_to(monkeypatch: pytest.MonkeyPatch, output: str) -> None:
    """Logging configured while a caller had swapped the stream (a test capturing output, an
    embedding process) keeps writing to the stream in place now, not to the closed one."""
    name = "stdout" if output == "json" else "stderr"
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, name, first)
    if output == "cli":
        log_destinations.configure_cli_logging()
    else:
        log_destinations.configure_logging("info", output)
    first.close()
    monkeypatch.setattr(sys, name, second)
    structlog.get_logger("gpu-agent").warning("still heard")
    assert "still heard" in second.getvalue()
