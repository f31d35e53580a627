"""`gpu-agent run`: collect -> snapshot -> evaluate -> act -> publish, once per interval.

Threads: one lane per GPU for time-bounded NVML reads (agent.bounded), the NVML event wait and
the kernel-log reader feeding the Xid watcher, the service prober, the metrics and API servers,
the action worker (a GPU reset can take a minute; the loop must not wait for it) and the
watchdog pinger. Only the loop builds snapshots; everyone else reads the last published one.

systemd: READY=1 after the first full collection; STATUS= one line per loop; WATCHDOG=1 only
while the loop keeps completing; STOPPING=1 on the way out. SIGTERM/SIGINT stop (fans go back to
automatic on every exit path); SIGHUP reloads config and rules, keeping the old ones if the new
ones are invalid.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import structlog

from agent import __version__
from agent.backend import open_backend
from agent.backend.base import GpuBackend, GpuEvent, GpuIdentity, WriteGuard
from agent.backend.errors import NO_DRIVER_KINDS, GpuError, GpuErrorKind
from agent.bounded import BoundedRunner, StaleGpu
from agent.collect import sample_identified
from agent.config import AgentConfig, ConfigError, load_config
from agent.episodes import Episodes
from agent.events import Event, EventKind, Health, HealthState, Severity
from agent.host.paths import HostPaths
from agent.notify import SdNotifier
from agent.policy.base import HostContext, ItemPlan, PlanStatus
from agent.policy.base import Outcome as ItemOutcome
from agent.policy.engine import PolicyEngine
from agent.rules.actions import ActionContext, AlertTracker, execute
from agent.rules.config import Rule, load_rules
from agent.rules.engine import evaluate, gpus_by_service
from agent.rules.model import ActionOutcome, Decision, Outcome
from agent.service_watch import InferenceMonitor
from agent.services import HealthProber, ProberThread, build_managers
from agent.state import CollectorStatus, GpuSample, NodeSnapshot, RemediationCount
from agent.store import Store, StoreError
from agent.watch.devices import DeviceWatcher, UdevWakeup
from agent.watch.gpu_lost import GpuLostWatcher
from agent.watch.health import HealthBook, PollWatcher
from agent.watch.kernel_log import KernelXid
from agent.watch.kmsg import KmsgSource
from agent.watch.memory import MemoryWatcher
from agent.watch.nvml_events import NvmlEventSource
from agent.watch.pcie import PcieWatcher
from agent.watch.throttle import ThrottleWatcher
from agent.watch.xid import XidWatcher

log = structlog.get_logger("gpu-agent")

RECENT_EVENTS = 100
#: Errors meaning the NVML session itself is gone (driver unloaded or reloaded, library and kernel
#: module now differ after an upgrade): only a fresh nvmlInit can recover, so the backend is reopened.
LIBRARY_FAULT_KINDS = NO_DRIVER_KINDS | {GpuErrorKind.UNINITIALIZED}
_LIBRARY_FAULT_VALUES = frozenset(kind.value for kind in LIBRARY_FAULT_KINDS)


@dataclass
class LoopTiming:
    call_timeout_seconds: float = 2.0  # one GPU's whole sample; past it the GPU is stale
    slow_every_seconds: float = 30.0  # ECC counters, remapping, PCIe, thresholds
    stall_loops: float = 3.0  # the watchdog stops pinging once the loop is this many intervals late
    # How long one loop waits for the policy step or for opening the backend before going on
    # without it (the work keeps running and its result is taken by a later loop). None: one
    # interval, so a slow update-initramfs or a hung nvmlInit never costs the watchdog.
    step_wait_seconds: float | None = None


#: What one policy step hands back: the plans, the items it fixed, and why the others failed to apply.
_PolicyStep = tuple[tuple[ItemPlan, ...], list[ItemPlan], dict[tuple[str, int | None], str]]


@dataclass
class _Published:
    snapshot: NodeSnapshot | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self) -> NodeSnapshot | None:
        with self.lock:
            return self.snapshot

    def set(self, snapshot: NodeSnapshot) -> None:
        with self.lock:
            self.snapshot = snapshot


class Daemon:
    def __init__(
        self,
        config: AgentConfig,
        config_path: Path | None = None,
        *,
        notifier: SdNotifier | None = None,
        timing: LoopTiming | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.notifier = notifier or SdNotifier.from_environment()
        self.timing = timing or LoopTiming()
        self.clock = clock
        self.started_seconds = clock()
        self.published = _Published()
        self.stop_requested = threading.Event()
        self.wake = threading.Event()  # set by event sources, signals: the loop reacts before its next tick
        self.reload_requested = threading.Event()
        self.heartbeat_seconds = time.monotonic()
        self.backend: GpuBackend | None = None
        self.backend_error: GpuError | None = None
        self._opening: Future[GpuBackend] | None = None  # an open_backend still running in the library lane
        self._library_faults: list[str] = []  # this loop's evidence that the NVML session is gone
        self.engine: PolicyEngine | None = None
        self.host = HostContext(HostPaths.at(config.host_root))
        self.runner = BoundedRunner(self.timing.call_timeout_seconds)
        self.identities: dict[int, GpuIdentity] = {}
        self.samples: dict[int, GpuSample] = {}
        self.stale: set[int] = set()
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.recent_events: list[Event] = []
        self.policy: tuple[ItemPlan, ...] = ()
        self.drift_seen: dict[tuple[str, int | None], int] = {}  # item -> times drift came back after a fix
        self.collectors: dict[str, CollectorStatus] = {}
        self.last_slow_seconds = float("-inf")
        self.last_policy_seconds = float("-inf")
        self._policy_pending: tuple[Future[_PolicyStep], bool] | None = None  # (step, full pass?)
        self._apply_failures: dict[tuple[str, int | None], str] = {}  # item -> why the last apply failed
        self.throttle = ThrottleWatcher()
        self.poll_watchers: list[PollWatcher] = [self.throttle, MemoryWatcher(), GpuLostWatcher(), PcieWatcher()]
        self.devices = DeviceWatcher()
        self.xid = XidWatcher(lambda: self.identities, clock=clock)
        self.health_book = HealthBook([*self.poll_watchers, self.xid, self.devices])
        self.rescan = threading.Event()  # udev saw an NVIDIA device come or go: enumerate again
        self.udev = UdevWakeup(self.rescan.set, self.host.paths)
        self.kmsg = KmsgSource(self.host.paths, self._on_kernel_xid, start_monotonic_seconds=time.monotonic())
        self.nvml_events: NvmlEventSource | None = None
        self._watchdog_thread: threading.Thread | None = None
        self._closers: list[Callable[[], None]] = []
        self.store: Store | None = None
        self._store_failed_monotonic: float | None = None  # when opening the store last failed
        self._unstored: list[Event] = []  # keyed events the store could not take yet
        self.episodes = Episodes(config.state_dir)
        self.rules: list[Rule] = []
        self.alerts = AlertTracker()
        self.prober = HealthProber(config.services, build_managers(config, self.host))
        self.prober.on_event = self.wake.set
        self.prober_thread: ProberThread | None = None
        self.inference = InferenceMonitor(config, lambda: self.backend, config.interval_seconds, clock=clock)
        self.actions: queue.SimpleQueue[Decision | None] = queue.SimpleQueue()
        self.inflight: list[tuple[Decision, float]] = []  # queued or running: counted as attempts
        self.inflight_lock = threading.Lock()
        self.last_alert_refresh_seconds = 0.0
        self.status_note = ""  # appended to STATUS= until the next successful reload
        self.loop_hook: Callable[[], None] | None = None  # tests: runs inside each loop iteration

    # -- sources feeding the event queue -----------------------------------------------------

    def _on_kernel_xid(self, record: KernelXid) -> None:
        for event in self.xid.ingest_kernel(record):
            self.events.put(event)
            self.wake.set()

    def _on_nvml_event(self, event: GpuEvent) -> None:
        for produced in self.xid.ingest_nvml(event):
            self.events.put(produced)
            self.wake.set()

    def _on_nvml_lost(self, error: GpuError) -> None:
        log.warning("nvml event wait reports a lost GPU", gpu=error.gpu, error=str(error))

    # -- backend -------------------------------------------------------------------------------

    def step_wait_seconds(self) -> float:
        if self.timing.step_wait_seconds is not None:
            return self.timing.step_wait_seconds
        return max(self.timing.call_timeout_seconds, self.config.interval_seconds)

    def _ensure_backend(self) -> bool:
        """Open the backend if it is not open; a missing driver is retried every loop, not fatal.
        nvmlInit runs in the library lane: on a wedged driver it can hang, and the loop must not."""
        if self.backend is not None:
            return True
        try:
            if self._opening is None:
                self._opening = self.runner.submit("library", partial(open_backend, self.config))
            backend = self.runner.result("library", self._opening, self.step_wait_seconds())
        except StaleGpu as exc:
            self._backend_unavailable(
                GpuError(GpuErrorKind.TIMEOUT, f"opening the GPU backend has not returned ({exc})", call="init")
            )
            return False
        except GpuError as exc:
            self._opening = None
            self._backend_unavailable(exc)
            return False
        self._opening = None
        self.backend = backend
        self.backend_error = None
        self.engine = PolicyEngine(self.config, self.backend, self.host)
        self.nvml_events = NvmlEventSource(self.backend, self._on_nvml_event, self._on_nvml_lost)
        self.nvml_events.start()
        log.info("GPU backend open", backend=self.config.backend, driver=self._driver_version())
        return True

    def _backend_unavailable(self, exc: GpuError) -> None:
        if self.backend_error is None or self.backend_error.kind != exc.kind:
            log.error("GPU backend unavailable; retrying every loop", error=str(exc), kind=exc.kind.value)
        self.backend_error = exc

    def _close_backend(self) -> None:
        if self.nvml_events is not None:
            self.nvml_events.stop()
            self.nvml_events = None
        backend = self.backend
        if backend is not None:
            with contextlib.suppress(GpuError, StaleGpu):
                self.runner.run("library", backend.shutdown)
        self.backend = None
        self.engine = None
        self._policy_pending = None  # a step still running holds the old backend: its result is dropped

    def _library_fault(self, where: str, kind: GpuErrorKind | str) -> None:
        value = kind.value if isinstance(kind, GpuErrorKind) else kind
        if value in _LIBRARY_FAULT_VALUES:
            self._library_faults.append(f"{where}: {value}")

    def _reopen_if_driver_gone(self) -> None:
        """After a driver reload or upgrade the old NVML session answers DRIVER_NOT_LOADED, VERSION_MISMATCH
        or UNINITIALIZED for good: close it, and the next loop runs nvmlInit again (retried every loop)."""
        if not self._library_faults:
            return
        log.error(
            "NVML session lost (driver unloaded, reloaded or upgraded): re-initialising", seen=self._library_faults
        )
        self._close_backend()
        self.backend_error = GpuError(GpuErrorKind.UNINITIALIZED, "re-initialising NVML: " + self._library_faults[0])

    def _unavailable_samples(self, now: float) -> list[GpuSample]:
        """GPUs known from before the backend went away stay in the snapshot, down, rather than vanish
        from metrics (an alert on gpu_up == 0 must still fire)."""
        kind = self.backend_error.kind.value if self.backend_error is not None else GpuErrorKind.UNKNOWN.value
        return [
            GpuSample(gpu, i.uuid, i.name, i.pci_bus_id, up=False, timestamp_seconds=now, read_errors={"backend": kind})
            for gpu, i in sorted(self.identities.items())
        ]

    # -- collect ------------------------------------------------------------------------------

    def _timed(self, name: str, work: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            result = work()
        except (GpuError, StaleGpu, OSError) as exc:
            self.collectors[name] = CollectorStatus(name, False, time.monotonic() - started, str(exc))
            raise
        self.collectors[name] = CollectorStatus(name, True, time.monotonic() - started)
        return result

    def _enumerate(self, backend: GpuBackend) -> None:
        def read() -> tuple[int, dict[int, GpuIdentity]]:
            found: dict[int, GpuIdentity] = {}
            count = backend.device_count()
            for gpu in range(count):
                with contextlib.suppress(GpuError):
                    found[gpu] = backend.identity(gpu)
            return count, found

        count, found = self._timed("enumerate", lambda: self.runner.run("library", read))
        # A GPU NVML still counts but cannot identify (lost) keeps its last identity, so its
        # kernel-log lines still map to it; one that left the count is gone.
        previous = self.identities
        self.identities = {
            gpu: identity for gpu in range(count) if (identity := found.get(gpu) or previous.get(gpu)) is not None
        }

    def collect(self, now: float) -> list[GpuSample]:
        backend = self.backend
        assert backend is not None
        slow = _due(now, self.last_slow_seconds, self.timing.slow_every_seconds)
        # enumerate at start, when udev says so, when the count changes, and on every slow pass
        # (polling covers hosts without udev)
        if slow or self.rescan.is_set() or not self.identities or len(self.identities) != self._device_count(backend):
            self.rescan.clear()
            try:
                self._enumerate(backend)
            except GpuError as exc:
                self._library_fault("enumerate", exc.kind)
            except StaleGpu:
                pass
        started = time.monotonic()
        stale: set[int] = set()
        samples: list[GpuSample] = []
        # Every GPU's reads start before any is waited for: eight hung GPUs cost one timeout, not eight.
        pending: dict[int, Future[GpuSample] | StaleGpu] = {}
        for gpu, identity in sorted(self.identities.items()):
            work = partial(sample_identified, backend, identity, slow=slow, clock=self.clock)
            try:
                pending[gpu] = self.runner.submit(f"gpu{gpu}", work)
            except StaleGpu as exc:
                pending[gpu] = exc
        deadline = time.monotonic() + self.timing.call_timeout_seconds
        for gpu, identity in sorted(self.identities.items()):
            try:
                started_work = pending[gpu]
                if isinstance(started_work, StaleGpu):
                    raise started_work
                sample = self.runner.result(f"gpu{gpu}", started_work, max(0.0, deadline - time.monotonic()))
            except StaleGpu as exc:
                stale.add(gpu)
                previous = self.samples.get(gpu)
                sample = previous or GpuSample(
                    gpu, identity.uuid, identity.name, identity.pci_bus_id, up=False, timestamp_seconds=now
                )
                sample = replace(sample, read_errors={**sample.read_errors, "stale": str(exc)})
            else:
                for field_name, kind in sample.read_errors.items():
                    self._library_fault(f"GPU {gpu} {field_name}", kind)
                if not slow and gpu in self.samples:
                    sample = _carry_slow_fields(self.samples[gpu], sample)
            samples.append(sample)
            self.samples[gpu] = sample
        if slow:
            self.last_slow_seconds = now
        if stale - self.stale:
            log.warning("GPU calls hung: readings are stale", gpus=sorted(stale - self.stale))
        self.stale = stale
        self.collectors["gpu"] = CollectorStatus(
            "gpu", not stale, time.monotonic() - started, f"stale: {sorted(stale)}" if stale else ""
        )
        return samples

    def _device_count(self, backend: GpuBackend) -> int:
        try:
            count: int = self.runner.run("library", backend.device_count)
        except GpuError as exc:
            self._library_fault("device_count", exc.kind)
            return len(self.identities)
        except StaleGpu:
            return len(self.identities)
        return count

    # -- policy --------------------------------------------------------------------------------

    def enforce_policy(self, now: float) -> list[Event]:
        """Plan (all items every policy interval, the fan curve every loop); apply drift in enforce mode."""
        engine = self.engine
        if engine is None:
            return []
        full = _due(now, self.last_policy_seconds, self.config.policy_interval_seconds)
        wants_fans = any(p.fan_curve is not None for p in self.config.policy.gpus)
        if not full and not wants_fans:
            return []
        enforcing = bool(self.config.writable_items() - {"gpu_reset"})

        def step() -> _PolicyStep:
            items = None if full else {"fan_curve"}
            if enforcing:
                # apply() only writes items whose plan was read completely and says DRIFT: an item
                # with any failed read is an ERROR plan and is skipped, never half-applied.
                report = engine.apply(only=items)
                fixed = [r.plan for r in report.results if r.outcome is ItemOutcome.APPLIED]
                failed = {
                    (r.plan.item, r.plan.gpu): r.detail for r in report.results if r.outcome is ItemOutcome.FAILED
                }
                return report.plan.items, fixed, failed
            return engine.plan(only=items).items, [], {}

        try:
            if self._policy_pending is None:
                self._policy_pending = (self.runner.submit("policy", step), full)
            future, full = self._policy_pending  # possibly a step an earlier loop started
            plans, fixed, failed = self._timed(
                "policy", lambda: self.runner.result("policy", future, self.step_wait_seconds())
            )
        except StaleGpu as exc:
            # Still running (a long update-initramfs, a hung NVML call): the loop goes on and a later
            # loop takes the result; the collector says so meanwhile.
            self.collectors["policy"] = CollectorStatus("policy", False, 0.0, f"step still running: {exc}")
            log.warning("policy step still running; the loop goes on without it", error=str(exc))
            return []
        except (GpuError, OSError) as exc:
            self._policy_pending = None
            log.error("policy step failed", error=str(exc))
            if isinstance(exc, GpuError):
                self._library_fault("policy", exc.kind)
            # What the last pass said is no longer known to hold.
            self.policy = tuple(_unknown_plan(p, exc) if full or p.item == "fan_curve" else p for p in self.policy)
            return []
        self._policy_pending = None
        for plan in plans:
            if plan.error_kind is not None:
                self._library_fault(f"policy {plan.item}", plan.error_kind)
        plans = self._note_apply_failures(plans, failed)
        if full:
            self.last_policy_seconds = now
            self.policy = plans
        else:
            self.policy = _merge_plans(self.policy, plans)
        return self._drift_events(fixed, now)

    def _note_apply_failures(
        self, plans: tuple[ItemPlan, ...], failed: dict[tuple[str, int | None], str]
    ) -> tuple[ItemPlan, ...]:
        """A drift that could not be put back says why, in the plan and (once per reason) in the log."""
        for key, detail in failed.items():
            if self._apply_failures.get(key) != detail:
                log.warning("policy item could not be applied", item=key[0], gpu=key[1], error=detail)
        planned = {(p.item, p.gpu) for p in plans}
        self._apply_failures = {
            **{k: v for k, v in self._apply_failures.items() if k not in planned},
            **failed,
        }
        return tuple(
            replace(p, detail="; ".join(filter(None, (p.detail, f"not applied: {failed[(p.item, p.gpu)]}"))))
            if (p.item, p.gpu) in failed
            else p
            for p in plans
        )

    def _drift_events(self, fixed: Sequence[ItemPlan], now: float) -> list[Event]:
        events = []
        for plan in fixed:
            key = (plan.item, plan.gpu)
            count = self.drift_seen.get(key, -1) + 1
            self.drift_seen[key] = count
            identity = self.identities.get(plan.gpu) if plan.gpu is not None else None
            log.info("policy drift corrected", item=plan.item, gpu=plan.gpu, desired=plan.desired, actual=plan.actual)
            events.append(
                Event(
                    EventKind.POLICY_DRIFT,
                    Severity.WARNING if count else Severity.INFO,
                    plan.gpu,
                    identity.uuid if identity else None,
                    f"{plan.item} drifted ({plan.actual}, want {plan.desired}) and was corrected"
                    + (f"; it came back {count} time(s)" if count else ""),
                    now,
                    "policy",
                    f"drift:{plan.item}:{plan.gpu}:{now}",
                    {"item": plan.item, "reappeared": count, "desired": plan.desired, "actual": plan.actual},
                )
            )
        return events

    # -- one loop ------------------------------------------------------------------------------

    def loop_once(self) -> NodeSnapshot:
        now = self.clock()
        started = time.monotonic()
        if self.loop_hook is not None:
            self.loop_hook()
        events: list[Event] = []
        samples: list[GpuSample] = []
        self._library_faults = []
        if self._ensure_backend():
            samples = self.collect(now)
            for watcher in self.poll_watchers:
                events.extend(watcher.observe(samples, now))
            events.extend(self.devices.observe(samples, now))
            events.extend(self.enforce_policy(now))
            self._reopen_if_driver_gone()
        else:
            samples = self._unavailable_samples(now)
        events.extend(self._take_queued_events())
        events.extend(self.inference.on_loop(samples, events))
        self._note_events(events)
        snapshot = self.build_snapshot(now, samples, time.monotonic() - started)
        self.remediate(snapshot, events, now)
        self.published.set(snapshot)
        self.heartbeat_seconds = time.monotonic()
        self.notifier.status(status_line(snapshot) + self.status_note)
        return snapshot

    def _take_queued_events(self) -> list[Event]:
        """Events from the source threads (Xids, probes), logged and kept for the status view."""
        events: list[Event] = []
        while True:
            try:
                events.append(self.events.get_nowait())
            except queue.Empty:
                break
        events.extend(self.prober.take_events())
        return events

    def _note_events(self, events: Sequence[Event]) -> None:
        for event in events:
            log.info(event.message, kind=event.kind.value, gpu=event.gpu, gpu_uuid=event.uuid, **_event_fields(event))
        self.recent_events = (self.recent_events + list(events))[-RECENT_EVENTS:]

    def react(self) -> None:
        """Between loops: an Xid or a failed probe is evaluated at once, against the last snapshot,
        instead of waiting up to one interval for the next collection."""
        snapshot = self.published.get()
        events = self._take_queued_events()
        if snapshot is None or not events:
            for event in events:  # before the first snapshot: keep them for the first loop
                self.events.put(event)
            return
        self._note_events(events)
        snapshot = replace(
            snapshot,
            services=tuple(self.prober.statuses()),
            xids=tuple(self.xid.counts()),
            recent_events=tuple(self.recent_events),
            health={gpu: self._health(gpu) for gpu in snapshot.health},
        )
        self.remediate(snapshot, events, self.clock())
        self.published.set(snapshot)

    def build_snapshot(self, now: float, samples: Sequence[GpuSample], duration_seconds: float) -> NodeSnapshot:
        gpus = sorted(s.index for s in samples)
        kmsg_ok, kmsg_detail = self.kmsg.status()
        collectors = dict(self.collectors)
        collectors["kmsg"] = CollectorStatus("kmsg", kmsg_ok, 0.0, "" if kmsg_ok else kmsg_detail)
        if self.nvml_events is not None:
            ok, detail = self.nvml_events.status()
            collectors["xid_nvml"] = CollectorStatus("xid_nvml", ok, 0.0, "" if ok else detail)
        if self.backend_error is not None:
            collectors["backend"] = CollectorStatus("backend", False, 0.0, str(self.backend_error))
        return NodeSnapshot(
            timestamp_seconds=now,
            started_seconds=self.started_seconds,
            version=__version__,
            backend=self.config.backend,
            driver_version=self._driver_version(),
            gpus=tuple(samples),
            stale_gpus=frozenset(self.stale),
            health={gpu: self._health(gpu) for gpu in gpus},
            policy=self.policy,
            item_modes={p.item: self.config.item_mode(p.item).value for p in self.policy if p.item != "gpu"},
            services=tuple(self.prober.statuses()),
            remediations=self._remediation_counts(),
            clock_event_seconds=self.throttle.clock_event_seconds(),
            throttle_active_since=self.throttle.active_since(),
            xids=tuple(self.xid.counts()),
            collectors=tuple(collectors.values()),
            recent_events=tuple(self.recent_events),
            collect_duration_seconds=duration_seconds,
            service_figures=self.inference.figures(),
            gpu_attribution=self.inference.attribution(),
        )

    def _remediation_counts(self) -> tuple[RemediationCount, ...]:
        if self.store is None:
            return ()
        try:
            return tuple(self.store.remediation_counts())
        except StoreError as exc:
            log.error("cannot read remediation counts", error=str(exc))
            return ()

    # -- evaluate -> act ---------------------------------------------------------------------

    def _reopen_store(self) -> Store | None:
        """A store that could not be opened (state dir full, read-only) is tried again now and then."""
        if self.store is not None or self._store_failed_monotonic is None:
            return self.store
        if time.monotonic() - self._store_failed_monotonic < STORE_RETRY_SECONDS:
            return None
        try:
            self.store = Store.open(self.config.state_dir)
        except StoreError as exc:
            self._store_failed_monotonic = time.monotonic()
            self.collectors["remediation"] = CollectorStatus("remediation", False, 0.0, str(exc))
            return None
        log.info("event store open again: remediation resumes", path=str(self.store.path))
        self._store_failed_monotonic = None
        self._closers.append(self.store.close)
        return self.store

    def remediate(self, snapshot: NodeSnapshot, events: Sequence[Event], now: float) -> None:
        """Store new events, evaluate the rules (pure), queue the actions: the loop never waits on one."""
        store = self._reopen_store()
        if store is None and self._store_failed_monotonic is None:
            return  # no store at all (an embedded daemon that never started its services)
        # Keyed once: a clearing event closes its episode once, however often it has to be retried. A
        # retried event the store took before it failed, but no rule saw, is offered again by the store.
        keyed_events = self._unstored + [self.episodes.keyed(event) for event in events]
        self._unstored = []
        if store is None:
            self._keep_unstored(keyed_events)
            return
        started = time.monotonic()
        new: list[Event] = []
        try:
            for keyed in keyed_events:
                if store.record_event(keyed):
                    new.append(keyed)
            with self.inflight_lock:
                history = _InflightHistory(store, list(self.inflight))
            decisions = evaluate(snapshot, new, self.rules, history, now, gpus_by_service(self.config.services))
            for decision in decisions:
                if decision.action is None or decision.dry_run:
                    outcome = Outcome.SUPPRESSED if decision.action is None else Outcome.DRY_RUN
                    self._record(ActionOutcome(decision, outcome, decision.reason, now, now))
                    log.info(
                        f"action {outcome.value}",
                        rule=decision.rule,
                        action=decision.action.kind.value if decision.action else None,
                        reason=decision.reason,
                        **_target_fields(decision),
                    )
                    continue
                with self.inflight_lock:
                    self.inflight.append((decision, now))
                log.info(
                    "action started",
                    rule=decision.rule,
                    action=decision.action.kind.value,
                    attempt=decision.attempt,
                    reason=decision.reason,
                    **_target_fields(decision),
                )
                self.actions.put(decision)
            for event in new:
                store.mark_handled(event.key)
        except StoreError as exc:
            self.collectors["remediation"] = CollectorStatus("remediation", False, time.monotonic() - started, str(exc))
            log.error("remediation step failed: the event store is unusable", error=str(exc))
            self._keep_unstored(keyed_events)
            return
        self.collectors["remediation"] = CollectorStatus("remediation", True, time.monotonic() - started)
        for event in events:
            with contextlib.suppress(Exception):
                self.alerts.resolve_cleared(event)
        if _due(now, self.last_alert_refresh_seconds, ALERT_REFRESH_SECONDS):
            self.last_alert_refresh_seconds = now
            for error in self.alerts.refresh():
                log.warning("could not refresh an alert", error=error)

    def _keep_unstored(self, keyed_events: list[Event]) -> None:
        """Events the store could not take wait for the next loop (bounded: a store down for days must
        not grow the agent); the oldest go first, and that is logged."""
        dropped = len(keyed_events) - MAX_UNSTORED_EVENTS
        if dropped > 0:
            log.error("event store unusable for long: oldest unstored events dropped", dropped=dropped)
        self._unstored = keyed_events[-MAX_UNSTORED_EVENTS:]

    def _record(self, outcome: ActionOutcome) -> None:
        if self.store is None:
            return
        try:
            self.store.record_outcome(outcome)
        except StoreError as exc:
            log.error("could not record a remediation", error=str(exc), rule=outcome.decision.rule)

    def _action_worker(self) -> None:
        while (decision := self.actions.get()) is not None:
            started = self.clock()
            backend = self.backend
            if backend is None:
                outcome = ActionOutcome(decision, Outcome.FAILED, "GPU backend unavailable", started, self.clock())
            else:
                context = ActionContext(
                    config=self.config,
                    backend=backend,
                    policy=PolicyEngine(self.config, backend, self.host),
                    host=self.host,
                    managers=build_managers(self.config, self.host),
                    prober=self.prober,
                    alerts=self.alerts,
                    clock=self.clock,
                )
                outcome = execute(decision, context)
            self._record(outcome)
            with self.inflight_lock:
                self.inflight = [(d, t) for d, t in self.inflight if d is not decision]
            log.info(
                "action finished",
                rule=decision.rule,
                action=decision.action.kind.value if decision.action else None,
                outcome=outcome.outcome.value,
                detail=outcome.detail,
                seconds=round(outcome.finished_seconds - outcome.started_seconds, 3),
                **_target_fields(decision),
            )
            action = decision.action
            reset_done = action is not None and action.kind.value == "reset_gpu" and outcome.outcome is Outcome.SUCCESS
            if reset_done and decision.target.gpu is not None:
                self.xid.clear(decision.target.gpu)  # a reset GPU starts with a clean Xid history

    def _health(self, gpu: int) -> Health:
        if self.backend is None and self.backend_error is not None:
            return Health(HealthState.DEGRADED, f"GPU backend unavailable: {self.backend_error}")
        if gpu in self.stale:
            return Health(HealthState.DEGRADED, "NVML calls for this GPU hang: readings are stale")
        return self.health_book.gpu_health(gpu)

    def _driver_version(self) -> str | None:
        if self.backend is None:
            return None
        try:
            version: str = self.runner.run("library", self.backend.driver_version)
        except (GpuError, StaleGpu):
            return None
        return version

    # -- reload --------------------------------------------------------------------------------

    def reload(self) -> bool:
        """SIGHUP: a valid new config replaces the old; an invalid one is logged and ignored."""
        if self.config_path is None:
            log.warning("reload requested but the daemon runs on a built-in config; nothing to reload")
            return False
        try:
            new = load_config(self.config_path)
            rules = self._load_rules(new)
        except ConfigError as exc:
            message = "; ".join(str(p) for p in exc.problems)
            log.error("config reload failed; keeping the running config", error=message)
            self.status_note = f"; config reload failed (running the previous config): {message}"[:300]
            self.notifier.status(f"config reload failed, running the previous config: {message}"[:400])
            return False
        if new.backend != self.config.backend or new.host_root != self.config.host_root:
            log.error("config reload: backend and host_root changes need a restart; keeping the running config")
            return False
        old_services = self.config.services
        self.config = new
        self.rules = rules
        if new.services != old_services:
            if self.prober_thread is not None:
                self.prober_thread.stop()
            self.prober = HealthProber(new.services, build_managers(new, self.host))
            self.prober.on_event = self.wake.set
            self.prober_thread = ProberThread(self.prober)
            self.prober_thread.start()
            self.inference.stop()
            self.inference = InferenceMonitor(new, lambda: self.backend, new.interval_seconds, clock=self.clock)
            self.inference.start()
        self.status_note = ""
        if self.backend is not None and hasattr(self.backend, "write_guard"):
            self.backend.write_guard = WriteGuard(new.writable_items())
        if self.engine is not None:
            self.engine.config = new
        self.last_policy_seconds = float("-inf")
        log.info("config reloaded", path=str(self.config_path), mode=new.mode.value)
        return True

    # -- watchdog ------------------------------------------------------------------------------

    def loop_healthy(self) -> bool:
        stall_seconds = self.timing.stall_loops * self.config.interval_seconds + self.timing.call_timeout_seconds
        return time.monotonic() - self.heartbeat_seconds <= stall_seconds

    def _watchdog(self, period_seconds: float) -> None:
        while not self.stop_requested.wait(period_seconds):
            if self.loop_healthy():
                self.notifier.watchdog()
            else:
                log.error("main loop stalled: withholding watchdog pings so systemd restarts the agent")

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
        from agent.api import ApiServer
        from agent.metrics import serve_metrics

        stale_after = self.timing.stall_loops * self.config.interval_seconds + self.timing.call_timeout_seconds
        metrics = serve_metrics(self.config.metrics.listen, self.published.get, stale_after_seconds=stale_after)
        self._closers.append(metrics.close)
        api = ApiServer(self.config.api.socket, self.api_handlers(), group=self.config.api.group)
        api.start()
        self._closers.append(api.close)
        self.kmsg.start()
        self._closers.append(self.kmsg.stop)
        self.rules = self._load_rules(self.config)
        try:
            self.store = Store.open(self.config.state_dir)
        except StoreError as exc:
            log.error(
                "event store unavailable: remediation is off until it can be opened",
                error=str(exc),
                retry_seconds=STORE_RETRY_SECONDS,
            )
            self.collectors["remediation"] = CollectorStatus("remediation", False, 0.0, str(exc))
            self._store_failed_monotonic = time.monotonic()
        else:
            self._closers.append(self.store.close)
        self.prober_thread = ProberThread(self.prober)
        self.prober_thread.start()
        self._closers.append(lambda: self.prober_thread.stop() if self.prober_thread else None)
        self.inference.start()
        self._closers.append(lambda: self.inference.stop())
        worker = threading.Thread(target=self._action_worker, name="actions", daemon=True)
        worker.start()

        def stop_worker() -> None:
            self.actions.put(None)
            worker.join(5)  # an action still running (a reset) is left to finish in its daemon thread

        self._closers.append(stop_worker)
        if self.udev.start():
            self._closers.append(self.udev.stop)
        else:
            log.info("udev not available; GPUs are re-enumerated by polling", reason=self.udev.reason)
        log.info("serving", metrics=self.config.metrics.listen, socket=self.config.api.socket)

    @staticmethod
    def _load_rules(config: AgentConfig) -> list[Rule]:
        """Rules from rules_dir; a missing directory means no rules (logged), an invalid file is a ConfigError."""
        rules_dir = Path(config.remediation.rules_dir)
        if not rules_dir.is_dir():
            log.warning("no rules directory: remediation has nothing to do", rules_dir=str(rules_dir))
            return []
        rules = load_rules([rules_dir], allow_reboot=config.remediation.allow_reboot)
        log.info("rules loaded", rules_dir=str(rules_dir), count=len(rules))
        return rules

    def api_handlers(self) -> dict[str, Callable[[Any], Any]]:
        from agent.render import snapshot_document

        def status(_params: Any) -> Any:
            snapshot = self.published.get()
            if snapshot is None:
                return {"starting": True}
            return snapshot_document(snapshot, source="daemon")

        return {"status": status, "ping": lambda _p: {"pid": threading.get_native_id(), "version": __version__}}

    def run(self) -> int:
        self.install_signal_handlers()
        try:
            self.start_services()
            snapshot = self.loop_once()
            self.notifier.ready(status_line(snapshot))
            period = self.notifier.watchdog_seconds
            if period is not None:
                self._watchdog_thread = threading.Thread(
                    target=self._watchdog, args=(period / 2,), name="watchdog", daemon=True
                )
                self._watchdog_thread.start()
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
            return 0
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self.stop_requested.set()
        self.notifier.stopping()
        self._restore_fans()
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                close()
        self._close_backend()
        self.runner.shutdown()
        log.info("stopped")

    def _restore_fans(self) -> None:
        """Fans the agent set to manual go back to automatic on every exit path."""
        if self.engine is None or "fan_curve" not in self.config.writable_items():
            return
        from agent.policy import fan_curve

        for gpu, ctx in sorted(self.engine.state.contexts.items()):
            try:
                result = self.runner.run(f"gpu{gpu}", partial(fan_curve.restore, ctx), timeout_seconds=5.0)
            except (StaleGpu, GpuError) as exc:
                log.error("could not restore automatic fan control", gpu=gpu, error=str(exc))
                continue
            if result.outcome is ItemOutcome.FAILED:
                log.error("could not restore automatic fan control", gpu=gpu, error=result.detail)
            else:
                log.info("fans restored to automatic", gpu=gpu, outcome=result.outcome.value)


ALERT_REFRESH_SECONDS = 60.0
STORE_RETRY_SECONDS = 30.0
MAX_UNSTORED_EVENTS = 10_000


class _InflightHistory:
    """The store's attempt history plus actions queued or running, so the next loop's evaluation
    counts an action from the moment it is decided, not only once it has finished."""

    def __init__(self, store: Store, inflight: list[tuple[Decision, float]]) -> None:
        self._store = store
        self._inflight = inflight

    def _mine(self, rule: str, target_key: str) -> list[float]:
        return [t for d, t in self._inflight if d.rule == rule and d.target.key == target_key]

    def attempts(self, rule: str, target_key: str, since_seconds: float) -> list[float]:
        extra = [t for t in self._mine(rule, target_key) if t >= since_seconds]
        return sorted(self._store.attempts(rule, target_key, since_seconds) + extra)

    def last_attempt(self, rule: str, target_key: str) -> float | None:
        times = self._mine(rule, target_key)
        stored = self._store.last_attempt(rule, target_key)
        if stored is not None:
            times.append(stored)
        return max(times) if times else None

    def circuit_open(self, rule: str, target_key: str) -> bool:
        return self._store.circuit_open(rule, target_key)

    def handled(self, event_key: str) -> bool:
        return self._store.handled(event_key)


def _target_fields(decision: Decision) -> dict[str, Any]:
    fields: dict[str, Any] = {"gpu": decision.target.gpu, "gpu_uuid": decision.target.uuid}
    if decision.target.service:
        fields["service"] = decision.target.service
    if "xid" in decision.event.data:
        fields["xid"] = decision.event.data["xid"]
    return fields


def _carry_slow_fields(previous: GpuSample, fresh: GpuSample) -> GpuSample:
    """A fast-tier sample keeps the last slow-tier readings, so metrics do not flap between loops."""
    slow = {
        name: getattr(previous, name)
        for name in (
            "ecc_corrected_volatile",
            "ecc_uncorrected_volatile",
            "ecc_corrected_aggregate",
            "ecc_uncorrected_aggregate",
            "remapped_rows_correctable",
            "remapped_rows_uncorrectable",
            "remap_pending",
            "remap_failed",
            "retired_pages_pending",
            "pcie_generation",
            "pcie_width",
            "pcie_max_generation",
            "pcie_max_width",
            "pcie_replay_count",
            "slowdown_temperature_celsius",
            "shutdown_temperature_celsius",
            "power_violation_ns",
            "thermal_violation_ns",
            "recovery_action",
        )
    }
    return replace(fresh, **slow) if fresh.up else fresh


def _due(now: float, last: float, every_seconds: float) -> bool:
    """Whether periodic work is due on the wall clock; a clock stepped backwards makes it due at once
    rather than wait for the clock to catch up with the old time (an hour without policy checks)."""
    elapsed = now - last
    return elapsed >= every_seconds or elapsed < 0


def _unknown_plan(plan: ItemPlan, exc: Exception) -> ItemPlan:
    return replace(
        plan,
        status=PlanStatus.ERROR,
        actual="unknown",
        detail=f"policy step failed: {exc}",
        changes=(),
        error_kind=exc.kind.value if isinstance(exc, GpuError) else None,
    )


def _merge_plans(previous: tuple[ItemPlan, ...], fresh: tuple[ItemPlan, ...]) -> tuple[ItemPlan, ...]:
    replaced = {(p.item, p.gpu): p for p in fresh}
    merged = [replaced.pop((p.item, p.gpu), p) for p in previous]
    return (*merged, *replaced.values())


def _event_fields(event: Event) -> dict[str, Any]:
    fields: dict[str, Any] = {"severity": event.severity.value, "source": event.source}
    if "xid" in event.data:
        fields["xid"] = event.data["xid"]
    return fields


def status_line(snapshot: NodeSnapshot) -> str:
    """One line for systemd's STATUS= (what `systemctl status gpu-agent` shows)."""
    total = len(snapshot.gpus)
    unhealthy = sum(1 for h in snapshot.health.values() if h.state is HealthState.UNHEALTHY)
    degraded = sum(1 for h in snapshot.health.values() if h.state is HealthState.DEGRADED)
    drift = sum(1 for p in snapshot.policy if p.status in (PlanStatus.DRIFT, PlanStatus.ERROR))
    parts = [f"{total} GPUs"]
    if unhealthy or degraded:
        parts.append(f"{unhealthy} unhealthy, {degraded} degraded")
    else:
        parts.append("all healthy")
    if snapshot.stale_gpus:
        parts.append(f"{len(snapshot.stale_gpus)} stale")
    parts.append(f"policy: {drift} item(s) off" if drift else "policy in sync")
    return "; ".join(parts)
