"""`gpu-agent status --direct` and the daemon judge a node alike: both build their snapshot with the
same builder and the same watchers, so a fault gives the same verdict whichever answers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import RunningAgent, running_agent

from agent.backend.base import RecoveryAction
from agent.backend.sim import SimulatedBackend
from agent.demo.inject import REASON_BITS

pytestmark = pytest.mark.real_daemon


def _thermal_slowdown(gpus: SimulatedBackend) -> None:
    gpus.set_clock_event_reasons(0, REASON_BITS["hw_thermal_slowdown"])


def _lost_gpu(gpus: SimulatedBackend) -> None:
    gpus.set_lost(1)


def _row_remap_pending(gpus: SimulatedBackend) -> None:
    gpus.set_remapped_rows(0, uncorrectable=1, pending=True)


def _reboot_asked(gpus: SimulatedBackend) -> None:
    gpus.set_recovery_action(1, RecoveryAction.NODE_REBOOT)


#: fault -> (inject it, the GPU it hits, before the daemon starts?). Slow-tier readings (row remapping,
#: the recovery action) are read at start and then every 30 s: those faults are there from the start.
#: A GPU lost before the first enumeration is never known to the daemon: that one comes later.
FAULTS: dict[str, tuple[Callable[[SimulatedBackend], None], int, bool]] = {
    "thermal slowdown": (_thermal_slowdown, 0, False),
    "lost GPU": (_lost_gpu, 1, False),
    "row remap pending": (_row_remap_pending, 0, True),
    "driver asks for a reboot": (_reboot_asked, 1, True),
}


def _health(document: dict[str, Any]) -> dict[int, Any]:
    return {gpu["index"]: gpu["health"] for gpu in document["gpus"]}


def _direct(agent: RunningAgent) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "status", "--direct", "--json", "--config", str(agent.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr  # a GPU not healthy: attention needed
    return dict(json.loads(result.stdout))


@pytest.mark.parametrize("fault", FAULTS)
def test_daemon_and_direct_read_give_the_same_verdict(tmp_path: Path, fault: str) -> None:
    inject, gpu, at_start = FAULTS[fault]
    gpus = SimulatedBackend("h200x2", tmp_path / "state")  # the node the daemon will run on
    gpus.init()
    if at_start:
        inject(gpus)
    with running_agent(tmp_path, mode="observe") as agent:
        agent.notifications.wait_for("READY", "1")
        if not at_start:
            inject(gpus)
        deadline = time.monotonic() + 20
        while _health(daemon := agent.status())[gpu]["state"] == "healthy":
            assert time.monotonic() < deadline, f"the daemon never saw the {fault}"
            time.sleep(0.1)
        direct = _direct(agent)
    assert daemon["source"] == "daemon" and direct["source"] == "direct"
    assert _health(direct) == _health(daemon)
    assert _health(direct)[gpu]["state"] != "healthy"
    assert direct["verdict"]["exit_code"] == daemon["verdict"]["exit_code"] == 2
    assert direct["note"] == "direct read (--direct)"


def _cli(agent: RunningAgent, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args, "--config", str(agent.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


SERVICE_DOWN = """\
services:
  - name: sglang
    manager: command
    start_command: [/bin/true]
    stop_command: [/bin/true]
    health_url: "http://127.0.0.1:{port}/health"
    probe_interval_seconds: 0.2
    unhealthy_after_probes: 2
    metrics_url: false
