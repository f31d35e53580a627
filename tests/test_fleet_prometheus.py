"""The fleet view end to end: one real Prometheus scrapes three real agents (`gpu-agent run` on three
simulated nodes, loopback ports, targets labelled with a cluster and a rack as a fleet labels them)
with different faults; every fleet recording rule keeps those labels and the GPU model, every query
of the dashboard's fleet row and the alerts name the right nodes. (A node whose agent dies:
tests/test_alert_story.py.)"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from daemon_harness import RunningAgent, running_agent
from helpers import wait_until
from test_dashboard_prometheus import (
    ALERTS,
    PROMETHEUS,
    PROMTOOL,
    RECORDING,
    Prometheus,
    all_panels,
    dashboard,
    substitute,
)

pytestmark = pytest.mark.real_daemon

ROOT = Path(__file__).resolve().parent.parent
FLEET_ROW = "Fleet"
NODES = ("clean", "lost", "xid")
TARGET = {"cluster": "eu-1", "rack": "r7"}
MODEL = "NVIDIA H200"
#: What each node suffers: nothing; GPU 1 fell off the bus; an Xid 48 on GPU 0 and a hot, slowed GPU 1.
FAULTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "clean": (),
    "lost": (("lost", "--gpu", "1"),),
    "xid": (
        ("xid", "48", "--gpu", "0", "--source", "nvml"),
        ("temperature", "--gpu", "1", "--celsius", "96"),
        ("throttle", "--gpu", "1", "--reason", "hw_thermal_slowdown"),
    ),
}
#: The health the faults give each GPU of each node.
HEALTH = {
    ("clean", "0"): "healthy",
    ("clean", "1"): "healthy",
    ("lost", "0"): "healthy",
    ("lost", "1"): "unhealthy",
    ("xid", "0"): "unhealthy",
    ("xid", "1"): "degraded",
}


def inject(agent: RunningAgent, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agent.cli", "inject", *args, "--config", str(agent.config_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr


def fleet_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every query in the dashboard's fleet row: the panels up to the next row."""
    panels = dashboard()["panels"]
    start = next(i for i, panel in enumerate(panels) if panel["type"] == "row" and panel["title"].startswith(FLEET_ROW))
    end = next((i for i in range(start + 1, len(panels)) if panels[i]["type"] == "row"), len(panels))
    return [
        (panel["title"], target["expr"]) for panel in all_panels(panels[start + 1 : end]) for target in panel["targets"]
    ]


