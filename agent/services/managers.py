"""Starting and stopping the inference services (sglang, vLLM, ...).

`SystemdManager` drives a unit with `systemctl`; its argv prefix is configurable so tests can
reach a sandboxed systemd (`nsenter -t PID -p -m -u -i chroot ROOT systemctl`). `CommandManager`
runs the service's configured `start_command`/`stop_command` (argv lists, never a shell, through
agent.host.processes); restart is stop then start. A start command should hand the server to a
supervisor of its own (a container runtime, `systemd-run`): whatever it leaves running in the
agent's cgroup is stopped together with the agent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.host.processes import ProcessResult, run_process
from agent.policy.base import HostContext
from agent.policy.triton_cache import triton_environments


class ServiceError(Exception):
    """A service could not be started, stopped or restarted."""


class ServiceManager(Protocol):
    """Starts and stops one kind of service. Methods raise ServiceError when the command fails."""

    def start(self, service: ServiceConfig) -> None: ...
    def stop(self, service: ServiceConfig) -> None: ...
    def restart(self, service: ServiceConfig) -> None: ...
    def is_active(self, service: ServiceConfig) -> bool | None:
        """Whether it runs; None when this manager has no way to tell."""


def _checked(result: ProcessResult, what: str) -> ProcessResult:
    if result.returncode != 0:
        raise ServiceError(f"{what} failed: {result.describe()}")
    return result


class SystemdManager:
    """Services as systemd units, through `systemctl` (or a prefix reaching another systemd)."""

    def __init__(self, systemctl_argv: Sequence[str] = ("systemctl",)) -> None:
        self.systemctl_argv = tuple(systemctl_argv)

    def systemctl(self, service: ServiceConfig, *args: str) -> ProcessResult:
        argv = (*self.systemctl_argv, *args)
        try:
            return run_process(argv, service.command_timeout_seconds)
        except OSError as exc:
            raise ServiceError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc

    def start(self, service: ServiceConfig) -> None:
        _checked(self.systemctl(service, "start", service.unit_name), f"systemctl start {service.unit_name}")

    def stop(self, service: ServiceConfig) -> None:
        _checked(self.systemctl(service, "stop", service.unit_name), f"systemctl stop {service.unit_name}")

    def restart(self, service: ServiceConfig) -> None:
        _checked(self.systemctl(service, "restart", service.unit_name), f"systemctl restart {service.unit_name}")

    def is_active(self, service: ServiceConfig) -> bool:
        return self.systemctl(service, "is-active", "--quiet", service.unit_name).returncode == 0

    def main_pid(self, service: ServiceConfig) -> int | None:
        """The unit's main process (`systemctl show -p MainPID`), None when it has none."""
        result = _checked(
            self.systemctl(service, "show", "--property=MainPID", "--value", service.unit_name),
            f"systemctl show {service.unit_name}",
        )
        pid = int(result.output.strip() or 0)
        return pid or None


class CommandManager:
    """Services started and stopped by their configured commands.

    `start_environments`: per service name, the variables its start command gets besides the
    runner's minimal environment (TRITON_CACHE_DIR for the services `policy.node.triton_cache`
    lists: a systemd drop-in cannot reach a process the agent starts itself).
    """

    def __init__(self, start_environments: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.start_environments = {name: dict(env) for name, env in (start_environments or {}).items()}

    @staticmethod
    def _run(
        service: ServiceConfig, argv: list[str] | None, what: str, extra_env: Mapping[str, str] | None = None
    ) -> ProcessResult:
        if argv is None:
            raise ServiceError(f"service {service.name} has no {what} (manager: {service.manager})")
        try:
            return run_process(argv, service.command_timeout_seconds, extra_env=extra_env)
        except OSError as exc:
            raise ServiceError(f"{service.name}: cannot run {argv[0]}: {exc.strerror or exc}") from exc

    def start(self, service: ServiceConfig) -> None:
        env = self.start_environments.get(service.name, {})
        _checked(self._run(service, service.start_command, "start_command", env), f"{service.name} start_command")

    def stop(self, service: ServiceConfig) -> None:
        _checked(self._run(service, service.stop_command, "stop_command"), f"{service.name} stop_command")

    def restart(self, service: ServiceConfig) -> None:
        self.stop(service)
        self.start(service)

    def is_active(self, service: ServiceConfig) -> bool | None:
        if service.status_command is None:
            return None
        return self._run(service, service.status_command, "status_command").returncode == 0


def build_managers(
    config: AgentConfig, host: HostContext, systemctl_argv: Sequence[str] | None = None
) -> dict[str, ServiceManager]:
    """A manager for every service that can have one.

    systemd services get one only when `host_root` is the real `/` or a `systemctl_argv` reaching
    some other systemd is given: against a test tree or the demo's, the host's units are left alone
    (an action on such a service is refused for want of a manager).
    """
    managers: dict[str, ServiceManager] = {}
    commands = CommandManager(triton_environments(config, host))
    systemd = SystemdManager(systemctl_argv) if systemctl_argv is not None else None
    if systemd is None and host.is_real_root:
        systemd = SystemdManager()
    for service in config.services:
        if service.manager == "command":
            managers[service.name] = commands
        elif systemd is not None:
            managers[service.name] = systemd
    return managers
