"""The agent's memory across restarts: events, remediations, attempt counters and open circuits in
SQLite (`<state_dir>/gpu-agent.db`, WAL mode).

It is what makes storm protection survive a restart: `Store` implements the engine's
`AttemptHistory`, so a fault that repeats across agent restarts is counted against the same
`max_attempts`, and an event already handled is never handled again (`record_event` says no).

What counts as an attempt (`attempts`, `last_attempt`): a recorded ladder decision (step >= 0)
whose outcome is SUCCESS, FAILED, REFUSED, DRY_RUN, RUNNING or INTERRUPTED (an action counts from
the moment it started). REFUSED counts because the agent did try (a process holding the GPU, Xid
79): the ladder must still move on to its alerting steps,
and a refusal repeated on every fault is itself a storm. DRY_RUN (a dry-run rule, or observe mode's
record of what would change the node) counts so a dry run shows what escalation and circuits would
do, and observe mode still reaches a ladder's alerts. SUPPRESSED never counts.

The remediation journal: an action that runs is written down before it starts
(`begin_remediation`: outcome RUNNING, counted, its event marked handled, in one transaction), each of
its steps as it completes (`journal_step`), and its end (`finish_remediation`); a row still RUNNING at
start is what an earlier run left half-done (`running_remediations`, closed by `close_interrupted`).
Each attempt keeps the boot id and CLOCK_BOOTTIME beside the wall time (agent.store.attempt_clock).

`record_outcome` (decisions that run nothing: suppressed, dry runs) also stores the decision's event
and marks it handled (so a fault the engine synthesized from the snapshot is one fault), and opens
the rule's circuit for the target when the decision has step -1 (the engine's "attempts exhausted"
decision). `ack` closes circuits and
retires attempts from the counters; their rows stay in the history.

One connection, shared by the threads of the process behind a lock; other processes (the CLI's
`gpu-agent ack` while the daemon runs) get their own and wait up to `schema.BUSY_TIMEOUT_SECONDS` for a
writer. A database that is not a database, fails its integrity check or was written by a newer
schema is kept aside as `gpu-agent.db.corrupt-<unix time>` (or `.newer-<unix time>`) and a new
one is created: losing history is better than not starting. Rows older than `RETENTION_SECONDS`
are pruned on open and by `prune` while the daemon runs (agent/daemon/node_memory.py calls it hourly); lifetime
totals per (rule, action, outcome) are kept apart and never pruned, because they feed a Prometheus
counter that must not go down.

Node memory (schema 2), all of it per boot (`/proc/sys/kernel/random/boot_id`): a restart of the
agent is not a reboot and must not forget, a reboot starts afresh (`start_boot` drops the rows of
every other boot). The GPU inventory (`InventoryGpu`: every GPU seen on this boot, until
acknowledged with `gpu-agent ack gpu:UUID`), the Xid counters and last-seen times (`XidCount`),
the Xid health window (`XidMark`) and (schema 4) the throttle watcher's time per clock-event reason
with the start of each slowdown active now (`ClockEventTotal`; schema 5 adds that start on
CLOCK_BOOTTIME) and the service prober's failure streaks (`ProbeStreak`). agent/daemon/node_memory.py
reads and writes them for the daemon.

The advisor's journal (schema 6, agent/store/tunes.py) and the journal of GPU settings a job holds,
with the originals to put back (schema 7, agent/store/holds.py).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sqlite3
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import trust
from agent.defaults import REBOOT_FLAG_NAME
from agent.events import Event, event_from_json, event_json
from agent.host import safe_json
from agent.logs import get_logger
from agent.rules.model import ActionOutcome, Decision, Outcome
from agent.state import RemediationCount, RemediationFailing
from agent.store.acks import Acknowledgements, Circuit
from agent.store.alerts import AlertTables
from agent.store.attempt_clock import ClockReading
from agent.store.boot_tables import BootTables, InventoryGpu
from agent.store.db import StoreError
from agent.store.holds import HoldTables
from agent.store.schema import Unusable, connect_or_replace
from agent.store.selector import ALL, AckResult, AckSelector
from agent.store.tunes import TuneHistoryTables, TuneTables

log = get_logger()

__all__ = [
    "ALL",
    "COUNTED_OUTCOMES",
    "DB_NAME",
    "EXHAUSTED_STEP",
    "RETENTION_SECONDS",
    "AckResult",
    "Circuit",
    "InventoryGpu",
    "JournalEntry",
    "Store",
    "StoreError",
    "StoredEvent",
    "StoredRemediation",
]

DB_NAME = "gpu-agent.db"
RETENTION_SECONDS = 30 * 24 * 3600.0
EXHAUSTED_STEP = -1  # agent.rules.engine.EXHAUSTED_STEP (not imported: the store must not need the rules)
#: The cause of a failing rule whose attempts ran out (its circuit is open).
EXHAUSTED = "exhausted"
COUNTED_OUTCOMES = frozenset(
    {Outcome.SUCCESS, Outcome.FAILED, Outcome.REFUSED, Outcome.DRY_RUN, Outcome.RUNNING, Outcome.INTERRUPTED}
)


@dataclass(frozen=True)
class StoredEvent:
    event: Event
    handled: bool


@dataclass(frozen=True)
class StoredRemediation:
    started_seconds: float
    finished_seconds: float
    rule: str
    action: str  # the action kind's name, or "none" for a decision without an action
    params: dict[str, Any]
    target_key: str
    gpu: int | None
    uuid: str | None
    service: str | None
    event_key: str
    attempt: int
    step: int
    outcome: Outcome
    reason: str
    detail: str
    dry_run: bool
    counted: bool  # an attempt for storm protection
    acked: bool  # retired from the counters by `gpu-agent ack`
    steps: tuple[str, ...] = ()  # the journal: the steps of the action as they completed


@dataclass(frozen=True)
class JournalEntry:
    """A journaled action that has not finished (outcome "running"): what recovery needs."""

    row_id: int
    started_seconds: float
    rule: str
    action: str
    target_key: str
    gpu: int | None
    service: str | None
    steps: tuple[str, ...]
    boot_id: str  # the boot it ran on; "" when unknown


#: The events table's columns after `key`, in INSERT and SELECT order, as `event_json` names them
#: (the table calls `timestamp_seconds` "ts").
_EVENT_FIELDS = (
    "kind",
    "severity",
    "gpu",
    "uuid",
    "message",
    "source",
    "suggested_action",
    "data",
    "timestamp_seconds",
)


def _event_row(event: Event) -> tuple[Any, ...]:
    """The events table's columns key .. ts, in INSERT order."""
    document = event_json(event)
    document["data"] = _dumps(event.data)
    return (event.key, *(document[name] for name in _EVENT_FIELDS))


