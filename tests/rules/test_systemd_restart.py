"""restart_service through a real systemd (booted in a sandbox: tests/systemd_sandbox.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from action_kinds import ActionKind, action_spec
from helpers import action_context
from hosttree import make_host_tree
from systemd_sandbox import SystemdSandbox, missing_requirements

from agent.backend.sim import SimulatedBackend
from agent.config import AgentConfig, Mode
from agent.config.service_entry import ServiceConfig
from agent.demo.standin_process import STANDIN_FILES, free_port
from agent.events import Event, EventKind, Severity
from agent.policy.base import HostContext
from agent.rules.actions.context import ActionContext
from agent.rules.actions.dispatch import execute
from agent.rules.model import Decision, Outcome, Target
from agent.services.managers import SystemdManager, build_managers

pytestmark = [
    pytest.mark.real_daemon,
    pytest.mark.e2e,
    pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
]
REPO = Path(__file__).resolve().parents[2]
PORT = free_port()
UNIT = f"""[Unit]
Description=sglang stand-in

[Service]
ExecStart=/usr/bin/python3 /opt/standin/agent/demo/standin.py --port {PORT} --control-file /run/standin.control
Restart=no
"""
SLEEPER_UNIT = """[Unit]
Description=a service with no health endpoint

[Service]
ExecStart=/bin/sleep infinity
"""
BROKEN_UNIT = """[Unit]
Description=a server that fails to start

[Service]
Type=oneshot
ExecStart=/bin/false
"""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdSandbox]:
    with SystemdSandbox(tmp_path_factory.mktemp("sandbox")) as booted:
        for name in STANDIN_FILES:
            booted.copy_in(REPO / name, f"/opt/standin/{name}")
        booted.install_unit("sglang.service", UNIT)
        booted.install_unit("sleeper.service", SLEEPER_UNIT)
        booted.install_unit("broken.service", BROKEN_UNIT)
        yield booted


def context(tmp_path: Path, sandbox: SystemdSandbox, services: list[ServiceConfig]) -> ActionContext:
    config = AgentConfig(
        mode=Mode.ENFORCE, state_dir=str(tmp_path / "state"), host_root=str(tmp_path / "host"), services=services
    )
    backend = SimulatedBackend("h200", tmp_path / "state")
    host = HostContext(make_host_tree(tmp_path / "host"))
    managers = build_managers(config, host, systemctl_argv=sandbox.systemctl_argv)
    return action_context(config, backend, host, managers, hostname="sandbox")


def restart(service: str) -> Decision:
    event = Event(
        EventKind.SERVICE_UNHEALTHY,
        Severity.CRITICAL,
        None,
        None,
        "down",
        0.0,
        "probe",
        f"service_unhealthy:{service}",
        {"service": service},
    )
    return Decision(
        "restart-unhealthy", event, Target(service=service), action_spec(ActionKind.RESTART_SERVICE), 0, 1, "unhealthy"
    )


def test_restart_service_through_real_systemd(tmp_path: Path, sandbox: SystemdSandbox) -> None:
    service = ServiceConfig(
        name="sglang",
        unit="sglang.service",
        health_url=f"http://127.0.0.1:{PORT}/health",
        probe_interval_seconds=0.1,
        probe_timeout_seconds=1,
        ready_timeout_seconds=20,
    )
    ctx = context(tmp_path, sandbox, [service])
    manager = ctx.managers["sglang"]
    assert isinstance(manager, SystemdManager)
    manager.start(service)
    assert ctx.prober is not None
    assert ctx.prober.wait_healthy("sglang", 20).ok
    before = manager.main_pid(service)
    assert before is not None

    outcome = execute(restart("sglang"), ctx)

    assert outcome.outcome is Outcome.SUCCESS, outcome.detail
    assert outcome.detail.startswith("restarted sglang; sglang healthy after ")
    after = manager.main_pid(service)
    assert after is not None and after != before
    assert manager.is_active(service)
    assert sandbox.unit_property("sglang.service", "ActiveState") == "active"
    assert sandbox.unit_property("sglang.service", "NRestarts") == "0"  # our restart, not systemd's Restart=
    assert ctx.prober.probe_once("sglang").ok
    manager.stop(service)
    assert not manager.is_active(service)
    assert not ctx.prober.probe_once("sglang").ok


def test_service_without_health_url_is_checked_with_is_active(tmp_path: Path, sandbox: SystemdSandbox) -> None:
    service = ServiceConfig(name="sleeper", unit="sleeper.service", probe_interval_seconds=0.2)
    ctx = context(tmp_path, sandbox, [service])
    assert ctx.prober is not None
    assert not ctx.prober.probe_once("sleeper").ok  # not started yet
    outcome = execute(restart("sleeper"), ctx)
    assert outcome.outcome is Outcome.SUCCESS, outcome.detail
    assert outcome.detail.startswith("restarted sleeper; sleeper healthy after ")
    assert ctx.prober.probe_once("sleeper").detail == "active"
    ctx.managers["sleeper"].stop(service)


def failed_restart(tmp_path: Path, sandbox: SystemdSandbox, name: str) -> str:
    """Restarting the service `name` (unit `name`.service) fails; what the outcome says."""
    ctx = context(tmp_path, sandbox, [ServiceConfig(name=name, unit=f"{name}.service")])
    outcome = execute(restart(name), ctx)
    assert outcome.outcome is Outcome.FAILED
    return outcome.detail


def test_unit_failing_to_start_fails_the_restart(tmp_path: Path, sandbox: SystemdSandbox) -> None:
    detail = failed_restart(tmp_path, sandbox, "broken")
    assert detail.startswith("restart broken failed: systemctl restart broken.service failed: exit 1: ")
    assert "Job for broken.service failed" in detail
    assert sandbox.unit_property("broken.service", "ActiveState") == "failed"


def test_restart_of_a_missing_unit_fails_with_systemctl_output(tmp_path: Path, sandbox: SystemdSandbox) -> None:
    detail = failed_restart(tmp_path, sandbox, "ghost")
    assert detail.startswith("restart ghost failed: systemctl restart ghost.service failed: exit 5: ")
    assert "ghost.service not found" in detail
