"""Remediation interrupted by kill -9 and SIGTERM, through real agent processes and a real
`manager: command` service (agent.demo.standin behind shell scripts that log every start and stop).

What is checked comes from the service's own log, never from the store the agent writes: how many
restarts really happened under the caps, and that a service an interrupted action stopped is
running again once the agent is back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from daemon_harness import RunningAgent, running_agent
from helpers import wait_until

from agent.backend.sim import SimulatedBackend
from agent.demo import standin
from agent.demo.standin_process import free_port

pytestmark = pytest.mark.real_daemon

POLICY = "  gpus: []\n"
RESTART_RULE = """rules:
  - name: restart-unhealthy
    match: {service_unhealthy: {probes: 3}}
    actions: [restart_service]
    cooldown_seconds: 300
    max_attempts: 3
    window_seconds: 3600
"""
RESET_RULE = """rules:
  - name: reset-on-xid-48
    match: {xid: {codes: [48]}}
    actions: [reset_gpu]
    cooldown_seconds: 300
    max_attempts: 3
    window_seconds: 3600
"""


class Service:
    """The stand-in server behind start/stop scripts that append `start`, `stop`, `stopped` to a log.
    `stop_sleep_seconds`: the stop command lingers after the server is gone (a slow drain), which is
    where a kill -9 of the agent lands mid-restart."""

    def __init__(self, tmp_path: Path, stop_sleep_seconds: float = 0.0, drain_seconds: float | None = None) -> None:
        self.port = free_port()
        self.log = tmp_path / "service-calls.log"
        self.pid_file = tmp_path / "standin.pid"
        python, server = sys.executable, standin.__file__
        self.start_script = tmp_path / "start.sh"
        # With a drain: a hook that logs `drain` and takes the stand-in out of traffic, whose running
        # requests then take `drain_seconds` to finish.
        self.drain_file = tmp_path / "drain-file"
        self.drain_hook = tmp_path / "drain.sh"
        self.drain_seconds = drain_seconds
        draining = "" if drain_seconds is None else f" --drain-file {self.drain_file} --drain-seconds {drain_seconds}"
        self.start_script.write_text(
            f"#!/bin/sh\necho start >> {self.log}\n"
            f"exec {python} {server} --daemon --port {self.port} --pid-file {self.pid_file}{draining}\n"
        )
        self.drain_hook.write_text(f"#!/bin/sh\necho drain >> {self.log}\ntouch {self.drain_file}\n")
        # exit 0 while the stand-in runs: recovery can tell a drained service still runs
        self.status_script = tmp_path / "status.sh"
        self.status_script.write_text(f'#!/bin/sh\nkill -0 "$(cat {self.pid_file})" 2>/dev/null\n')
        self.stop_script = tmp_path / "stop.sh"
        self.stop_script.write_text(
            f"#!/bin/sh\necho stop >> {self.log}\n{python} {server} --stop --pid-file {self.pid_file}\n"
            f"echo stopped >> {self.log}\nsleep {stop_sleep_seconds}\n"
        )
        for script in (self.start_script, self.stop_script, self.drain_hook, self.status_script):
            os.chmod(script, 0o755)

    def config(self) -> str:
        return (
            f"services:\n  - name: sglang\n    manager: command\n    gpus: [0]\n"
            f"    health_url: http://127.0.0.1:{self.port}/health\n"
            f"    start_command: [{self.start_script}]\n    stop_command: [{self.stop_script}]\n"
            "    probe_interval_seconds: 0.2\n    probe_timeout_seconds: 1\n    unhealthy_after_probes: 3\n"
            "    ready_timeout_seconds: 20\n"
            + (
                ""
                if self.drain_seconds is None
                else f"    drain: {{hook: [{self.drain_hook}], timeout_seconds: 120}}\n"
                f"    status_command: [{self.status_script}]\n"
            )
        )

    def start(self) -> None:
        subprocess.run([self.start_script], check=True, timeout=30)
        self.log.write_text("")  # the test's own start is not the agent's

    def calls(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def pid(self) -> int:
        pid = standin.read_pid(self.pid_file)
        assert pid is not None, "the stand-in has no pid file"
        return pid

    def running(self) -> bool:
        pid = standin.read_pid(self.pid_file)
        return pid is not None and standin.running(pid)

    def stop(self) -> None:
        subprocess.run([sys.executable, standin.__file__, "--stop", "--pid-file", str(self.pid_file)], timeout=30)

    def __enter__(self) -> Service:
        """Started by the test itself; stopped on the way out, whatever the agent left."""
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def write_rules(tmp_path: Path, text: str) -> Path:
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755, exist_ok=True)
    (rules / "10-test.yaml").write_text(text)
    os.chmod(rules / "10-test.yaml", 0o644)
    return rules


@contextmanager
def ready_agent(tmp_path: Path, rules: Path, service: Service) -> Iterator[RunningAgent]:
    """An agent process with `rules` that manages `service`, once it has said READY=1."""
    with running_agent(tmp_path, rules_dir=rules, policy=POLICY + service.config()) as agent:
        agent.notifications.wait_for("READY", "1")
        yield agent


def remediations(tmp_path: Path) -> list[dict[str, object]]:
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.cli",
            "events",
            "--json",
            "--since",
            "1h",
            "--config",
            str(tmp_path / "agent.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    rows: list[dict[str, object]] = json.loads(listed.stdout)["remediations"]
    return rows


def service_up(agent: RunningAgent) -> bool:
    return agent.status()["services"][0]["up"] is True


def test_five_kill_9_mid_restart_under_cooldown_300_and_max_3(tmp_path: Path) -> None:
    rules = write_rules(tmp_path, RESTART_RULE)
    with Service(tmp_path, stop_sleep_seconds=30) as service:
        for round_number in range(5):
            with ready_agent(tmp_path, rules, service) as agent:
                # a service the previous round left stopped is started again by recovery
                wait_until(service.running, 30, f"the service running in round {round_number}")
                os.kill(service.pid(), signal.SIGHUP)  # healthy again (the last round made it answer 503)
                wait_until(lambda: service_up(agent), 30, f"the service up in round {round_number}")
                os.kill(service.pid(), signal.SIGUSR1)  # it answers 503 from now on
                if round_number == 0:
                    wait_until(lambda: "stopped" in service.calls(), 20, "the restart under way")
                else:
                    wait_until(lambda: not service_up(agent), 10, "the service seen unhealthy")
                    time.sleep(2.0)  # ten loops: ample for a decision, were the cooldown forgotten
                agent.process.kill()  # mid-restart in round 0: the stop command is still lingering
                agent.process.wait(timeout=10)
        calls = service.calls()
        assert calls.count("stop") == 1, f"cooldown 300 s allows one restart in this test, got {calls}"
        assert calls.count("stop") <= 3
        # the restart cut short in round 0 was rolled back by the next start: the service runs
        assert calls == ["stop", "stopped", "start"], calls
        assert service.running()
        interrupted = [r for r in remediations(tmp_path) if r["outcome"] == "interrupted"]
        assert len(interrupted) == 1 and "started sglang again" in str(interrupted[0]["detail"])
        assert "last step: restarting sglang" in str(interrupted[0]["detail"])


def hold_gpu_0(tmp_path: Path) -> SimulatedBackend:
    """A process that is not the service keeps GPU 0 busy, so the reset waits for it to drain."""
    backend = SimulatedBackend("h200x2", tmp_path / "state")
    backend.init()
    backend.set_processes(0, [os.getpid()])
    return backend


def inject_xid_48(agent: RunningAgent) -> None:
    injected = subprocess.run(
        [sys.executable, "-m", "agent.cli", "inject", "xid", "48", "--gpu", "0", "--config", str(agent.config_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert injected.returncode == 0, injected.stderr


def reset_draining(tmp_path: Path, agent: RunningAgent, service: Service) -> None:
    """Another process holds GPU 0 and Xid 48 arrives: the reset stops the service, then waits for
    GPU 0 to drain."""
    hold_gpu_0(tmp_path)
    wait_until(lambda: service_up(agent), 20, "the service up")
    inject_xid_48(agent)
    wait_until(lambda: "stopped" in service.calls(), 20, "the reset's services stopped")


def test_sigterm_while_a_reset_drains_starts_the_services_again_and_says_so(tmp_path: Path) -> None:
    rules = write_rules(tmp_path, RESET_RULE)
    with Service(tmp_path) as service:
        with ready_agent(tmp_path, rules, service) as agent:
            reset_draining(tmp_path, agent, service)
            time.sleep(1.0)  # now waiting for GPU 0 to drain
            asked = time.monotonic()
            agent.signal(signal.SIGTERM)
            assert agent.process.wait(timeout=30) == 0
            assert time.monotonic() - asked < 25, "stop gives a running action a bounded time"
            assert "action finished" in agent.log()
        assert service.calls() == ["stop", "stopped", "start"], service.calls()
        assert service.running()
        (reset,) = [r for r in remediations(tmp_path) if r["rule"] == "reset-on-xid-48"]
        assert reset["outcome"] == "interrupted" and "abandoned" in str(reset["detail"])
        assert reset["counted"]


def test_kill_9_while_a_reset_drains_is_rolled_back_by_the_next_start(tmp_path: Path) -> None:
    rules = write_rules(tmp_path, RESET_RULE)
    with Service(tmp_path) as service:
        with ready_agent(tmp_path, rules, service) as agent:
            reset_draining(tmp_path, agent, service)

            def journaled_stopped() -> bool:
                rows = [r for r in remediations(tmp_path) if r["rule"] == "reset-on-xid-48"]
                return bool(rows) and "stopped sglang" in str(rows[0]["detail"])

            wait_until(journaled_stopped, 20, "the stop journaled")  # now waiting for GPU 0 to drain
            agent.process.kill()
            agent.process.wait(timeout=10)
        assert not service.running(), "nothing ran in the killed agent: the service is still stopped"
        with ready_agent(tmp_path, rules, service) as agent:
            wait_until(lambda: service.running(), 30, "the service started again by recovery")
            wait_until(lambda: service_up(agent), 20, "the service healthy")
            time.sleep(1.0)  # the fault is not handled a second time
        assert service.calls() == ["stop", "stopped", "start"], service.calls()
        (reset,) = [r for r in remediations(tmp_path) if r["rule"] == "reset-on-xid-48"]
        assert reset["outcome"] == "interrupted" and "started sglang again" in str(reset["detail"])
        assert "last step: stopped sglang" in str(reset["detail"])


def test_sigterm_mid_restart_lets_the_restart_finish_within_the_stop_bound(tmp_path: Path) -> None:
    rules = write_rules(tmp_path, RESTART_RULE)
    with Service(tmp_path, stop_sleep_seconds=3) as service:
        with ready_agent(tmp_path, rules, service) as agent:
            wait_until(lambda: service_up(agent), 20, "the service up")
            os.kill(service.pid(), signal.SIGUSR1)
            wait_until(lambda: "stopped" in service.calls(), 20, "the restart under way")
            asked = time.monotonic()
            agent.signal(signal.SIGTERM)  # while the stop command lingers
            assert agent.process.wait(timeout=30) == 0
            assert time.monotonic() - asked < 25
        assert service.calls() == ["stop", "stopped", "start"], service.calls()
        assert service.running()
        (restart,) = [r for r in remediations(tmp_path) if r["rule"] == "restart-unhealthy"]
        assert restart["outcome"] == "success", restart
        with ready_agent(tmp_path, rules, service) as agent:
            wait_until(lambda: service_up(agent), 20, "the restarted service healthy")
        assert service.calls() == ["stop", "stopped", "start"], "nothing left to roll back, nothing restarted twice"


def test_kill_9_during_a_drain_is_rolled_back_by_the_next_start(tmp_path: Path) -> None:
    """A reset drains the service first (its requests take 120 s to finish); the agent is killed
    while it waits. The service was never stopped: the next start closes the action as interrupted
    at `draining sglang`, finds the service running, says it was drained, and stops nothing."""
    rules = write_rules(tmp_path, RESET_RULE)
    with Service(tmp_path, drain_seconds=120) as service:
        with ready_agent(tmp_path, rules, service) as agent:
            wait_until(lambda: service_up(agent), 20, "the service up")
            inject_xid_48(agent)

            def journaled_draining() -> bool:
                rows = [r for r in remediations(tmp_path) if r["rule"] == "reset-on-xid-48"]
                return bool(rows) and "draining sglang" in str(rows[0]["detail"])

            wait_until(journaled_draining, 20, "the drain journaled")
            wait_until(lambda: "drain" in service.calls(), 10, "the drain hook run")
            time.sleep(1.0)  # now waiting for the running requests to finish
            agent.process.kill()
            agent.process.wait(timeout=10)
        assert service.calls() == ["drain"], "drained, never stopped"
        assert service.running()
        with ready_agent(tmp_path, rules, service) as agent:
            wait_until(lambda: service_up(agent), 20, "the service healthy")

            def closed() -> bool:
                rows = [r for r in remediations(tmp_path) if r["rule"] == "reset-on-xid-48"]
                return bool(rows) and rows[0]["outcome"] == "interrupted"

            wait_until(closed, 20, "the interrupted drain closed")
            time.sleep(1.0)  # the fault is not handled a second time
        assert service.calls() == ["drain"], service.calls()
        (reset,) = [r for r in remediations(tmp_path) if r["rule"] == "reset-on-xid-48"]
        assert "last step: draining sglang" in str(reset["detail"])
        assert "sglang already running (drained, not restarted)" in str(reset["detail"])
