"""The action worker: decided actions run off the loop (a GPU reset can take a minute; the loop
must not wait for it), journaled in the store from before they start, each on its lane
(agent.daemon.lanes): alerts, webhooks and reboot recommendations on the notify lane, which never
waits for a job on the node; an action that changes the node as soon as no job touching one of its
GPUs (agent.rules.actions.footprint) runs or waits before it.

Tasks (`submit_task`: a tune sweep, a recovery) are node jobs with their own footprint. A decided
action that changes the node and touches a running task's GPUs aborts the task (`Task.abort`), so a
repair never waits for an experiment for longer than the task takes to put its settings back; an
alert never ends a task (a sweep's own power cap raises latency alerts) and never waits for one.
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

import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from agent.config import AgentConfig
from agent.daemon.lanes import LaneJob, Lanes, overlaps
from agent.events import Event, EventKind, Severity
from agent.logger import get_logger
from agent.policy.holds import PolicyHolds
from agent.rules.actions.context import ActionContext
from agent.rules.actions.dispatch import execute
from agent.rules.actions.footprint import Footprint
from agent.rules.actions.steps import DRAINING, services_left_down, step
from agent.rules.model import ActionOutcome, Decision, Outcome
from agent.rules.params import ACTION_LANES, Lane
from agent.services.managers import ServiceError, ServiceManager
from agent.store.attempt_clock import AttemptClock, ClockReading, effective_wall_seconds
from agent.store.database import JournalEntry, Store, StoreError

log = get_logger()

#: How long `stop` waits for the running actions: well below systemd's stop timeout (TimeoutStopSec,
#: 90 s by default) so the journal notes are written before systemd would kill the agent.
STOP_TIMEOUT_SECONDS = 20.0


class Task(Protocol):
    """A job that is no rule's action (a tune sweep, a recovery): it journals itself, and gives up
    where it safely can, putting back what it changed, once `abort` is called. `gpus`: what it
    touches (None: the whole node)."""

    name: str
    gpus: frozenset[int] | None

    def run(self) -> None: ...
    def abort(self, reason: str) -> None: ...


def _whole_node(_decision: Decision) -> Footprint:
    return None


class ActionWorker:
    def __init__(
        self,
        context: Callable[[], ActionContext | None],
        store: Callable[[], Store | None],
        on_fixed: Callable[[Decision, Footprint], None],
        clock: Callable[[], float],
        attempt_clock: AttemptClock,
        managers: Callable[[], tuple[AgentConfig, Mapping[str, ServiceManager]]] | None = None,
        footprint: Callable[[Decision], Footprint] = _whole_node,
        holds: PolicyHolds | None = None,
    ) -> None:
        self.context = context  # None while the GPU backend is unavailable
        self.store = store
        # An action succeeded, with the GPUs it touched: what it fixed leaves the verdict (remediator.py).
        self.on_fixed = on_fixed
        self.clock = clock
        self.attempt_clock = attempt_clock
        self.managers = managers  # for recovery: the services and their managers, no GPU backend needed
        self.footprint = footprint  # the GPUs a decision on a gpus lane touches (default: all of them)
        self.holds = holds  # the ledger whose settings go back at stop, whatever still runs
        self.cancel = threading.Event()
        self.lanes = Lanes()
        self._rows: dict[LaneJob, int] = {}  # a remediation's journal row, while it runs

    def submit(self, decision: Decision, now: float) -> None:
        """Journal the action as started, then queue it on its lane. StoreError when it cannot be
        journaled: then it does not run, and its event stays unhandled for a later loop."""
        store = self.store()
        if store is None:
            raise StoreError("no event store: an action is never run unrecorded")
        row_id = store.begin_remediation(decision, self.attempt_clock.reading(now))
        lane = ACTION_LANES[decision.action.kind] if decision.action is not None else Lane.NOTIFY
        footprint = frozenset() if lane is Lane.NOTIFY else self.footprint(decision)
        job = LaneJob(f"remediation {decision.rule}", lane, footprint, lambda: None)
        job.work = lambda: self._run_job(job, decision, row_id)
        if lane is not Lane.NOTIFY:
            for running in self.lanes.running():
                if running.abort is not None and overlaps(running.footprint, footprint):
                    running.abort(f"remediation {decision.rule} needs the node")
        self.lanes.put(job)

    def submit_task(self, task: Task) -> None:
        """Queue a task behind whatever touches its GPUs."""
        self.lanes.put(LaneJob(task.name, Lane.NODE, task.gpus, lambda: self._run_task(task), task.abort))

    def busy(self) -> str | None:
        """What the worker is doing or has queued on the node, or None when the node is quiet."""
        running = self.lanes.running()
        if running:
            return f"{running[0].name} is running"
        waiting = self.lanes.waiting()
        return f"{len(waiting)} job(s) are queued" if waiting else None

    def history(self, store: Store, now: float) -> ClockHistory:
        return ClockHistory(store, self.attempt_clock.reading(now))

    def recover(self, store: Store) -> None:
        """Queue the roll-back of what an earlier run left running (before any other node job)."""
        entries = store.running_remediations()
        if entries:
            self.lanes.put(LaneJob("recovery of interrupted actions", Lane.NODE, None, lambda: self._recover(entries)))

    def start(self) -> None:
        self.lanes.start()

    def stop(self, timeout_seconds: float = STOP_TIMEOUT_SECONDS) -> None:
        """Ask the running jobs to give up where they safely can, wait `timeout_seconds` for them,
        journal where each action still running was (its row stays "running", so the next start
        rolls it back), then put back what a job still holds."""
        self.cancel.set()
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
            store = self.store()
            if store is not None:
                try:
                    store.journal_step(row_id, note)
                except StoreError as exc:
                    log.error("could not journal the interrupted action", error=str(exc))
        if self.holds is not None:
            self.holds.end_all("the agent is stopping")

    def _run_task(self, task: Task) -> None:
        if self.cancel.is_set():
            task.abort("the agent is stopping")
        task.run()

    def _run_job(self, job: LaneJob, decision: Decision, row_id: int) -> None:
        if self.cancel.is_set():
            self._close(row_id, "not started: the agent was stopping", started=False)
            return
        self._rows[job] = row_id
        try:
            self._execute(decision, row_id)
        finally:
            self._rows.pop(job, None)

    def _execute(self, decision: Decision, row_id: int) -> None:
        started = self.clock()
        context = self.context()
        if context is None:
            outcome = ActionOutcome(decision, Outcome.FAILED, "GPU backend unavailable", started, self.clock())
        else:
            context.journal = lambda step: self._journal(row_id, step)
            context.cancel = self.cancel
            outcome = execute(decision, context)
        if self.cancel.is_set() and outcome.outcome is not Outcome.SUCCESS:
            outcome = ActionOutcome(
                decision,
                Outcome.INTERRUPTED,
                f"agent stopping: {outcome.detail}",
                outcome.started_seconds,
                outcome.finished_seconds,
            )
        store = self.store()
        if store is not None:
            try:
                store.finish_remediation(row_id, outcome)
            except StoreError as exc:
                log.error("could not record a remediation", error=str(exc), rule=decision.rule)
        log.info(
            "action finished",
            rule=decision.rule,
            action=decision.action.kind.value if decision.action else None,
            outcome=outcome.outcome.value,
            detail=outcome.detail,
            seconds=round(outcome.finished_seconds - outcome.started_seconds, 3),
            **target_fields(decision),
        )
        if outcome.outcome is Outcome.SUCCESS:
            self.on_fixed(decision, self.footprint(decision))

    def _journal(self, row_id: int, step: str) -> None:
        store = self.store()
        if store is None:
            return
        try:
            store.journal_step(row_id, step)
        except StoreError as exc:  # the action goes on: stopping half-way would be worse than an unjournaled step
            log.error("could not journal an action step", error=str(exc), step=step)

    def _close(self, row_id: int, detail: str, started: bool = True) -> None:
        store = self.store()
        if store is None:
            return
        try:
            store.close_interrupted(row_id, detail, self.clock(), started)
        except StoreError as exc:
            log.error("could not close an interrupted action", error=str(exc))

    def _recover(self, entries: list[JournalEntry]) -> None:
        """Start again every service an interrupted action left down; close its row as interrupted."""
        config, managers = self.managers() if self.managers is not None else (None, {})
        services = {s.name: s for s in config.services} if config is not None else {}
        for entry in entries:
            if not entry.boot_id or entry.boot_id != self.attempt_clock.boot_id:
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
            log.warning(
                "interrupted action recovered",
                rule=entry.rule,
                action=entry.action,
                target=entry.target_key,
                detail=detail,
            )
            self._close(entry.row_id, detail)

    def _report_earlier_boot(self, entry: JournalEntry) -> None:
        """An action a reboot interrupted: reported, closed, nothing started."""
        stopped = services_left_down(entry.steps)
        where = entry.steps[-1] if entry.steps else "before its first step"
        left = f"; it had stopped {', '.join(stopped)}, left as this boot has it" if stopped else ""
        detail = f"interrupted on an earlier boot (last step: {where}); not rolled back{left}"
        log.warning(
            "action interrupted on an earlier boot",
            rule=entry.rule,
            action=entry.action,
            target=entry.target_key,
            boot_id=entry.boot_id,
            detail=detail,
        )
        event = Event(
            kind=EventKind.REMEDIATION_INTERRUPTED,
            severity=Severity.WARNING if stopped else Severity.INFO,
            gpu=entry.gpu,
            uuid=None,
            message=f"{entry.action} by rule {entry.rule} on {entry.target_key}: {detail}",
            timestamp_seconds=self.clock(),
            source="remediation",
            key=f"remediation_interrupted:{entry.row_id}",
            data={
                "rule": entry.rule,
                "action": entry.action,
                "target": entry.target_key,
                "boot_id": entry.boot_id or None,
                "last_step": entry.steps[-1] if entry.steps else None,
                "services_stopped": stopped,
            },
        )
        store = self.store()
        if store is not None:
            try:
                # A report: nothing for the rules to act on again.
                if store.record_event(event):
                    store.mark_handled(event.key)
            except StoreError as exc:
                log.error("could not record an interrupted action", error=str(exc))
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


def target_fields(decision: Decision) -> dict[str, Any]:
    fields: dict[str, Any] = {"gpu": decision.target.gpu, "gpu_uuid": decision.target.uuid}
    if decision.target.service:
        fields["service"] = decision.target.service
    if "xid" in decision.event.data:
        fields["xid"] = decision.event.data["xid"]
    return fields
