"""The daemon, as a real process on a simulated H200 node, with a real stand-in sglang server on
GPU 0: its latency, queue and GPU memory reach /metrics and status (and `status --direct` reads
what one scrape gives), a thermal slowdown injected into GPU 0 becomes a service_latency_regression
event that names GPU 0 and thermal slowdown, and a reload that changes the services scrapes the
new ones."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DEFAULT_POLICY, running_agent
from helpers import wait_until

from agent.backend.sim import SimulatedBackend
from agent.demo.standin_process import StandinServer, free_port
from agent.textview import status_text

pytestmark = pytest.mark.real_daemon

SERVICE = """\
services:
  - name: sglang
    manager: command
    start_command: [/bin/true]
    stop_command: [/bin/true]
    health_url: "http://127.0.0.1:{port}/health"
    gpus: [0]
    slo: {{e2e_p95_seconds: 1.5, min_requests: 5}}
"""


def direct_status(config_path: Path) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "status", "--direct", "--json", "--config", str(config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def metric_value(metrics: str, prefix: str) -> float:
    (line,) = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(line.rsplit(" ", 1)[1])


def test_the_daemon_exports_server_latency_and_names_a_thermal_cause(tmp_path: Path) -> None:
    port = free_port()
    state_dir = tmp_path / "state"
    args = ("--flavor", "sglang", "--sim-state-dir", str(state_dir), "--sim-profile", "h200x2", "--gpus", "0")
    policy = DEFAULT_POLICY + SERVICE.format(port=port)
    with (
        StandinServer(tmp_path, port=port, extra_args=args),
        running_agent(tmp_path, mode="observe", profile="h200x2", policy=policy) as agent,
    ):
        agent.notifications.wait_for("READY", "1")
        deadline = time.monotonic() + 30
        metrics = ""
        e2e_count = 'gpu_agent_service_request_duration_seconds_count{kind="e2e",service="sglang"}'
        while time.monotonic() < deadline:
            metrics = agent.metrics()
            if e2e_count in metrics and "gpu_agent_service_gpu_memory_bytes" in metrics:
                break
            time.sleep(0.2)
        # the server's histograms as counter histograms, end to end and to the first token by default
        assert 'gpu_agent_service_request_duration_seconds_bucket{kind="e2e",le="+Inf",service="sglang"}' in metrics
        assert 'gpu_agent_service_request_duration_seconds_bucket{kind="ttft",le="+Inf",service="sglang"}' in metrics
        assert 'kind="queue"' not in metrics  # service_latency_detail: off by default
        assert 'gpu_agent_service_requests_running{service="sglang"}' in metrics
        assert 'gpu_agent_service_gpu_memory_bytes{gpu="0",service="sglang"' in metrics
        # tokens per joule, as PromQL takes it: the increase of the generated-token counter over that of
        # the energy counter of the service's GPUs (GPU 0, its only one). The joules of GPU 0 over a
        # stretch are its watts times the seconds (its power is steady); the counter is read on the
        # slow tier, so the stretch spans a few readings.
        energy = 'gpu_agent_service_gpu_energy_joules_total{service="sglang"}'
        wait_until(lambda: metric_value(agent.metrics(), energy) > 0, timeout_seconds=60, what="the service's joules")
        first = agent.metrics()
        started = time.monotonic()
        time.sleep(6.0)
        last = agent.metrics()
        seconds = time.monotonic() - started
        joules = metric_value(last, energy) - metric_value(first, energy)
        assert joules / seconds == pytest.approx(metric_value(last, 'gpu_agent_gpu_power_usage_watts{gpu="0"'), rel=0.3)
        tokens = 'gpu_agent_service_generated_tokens_total{service="sglang"}'
        assert metric_value(last, tokens) > metric_value(first, tokens) > 0
        # the window's tokens per joule in status needs two of its scrapes inside the energy readings
        wait_until(
            lambda: agent.status()["services"][0]["metrics"]["tokens_per_joule"] is not None,
            timeout_seconds=90,
            what="tokens per joule in status",
        )
        document = agent.status()
        (service,) = document["services"]
        assert service["metrics"]["kind"] == "sglang"
        assert service["metrics"]["latency_seconds"]["e2e"]["0.95"] < 1.5
        assert service["metrics"]["latency_seconds"]["queue"]["0.95"] is not None
        assert service["metrics"]["tokens_per_joule"] > 0
        assert document["unattributed_gpu_processes"] == []
        assert "\nservice sglang: up\n  sglang: p95 e2e " in status_text(document)  # a command service: no unit

        # Without the daemon's help: one scrape gives the gauges (quantiles need two, a window apart).
        direct = direct_status(agent.config_path)
        (listed,) = direct["services"]
        # a one-off read probes nothing: the service is as the daemon's probes declared it (node memory)
        assert (listed["name"], listed["up"]) == ("sglang", True)
        assert listed["metrics"]["kind"] == "sglang" and listed["metrics"]["requests_running"] is not None
        assert listed["metrics"]["latency_seconds"] == {}
        assert direct["unattributed_gpu_processes"] == []

        SimulatedBackend("h200x2", state_dir).set_temperature(0, 92)
        regression = None
        deadline = time.monotonic() + 40
        while regression is None and time.monotonic() < deadline:
            events = agent.status()["recent_events"]
            regression = next((e for e in events if e["kind"] == "service_latency_regression"), None)
            time.sleep(0.3)
        assert regression is not None, agent.log()[-3000:]

        # A reload that renames the service: the scrape threads are rebuilt for the new services.
        agent.config_path.write_text(agent.config_path.read_text().replace("name: sglang", "name: llm"))
        agent.signal(signal.SIGHUP)
        wait_until(
            lambda: 'gpu_agent_service_requests_running{service="llm"}' in agent.metrics(),
            timeout_seconds=20,
            what="the renamed service's figures",
        )
        assert 'service="sglang"' not in agent.metrics()
    assert regression["gpu"] == 0
    assert regression["data"]["cause"] == "thermal_slowdown"
    assert "likely cause: GPU 0 thermal slowdown" in regression["message"]
