"""The daemon's live parts: the one object every part of the daemon is handed (`live=`, keyword
only), and asks, at the time of use, for what it needs. Nobody keeps a copy of what changes, so a
part sees a reload's swap or a store opened late without being told:

- `config`: the running config; a reload swaps it whole (agent/daemon/reload.py);
- `store`: the event store, None until the remediator opened it (and while it cannot);
- `prober`, `inference`: the service prober and the inference monitor; a reload that changes the
  services starts new ones (`restart_service_watch`);
- `current_backend()`: what the backend session has open now (None while the driver is away);
- `snapshot()`: the last published snapshot.

The rest is made here, once, and never replaced: the host, the clocks, the bounded runner, the
event intake, the backend session, the GPU collector, the health watchers, the ledger of held
settings, the action worker's lanes, Alertmanager's alert tracker, the publisher, the kernel-log
reader and the record of the published socket, each wired to the others by what it is given here.
Only the loop's thread writes the swapped parts (at start, and in a reload between loops); every
other thread reads them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from agent.backend.base import GpuBackend, GpuEvent, GpuIdentity
from agent.config import AgentConfig
from agent.daemon.alert_book import PushBook
from agent.daemon.bounded import BoundedRunner
from agent.daemon.gpu_collector import GpuCollector
from agent.daemon.intake import EventIntake
from agent.daemon.lanes import Lanes
from agent.daemon.publisher import Publisher
from agent.daemon.sd_notify import SdNotifier
from agent.daemon.session import BackendSession
from agent.daemon.socket_record import SocketRecord
from agent.daemon.timing import LoopTiming
from agent.host.paths import HostPaths
from agent.logs import get_logger
from agent.node_memory.inventory import read_boot_id
from agent.policy.base import HostContext
from agent.policy.engine import PolicyEngine
from agent.policy.holds import PolicyHolds
from agent.rules.actions.context import ActionContext
from agent.services.attribution import service_of_pid
from agent.services.managers import ServiceManager, build_managers
from agent.services.monitor import InferenceMonitor
from agent.services.prober import HealthProber, ProberThread
from agent.snapshot import NodeWatchers
from agent.state import NodeSnapshot
from agent.store.attempt_clock import AttemptClock
from agent.store.database import Store, StoreError
from agent.watch.kernel_log import KernelXid
from agent.watch.kmsg import KmsgSource

log = get_logger()

# How long the policy step waits for the next-boot check (it runs on a worker of its own): a slow
# check is taken by a later pass instead of holding up the fan curve.
BOOT_CHECK_WAIT_SECONDS = 5.0


class Live:
    def __init__(
        self,
        config: AgentConfig,
        *,
        config_path: Path | None,
        config_identity: list[int] | None,
        timing: LoopTiming,
        clock: Callable[[], float],
        boottime: Callable[[], float],
        notifier: SdNotifier,
    ) -> None:
        self.config = config
        self.config_path = config_path  # the file a reload reads again (None: a built-in config)
        self.timing = timing
        self.clock = clock  # wall time: what is recorded and shown
        self.boottime = boottime  # CLOCK_BOOTTIME: windows and holds
        self.stop_requested = threading.Event()
        self.wake = threading.Event()  # set by event sources and signals: the loop reacts before its tick
        self.host = HostContext(HostPaths.at(config.host_root), boot_check_wait_seconds=BOOT_CHECK_WAIT_SECONDS)
        boot_id = self.host.paths.boot_id()  # "" when it cannot be read: no journal entry counts as this boot's
        self.memory_boot_id = read_boot_id(self.host.paths)  # the boot the node memory is kept under
        self.store: Store | None = None
        self._store_readers: list[Callable[[Store], None]] = []
        self.runner = BoundedRunner(timing.call_timeout_seconds)
        self.intake = EventIntake(self.wake)
        self.session = BackendSession(self.runner, self._on_nvml_event)
        self.collector = GpuCollector(self.runner, timing, clock, self.session.note_fault)
        self.watchers = NodeWatchers(
            self._identities,
            clock,
            boottime,
            self._service_of_pid,
            kernel_log_followed=self._kernel_log_followed,
            release_xids=self.intake.put,
        )
        # GPU settings a job drives (a tune sweep, a reset): the policy loop plans them, never writes
        # them, and the ledger puts them back on every way out (journaled in the store).
        self.holds = PolicyHolds(self.current_store, boot_id, clock)
        self.attempt_clock = AttemptClock(boot_id, boottime)
        self.lanes = Lanes()
        self.alerts = PushBook(
            self.current_store, boot_id, clock
        )  # the alerts pushed to Alertmanager, kept in the store
        self.publisher = Publisher(notifier)
        self.socket_record = SocketRecord(self.host.paths, config_path, config_identity)
        self.kmsg = KmsgSource(self.host.paths, self._on_kernel_xid, start_monotonic_seconds=time.monotonic())
        self.prober = self._new_prober()
        self.prober_thread: ProberThread | None = None
        # The backend of the moment: the session reopens it after a driver reload.
        self.inference = InferenceMonitor(config, self.current_backend, clock=clock)

    # -- what the parts read at the time of use -------------------------------------------------

    def current_backend(self) -> GpuBackend | None:
        return self.session.backend

    def current_store(self) -> Store | None:
        return self.store

    def snapshot(self) -> NodeSnapshot | None:
        """The last published snapshot: what the API and a reaction between loops judge against."""
        return self.publisher.get()

    def gpu_count(self) -> int:
        return len(self.collector.identities)

    def managers(self) -> Mapping[str, ServiceManager]:
        """The running config's service managers (systemd, command), made anew: a reload may have changed them."""
        return build_managers(self.config, self.host)

    def action_context(self) -> ActionContext | None:
        """What an action reaches, built when it runs (the backend of the moment); None without one."""
        backend = self.session.backend
        if backend is None:
            return None
        return ActionContext(
            config=self.config,
            backend=backend,
            policy=PolicyEngine(self.config, backend, self.host, self.holds),
            host=self.host,
            managers=self.managers(),
            prober=self.prober,
            alerts=self.alerts,
            clock=self.clock,
        )

    # -- the store --------------------------------------------------------------------------------

    def when_store_opens(self, read: Callable[[Store], None]) -> None:
        """`read` runs each time the store opens (at start, or later when it could not be at first)."""
        self._store_readers.append(read)

    def store_opened(self, store: Store) -> None:
        """The remediator opened the store: every part reads it from now on, and what waited for it runs."""
        self.store = store
        for read in self._store_readers:
            read(store)

    def write_store(self, failure: str, write: Callable[[Store], object], **fields: object) -> None:
        """`write` to the store, if one is open. A StoreError is logged as `failure` (with `fields`),
        never raised: the caller goes on, as an action half-way must (stopping there would be worse
        than a step the journal missed) and the loop does."""
        store = self.store
        if store is None:
            return
        try:
            write(store)
        except StoreError as exc:
            log.error(failure, error=str(exc), **fields)

    # -- the services' prober and inference monitor -----------------------------------------------

    def start_service_watch(self) -> None:
        """The prober's threads and the inference monitor's scrapers, for the running config's services."""
        self.prober_thread = ProberThread(self.prober)
        self.prober_thread.start()
        self.inference.start()

    def stop_service_watch(self) -> None:
        self.inference.stop()
        if self.prober_thread is not None:
            self.prober_thread.stop()

    def restart_service_watch(self) -> None:
        """A reload changed the services: a fresh prober and inference monitor for them."""
        self.stop_service_watch()
        self.prober = self._new_prober()
        self.inference = InferenceMonitor(self.config, self.current_backend, clock=self.clock)
        self.start_service_watch()

    def _new_prober(self) -> HealthProber:
        prober = HealthProber(self.config.services, self.managers())
        prober.on_event = self.wake.set
        return prober

    # -- what the sources feed the watchers -----------------------------------------------------

    def _identities(self) -> Mapping[int, GpuIdentity]:
        return self.collector.identities

    def _service_of_pid(self, pid: int) -> str | None:
        """The configured service a faulting process belongs to (whose Xid it is)."""
        return service_of_pid(pid, self.config.services, self.host.paths)

    def _kernel_log_followed(self) -> bool:
        return self.kmsg.status()[0]

    def _on_kernel_xid(self, record: KernelXid) -> None:
        self.intake.put(self.watchers.xid.ingest_kernel(record))

    def _on_nvml_event(self, event: GpuEvent) -> None:
        self.intake.put(self.watchers.xid.ingest_nvml(event))
