"""Everything an action handler reaches."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from agent.backend.base import GpuBackend
from agent.config import AgentConfig
from agent.policy.base import HostContext
from agent.policy.engine import PolicyEngine
from agent.services.managers import ServiceManager
from agent.services.prober import HealthProber


class AlertRaiser(Protocol):
    """Where an `alertmanager` or `recommend_reboot` step raises the catalogue's alerts: the daemon's
    push book (agent/daemon/alert_book.py), which pushes them while the verdict holds them."""

    def raise_alerts(
        self,
        names: Iterable[str],
        match: Mapping[str, str],
        url: str | None = None,
        overrides: Mapping[str, str] | None = None,
    ) -> None: ...


@dataclass
class ActionContext:
    """Everything actions reach. `managers` maps service names to their manager (a service without
    one cannot be restarted: see agent.services.managers.build_managers)."""

    config: AgentConfig
    backend: GpuBackend
    policy: PolicyEngine
    host: HostContext
    managers: Mapping[str, ServiceManager]
    alerts: AlertRaiser  # where an alertmanager or recommend_reboot step raises its alert
    prober: HealthProber | None = None
    clock: Callable[[], float] = time.time  # wall time, for what is recorded and shown
    #: Every deadline and wait an action measures (a drain, a reset waiting for the GPU to go idle,
    #: a service becoming healthy): a wall-clock step must not lengthen or cut one.
    monotonic: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    hostname: str = field(default_factory=socket.gethostname)
    #: How long a GPU reset waits for the GPU's processes to exit after the services stopped.
    drain_timeout_seconds: float = 30.0
    drain_poll_seconds: float = 0.5
    #: Each step of an action as it completes (agent.rules.actions.steps names them), written to the
    #: remediation journal so an interrupted action can be rolled back by the next run.
    journal: Callable[[str], None] = lambda _step: None
    #: Set when the agent stops: a long action gives up where it safely can (a GPU reset still waiting
    #: for the GPU to drain starts the services again instead of resetting).
    cancel: threading.Event = field(default_factory=threading.Event)
