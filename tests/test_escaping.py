"""What humans read is escaped: a process name or kernel text with terminal escapes, bidi overrides or
newlines reaches no status screen, event list, plan, log line or metric label raw."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import structlog
from daemon_harness import running_agent
from helpers import make_event, wait_until
from services.test_gpu_attribution import fake_proc
from snapshots import node_snapshot

from agent.config import Mode
from agent.documents import snapshot_document
from agent.events import EventKind
from agent.host.paths import HostPaths
from agent.logs import destinations as log_destinations
from agent.metrics.families import Families
from agent.policy.engine import NodePlan
from agent.policy.plan import ItemPlan, PlanStatus
from agent.printable import printable
from agent.render import history_text, plan_text
from agent.services.attribution import command_of_pid
from agent.store.database import StoredEvent
from agent.textview import status_text
from agent.watch.fake_kernel_log import append_kmsg, xid_line
from agent.watch.kernel_log import KernelLogParser

pytestmark = pytest.mark.real_daemon

#: Clears the screen, sets the terminal title, rings the bell, then reverses what follows.
HOSTILE = "\x1b[2J\x1b]0;pwned\x07ev\u202eil\nNVRM"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def test_printable_escapes_controls_and_format_characters_and_nothing_else() -> None:
    assert printable(HOSTILE) == "\\x1b[2J\\x1b]0;pwned\\x07ev\\u202eil\\x0aNVRM"
    assert printable("a\nb", keep_newlines=True) == "a\nb"
    assert printable("python3 é 日本") == "python3 é 日本"
    assert printable(printable(HOSTILE)) == printable(HOSTILE)  # idempotent: escaping twice changes nothing


def test_kernel_text_is_escaped_where_it_enters() -> None:
    message = xid_line("0000:3b:00", 13, pid=4242, process="\x1b]0;x\x07py\u202e", text="Graphics \x1b[31mred")
    (event,) = KernelLogParser().feed_record(message, 1.0)
    assert event.process == "\\x1b]0;x\\x07py\\u202e"
    assert event.text == "Graphics \\x1b[31mred"
    assert not RAW.search(event.raw)


def test_a_process_name_from_proc_is_escaped(tmp_path: Path) -> None:
    fake_proc(tmp_path, 77, "0::/system.slice/x.service\n", "\x1b[2Jtop")
    assert command_of_pid(77, HostPaths.at(tmp_path)) == "\\x1b[2Jtop"


def test_status_events_and_plan_text_show_escapes_not_raw_controls() -> None:
    snap = node_snapshot()
    snap = replace(
        snap,
        recent_events=(
            make_event(EventKind.XID, 1, message=f"Xid 13 by {HOSTILE}", timestamp_seconds=snap.timestamp_seconds),
        ),
        reboot_recommended=f"reason {HOSTILE}",
    )
    for colour in (False, True):
        text = status_text(snapshot_document(snap, source="daemon"), now=snap.timestamp_seconds, colour=colour)
        assert "Xid 13 by \\x1b[2J" in text
        assert not RAW.search(re.sub("\x1b\\[[0-9;]*m", "", text)), "only the screen's own colours are escapes"
    event = make_event(EventKind.XID, 1, message=f"Xid 13 by {HOSTILE}")
    history = history_text([StoredEvent(event, True)], [])
    assert len(history.splitlines()) == 1 and not RAW.search(history)
    plan = NodePlan(
        Mode.OBSERVE,
        (ItemPlan("nouveau", None, PlanStatus.ERROR, "blacklisted", "unreadable", f"cannot read {HOSTILE}"),),
        {},
        {},
    )
    assert not RAW.search(plan_text(plan))


def test_log_lines_and_metric_labels_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        log_destinations.configure_logging("info", "console")
        structlog.get_logger("test").warning(f"Xid 13 by {HOSTILE}", process=HOSTILE)
    finally:
        log_destinations.configure_cli_logging()
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "\\x1b]0;pwned" in err and not RAW.search(err)
    families = Families()
    families.gauge("gpu_agent_gpu_info", "help", {"name": HOSTILE}, 1.0, family="gpu")
    (family,) = list(families)
    assert family.samples[0].labels == {"name": "\\x1b[2J\\x1b]0;pwned\\x07ev\\u202eil\\x0aNVRM"}


def test_a_hostile_process_name_in_the_kernel_log_reaches_no_terminal_raw(tmp_path: Path) -> None:
    with running_agent(tmp_path, mode="observe") as agent:
        agent.notifications.wait_for("READY", "1")
        bus = agent.status()["gpus"][0]["pci_bus_id"]
        append_kmsg(HostPaths.at(agent.host_root), xid_line(bus, 13, pid=4242, process="\x1b[2J\x1b]0;pwned\x07"))
        wait_until(lambda: agent.status()["recent_events"], 15, "the Xid event")
        for command in (["status"], ["events"]):
            done = subprocess.run(
                [sys.executable, "-m", "agent.cli", *command, "--config", str(agent.config_path)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert "pwned" in done.stdout, done.stdout
            assert not RAW.search(done.stdout), done.stdout
        logged = [json.loads(line) for line in agent.log().splitlines()]
        assert any("\\x1b]0;pwned" in json.dumps(line) for line in logged)