def _stored_event(row: tuple[Any, ...]) -> StoredEvent:
    """A row of `SELECT key, <_EVENT_FIELDS>, handled FROM events`."""
    key, *values, handled = row
    document = dict(zip(_EVENT_FIELDS, values, strict=True))
    document["data"] = safe_json.loads(document["data"])
    return StoredEvent(event_from_json(document, key), bool(handled))


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def _without_secrets(params: dict[str, Any]) -> dict[str, Any]:
    """Action params as stored: header values (tokens) and a URL's credentials, path and query (tokens
    live there too) stay out of the database and so out of `gpu-agent events`."""
    kept = dict(params)
    if isinstance(kept.get("headers"), dict):
        kept["headers"] = dict.fromkeys(kept["headers"], "<redacted>")
    if isinstance(kept.get("url"), str):
        parts = urllib.parse.urlsplit(kept["url"])
        kept["url"] = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}" + ("/…" if parts.path.strip("/") else "")
    return kept


@dataclass(frozen=True)
class _RemediationRow:
    """What a remediations row records beyond its decision."""

    started_seconds: float
    finished_seconds: float
    outcome: str
    counted: bool
    reading: ClockReading | None  # the clock when it was decided
    detail: str = ""
    dry_run: bool = False


def _action_name(decision: Decision) -> str:
    return decision.action.kind if decision.action is not None else "none"


