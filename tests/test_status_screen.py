"""`gpu-agent status` as the operator's one screen: the verdict first, 100 columns (wider only on a
wider terminal), colour only on a terminal and never with NO_COLOR, "3m ago" times, memory used/total,
the REBOOT RECOMMENDED line, exit codes like `plan`; and observe mode's "would restart" decisions."""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import make_event
from snapshots import node_snapshot

from agent.config import AgentConfig, Mode
from agent.daemon.publisher import Publisher, systemd_status_line
from agent.daemon.remediator import Remediator
from agent.daemon.sd_notify import SdNotifier
from agent.documents import snapshot_document
from agent.events import EventKind
from agent.rules.model import ActionKind, ActionSpec, Decision, Target
from agent.rules.params import RestartServiceParams
from agent.state import RecentRemediation
from agent.store.database import Store
from agent.textview import (
    EXIT_ATTENTION,
    EXIT_COULD_NOT_TELL,
    EXIT_HEALTHY,
    ago,
    screen_width,
    status_exit_code,
    status_text,
    use_colour,
)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def document(**fields: Any) -> dict[str, Any]:
    return snapshot_document(node_snapshot(**fields), source="daemon")


def test_the_screen_fits_100_columns_and_says_when_things_happened() -> None:
    snap = node_snapshot()
    now = snap.timestamp_seconds
    snap = replace(
        snap,
        recent_events=(make_event(EventKind.XID, 1, message="Xid 48 " + "x" * 200, timestamp_seconds=now - 180),),
        recent_remediations=(
            RecentRemediation(
                now - 3600 * 2 - 60, "service-unhealthy", "restart_service", "service:sglang", "success", ""
            ),
        ),
        xids=tuple(replace(x, last_seen_seconds=now - 45) for x in snap.xids),
        reboot_recommended="Xid 79 on GPU 3",
    )
    text = status_text(snapshot_document(snap, source="daemon"), now=now, width=100)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100, text
    assert "REBOOT RECOMMENDED: Xid 79 on GPU 3" in lines
    assert any("3m ago" in line and "Xid 48" in line for line in lines), text
    assert any("2h01m ago" in line and "restart_service service:sglang -> success" in line for line in lines), text
    assert all("last 45s ago" in line for line in lines if line.startswith("  GPU ") and " Xid " in line)
    header = next(line for line in lines if line.startswith("GPU "))
    assert "MEMORY" in header
    row0 = next(line for line in lines if line.startswith("0 "))
    assert re.search(r"\b\d+/\d+G\b", row0), row0
    assert ANSI.search(text) is None  # no colour unless asked


def test_a_wider_terminal_gets_wider_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert screen_width() == 100  # never narrower than the 100 columns the screen is made for
    monkeypatch.setenv("COLUMNS", "180")
    assert screen_width() == 180
    long_reason = {"gpus": [{**document()["gpus"][1], "health": {"state": "unhealthy", "reason": "r" * 150}}]}
    wide = status_text({**document(), **long_reason}, width=180)
    assert max(len(line) for line in wide.splitlines()) > 100
    assert max(len(line) for line in wide.splitlines()) <= 180


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_colour(_Stream(tty=True))
    assert not use_colour(_Stream(tty=False))
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_colour(_Stream(tty=True))
    coloured = status_text(document(), colour=True)
    assert ANSI.search(coloured)
    assert ANSI.sub("", coloured) == status_text(document(), colour=False)


def test_exit_codes_like_plan() -> None:
    healthy = node_snapshot(gpus=node_snapshot().gpus[:1], health={}, policy=(), xids=(), services=())
    assert status_exit_code(snapshot_document(healthy, source="daemon")) == EXIT_HEALTHY
    assert status_exit_code(document()) == EXIT_ATTENTION  # the fixture node has unhealthy GPUs
    no_gpus = snapshot_document(replace(healthy, gpus=(), health={}), source="daemon")
    assert status_exit_code(no_gpus) == EXIT_ATTENTION
    assert no_gpus["verdict"]["problem"]["cause"] == "no_gpus"
    assert status_exit_code({"gpus": []}) == EXIT_COULD_NOT_TELL  # an answer without a verdict
    rebooting = snapshot_document(replace(healthy, reboot_recommended="Xid 79"), source="daemon")
    assert status_exit_code(rebooting) == EXIT_ATTENTION


