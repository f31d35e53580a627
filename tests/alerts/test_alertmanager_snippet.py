"""The Alertmanager snippet the package ships (packaging/alertmanager/gpu-agent-alertmanager.yaml):
amtool accepts it, it routes each severity to its receiver, and its inhibit rules name the
catalogue's alerts, every fault of a GPU over the GPU's health alerts. (That it gives one page per
fault: tests/test_alert_story.py, with a real Alertmanager.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from alert_cases import CASES

from agent.alerts.catalog import BY_NAME, AlertSeverity, raised_by
from agent.events import EventKind
from agent.rules.config import load_rules

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = ROOT / "packaging/alertmanager/gpu-agent-alertmanager.yaml"
AMTOOL = shutil.which("amtool")
needs_amtool = pytest.mark.skipif(
    AMTOOL is None, reason="amtool not installed (apt-get install prometheus-alertmanager)"
)
#: The GPU's health alerts, which only say that something is wrong with it.
HEALTH = {"GpuUnhealthy", "GpuDegraded"}
#: Alerts about a GPU that leave its health alone: a setting off its declared value.
NOT_HEALTH = {"GpuPolicyDrift", "GpuPolicyDriftObserved"}


def config() -> dict[str, object]:
    loaded: dict[str, object] = yaml.safe_load(SNIPPET.read_text())
    return loaded


def names_in(matchers: list[str]) -> set[str]:
    """The alert names an alertname matcher list selects from the catalogue."""
    found = set(BY_NAME)
    for matcher in matchers:
        label, op, value = re.fullmatch(r'(\w+)(=~|!~|!=|=)"(.*)"', matcher).groups()  # type: ignore[union-attr]
        if label != "alertname":
            continue
        selected = {name for name in BY_NAME if re.fullmatch(value, name)}
        found &= selected if op in ("=", "=~") else set(BY_NAME) - selected
    return found


@needs_amtool
def test_amtool_accepts_it() -> None:
    assert AMTOOL is not None
    proc = subprocess.run([AMTOOL, "check-config", str(SNIPPET)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@needs_amtool
@pytest.mark.parametrize(
    ("severity", "receiver"),
    [("critical", "gpu-agent-pager"), ("warning", "gpu-agent-tickets"), ("info", "gpu-agent-dashboard")],
)
def test_each_severity_goes_to_its_receiver(severity: str, receiver: str) -> None:
    assert AMTOOL is not None
    proc = subprocess.run(
        [AMTOOL, "config", "routes", "test", f"--config.file={SNIPPET}", f"severity={severity}", "alertname=GpuLost"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == receiver, proc.stdout + proc.stderr


def test_every_alert_it_names_is_in_the_catalogue() -> None:
    text = SNIPPET.read_text()
    named = set(re.findall(r"\b(?:Gpu|Inference)[A-Za-z]+\b", text))
    named -= {"GpuXid", "GpuRowRemap", "GpuNvlink"}  # no such prefix is used alone: the regexes name them whole
    assert named <= set(BY_NAME), named - set(BY_NAME)


def test_every_fault_of_a_gpu_is_over_its_health_alerts() -> None:
    """An alert about one GPU's fault inhibits GpuUnhealthy and GpuDegraded on that GPU, so the page
    is the fault's, never the generic one's as well (the lost GPU has its own rule, over all)."""
    per_gpu = {case.alert for case in CASES for alerts in case.fires.values() for labels in alerts if "gpu" in labels}
    rules = config()["inhibit_rules"]
    assert isinstance(rules, list)
    over_health = set().union(
        *(
            names_in(rule["source_matchers"])
            for rule in rules
            if names_in(rule["target_matchers"]) == HEALTH and rule["equal"] == ["instance", "gpu"]
        )
    )
    faults = per_gpu - HEALTH - NOT_HEALTH - {"GpuLost"}
    assert faults <= over_health, faults - over_health
    assert not NOT_HEALTH & over_health
    lost = [rule for rule in rules if names_in(rule["source_matchers"]) == {"GpuLost"}]
    assert [names_in(rule["target_matchers"]) for rule in lost] == [set(BY_NAME) - {"GpuLost"}]


def test_a_fault_that_pages_holds_back_the_reboot_recommended_for_it() -> None:
    """Every shipped rule that recommends a reboot does so for a fault whose critical alerts (the
    catalogue's for the events it matches) inhibit GpuRebootRecommended on the node: one page, and
    the recommendation a ticket once the page resolves. A new such rule for another fault fails here
    until the snippet names its alert."""
    kinds: set[EventKind] = set()
    for rule in load_rules([ROOT / "rules"]):
        if any(step.kind == "recommend_reboot" for step in rule.steps):
            event = rule.match.event
            kinds |= set(event.kinds) if event is not None else {EventKind(rule.match.kind)}
    paging = {name for kind in kinds for name in raised_by(kind) if BY_NAME[name].severity is AlertSeverity.CRITICAL}
    assert paging >= {"GpuLost", "GpuXidCritical", "GpuRecoveryActionRequired"}
    rules = config()["inhibit_rules"]
    assert isinstance(rules, list)
    over_reboot = [rule for rule in rules if names_in(rule["target_matchers"]) == {"GpuRebootRecommended"}]
    assert [names_in(rule["source_matchers"]) for rule in over_reboot] == [paging]
    assert over_reboot[0]["equal"] == ["instance"]


def test_the_node_over_everything_and_a_service_down_over_its_figures() -> None:
    rules = config()["inhibit_rules"]
    assert isinstance(rules, list)
    by_source = {frozenset(names_in(rule["source_matchers"])): rule for rule in rules}
    node = by_source[frozenset({"GpuAgentDown", "GpuNodeProblem"})]
    assert names_in(node["target_matchers"]) == set(BY_NAME) - {"GpuAgentDown", "GpuNodeProblem"}
    assert node["equal"] == ["instance"]
    service = by_source[frozenset({"InferenceServiceDown"})]
    assert names_in(service["target_matchers"]) == {
        "InferenceLatencyAboveSlo",
        "InferenceKvCacheNearFull",
        "InferenceMetricsUnreadable",
    }
    assert service["equal"] == ["instance", "service"]
    assert config()["route"]["group_by"] == ["instance"]  # type: ignore[index]
