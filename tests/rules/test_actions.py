"""actions.dispatch.execute with real parts: the simulated backend for the GPUs, a stand-in inference server
process started and stopped by its configured commands, real hook processes, a local HTTP server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import structlog
from action_kinds import ActionKind
from helpers import action_context, http_server, make_event, wait_until
from hosttree import NOBODY_ID, ScriptedHostContext, make_host_tree
from pydantic import ValidationError
from race import attempts, swapping
from slow_endpoint import SlowEndpoint

from agent.backend.base import RecoveryAction
from agent.backend.errors import GpuErrorKind
from agent.backend.sim import SimulatedBackend
from agent.config import AgentConfig, Mode
from agent.config.remediation import RemediationConfig
from agent.config.service_entry import ServiceConfig
from agent.daemon.alert_book import Found
from agent.demo import standin
from agent.demo.standin import running
from agent.demo.standin_process import free_port
from agent.events import Event, EventKind, Severity, SuggestedAction, event_json
from agent.policy.base import HostContext
from agent.rules.actions.base import ActionError
from agent.rules.actions.context import ActionContext
from agent.rules.actions.dispatch import execute
from agent.rules.actions.http_client import post_json, redacted_url
from agent.rules.actions.kinds.reset_gpu import ResetGpuParams
from agent.rules.actions.kinds.restart_service import RestartServiceParams
from agent.rules.actions.registry import KINDS
from agent.rules.config import ActionStep
from agent.rules.model import ActionSpec, Decision, Outcome, Target
from agent.services.managers import CommandManager, build_managers
from agent.services.scrape import scrape

STANDIN = str(Path(standin.__file__))
PROFILE = "h200x2"
UUID0 = "GPU-8bb8f26c-9cd6-525f-ae91-348f344348a2"  # GPU 0 of the simulated h200x2


# -- the node --------------------------------------------------------------------------------------


@dataclass
class Node:
    tmp: Path
    config: AgentConfig
    backend: SimulatedBackend
    ctx: ActionContext
    pid_file: Path
    started: list[str] = field(default_factory=list)

    def service_pid(self) -> int:
        return int(self.pid_file.read_text())

    def gpu_pids(self, gpu: int = 0) -> list[int]:
        return [p.pid for p in self.backend.compute_processes(gpu)]

    def start_service(self) -> int:
        service = self.config.services[0]
        CommandManager().start(service)
        assert self.ctx.prober is not None
        assert self.ctx.prober.wait_healthy(service.name, 10).ok
        return self.service_pid()


def standin_service(tmp: Path, state_dir: Path, profile: str, gpus: list[int], **fields: Any) -> ServiceConfig:
    port = free_port()
    pid_file = tmp / "sglang.pid"
    sim_args = ["--sim-state-dir", str(state_dir), "--sim-profile", profile, "--gpus", ",".join(map(str, gpus))]
    return ServiceConfig.model_validate(
        {
            "name": "sglang",
            "manager": "command",
            "start_command": [
                sys.executable,
                STANDIN,
                "--daemon",
                "--port",
                str(port),
                "--pid-file",
                str(pid_file),
                *sim_args,
            ],
            "stop_command": [sys.executable, STANDIN, "--stop", "--pid-file", str(pid_file)],
            "health_url": f"http://127.0.0.1:{port}/health",
            "gpus": gpus,
            "probe_interval_seconds": 0.1,
            "probe_timeout_seconds": 1.0,
            "ready_timeout_seconds": 15,
            **fields,
        }
    )


def make_node(
    tmp: Path,
    mode: Mode = Mode.ENFORCE,
    profile: str = PROFILE,
    remediation: RemediationConfig | None = None,
    service_fields: dict[str, Any] | None = None,
    host: HostContext | None = None,
) -> Node:
    state_dir = tmp / "state"
    service = standin_service(tmp, state_dir, profile, [0], **(service_fields or {}))
    config = AgentConfig.model_validate(
        {
            "mode": mode.value,
            "backend": "simulated",
            "host_root": str(tmp / "host"),
            "state_dir": str(state_dir),
            "policy": {"gpus": [{"match": {"model": "NVIDIA H200*"}, "power_limit_watts": 500}]},
            "services": [service.model_dump()],
            "remediation": (remediation or RemediationConfig()).model_dump(),
        }
    )
    backend = SimulatedBackend(profile, state_dir, writable_items=config.writable_items())
    backend.init()
    host = host or HostContext(make_host_tree(tmp / "host"))
    ctx = action_context(
        config,
        backend,
        host,
        build_managers(config, host),
        hostname="gpu-node-7",
        drain_timeout_seconds=5.0,
        drain_poll_seconds=0.05,
    )
    return Node(tmp, config, backend, ctx, tmp / "sglang.pid")


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = make_node(tmp_path)
    yield made
    CommandManager().stop(made.config.services[0])


def event(
    kind: EventKind = EventKind.XID,
    gpu: int | None = 0,
    uuid: str | None = UUID0,
    data: dict[str, Any] | None = None,
    severity: Severity = Severity.CRITICAL,
) -> Event:
    """An NVML event on the simulated GPU 0 (Xid 48 by default) whose remedy is a reset."""
    return make_event(
        kind,
        gpu,
        uuid=uuid,
        severity=severity,
        timestamp_seconds=1_700_000_000.0,
        source="nvml",
        key=f"{kind.value}:{uuid}",
        suggested_action=SuggestedAction.RESET_GPU,
        **({"xid": 48} if data is None else data),
    )


def spec(kind: ActionKind, params: dict[str, Any] | None = None) -> ActionSpec:
    """The step as a rules file would give it: `{kind: params}` validated by the same models."""
    return ActionStep.model_validate({kind.value: params or {}}).spec()


def decision(
    kind: ActionKind,
    params: dict[str, Any] | None = None,
    ev: Event | None = None,
    target: Target | None = None,
    dry_run: bool = False,
) -> Decision:
    return Decision(
        rule="xid-reset",
        event=ev or event(),
        target=target or Target(gpu=0, uuid=UUID0),
        action=spec(kind, params),
        step=0,
        attempt=1,
        reason="Xid 48 on GPU 0",
        dry_run=dry_run,
    )


# -- the envelope ---------------------------------------------------------------------------------------


def test_suppressed_and_dry_run_decisions_do_nothing(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    marker = tmp_path / "ran"
    hook = write_hook(tmp_path, f"#!/bin/sh\ntouch {marker}\n")
    suppressed = Decision("r", event(), Target(gpu=0), None, 1, 3, "cooldown: 120 s left")
    outcome = execute(suppressed, node.ctx)
    assert (outcome.outcome, outcome.detail) == (Outcome.SUPPRESSED, "cooldown: 120 s left")
    dry = execute(decision(ActionKind.RUN_HOOK, {"argv": [str(hook)]}, dry_run=True), node.ctx)
    assert dry.outcome is Outcome.DRY_RUN
    assert dry.detail == "dry run: would run_hook (gpu:" + UUID0 + ")"
    assert not marker.exists()
    assert dry.started_seconds <= dry.finished_seconds


@pytest.mark.parametrize(
    ("kind", "target", "would"),
    [
        (
            ActionKind.RESTART_SERVICE,
            Target(gpu=0, uuid=UUID0, service="sglang"),
            "run restart_service on service sglang",
        ),
        (ActionKind.RESET_GPU, Target(gpu=0, uuid=UUID0), "run reset_gpu on GPU 0"),
        (ActionKind.REBOOT, Target(gpu=0, uuid=UUID0), "run reboot on the node"),
    ],
)
def test_observe_mode_records_what_would_change_the_node_as_a_dry_run(
    tmp_path: Path, kind: ActionKind, target: Target, would: str
) -> None:
    host = ScriptedHostContext(make_host_tree(tmp_path / "host"))
    node = make_node(tmp_path, mode=Mode.OBSERVE, remediation=RemediationConfig(allow_reboot=True), host=host)
    first = node.start_service()
    node.backend.set_recovery_action(0, RecoveryAction.GPU_RESET)
    outcome = execute(decision(kind, target=target), node.ctx)
    assert (outcome.outcome, outcome.detail) == (Outcome.DRY_RUN, f"observe mode: would {would} (rule xid-reset)")
    assert node.backend.recovery_action(0) == RecoveryAction.GPU_RESET  # no reset happened
    assert node.service_pid() == first  # no restart either
    assert host.calls == []  # nor a reboot


def test_the_kinds_that_change_the_node_are_the_restart_the_reset_and_the_reboot() -> None:
    assert sorted(name for name, kind in KINDS.items() if kind.changes_node) == [
        "reboot",
        "reset_gpu",
        "restart_service",
    ]


def test_observe_mode_still_runs_hooks_and_notifications(tmp_path: Path) -> None:
    node = make_node(tmp_path, mode=Mode.OBSERVE)
    marker = tmp_path / "ran"
    hook = write_hook(tmp_path, f"#!/bin/sh\ntouch {marker}\n")
    assert execute(decision(ActionKind.RUN_HOOK, {"argv": [str(hook)]}), node.ctx).outcome is Outcome.SUCCESS
    assert marker.exists()
    with Receiver() as receiver:
        outcome = execute(decision(ActionKind.WEBHOOK, {"url": receiver.url("/hook")}), node.ctx)
    assert outcome.outcome is Outcome.SUCCESS
    assert len(receiver.requests) == 1
    outcome = execute(decision(ActionKind.RECOMMEND_REBOOT), node.ctx)
    assert outcome.outcome is Outcome.SUCCESS
    assert (Path(node.config.state_dir) / "reboot-recommended").exists()


def test_an_unexpected_error_is_a_failed_outcome_not_an_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(tmp_path)

    def broken(gpu: int) -> None:
        raise ValueError(f"GPU {gpu}: a bug")

    monkeypatch.setattr(node.backend, "identity", broken)
    with structlog.testing.capture_logs() as logs:
        outcome = execute(decision(ActionKind.RESET_GPU), node.ctx)
    assert outcome.outcome is Outcome.FAILED
    assert outcome.detail == "internal error: ValueError: GPU 0: a bug"
    assert [entry["event"] for entry in logs] == ["action failed unexpectedly", "action carried out"]
    assert logs[0]["log_level"] == "error" and logs[1]["outcome"] == "failed"


def test_parameters_arrive_as_the_kinds_model(tmp_path: Path) -> None:
    """The rules file's models are what the handlers get: no dict, no second check."""
    for name, kind in KINDS.items():
        assert ActionStep.model_fields[name].annotation == kind.params | None
    restart = spec(ActionKind.RESTART_SERVICE, {"service": "sglang", "ready_timeout_seconds": 30})
    assert restart.options == RestartServiceParams(service="sglang", ready_timeout_seconds=30)
    assert restart.params == {"service": "sglang", "ready_timeout_seconds": 30.0}  # as the store records it
    assert spec(ActionKind.RESET_GPU).options == ResetGpuParams()
    assert ActionSpec(ResetGpuParams()).kind == "reset_gpu"  # the kind is its parameters' own
    with pytest.raises(TypeError, match="reboot got ResetGpuParams"):
        KINDS["reboot"].execute(decision(ActionKind.REBOOT), ResetGpuParams(), make_node(tmp_path).ctx)


