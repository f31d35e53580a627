"""The advisor's last sweeps in /metrics (agent/metrics/tune.py): one series per step and kind,
bounded by the sweep, and one PromQL query over a real Prometheus scraping three nodes answers
"the best power limit per GPU model across the fleet"."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from snapshots import h200_snapshot
from test_dashboard_prometheus import PROMETHEUS, Prometheus

from agent.metrics.collector import SnapshotCollector
from agent.metrics.server import MetricsServer
from agent.state import NodeSnapshot, TuneResult, TuneStepFigures

FLEET_BEST_LIMIT = 'topk by (gpu_model) (1, count by (gpu_model, setting) (gpu_agent_tune_recommended{kind="power"}))'


def sweep(service: str, model: str, recommended: float | None, *settings: float, kind: str = "power") -> TuneResult:
    steps = tuple(TuneStepFigures(s, 1000 / s, 900 - s / 10, 0.5 + 100 / s) for s in settings)
    return TuneResult(service, kind, model, 1_700_000_000.0, steps, recommended)


def render(snapshot: NodeSnapshot) -> str:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snapshot, version="1.0", revision="abc"))
    return generate_latest(registry).decode()


def test_each_step_of_the_last_sweep_per_service_and_kind_is_a_series() -> None:
    snapshot = h200_snapshot(
        tunes=(
            sweep("sglang", "NVIDIA H200", 450, 700, 600, 450),
            sweep("sglang", "NVIDIA H200", None, 1980, 1680, kind="clocks"),
        )
    )
    text = render(snapshot)
    tune_lines = [line for line in text.splitlines() if line.startswith("gpu_agent_tune_")]
    # 3 figures x 3 steps + a recommendation + when it ended; 3 x 2 + when it ended (no recommendation)
    assert len(tune_lines) == (3 * 3 + 1 + 1) + (3 * 2 + 1)
    labels = 'gpu_model="NVIDIA H200",kind="power",service="sglang"'
    assert f'gpu_agent_tune_recommended{{{labels},setting="450"}} 1.0' in tune_lines
    assert f'gpu_agent_tune_tokens_per_joule{{{labels},setting="600"}} 1.6666666666666667' in tune_lines
    assert f'gpu_agent_tune_e2e_p95_seconds{{{labels},setting="700"}} 0.6428571428571428' in tune_lines
    assert not any(
        line.startswith('gpu_agent_tune_recommended{gpu_model="NVIDIA H200",kind="clocks"') for line in tune_lines
    )
    assert not any(line.startswith("gpu_agent_tune_") for line in render(h200_snapshot()).splitlines())
    promtool = shutil.which("promtool")
    if promtool is not None:
        linted = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert linted.returncode == 0, linted.stdout + linted.stderr


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")
def test_one_query_gives_the_best_limit_per_model_across_the_fleet(tmp_path: Path) -> None:
    nodes = (
        h200_snapshot(tunes=(sweep("sglang", "NVIDIA H200", 450, 700, 600, 450),)),
        h200_snapshot(tunes=(sweep("sglang", "NVIDIA H200", 450, 700, 550, 450, 400),)),
        h200_snapshot(
            tunes=(
                sweep("vllm", "NVIDIA H200", 500, 700, 500),
                sweep("vllm", "NVIDIA RTX PRO 6000 Blackwell Server Edition", 300, 450, 300),
            )
        ),
    )
    with contextlib.ExitStack() as stack:
        servers = [MetricsServer("127.0.0.1:0", lambda node=node: node) for node in nodes]  # type: ignore[misc]
        for server in servers:
            stack.callback(server.close)
        prometheus = Prometheus(tmp_path, [server.port for server in servers], rule_files=())
        stack.callback(prometheus.stop)
        prometheus.wait_for("all three nodes' sweeps", lambda: len(prometheus.query("gpu_agent_tune_recommended")) == 4)
        best = prometheus.query(FLEET_BEST_LIMIT)
    answer = {(r["metric"]["gpu_model"], r["metric"]["setting"], r["value"][1]) for r in best}
    assert answer == {("NVIDIA H200", "450", "2"), ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "300", "1")}