"""


def test_the_direct_read_takes_the_daemons_node_memory(tmp_path: Path) -> None:
    """An Xid is an event: once it has happened, no reading shows it. The daemon keeps it (and the
    services its probes declared down) in the store's node memory; the direct read reads that memory,
    read-only, and reaches the daemon's verdict, while the daemon runs and after it stopped."""
    from daemon_harness import DEFAULT_POLICY, free_port

    policy = DEFAULT_POLICY + SERVICE_DOWN.format(port=free_port())
    with running_agent(tmp_path, mode="observe", policy=policy) as agent:
        agent.notifications.wait_for("READY", "1")
        injected = _cli(agent, "inject", "xid", "13", "--gpu", "1")
        assert injected.returncode == 0, injected.stderr
        deadline = time.monotonic() + 20
        while not {"gpu_health", "service_down"} <= set((daemon := agent.status())["verdict"]["causes"]):
            assert time.monotonic() < deadline, daemon["verdict"]
            time.sleep(0.2)
        time.sleep(1.0)  # the loop after: the node memory is saved
        while_running = _direct(agent)
    after_stop = _direct(agent)
    database = agent.state_dir / "gpu-agent.db"
    before = database.read_bytes()
    for direct in (while_running, after_stop):
        assert _health(direct) == _health(daemon)
        assert _health(direct)[1]["state"] == "degraded" and "Xid 13" in _health(direct)[1]["reason"]
        assert [(x["gpu"], x["xid"]) for x in direct["xids"]] == [(1, 13)]
        assert direct["verdict"]["causes"] == daemon["verdict"]["causes"] == ["gpu_health", "service_down"]
        (service,) = direct["services"]
        assert service["up"] is False
    assert _direct(agent) and database.read_bytes() == before  # read-only: nothing written


def test_a_direct_read_without_any_store_is_a_fresh_node(tmp_path: Path) -> None:
    """No daemon ever ran: no store is created by looking."""
    from daemon_harness import write_agent_config

    config, _ = write_agent_config(tmp_path, mode="observe")
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "status", "--direct", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["xids"] == []
    assert not (tmp_path / "state" / "gpu-agent.db").exists()


def test_ack_marks_an_xid_dealt_with_for_the_daemon_and_the_direct_read(tmp_path: Path) -> None:
    """`ack xid:13@1` takes that Xid out of the verdict, `ack gpu:0` every Xid of GPU 0, saying so;
    the counts stay. The running daemon follows at its next loop; a direct read does too."""
    with running_agent(tmp_path, mode="observe") as agent:
        agent.notifications.wait_for("READY", "1")
        for gpu, code in ((1, "13"), (1, "31"), (0, "43")):
            assert _cli(agent, "inject", "xid", code, "--gpu", str(gpu)).returncode == 0
        deadline = time.monotonic() + 20
        while {g["index"]: g["health"]["state"] for g in agent.status()["gpus"]} != {0: "degraded", 1: "degraded"}:
            assert time.monotonic() < deadline, agent.status()["gpus"]
            time.sleep(0.2)
        time.sleep(1.0)  # saved to the node memory

        one = _cli(agent, "ack", "xid:13@1")
        assert one.returncode == 0, one.stderr
        assert one.stdout == (
            "xid:13@1: Xid 13 on GPU 1 marked dealt with: no longer in the verdict (the counts stay in status and"
            " /metrics)\n"
        )
        time.sleep(1.0)
        assert "Xid 31" in _health(agent.status())[1]["reason"]  # the other Xid on GPU 1 stays
        assert "Xid 13" not in _health(agent.status())[1]["reason"]

        both = _cli(agent, "ack", "gpu:1")
        assert both.returncode == 0 and both.stdout.startswith("gpu:1: Xid 31 on GPU 1 marked dealt with"), both
        deadline = time.monotonic() + 10
        while _health(daemon := agent.status())[1]["state"] != "healthy":
            assert time.monotonic() < deadline, daemon["gpus"]
            time.sleep(0.2)
        assert _health(daemon)[0]["state"] == "degraded"  # GPU 0's Xid was not acknowledged
        assert {(x["gpu"], x["xid"]) for x in daemon["xids"]} == {(0, 43), (1, 13), (1, 31)}  # counts stay
        direct = _direct(agent)
        assert _health(direct) == _health(daemon)

        nothing = _cli(agent, "ack", "xid:13@1")
        assert nothing.returncode == 1 and "nothing to acknowledge" in nothing.stderr
