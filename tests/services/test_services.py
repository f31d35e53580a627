"""Service managers and the health prober, against a real stand-in inference server process."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import wait_until
from pydantic import ValidationError

from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.demo import standin
from agent.demo.standin import running
from agent.demo.standin_process import StandinServer, free_port
from agent.events import EventKind, Severity, SuggestedAction
from agent.host.paths import HostPaths
from agent.policy.base import HostContext
from agent.services.managers import CommandManager, ServiceError, SystemdManager, build_managers
from agent.services.prober import HealthProber, ProberThread

STANDIN = str(Path(standin.__file__))


def probed(url: str, **fields: object) -> ServiceConfig:
    return ServiceConfig.model_validate(
        {
            "name": "sglang",
            "health_url": url,
            "probe_interval_seconds": 0.05,
            "probe_timeout_seconds": 0.5,
            "unhealthy_after_probes": 3,
            **fields,
        }
    )


def command_service(tmp_path: Path, port: int, **fields: object) -> ServiceConfig:
    pid_file = str(tmp_path / "sglang.pid")
    return ServiceConfig.model_validate(
        {
            "name": "sglang",
            "manager": "command",
            "start_command": [sys.executable, STANDIN, "--daemon", "--port", str(port), "--pid-file", pid_file],
            "stop_command": [sys.executable, STANDIN, "--stop", "--pid-file", pid_file],
            "health_url": f"http://127.0.0.1:{port}/health",
            "probe_interval_seconds": 0.05,
            "probe_timeout_seconds": 0.5,
            **fields,
        }
    )


def pid_of(tmp_path: Path) -> int:
    return int((tmp_path / "sglang.pid").read_text())


# -- config ----------------------------------------------------------------------------------------


def test_command_manager_needs_both_commands() -> None:
    with pytest.raises(ValidationError, match="manager 'command' needs stop_command"):
        ServiceConfig(name="a", manager="command", start_command=["/bin/true"])


def test_commands_must_be_absolute_and_only_for_command_manager() -> None:
    with pytest.raises(ValidationError, match="must be an absolute path, not 'true'"):
        ServiceConfig(name="a", manager="command", start_command=["true"], stop_command=["/bin/true"])
    with pytest.raises(ValidationError, match="start_command: only for manager 'command'"):
        ServiceConfig(name="a", start_command=["/bin/true"])


def test_health_url_must_be_http_and_probe_settings_have_defaults() -> None:
    with pytest.raises(ValidationError, match="http:// or https://"):
        ServiceConfig(name="a", health_url="127.0.0.1:30000/health")
    service = ServiceConfig(name="a", health_url="http://127.0.0.1:30000/health")
    assert (service.probe_interval_seconds, service.probe_timeout_seconds, service.unhealthy_after_probes) == (
        5.0,
        2.0,
        3,
    )
    assert service.manager == "systemd"


# -- managers --------------------------------------------------------------------------------------


def test_command_manager_starts_stops_and_restarts_the_standin(tmp_path: Path) -> None:
    port = free_port()
    service = command_service(tmp_path, port)
    manager = CommandManager()
    manager.start(service)
    try:
        first = pid_of(tmp_path)
        assert running(first)
        assert HealthProber([service]).probe_once("sglang").ok
        manager.restart(service)
        second = pid_of(tmp_path)
        assert second != first
        assert not running(first)
        assert HealthProber([service]).probe_once("sglang").ok
    finally:
        manager.stop(service)
    assert not (tmp_path / "sglang.pid").exists()
    assert not HealthProber([service]).probe_once("sglang").ok


def test_command_manager_failures_raise_with_the_output(tmp_path: Path) -> None:
    service = ServiceConfig(
        name="broken",
        manager="command",
        start_command=[sys.executable, "-c", "import sys; print('no GPU for you'); sys.exit(2)"],
        stop_command=["/nonexistent/stop"],
    )
    with pytest.raises(ServiceError, match="broken start_command failed: exit 2: no GPU for you"):
        CommandManager().start(service)
    with pytest.raises(ServiceError, match="cannot run /nonexistent/stop"):
        CommandManager().stop(service)
    assert CommandManager().is_active(service) is None


def test_command_manager_status_command_answers_is_active(tmp_path: Path) -> None:
    def answering(name: str, status: str) -> ServiceConfig:
        return ServiceConfig(
            name=name,
            manager="command",
            start_command=["/bin/true"],
            stop_command=["/bin/true"],
            status_command=[status],
        )

    yes, no = answering("a", "/bin/true"), answering("b", "/bin/false")
    assert CommandManager().is_active(yes) is True
    assert CommandManager().is_active(no) is False
    prober = HealthProber([yes, no], {"a": CommandManager(), "b": CommandManager()})
    assert prober.probe_once("a").detail == "active"
    assert not prober.probe_once("b").ok


def test_systemd_manager_runs_systemctl_through_its_prefix(tmp_path: Path) -> None:
    # A fake "systemctl" recording its argv proves the prefix and the verbs (the real one is
    # exercised in test_systemd_restart.py, inside a sandboxed systemd).
    log = tmp_path / "calls"
    fake = tmp_path / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" != is-active ]\n')
    fake.chmod(0o755)
    manager = SystemdManager([str(fake)])
    service = ServiceConfig(name="sglang", unit="sglang-main.service")
    manager.start(service)
    manager.stop(service)
    manager.restart(service)
    assert manager.is_active(service) is False
    assert log.read_text().splitlines() == [
        "start sglang-main.service",
        "stop sglang-main.service",
        "restart sglang-main.service",
        "is-active --quiet sglang-main.service",
    ]
    with pytest.raises(ServiceError, match="cannot run /nonexistent/systemctl"):
        SystemdManager(["/nonexistent/systemctl"]).start(service)


def test_build_managers_leaves_host_units_alone_unless_host_root_is_real(tmp_path: Path) -> None:
    config = AgentConfig(
        host_root=str(tmp_path),
        services=[
            ServiceConfig(name="unit"),
            ServiceConfig(name="cmd", manager="command", start_command=["/bin/true"], stop_command=["/bin/true"]),
        ],
    )
    fake_tree = HostContext(HostPaths.at(tmp_path))
    managers = build_managers(config, fake_tree)
    assert set(managers) == {"cmd"}
    assert isinstance(managers["cmd"], CommandManager)
    aimed = build_managers(config, fake_tree, systemctl_argv=["nsenter", "-t", "1", "systemctl"])
    assert isinstance(aimed["unit"], SystemdManager)
    assert aimed["unit"].systemctl_argv == ("nsenter", "-t", "1", "systemctl")
    real = build_managers(config, HostContext(HostPaths.at("/")))
    assert isinstance(real["unit"], SystemdManager)
    assert real["unit"].systemctl_argv == ("systemctl",)


# -- prober ----------------------------------------------------------------------------------------


def test_prober_healthy_then_503_three_times_emits_one_unhealthy_event(tmp_path: Path) -> None:
    with StandinServer(tmp_path) as server:
        prober = HealthProber([probed(server.health_url)])
        first = prober.probe_once("sglang")
        assert first.ok and first.detail == "HTTP 200"
        assert first.latency_seconds is not None and 0 < first.latency_seconds < 0.5
        assert prober.statuses()[0].up is True
        assert prober.take_events() == []  # first verdict "healthy" is not a transition

        server.set_mode("503")
        details = [prober.probe_once("sglang").detail for _ in range(2)]
        assert details == ["HTTP 503", "HTTP 503"]
        status = prober.statuses()[0]
        assert (status.up, status.consecutive_failures) == (True, 2)  # not yet declared
        assert prober.take_events() == []

        prober.probe_once("sglang")
        events = prober.take_events()
        assert [e.kind for e in events] == [EventKind.SERVICE_UNHEALTHY]
        event = events[0]
        assert event.severity is Severity.CRITICAL
        assert event.suggested_action is SuggestedAction.RESTART_SERVICE
        assert event.key == "service_unhealthy:sglang"
        assert event.source == "probe"
        assert event.data["service"] == "sglang" and event.data["consecutive_failures"] == 3
        assert "HTTP 503" in event.message

        for _ in range(3):
            prober.probe_once("sglang")
        assert prober.take_events() == []  # still down: no new event
        status = prober.statuses()[0]
        assert (status.up, status.consecutive_failures, status.detail) == (False, 6, "HTTP 503")

        server.set_mode("ok")
        assert prober.probe_once("sglang").ok
        events = prober.take_events()
        assert [e.kind for e in events] == [EventKind.SERVICE_HEALTHY]
        assert events[0].key == "service_healthy:sglang"
        status = prober.statuses()[0]
        assert (status.up, status.consecutive_failures) == (True, 0)


def test_prober_counts_a_hang_as_a_timeout(tmp_path: Path) -> None:
    with StandinServer(tmp_path) as server:
        prober = HealthProber([probed(server.health_url, probe_timeout_seconds=0.3, unhealthy_after_probes=2)])
        server.set_mode("hang")
        began = time.monotonic()
        result = prober.probe_once("sglang")
        took = time.monotonic() - began
        assert not result.ok
        assert result.detail == "timed out after 0.3 s"
        assert 0.25 < took < 2.0
        assert result.latency_seconds is not None and result.latency_seconds >= 0.25
        assert prober.statuses()[0].consecutive_failures == 1
        prober.probe_once("sglang")
        assert [e.kind for e in prober.take_events()] == [EventKind.SERVICE_UNHEALTHY]
        server.set_mode("ok")
        assert prober.probe_once("sglang").ok
        assert [e.kind for e in prober.take_events()] == [EventKind.SERVICE_HEALTHY]


def test_prober_sees_a_crashed_server_as_refused(tmp_path: Path) -> None:
    server = StandinServer(tmp_path).start()
    prober = HealthProber([probed(server.health_url, unhealthy_after_probes=1)])
    assert prober.probe_once("sglang").ok
    server.set_mode("exit")
    assert server.proc is not None
    assert server.proc.wait(5) == 3  # the stand-in's crash status
    server.stop()
    result = prober.probe_once("sglang")
    assert not result.ok
    assert "refused" in result.detail
    assert [e.kind for e in prober.take_events()] == [EventKind.SERVICE_UNHEALTHY]


def test_unprobed_service_reports_up_none(tmp_path: Path) -> None:
    prober = HealthProber([probed(f"http://127.0.0.1:{free_port()}/health"), ServiceConfig(name="other")])
    assert [(s.name, s.up, s.unit) for s in prober.statuses()] == [
        ("sglang", None, "sglang.service"),
        ("other", None, "other.service"),
    ]
    assert prober.can_probe("sglang")
    assert not prober.can_probe("other")  # no health URL and no manager to ask
    with pytest.raises(ValueError, match="no health_url and no manager"):
        prober.probe_once("other")


def test_failures_while_the_agent_restarts_a_service_are_not_counted(tmp_path: Path) -> None:
    with StandinServer(tmp_path) as server:
        prober = HealthProber([probed(server.health_url, unhealthy_after_probes=1)])
        assert prober.probe_once("sglang").ok
        prober.expect_down("sglang", 60)
        server.set_mode("503")
        for _ in range(3):
            prober.probe_once("sglang")
        status = prober.statuses()[0]
        assert (status.up, status.consecutive_failures) == (True, 0)
        assert status.detail == "restart in progress: HTTP 503"
        assert prober.take_events() == []
        server.set_mode("ok")
        assert prober.probe_once("sglang").ok  # success ends the window
        server.set_mode("503")
        prober.probe_once("sglang")
        assert [e.kind for e in prober.take_events()] == [EventKind.SERVICE_UNHEALTHY]


def test_wait_healthy_waits_for_a_loading_server(tmp_path: Path) -> None:
    with StandinServer(tmp_path, extra_args=("--ready-after-seconds", "1.0")) as server:
        prober = HealthProber([probed(server.health_url, unhealthy_after_probes=1)])
        began = time.monotonic()
        result = prober.wait_healthy("sglang", timeout_seconds=10)
        assert result.ok
        assert 0.3 < time.monotonic() - began < 5
        assert prober.take_events() == []  # the 503s while loading were expected


def test_wait_healthy_gives_up_after_its_timeout(tmp_path: Path) -> None:
    with StandinServer(tmp_path) as server:
        server.set_mode("503")
        prober = HealthProber([probed(server.health_url, unhealthy_after_probes=1)])
        began = time.monotonic()
        result = prober.wait_healthy("sglang", timeout_seconds=0.5)
        assert not result.ok and result.detail == "HTTP 503"
        assert 0.4 < time.monotonic() - began < 3
        prober.probe_once("sglang")  # the window is over: failures count again
        assert [e.kind for e in prober.take_events()] == [EventKind.SERVICE_UNHEALTHY]


def test_prober_thread_probes_each_service_and_stops_promptly(tmp_path: Path) -> None:
    with StandinServer(tmp_path) as good, StandinServer(tmp_path) as wedged:
        wedged.set_mode("hang")
        services = [
            probed(good.health_url, name="good", probe_interval_seconds=0.05),
            probed(
                wedged.health_url,
                name="wedged",
                probe_interval_seconds=0.05,
                probe_timeout_seconds=0.3,
                unhealthy_after_probes=2,
            ),
        ]
        prober = HealthProber(services)
        thread = ProberThread(prober)
        thread.start()

        def settled() -> bool:
            status = {s.name: s for s in prober.statuses()}
            return bool(status["good"].up) and status["wedged"].up is False

        wait_until(settled, 5, "the good service up and the wedged one down", poll_seconds=0.05)
        status = {s.name: s for s in prober.statuses()}
        assert status["good"].up is True
        assert status["wedged"].up is False  # the hanging server did not hold up the other one
        assert status["wedged"].detail == "timed out after 0.3 s"
        began = time.monotonic()
        thread.stop()
        assert time.monotonic() - began < 1.5
        assert not any(t.name.startswith("probe-") for t in threading.enumerate())
        events = prober.take_events()
        assert [(e.kind, e.data["service"]) for e in events] == [(EventKind.SERVICE_UNHEALTHY, "wedged")]


def test_a_command_service_has_no_unit_to_show() -> None:
    """Only systemd runs units: a service started by commands is not shown as NAME.service."""
    by_commands = ServiceConfig(
        name="sglang", manager="command", start_command=["/bin/true"], stop_command=["/bin/true"]
    )
    by_systemd = ServiceConfig(name="vllm")
    named = ServiceConfig(name="llm", unit="llm-main.service")
    statuses = {s.name: s.unit for s in HealthProber([by_commands, by_systemd, named]).statuses()}
    assert statuses == {"sglang": "", "vllm": "vllm.service", "llm": "llm-main.service"}


def test_a_standin_that_cannot_start_on_a_lost_gpu_says_why(tmp_path: Path) -> None:
    """The stand-in forks into the background; when the server dies before it listens (its GPU fell
    off the bus), the start command's stderr carries the reason into the ServiceError (and so into
    the restart's outcome and event), not only "exited during start"."""
    from agent.backend.sim import SimulatedBackend

    gpus = SimulatedBackend("h200x2", tmp_path / "sim")
    gpus.init()
    gpus.set_lost(1)
    gpus.shutdown()
    port = free_port()
    base = command_service(tmp_path, port)
    argv = [*(base.start_command or []), "--sim-state-dir", str(tmp_path / "sim"), "--sim-profile", "h200x2"]
    service = base.model_copy(update={"start_command": [*argv, "--gpus", "1"]})
    with pytest.raises(ServiceError) as failed:
        CommandManager().start(service)
    message = str(failed.value)
    assert "standin: server exited during start: standin: cannot run on simulated GPUs 1:" in message, message
    assert "GPU 1: GPU has fallen off the bus" in message, message
