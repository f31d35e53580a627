"""Remediation through the real daemon: faults injected into a simulated node, actions carried out
on real processes, storm protection kept across agent restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import running_agent
from helpers import wait_until

from agent.demo import standin
from agent.demo.standin_process import free_port

pytestmark = pytest.mark.real_daemon

POLICY = "  gpus: []\n"
#: How long a test waits for the agent to do what it is asked.
WAIT_SECONDS = 15.0


def gpu_agent(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args, "--config", str(config)], capture_output=True, text=True, timeout=30
    )


def decided(log: str, rule: str) -> bool:
    """A decision of `rule` is done: its action finished, or it was suppressed."""
    for line in log.splitlines():
        record = json.loads(line)
        if record.get("rule") == rule and record["event"] in ("action finished", "action suppressed"):
            return True
    return False


def write_rules(directory: Path, text: str) -> Path:
    directory.mkdir(mode=0o755, exist_ok=True)
    (directory / "10-test.yaml").write_text(text)
    os.chmod(directory / "10-test.yaml", 0o644)
    return directory


def hook_script(tmp_path: Path) -> tuple[Path, Path]:
    record = tmp_path / "hook-calls.log"
    hook = tmp_path / "hooks" / "record.sh"
    hook.parent.mkdir(mode=0o755)
    hook.write_text(f'#!/bin/sh\necho "$GPU_AGENT_XID $GPU_AGENT_GPU_UUID" >> {record}\n')
    os.chmod(hook, 0o755)
    return hook, record


def test_ten_faults_three_attempts_across_restarts(tmp_path: Path) -> None:
    hook, record = hook_script(tmp_path)
    rules = write_rules(
        tmp_path / "rules.d",
        f"""rules:
  - name: hook-on-xid-13
    match: {{xid: {{codes: [13]}}}}
    actions:
      - run_hook: {{argv: [{hook}], timeout_seconds: 10}}
    cooldown_seconds: 0
    max_attempts: 3
    window_seconds: 3600
""",
    )
    for fault in range(10):
        # a fresh agent process for every fault: only the store in state_dir remembers
        with running_agent(tmp_path, rules_dir=rules, policy=POLICY, mode="observe") as agent:
            agent.notifications.wait_for("READY", "1")
            injected = gpu_agent(agent.config_path, "inject", "xid", "13", "--gpu", "0", "--source", "nvml")
            assert injected.returncode == 0, injected.stderr
            wait_until(lambda: decided(agent.log(), "hook-on-xid-13"), WAIT_SECONDS, f"the decision on fault {fault}")
            agent.signal(signal.SIGTERM)
            assert agent.process.wait(timeout=15) == 0
    calls = record.read_text().splitlines()
    assert len(calls) == 3, calls
    assert all(line.startswith("13 GPU-") for line in calls)
    history = json.loads(gpu_agent(tmp_path / "agent.yaml", "events", "--json", "--since", "1h").stdout)
    decisions = [r for r in history["remediations"] if r["rule"] == "hook-on-xid-13"]
    assert [r["outcome"] for r in decisions if r["counted"]] == ["success"] * 3
    assert len(decisions) == 10  # 3 actions, the circuit opening, 6 suppressed
    assert any(r["step"] == -1 for r in decisions)
    # ack re-arms the rule
    acked = gpu_agent(tmp_path / "agent.yaml", "ack", "hook-on-xid-13")
    assert "re-armed" in acked.stdout


def test_unhealthy_service_is_restarted_through_the_command_adapter(tmp_path: Path) -> None:
    port = free_port()
    pid_file = tmp_path / "standin.pid"
    start = [sys.executable, standin.__file__, "--daemon", "--port", str(port), "--pid-file", str(pid_file)]
    stop = [sys.executable, standin.__file__, "--stop", "--pid-file", str(pid_file)]
    subprocess.run(start, check=True, timeout=30)
    first_pid = int(pid_file.read_text())
    rules = write_rules(
        tmp_path / "rules.d",
        """rules:
  - name: restart-unhealthy
    match: {service_unhealthy: {probes: 3}}
    actions: [restart_service]
    cooldown_seconds: 60
    max_attempts: 3
    window_seconds: 3600
