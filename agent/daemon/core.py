"""The thin `Daemon`: makes the parts, runs the loop, handles signals and stops.

Each loop is the data flow collect -> snapshot -> evaluate -> act -> publish: the backend session
and the GPU collector read the GPUs, the watchers and the policy loop turn the readings into events
and plans, the snapshot builder makes one NodeSnapshot of it, the remediator stores the events,
evaluates the rules and queues actions, and the publisher hands the snapshot to the metrics
endpoint, the status API and systemd. Every part is handed the daemon's live parts
(agent/daemon/live.py) and asks them for what it needs when it needs it; a reload is
agent/daemon/reload.py.
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

from agent.config import AgentConfig
from agent.daemon.ack_api import ACK_METHODS, ack_handlers
from agent.daemon.allocator import return_large_buffers
from agent.daemon.live import Live
from agent.daemon.node_memory import NodeMemory
from agent.daemon.policy_loop import PolicyLoop
from agent.daemon.publisher import systemd_status_line
from agent.daemon.reload import RELOAD_METHODS, Reloader, record_known_good
from agent.daemon.remediator import Remediator
from agent.daemon.sd_notify import SdNotifier
from agent.daemon.timing import LoopTiming
from agent.daemon.watchdog import Watchdog
from agent.events import Event
from agent.host.boottime import boottime_seconds
from agent.logs import get_logger
from agent.snapshot import DaemonParts, build_snapshot
from agent.state import CollectorStatus, GpuSample, NodeSnapshot
from agent.tune.runner import PRIVILEGED_METHODS, TuneRunner
from agent.watch.devices import UdevWakeup

log = get_logger()


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
        config_identity: list[int] | None = None,
    ) -> None:
        """`config_identity`: the config file's, taken just before it was read (None: when the daemon
        starts; agent/daemon/socket_record.py)."""
        self.live = live = Live(
            config,
            config_path=config_path,
            config_identity=config_identity,
            timing=timing or LoopTiming(),
            clock=clock,
            boottime=boottime,
            notifier=notifier or SdNotifier.from_environment(),
        )
        self.started_seconds = clock()
        self.policy = PolicyLoop(live=live)
        self.remediator = Remediator(live=live)
        self.memory = NodeMemory(live=live)
        live.when_store_opens(self.memory.load)
        self.tune = TuneRunner(node=live)
        self.watchdog = Watchdog(live=live)
        self.reloader = Reloader(live=live, policy=self.policy, remediator=self.remediator)
        self.udev = UdevWakeup(live.collector.rescan.set, live.host.paths)
        publisher = live.publisher
        publisher.extra_handlers = {**self.tune.handlers(), **ack_handlers(live), "reload": self.reloader.on_request}
        publisher.privileged_methods = PRIVILEGED_METHODS | ACK_METHODS | RELOAD_METHODS
        publisher.last_tune = self.tune.last
        self._closers: list[Callable[[], None]] = []
        self.loop_hook: Callable[[], None] | None = None  # tests: runs inside each loop iteration

    # -- one loop: collect -> snapshot -> evaluate -> act -> publish ---------------------------

    def loop_once(self) -> NodeSnapshot:
        live = self.live
        now = live.clock()
        started = time.monotonic()
        if self.loop_hook is not None:
            self.loop_hook()
        samples, events = self._collect(now)
        events += live.intake.take(live.prober.take_events())
        events += live.inference.on_loop(samples, events)
        live.intake.note(events)
        snapshot = self._snapshot(now, samples, time.monotonic() - started)
        self._save_memory(now)
        self.tune.history.observe(live.config, now, samples, snapshot.service_figures)
        self.tune.history.flush(live.store)
        self.remediator.remediate(snapshot, events, now)
        snapshot = live.publisher.publish(snapshot)
        self.remediator.push_alerts(snapshot)
        self.watchdog.beat()
        return snapshot

    def _collect(self, now: float) -> tuple[list[GpuSample], list[Event]]:
        """This loop's samples, and the events the watchers and the policy loop made of them."""
        live = self.live
        self.memory.follow_acks()
        wait_seconds = live.timing.step_wait(live.config.interval_seconds)
        backend = live.session.begin_loop(live.config, wait_seconds)
        if backend is None:
            return self.memory.remember(live.collector.unavailable(now, live.session.error), now), []
        samples = live.collector.collect(backend, now, live.config.counters_interval_seconds)
        samples = self.memory.remember(samples, now)
        events = live.watchers.observe(samples, now)
        events += self.policy.step(backend, now, wait_seconds, samples)
        if live.session.end_loop():
            self.policy.forget_backend()
        return samples, events

    def _snapshot(self, now: float, samples: list[GpuSample], duration_seconds: float) -> NodeSnapshot:
        live = self.live
        return build_snapshot(
            live.config,
            now,
            samples,
            live.watchers,
            driver_version=live.session.driver_version(),
            policy=self.policy.plans,
            daemon=self._daemon_parts(duration_seconds),
            service_figures=live.inference.figures(),
            gpu_attribution=live.inference.attribution(),
        )

    def _daemon_parts(self, duration_seconds: float) -> DaemonParts:
        live = self.live
        kmsg_ok, kmsg_detail = live.kmsg.status()
        collectors = (
            *live.collector.statuses(),
            *(s for s in (self.policy.status, self.remediator.status, self.remediator.alert_delivery.status) if s),
            CollectorStatus("kmsg", kmsg_ok, 0.0, "" if kmsg_ok else kmsg_detail),
            *live.session.statuses(),
        )
        return DaemonParts(
            started_seconds=self.started_seconds,
            stale_gpus=live.collector.stale,
            backend_error=live.session.error,
            services=tuple(live.prober.statuses()),
            remediations=self.remediator.counts(),
            remediation_failing=self.remediator.failing(),
            collectors=collectors,
            recent_events=live.intake.recent,
            recent_remediations=self.remediator.recent(),
            rules_sources=self.remediator.rules_sources,
            rules_loaded=self.remediator.rules_loaded(),
            slo_breaches=live.inference.breaches(),
            collect_duration_seconds=duration_seconds,
            tunes=self.tune.results(),
        )

    def react(self) -> None:
        """Between loops: an Xid or a failed probe is evaluated at once, against the last snapshot,
        instead of waiting up to one interval for the next collection."""
        live = self.live
        snapshot = live.snapshot()
        events = live.intake.take(live.prober.take_events())
        if snapshot is None or not events:
            live.intake.give_back(events)  # before the first snapshot: kept for the first loop
            return
        live.intake.note(events)
        snapshot = replace(
            snapshot,
            services=tuple(live.prober.statuses()),
            xids=tuple(live.watchers.xid.counts()),
            open_xids=live.watchers.xid.open_marks(),
            recent_events=live.intake.recent,
            health=live.watchers.health(snapshot.health, live.collector.stale, live.session.error),
        )
        self._save_memory(live.clock())
        self.remediator.remediate(snapshot, events, live.clock())
        live.publisher.set(snapshot)

    def _save_memory(self, now: float | None = None) -> None:
        self.memory.follow_acks()  # an ack since the loop began is not written over
        self.memory.save(self.live.clock() if now is None else now)

    # -- lifecycle -----------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # embedded (tests): the caller stops the daemon through stop_requested

        def on_stop(signum: int, _frame: FrameType | None) -> None:
            self.live.stop_requested.set()
            self.live.wake.set()

        def on_hup(_signum: int, _frame: FrameType | None) -> None:
            self.reloader.requested.set()
            self.live.wake.set()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)

    def start_services(self) -> None:
        live = self.live
        stale_after = live.timing.stall_seconds(live.config.interval_seconds)
        self._closers.extend(live.publisher.serve(live.config, stale_after))
        self.reloader.publish_socket()
        self._closers.append(live.socket_record.withdraw)  # closed before the socket: no record outlives it
        record_known_good(live.config)
        live.kmsg.start()
        self._closers.append(live.kmsg.stop)
        self.remediator.start()  # opens the store: the node memory loads
        self._closers.append(self.remediator.stop)
        # Before the first loop: the policy loop never sees a setting a killed job left changed unheld.
        recovery = live.holds.recover(live.current_backend)
        self.tune.recover()  # its rows close once recovery has put their settings back
        if recovery is not None:
            live.lanes.submit_task(recovery)
        # Closed in reverse: after the prober stops, before the store closes, the last streaks are kept.
        self._closers.append(self._save_memory)
        live.start_service_watch()
        self._closers.append(live.stop_service_watch)
        if self.udev.start():
            self._closers.append(self.udev.stop)
        else:
            log.info("udev not available; GPUs are re-enumerated by polling", reason=self.udev.reason)
        log.info("serving", metrics=live.config.metrics.listen, socket=live.config.api.socket)

    def run(self) -> int:
        self.install_signal_handlers()
        return_large_buffers()
        try:
            self.start_services()
            snapshot = self.loop_once()
            self.live.publisher.notifier.ready(systemd_status_line(snapshot))
            self.watchdog.start()
            self._run_loops()
            return 0
        finally:
            self.shutdown()

    def _run_loops(self) -> None:
        live = self.live
        next_loop = time.monotonic() + live.config.interval_seconds
        while not live.stop_requested.is_set():
            live.wake.wait(max(0.0, next_loop - time.monotonic()))
            live.wake.clear()
            if live.stop_requested.is_set():
                break
            if self.reloader.requested.is_set():
                self.reloader.run_requested()
            if time.monotonic() < next_loop:
                self.react()  # woken early by an event
                continue
            self.loop_once()
            next_loop += live.config.interval_seconds
            if next_loop < time.monotonic():  # a slow loop: start again now, do not try to catch up
                next_loop = time.monotonic()

    def shutdown(self) -> None:
        live = self.live
        live.stop_requested.set()
        live.publisher.notifier.stopping()
        self.policy.restore_fans()  # fans the agent set to manual go back to automatic on every exit path
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                close()
        live.session.close()
        self.policy.forget_backend()
        live.runner.shutdown()
        log.info("stopped")
