"""Circuits and the operator's acknowledgements (`gpu-agent ack`): a rule whose attempts ran out
stops acting on its target until acknowledged; an acknowledgement re-arms rules and retires their
attempts from the counters, and can declare missing GPUs gone."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from agent.logs import get_logger
from agent.rules.model import Target
from agent.store.db import Database
from agent.store.selector import AckSelector, parse_ack_selector

log = get_logger()


@dataclass(frozen=True)
class Circuit:
    rule: str
    target_key: str
    gpu: int | None
    uuid: str | None
    service: str | None
    opened_seconds: float
    reason: str


class Acknowledgements(Database):
    """The store's circuits and acknowledgements."""

    @staticmethod
    def _open_circuit(db: sqlite3.Connection, rule: str, target: Target, reason: str, now_seconds: float) -> None:
        db.execute(
            "INSERT OR IGNORE INTO circuits (rule, target_key, gpu, uuid, service, opened_at, reason)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (rule, target.key, target.gpu, target.uuid, target.service, now_seconds, reason),
        )

    def open_circuit(self, rule: str, target: Target, reason: str, now_seconds: float | None = None) -> None:
        """Stop `rule` acting on `target` until acknowledged (opening an open circuit changes nothing)."""
        with self._transaction() as db:
            self._open_circuit(db, rule, target, reason, time.time() if now_seconds is None else now_seconds)

    def circuits(self) -> list[Circuit]:
        rows = self._query(
            "SELECT rule, target_key, gpu, uuid, service, opened_at, reason FROM circuits ORDER BY rule, target_key"
        )
        return [Circuit(*row) for row in rows]

    def ack(self, selector: str, now_seconds: float | None = None) -> int:
        """Re-arm rules: close their circuits and retire their attempts from the counters.

        `selector`: "all"; a rule name; "gpu:<index>", "gpu:<uuid>" or a bare "GPU-..." uuid (every
        rule's state for that GPU, services targeted through it included); "service:<name>"
        (agent/store/selector.py; ValueError for a number out of range). Returns how many (rule,
        target) pairs it re-armed. (`Store.acknowledge` is the whole of `gpu-agent ack`.)
        """
        # `where` is one of _selector's fixed clauses; every value in it is a bound parameter (nosec B608 below).
        where, args = _selector(parse_ack_selector(selector))
        with self._transaction() as db:
            pairs = set(db.execute(f"SELECT rule, target_key FROM circuits WHERE {where}", args).fetchall())  # noqa: S608  # nosec B608
            pairs |= set(
                db.execute(
                    f"SELECT rule, target_key FROM remediations WHERE counted = 1 AND acked = 0 AND ({where})",  # noqa: S608  # nosec B608
                    args,
                ).fetchall()
            )
            db.execute(f"DELETE FROM circuits WHERE {where}", args)  # noqa: S608  # nosec B608
            db.execute(f"UPDATE remediations SET acked = 1 WHERE counted = 1 AND acked = 0 AND ({where})", args)  # noqa: S608  # nosec B608
            db.execute(
                "INSERT INTO acks (ts, selector, reset) VALUES (?, ?, ?)",
                (time.time() if now_seconds is None else now_seconds, selector, len(pairs)),
            )
        log.info("acknowledged", selector=selector, rearmed=len(pairs))
        return len(pairs)

    def acknowledge_gone(self, selector: str) -> list[str]:
        """Acknowledge missing GPUs as gone: they leave the inventory's expected GPUs (and `status`,
        `/metrics`) until they answer again. Only a GPU missing at the daemon's last look qualifies:
        one that answers is there, whatever the operator says. `selector` as for `ack`: "all",
        "gpu:<uuid>", a bare "GPU-..." uuid or "gpu:<index>"; any other names no GPU. Returns the
        UUIDs acknowledged."""
        condition = _inventory_selector(parse_ack_selector(selector))
        if condition is None:
            return []
        # `where` is one of _inventory_selector's fixed clauses; its values are bound parameters.
        where, args = condition
        with self._transaction() as db:
            uuids = [
                row[0]
                for row in db.execute(
                    f"SELECT DISTINCT uuid FROM gpu_inventory WHERE acked = 0 AND present = 0 AND ({where})",  # noqa: S608  # nosec B608
                    args,
                ).fetchall()
            ]
            db.execute(
                f"UPDATE gpu_inventory SET acked = 1 WHERE acked = 0 AND present = 0 AND ({where})",  # noqa: S608  # nosec B608
                args,
            )
        if uuids:
            log.info("missing GPUs acknowledged gone", selector=selector, uuids=uuids)
        return sorted(uuids)


def _selector(selector: AckSelector) -> tuple[str, tuple[Any, ...]]:
    """SQL condition (over rule, target_key, gpu, uuid, service columns) for an ack selector."""
    if selector.every:
        return "1 = 1", ()
    if selector.xid is not None or selector.reboot:
        return "0 = 1", ()  # an Xid or the reboot recommendation dealt with re-arms no rule
    if selector.gpu_index is not None:
        return "(gpu = ? OR target_key = ?)", (selector.gpu_index, f"gpu-index:{selector.gpu_index}")
    if selector.gpu_uuid is not None:
        return "uuid = ?", (selector.gpu_uuid,)
    if selector.service is not None:
        return "service = ?", (selector.service,)
    return "rule = ?", (selector.rule,)


def _inventory_selector(selector: AckSelector) -> tuple[str, tuple[Any, ...]] | None:
    """SQL condition over gpu_inventory for the selectors that name GPUs ("all", "gpu:UUID",
    "GPU-...", "gpu:INDEX"); None for a rule, service or Xid selector."""
    if selector.every:
        return "1 = 1", ()
    if selector.xid is not None:
        return None
    if selector.gpu_index is not None:
        return "gpu = ?", (selector.gpu_index,)
    if selector.gpu_uuid is not None:
        return "uuid = ?", (selector.gpu_uuid,)
    return None