def test_fewer_gpus_than_seen_before_is_a_problem_everywhere() -> None:
    """Node memory (agent.store.node_memory) keeps a GPU that left the bus in the daemon's snapshot, down, until
    it answers again or is acknowledged gone: the publisher expects every GPU the snapshot holds."""
    publisher = Publisher(SdNotifier(None, None))
    full = node_snapshot(health={}, policy=(), xids=())
    full = replace(full, gpus=tuple(replace(g, up=True) for g in full.gpus))
    assert publisher.publish(full).expected_gpus == len(full.gpus)
    gone = tuple(replace(g, up=False) if g.index >= 2 else g for g in full.gpus)
    fewer = publisher.publish(replace(full, gpus=gone))
    assert fewer.expected_gpus == len(full.gpus)
    line = systemd_status_line(fewer)
    assert line.startswith(f"PROBLEM: 2 of {len(full.gpus)} expected GPUs answer"), line
    verdict = snapshot_document(fewer, source="daemon")["verdict"]
    assert verdict["problem"]["cause"] == "gpus_missing" and verdict["exit_code"] == EXIT_ATTENTION


def test_ago() -> None:
    assert [ago(1000.0 - s, 1000.0) for s in (5, 180, 7260, 3 * 86400)] == ["5s ago", "3m ago", "2h01m ago", "3d ago"]
    assert ago(None, 1000.0) == "-"


def test_observe_mode_records_what_it_would_have_done(tmp_path: Path) -> None:
    """Observe mode: a restart the rules decide on is recorded as a dry run saying what the agent
    would have done (not sent to the worker to be refused), and the status screen shows it."""
    config = AgentConfig(mode=Mode.OBSERVE, state_dir=str(tmp_path / "state"))
    remediator = Remediator(config, lambda _alerts: None, lambda _gpu: None, lambda: 1000.0)
    remediator.store = Store.open(tmp_path / "state")
    try:
        event = make_event(EventKind.SERVICE_UNHEALTHY, None, timestamp_seconds=1000.0)
        spec = ActionSpec(ActionKind.RESTART_SERVICE, RestartServiceParams())
        decision = Decision("service-unhealthy", event, Target(service="sglang"), spec, 0, 1, "probe failed")
        remediator._act(decision, 1000.0)
        (recent,) = remediator.recent()
        counts = remediator.counts()
    finally:
        remediator.store.close()
    assert recent.outcome == "dry_run"
    assert recent.detail == "observe mode: would restart service sglang (rule service-unhealthy)"
    assert [(c.rule, c.outcome, c.count) for c in counts] == [("service-unhealthy", "dry_run", 1)]
    snap = replace(node_snapshot(), recent_remediations=(recent,))
    text = status_text(snapshot_document(snap, source="daemon"), now=1180.0)
    assert "  3m ago  observe mode: would restart service sglang (rule service-unhealthy)" in text
    assert (
        json.loads(json.dumps(snapshot_document(snap, source="daemon")))["recent_remediations"][0]["outcome"]
        == "dry_run"
    )


def test_a_reboot_flag_written_before_the_last_boot_is_spent(tmp_path: Path) -> None:
    import json

    from agent.host.paths import BOOT_ID_PATH, HostPaths
    from agent.rules.actions.reboot import REBOOT_FLAG_NAME
    from agent.verdict import reboot_recommended

    host = tmp_path / "host"
    (host / BOOT_ID_PATH.lstrip("/")).parent.mkdir(parents=True)
    (host / BOOT_ID_PATH.lstrip("/")).write_text("boot-b\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / REBOOT_FLAG_NAME).write_text(json.dumps({"reason": "Xid 79", "boot_id": "boot-b"}))
    assert reboot_recommended(str(state), HostPaths.at(host)) == "Xid 79"
    (state / REBOOT_FLAG_NAME).write_text(json.dumps({"reason": "Xid 79", "boot_id": "boot-a"}))
    assert reboot_recommended(str(state), HostPaths.at(host)) is None  # that reboot happened
