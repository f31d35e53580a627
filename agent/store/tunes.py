"""The advisor's journal (`gpu-agent tune`): one row per sweep, written before its first change.

A row is `running` from before the first setting is changed until the originals are back; each
measured step is appended as it completes. A row still `running` at start is a sweep an earlier
run left half-done (kill -9, a crash): the daemon puts its `originals` back before the policy loop
may touch those GPUs, then closes the row as `interrupted`. The documents are JSON as
agent.tune.model writes them; the store does not interpret them beyond the state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agent.store.db import Database

RUNNING = "running"

#: The schema of the advisor's journal: a sweep is written down, with the settings it will
#: put back, before its first change; and the per-setting history the passive advice reads.
#: (agent.store.database's MIGRATIONS takes it as schema 6.)
TUNES_MIGRATION: tuple[str, ...] = (
    """CREATE TABLE tunes (
        id INTEGER PRIMARY KEY,
        started REAL NOT NULL,
        finished REAL,
        state TEXT NOT NULL,
        document TEXT NOT NULL
    )""",
    "CREATE INDEX tunes_running ON tunes (state) WHERE state = 'running'",
    """CREATE TABLE tune_history (
        service TEXT NOT NULL,
        gpu_model TEXT NOT NULL,
        setting TEXT NOT NULL,
        seconds REAL NOT NULL,
        tokens REAL NOT NULL,
        joules REAL NOT NULL,
        e2e_p95_max REAL,
        last_seen REAL NOT NULL,
        PRIMARY KEY (service, gpu_model, setting)
    )""",
)


@dataclass(frozen=True)
class TuneRow:
    row_id: int
    document: dict[str, Any]  # agent.tune.model.TuneDocument as JSON, id and state included


class TuneTables(Database):
    def begin_tune(self, started_seconds: float, document: dict[str, Any]) -> int:
        """Journal a sweep as running (its originals included) before it changes anything; its id."""
        with self._transaction() as db:
            cursor = db.execute(
                "INSERT INTO tunes (started, finished, state, document) VALUES (?, NULL, ?, ?)",
                (started_seconds, RUNNING, json.dumps(document)),
            )
            row_id = cursor.lastrowid
        if row_id is None:  # pragma: no cover - sqlite always sets it after an INSERT
            raise RuntimeError("no row id for the journaled tune")
        return row_id

    def save_tune(self, row_id: int, document: dict[str, Any], finished_seconds: float | None = None) -> None:
        """The sweep's document as it stands (a step appended, or its end with `finished_seconds`)."""
        state = str(document.get("state", RUNNING))
        with self._transaction() as db:
            db.execute(
                "UPDATE tunes SET state = ?, document = ?, finished = ? WHERE id = ?",
                (state, json.dumps(document), finished_seconds, row_id),
            )

    def running_tunes(self) -> list[TuneRow]:
        rows = self._query("SELECT id, document FROM tunes WHERE state = ? ORDER BY id", (RUNNING,))
        return [TuneRow(row_id, _with_id(row_id, text)) for row_id, text in rows]

    def last_tune(self) -> TuneRow | None:
        rows = self._query("SELECT id, document FROM tunes ORDER BY id DESC LIMIT 1")
        return TuneRow(rows[0][0], _with_id(rows[0][0], rows[0][1])) if rows else None

    def last_measured_tunes(self) -> list[TuneRow]:
        """The last sweep of each service and kind that measured to its end (done, or stopped early by
        the traffic or the SLO), oldest first: what /metrics shows the fleet."""
        rows = self._query(
            "SELECT id, document FROM tunes WHERE id IN (SELECT MAX(id) FROM tunes WHERE state IN ('done', 'stopped')"
            " GROUP BY json_extract(document, '$.request.service'), json_extract(document, '$.request.kind'))"
            " ORDER BY id"
        )
        return [TuneRow(row_id, _with_id(row_id, text)) for row_id, text in rows]

    def tune(self, row_id: int) -> TuneRow | None:
        rows = self._query("SELECT id, document FROM tunes WHERE id = ?", (row_id,))
        return TuneRow(rows[0][0], _with_id(rows[0][0], rows[0][1])) if rows else None


def _with_id(row_id: int, text: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(text)
    document["id"] = row_id
    return document


@dataclass(frozen=True)
class HistoryRow:
    """What a service did while its GPUs ran at one setting (a power limit), summed over time."""

    service: str
    gpu_model: str
    setting: str  # "power:700@2-4": the limit and the traffic band (agent.tune.passive); "power:700" before bands
    seconds: float
    tokens: float
    joules: float
    e2e_p95_max_seconds: float | None
    last_seen_seconds: float


class TuneHistoryTables(Database):
    def add_history(self, rows: list[HistoryRow]) -> None:
        """Add each row's time, tokens and joules to what the store holds for its setting."""
        with self._transaction(("tune_history",)) as db:
            for row in rows:
                db.execute(
                    "INSERT INTO tune_history (service, gpu_model, setting, seconds, tokens, joules, e2e_p95_max,"
                    " last_seen) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (service, gpu_model, setting) DO UPDATE"
                    " SET seconds = seconds + excluded.seconds, tokens = tokens + excluded.tokens,"
                    " joules = joules + excluded.joules, last_seen = excluded.last_seen,"
                    " e2e_p95_max = MAX(COALESCE(e2e_p95_max, excluded.e2e_p95_max), COALESCE(excluded.e2e_p95_max,"
                    " e2e_p95_max))",
                    (
                        row.service,
                        row.gpu_model,
                        row.setting,
                        row.seconds,
                        row.tokens,
                        row.joules,
                        row.e2e_p95_max_seconds,
                        row.last_seen_seconds,
                    ),
                )

    def history(self, service: str) -> list[HistoryRow]:
        rows = self._query(
            "SELECT service, gpu_model, setting, seconds, tokens, joules, e2e_p95_max, last_seen FROM tune_history"
            " WHERE service = ? ORDER BY gpu_model, setting",
            (service,),
        )
        return [HistoryRow(*row) for row in rows]
