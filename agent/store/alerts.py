"""The alerts the agent pushes to Alertmanager (agent.daemon.alert_book), kept across restarts: one row per
alert (its labels are its identity), pending, firing or resolved and not yet told to every
Alertmanager. A restarted agent goes on from them: a firing alert keeps its start (Alertmanager sees
the same alert, no new page), a pending one its `for` on the same boot, a resolution still owed is
delivered."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from agent.store.db import Database

#: The schema of the pushed alerts (agent.store.schema's MIGRATIONS takes it as schema 8).
ALERTS_MIGRATION: tuple[str, ...] = (
    """CREATE TABLE alert_pushes (
        key TEXT PRIMARY KEY,
        labels TEXT NOT NULL,
        annotations TEXT NOT NULL,
        boot_id TEXT NOT NULL,
        pending_since REAL,
        starts_at REAL,
        ends_at REAL,
        raised INTEGER NOT NULL,
        overrides TEXT NOT NULL,
        delivered TEXT NOT NULL
    )""",
)


@dataclass(frozen=True)
class AlertRow:
    """One pushed alert. `pending_since` is CLOCK_BOOTTIME on `boot_id`; `starts_at`/`ends_at` wall
    time (None: not firing yet / not resolved); `overrides` the annotations a rule's step set;
    `delivered` the Alertmanagers that have its resolution, by a digest of their URL; `urls` the
    Alertmanagers a rule's step named besides the configured ones, kept in memory only (a URL may
    carry a token, and tokens stay out of the store)."""

    key: str
    labels: dict[str, str]
    annotations: dict[str, str]
    boot_id: str
    pending_since: float | None
    starts_at: float | None
    ends_at: float | None
    raised: bool
    overrides: dict[str, str]
    delivered: tuple[str, ...]
    urls: tuple[str, ...] = ()


_COLUMNS = "key, labels, annotations, boot_id, pending_since, starts_at, ends_at, raised, overrides, delivered"


class AlertTables(Database):
    def pushed_alerts(self) -> list[AlertRow]:
        rows = self._query(f"SELECT {_COLUMNS} FROM alert_pushes ORDER BY key")  # noqa: S608  # nosec B608
        return [
            AlertRow(
                row[0],
                json.loads(row[1]),
                json.loads(row[2]),
                row[3],
                row[4],
                row[5],
                row[6],
                bool(row[7]),
                json.loads(row[8]),
                tuple(json.loads(row[9])),
            )
            for row in rows
        ]

    def save_pushed_alerts(self, changed: Iterable[AlertRow], gone: Iterable[str]) -> None:
        """Write these rows (as they are now) and delete the alerts of `gone` keys, in one transaction."""
        with self._transaction(("alert_pushes",)) as db:
            db.executemany(
                f"INSERT OR REPLACE INTO alert_pushes ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",  # noqa: S608  # nosec B608
                [
                    (
                        row.key,
                        json.dumps(row.labels, sort_keys=True),
                        json.dumps(row.annotations, sort_keys=True),
                        row.boot_id,
                        row.pending_since,
                        row.starts_at,
                        row.ends_at,
                        int(row.raised),
                        json.dumps(row.overrides, sort_keys=True),
                        json.dumps(list(row.delivered)),
                    )
                    for row in changed
                ],
            )
            db.executemany("DELETE FROM alert_pushes WHERE key = ?", [(key,) for key in gone])
