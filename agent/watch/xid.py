"""Xid watcher: NVML Xid events and kernel-log Xid lines -> one Event per fault, counters and health.

The driver reports one Xid twice: as an NVML event (GPU index and code only) and as an ``NVRM: Xid``
kernel-log line (PCI bus id, pid, process, the decoded text). Either may come first, and either may
be missing (no NVML event set while the driver is wedged; no kernel log inside a container). Both
sources feed one ``XidWatcher``, which maps each sighting to a GPU and holds the one rule of what is
one fault: sightings of the same GPU and code whose first came within ``dedupe_window_seconds`` (on
the window clock) are one fault; for an app-level code (catalog action restart_service) also of the
same process, where a sighting that names none (NVML never does) joins the fault open for that code.
One fault is one Event, one count and so at most one remediation decision, with ``data["sources"]``
naming every source that saw it.

The Event is the richer record: the kernel log's line (its pid decides whose service an app-level Xid
restarts). An Xid NVML reports first, while a kernel log is followed, waits up to
``kernel_line_wait_seconds`` for its line and is told once, with the line's details when it came in
time and as NVML saw it otherwise (``release`` hands it on then). A line later than that only adds its
source. A fault a reset dealt with (``clear``) is closed: the reporter that has not seen it yet still
folds into it (no second event, no new health mark), a repeat from one that has is a new fault.

Health follows the catalog's default action for each Xid seen within ``health_window_seconds``:
reboot or reset_gpu -> UNHEALTHY, restart_service or alert -> DEGRADED, none -> HEALTHY. An Xid 154
("GPU recovery action changed") counts with the recovery action it names, and the latest one
replaces earlier ones: the driver is stating the GPU's current need, not adding a fault.

Counters, last-seen times and the health window outlive an agent restart: the daemon saves
``counts()`` and ``marks()`` in the store and hands them back to ``restore`` at start (agent/daemon/node_memory.py).

Both windows run on ``window_clock``, CLOCK_BOOTTIME by default: a step of the wall clock (NTP, an
operator) neither clears a fresh verdict nor holds an old one, and the readings stay comparable
across an agent restart on the same boot (the store keeps marks per boot). Event times and the
last-seen times people read are wall-clock time.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.backend.base import GpuEvent, GpuEventKind, GpuIdentity
from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.host.boottime import boottime_seconds
from agent.logs import get_logger
from agent.state import XidCount
from agent.watch import xid_catalog
from agent.watch.kernel_log import RECOVERY_ACTION_XID, KernelXid, normalise_pci_bus_id

log = get_logger()

SOURCE_NVML = "nvml"
SOURCE_KMSG = "kmsg"
#: The two reporters of an Xid: NVML's event set and the kernel log (read from /dev/kmsg or the journal).
_KERNEL_LOG = "kernel log"
#: How long an Xid NVML reported first waits for its kernel-log line. The driver writes both at once and
#: the reader follows the log within 0.1 s; a line later than this is not waited for.
KERNEL_LINE_WAIT_SECONDS = 1.0

DEFAULT_DEDUPE_WINDOW_SECONDS = 10.0
DEFAULT_HEALTH_WINDOW_SECONDS = 3600.0

_ACTION_HEALTH = {
    SuggestedAction.REBOOT: HealthState.UNHEALTHY,
    SuggestedAction.RESET_GPU: HealthState.UNHEALTHY,
    SuggestedAction.CONTACT_SUPPORT: HealthState.DEGRADED,
    SuggestedAction.CHECK_MECHANICALS: HealthState.DEGRADED,
    SuggestedAction.RESTART_SERVICE: HealthState.DEGRADED,
    SuggestedAction.ALERT: HealthState.DEGRADED,
    SuggestedAction.NONE: HealthState.HEALTHY,
}
_RECOVERY_SEVERITY = {
    SuggestedAction.REBOOT: Severity.CRITICAL,
    SuggestedAction.RESET_GPU: Severity.CRITICAL,
    SuggestedAction.ALERT: Severity.WARNING,
    SuggestedAction.NONE: Severity.INFO,
}


@dataclass(frozen=True)
class XidMark:
    """What one (GPU, Xid) contributes to that GPU's health while inside the health window."""

    gpu: int
    xid: int
    action: str  # SuggestedAction value
    reason: str
    seen_seconds: float  # CLOCK_BOOTTIME of the boot the mark belongs to (the watcher's window clock)


