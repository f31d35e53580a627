"""The publisher: the last snapshot, for everyone who reads it (the metrics endpoint, the status
API), and one line of it for systemd's STATUS=. Only the loop builds snapshots; readers on other
threads get the last published one.

It owns the two listeners. A reload that moves one binds the new one before the old one closes;
when the new one cannot be bound, nothing changes and the reload is refused (`ListenerError`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from agent import __version__
from agent.config import AgentConfig
from agent.daemon.sd_notify import SdNotifier
from agent.events import HealthState
from agent.host.paths import HostPaths
from agent.policy.plan import PlanStatus
from agent.state import NodeSnapshot
from agent.verdict import AttentionCause, attention_items, drifted, expected_gpu_count, node_problem

if TYPE_CHECKING:
    from agent.api_server import ApiServer
    from agent.metrics.server import MetricsServer


class ListenerError(Exception):
    """A listener a reload asked for could not be bound; the running ones are kept."""


class Publisher:
    def __init__(self, notifier: SdNotifier) -> None:
        self.notifier = notifier
        # What the last reload left: why it was refused, or the settings that wait for a restart.
        # Stamped on every published snapshot until a reload succeeds.
        self.reload_error = ""
        self.pending_restart: tuple[str, ...] = ()
        self.hostname = ""  # the node's, read when serving starts and at each reload (gpu_agent_node_info)
        self.metrics: MetricsServer | None = None
        self.api: ApiServer | None = None
        self.extra_handlers: dict[str, Callable[[Any], Any]] = {}  # API methods of other parts (tune)
        self.privileged_methods: frozenset[str] = frozenset()  # of those, the ones that change the node
        self.last_tune: Callable[[], dict[str, Any] | None] = lambda: None  # `status` shows it
        self._snapshot: NodeSnapshot | None = None
        self._lock = threading.Lock()

    def get(self) -> NodeSnapshot | None:
        with self._lock:
            return self._snapshot

    def set(self, snapshot: NodeSnapshot) -> None:
        """The snapshot readers see from now on."""
        with self._lock:
            self._snapshot = snapshot

    def publish(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        """A loop's snapshot, with the expected GPU count: to the readers and, as one line, to systemd."""
        # Node memory (agent/node_memory/) keeps a GPU that left the bus in the snapshot, down, until it answers
        # or is acknowledged gone: the snapshot's GPUs are the ones this node should have.
        snapshot = replace(
            snapshot, expected_gpus=expected_gpu_count(snapshot) or None, published_monotonic_seconds=time.monotonic()
        )
        snapshot = self._stamped(snapshot)
        self.set(snapshot)
        self.notifier.status(systemd_status_line(snapshot))
        return snapshot

    def note_reload(self, *, error: str = "", pending_restart: tuple[str, ...] = ()) -> None:
        """What the last reload left (nothing: it was applied); readers see it at once, not a loop later."""
        self.reload_error = error
        self.pending_restart = pending_restart
        snapshot = self.get()
        if snapshot is not None:
            self.set(self._stamped(snapshot))

    def _stamped(self, snapshot: NodeSnapshot) -> NodeSnapshot:
        return replace(
            snapshot,
            reload_error=self.reload_error,
            config_pending_restart=self.pending_restart,
            hostname=self.hostname,
        )

    def serve(self, config: AgentConfig, stale_after_seconds: float) -> list[Callable[[], None]]:
        """The metrics endpoint and the status API; what closes them."""
        from agent.api_server import ApiServer
        from agent.metrics.server import MetricsServer
        from agent.names.metric_families import FamilySwitches

        self.hostname = HostPaths.at(config.host_root).hostname()
        self.metrics = MetricsServer(
            config.metrics.listen,
            self.get,
            stale_after_seconds=stale_after_seconds,
            switches=FamilySwitches.of(config.metrics.families),
        )
        self.api = ApiServer(
            config.api.socket, self.api_handlers(), group=config.api.group, privileged=self.privileged_methods
        )
        self.api.start()
        return [self.close]

    def rebind(self, old: AgentConfig, new: AgentConfig, stale_after_seconds: float) -> list[str]:
        """The listeners `new` moves, bound anew before the old ones close; what moved, for the log.
        Raises ListenerError, with the running listeners untouched, when one cannot be bound."""
        from agent.api_server import ApiServer
        from agent.metrics.server import MetricsServer
        from agent.names.metric_families import FamilySwitches

        if self.metrics is None or self.api is None:
            return []  # not serving (an embedded daemon): nothing to move
        switches = FamilySwitches.of(new.metrics.families)
        metrics: MetricsServer | None = None
        api: ApiServer | None = None
        binding = ""
        try:
            if new.metrics.listen != old.metrics.listen:
                binding = f"metrics.listen {new.metrics.listen}"
                metrics = MetricsServer(
                    new.metrics.listen, self.get, stale_after_seconds=stale_after_seconds, switches=switches
                )
            if (new.api.socket, new.api.group) != (old.api.socket, old.api.group):
                binding = f"api.socket {new.api.socket}"
                api = ApiServer(
                    new.api.socket, self.api_handlers(), group=new.api.group, privileged=self.privileged_methods
                )
                api.start()
        except (OSError, KeyError) as exc:
            if metrics is not None:
                metrics.close()
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ListenerError(f"cannot bind {binding}: {reason}") from None
        moved: list[str] = []
        self.hostname = HostPaths.at(new.host_root).hostname()
        self.metrics.switches = switches  # the families a reload switched, from the next scrape on
        if metrics is not None:
            self.metrics.close()
            self.metrics = metrics
            moved.append(f"metrics.listen {old.metrics.listen} -> {new.metrics.listen}")
        if api is not None:
            self.api.close()
            self.api = api
            moved.append(f"api.socket {old.api.socket} -> {new.api.socket}")
        return moved

    def close(self) -> None:
        for server in (self.metrics, self.api):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.close()

    def api_handlers(self) -> dict[str, Callable[[Any], Any]]:
        from agent.documents import snapshot_document

        def status(_params: Any) -> Any:
            snapshot = self.get()
            if snapshot is None:
                return {"starting": True}
            document = snapshot_document(snapshot, source="daemon")
            last_tune = self.last_tune()
            if last_tune is not None:
                document["last_tune"] = last_tune
            return document

        return {
            **self.extra_handlers,
            "status": status,
            "ping": lambda _p: {"pid": threading.get_native_id(), "version": __version__},
        }


