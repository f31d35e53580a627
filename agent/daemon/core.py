"""The thin `Daemon`: wires the parts, runs the loop, handles signals, reloads and stops.

Each loop is the data flow collect -> snapshot -> evaluate -> act -> publish:
the backend session and the GPU collector read the GPUs, the watchers and the policy loop turn
the readings into events and plans, the snapshot builder makes one NodeSnapshot of it, the
remediator stores the events, evaluates the rules and queues actions, and the publisher hands the
snapshot to the metrics endpoint, the status API and systemd.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType

from agent.alerts.book import PushBook
from agent.backend import load_checked_config
from agent.backend.base import GpuEvent
from agent.config import AgentConfig, ConfigError
from agent.daemon.ack_api import ACK_METHODS, ack_handlers
from agent.daemon.allocator import return_large_buffers
from agent.daemon.bounded import BoundedRunner
from agent.daemon.collector import GpuCollector
from agent.daemon.intake import EventIntake
from agent.daemon.policy_loop import PolicyLoop
from agent.daemon.publisher import ListenerError, Publisher, systemd_status_line
from agent.daemon.remediator import LoadedRules, Remediator, fixed_xids, load_rules_dir
from agent.daemon.sd_notify import SdNotifier
from agent.daemon.session import BackendSession
from agent.daemon.timing import LoopTiming
from agent.daemon.watchdog import Watchdog
from agent.events import Event
from agent.host.boottime import boottime_seconds
from agent.host.paths import HostPaths
from agent.logger import get_logger
from agent.policy import known_good
from agent.policy.base import HostContext
from agent.policy.engine import PolicyEngine
from agent.policy.holds import PolicyHolds
from agent.policy.names import FAN_CURVE
from agent.policy.registry import RESTORABLE_NAMES
from agent.rules.actions.context import ActionContext
from agent.services.attribution import service_of_pid
from agent.services.health import HealthProber, ProberThread
from agent.services.managers import build_managers
from agent.services.watch import InferenceMonitor
from agent.snapshot import DaemonParts, NodeWatchers, build_snapshot
from agent.state import CollectorStatus, GpuSample, NodeSnapshot
from agent.store.attempt_clock import AttemptClock
from agent.store.node_memory import NodeMemory, read_boot_id
from agent.tune.runner import PRIVILEGED_METHODS, TuneRunner
from agent.watch.devices import UdevWakeup
from agent.watch.kernel_log import KernelXid
from agent.watch.kmsg import KmsgSource

log = get_logger()

# How long the policy step waits for the next-boot check (it runs on a worker of its own): a slow
# check is taken by a later pass instead of holding up the fan curve.
BOOT_CHECK_WAIT_SECONDS = 5.0


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


class Daemon:
    def __init__(
        self,
        config: AgentConfig,
        config_path: Path | None = None,
        *,
        notifier: SdNotifier | None = None,
        timing: LoopTiming | None = None,
        clock: Callable[[], float] = time.time,
        boottime: Callable[[], float] = boottime_seconds,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.timing = timing or LoopTiming()
        self.clock = clock
        self.started_seconds = clock()
        self.stop_requested = threading.Event()
        self.wake = threading.Event()  # set by event sources, signals: the loop reacts before its next tick
        self.reload_requested = threading.Event()
        self.host = HostContext(HostPaths.at(config.host_root), boot_check_wait_seconds=BOOT_CHECK_WAIT_SECONDS)
        self.runner = BoundedRunner(self.timing.call_timeout_seconds)
        self.intake = EventIntake(self.wake)
        self.session = BackendSession(self.runner, self._on_nvml_event)
        self.collector = GpuCollector(self.runner, self.timing, clock, self.session.note_fault)
        self.watchers = NodeWatchers(
            lambda: self.collector.identities,
            clock,
            boottime,
            lambda pid: service_of_pid(pid, self.config.services, self.host.paths),
            kernel_log_followed=lambda: self.kmsg.status()[0],
            release_xids=self.intake.put,
        )
        # GPU settings a job drives (a tune sweep, a reset): the policy loop plans them, never writes
        # them, and the ledger puts them back on every way out (journaled in the store).
        self.holds = PolicyHolds(lambda: self.remediator.store, self.host.paths.boot_id(), clock)
        self.policy = PolicyLoop(config, self.host, self.runner, self.session.note_fault, self.holds)
        self.remediator = Remediator(
            config,
            self._action_context,
            fixed_xids(self.watchers.xid),
            clock,
            AttemptClock(self.host.paths.boot_id(), boottime),
            lambda current: build_managers(current, self.host),
            self.holds,
        )
        # Shares the remediator's store: the memory is there as soon as the store is (start_services).
        self.memory = NodeMemory(lambda: self.remediator.store, read_boot_id(self.host.paths), clock)
        self.publisher = Publisher(notifier or SdNotifier.from_environment())
        self.watchdog = Watchdog(
            self.publisher.notifier,
            lambda: self.timing.stall_seconds(self.config.interval_seconds),
            self.stop_requested,
        )
        self.prober = self._new_prober(config)
        self.prober_thread: ProberThread | None = None
        self.inference = self._new_inference(config)
        self.tune = TuneRunner(
            lambda: self.config,
            lambda: self.session.backend,
            lambda: self.remediator.store,
            lambda: self.remediator.worker,
            self.holds,
            lambda: self.prober.statuses(),
            lambda: self.inference.figures(),
            lambda: len(self.collector.identities),
            clock,
        )
        self.publisher.extra_handlers = {
            **self.tune.handlers(),
            **ack_handlers(lambda: self.remediator.store, self.memory.boot_id, self.watchers.xid.forget),
        }
        self.publisher.privileged_methods = PRIVILEGED_METHODS | ACK_METHODS
        self.publisher.last_tune = self.tune.last
        self.udev = UdevWakeup(self.collector.rescan.set, self.host.paths)
        self.kmsg = KmsgSource(self.host.paths, self._on_kernel_xid, start_monotonic_seconds=time.monotonic())
        self._closers: list[Callable[[], None]] = []
        self.loop_hook: Callable[[], None] | None = None  # tests: runs inside each loop iteration

    # -- one loop: collect -> snapshot -> evaluate -> act -> publish ---------------------------

    def loop_once(self) -> NodeSnapshot:
        now = self.clock()
        started = time.monotonic()
        if self.loop_hook is not None:
            self.loop_hook()
        samples, events = self._collect(now)
        events += self.intake.take(self.prober.take_events())
        events += self.inference.on_loop(samples, events)
        self.intake.note(events)
        snapshot = self._snapshot(now, samples, time.monotonic() - started)
        self._save_memory(now)
        self.tune.history.observe(self.config, now, samples, snapshot.service_figures)
        self.tune.history.flush(self.remediator.store)
        self.remediator.remediate(snapshot, events, now)
        snapshot = self.publisher.publish(snapshot)
        self.remediator.push_alerts(snapshot)
        self.watchdog.beat()
        return snapshot

    def _collect(self, now: float) -> tuple[list[GpuSample], list[Event]]:
        """This loop's samples, and the events the watchers and the policy loop made of them."""
        self.memory.load(self.collector.identities, self.watchers.xid, self.watchers.throttle, self.prober)
        self.memory.follow_acks(self.watchers.xid)
        wait_seconds = self.timing.step_wait(self.config.interval_seconds)
        backend = self.session.begin_loop(self.config, wait_seconds)
        if backend is None:
            return self.memory.remember(self.collector.unavailable(now, self.session.error), now), []
        samples = self.memory.remember(self.collector.collect(backend, now, self.config.counters_interval_seconds), now)
        events = self.watchers.observe(samples, now)
        events += self.policy.step(backend, now, wait_seconds, self.collector.identities, samples)
        if self.session.end_loop():
            self.policy.forget_backend()
        return samples, events

    def _snapshot(self, now: float, samples: list[GpuSample], duration_seconds: float) -> NodeSnapshot:
        return build_snapshot(
            self.config,
            now,
            samples,
            self.watchers,
            driver_version=self.session.driver_version(),
            policy=self.policy.plans,
            daemon=self._daemon_parts(duration_seconds),
            service_figures=self.inference.figures(),
            gpu_attribution=self.inference.attribution(),
        )

    def _daemon_parts(self, duration_seconds: float) -> DaemonParts:
        kmsg_ok, kmsg_detail = self.kmsg.status()
        collectors = (
            *self.collector.statuses(),
            *(s for s in (self.policy.status, self.remediator.status, self.remediator.alert_delivery.status) if s),
            CollectorStatus("kmsg", kmsg_ok, 0.0, "" if kmsg_ok else kmsg_detail),
            *self.session.statuses(),
        )
        return DaemonParts(
            started_seconds=self.started_seconds,
            stale_gpus=self.collector.stale,
            backend_error=self.session.error,
            services=tuple(self.prober.statuses()),
            remediations=self.remediator.counts(),
            remediation_failing=self.remediator.failing(),
            collectors=collectors,
            recent_events=self.intake.recent,
            recent_remediations=self.remediator.recent(),
            rules_sources=self.remediator.rules_sources,
            rules_loaded=self.remediator.rules_loaded(),
            slo_breaches=self.inference.breaches(),
            collect_duration_seconds=duration_seconds,
        )

    def react(self) -> None:
        """Between loops: an Xid or a failed probe is evaluated at once, against the last snapshot,
        instead of waiting up to one interval for the next collection."""
        snapshot = self.publisher.get()
        events = self.intake.take(self.prober.take_events())
        if snapshot is None or not events:
            self.intake.give_back(events)  # before the first snapshot: kept for the first loop
            return
        self.intake.note(events)
        snapshot = replace(
            snapshot,
            services=tuple(self.prober.statuses()),
            xids=tuple(self.watchers.xid.counts()),
            open_xids=self.watchers.xid.open_marks(),
            recent_events=self.intake.recent,
            health=self.watchers.health(snapshot.health, self.collector.stale, self.session.error),
        )
        self._save_memory(self.clock())
        self.remediator.remediate(snapshot, events, self.clock())
        self.publisher.set(snapshot)

    def _save_memory(self, now: float) -> None:
        self.memory.follow_acks(self.watchers.xid)  # an ack since the loop began is not written over
        self.memory.save(self.watchers.xid, now, self.watchers.throttle, self.prober)

    # -- sources feeding the event intake ------------------------------------------------------

    def _on_kernel_xid(self, record: KernelXid) -> None:
        self.intake.put(self.watchers.xid.ingest_kernel(record))

    def _on_nvml_event(self, event: GpuEvent) -> None:
        self.intake.put(self.watchers.xid.ingest_nvml(event))

    def _action_context(self, alerts: PushBook) -> ActionContext | None:
        """What an action reaches, built when it runs (the backend of the moment); None without one."""
        backend = self.session.backend
        if backend is None:
            return None
        return ActionContext(
            config=self.config,
            backend=backend,
            policy=PolicyEngine(self.config, backend, self.host, self.holds),
            host=self.host,
            managers=build_managers(self.config, self.host),
            prober=self.prober,
            alerts=alerts,
            clock=self.clock,
        )

    def _new_prober(self, config: AgentConfig) -> HealthProber:
        prober = HealthProber(config.services, build_managers(config, self.host))
        prober.on_event = self.wake.set
        return prober

    def _new_inference(self, config: AgentConfig) -> InferenceMonitor:
        # The backend of the moment: the session reopens it after a driver reload.
        return InferenceMonitor(config, lambda: self.session.backend, clock=self.clock)

    # -- reload --------------------------------------------------------------------------------

    def reload(self) -> bool:
        """SIGHUP: a new config is applied whole or not at all. One that is invalid, changes a setting
        only a restart applies, or moves a listener that cannot be bound is logged, kept out, and shown
        (status, STATUS=) until a later reload succeeds: the running config stays as it was."""
        loaded = self._load_new_config()
        if loaded is None:
            return False
        new, rules = loaded
        pending = restart_fields(self.config, new)
        if pending:
            log.error("config change needs a restart; keeping the running config whole", settings=list(pending))
            self.publisher.note_reload(pending_restart=pending)
            return False
        try:
            moved = self.publisher.rebind(self.config, new, self.timing.stall_seconds(new.interval_seconds))
        except ListenerError as exc:
            self._reload_failed(f"{exc}; still serving on the previous address")
            return False
        old_services = self.config.services
        # While the running config's write guard still allows it: fans it drove and `new` does not go
        # back to automatic, or nothing would ever follow their curve again; and a job (a sweep) whose
        # settings `new` would not let it write, or whose service `new` drops, ends with its
        # originals put back now, not refused by the new guard later.
        self.policy.hand_back_fans(new)
        self.holds.end_conflicting(new)
        old_items = self.config.writable_items()
        self.config = new
        # Before anything else runs under the new config: in observe mode no setter may reach the GPU.
        self.session.set_writable(new.writable_items())
        self._record_known_good(old_items)
        self.remediator.reconfigure(new, rules)
        self.policy.reconfigure(new)
        if new.services != old_services:
            self._restart_prober(new)
            self._restart_inference(new)
        self.publisher.note_reload()
        log.info("config reloaded", path=str(self.config_path), mode=new.mode.value, moved=moved)
        return True

    def _load_new_config(self) -> tuple[AgentConfig, LoadedRules] | None:
        if self.config_path is None:
            log.warning("reload requested but the daemon runs on a built-in config; nothing to reload")
            return None
        try:
            new = load_checked_config(self.config_path)
            rules = load_rules_dir(new)
        except ConfigError as exc:
            self._reload_failed("; ".join(str(p) for p in exc.problems))
            return None
        return new, rules

    def _reload_failed(self, message: str) -> None:
        log.error("config reload failed; keeping the running config", error=message)
        self.publisher.note_reload(error=message[:300])
        self.publisher.notifier.status(f"config reload failed, running the previous config: {message}"[:400])

    def _record_known_good(self, changed_before: frozenset[str] = frozenset()) -> None:
        """For `gpu-agent restore` without a valid config: this backend and the items the agent may
        have changed and not handed back (fans are handed back on a reload that stops driving them)."""
        items = (changed_before | self.config.writable_items()) & RESTORABLE_NAMES
        if FAN_CURVE not in self.config.writable_items():
            items -= {FAN_CURVE}
        known_good.record(self.config, items)

    def _restart_prober(self, config: AgentConfig) -> None:
        if self.prober_thread is not None:
            self.prober_thread.stop()
        self.prober = self._new_prober(config)
        self.prober_thread = ProberThread(self.prober)
        self.prober_thread.start()

    def _restart_inference(self, config: AgentConfig) -> None:
        self.inference.stop()
        self.inference = self._new_inference(config)
        self.inference.start()

    # -- lifecycle -----------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # embedded (tests): the caller stops the daemon through stop_requested

        def on_stop(signum: int, _frame: FrameType | None) -> None:
            self.stop_requested.set()
            self.wake.set()

        def on_hup(_signum: int, _frame: FrameType | None) -> None:
            self.reload_requested.set()
            self.wake.set()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)

    def start_services(self) -> None:
        stale_after = self.timing.stall_seconds(self.config.interval_seconds)
        self._closers.extend(self.publisher.serve(self.config, stale_after))
        self._record_known_good()
        self.kmsg.start()
        self._closers.append(self.kmsg.stop)
        self.remediator.start()
        self._closers.append(self.remediator.stop)
        # Before the first loop: the policy loop never sees a setting a killed job left changed unheld.
        recovery = self.holds.recover(lambda: self.session.backend)
        self.tune.recover()  # its rows close once recovery has put their settings back
        if recovery is not None:
            self.remediator.worker.submit_task(recovery)
        # Closed in reverse: after the prober stops, before the store closes, the last streaks are kept.
        self._closers.append(lambda: self._save_memory(self.clock()))
        self.prober_thread = ProberThread(self.prober)
        self.prober_thread.start()
        self._closers.append(lambda: self.prober_thread.stop() if self.prober_thread else None)
        self.inference.start()
        self._closers.append(lambda: self.inference.stop())
        if self.udev.start():
            self._closers.append(self.udev.stop)
        else:
            log.info("udev not available; GPUs are re-enumerated by polling", reason=self.udev.reason)
        log.info("serving", metrics=self.config.metrics.listen, socket=self.config.api.socket)

    def run(self) -> int:
        self.install_signal_handlers()
        return_large_buffers()
        try:
            self.start_services()
            snapshot = self.loop_once()
            self.publisher.notifier.ready(systemd_status_line(snapshot))
            self.watchdog.start()
            self._run_loops()
            return 0
        finally:
            self.shutdown()

    def _run_loops(self) -> None:
        next_loop = time.monotonic() + self.config.interval_seconds
        while not self.stop_requested.is_set():
            self.wake.wait(max(0.0, next_loop - time.monotonic()))
            self.wake.clear()
            if self.stop_requested.is_set():
                break
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self.reload()
            if time.monotonic() < next_loop:
                self.react()  # woken early by an event
                continue
            self.loop_once()
            next_loop += self.config.interval_seconds
            if next_loop < time.monotonic():  # a slow loop: start again now, do not try to catch up
                next_loop = time.monotonic()

    def shutdown(self) -> None:
        self.stop_requested.set()
        self.publisher.notifier.stopping()
        self.policy.restore_fans()  # fans the agent set to manual go back to automatic on every exit path
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                close()
        self.session.close()
        self.policy.forget_backend()
        self.runner.shutdown()
        log.info("stopped")
