"""Fail-safe fans: however the agent ends, fans it set to a manual speed go back to automatic control.

Real `gpu-agent run` processes on the simulated RTX PRO 6000 (a fanned board) with the fan curve,
locked clocks and a power limit enforced. A normal stop (SIGTERM, SIGINT) and a bug in the loop (an
exception) are handled by the daemon itself; SIGKILL and the watchdog's SIGABRT leave nothing to run
in the process, so the unit's `ExecStopPost=gpu-agent restore` does it, and that command is run here
exactly as systemd runs it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from daemon_harness import Notifications, write_agent_config
from helpers import wait_until

from agent.backend.base import ClockDomain
from agent.backend.sim import SimulatedBackend

pytestmark = pytest.mark.real_daemon

PROFILE = "rtx-pro-6000x2"
POLICY = """\
  gpus:
    - match: {model: "NVIDIA RTX PRO 6000*"}
      power_limit_watts: 500
      locked_clocks: {gpu_mhz: [1005, 1995]}
      fan_curve: [[30, 30], [50, 65], [75, 100]]
"""
# The daemon with one bug planted: its loop raises once the trigger file exists.
BUGGY_AGENT = """\
import sys
from pathlib import Path

from agent import cli
from agent.daemon import Daemon

original = Daemon.loop_once


def loop_once(self):
    if Path(sys.argv[2]).exists():
        raise RuntimeError("a bug in the loop")
    return original(self)