@dataclass(frozen=True)
class _Sighting:
    """One report of an Xid, from either source, mapped to a GPU."""

    source: str
    xid: int
    gpu: int | None
    uuid: str | None
    pci_bus_id: str | None
    pid: int | None
    process: str | None
    text: str
    nvlink: dict[str, Any] | None
    recovery_action: str | None
    kernel_timestamp_seconds: float | None
    process_service: str | None = None  # the configured service the faulting process belongs to

    def event(
        self,
        kind: EventKind,
        severity: Severity,
        message: str,
        key_detail: str,
        now: float,
        data: dict[str, Any],
        action: SuggestedAction,
    ) -> Event:
        """An event about this sighting, keyed "<kind>:<GPU identity>:<key_detail>:<now>"."""
        identity = self.uuid or self.pci_bus_id or "unknown"
        return Event(
            kind=kind,
            severity=severity,
            gpu=self.gpu,
            uuid=self.uuid,
            message=message,
            timestamp_seconds=now,
            source=self.source,
            key=f"{kind.value}:{identity}:{key_detail}:{now:.3f}",
            data=data,
            suggested_action=action,
        )


@dataclass
class _Fault:
    """A fault and its Event; later sightings inside the window fold into it."""

    event: Event
    first_seen_seconds: float  # on the window clock
    recovery_actions: set[str]
    reporters: set[str]  # NVML, the kernel log: each reports one Xid once
    held: bool = False  # NVML's sighting waiting for the kernel-log line: not told yet
    closed: bool = False  # a reset dealt with it


def _reporter(source: str) -> str:
    return SOURCE_NVML if source == SOURCE_NVML else _KERNEL_LOG


@dataclass
class _Mark:
    """What one (GPU, Xid) contributes to that GPU's health, and when it was last seen."""

    xid: int
    action: SuggestedAction
    reason: str
    seen_seconds: float  # on the window clock


@dataclass
class _Count:
    uuid: str
    count: int
    last_seen_seconds: float


def _within(elapsed_seconds: float, window_seconds: float) -> bool:
    """A reading still inside its window. A negative elapsed time is a reading from another clock
    (a mark stored as wall-clock time by an older agent): outside, not held open for good."""
    return 0.0 <= elapsed_seconds <= window_seconds


def _catalog_row(xid: int) -> tuple[str, str, Severity, SuggestedAction]:
    """(name, resolution bucket, severity, action) for a code, with the unknown-code defaults."""
    verdict = xid_catalog.verdict(xid)
    return verdict.name, verdict.resolution, Severity(verdict.severity), verdict.action


def _app_level(xid: int) -> bool:
    """The code is its process's own fault (catalog action restart_service)."""
    return _catalog_row(xid)[3] is SuggestedAction.RESTART_SERVICE


def recovery_suggested_action(recovery_action: str) -> SuggestedAction:
    """Xid 154's recovery action text ("GPU Reset Required", ...) -> SuggestedAction; unknown text -> ALERT."""
    mapped = xid_catalog.action_for_recovery(recovery_action)
    return mapped if mapped is not None else SuggestedAction.ALERT


def _by(sighting: _Sighting) -> str:
    """Whose process faulted, for the message: ` (pid 4242 python3, service sglang)`."""
    if sighting.pid is None:
        return ""
    name = f" {sighting.process}" if sighting.process else ""
    owner = f", service {sighting.process_service}" if sighting.process_service else ", no configured service"
    return f" (pid {sighting.pid}{name}{owner})"


def _where(gpu: int | None, pci_bus_id: str | None) -> str:
    if gpu is not None:
        return f"GPU {gpu} ({pci_bus_id})" if pci_bus_id else f"GPU {gpu}"
    return f"unknown GPU ({pci_bus_id})" if pci_bus_id else "an unidentified GPU"