class Fleet:
    def __init__(self, prometheus: Prometheus, node_of: dict[str, str]) -> None:
        self.prometheus = prometheus
        self.node_of = node_of  # instance label -> node name

    def by_node(self, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
        """(node, *labels) -> value for each series of an instant query."""
        return {
            (self.node_of[series["metric"]["instance"]], *(series["metric"].get(label, "") for label in labels)): float(
                series["value"][1]
            )
            for series in self.prometheus.query(expr)
        }

    def scalar_by(self, expr: str, label: str = "") -> dict[str, float]:
        return {series["metric"].get(label, ""): float(series["value"][1]) for series in self.prometheus.query(expr)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if PROMETHEUS is None:
        pytest.skip("prometheus server not installed (apt-get install prometheus)")
    with contextlib.ExitStack() as stack:
        agents: dict[str, RunningAgent] = {}
        for name in NODES:
            workdir = tmp_path_factory.mktemp(f"node-{name}")
            agents[name] = stack.enter_context(running_agent(workdir, watchdog_usec=None, interval=1.0))
        for name, agent in agents.items():
            agent.notifications.wait_for("READY", "1")
            for fault in FAULTS[name]:
                inject(agent, *fault)
        for name, agent in agents.items():
            wait_until(
                lambda agent=agent, name=name: (
                    [g["health"]["state"] for g in agent.status()["gpus"]] == [HEALTH[(name, "0")], HEALTH[(name, "1")]]
                ),
                60.0,
                f"node {name}'s faults in its status",
                poll_seconds=0.5,
            )
        prometheus = Prometheus(
            tmp_path_factory.mktemp("prometheus"),
            [agent.port for agent in agents.values()],
            [ALERTS, RECORDING],
            target_labels=TARGET,
        )
        stack.callback(prometheus.stop)
        node_of = {f"127.0.0.1:{agent.port}": name for name, agent in agents.items()}

        def scraped_twice() -> bool:
            targets = prometheus.api("targets")["activeTargets"]
            return (
                len(targets) == len(NODES)
                and all(target["health"] == "up" for target in targets)
                and len(prometheus.query("count_over_time(gpu_agent_up[1m]) >= 2")) == len(NODES)
            )

        prometheus.wait_for("three agents scraped twice", scraped_twice, timeout_seconds=60.0)
        yield Fleet(prometheus, node_of)


# -- the tests --------------------------------------------------------------------------------------


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_check_recording_rules() -> None:
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "rules", str(RECORDING)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 18 rules found" in result.stdout


def test_the_dashboard_opens_on_the_fleet_row_and_it_reads_the_recording_rules() -> None:
    recorded = {rule["record"] for group in yaml.safe_load(RECORDING.read_text())["groups"] for rule in group["rules"]}
    assert dashboard()["panels"][0]["title"].startswith(FLEET_ROW)
    queries = fleet_queries()
    assert len(queries) >= 10
    for title, expr in queries:
        assert any(name in expr for name in recorded), (title, expr)
        assert set(re.findall(r"\$(\w+)", expr)) <= {"job", "cluster"}, f"{title}: the fleet row is not one node's"
        assert "by (instance" not in expr, f"{title}: aggregated by node drops what a fleet labels its nodes with"


def test_recording_rules_rank_every_gpu_of_every_node(fleet: Fleet) -> None:
    rank = {"healthy": 0.0, "degraded": 1.0, "unhealthy": 2.0}
    wanted = {key: rank[state] for key, state in HEALTH.items()}
    wanted[("lost", "1")] = 3.0  # not answering: missing ranks above unhealthy
    fleet.prometheus.wait_for(
        "every GPU's rank",
        lambda: fleet.by_node("instance_gpu:gpu_agent_gpu_health:rank", "gpu") == wanted,
        timeout_seconds=30.0,
        detail=lambda: str(fleet.by_node("instance_gpu:gpu_agent_gpu_health:rank", "gpu")),
    )
    # every series keeps what the fleet labels its targets with, and the GPU's model
    for series in fleet.prometheus.query("instance_gpu:gpu_agent_gpu_health:rank"):
        assert {k: series["metric"].get(k) for k in ("cluster", "rack", "model")} == {**TARGET, "model": MODEL}
    states = {**{key: state for key, state in HEALTH.items()}, ("lost", "1"): "missing"}
    by_state = fleet.by_node("instance:gpu_agent_gpus:by_state", "state")
    assert by_state == {
        (node, state): float(sum(1 for (n, _), s in states.items() if n == node and s == state))
        for node in NODES
        for state in (*rank, "missing")
    }
    assert fleet.by_node("instance:gpu_agent_gpu_health:worst") == {("clean",): 0, ("lost",): 3, ("xid",): 2}
    assert fleet.by_node("instance:gpu_agent_gpus_expected:missing") == {("clean",): 0, ("lost",): 1, ("xid",): 0}


def test_fleet_aggregates(fleet: Fleet) -> None:
    by_state = "sum by (state) (fleet:gpu_agent_gpus:by_state)"
    fleet.prometheus.wait_for(
        "the fleet totals",
        lambda: fleet.scalar_by(by_state, "state") == {"healthy": 3, "degraded": 1, "unhealthy": 1, "missing": 1},
        timeout_seconds=30.0,
        detail=lambda: str(fleet.scalar_by(by_state, "state")),
    )
    # per job and the fleet's labels: the rack's totals
    (series,) = fleet.prometheus.query("fleet:gpu_agent_gpus_expected:sum")
    assert series["metric"] == {"__name__": "fleet:gpu_agent_gpus_expected:sum", "job": "gpu-agent", **TARGET}
    assert fleet.scalar_by("sum(fleet:gpu_agent_gpus_expected:sum)") == {"": 6}
    assert fleet.scalar_by("sum(fleet:gpu_agent_gpus_expected:missing)") == {"": 1}
    assert fleet.scalar_by("sum(fleet:gpu_agent_nodes:missing_gpus)") == {"": 1}
    assert fleet.scalar_by("sum(fleet:gpu_agent_nodes:not_healthy)") == {"": 2}
    assert fleet.scalar_by("sum(fleet:gpu_agent_nodes:not_reporting)") == {"": 0}
    # capacity: the healthy GPUs of each model, of all of them
    assert fleet.scalar_by("sum by (model) (fleet_model:gpu_agent_gpus:healthy)", "model") == {MODEL: 3}
    assert fleet.scalar_by("sum by (model) (fleet_model:gpu_agent_gpus:count)", "model") == {MODEL: 6}


def test_worst_node_first(fleet: Fleet) -> None:
    def order() -> list[str]:
        result = fleet.prometheus.query("sort_desc(instance:gpu_agent_gpu_health:attention_score)")
        return [fleet.node_of[series["metric"]["instance"]] for series in result]

    fleet.prometheus.wait_for(
        "the nodes worst first", lambda: order() == ["lost", "xid", "clean"], detail=lambda: str(order())
    )
    assert fleet.by_node("instance:gpu_agent_gpu_health:attention_score") == {
        ("lost",): 303,  # missing (3) and a healthy GPU
        ("xid",): 203,  # unhealthy (2) and degraded (1)
        ("clean",): 0,
    }


def test_every_fleet_panel_query_returns_the_right_nodes(fleet: Fleet) -> None:
    failures = []
    for title, expr in fleet_queries():
        result = fleet.prometheus.query(substitute(expr))
        if not result:
            failures.append(f"{title}: no data for {expr}")
            continue
        instances = {series["metric"].get("instance") for series in result}
        if instances != {None} and {fleet.node_of.get(i or "") for i in instances} != set(NODES):
            failures.append(f"{title}: nodes {instances} for {expr}")
    assert failures == []


def test_alerts_name_the_right_nodes(fleet: Fleet) -> None:
    wanted = {
        "GpuLost": {("lost", "1")},
        "GpuUnhealthy": {("lost", "1"), ("xid", "0")},
        "GpuXidCritical": {("xid", "0")},
        "GpuThermalSlowdown": {("xid", "1")},
    }

    def active() -> dict[str, set[tuple[str, str]]]:
        found: dict[str, set[tuple[str, str]]] = {name: set() for name in wanted}
        for series in fleet.prometheus.query('ALERTS{alertstate=~"pending|firing"}'):
            labels = series["metric"]
            if labels["alertname"] in found:
                found[labels["alertname"]].add((fleet.node_of[labels["instance"]], labels.get("gpu", "")))
        return found

    fleet.prometheus.wait_for("the alerts of each node", lambda: active() == wanted, detail=lambda: str(active()))