Daemon.loop_once = loop_once
sys.exit(cli.main(["run", "--log-format", "json", "--config", sys.argv[1]]))
"""


class Agent:
    def __init__(self, tmp: Path, buggy: bool) -> None:
        self.config, _ = write_agent_config(tmp, profile=PROFILE, policy=POLICY)
        self.state_dir = tmp / "state"
        self.trigger = tmp / "raise-now"
        notify = tmp / "notify.sock"
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(str(notify))
        self.notifications = Notifications(self.socket)
        env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "WATCHDOG_PID", "WATCHDOG_USEC")}
        env["NOTIFY_SOCKET"] = str(notify)
        env["PYTHONFAULTHANDLER"] = "1"  # as the unit sets it
        argv = (
            [sys.executable, "-c", BUGGY_AGENT, str(self.config), str(self.trigger)]
            if buggy
            else [sys.executable, "-m", "agent.cli", "run", "--log-format", "json", "--config", str(self.config)]
        )
        self.log_path = tmp / "agent.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)

    def log(self) -> str:
        return self.log_path.read_text()

    def restore(self) -> subprocess.CompletedProcess[str]:
        """What ExecStopPost runs after every stop."""
        return subprocess.run(
            [sys.executable, "-m", "agent.cli", "restore", "--config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=60,
        )


@contextmanager
def agent(tmp: Path, buggy: bool = False) -> Iterator[Agent]:
    running = Agent(tmp, buggy)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait()
        running.socket.close()


def gpus(state_dir: Path) -> SimulatedBackend:
    backend = SimulatedBackend(PROFILE, state_dir)
    backend.init()
    return backend


def fan_modes(backend: SimulatedBackend) -> list[bool]:
    backend.reload()
    return [backend.fan_manual(gpu, fan) for gpu in (0, 1) for fan in range(backend.fan_count(gpu))]


def wait_enforced(running: Agent) -> SimulatedBackend:
    running.notifications.wait_for("READY", "1")
    backend = gpus(running.state_dir)

    def enforced() -> bool:
        assert running.process.poll() is None, running.log()
        return all(fan_modes(backend)) and backend.locked_clocks_mhz(1, ClockDomain.GRAPHICS) is not None

    wait_until(enforced, 15, "the policy enforced", poll_seconds=0.05)
    assert backend.power_limit_watts(0) == 500.0
    return backend


def assert_defaults(backend: SimulatedBackend) -> None:
    backend.reload()
    assert fan_modes(backend) == [False] * 4
    for gpu in (0, 1):
        assert backend.locked_clocks_mhz(gpu, ClockDomain.GRAPHICS) is None
        assert backend.power_limit_watts(gpu) == backend.default_power_limit_watts(gpu)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_normal_stop_returns_the_fans_before_exiting(tmp_path: Path, signum: int) -> None:
    with agent(tmp_path) as running:
        backend = wait_enforced(running)
        running.process.send_signal(signum)
        assert running.process.wait(timeout=15) == 0
        assert fan_modes(backend) == [False] * 4, "the daemon itself put the fans back"
        running.notifications.poll(0.2)
        assert running.notifications.times("STOPPING")
        # clocks and power are ExecStopPost's part
        restored = running.restore()
        assert restored.returncode == 0, restored.stdout + restored.stderr
        assert_defaults(backend)


def test_an_exception_in_the_loop_returns_the_fans_and_fails_the_unit(tmp_path: Path) -> None:
    with agent(tmp_path, buggy=True) as running:
        backend = wait_enforced(running)
        running.trigger.touch()
        code = running.process.wait(timeout=15)
        assert code != 0, "a crash must fail the unit, so Restart=on-failure brings the agent back"
        assert "RuntimeError: a bug in the loop" in running.log()
        assert fan_modes(backend) == [False] * 4, "fans back to automatic on the way out of a crash"
        assert "fans restored to automatic" in running.log()
        restored = running.restore()
        assert restored.returncode == 0, restored.stdout + restored.stderr
        assert_defaults(backend)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGABRT], ids=["SIGKILL", "SIGABRT"])
def test_a_killed_agent_is_cleaned_up_by_exec_stop_post(tmp_path: Path, signum: int) -> None:
    """SIGKILL (systemctl kill, the OOM killer) and SIGABRT (the watchdog) leave no chance to clean up."""
    with agent(tmp_path) as running:
        backend = wait_enforced(running)
        running.process.send_signal(signum)
        assert running.process.wait(timeout=15) == -signum
        assert all(fan_modes(backend)), "nothing ran in the killed process: the fans are still manual"
        if signum == signal.SIGABRT:
            assert "Fatal Python error: Aborted" in running.log()  # the stacks, for the post-mortem
        restored = running.restore()
        assert restored.returncode == 0, restored.stdout + restored.stderr
        assert "back to automatic" in restored.stdout
        assert_defaults(backend)
        # a second run (a restart that failed again) is harmless
        again = running.restore()
        assert again.returncode == 0 and "back to automatic" not in again.stdout


# -- whatever stops driving the fans hands them back ------------------------------------------------

RELOADS = {
    "enforce-to-observe": lambda text: text.replace("mode: enforce", "mode: observe"),
    "fan_curve-observe": lambda text: text.replace("policy:\n", "policy:\n  modes: {fan_curve: observe}\n"),
    "curve-removed": lambda text: text.replace("      fan_curve: [[30, 30], [50, 65], [75, 100]]\n", ""),
}


@pytest.mark.parametrize("change", sorted(RELOADS))
def test_a_reload_that_stops_driving_the_fans_hands_them_back(tmp_path: Path, change: str) -> None:
    with agent(tmp_path) as running:
        backend = wait_enforced(running)
        edited = RELOADS[change](running.config.read_text())
        assert edited != running.config.read_text()
        running.config.write_text(edited)
        running.process.send_signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in running.log(), 10, "the reload")
        wait_until(lambda: fan_modes(backend) == [False] * 4, 10, "fans automatic after the reload", poll_seconds=0.05)
        # and they stay automatic: the reloaded daemon does not take them again (the loop runs every 0.2 s)
        running.notifications.poll(1.0)
        assert fan_modes(backend) == [False] * 4
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=15) == 0
        assert fan_modes(backend) == [False] * 4


INVALID_CONFIGS = {
    "bad-value": lambda text: text.replace("mode: enforce", "mode: enforce-please"),
    "unparseable": lambda text: text + "\n  - [unclosed\n",
}


@pytest.mark.parametrize("damage", sorted(INVALID_CONFIGS))
def test_restore_after_kill_works_with_an_invalid_config_on_disk(tmp_path: Path, damage: str) -> None:
    with agent(tmp_path) as running:
        backend = wait_enforced(running)
        running.process.kill()
        running.process.wait(timeout=15)
        assert all(fan_modes(backend))
        running.config.write_text(INVALID_CONFIGS[damage](running.config.read_text()))
        restored = running.restore()
        assert restored.returncode == 0, restored.stdout + restored.stderr
        assert "config is not valid" in restored.stderr and "known-good.json" in restored.stderr
        backend.reload()
        assert fan_modes(backend) == [False] * 4
        assert all(backend.locked_clocks_mhz(gpu, ClockDomain.GRAPHICS) is None for gpu in (0, 1))


def test_restore_hands_back_fans_a_killed_daemon_drove_even_after_an_edit_to_observe(tmp_path: Path) -> None:
    with agent(tmp_path) as running:
        backend = wait_enforced(running)
        running.process.kill()
        running.process.wait(timeout=15)
        running.config.write_text(running.config.read_text().replace("mode: enforce", "mode: observe"))
        restored = running.restore()
        assert restored.returncode == 0, restored.stdout + restored.stderr
        assert fan_modes(backend) == [False] * 4


def apply_once(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "apply", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_one_shot_apply_without_a_daemon_hands_the_fans_back(tmp_path: Path) -> None:
    config, _ = write_agent_config(tmp_path, profile=PROFILE, policy=POLICY)
    applied = apply_once(config)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "no gpu-agent daemon answers" in applied.stderr
    backend = gpus(tmp_path / "state")
    assert fan_modes(backend) == [False] * 4, "nothing follows the curve: fans must not stay at a fixed speed"
    assert backend.power_limit_watts(0) == 500.0  # the rest of the policy was applied


def test_a_one_shot_apply_beside_a_running_daemon_leaves_the_fans_to_it(tmp_path: Path) -> None:
    with agent(tmp_path) as running:
        backend = wait_enforced(running)
        applied = apply_once(running.config)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "no gpu-agent daemon answers" not in applied.stderr
        assert all(fan_modes(backend))
