"""The action worker: decided actions run off the loop (a GPU reset can take a minute; the loop
must not wait for it), journaled in the store from before they start, each on its lane
(agent.daemon.lanes): alerts, webhooks and reboot recommendations on the notify lane, which never
waits for a job on the node; an action that changes the node as soon as no job touching one of its
GPUs (agent.rules.actions.footprint) runs or waits before it.

Tasks (the lanes' `submit_task`: a tune sweep, a recovery) are node jobs with their own footprint.
A decided action that changes the node and touches a running task's GPUs aborts the task
(`Task.abort`), so a repair never waits for an experiment for longer than the task takes to put its
settings back; an alert never ends a task (a sweep's own power cap raises latency alerts) and never
waits for one.
`submit` writes the journal row (outcome "running", counted as an attempt, its event handled) on
the caller's thread and only then queues the action: an action the agent never recorded never
runs, and one it recorded counts against the caps even if the agent dies a moment later. The
handler journals each step as it completes (ctx.journal). `stop` gives the running actions a
bounded time (below systemd's stop timeout), notes in the journal where each still running was,
then has the ledger put back every GPU setting a job still holds; `recover`, the first node job at
start, rolls back what an earlier run on this boot left half-done (a service a reset stopped, or a
restart cut short, is started again) and closes those rows as "interrupted". An entry of an
earlier boot (or of a boot that cannot be told) is not rolled back: the reboot ended that action,
and what runs now is this boot's. What it had stopped is reported as a `remediation_interrupted`
event and in the closed row, and nothing is started.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from agent.daemon.lanes import LaneJob, overlaps
from agent.events import Event, EventKind, Severity
from agent.logs import get_logger
from agent.rules.actions.dispatch import execute
from agent.rules.actions.footprint import footprint as decision_footprint
from agent.rules.actions.footprint import lane
from agent.rules.actions.kind import ClearsXids, Lane
from agent.rules.actions.registry import KINDS
from agent.rules.actions.steps import DRAINING, services_left_down, step
from agent.rules.model import ActionOutcome, Decision, Outcome
from agent.services.managers import ServiceError
from agent.store.attempt_clock import ClockReading, effective_wall_seconds
from agent.store.database import JournalEntry, Store, StoreError

if TYPE_CHECKING:
    from agent.daemon.live import Live

log = get_logger()

#: How long `stop` waits for the running actions: well below systemd's stop timeout (TimeoutStopSec,
#: 90 s by default) so the journal notes are written before systemd would kill the agent.
STOP_TIMEOUT_SECONDS = 20.0


class ActionWorker:
    """Reads of the daemon's live parts (agent/daemon/live.py): the store and the config of the
    moment, its lanes, the ledger of held settings (put back at stop, whatever still runs), the
    action context (None while the GPU backend is unavailable), the Xid watcher (what a successful
    action fixed leaves the verdict: `_clear_xids`) and the services' managers (recovery needs no
    GPU backend)."""

    def __init__(self, *, live: Live) -> None:
        self.live = live
        self.lanes = live.lanes
        self._rows: dict[LaneJob, int] = {}  # a remediation's journal row, while it runs

    def submit(self, decision: Decision, now: float) -> None:
        """Journal the action as started, then queue it on its lane. StoreError when it cannot be
        journaled: then it does not run, and its event stays unhandled for a later loop."""
        store = self.live.store
        if store is None:
            raise StoreError("no event store: an action is never run unrecorded")
        row_id = store.begin_remediation(decision, self.live.attempt_clock.reading(now))
        its_lane = lane(decision)
        footprint = frozenset() if its_lane is Lane.NOTIFY else decision_footprint(decision, self.live.config)
        job = LaneJob(f"remediation {decision.rule}", its_lane, footprint, lambda: None)
        job.work = partial(self._run_job, job, decision, row_id)
        if its_lane is not Lane.NOTIFY:
            for running in self.lanes.running():
                if running.abort is not None and overlaps(running.footprint, footprint):
                    running.abort(f"remediation {decision.rule} needs the node")
        self.lanes.put(job)

    def history(self, store: Store, now: float) -> ClockHistory:
        return ClockHistory(store, self.live.attempt_clock.reading(now))

    def recover(self, store: Store) -> None:
        """Queue the roll-back of what an earlier run left running (before any other node job)."""
        entries = store.running_remediations()
        if entries:
            self.lanes.put(LaneJob("recovery of interrupted actions", Lane.NODE, None, partial(self._recover, entries)))

    def start(self) -> None:
        self.lanes.start()

    def stop(self, timeout_seconds: float = STOP_TIMEOUT_SECONDS) -> None:
        """Ask the running jobs to give up where they safely can, wait `timeout_seconds` for them,
        journal where each action still running was (its row stays "running", so the next start
        rolls it back), then put back what a job still holds."""
        self.lanes.stopping.set()
        for job in (*self.lanes.running(), *self.lanes.waiting()):
            if job.abort is not None:
                job.abort("the agent is stopping")
        still = self.lanes.stop(timeout_seconds)
        note = f"agent stopped after waiting {timeout_seconds:g} s for the action; the next start rolls it back"
        for job in still:
            row_id = self._rows.get(job)
            if row_id is None:
                continue
            log.error("action still running at stop", job=job.name)
            self.live.write_store(
                "could not journal the interrupted action", partial(Store.journal_step, row_id=row_id, step=note)
            )
        self.live.holds.end_all("the agent is stopping")

    def _run_job(self, job: LaneJob, decision: Decision, row_id: int) -> None:
        if self.lanes.stopping.is_set():
            self._close(row_id, "not started: the agent was stopping", started=False)
            return
        self._rows[job] = row_id
        try:
            self._execute(decision, row_id)
        finally:
            self._rows.pop(job, None)

    def _execute(self, decision: Decision, row_id: int) -> None:
        clock = self.live.clock
        started = clock()
        context = self.live.action_context()
        if context is None:
            outcome = ActionOutcome(decision, Outcome.FAILED, "GPU backend unavailable", started, clock())
        else:
            context.journal = partial(self._journal, row_id)
            context.cancel = self.lanes.stopping
            outcome = execute(decision, context)
        if self.lanes.stopping.is_set() and outcome.outcome is not Outcome.SUCCESS:
            outcome = ActionOutcome(
                decision,
                Outcome.INTERRUPTED,
                f"agent stopping: {outcome.detail}",
                outcome.started_seconds,
                outcome.finished_seconds,
            )
        self.live.write_store(
            "could not record a remediation",
            lambda store: store.finish_remediation(row_id, outcome),
            rule=decision.rule,
        )
        log.info(
            "action finished",
            rule=decision.rule,
            action=decision.action.kind if decision.action else None,
            outcome=outcome.outcome.value,
            detail=outcome.detail,
            seconds=round(outcome.finished_seconds - outcome.started_seconds, 3),
            **target_fields(decision),
        )
        if decision.action is not None and outcome.outcome is Outcome.SUCCESS:
            self._clear_xids(decision, KINDS[decision.action.kind].clears_xids)

    def _clear_xids(self, decision: Decision, clears: ClearsXids) -> None:
        """What a successful action fixed leaves the Xid health window (and so the verdict and the Xid
        alerts); the counters stay. A GPU reset: every Xid of its GPU. A service restart: the app-level
        Xids of the GPUs it touched (its processes' own faults)."""
        xid = self.live.watchers.xid
        if clears is ClearsXids.GPU and decision.target.gpu is not None:
            xid.clear(decision.target.gpu)
        elif clears is ClearsXids.APP_LEVEL:
            xid.restarted(decision_footprint(decision, self.live.config))

    def _journal(self, row_id: int, step: str) -> None:
        self.live.write_store(
            "could not journal an action step", lambda store: store.journal_step(row_id, step), step=step
        )

    def _close(self, row_id: int, detail: str, started: bool = True) -> None:
        self.live.write_store(
            "could not close an interrupted action",
            lambda store: store.close_interrupted(row_id, detail, self.live.clock(), started),
        )

    def _recover(self, entries: list[JournalEntry]) -> None:
        """Start again every service an interrupted action left down; close its row as interrupted."""
        services = {s.name: s for s in self.live.config.services}
        managers = self.live.managers()
        for entry in entries:
            if not entry.boot_id or entry.boot_id != self.live.attempt_clock.boot_id:
                self._report_earlier_boot(entry)
                continue
            rolled_back: list[str] = []
            for name in services_left_down(entry.steps):
                service, manager = services.get(name), managers.get(name)
                if service is None or manager is None:
                    rolled_back.append(f"{name} left as it is (no longer configured or no manager)")
                    continue
                try:
                    if manager.is_active(service) is True:
                        # Drained and never stopped: running, but whatever its drain hook did (out of
                        # the load balancer) stays done until it restarts or someone undoes it.
                        drained = step(DRAINING, name) in entry.steps
                        rolled_back.append(f"{name} already running{' (drained, not restarted)' if drained else ''}")
                        continue
                    manager.start(service)
                except ServiceError as exc:
                    rolled_back.append(f"start {name} failed: {exc}")
                    continue
                rolled_back.append(f"started {name} again")
            where = entry.steps[-1] if entry.steps else "before its first step"
            detail = f"interrupted (last step: {where}); rolled back: {', '.join(rolled_back) or 'nothing to undo'}"
            log.warning("interrupted action recovered", **entry_fields(entry), detail=detail)
            self._close(entry.row_id, detail)

    def _report_earlier_boot(self, entry: JournalEntry) -> None:
        """An action a reboot interrupted: reported, closed, nothing started."""
        stopped = services_left_down(entry.steps)
        where = entry.steps[-1] if entry.steps else "before its first step"
        left = f"; it had stopped {', '.join(stopped)}, left as this boot has it" if stopped else ""
        detail = f"interrupted on an earlier boot (last step: {where}); not rolled back{left}"
        log.warning(
            "action interrupted on an earlier boot", **entry_fields(entry), boot_id=entry.boot_id, detail=detail
        )
        event = Event(
            kind=EventKind.REMEDIATION_INTERRUPTED,
            severity=Severity.WARNING if stopped else Severity.INFO,
            gpu=entry.gpu,
            uuid=None,
            message=f"{entry.action} by rule {entry.rule} on {entry.target_key}: {detail}",
            timestamp_seconds=self.live.clock(),
            source="remediation",
            key=f"remediation_interrupted:{entry.row_id}",
            data={
                **entry_fields(entry),
                "boot_id": entry.boot_id or None,
                "last_step": entry.steps[-1] if entry.steps else None,
                "services_stopped": stopped,
            },
        )

        def record_handled(store: Store) -> None:
            # A report: nothing for the rules to act on again.
            if store.record_event(event):
                store.mark_handled(event.key)

        self.live.write_store("could not record an interrupted action", record_handled)
        self._close(entry.row_id, detail)


class ClockHistory:
    """The store's attempt history measured with agent.store.attempt_clock: each attempt's time is placed on
    the current wall clock by the time really elapsed since it (boottime within a boot; a wall clock
    stepped back counts as nothing elapsed), so the engine's `now - last` is right across restarts
    and clock steps. Actions journaled as running are in the store already: they count at once."""

    def __init__(self, store: Store, now: ClockReading) -> None:
        self._store = store
        self._now = now

    def _times(self, rule: str, target_key: str) -> list[float]:
        return sorted(effective_wall_seconds(r, self._now) for r in self._store.attempt_readings(rule, target_key))

    def attempts(self, rule: str, target_key: str, since_seconds: float) -> list[float]:
        return [t for t in self._times(rule, target_key) if t >= since_seconds]

    def last_attempt(self, rule: str, target_key: str) -> float | None:
        times = self._times(rule, target_key)
        return times[-1] if times else None

    def circuit_open(self, rule: str, target_key: str) -> bool:
        return self._store.circuit_open(rule, target_key)

    def handled(self, event_key: str) -> bool:
        return self._store.handled(event_key)


def entry_fields(entry: JournalEntry) -> dict[str, Any]:
    """What names an interrupted action in its log lines and its event: its rule, kind and target."""
    return {"rule": entry.rule, "action": entry.action, "target": entry.target_key}


def target_fields(decision: Decision) -> dict[str, Any]:
    fields: dict[str, Any] = {"gpu": decision.target.gpu, "gpu_uuid": decision.target.uuid}
    if decision.target.service:
        fields["service"] = decision.target.service
    if "xid" in decision.event.data:
        fields["xid"] = decision.event.data["xid"]
    return fields
