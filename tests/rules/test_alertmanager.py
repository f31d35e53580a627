"""The alertmanager action against a real Alertmanager (Debian's prometheus-alertmanager) on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hosttree import make_host_tree

from agent.backend.sim import SimulatedBackend
from agent.config import AgentConfig, Mode, RemediationConfig
from agent.demo.standin_process import free_port
from agent.events import Event, EventKind, Severity, SuggestedAction
from agent.policy.base import HostContext
from agent.policy.engine import PolicyEngine
from agent.rules.actions.alertmanager import AlertTracker, post_alert, resolve_alert
from agent.rules.actions.context import ActionContext
from agent.rules.actions.dispatch import execute
from agent.rules.actions.kinds.alertmanager import AlertmanagerParams, alert_for
from agent.rules.model import ActionSpec, Decision, Outcome, Target

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = pytest.mark.skipif(
    ALERTMANAGER is None,
    reason="needs Alertmanager: apt-get install -y prometheus-alertmanager (/usr/bin/prometheus-alertmanager)",
)
UUID0 = "GPU-8bb8f26c-9cd6-525f-ae91-348f344348a2"
CONFIG = """
route:
  receiver: blackhole
  group_wait: 1s
receivers:
  - name: blackhole
"""


class Alertmanager:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = directory / "alertmanager.yml"
        config.write_text(CONFIG)
        (directory / "data").mkdir()
        self.log = open(directory / "alertmanager.log", "wb")  # noqa: SIM115 (closed in stop)
        assert ALERTMANAGER is not None
        self.proc = subprocess.Popen(
            [
                ALERTMANAGER,
                f"--config.file={config}",
                f"--storage.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",  # no gossip port: a single instance on loopback
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"Alertmanager did not become ready: {(directory / 'alertmanager.log').read_text()}")

    def alerts(self) -> list[dict[str, Any]]:
        """What Alertmanager shows now (GET /api/v2/alerts hides resolved alerts)."""
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=5) as response:
            alerts: list[dict[str, Any]] = json.load(response)
        return alerts

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Alertmanager]:
    am = Alertmanager(tmp_path_factory.mktemp("alertmanager"))
    yield am
    am.stop()


def context(tmp_path: Path, alertmanager_url: str | None) -> ActionContext:
    config = AgentConfig(
        mode=Mode.ENFORCE,
        state_dir=str(tmp_path / "state"),
        host_root=str(tmp_path / "host"),
        remediation=RemediationConfig(alertmanager_url=alertmanager_url),
    )
    backend = SimulatedBackend("h200", tmp_path / "state")
    host = HostContext(make_host_tree(tmp_path / "host"))
    return ActionContext(
        config=config,
        backend=backend,
        policy=PolicyEngine(config, backend, host),
        host=host,
        managers={},
        hostname="gpu-node-7",
    )


def event(kind: EventKind, gpu: int | None = 0, uuid: str | None = UUID0, **data: Any) -> Event:
    return Event(
        kind=kind,
        severity=Severity.CRITICAL,
        gpu=gpu,
        uuid=uuid,
        message=f"{kind.value} seen",
        timestamp_seconds=time.time() - 60,
        source="test",
        key=f"{kind.value}:{uuid}",
        data=data,
        suggested_action=SuggestedAction.ALERT,
    )


def decision(ev: Event, target: Target, params: AlertmanagerParams | None = None) -> Decision:
    return Decision("page-oncall", ev, target, ActionSpec(params or AlertmanagerParams()), 0, 1, "fired")


def wait_for(alertmanager: Alertmanager, predicate: Any, timeout_seconds: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_seconds
    alerts = alertmanager.alerts()
    while not predicate(alerts) and time.monotonic() < deadline:
        time.sleep(0.1)
        alerts = alertmanager.alerts()
    return alerts


def by_name(alerts: list[dict[str, Any]], alertname: str) -> list[dict[str, Any]]:
    return [a for a in alerts if a["labels"].get("alertname") == alertname]


def test_alert_reaches_alertmanager_with_labels_and_annotations(tmp_path: Path, alertmanager: Alertmanager) -> None:
    ctx = context(tmp_path, alertmanager.url)
    xid = decision(
        event(EventKind.XID, xid=48), Target(gpu=0, uuid=UUID0), AlertmanagerParams(labels={"team": "inference"})
    )
    outcome = execute(xid, ctx)
    assert outcome.outcome is Outcome.SUCCESS, outcome.detail
    assert outcome.detail == f"alert GpuAgentXid sent to {alertmanager.url}"
    (alert,) = by_name(wait_for(alertmanager, lambda a: by_name(a, "GpuAgentXid")), "GpuAgentXid")
    assert alert["labels"] == {
        "alertname": "GpuAgentXid",
        "severity": "critical",
        "instance": "gpu-node-7",
        "event": "xid",
        "rule": "page-oncall",
        "gpu": "0",
        "uuid": UUID0,
        "xid": "48",
        "team": "inference",
    }
    assert alert["annotations"]["summary"] == "xid seen"
    assert alert["annotations"]["description"] == "page-oncall: fired"
    assert alert["status"]["state"] == "active"
    assert [a.labels["alertname"] for a in ctx.alerts.active()] == ["GpuAgentXid"]


def test_cleared_condition_resolves_only_its_own_alert(tmp_path: Path, alertmanager: Alertmanager) -> None:
    ctx = context(tmp_path, alertmanager.url)
    for service in ("sglang", "vllm"):
        ev = event(EventKind.SERVICE_UNHEALTHY, gpu=None, uuid=None, service=service)
        assert execute(decision(ev, Target(service=service)), ctx).outcome is Outcome.SUCCESS

    def services(alerts: list[dict[str, Any]]) -> set[str]:
        return {a["labels"]["service"] for a in by_name(alerts, "GpuAgentServiceUnhealthy")}

    assert services(wait_for(alertmanager, lambda a: services(a) == {"sglang", "vllm"})) == {"sglang", "vllm"}

    # Unrelated clearing events resolve nothing.
    assert ctx.alerts.resolve_cleared(event(EventKind.GPU_RECOVERED)) == []
    assert ctx.alerts.resolve_cleared(event(EventKind.SERVICE_HEALTHY, gpu=None, uuid=None, service="tgi")) == []

    resolved = ctx.alerts.resolve_cleared(event(EventKind.SERVICE_HEALTHY, gpu=None, uuid=None, service="sglang"))
    assert [a.labels["service"] for a in resolved] == ["sglang"]
    assert services(wait_for(alertmanager, lambda a: services(a) == {"vllm"})) == {"vllm"}
    assert [a.labels["service"] for a in ctx.alerts.active()] == ["vllm"]

    # Refreshing keeps the remaining one alive, without bringing the resolved one back.
    assert ctx.alerts.refresh() == []
    assert services(alertmanager.alerts()) == {"vllm"}
    assert [a.labels["service"] for a in ctx.alerts.resolve({"service": "vllm"})] == ["vllm"]
    assert services(wait_for(alertmanager, lambda a: not services(a))) == set()


def test_resolve_alert_posts_ends_at_now(alertmanager: Alertmanager) -> None:
    dec = decision(event(EventKind.THROTTLE_STARTED, reason="hw_thermal_slowdown"), Target(gpu=0, uuid=UUID0))
    alert = alert_for(dec, "gpu-node-7", AlertmanagerParams(alertname="GpuAgentDirect"))
    assert alert.labels["reason"] == "hw_thermal_slowdown"
    post_alert(alertmanager.url, alert)
    assert by_name(wait_for(alertmanager, lambda a: by_name(a, "GpuAgentDirect")), "GpuAgentDirect")
    resolve_alert(alertmanager.url, alert, time.time())
    assert by_name(wait_for(alertmanager, lambda a: not by_name(a, "GpuAgentDirect")), "GpuAgentDirect") == []


def test_throttle_end_resolves_the_same_reason_on_the_same_gpu(alertmanager: Alertmanager) -> None:
    tracker = AlertTracker()
    for gpu, reason in ((0, "hw_thermal_slowdown"), (0, "sw_thermal_slowdown"), (1, "hw_thermal_slowdown")):
        ev = event(EventKind.THROTTLE_STARTED, gpu=gpu, uuid=f"GPU-{gpu}", reason=reason)
        tracker.fire(
            alertmanager.url, alert_for(decision(ev, Target(gpu=gpu, uuid=f"GPU-{gpu}")), "h", AlertmanagerParams())
        )
    ended = event(EventKind.THROTTLE_ENDED, gpu=0, uuid="GPU-0", reason="hw_thermal_slowdown")
    resolved = tracker.resolve_cleared(ended)
    assert [(a.labels["gpu"], a.labels["reason"]) for a in resolved] == [("0", "hw_thermal_slowdown")]
    assert sorted((a.labels["gpu"], a.labels["reason"]) for a in tracker.active()) == [
        ("0", "sw_thermal_slowdown"),
        ("1", "hw_thermal_slowdown"),
    ]
    tracker.resolve({"alertname": "GpuAgentThrottleStarted"})
    assert tracker.active() == []


def test_alertmanager_action_without_url_is_not_configured_and_unreachable_fails(tmp_path: Path) -> None:
    """No Alertmanager set is no failure of the alert (GpuAgentRemediationFailing must not page for
    every fault of a node without one): it is reported as not configured."""
    dec = decision(event(EventKind.XID, xid=13), Target(gpu=0, uuid=UUID0))
    outcome = execute(dec, context(tmp_path, None))
    assert (outcome.outcome, outcome.detail) == (
        Outcome.NOT_CONFIGURED,
        "no Alertmanager configured: set remediation.alertmanager_url or the step's url",
    )
    ctx = context(tmp_path, f"http://127.0.0.1:{free_port()}")
    outcome = execute(dec, ctx)
    assert outcome.outcome is Outcome.FAILED
    assert "refused" in outcome.detail.lower()
    assert ctx.alerts.active() == []  # nothing remembered that never arrived
