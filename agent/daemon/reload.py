"""A reload (SIGHUP, or the socket's `reload` that `gpu-agent tune apply` and `undo` ask for): the
config file and the rules read again and applied whole, or not at all.

A config that is invalid, changes a setting only a restart applies (`RESTART_SETTINGS`), or moves a
listener that cannot be bound is logged, kept out, and shown (status, STATUS=) until a later reload
succeeds: the running config stays as it was. An applied reload first hands back what the running
config's write guard still allows (fans it drove and the new one does not; a sweep whose settings
the new one would not let it write, or whose service it drops), then swaps the config in the live
parts, the write guard before anything else runs under it, then the rules, the services' prober and
monitor, and the published socket record.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.api import ApiError
from agent.config import AgentConfig, ConfigError
from agent.daemon.publisher import ListenerError
from agent.daemon.remediator import LoadedRules, load_rules_dir
from agent.logs import get_logger
from agent.names.policy_items import FAN_CURVE
from agent.policy import known_good
from agent.policy.dropins import load_checked_config
from agent.policy.registry import RESTORABLE_NAMES

if TYPE_CHECKING:
    from agent.daemon.live import Live
    from agent.daemon.policy_loop import PolicyLoop
    from agent.daemon.remediator import Remediator

log = get_logger()

#: How long a `reload` asked over the socket (`gpu-agent tune apply`) waits for the loop to do it.
RELOAD_ANSWER_SECONDS = 60.0
#: The socket's method, which only root or the agent's own user may call.
RELOAD_METHODS = frozenset({"reload"})

#: Settings a running daemon cannot take: the backend is opened once, every host path and the node's
#: identity are resolved under host_root at start, the event store, the action journal and the
#: node memory live in state_dir. A reload that changes one is refused whole.
RESTART_SETTINGS: tuple[str, ...] = ("backend", "simulated", "host_root", "state_dir")


def restart_fields(running: AgentConfig, new: AgentConfig) -> tuple[str, ...]:
    """The settings `new` changes that only a restart applies (`simulated` only matters on that backend)."""
    changed = [name for name in RESTART_SETTINGS if getattr(running, name) != getattr(new, name)]
    if "simulated" in changed and "simulated" not in (running.backend, new.backend):
        changed.remove("simulated")
    return tuple(changed)


def record_known_good(config: AgentConfig, changed_before: frozenset[str] = frozenset()) -> None:
    """For `gpu-agent restore` without a valid config: this backend and the items the agent may
    have changed and not handed back (fans are handed back on a reload that stops driving them)."""
    items = (changed_before | config.writable_items()) & RESTORABLE_NAMES
    if FAN_CURVE not in config.writable_items():
        items -= {FAN_CURVE}
    known_good.record(config, items)


class Reloader:
    """Swaps the live parts' config (agent/daemon/live.py) and tells the two parts that hold what a
    config made: the policy loop (the fans it drives) and the remediator (its rules)."""

    def __init__(self, *, live: Live, policy: PolicyLoop, remediator: Remediator) -> None:
        self.live = live
        self.policy = policy
        self.remediator = remediator
        self.requested = threading.Event()  # SIGHUP or the socket: the loop reloads before its next step
        # `reload` callers over the socket, each answered by the first reload that starts after it asked
        self._waiters: list[tuple[threading.Event, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def reload(self) -> bool:
        """Read the config and the rules again and apply them whole; False when they were kept out."""
        live = self.live
        loaded = self._load_new_config()
        if loaded is None:
            return False
        new, rules = loaded
        pending = restart_fields(live.config, new)
        if pending:
            log.error("config change needs a restart; keeping the running config whole", settings=list(pending))
            live.publisher.note_reload(pending_restart=pending)
            return False
        try:
            moved = live.publisher.rebind(live.config, new, live.timing.stall_seconds(new.interval_seconds))
        except ListenerError as exc:
            self._failed(f"{exc}; still serving on the previous address")
            return False
        old = live.config
        # While the running config's write guard still allows it: fans it drove and `new` does not go
        # back to automatic, or nothing would ever follow their curve again; and a job (a sweep) whose
        # settings `new` would not let it write, or whose service `new` drops, ends with its
        # originals put back now, not refused by the new guard later.
        self.policy.hand_back_fans(new)
        live.holds.end_conflicting(new)
        live.config = new
        # Before anything else runs under the new config: in observe mode no setter may reach the GPU.
        live.session.set_writable(new.writable_items())
        record_known_good(new, old.writable_items())
        self.remediator.reconfigure(rules)
        if new.services != old.services:
            live.restart_service_watch()
        live.publisher.note_reload()
        self.publish_socket()
        log.info("config reloaded", path=str(live.config_path), mode=new.mode.value, moved=moved)
        return True

    def on_request(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The socket's `reload` (what `gpu-agent tune apply` and `undo` ask after writing their
        drop-in): the same reload as SIGHUP, done by the loop, answered once it is done: `reloaded`,
        and why not (`error`, `pending_restart`). Refused when the daemon runs another config file."""
        wanted = params.get("config_path")
        running = self.live.config_path
        if running is None:
            raise ApiError("the daemon runs on a built-in config: there is no file to reload")
        if wanted is not None and Path(str(wanted)).resolve() != running.resolve():
            raise ApiError(f"the daemon runs {running}, not {wanted}: nothing reloaded")
        done = threading.Event()
        answer: dict[str, Any] = {}
        with self._lock:
            self._waiters.append((done, answer))
            self.requested.set()
        self.live.wake.set()
        if not done.wait(RELOAD_ANSWER_SECONDS):
            raise ApiError(f"the daemon did not get to the reload within {RELOAD_ANSWER_SECONDS:g} s")
        return answer

    def run_requested(self) -> None:
        """SIGHUP or `reload`: a reload, and its outcome to every caller that asked before it started
        (one who asks meanwhile is answered by the next one, which reads what they wrote)."""
        with self._lock:
            self.requested.clear()
            waiters, self._waiters = self._waiters, []
        reloaded = self.reload()
        publisher = self.live.publisher
        outcome = {
            "reloaded": reloaded,
            "error": publisher.reload_error,
            "pending_restart": list(publisher.pending_restart),
            "config_path": str(self.live.config_path),
        }
        for done, answer in waiters:
            answer.update(outcome)
            done.set()

    def publish_socket(self) -> None:
        """Which socket serves the config this daemon runs, for `gpu-agent status` (socket_record.py)."""
        api = self.live.publisher.api
        self.live.socket_record.publish(self.live.config, None if api is None else api.socket_file)

    def _load_new_config(self) -> tuple[AgentConfig, LoadedRules] | None:
        path = self.live.config_path
        if path is None:
            log.warning("reload requested but the daemon runs on a built-in config; nothing to reload")
            return None
        self.live.socket_record.reading()
        try:
            new = load_checked_config(path)
            rules = load_rules_dir(new)
        except ConfigError as exc:
            self._failed("; ".join(str(p) for p in exc.problems))
            return None
        return new, rules

    def _failed(self, message: str) -> None:
        log.error("config reload failed; keeping the running config", error=message)
        publisher = self.live.publisher
        publisher.note_reload(error=message[:300])
        publisher.notifier.status(f"config reload failed, running the previous config: {message}"[:400])