# -- restart_service --------------------------------------------------------------------------------


def test_restart_service_with_the_command_adapter(node: Node) -> None:
    first = node.start_service()
    assert node.gpu_pids() == [first]
    restart = decision(
        ActionKind.RESTART_SERVICE,
        target=Target(service="sglang"),
        ev=event(EventKind.SERVICE_UNHEALTHY, None, None, {"service": "sglang"}),
    )
    outcome = execute(restart, node.ctx)
    assert outcome.outcome is Outcome.SUCCESS, outcome.detail
    assert outcome.detail.startswith("restarted sglang; sglang healthy after ")
    second = node.service_pid()
    assert second != first
    assert not running(first)
    assert node.gpu_pids() == [second]
    assert node.ctx.prober is not None
    assert node.ctx.prober.probe_once("sglang").ok
    assert node.ctx.prober.take_events() == []  # the restart's own outage raised no event


def test_restart_from_a_gpu_event_restarts_the_services_on_that_gpu(node: Node) -> None:
    first = node.start_service()
    outcome = execute(decision(ActionKind.RESTART_SERVICE, ev=event(data={"xid": 43})), node.ctx)
    assert outcome.outcome is Outcome.SUCCESS, outcome.detail
    assert node.service_pid() != first
    other_gpu = decision(ActionKind.RESTART_SERVICE, target=Target(gpu=1), ev=event(gpu=1, uuid=None))
    outcome = execute(other_gpu, node.ctx)
    assert outcome.outcome is Outcome.FAILED
    assert "no service uses its GPU" in outcome.detail