def match_bus_id(
    pci_bus_id: str | None, identities: Mapping[int, GpuIdentity]
) -> tuple[int | None, GpuIdentity | None]:
    """The GPU a kernel-log bus id names, in any of the forms drivers print; (None, None) if none."""
    if pci_bus_id is None:
        return None, None
    wanted = normalise_pci_bus_id(pci_bus_id)
    if wanted is None:
        return None, None
    by_bus: dict[str, tuple[int, GpuIdentity]] = {}
    for index, identity in identities.items():
        normalised = normalise_pci_bus_id(identity.pci_bus_id)
        if normalised is not None:
            by_bus[normalised] = (index, identity)
    found = by_bus.get(wanted)
    if found is not None:
        return found
    # Older drivers print "PCI:3b:00" without a domain, which reads as domain 0; on a host whose GPUs
    # sit in another PCI domain, bus:device.function still names one GPU when it is unique.
    if wanted.startswith("00000000:"):
        tail = wanted.partition(":")[2]
        candidates = [entry for bus, entry in by_bus.items() if bus.partition(":")[2] == tail]
        if len(candidates) == 1:
            return candidates[0]
    return None, None


class XidWatcher:
    """Folds NVML and kernel-log Xid sightings into one Event per fault; thread-safe.

    ``identities`` returns the GPUs the agent knows (index -> identity); it is called on each sighting,
    so it should be cheap (a cached mapping) and keep the last known identity of a GPU that was lost,
    or that GPU's kernel-log lines cannot be matched to it. ``clock`` is wall-clock seconds (event
    times); ``window_clock`` measures the dedupe and health windows (see the module docstring).
    ``kernel_log_followed`` says whether a kernel-log line can still come (the daemon's kernel log
    source is reading); while it does, an NVML sighting waits for its line and is then handed to
    ``release`` (from a timer thread) unless the line came first.
    """

    def __init__(
        self,
        identities: Callable[[], Mapping[int, GpuIdentity]],
        clock: Callable[[], float] = time.time,
        dedupe_window_seconds: float = DEFAULT_DEDUPE_WINDOW_SECONDS,
        health_window_seconds: float = DEFAULT_HEALTH_WINDOW_SECONDS,
        window_clock: Callable[[], float] = boottime_seconds,
        process_owner: Callable[[int], str | None] = lambda pid: None,
        kernel_log_followed: Callable[[], bool] = lambda: False,
        release: Callable[[list[Event]], object] = lambda events: None,
        kernel_line_wait_seconds: float = KERNEL_LINE_WAIT_SECONDS,
    ) -> None:
        if dedupe_window_seconds < 0 or health_window_seconds < 0 or kernel_line_wait_seconds < 0:
            raise ValueError("windows must not be negative")
        self._kernel_log_followed = kernel_log_followed
        self._release = release
        self._kernel_line_wait_seconds = kernel_line_wait_seconds
        self._identities = identities
        self._clock = clock
        self._window_clock = window_clock
        self._process_owner = process_owner
        self._dedupe_window_seconds = dedupe_window_seconds
        self._health_window_seconds = health_window_seconds
        self._lock = threading.Lock()
        # (gpu index, or bus id when the GPU is unknown) x Xid x pid -> the fault reported for it. The pid
        # is part of an app-level Xid's identity (two processes' faults are two faults), None otherwise.
        self._faults: dict[tuple[int | str | None, int, int | None], _Fault] = {}
        self._marks: dict[tuple[int, int], _Mark] = {}
        self._counts: dict[tuple[int | None, int], _Count] = {}

    # -- sources ----------------------------------------------------------------------------

    def ingest_nvml(self, event: GpuEvent) -> list[Event]:
        """An NVML event-set event; ECC events are not Xids and yield nothing here."""
        if event.kind is not GpuEventKind.XID:
            return []
        identity = self._identities().get(event.gpu)
        sighting = _Sighting(
            source=SOURCE_NVML,
            xid=event.data,
            gpu=event.gpu,
            uuid=identity.uuid if identity is not None else None,
            pci_bus_id=identity.pci_bus_id if identity is not None else None,
            pid=None,
            process=None,
            text="",
            nvlink=None,
            recovery_action=None,
            kernel_timestamp_seconds=None,
        )
        return self._ingest(sighting)

    def ingest_kernel(self, record: KernelXid, source: str = SOURCE_KMSG) -> list[Event]:
        """A kernel-log Xid; ``source`` names the log it came from ("kmsg", "journal")."""
        gpu, identity = self._match_bus_id(record.pci_bus_id)
        sighting = _Sighting(
            source=source,
            xid=record.xid,
            gpu=gpu,
            uuid=identity.uuid if identity is not None else None,
            pci_bus_id=identity.pci_bus_id if identity is not None else record.pci_bus_id,
            pid=record.pid,
            process=record.process,
            text=record.text,
            nvlink=dataclasses.asdict(record.nvlink) if record.nvlink is not None else None,
            recovery_action=record.recovery_action,
            kernel_timestamp_seconds=record.timestamp_seconds,
            # Read now, off the lock: the process may be gone by the time a rule looks.
            process_service=self._process_owner(record.pid) if record.pid is not None else None,
        )
        return self._ingest(sighting)

    def _match_bus_id(self, pci_bus_id: str | None) -> tuple[int | None, GpuIdentity | None]:
        return match_bus_id(pci_bus_id, self._identities())

    # -- folding ----------------------------------------------------------------------------

    def _ingest(self, sighting: _Sighting) -> list[Event]:
        with self._lock:
            now = self._clock()
            tick = self._window_clock()
            self._forget_old_faults(tick)
            fault_key, fault = self._fault_of(sighting)
            reporter = _reporter(sighting.source)
            if fault is not None and fault.closed and reporter in fault.reporters:
                fault = None  # a reset dealt with that one: the same reporter again is a new fault
            events: list[Event] = []
            if fault is None:
                fault = self._new_fault(sighting, now, tick)
                self._faults[fault_key] = fault
                self._count(sighting, now, new_fault=True)
                if reporter == SOURCE_NVML and self._kernel_log_followed():
                    self._hold(fault)
                else:
                    events.append(fault.event)
            else:
                fault.reporters.add(reporter)
                self._count(sighting, now, new_fault=False)
                if fault.held and reporter == _KERNEL_LOG:
                    # The line NVML's sighting waited for: the fault is told once, with what the line says.
                    fault.held = False
                    fault.event = self._xid_event(sighting, fault.event.timestamp_seconds, fault.event.data["sources"])
                    events.append(fault.event)
                elif sighting.source not in fault.event.data["sources"]:
                    # A new list rather than an append: a reader iterating the old one is not disturbed.
                    fault.event.data["sources"] = [*fault.event.data["sources"], sighting.source]
            recovery = sighting.recovery_action
            if sighting.xid == RECOVERY_ACTION_XID and recovery is not None and recovery not in fault.recovery_actions:
                fault.recovery_actions.add(recovery)
                events.append(self._recovery_event(sighting, recovery, now))
            if not fault.closed:
                self._mark(sighting, tick)
            return events

    def _hold(self, fault: _Fault) -> None:
        """Wait for the kernel-log line of a fault NVML reported; told as NVML saw it if none comes."""
        fault.held = True
        timer = threading.Timer(self._kernel_line_wait_seconds, self._release_held, args=(fault,))
        timer.daemon = True
        timer.name = "xid-kernel-line-wait"
        timer.start()

    def _release_held(self, fault: _Fault) -> None:
        with self._lock:
            if not fault.held:
                return  # its line came in time: told then
            fault.held = False
            event = fault.event
        try:
            self._release([event])
        except Exception:  # a failing consumer must not lose the next fault's release
            log.exception("could not hand on an Xid event", key=event.key)

    def _fault_of(self, sighting: _Sighting) -> tuple[tuple[int | str | None, int, int | None], _Fault | None]:
        """The key this sighting's fault is kept under, and that fault if it is open. An app-level Xid is
        its process's: keyed by pid, where NVML's sighting (no pid) folds into whichever is open, and the
        kernel line naming the process of a fault NVML opened takes that fault over."""
        where = sighting.gpu if sighting.gpu is not None else sighting.pci_bus_id
        key: tuple[int | str | None, int, int | None]
        unnamed: tuple[int | str | None, int, int | None] = (where, sighting.xid, None)
        if not _app_level(sighting.xid):
            return unnamed, self._faults.get(unnamed)
        if sighting.pid is None:
            open_faults = [k for k in self._faults if k[:2] == unnamed[:2]]
            key = unnamed if unnamed in self._faults or not open_faults else open_faults[0]
            return key, self._faults.get(key)
        key = (where, sighting.xid, sighting.pid)
        if key not in self._faults and unnamed in self._faults:
            self._faults[key] = self._faults.pop(unnamed)
        return key, self._faults.get(key)

    def _forget_old_faults(self, tick: float) -> None:
        expired = [
            key
            for key, fault in self._faults.items()
            if not _within(tick - fault.first_seen_seconds, self._dedupe_window_seconds)
        ]
        for key in expired:
            del self._faults[key]

    def _new_fault(self, sighting: _Sighting, now: float, tick: float) -> _Fault:
        return _Fault(
            event=self._xid_event(sighting, now, []),
            first_seen_seconds=tick,
            recovery_actions=set(),
            reporters={_reporter(sighting.source)},
        )

    @staticmethod
    def _xid_event(sighting: _Sighting, now: float, sources: list[str]) -> Event:
        """The Xid's event from this sighting's details, seen at `now` by `sources` and this sighting's."""
        name, resolution, severity, action = _catalog_row(sighting.xid)
        verdict = "informational" if action is SuggestedAction.NONE else action.value
        return sighting.event(
            EventKind.XID,
            severity,
            f"Xid {sighting.xid} on {_where(sighting.gpu, sighting.pci_bus_id)}{_by(sighting)}: {name} — {verdict}",
            str(sighting.xid),
            now,
            {
                "xid": sighting.xid,
                "pci_bus_id": sighting.pci_bus_id,
                "pid": sighting.pid,
                "process": sighting.process,
                "process_service": sighting.process_service,
                "text": sighting.text,
                "sources": [*sources, sighting.source],
                "resolution": resolution,
                "name": name,
                "nvlink": sighting.nvlink,
                "recovery_action": sighting.recovery_action,
                "kernel_timestamp_seconds": sighting.kernel_timestamp_seconds,
            },
            action,
        )

    def _recovery_event(self, sighting: _Sighting, recovery: str, now: float) -> Event:
        action = recovery_suggested_action(recovery)
        return sighting.event(
            EventKind.RECOVERY_ACTION,
            _RECOVERY_SEVERITY.get(action, Severity.WARNING),
            f"{_where(sighting.gpu, sighting.pci_bus_id)}: driver recovery action is now {recovery}",
            recovery,
            now,
            {
                "xid": sighting.xid,
                "pci_bus_id": sighting.pci_bus_id,
                "recovery_action": recovery,
                "text": sighting.text,
                "sources": [sighting.source],
            },
            action,
        )

    def _count(self, sighting: _Sighting, now: float, new_fault: bool) -> None:
        key = (sighting.gpu, sighting.xid)
        counted = self._counts.get(key)
        if counted is None:
            counted = self._counts[key] = _Count(uuid="", count=0, last_seen_seconds=now)
        if sighting.uuid:
            counted.uuid = sighting.uuid
        counted.count += 1 if new_fault else 0
        counted.last_seen_seconds = now

    def _mark(self, sighting: _Sighting, tick: float) -> None:
        if sighting.gpu is None:
            return
        key = (sighting.gpu, sighting.xid)
        if sighting.xid == RECOVERY_ACTION_XID:
            if sighting.recovery_action is not None:
                action = recovery_suggested_action(sighting.recovery_action)
                self._marks[key] = _Mark(
                    sighting.xid, action, f"Xid 154: driver recovery action {sighting.recovery_action}", tick
                )
                return
            previous = self._marks.get(key)
            if previous is not None:
                # An NVML sighting of 154 carries no action: the one the kernel log named still stands.
                previous.seen_seconds = tick
                return
        name, _, _, action = _catalog_row(sighting.xid)
        self._marks[key] = _Mark(sighting.xid, action, f"Xid {sighting.xid}: {name}", tick)

    # -- readers ----------------------------------------------------------------------------

    def counts(self) -> list[XidCount]:
        """Faults per (GPU, Xid) since start, for ``gpu_agent_xid_errors_total``; folded sightings count once."""
        with self._lock:
            return [
                XidCount(gpu=gpu, uuid=c.uuid, xid=xid, count=c.count, last_seen_seconds=c.last_seen_seconds)
                for (gpu, xid), c in sorted(
                    self._counts.items(), key=lambda item: (item[0][0] is None, item[0][0] or 0, item[0][1])
                )
            ]

    def health(self, gpu: int) -> Health:
        """The worst Xid-derived health of a GPU over the health window."""
        with self._lock:
            tick = self._window_clock()
            worst: _Mark | None = None
            for (mark_gpu, _), mark in list(self._marks.items()):
                if not _within(tick - mark.seen_seconds, self._health_window_seconds):
                    del self._marks[(mark_gpu, mark.xid)]
                    continue
                if mark_gpu != gpu:
                    continue
                if worst is None or mark.action.rank > worst.action.rank:
                    worst = mark
            if worst is None or worst.action is SuggestedAction.NONE:
                return Health.healthy()
            return Health(_ACTION_HEALTH[worst.action], worst.reason, worst.action, (FaultCause.XID,))

    def open_marks(self) -> frozenset[tuple[int, int]]:
        """(GPU, Xid) of each Xid that holds its GPU's health now: within the health window, not fixed
        (`clear`, `restarted`), not acknowledged (`forget`), and not informational."""
        with self._lock:
            tick = self._window_clock()
            return frozenset(
                key
                for key, mark in self._marks.items()
                if mark.action is not SuggestedAction.NONE
                and _within(tick - mark.seen_seconds, self._health_window_seconds)
            )

    def marks(self) -> list[XidMark]:
        """The health window: what each (GPU, Xid) seen within it says, for the store."""
        with self._lock:
            return [
                XidMark(gpu, xid, mark.action.value, mark.reason, mark.seen_seconds)
                for (gpu, xid), mark in sorted(self._marks.items())
            ]

    def restore(self, counts: list[XidCount], marks: list[XidMark]) -> None:
        """Counters and the health window as an earlier run of the agent on this boot left them.

        Faults counted since this run started (the store opened late) add to the stored counts; a
        mark seen since is newer than the stored one. A mark whose action this agent no longer knows
        is dropped."""
        with self._lock:
            for count in counts:
                key = (count.gpu, count.xid)
                current = self._counts.get(key)
                if current is None:
                    self._counts[key] = _Count(count.uuid, count.count, count.last_seen_seconds)
                else:
                    current.count += count.count
                    current.uuid = current.uuid or count.uuid
                    current.last_seen_seconds = max(current.last_seen_seconds, count.last_seen_seconds)
            for stored in marks:
                try:
                    action = SuggestedAction(stored.action)
                except ValueError:
                    continue
                self._marks.setdefault(
                    (stored.gpu, stored.xid), _Mark(stored.xid, action, stored.reason, stored.seen_seconds)
                )

    def forget(self, marks: set[tuple[int, int]]) -> None:
        """Drop these (GPU, Xid) marks from the health window: an operator dealt with them
        (`gpu-agent ack`); the counters stay."""
        with self._lock:
            for key in marks:
                self._marks.pop(key, None)

    def restarted(self, gpus: frozenset[int] | None) -> None:
        """The services on these GPUs (None: on every GPU) were restarted and answer again: the
        app-level Xids (catalog action restart_service) they took were their processes' faults, dealt
        with by the restart, and leave the health window; their open faults close (a late report of
        one is that fault, a repeat is a new one). The counters stay."""
        with self._lock:
            for key in [key for key in self._marks if _app_level(key[1]) and (gpus is None or key[0] in gpus)]:
                del self._marks[key]
            for fault_key, fault in self._faults.items():
                where, xid, _ = fault_key
                if _app_level(xid) and isinstance(where, int) and (gpus is None or where in gpus):
                    fault.closed = True

    def clear(self, gpu: int) -> None:
        """Forget a GPU's Xid health and close its open faults (after a successful reset); counters stay.
        A closed fault still takes the sighting of the reporter that had not seen it yet (the reset may
        end before the second report of the fault it dealt with arrives); a repeat is a new fault."""
        with self._lock:
            for key in [key for key in self._marks if key[0] == gpu]:
                del self._marks[key]
            for fault_key, fault in self._faults.items():
                if fault_key[0] == gpu:
                    fault.closed = True
