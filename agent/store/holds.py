"""The journal of GPU settings a job holds outside the policy loop (agent.policy.holds): one row per
transaction, written with the originals before the job's first change and ended once they are back.

A row still open at start is a job an earlier run left half-done (kill -9, a crash): the daemon
puts its originals back before the policy loop may touch those settings, then ends the row. The
originals are JSON as agent.policy.transaction writes them; the store does not interpret them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agent.store.db import Database

#: The schema of the hold journal (agent.store.schema's MIGRATIONS takes it as schema 7).
HOLDS_MIGRATION: tuple[str, ...] = (
    """CREATE TABLE gpu_holds (
        id INTEGER PRIMARY KEY,
        owner TEXT NOT NULL,
        boot_id TEXT NOT NULL,
        started REAL NOT NULL,
        finished REAL,
        originals TEXT NOT NULL,
        detail TEXT NOT NULL DEFAULT ''
    )""",
    "CREATE INDEX gpu_holds_open ON gpu_holds (id) WHERE finished IS NULL",
)


@dataclass(frozen=True)
class HoldRow:
    row_id: int
    owner: str
    boot_id: str
    originals: list[dict[str, Any]]
    finished_seconds: float | None = None
    detail: str = ""


class HoldTables(Database):
    def begin_hold(self, owner: str, boot_id: str, started_seconds: float, originals: list[dict[str, Any]]) -> int:
        """Journal a hold with the originals to put back, before its job changes anything; its id."""
        with self._transaction(("gpu_holds",)) as db:
            cursor = db.execute(
                "INSERT INTO gpu_holds (owner, boot_id, started, originals) VALUES (?, ?, ?, ?)",
                (owner, boot_id, started_seconds, json.dumps(originals)),
            )
            row_id = cursor.lastrowid
        if row_id is None:  # pragma: no cover - sqlite always sets it after an INSERT
            raise RuntimeError("no row id for the journaled hold")
        return row_id

    def end_hold(self, row_id: int, finished_seconds: float, detail: str) -> None:
        """The originals are back (or could not be put back: `detail` says which)."""
        with self._transaction(("gpu_holds",)) as db:
            db.execute(
                "UPDATE gpu_holds SET finished = ?, detail = ? WHERE id = ? AND finished IS NULL",
                (finished_seconds, detail, row_id),
            )

    def open_holds(self) -> list[HoldRow]:
        rows = self._query("SELECT id, owner, boot_id, originals FROM gpu_holds WHERE finished IS NULL ORDER BY id")
        return [HoldRow(row_id, owner, boot_id, json.loads(text)) for row_id, owner, boot_id, text in rows]

    def holds(self, limit: int = 100) -> list[HoldRow]:
        """The newest holds first, ended or not (tests and diagnostics)."""
        rows = self._query(
            "SELECT id, owner, boot_id, originals, finished, detail FROM gpu_holds ORDER BY id DESC LIMIT ?", (limit,)
        )
        return [HoldRow(r[0], r[1], r[2], json.loads(r[3]), r[4], r[5]) for r in rows]