def _insert_remediation(db: sqlite3.Connection, decision: Decision, row: _RemediationRow) -> int | None:
    """Insert `decision` as a remediations row; the new row's id."""
    params = _without_secrets(decision.action.params) if decision.action is not None else {}
    target = decision.target
    cursor = db.execute(
        "INSERT INTO remediations (ts, finished, rule, action, params, target_key, gpu, uuid, service,"
        " event_key, attempt, step, outcome, reason, detail, dry_run, counted, boot_id, boottime)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            row.started_seconds,
            row.finished_seconds,
            decision.rule,
            _action_name(decision),
            _dumps(params),
            target.key,
            target.gpu,
            target.uuid,
            target.service,
            decision.event.key,
            decision.attempt,
            decision.step,
            row.outcome,
            decision.reason,
            row.detail,
            int(row.dry_run),
            int(row.counted),
            row.reading.boot_id if row.reading is not None else "",
            row.reading.boottime_seconds if row.reading is not None else None,
        ),
    )
    return cursor.lastrowid


def _mark_handled(db: sqlite3.Connection, event: Event) -> None:
    """Store `event` as handled (its action is on record), inserting it when it is not stored yet."""
    db.execute(
        "INSERT INTO events (key, kind, severity, gpu, uuid, message, source, suggested_action, data, ts,"
        " handled) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)"
        " ON CONFLICT (key) DO UPDATE SET handled = 1",
        _event_row(event),
    )


def _dumps(value: Any) -> str:
    return json.dumps(value, default=_json_default, sort_keys=True)