#: Verdict lines STATUS= carries as they are; the GPU ones it counts.
_STATUS_LINE_CAUSES = frozenset(
    {
        AttentionCause.SERVICE_DOWN,
        AttentionCause.SERVICE_SLO,
        AttentionCause.NEXT_BOOT,
        AttentionCause.DRIVER,
        AttentionCause.NO_RULES,
        AttentionCause.CONFIG,
    }
)


def systemd_status_line(snapshot: NodeSnapshot) -> str:
    """One line for systemd's STATUS= (what `systemctl status gpu-agent` shows); a node problem
    (no driver, no or missing GPUs) comes first, so it is never read as health, and "all healthy"
    only when the verdict has no attention line at all."""
    total = len(snapshot.gpus)
    unhealthy = sum(1 for h in snapshot.health.values() if h.state is HealthState.UNHEALTHY)
    degraded = sum(1 for h in snapshot.health.values() if h.state is HealthState.DEGRADED)
    drift = len(drifted(snapshot))
    problem = node_problem(snapshot)
    needs = attention_items(snapshot)
    parts = [f"PROBLEM: {problem.detail}"] if problem is not None else []
    parts.append(f"{total} GPUs")
    if unhealthy or degraded:
        parts.append(f"{unhealthy} unhealthy, {degraded} degraded")
    elif not needs:
        parts.append("all healthy")
    if snapshot.stale_gpus:
        parts.append(f"{len(snapshot.stale_gpus)} stale")
    # A sweep's GPUs are off their declared values on purpose: not drift, and not "in sync" either.
    held = sum(1 for plan in snapshot.policy if plan.status is PlanStatus.HELD)
    policy = [f"{drift} item(s) drifted"] if drift else []
    policy += [f"{held} held by a running job"] if held else []
    parts.append(f"policy: {', '.join(policy)}" if policy else "policy in sync")
    if snapshot.reboot_recommended is not None:
        parts.append(f"REBOOT RECOMMENDED: {snapshot.reboot_recommended}")
    parts.extend(f"ATTENTION: {item.text}" for item in needs if item.cause in _STATUS_LINE_CAUSES)
    return "; ".join(parts)