def test_restart_fails_when_the_service_does_not_come_back_healthy(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    service = node.config.services[0]
    try:
        node.start_service()
        # The restarted server "loads its model" for longer than the action waits.
        slow = service.model_copy(
            update={"start_command": [*(service.start_command or []), "--ready-after-seconds", "30"]}
        )
        node.ctx.config = node.config.model_copy(update={"services": [slow]})
        outcome = execute(
            decision(ActionKind.RESTART_SERVICE, {"ready_timeout_seconds": 0.5}, target=Target(service="sglang")),
            node.ctx,
        )
        assert outcome.outcome is Outcome.FAILED
        assert outcome.detail == "restarted sglang; sglang not healthy within 0.5 s (HTTP 503)"
    finally:
        CommandManager().stop(service)


def test_restart_is_refused_without_a_manager_and_fails_for_unknown_services(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    unit = ServiceConfig(name="vllm", unit="vllm.service")
    node.ctx.config = node.config.model_copy(update={"services": [*node.config.services, unit]})
    node.ctx.managers = build_managers(node.ctx.config, node.ctx.host)  # host_root is a test tree
    outcome = execute(decision(ActionKind.RESTART_SERVICE, target=Target(service="vllm")), node.ctx)
    assert outcome.outcome is Outcome.REFUSED
    assert outcome.detail.startswith("no service manager for vllm (systemd units are only driven when host_root is /")
    outcome = execute(decision(ActionKind.RESTART_SERVICE, {"service": "tgi"}), node.ctx)
    assert (outcome.outcome, outcome.detail) == (Outcome.FAILED, "unknown service(s) tgi (not in services:)")


# -- reset_gpu --------------------------------------------------------------------------------------


def test_reset_gpu_full_safe_sequence(node: Node) -> None:
    node.ctx.policy.apply()
    assert node.backend.power_limit_watts(0) == 500
    node.backend.set_recovery_action(0, RecoveryAction.GPU_RESET)
    first = node.start_service()
    assert node.gpu_pids() == [first]

    outcome = execute(decision(ActionKind.RESET_GPU), node.ctx)

    assert outcome.outcome is Outcome.SUCCESS, outcome.detail
    steps = outcome.detail.split("; ")
    assert steps[0] == "stopped sglang"
    assert steps[1].startswith("GPU 0 idle after ")
    assert steps[2:6] == [
        "reset GPU 0",
        "settings put back: GPU 0 clocks unlocked, GPU 0 power limit 500 W",
        "policy re-applied (0 item(s) set)",  # the settings it drives are back already
        "started sglang",
    ]
    assert steps[6].startswith("sglang healthy after ")
    assert node.backend.recovery_action(0) == RecoveryAction.NONE  # the reset happened
    assert node.backend.power_limit_watts(0) == 500  # reset to 700 W by the reset, then put back
    second = node.service_pid()
    assert second != first and not running(first)
    assert node.gpu_pids() == [second]
    assert node.ctx.prober is not None
    assert node.ctx.prober.take_events() == []


def _unchanged(node: Node, pid: int) -> None:
    assert node.service_pid() == pid and running(pid)
    assert node.backend.recovery_action(0) == RecoveryAction.GPU_RESET


@pytest.mark.parametrize(
    ("ev", "why"),
    [
        (event(data={"xid": 79}), "Xid 79 / GPU lost: a reset cannot recover GPU 0; it needs a reboot"),
        (event(EventKind.GPU_LOST, data={}), "Xid 79 / GPU lost: a reset cannot recover GPU 0; it needs a reboot"),
    ],
    ids=["xid79", "gpu_lost_event"],
)
def test_reset_refused_for_xid_79(node: Node, ev: Event, why: str) -> None:
    node.backend.set_recovery_action(0, RecoveryAction.GPU_RESET)
    pid = node.start_service()
    outcome = execute(decision(ActionKind.RESET_GPU, ev=ev), node.ctx)
    assert (outcome.outcome, outcome.detail) == (Outcome.REFUSED, why)
    _unchanged(node, pid)


def test_reset_refused_for_a_lost_gpu(node: Node) -> None:
    pid = node.start_service()
    node.backend.set_lost(0)
    outcome = execute(decision(ActionKind.RESET_GPU), node.ctx)
    assert outcome.outcome is Outcome.REFUSED
    assert outcome.detail == "GPU 0 has fallen off the bus: a reset cannot recover it; it needs a reboot"
    assert node.service_pid() == pid and running(pid)
    node.backend.set_lost(0, False)


def test_reset_refused_when_the_index_names_another_gpu(node: Node) -> None:
    outcome = execute(decision(ActionKind.RESET_GPU, target=Target(gpu=0, uuid="GPU-elsewhere")), node.ctx)
    assert outcome.outcome is Outcome.REFUSED
    assert "re-enumerated" in outcome.detail


def test_reset_refused_with_mig_enabled(tmp_path: Path) -> None:
    profile = tmp_path / "mig-h200.json"
    profile.write_text(json.dumps({"gpus": [{"model": {"base": "h200", "mig_default": True}, "count": 2}]}))
    node = make_node(tmp_path, profile=str(profile))
    try:
        node.backend.set_recovery_action(0, RecoveryAction.GPU_RESET)
        pid = node.start_service()
        uuid = node.backend.identity(0).uuid
        outcome = execute(
            decision(ActionKind.RESET_GPU, target=Target(gpu=0, uuid=uuid), ev=event(uuid=uuid)), node.ctx
        )
        assert outcome.outcome is Outcome.REFUSED
        assert outcome.detail == "MIG is enabled on GPU 0: a reset destroys its MIG instances"
        _unchanged(node, pid)
    finally:
        CommandManager().stop(node.config.services[0])


def test_reset_refusal_says_whose_the_remaining_processes_are(node: Node) -> None:
    """A process of a configured service on another GPU (the reset stops only GPU 0's services) is
    named with its service; a stray one in some other unit with that unit."""
    node.backend.set_recovery_action(0, RecoveryAction.GPU_RESET)
    node.start_service()
    embeddings = ServiceConfig(name="embeddings", unit="embeddings.service", gpus=[1])
    node.ctx.config = node.config.model_copy(update={"services": [*node.config.services, embeddings]})
    node.backend.set_processes(0, [5151, 4242])
    for pid, comm, unit in ((5151, "python3", "embeddings.service"), (4242, "jupyter", "jupyter.service")):
        proc_dir = node.ctx.host.paths.path(f"/proc/{pid}")
        proc_dir.mkdir(parents=True)
        (proc_dir / "comm").write_text(f"{comm}\n")
        (proc_dir / "cgroup").write_text(f"0::/system.slice/{unit}\n")
    node.ctx.drain_timeout_seconds = 0.2

    outcome = execute(decision(ActionKind.RESET_GPU), node.ctx)

    assert outcome.outcome is Outcome.REFUSED
    assert outcome.detail.split("; ")[1].startswith(
        "processes 5151 (python3, service embeddings), 4242 (jupyter, jupyter.service, in no configured service)"
        " still on GPU 0 after "
    )
    assert node.backend.recovery_action(0) == RecoveryAction.GPU_RESET  # not reset


def test_reset_refused_when_processes_remain_and_services_come_back(node: Node) -> None:
    node.backend.set_recovery_action(0, RecoveryAction.GPU_RESET)
    first = node.start_service()
    # A process the agent does not manage (a stray notebook, a monitoring tool) holds the GPU too.
    node.backend.set_processes(0, [first, 4242])
    proc_dir = node.ctx.host.paths.path("/proc/4242")
    proc_dir.mkdir(parents=True)
    (proc_dir / "comm").write_text("jupyter\n")
    node.ctx.drain_timeout_seconds = 0.5

    outcome = execute(decision(ActionKind.RESET_GPU), node.ctx)

    assert outcome.outcome is Outcome.REFUSED
    steps = outcome.detail.split("; ")
    assert steps[0] == "stopped sglang"
    assert steps[1].startswith("processes 4242 (jupyter, in no configured service) still on GPU 0 after ")
    assert steps[2] == "started sglang"
    assert node.backend.recovery_action(0) == RecoveryAction.GPU_RESET  # not reset
    second = node.service_pid()
    assert second != first and running(second)
    assert sorted(node.gpu_pids()) == sorted([4242, second])
    assert node.ctx.prober is not None
    assert node.ctx.prober.wait_healthy("sglang", 10).ok


def test_services_come_back_when_the_sequence_breaks_after_the_reset(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = node.start_service()
    node.backend.fail_call(None, "device_count", GpuErrorKind.UNKNOWN)  # the policy cannot even enumerate
    outcome = execute(decision(ActionKind.RESET_GPU), node.ctx)
    node.backend.fail_call(None, "device_count", None)
    assert outcome.outcome is Outcome.FAILED
    steps = outcome.detail.split("; ")
    assert steps[2:4] == ["reset GPU 0", "settings put back: GPU 0 clocks unlocked, GPU 0 power limit 700 W"]
    assert steps[4].startswith("policy re-apply failed: injected failure of device_count")
    assert steps[5] == "started sglang" and steps[6].startswith("sglang healthy after ")
    second = node.service_pid()
    assert second != first and running(second)

    def broken_apply(dry_run: bool = False) -> None:
        raise RuntimeError("engine bug")

    monkeypatch.setattr(node.ctx.policy, "apply", broken_apply)
    outcome = execute(decision(ActionKind.RESET_GPU), node.ctx)
    assert outcome.outcome is Outcome.FAILED
    assert "; unexpected error: RuntimeError: engine bug; started sglang; sglang healthy after " in outcome.detail
    assert running(node.service_pid()) and node.service_pid() != second


def test_reset_without_services_and_with_a_failing_policy_item(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    node.ctx.config = node.config.model_copy(update={"services": []})
    node.ctx.policy.config = node.ctx.config
    node.backend.set_recovery_action(1, RecoveryAction.GPU_RESET)
    node.backend.fail_call(1, "set_power_limit_watts", GpuErrorKind.UNKNOWN)
    uuid1 = node.backend.identity(1).uuid
    outcome = execute(
        decision(ActionKind.RESET_GPU, target=Target(gpu=1, uuid=uuid1), ev=event(gpu=1, uuid=uuid1)), node.ctx
    )
    assert outcome.outcome is Outcome.FAILED
    assert node.backend.recovery_action(1) == RecoveryAction.NONE
    assert "reset GPU 1" in outcome.detail
    assert "policy re-applied with 1 failure(s): power_limit GPU 1: " in outcome.detail


# -- run_hook -----------------------------------------------------------------------------------------


def write_hook(directory: Path, text: str, mode: int = 0o755) -> Path:
    hook = directory / "hooks" / "hook.sh"
    hook.parent.mkdir(exist_ok=True)
    hook.parent.chmod(0o755)
    hook.write_text(text)
    hook.chmod(mode)
    return hook


def test_hook_gets_the_event_on_stdin_and_gpu_agent_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = make_node(tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    out = tmp_path / "out"
    hook = write_hook(tmp_path, f'#!/bin/sh\ncat > {out}.json\nenv > {out}.env\necho hook ran for "$1"\n')
    outcome = execute(decision(ActionKind.RUN_HOOK, {"argv": [str(hook), "first arg"]}), node.ctx)
    assert outcome.outcome is Outcome.SUCCESS, outcome.detail
    assert outcome.detail == f"hook {hook} exit 0: hook ran for first arg"
    payload = json.loads((tmp_path / "out.json").read_text())
    assert payload["rule"] == "xid-reset" and payload["action"] == "run_hook" and payload["host"] == "gpu-node-7"
    assert payload["event"]["kind"] == "xid" and payload["event"]["data"] == {"xid": 48}
    assert payload["target"] == {"gpu": 0, "uuid": UUID0, "service": None}
    env = dict(line.split("=", 1) for line in (tmp_path / "out.env").read_text().splitlines() if "=" in line)
    assert env["PATH"] == "/usr/sbin:/usr/bin:/sbin:/bin"
    assert env["LANG"] == "C.UTF-8"
    assert env["GPU_AGENT_EVENT_KIND"] == "xid"
    assert env["GPU_AGENT_GPU"] == "0"
    assert env["GPU_AGENT_GPU_UUID"] == UUID0
    assert env["GPU_AGENT_XID"] == "48"
    assert env["GPU_AGENT_RULE"] == "xid-reset"
    assert env["GPU_AGENT_SEVERITY"] == "critical"
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert "hunter2" not in (tmp_path / "out.env").read_text()
    # sh adds PWD, SHLVL and _ itself; nothing else came from the agent's environment.
    assert set(env) - {"PWD", "SHLVL", "_"} == {
        "PATH",
        "LANG",
        "GPU_AGENT_EVENT_KIND",
        "GPU_AGENT_GPU",
        "GPU_AGENT_GPU_UUID",
        "GPU_AGENT_XID",
        "GPU_AGENT_RULE",
        "GPU_AGENT_SEVERITY",
        "GPU_AGENT_SERVICE",
    }


def test_hook_timeout_kills_its_process_group(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    child_pid_file = tmp_path / "child.pid"
    hook = write_hook(tmp_path, f"#!/bin/sh\necho started\nsleep 60 &\necho $! > {child_pid_file}\nwait\n")
    began = time.monotonic()
    outcome = execute(decision(ActionKind.RUN_HOOK, {"argv": [str(hook)], "timeout_seconds": 0.5}), node.ctx)
    assert time.monotonic() - began < 5
    assert outcome.outcome is Outcome.FAILED
    assert outcome.detail == f"hook {hook} timed out after 0.5 s (process group killed): started"
    child = int(child_pid_file.read_text())
    deadline = time.monotonic() + 5
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not running(child)  # the hook's own child died with it


def test_hook_nonzero_exit_fails_with_its_output(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    hook = write_hook(tmp_path, "#!/bin/sh\necho draining failed >&2\nexit 3\n")
    outcome = execute(decision(ActionKind.RUN_HOOK, {"argv": [str(hook)]}), node.ctx)
    assert (outcome.outcome, outcome.detail) == (Outcome.FAILED, f"hook {hook} exit 3: draining failed")


def test_hook_output_is_truncated(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    hook = write_hook(tmp_path, "#!/bin/sh\nhead -c 20000 /dev/zero | tr '\\0' 'a'\necho LAST\n")
    outcome = execute(decision(ActionKind.RUN_HOOK, {"argv": [str(hook)]}), node.ctx)
    assert outcome.outcome is Outcome.SUCCESS
    assert outcome.detail.endswith("LAST")
    assert "bytes cut]" in outcome.detail
    assert len(outcome.detail) < 4096 + 200


def test_hook_argv_is_never_given_to_a_shell(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    pwned = tmp_path / "pwned"
    hook = write_hook(tmp_path, '#!/bin/sh\nprintf "%s|" "$@"\n')
    argv = [str(hook), f"; touch {pwned}", "$(id)", "a b"]
    outcome = execute(decision(ActionKind.RUN_HOOK, {"argv": argv}), node.ctx)
    assert outcome.outcome is Outcome.SUCCESS
    assert outcome.detail == f"hook {hook} exit 0: ; touch {pwned}|$(id)|a b|"
    assert not pwned.exists()


@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_group_or_world_writable_hook_is_refused(tmp_path: Path, mode: int) -> None:
    node = make_node(tmp_path)
    marker = tmp_path / "ran"
    hook = write_hook(tmp_path, f"#!/bin/sh\ntouch {marker}\n", mode=mode)
    outcome = execute(decision(ActionKind.RUN_HOOK, {"argv": [str(hook)]}), node.ctx)
    assert outcome.outcome is Outcome.REFUSED
    assert outcome.detail.startswith(f"{hook} is writable by group or others (mode {mode:04o})")
    assert not marker.exists()


def test_hook_in_a_writable_directory_or_not_root_owned_is_refused(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    marker = tmp_path / "ran"
    hook = write_hook(tmp_path, f"#!/bin/sh\ntouch {marker}\n")

    def run(argv0: Path) -> tuple[Outcome, str]:
        outcome = execute(decision(ActionKind.RUN_HOOK, {"argv": [str(argv0)]}), node.ctx)
        return outcome.outcome, outcome.detail

    hook.parent.chmod(0o777)
    assert run(hook) == (
        Outcome.REFUSED,
        f"directory {hook.parent} of {hook} is writable by group or others (mode 0777):"
        " anyone who can write there can replace the file",
    )
    assert not marker.exists()
    hook.parent.chmod(0o755)
    assert run(hook)[0] is Outcome.SUCCESS and marker.exists()
    outcome, detail = run(tmp_path / "missing")
    assert outcome is Outcome.FAILED and "No such file" in detail, detail  # cannot run, not untrusted
    if os.geteuid() == 0:
        marker.unlink()
        os.chown(hook, 65534, 65534)
        assert run(hook) == (Outcome.REFUSED, f"{hook} is owned by uid 65534, not root: run `chown root: {hook}`")
        assert not marker.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="ownership checks apply when the agent runs as root")
def test_a_hook_link_swapped_to_a_users_script_never_runs_it(tmp_path: Path) -> None:
    """The race from the review, through the action: the hook's link is swapped between root's
    script and a user's as fast as possible while the rule's hook runs again and again. Each run
    either refuses the user's script or runs root's; a check of one file and an exec of the other
    would leave a mark in the user's file."""
    node = make_node(tmp_path)
    marks, hooks = tmp_path / "marks", tmp_path / "hooks"
    marks.mkdir()
    hooks.mkdir(mode=0o755)
    for who in ("root", "user"):
        script = hooks / f"{who}.sh"
        script.write_text(f'#!/bin/sh\necho "{who} $1" >> {marks}/{who}\n')
        script.chmod(0o755)
    os.chown(hooks / "user.sh", NOBODY_ID, NOBODY_ID)
    link, spare = hooks / "hook", hooks / "spare"
    link.symlink_to(hooks / "root.sh")
    spare.symlink_to(hooks / "user.sh")
    run_it = decision(ActionKind.RUN_HOOK, {"argv": [str(link), "xid"]})

    def attempt() -> str:
        done = execute(run_it, node.ctx)
        if done.outcome is Outcome.REFUSED:
            assert f"{hooks / 'user.sh'}" in done.detail and f"uid {NOBODY_ID}" in done.detail, done.detail
            return "refused"
        # The operator sees the hook as configured, never the /proc path it was run through.
        assert (done.outcome, done.detail) == (Outcome.SUCCESS, f"hook {link} exit 0"), done
        return "ran"

    with swapping(link, spare):
        outcomes = attempts(attempt, {"ran", "refused"}, 150)
    assert outcomes.get("ran") and outcomes.get("refused"), outcomes
    assert not (marks / "user").exists(), (marks / "user").read_text()
    assert (marks / "root").read_text().splitlines() == ["root xid"] * outcomes["ran"]


# -- webhook ---------------------------------------------------------------------------------------


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    """A local HTTP server thread that records POSTs and answers with `status`."""

    def __init__(self, status: int = 200, location: str | None = None) -> None:
        self.status = status
        self.location = location
        self.requests: list[Request] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                receiver.requests.append(Request(self.path, dict(self.headers.items()), self.rfile.read(length)))
                self.send_response(receiver.status)
                if receiver.location:
                    self.send_header("Location", receiver.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_webhook_posts_the_event_with_headers_and_hides_secrets(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    with Receiver() as receiver, structlog.testing.capture_logs() as logs:
        url = receiver.url("/services/T000/B000/s3cr3tpath?token=abc")
        params = {"url": url, "headers": {"Authorization": "Bearer topsecret", "X-Team": "gpu"}}
        outcome = execute(decision(ActionKind.WEBHOOK, params), node.ctx)
    assert outcome.outcome is Outcome.SUCCESS
    assert outcome.detail == f"POST http://127.0.0.1:{receiver.server.server_address[1]}/…: HTTP 200"
    (request,) = receiver.requests
    assert request.path == "/services/T000/B000/s3cr3tpath?token=abc"
    assert request.headers["Authorization"] == "Bearer topsecret"
    assert request.headers["X-Team"] == "gpu"
    assert request.headers["Content-Type"] == "application/json"
    body = json.loads(request.body)
    assert body["event"]["kind"] == "xid" and body["target"]["gpu"] == 0 and body["rule"] == "xid-reset"
    # The event as every other JSON document shows it (agent.events.event_json), plus its key.
    assert body["event"] == {**event_json(event()), "key": event().key}
    assert [entry["event"] for entry in logs] == ["action carried out"]
    for secret in ("topsecret", "s3cr3tpath", "token=abc"):
        assert secret not in outcome.detail
        assert secret not in repr(logs)


def test_webhook_non_2xx_and_redirects_fail(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    with Receiver(status=500) as receiver:
        outcome = execute(decision(ActionKind.WEBHOOK, {"url": receiver.url("/x")}), node.ctx)
    assert outcome.outcome is Outcome.FAILED
    assert outcome.detail.endswith(": HTTP 500")
    with Receiver() as elsewhere, Receiver(status=307, location=elsewhere.url("/steal")) as receiver:
        outcome = execute(
            decision(ActionKind.WEBHOOK, {"url": receiver.url("/x"), "headers": {"Authorization": "t"}}), node.ctx
        )
    assert outcome.outcome is Outcome.FAILED
    assert outcome.detail.endswith(": HTTP 307")
    assert elsewhere.requests == []  # the headers did not follow the redirect
    outcome = execute(
        decision(ActionKind.WEBHOOK, {"url": f"http://127.0.0.1:{free_port()}/x", "timeout_seconds": 2}), node.ctx
    )
    assert outcome.outcome is Outcome.FAILED
    assert "refused" in outcome.detail.lower()
    # Refused when the rules load, and by the client itself.
    with pytest.raises(ValidationError, match="must be an http:// or https:// URL"):
        spec(ActionKind.WEBHOOK, {"url": "file:///etc/passwd"})
    with pytest.raises(ActionError, match=r"^POST file:///…: not an http\(s\) URL$"):
        post_json("file:///etc/passwd", {}, 1.0)


DEADLINE_MARGIN_SECONDS = 1.0


def timed(call: Any) -> tuple[Any, float]:
    began = time.monotonic()
    result = call()
    return result, time.monotonic() - began


def test_webhook_to_a_dripping_server_is_cut_at_its_total_deadline(tmp_path: Path) -> None:
    """One byte every 2 s keeps every socket read short of its timeout; the request as a whole
    still ends at timeout_seconds, and the connection is closed, not left to drip."""
    node = make_node(tmp_path)
    with SlowEndpoint("drip", "--interval", "2") as server:
        outcome, took = timed(
            lambda: execute(decision(ActionKind.WEBHOOK, {"url": server.url("/hook"), "timeout_seconds": 5}), node.ctx)
        )
        assert 5 <= took < 5 + DEADLINE_MARGIN_SECONDS, took
        assert (outcome.outcome, outcome.detail) == (
            Outcome.FAILED,
            f"POST {server.url()}/…: timed out: no complete answer within 5 s",
        )
        assert server.lines[:1] == ["request 1"]
        assert server.wait_for("gone 1", timeout_seconds=5)  # the agent hung up


def found(name: str, for_seconds: float = 600.0, **labels: str) -> Found:
    """What the agent's verdict holds: the catalogue's alert `name` with these labels."""
    return Found(name, {"alertname": name, **labels}, {"summary": f"{name} from the catalogue"}, for_seconds)


def test_an_alertmanager_step_raises_the_catalogues_alert_of_its_fault_at_once(tmp_path: Path) -> None:
    """The step names no alert of its own: it raises the catalogue's alert of the decision's fault (an
    Xid 48 on GPU 0: GpuXidCritical, with those labels), which then fires as soon as the verdict holds
    it, without its `for`, and carries the event's text; the same alert on another GPU waits."""
    node = make_node(tmp_path, remediation=RemediationConfig(alertmanager_url="http://127.0.0.1:9"))
    params = {"summary": "paged by the rule", "annotations": {"team": "inference"}}
    outcome = execute(decision(ActionKind.ALERTMANAGER, params), node.ctx)
    assert (outcome.outcome, outcome.detail) == (
        Outcome.SUCCESS,
        f"alert GpuXidCritical or GpuXidError (gpu=0, uuid={UUID0}, xid=48) raised: pushed while the verdict holds it",
    )
    book = node.ctx.alerts
    ours = found("GpuXidCritical", gpu="0", uuid=UUID0, xid="48", action="reset_gpu")
    other = found("GpuXidCritical", gpu="1", uuid="GPU-1", xid="48", action="reset_gpu")
    assert book.update([ours, other], ("http://127.0.0.1:9",)) is True
    firing = {row.labels["gpu"]: row for row in book.active()}
    assert firing["0"].starts_at is not None and firing["1"].starts_at is None  # raised at once; the other waits
    assert firing["0"].annotations == {
        "summary": "paged by the rule",
        "team": "inference",
        "event": "xid on GPU 0",
    }


def test_an_on_exhausted_step_raises_the_rules_remediation_failing(tmp_path: Path) -> None:
    node = make_node(tmp_path, remediation=RemediationConfig(alertmanager_url=["http://127.0.0.1:9"]))
    exhausted = replace(decision(ActionKind.ALERTMANAGER), step=-1)
    outcome = execute(exhausted, node.ctx)
    assert outcome.detail == (
        "alert GpuAgentRemediationFailing (rule=xid-reset) raised: pushed while the verdict holds it"
    )
    failing = found("GpuAgentRemediationFailing", rule="xid-reset", cause="exhausted")
    assert node.ctx.alerts.update([failing], node.config.remediation.alertmanager_urls)
    (row,) = node.ctx.alerts.active()
    assert row.starts_at is not None


def test_an_alertmanager_step_with_nowhere_to_go_is_not_configured(tmp_path: Path) -> None:
    """No Alertmanager set is no failure of the alert (GpuAgentRemediationFailing must not page for
    every fault of a node without one), and neither is an event no alert of the catalogue is about."""
    outcome = execute(decision(ActionKind.ALERTMANAGER), make_node(tmp_path).ctx)
    assert (outcome.outcome, outcome.detail) == (
        Outcome.NOT_CONFIGURED,
        "no Alertmanager configured: set remediation.alertmanager_url or the step's url",
    )
    node = make_node(tmp_path, remediation=RemediationConfig(alertmanager_url="http://127.0.0.1:9"))
    corrected = event(EventKind.ECC_CORRECTED, data={"new_errors": 1})
    outcome = execute(decision(ActionKind.ALERTMANAGER, ev=corrected), node.ctx)
    assert (outcome.outcome, outcome.detail) == (
        Outcome.NOT_CONFIGURED,
        "no alert in the catalogue for a ecc_corrected event (docs/alerts.md)",
    )
    assert execute(
        decision(ActionKind.ALERTMANAGER, {"url": "http://127.0.0.1:9"}), make_node(tmp_path).ctx
    ).outcome is (Outcome.SUCCESS)


def test_an_alertmanager_step_that_names_its_own_alert_loads_and_raises_the_catalogues(tmp_path: Path) -> None:
    """0.1's steps named a severity, an alertname and labels: the rules still load (an upgrade keeps the
    admin's files), each such field is reported as ignored, and the alert raised is the catalogue's."""
    params = {"severity": "info", "alertname": "Mine", "labels": {"team": "x"}}
    step = spec(ActionKind.ALERTMANAGER, params)
    assert [field for field, _ in KINDS["alertmanager"].ignored_fields(step.options)] == [
        "severity",
        "alertname",
        "labels",
    ]
    assert KINDS["alertmanager"].ignored_fields(spec(ActionKind.ALERTMANAGER, {"summary": "s"}).options) == []
    node = make_node(tmp_path, remediation=RemediationConfig(alertmanager_url="http://127.0.0.1:9"))
    outcome = execute(decision(ActionKind.ALERTMANAGER, params), node.ctx)
    assert outcome.detail.startswith("alert GpuXidCritical or GpuXidError (gpu=0, "), outcome.detail
    with pytest.raises(ValidationError, match="severity"):  # still a string, as 0.1 took it
        spec(ActionKind.ALERTMANAGER, {"severity": ["critical"]})


def test_redacted_url_keeps_only_where_it_goes() -> None:
    assert redacted_url("https://user:pw@hooks.example.com:8443/a/b?c=d") == "https://hooks.example.com:8443/…"
    assert redacted_url("http://127.0.0.1:9093") == "http://127.0.0.1:9093"


# -- recommend_reboot and reboot -------------------------------------------------------------------


def test_recommend_reboot_writes_the_flag_and_raises_its_alert(tmp_path: Path) -> None:
    boot_id = tmp_path / "host/proc/sys/kernel/random/boot_id"
    node = make_node(tmp_path, remediation=RemediationConfig(alertmanager_url="http://127.0.0.1:9"))
    boot_id.parent.mkdir(parents=True)
    boot_id.write_text("7c1e9a4e-0000-4000-8000-000000000001\n")
    outcome = execute(decision(ActionKind.RECOMMEND_REBOOT, ev=event(data={"xid": 79})), node.ctx)
    flag_path = Path(node.config.state_dir) / "reboot-recommended"
    assert outcome.outcome is Outcome.SUCCESS, outcome.detail
    assert outcome.detail == (
        f"reboot recommended: wrote {flag_path}; alert GpuXidCritical or GpuXidError (gpu=0, uuid={UUID0}, xid=79) "
        "raised: pushed while the verdict holds it; alert GpuRebootRecommended raised: pushed while the verdict holds it"
    )
    flag = json.loads(flag_path.read_text())
    assert flag["reason"] == "xid on GPU 0"
    assert (flag["rule"], flag["gpu"], flag["uuid"], flag["xid"]) == ("xid-reset", 0, UUID0, 79)
    assert flag["boot_id"] == "7c1e9a4e-0000-4000-8000-000000000001"
    assert flag["time"].endswith("Z")
    # the verdict reads the flag on the next loop: the alert fires then, not after its `for`
    assert node.ctx.alerts.update([found("GpuRebootRecommended", cause="xid")], ("http://127.0.0.1:9",))


def test_a_lost_gpus_reboot_recommendation_never_reaches_alertmanager_before_gpulost(tmp_path: Path) -> None:
    """GpuLost inhibits GpuRebootRecommended, but Alertmanager can only hold back what arrives after
    the inhibiting alert: the recommendation raises GpuLost at once too (its `for` is a minute, the
    recommendation's none), so both fire in the same push and the fault pages without a ticket first."""
    node = make_node(tmp_path, remediation=RemediationConfig(alertmanager_url="http://127.0.0.1:9"))
    outcome = execute(decision(ActionKind.RECOMMEND_REBOOT, ev=event(EventKind.GPU_LOST, data={})), node.ctx)
    assert f"alert GpuLost (gpu=0, uuid={UUID0}) raised" in outcome.detail, outcome.detail
    urls = ("http://127.0.0.1:9",)
    assert node.ctx.alerts.update(
        [found("GpuLost", 60.0, gpu="0", uuid=UUID0), found("GpuRebootRecommended", 0.0, cause="gpu_lost")], urls
    )
    fired = {row.labels["alertname"] for row in node.ctx.alerts.active() if row.starts_at is not None}
    assert fired == {"GpuLost", "GpuRebootRecommended"}


def test_recommend_reboot_without_alertmanager_only_writes_the_flag(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    outcome = execute(decision(ActionKind.RECOMMEND_REBOOT, {"reason": "row remap failed"}), node.ctx)
    assert outcome.outcome is Outcome.SUCCESS
    assert json.loads((Path(node.config.state_dir) / "reboot-recommended").read_text())["reason"] == "row remap failed"


def test_reboot_needs_allow_reboot(tmp_path: Path) -> None:
    node = make_node(tmp_path)
    outcome = execute(decision(ActionKind.REBOOT), node.ctx)
    assert (outcome.outcome, outcome.detail) == (
        Outcome.REFUSED,
        "reboot is not allowed (remediation.allow_reboot is false)",
    )


def test_reboot_never_runs_against_a_test_tree(tmp_path: Path) -> None:
    node = make_node(tmp_path, remediation=RemediationConfig(allow_reboot=True))
    outcome = execute(decision(ActionKind.REBOOT), node.ctx)
    assert outcome.outcome is Outcome.REFUSED
    assert outcome.detail == f"reboot not run: not run: host_root is {tmp_path / 'host'}"


def test_reboot_runs_the_configured_command(tmp_path: Path) -> None:
    host = ScriptedHostContext(make_host_tree(tmp_path / "host"))
    remediation = RemediationConfig(allow_reboot=True, reboot_command=["/usr/bin/systemctl", "reboot", "--when=+1min"])
    node = make_node(tmp_path, remediation=remediation, host=host)
    outcome = execute(decision(ActionKind.REBOOT), node.ctx)
    assert (outcome.outcome, outcome.detail) == (
        Outcome.SUCCESS,
        "/usr/bin/systemctl reboot --when=+1min: reboot started",
    )
    assert host.calls == [("/usr/bin/systemctl", "reboot", "--when=+1min")]
    host.results["/usr/bin/systemctl"] = (1, "Access denied")
    outcome = execute(decision(ActionKind.REBOOT), node.ctx)
    assert (outcome.outcome, outcome.detail) == (
        Outcome.FAILED,
        "/usr/bin/systemctl reboot --when=+1min: exit 1: Access denied",
    )


# -- drain before a restart or reset ----------------------------------------------------------------


@dataclass
class DrainedNode:
    node: Node
    service: ServiceConfig
    journal: list[str]  # the action's journal lines
    told: Path  # what the drain hook wrote: the service it was run for
    first_pid: int  # the stand-in's pid before any action


@contextlib.contextmanager
def drained_node(
    tmp_path: Path, drain_seconds: float, timeout_seconds: float, metrics_url: str | None = None
) -> Iterator[DrainedNode]:
    """A node whose stand-in takes no new requests while `drain-file` exists (its running requests
    finish within `drain_seconds`), behind a drain hook that creates the file and says for whom;
    the stand-in started, and stopped on the way out whatever the test did. The drain reads
    `metrics_url` when given, else the stand-in's own."""
    drain_file = tmp_path / "drain-file"
    told = tmp_path / "hook-told"
    hook = write_hook(tmp_path, f'#!/bin/sh\necho "$GPU_AGENT_SERVICE" > {told}\ntouch {drain_file}\n')
    fields: dict[str, Any] = {"drain": {"hook": [str(hook)], "timeout_seconds": timeout_seconds}}
    if metrics_url is not None:
        fields["metrics_url"] = metrics_url
    node = make_node(tmp_path, service_fields=fields)
    service = node.config.services[0]
    extra = ["--drain-file", str(drain_file), "--drain-seconds", str(drain_seconds), "--request-rate", "40"]
    slow = service.model_copy(update={"start_command": [*(service.start_command or []), *extra]})
    node.config = node.config.model_copy(update={"services": [slow]})
    node.ctx.config = node.config
    journal: list[str] = []
    node.ctx.journal = journal.append
    try:
        yield DrainedNode(node, slow, journal, told, node.start_service())
    finally:
        CommandManager().stop(slow)


def running_requests(service: ServiceConfig) -> float:
    url = service.effective_metrics_url
    assert url is not None
    running = scrape(url, timeout_seconds=2.0).running
    assert running is not None
    return running


def test_a_restart_drains_first_and_waits_for_the_running_requests(tmp_path: Path) -> None:
    with drained_node(tmp_path, drain_seconds=1.5, timeout_seconds=20) as drained:
        wait_until(lambda: running_requests(drained.service) > 0, 10, "requests running")
        restart = decision(ActionKind.RESTART_SERVICE, target=Target(service="sglang"))
        outcome = execute(restart, drained.node.ctx)
        assert outcome.outcome is Outcome.SUCCESS, outcome.detail
        steps = outcome.detail.split("; ")
        assert steps[0] == f"drain hook {tmp_path / 'hooks' / 'hook.sh'} of sglang exit 0"
        waited = re.fullmatch(r"sglang drained: no request running after ([0-9.]+) s", steps[1])
        assert waited is not None, steps
        # the stand-in's requests take 1.5 s to finish once nothing new arrives: waited for, not skipped
        assert 1.0 <= float(waited.group(1)) < 10
        assert steps[2] == "restarted sglang"
        assert drained.journal == ["draining sglang", "drained sglang", "restarting sglang", "restarted sglang"]
        assert drained.told.read_text() == "sglang\n"
        assert drained.node.service_pid() != drained.first_pid
        assert not (tmp_path / "drain-file").exists()  # the new server takes requests again
        wait_until(lambda: running_requests(drained.service) > 0, 10, "requests running after the restart")


def test_a_drain_that_times_out_lets_the_restart_go_ahead(tmp_path: Path) -> None:
    with drained_node(tmp_path, drain_seconds=600, timeout_seconds=1.5) as drained:
        wait_until(lambda: running_requests(drained.service) > 0, 10, "requests running")
        outcome = execute(decision(ActionKind.RESTART_SERVICE, target=Target(service="sglang")), drained.node.ctx)
        assert outcome.outcome is Outcome.SUCCESS, outcome.detail
        timed_out = outcome.detail.split("; ")[1]
        assert re.fullmatch(
            r"sglang still running [0-9.]+ request\(s\) when its drain timed out after 1\.[5-9] s", timed_out
        )
        assert drained.journal[:3] == ["draining sglang", "drained sglang", "restarting sglang"]
        assert drained.node.service_pid() != drained.first_pid


def test_an_unreadable_server_is_not_waited_on(tmp_path: Path) -> None:
    with drained_node(tmp_path, drain_seconds=600, timeout_seconds=30) as drained:
        os.kill(drained.node.service_pid(), signal.SIGUSR1)  # it answers 503, /metrics included
        began = time.monotonic()
        outcome = execute(decision(ActionKind.RESTART_SERVICE, target=Target(service="sglang")), drained.node.ctx)
        assert outcome.outcome is Outcome.SUCCESS, outcome.detail
        assert outcome.detail.split("; ")[1] == "sglang's running requests unreadable (HTTP 503): not waited on"
        assert time.monotonic() - began < 20


def test_a_drain_that_meets_an_error_of_any_type_still_restarts_the_service(tmp_path: Path) -> None:
    """The reproduction: the server's /metrics redirects to port 99999 while its restart drains it.
    Whatever the running-requests reader raises, the drain only delays the stop: the service is
    restarted, and the journal says it was drained."""
    # `urlsplit` raises ValueError on the port: an error of no reader's own type.
    with http_server(lambda _path: (302, {"Location": "http://127.0.0.1:99999/metrics"}, b"")) as server:
        drain = {"hook": ["/bin/true"], "timeout_seconds": 5}
        node = make_node(tmp_path, service_fields={"metrics_url": f"{server}/metrics", "drain": drain})
        journal: list[str] = []
        node.ctx.journal = journal.append
        first = node.start_service()
        try:
            outcome = execute(decision(ActionKind.RESTART_SERVICE, target=Target(service="sglang")), node.ctx)
            assert outcome.outcome is Outcome.SUCCESS, outcome.detail
            assert node.service_pid() != first
            assert journal == ["draining sglang", "drained sglang", "restarting sglang", "restarted sglang"]
            waited = outcome.detail.split("; ")[1]
            assert waited.startswith(("sglang's running requests unreadable (", "drain of sglang failed (")), waited
        finally:
            CommandManager().stop(node.config.services[0])


def test_a_reset_drains_the_services_before_stopping_them(tmp_path: Path) -> None:
    with drained_node(tmp_path, drain_seconds=1.0, timeout_seconds=20) as drained:
        wait_until(lambda: running_requests(drained.service) > 0, 10, "requests running")
        outcome = execute(decision(ActionKind.RESET_GPU), drained.node.ctx)
        assert outcome.outcome is Outcome.SUCCESS, outcome.detail
        steps = outcome.detail.split("; ")
        assert steps[0].startswith("drain hook ") and steps[1].startswith("sglang drained: no request running after ")
        assert steps[2] == "stopped sglang"
        assert drained.journal[:4] == ["draining sglang", "drained sglang", "stopping sglang", "stopped sglang"]


def test_drain_needs_the_servers_metrics() -> None:
    with pytest.raises(ValueError, match="drain waits on the server's running-requests gauge"):
        ServiceConfig.model_validate(
            {
                "name": "tgi",
                "health_url": "http://127.0.0.1:8080/health",
                "kind": "generic",
                "drain": {"hook": ["/bin/true"]},
            }
        )
    with pytest.raises(ValueError, match="drain waits on the server's running-requests gauge"):
        ServiceConfig.model_validate({"name": "tgi", "drain": {"hook": ["/bin/true"]}})


def test_check_config_refuses_a_drain_hook_others_can_write(tmp_path: Path) -> None:
    hook = write_hook(tmp_path, "#!/bin/sh\ntrue\n")
    config = tmp_path / "agent.yaml"
    config.write_text(
        "backend: simulated\nservices:\n"
        "  - name: sglang\n    health_url: http://127.0.0.1:30000/health\n"
        f"    drain: {{hook: [{hook}], timeout_seconds: 30}}\n"
        f"remediation: {{rules_dirs: [{tmp_path / 'rules.d'}]}}\n"
    )
    config.chmod(0o644)
    (tmp_path / "rules.d").mkdir(mode=0o755)

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agent.cli", "check-config", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert check().returncode == 0, check().stderr
    hook.chmod(0o775)
    refused = check()
    assert refused.returncode == 1
    assert f"{config} services[0].drain.hook[0]: {hook} is writable by group or others (mode 0775)" in refused.stderr


def test_an_untrusted_drain_hook_is_not_run_and_the_restart_goes_ahead(tmp_path: Path) -> None:
    with drained_node(tmp_path, drain_seconds=1.0, timeout_seconds=5) as drained:
        hook = tmp_path / "hooks" / "hook.sh"
        hook.chmod(0o775)
        outcome = execute(decision(ActionKind.RESTART_SERVICE, target=Target(service="sglang")), drained.node.ctx)
        assert outcome.outcome is Outcome.SUCCESS, outcome.detail
        refused = outcome.detail.split("; ")[0]
        assert refused.startswith("drain hook of sglang refused: ") and "writable by group or others" in refused
        assert not drained.told.exists()  # never ran
        assert drained.journal[:3] == ["draining sglang", "drained sglang", "restarting sglang"]
        assert drained.node.service_pid() != drained.first_pid


@pytest.mark.parametrize("location", ["http://127.0.0.1:99999/metrics", "http://[::1/metrics"])
def test_a_server_that_redirects_its_metrics_to_no_url_is_not_waited_on(tmp_path: Path, location: str) -> None:
    """The scrape raised ValueError for such a Location: the restart failed with "internal error:
    ValueError" before its stop, and the service was never restarted."""
    answer = tmp_path / "answer"
    answer.write_bytes(f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode())
    with (
        SlowEndpoint("raw", "--body", str(answer)) as redirecting,
        drained_node(
            tmp_path, drain_seconds=600, timeout_seconds=30, metrics_url=redirecting.url("/metrics")
        ) as drained,
    ):
        outcome = execute(decision(ActionKind.RESTART_SERVICE, target=Target(service="sglang")), drained.node.ctx)
        assert outcome.outcome is Outcome.SUCCESS, outcome.detail
        waited = outcome.detail.split("; ")[1]
        assert waited.startswith(f"sglang's running requests unreadable (redirected to '{location}', not a URL"), waited
        assert drained.journal == ["draining sglang", "drained sglang", "restarting sglang", "restarted sglang"]
        assert drained.node.service_pid() != drained.first_pid
