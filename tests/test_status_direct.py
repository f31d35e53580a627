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