class Store(BootTables, Acknowledgements, TuneTables, TuneHistoryTables, HoldTables, AlertTables):
    """See the module docstring. Build it with `Store.open(state_dir)`. Node memory is
    `agent.store.boot_tables`, circuits and acknowledgements `agent.store.acks`, the shared connection
    `agent.store.db`."""

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        state_dir: str | Path,
        now_seconds: float | None = None,
        retention_seconds: float = RETENTION_SECONDS,
        reuse_newer: bool = True,
    ) -> Store:
        """Open (or create) the database; set aside an unusable one; prune old rows. reuse_newer:
        put back the database an older agent set aside as too new for it (`schema.connect_or_replace`)."""
        now = time.time() if now_seconds is None else now_seconds
        directory = Path(state_dir)
        # What the agent reads back from here decides what it does: only where nobody else can write.
        problem = trust.state_directory_problem(directory, "state_dir")
        if problem is not None:
            raise StoreError(problem)
        try:
            # 0700: events carry process names and command lines; the directory keeps the WAL files private too.
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create {directory}: {exc.strerror or exc}") from exc
        path = directory / DB_NAME
        for part in (path, path.with_name(f"{DB_NAME}-wal"), path.with_name(f"{DB_NAME}-shm")):
            # Before SQLite opens it: a FIFO there would hang the open (and SIGTERM with it).
            problem = trust.state_file_problem(part)
            if problem is not None:
                raise StoreError(f"cannot open {path}: {problem}")
        try:
            connection = connect_or_replace(path, now, reuse_newer)
        except (Unusable, sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open {path}: {exc}") from exc
        store = cls(path, connection)
        try:
            store._prune(now - retention_seconds)
        except StoreError:
            store.close()
            raise
        return store

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _prune(self, before_seconds: float) -> None:
        self.prune(before_seconds)

    def prune(self, before_seconds: float) -> int:
        """Delete events and remediations older than `before_seconds` (the history a long-running
        daemon would otherwise grow without end); how many rows went. Node memory is per boot and
        bounded by the GPUs and Xid codes: `start_boot` retires it."""
        with self._transaction(("events", "remediations", "gpu_holds")) as db:
            events = db.execute("DELETE FROM events WHERE ts < ?", (before_seconds,)).rowcount
            remediations = db.execute("DELETE FROM remediations WHERE ts < ?", (before_seconds,)).rowcount
            # An ended hold is history; an open one is what the next start must put back.
            db.execute("DELETE FROM gpu_holds WHERE finished IS NOT NULL AND finished < ?", (before_seconds,))
        if events or remediations:
            log.info("pruned rows older than the retention", events=events, remediations=remediations)
        return int(events + remediations)

    # -- events -------------------------------------------------------------------------------

    def record_event(self, event: Event) -> bool:
        """Store a new event. False when its key is already stored and handled: the fault was dealt
        with (before a restart, maybe) and must not be handled again. A stored but unhandled event
        (the agent stopped between seeing and handling it) is offered again."""
        with self._transaction(("events",)) as db:
            row = db.execute("SELECT handled FROM events WHERE key = ?", (event.key,)).fetchone()
            if row is not None:
                return not row[0]
            db.execute(
                "INSERT INTO events (key, kind, severity, gpu, uuid, message, source, suggested_action, data, ts)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                _event_row(event),
            )
            return True

    def mark_handled(self, event_key: str) -> None:
        with self._transaction(("events",)) as db:
            db.execute("UPDATE events SET handled = 1 WHERE key = ?", (event_key,))

    def handled(self, event_key: str) -> bool:
        rows = self._query("SELECT handled FROM events WHERE key = ?", (event_key,))
        return bool(rows and rows[0][0])

    def events(self, since_seconds: float = 0.0, limit: int = 1000) -> list[StoredEvent]:
        """The newest `limit` events at or after `since_seconds`, oldest first."""
        rows = self._query(
            "SELECT key, kind, severity, gpu, uuid, message, source, suggested_action, data, ts, handled"
            " FROM events WHERE ts >= ? ORDER BY ts DESC, id DESC LIMIT ?",
            (since_seconds, limit),
        )
        return [_stored_event(row) for row in reversed(rows)]

    # -- acknowledgements ----------------------------------------------------------------------

    def acknowledge(self, selector: AckSelector, boot_id: str) -> AckResult:
        """`gpu-agent ack` on this store (the daemon's own, or the file when no daemon answers): the
        selected Xids marked dealt with on this boot, rules re-armed, missing GPUs acknowledged gone, the
        reboot recommendation withdrawn (its flag beside the store removed)."""
        marks = selector.xid_marks()
        cleared = self.clear_xid_marks(boot_id, *marks) if marks is not None else []
        return AckResult(
            rearmed=self.ack(selector.text),
            gone=tuple(self.acknowledge_gone(selector.text)),
            cleared=tuple((mark.gpu, mark.xid) for mark in cleared),
            reboot=selector.reboot and self._withdraw_reboot_recommendation(),
        )

    def _withdraw_reboot_recommendation(self) -> bool:
        """Remove `state_dir/reboot-recommended`; whether there was one."""
        try:
            (self.path.parent / REBOOT_FLAG_NAME).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot remove {self.path.parent / REBOOT_FLAG_NAME}: {exc.strerror or exc}") from exc
        log.info("reboot recommendation acknowledged")
        return True

    # -- remediations -------------------------------------------------------------------------

    def record_outcome(self, outcome: ActionOutcome, reading: ClockReading | None = None) -> None:
        """Record what came of a decision (see the module docstring for what it counts and opens).
        `reading`: the clock when it was decided (without one, only the wall time relates it to later)."""
        decision = outcome.decision
        counted = outcome.outcome in COUNTED_OUTCOMES and decision.action is not None and decision.step >= 0
        with self._transaction() as db:
            _insert_remediation(
                db,
                decision,
                _RemediationRow(
                    outcome.started_seconds,
                    outcome.finished_seconds,
                    outcome.outcome.value,
                    counted,
                    reading,
                    detail=outcome.detail,
                    dry_run=decision.dry_run,
                ),
            )
            db.execute(
                "INSERT INTO remediation_totals (rule, action, outcome, count) VALUES (?, ?, ?, 1)"
                " ON CONFLICT (rule, action, outcome) DO UPDATE SET count = count + 1",
                (decision.rule, _action_name(decision), outcome.outcome.value),
            )
            _mark_handled(db, decision.event)
            if decision.step == EXHAUSTED_STEP:
                self._open_circuit(db, decision.rule, decision.target, decision.reason, outcome.started_seconds)

    def remediations(self, since_seconds: float = 0.0, limit: int = 1000) -> list[StoredRemediation]:
        """The newest `limit` remediations started at or after `since_seconds`, oldest first."""
        rows = self._query(
            "SELECT ts, finished, rule, action, params, target_key, gpu, uuid, service, event_key, attempt, step,"
            " outcome, reason, detail, dry_run, counted, acked, steps"
            " FROM remediations WHERE ts >= ? ORDER BY ts DESC, id DESC LIMIT ?",
            (since_seconds, limit),
        )
        stored = [
            StoredRemediation(
                started_seconds=row[0],
                finished_seconds=row[1],
                rule=row[2],
                action=row[3],
                params=safe_json.loads(row[4]),
                target_key=row[5],
                gpu=row[6],
                uuid=row[7],
                service=row[8],
                event_key=row[9],
                attempt=row[10],
                step=row[11],
                outcome=Outcome(row[12]),
                reason=row[13],
                detail=row[14],
                dry_run=bool(row[15]),
                counted=bool(row[16]),
                acked=bool(row[17]),
                steps=tuple(safe_json.loads(row[18])),
            )
            for row in rows
        ]
        return stored[::-1]

    def failing_rules(self) -> list[RemediationFailing]:
        """Each rule that cannot fix its fault now, and why: the last finished attempt of the rule on
        some target failed or was refused (a later success on that target clears it), or the rule's
        attempts ran out there (its circuit is open). `gpu-agent ack` clears both."""
        rows = self._query(
            "SELECT DISTINCT r.rule, r.outcome FROM remediations AS r JOIN ("
            " SELECT MAX(id) AS id FROM remediations WHERE counted = 1 AND acked = 0 AND outcome IN (?, ?, ?)"
            " GROUP BY rule, target_key) AS last ON r.id = last.id WHERE r.outcome IN (?, ?)"
            " UNION SELECT DISTINCT rule, ? FROM circuits ORDER BY 1, 2",
            (
                Outcome.SUCCESS.value,
                Outcome.FAILED.value,
                Outcome.REFUSED.value,
                Outcome.FAILED.value,
                Outcome.REFUSED.value,
                EXHAUSTED,
            ),
        )
        return [RemediationFailing(rule, cause) for rule, cause in rows]

    def remediation_counts(self) -> list[RemediationCount]:
        """Lifetime totals per (rule, action, outcome), for gpu_agent_remediations_total."""
        rows = self._query("SELECT rule, action, outcome, count FROM remediation_totals ORDER BY rule, action, outcome")
        return [RemediationCount(rule, action, outcome, count) for rule, action, outcome, count in rows]

    # -- the remediation journal ----------------------------------------------------------------
    # An action is written down before it starts and each of its steps as it completes, so an agent
    # killed mid-action leaves a "running" row that counts as an attempt and says what to roll back.

    def begin_remediation(self, decision: Decision, reading: ClockReading) -> int:
        """Journal `decision`'s action as started (outcome running; counted when a ladder step) and mark its
        event handled, in one transaction: an event is handled exactly when its action is on record. The row id."""
        counted = decision.step >= 0  # a ladder step: an attempt; the on_exhausted step (-1) is not
        row = _RemediationRow(reading.wall_seconds, reading.wall_seconds, Outcome.RUNNING.value, counted, reading)
        with self._transaction() as db:
            row_id = _insert_remediation(db, decision, row)
            _mark_handled(db, decision.event)
        if row_id is None:  # pragma: no cover - sqlite always sets it after an INSERT
            raise StoreError(f"{self.path}: no row id for the journaled action")
        return row_id

    def journal_step(self, row_id: int, step: str) -> None:
        """Append a completed step to a journaled action (its detail shows the steps so far)."""
        with self._transaction() as db:
            row = db.execute("SELECT steps FROM remediations WHERE id = ?", (row_id,)).fetchone()
            if row is None:
                return
            steps = [*safe_json.loads(row[0]), step]
            db.execute(
                "UPDATE remediations SET steps = ?, detail = ? WHERE id = ?", (_dumps(steps), "; ".join(steps), row_id)
            )

    def finish_remediation(self, row_id: int, outcome: ActionOutcome) -> None:
        """A journaled action ended: its outcome, detail and end time replace "running". One that had
        nowhere to go (not configured) tried nothing: no attempt of its rule."""
        self._close_journal_entry(
            row_id,
            outcome.outcome,
            outcome.detail,
            outcome.finished_seconds,
            counted=outcome.outcome in COUNTED_OUTCOMES,
        )

    def close_interrupted(self, row_id: int, detail: str, finished_seconds: float, started: bool = True) -> None:
        """A journaled action an earlier run left unfinished, rolled back or finished by recovery; or one
        still queued when the agent stopped (`started` False: it never ran, so it is no attempt)."""
        self._close_journal_entry(row_id, Outcome.INTERRUPTED, detail, finished_seconds, counted=started)

    def _close_journal_entry(
        self, row_id: int, outcome: Outcome, detail: str, finished_seconds: float, counted: bool = True
    ) -> None:
        with self._transaction() as db:
            row = db.execute(
                "SELECT rule, action FROM remediations WHERE id = ? AND outcome = ?", (row_id, Outcome.RUNNING.value)
            ).fetchone()
            if row is None:
                return  # closed already (recovery and a late worker must not both count it)
            db.execute(
                "UPDATE remediations SET outcome = ?, detail = ?, finished = ?, counted = counted AND ? WHERE id = ?",
                (outcome.value, detail, finished_seconds, int(counted), row_id),
            )
            db.execute(
                "INSERT INTO remediation_totals (rule, action, outcome, count) VALUES (?, ?, ?, 1)"
                " ON CONFLICT (rule, action, outcome) DO UPDATE SET count = count + 1",
                (row[0], row[1], outcome.value),
            )

    def running_remediations(self) -> list[JournalEntry]:
        """Journaled actions not finished: at start, what an earlier run left half-done."""
        rows = self._query(
            "SELECT id, ts, rule, action, target_key, gpu, service, steps, boot_id FROM remediations"
            " WHERE outcome = ? ORDER BY id",
            (Outcome.RUNNING.value,),
        )
        return [
            JournalEntry(
                row_id, started, rule, action, target_key, gpu, service, tuple(safe_json.loads(steps)), boot_id
            )
            for row_id, started, rule, action, target_key, gpu, service, steps, boot_id in rows
        ]

    def attempt_readings(self, rule: str, target_key: str) -> list[ClockReading]:
        """The clock readings of `rule`'s counted, unacknowledged attempts on the target (started ones
        included), for agent.store.attempt_clock to measure cooldowns and windows with."""
        rows = self._query(
            "SELECT ts, boot_id, boottime FROM remediations WHERE rule = ? AND target_key = ? AND counted = 1"
            " AND acked = 0 ORDER BY ts",
            (rule, target_key),
        )
        return [ClockReading(wall, boot_id, boottime) for wall, boot_id, boottime in rows]

    # -- AttemptHistory -----------------------------------------------------------------------

    def attempts(self, rule: str, target_key: str, since_seconds: float) -> list[float]:
        rows = self._query(
            "SELECT ts FROM remediations WHERE rule = ? AND target_key = ? AND counted = 1 AND acked = 0"
            " AND ts >= ? ORDER BY ts",
            (rule, target_key, since_seconds),
        )
        return [row[0] for row in rows]

    def last_attempt(self, rule: str, target_key: str) -> float | None:
        rows = self._query(
            "SELECT MAX(ts) FROM remediations WHERE rule = ? AND target_key = ? AND counted = 1 AND acked = 0",
            (rule, target_key),
        )
        value: float | None = rows[0][0]
        return value

    def circuit_open(self, rule: str, target_key: str) -> bool:
        return bool(self._query("SELECT 1 FROM circuits WHERE rule = ? AND target_key = ?", (rule, target_key)))


# -- opening helpers ---------------------------------------------------------------------------