""",
    )
    services = (
        f"services:\n  - name: sglang\n    manager: command\n    health_url: http://127.0.0.1:{port}/health\n"
        f"    start_command: {json.dumps(start)}\n    stop_command: {json.dumps(stop)}\n"
        "    probe_interval_seconds: 0.2\n    probe_timeout_seconds: 1\n    unhealthy_after_probes: 3\n"
        "    ready_timeout_seconds: 20\n"
    )
    try:
        with running_agent(tmp_path, rules_dir=rules, policy=POLICY + services) as agent:
            agent.notifications.wait_for("READY", "1")
            wait_until(lambda: agent.status()["services"][0]["up"] is True, WAIT_SECONDS, "service up")
            os.kill(first_pid, signal.SIGUSR1)  # the server starts answering 503
            # between stop and start there is no pid file; read it once per look
            wait_until(lambda: standin.read_pid(pid_file) not in (None, first_pid), WAIT_SECONDS, "restart")
            wait_until(lambda: "action finished" in agent.log(), WAIT_SECONDS, "action finished")
            finished = [json.loads(line) for line in agent.log().splitlines() if '"action finished"' in line]
            assert finished[0]["outcome"] == "success" and finished[0]["service"] == "sglang"
            wait_until(lambda: agent.status()["services"][0]["up"] is True, WAIT_SECONDS, "service healthy again")
            # The snapshot that first shows the service up again can be a loop older than the
            # action's end: the count reaches status and /metrics with the next loop.
            counted = {"rule": "restart-unhealthy", "action": "restart_service", "outcome": "success", "count": 1}
            wait_until(lambda: counted in agent.status()["remediations"], WAIT_SECONDS, "the restart counted")
            assert (
                'gpu_agent_remediations_total{action="restart_service",outcome="success",rule="restart-unhealthy"} 1.0'
                in agent.metrics()
            )
    finally:
        subprocess.run(stop, timeout=30, check=False)


def test_xid_79_recommends_a_reboot_and_never_resets(tmp_path: Path) -> None:
    repo_rules = Path(__file__).parent.parent / "rules"
    rules = tmp_path / "rules.d"
    rules.mkdir(mode=0o755)
    for source in repo_rules.glob("*.yaml"):
        (rules / source.name).write_text(source.read_text())
        os.chmod(rules / source.name, 0o644)
    with running_agent(tmp_path, rules_dir=rules, policy=POLICY) as agent:
        agent.notifications.wait_for("READY", "1")
        assert gpu_agent(agent.config_path, "inject", "xid", "79", "--gpu", "1").returncode == 0
        flag = agent.state_dir / "reboot-recommended"
        wait_until(flag.exists, WAIT_SECONDS, "reboot-recommended flag")
        assert "79" in flag.read_text()
        time.sleep(0.5)
        assert '"reset_gpu"' not in agent.log()
        health = agent.status()["gpus"][1]["health"]
        assert health["state"] == "unhealthy" and health["suggested_action"] == "reboot"


def test_an_xid_is_acted_on_before_the_next_loop(tmp_path: Path) -> None:
    """Events wake the loop: with a 30 s interval the rule acts within seconds, not at the next loop
    (the bound leaves room for the inject command's own start on a loaded two-core machine)."""
    hook, record = hook_script(tmp_path)
    rules = write_rules(
        tmp_path / "rules.d",
        f"rules:\n  - name: fast\n    match: {{xid: {{codes: [31]}}}}\n    actions:\n      - run_hook: {{argv: [{hook}]}}\n",
    )
    with running_agent(tmp_path, rules_dir=rules, policy=POLICY, interval=30.0) as agent:
        agent.notifications.wait_for("READY", "1")
        injected_at = time.monotonic()
        assert gpu_agent(agent.config_path, "inject", "xid", "31", "--gpu", "0", "--source", "kmsg").returncode == 0
        wait_until(record.exists, 15, "the hook run before the next loop")
        assert time.monotonic() - injected_at < 15
        assert record.read_text().startswith("31 GPU-")


def test_another_users_app_xid_restarts_nothing_and_the_services_own_does(tmp_path: Path) -> None:
    """Any local CUDA user can make an Xid 13 on a GPU sglang uses; only sglang's own process's Xid
    restarts sglang. The process is told by the kernel log's pid, read before the rule looks."""
    port = free_port()
    pid_file = tmp_path / "standin.pid"
    start = [sys.executable, standin.__file__, "--daemon", "--port", str(port), "--pid-file", str(pid_file)]
    stop = [sys.executable, standin.__file__, "--stop", "--pid-file", str(pid_file)]
    subprocess.run(start, check=True, timeout=30)
    first_pid = int(pid_file.read_text())
    rules = write_rules(
        tmp_path / "rules.d",
        """rules:
  - name: xid-restart-service
    match: {xid: {catalog_action: restart_service}}
    actions: [restart_service]
    cooldown_seconds: 0
    max_attempts: 5
    window_seconds: 3600
""",
    )
    services = (
        f"services:\n  - name: sglang\n    manager: command\n    gpus: [0]\n"
        f"    health_url: http://127.0.0.1:{port}/health\n"
        f"    start_command: {json.dumps(start)}\n    stop_command: {json.dumps(stop)}\n"
        "    ready_timeout_seconds: 20\n"
    )
    try:
        with running_agent(tmp_path, rules_dir=rules, policy=POLICY + services) as agent:
            agent.notifications.wait_for("READY", "1")
            someone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            try:
                inject = ("inject", "xid", "13", "--gpu", "0", "--source", "kmsg", "--process", "python3")
                assert gpu_agent(agent.config_path, *inject, "--pid", str(someone.pid)).returncode == 0
                wait_until(lambda: decided(agent.log(), "xid-restart-service"), WAIT_SECONDS, "the decision")
            finally:
                someone.kill()
                someone.wait()
            suppressed = [json.loads(line) for line in agent.log().splitlines() if '"action suppressed"' in line]
            assert f"pid {someone.pid} (python3) belongs to no configured service" in suppressed[0]["reason"]
            assert standin.read_pid(pid_file) == first_pid  # not restarted
            assert gpu_agent(agent.config_path, *inject, "--gpu", "0", "--pid", str(first_pid)).returncode == 0
            wait_until(lambda: standin.read_pid(pid_file) not in (None, first_pid), WAIT_SECONDS, "restart")
            # the restart dealt with the app-level Xid: the GPU is healthy again, not degraded for an hour
            wait_until(
                lambda: agent.status()["gpus"][0]["health"]["state"] == "healthy",
                WAIT_SECONDS,
                "GPU 0 healthy once its service restarted",
            )
    finally:
        subprocess.run(stop, timeout=30, check=False)
