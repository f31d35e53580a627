"""The agent's pushes against real Alertmanagers (Debian's prometheus-alertmanager on loopback): the
alerts its verdict holds reach every Alertmanager of `remediation.alertmanager_url` with the shipped
rules' names and labels, resolve (`endsAt`) when the verdict no longer holds them, survive an agent
restart (the store), and are retried until an Alertmanager that was down has them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from slow_endpoint import SlowEndpoint
from snapshots import gpu_uuid, node_snapshot

from agent.alerts.catalog import BY_NAME
from agent.config import AgentConfig
from agent.daemon.alert_book import FIRING_VALIDITY_SECONDS, Found, PushBook
from agent.daemon.alert_delivery import AlertDelivery
from agent.daemon.alert_found import found_alerts
from agent.demo.alertmanager_process import DemoAlertmanager, find_alertmanager
from agent.demo.standin_process import free_port
from agent.store.database import Store

ALERTMANAGER = find_alertmanager()
needs_alertmanager = pytest.mark.skipif(
    ALERTMANAGER is None, reason="needs Alertmanager: apt-get install -y prometheus-alertmanager"
)
NODE = {"instance": "gpu-node-1:9481", "job": "gpu-agent", "cluster": "eu-1"}


def alertmanager(directory: Path) -> DemoAlertmanager:
    assert ALERTMANAGER is not None
    directory.mkdir(parents=True, exist_ok=True)
    return DemoAlertmanager(ALERTMANAGER, directory).start()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DemoAlertmanager, DemoAlertmanager]]:
    if ALERTMANAGER is None:
        pytest.skip("needs Alertmanager: apt-get install -y prometheus-alertmanager")
    first = alertmanager(tmp_path_factory.mktemp("am-a"))
    second = alertmanager(tmp_path_factory.mktemp("am-b"))
    yield first, second
    first.stop()
    second.stop()


def config(tmp_path: Path, urls: list[str]) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "metrics": {"listen": "127.0.0.1:9481"},
            "remediation": {"rules_dirs": [], "alertmanager_url": urls},
            "alerts": {"instance": NODE["instance"], "labels": {"cluster": NODE["cluster"]}},
        }
    )


def held(name: str, **labels: str) -> Found:
    spec = BY_NAME[name]
    return Found(name, {"alertname": name, "severity": spec.severity.value, **NODE, **labels}, {"summary": name}, 0.0)


def alerts_of(am: DemoAlertmanager, name: str) -> list[dict[str, Any]]:
    return [a for a in am.alerts() if a["labels"].get("alertname") == name]


def test_the_agents_alerts_have_the_rules_labels() -> None:
    """What the agent pushes for the mixed node of tests/snapshots.py: the shipped rules' alerts
    (their `for` aside), with the target's labels as `alerts` names them and the rule's text."""
    base = AgentConfig.model_validate({"alerts": {"instance": "gpu-node-1:9481", "labels": {"cluster": "eu-1"}}})
    found = {
        (f.name, f.labels.get("gpu", f.labels.get("service", f.labels.get("rule", "")))): f
        for f in found_alerts(node_snapshot(), base)
    }
    assert set(found) == {
        ("GpuAgentCollectorFailing", ""),
        ("GpuAgentRemediationFailing", "xid-reset-gpu"),
        ("GpuLost", "3"),
        ("GpuStale", "2"),
        ("GpuUnhealthy", "1"),
        ("GpuUnhealthy", "3"),
        ("GpuDegraded", "2"),
        ("GpuRecoveryActionRequired", "1"),
        ("GpuXidCritical", "1"),
        ("GpuXidCritical", "3"),
        ("GpuRowRemapPending", "1"),
        ("GpuPolicyDrift", "2"),
        ("GpuPolicyDriftObserved", ""),
        ("GpuNextBootNotReady", ""),
        ("InferenceServiceDown", "embeddings"),
    }
    xid = found[("GpuXidCritical", "1")]
    assert xid.labels == {
        "alertname": "GpuXidCritical",
        "severity": "critical",
        "instance": "gpu-node-1:9481",
        "job": "gpu-agent",
        "cluster": "eu-1",
        "gpu": "1",
        "uuid": gpu_uuid(1),
        "xid": "48",
        "action": "reset_gpu",
    }
    assert xid.annotations["summary"] == "Critical Xid 48 on GPU 1 of gpu-node-1:9481"
    assert xid.annotations["runbook_url"] == "file:///usr/share/doc/gpu-agent/docs/alerts.md#gpuxidcritical"
    assert xid.for_seconds == 0
    assert found[("InferenceServiceDown", "embeddings")].labels.keys() >= {"service"}
    assert "unit" not in found[("InferenceServiceDown", "embeddings")].labels
    # the instance defaults to the host name and the metrics port, the job to gpu-agent
    default = found_alerts(replace(node_snapshot(), hostname="gpu-node-9"), AgentConfig())
    assert {(f.labels["instance"], f.labels["job"]) for f in default} == {("gpu-node-9:9481", "gpu-agent")}
    # an alert's `for` is its own, or `alerts.for_seconds`
    quick = AgentConfig.model_validate({"alerts": {"for_seconds": {"GpuLost": 5}}})
    assert {f.for_seconds for f in found_alerts(node_snapshot(), quick) if f.name == "GpuLost"} == {5.0}


@needs_alertmanager
def test_a_firing_alert_reaches_every_alertmanager_and_resolves_when_the_fault_is_fixed(
    tmp_path: Path, two: tuple[DemoAlertmanager, DemoAlertmanager]
) -> None:
    first, second = two
    cfg = config(tmp_path, [first.url, second.url])
    with Store.open(cfg.state_dir) as store:
        book = PushBook(lambda: store, "boot-1")
        delivery = AlertDelivery(book, timeout_seconds=5.0)
        ecc = held("GpuUncorrectableEcc", gpu="1", uuid=gpu_uuid(1))
        assert book.update([ecc], cfg.remediation.alertmanager_urls) is True
        delivery.deliver()
        for am in two:
            (alert,) = alerts_of(am, "GpuUncorrectableEcc")
            assert alert["labels"] == dict(ecc.labels)
            assert alert["status"]["state"] == "active"
        assert delivery.status is not None and delivery.status.success
        # the fault fixed: the same labels with endsAt now, to both; then the book forgets it
        assert book.update([], cfg.remediation.alertmanager_urls) is True
        delivery.poke()
        delivery.deliver()
        for am in two:
            wait_until(lambda am=am: not alerts_of(am, "GpuUncorrectableEcc"), 5.0, "the alert resolved")
        assert book.active() == []
        assert store.pushed_alerts() == []


@needs_alertmanager
def test_a_restarted_agent_goes_on_with_its_alerts(
    tmp_path: Path, two: tuple[DemoAlertmanager, DemoAlertmanager]
) -> None:
    """The store keeps the book: after a restart an alert that still holds keeps its start (the same
    alert, no new page), and one that no longer holds is resolved once the agent has settled."""
    first, _ = two
    urls = (first.url,)
    clock = [1000.0]
    with Store.open(tmp_path / "state") as store:
        book = PushBook(lambda: store, "boot-1", boottime=lambda: clock[0])
        lost = held("GpuLost", gpu="3", uuid=gpu_uuid(3))
        down = held("InferenceServiceDown", service="restart-kept")
        book.update([lost, down], urls)
        AlertDelivery(book).deliver()
        started = {row.labels["alertname"]: row.starts_at for row in book.active()}
        clock[0] += 5
        again = PushBook(lambda: store, "boot-1", boottime=lambda: clock[0])
        again.update([lost], urls)  # the first loop: the service's verdict not known yet
        assert {row.labels["alertname"]: row.starts_at for row in again.active()} == started  # nothing resolved yet
        clock[0] += 60  # settled: what does not hold now is resolved
        assert again.update([lost], urls) is True
        rows = {row.labels["alertname"]: row for row in again.active()}
        assert rows["GpuLost"].starts_at == started["GpuLost"] and rows["GpuLost"].ends_at is None
        assert rows["InferenceServiceDown"].ends_at is not None
        AlertDelivery(again).deliver()
        wait_until(lambda: not alerts_of(first, "InferenceServiceDown"), 5.0, "the resolution delivered")
        assert [row.labels["alertname"] for row in again.active()] == ["GpuLost"]
        (alert,) = alerts_of(first, "GpuLost")
        assert alert["startsAt"].startswith(time.strftime("%Y-%m-%dT", time.gmtime(started["GpuLost"] or 0)))


@needs_alertmanager
def test_an_alertmanager_that_was_down_gets_the_alerts_once_it_is_up(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    book = PushBook()
    delivery = AlertDelivery(book, timeout_seconds=2.0)
    book.update([held("GpuPowerBrake", gpu="0", uuid=gpu_uuid(0))], (url,))
    delivery.start()
    try:
        delivery.poke()
        wait_until(lambda: delivery.status is not None and not delivery.status.success, 10.0, "a failed round")
        assert delivery.status is not None and "refused" in delivery.status.last_error.lower()
        am = DemoAlertmanager(str(ALERTMANAGER), tmp_path / "late")
        am.port, am.url = port, url
        am.start()
        try:
            # retried with a backoff of 1, 2, 4 ... s: it arrives without another change
            wait_until(lambda: bool(alerts_of(am, "GpuPowerBrake")), 20.0, "the retried delivery")
            wait_until(lambda: delivery.status is not None and delivery.status.success, 5.0, "the collector ok again")
        finally:
            am.stop()
    finally:
        delivery.stop()


def test_a_silent_alertmanager_costs_one_deadline_for_all_of_its_alerts() -> None:
    """Six firing alerts to an Alertmanager that accepts and never answers: one request with all of
    them, ended at its deadline; the failure is the `alerts` collector's."""
    with SlowEndpoint("silent") as silent:
        book = PushBook()
        book.update([held("GpuLost", gpu=str(n), uuid=gpu_uuid(n)) for n in range(6)], (silent.url(),))
        delivery = AlertDelivery(book, timeout_seconds=2.0)
        began = time.monotonic()
        delivery.deliver()
        took = time.monotonic() - began
        assert 2 <= took < 4, took
        assert silent.lines[:2] == ["request 1"] or silent.lines[:1] == ["request 1"]
        assert delivery.status is not None and not delivery.status.success
        assert delivery.status.last_error == f"POST {silent.url()}/…: timed out: no complete answer within 2 s"


def test_a_firing_alert_tells_alertmanager_how_long_it_holds() -> None:
    """`endsAt` of a firing push lies FIRING_VALIDITY_SECONDS ahead, so Alertmanager keeps a dead
    agent's alert as long as Prometheus keeps a silent node's, then resolves it itself."""
    clock = [1_780_000_000.0]
    book = PushBook(clock=lambda: clock[0])
    book.update([held("GpuLost", gpu="0", uuid=gpu_uuid(0))], ("http://am",))
    ((_, body),) = book.payloads()["http://am"]
    assert body["startsAt"] == "2026-05-28T20:26:40Z"
    assert body["endsAt"] == "2026-05-28T20:36:40Z"
    assert FIRING_VALIDITY_SECONDS == 600
