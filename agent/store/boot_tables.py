"""Node memory, all of it per boot (`/proc/sys/kernel/random/boot_id`): the GPU inventory, the Xid
counters and health window, the throttle watcher's clock-event totals and the service prober's
failure streaks (see agent.store.database for the schema and agent/daemon/node_memory.py for who reads them). A restart
of the agent is not a reboot and must not forget; a reboot starts afresh (`start_boot`)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.logs import get_logger
from agent.state import ProbeStreak, XidCount
from agent.store.db import Database
from agent.watch.throttle import ClockEventTotal
from agent.watch.xid import XidMark

log = get_logger()


@dataclass(frozen=True)
class InventoryGpu:
    """A GPU seen on this boot."""

    uuid: str
    pci_bus_id: str
    model: str
    index: int  # its NVML index when last seen
    first_seen_seconds: float
    last_seen_seconds: float  # when it last answered
    present: bool = True  # answering at the daemon's last look
    acked: bool = False  # acknowledged gone: not expected any more


def _total_row(total: ClockEventTotal) -> tuple[object, ...]:
    return (
        total.gpu,
        total.uuid,
        total.reason,
        total.seconds,
        total.active_since_seconds,
        total.active_since_boottime_seconds,
    )


_UNKNOWN_GPU = -1  # xid_counts.gpu for an Xid no GPU could be named for


class BootTables(Database):
    """The store's node memory tables."""

    def start_boot(self, boot_id: str) -> None:
        """This boot's memory is the only one: what earlier boots remembered is dropped (a reboot
        resets GPUs, their Xid counters and health)."""
        with self._transaction() as db:
            gone = sum(
                db.execute(f"DELETE FROM {table} WHERE boot_id != ?", (boot_id,)).rowcount  # noqa: S608  # nosec B608
                for table in ("gpu_inventory", "xid_counts", "xid_marks", "clock_event_totals", "probe_streaks")
            )
        if gone:
            log.info("new boot: node memory of earlier boots dropped", boot_id=boot_id, rows=gone)

    def inventory(self, boot_id: str) -> list[InventoryGpu]:
        """Every GPU seen on this boot, acknowledged ones included, by index then UUID."""
        rows = self._query(
            "SELECT uuid, pci_bus_id, model, gpu, first_seen, last_seen, present, acked FROM gpu_inventory"
            " WHERE boot_id = ? ORDER BY gpu, uuid",
            (boot_id,),
        )
        return [
            InventoryGpu(uuid, bus, model, index, first, last, present=bool(present), acked=bool(acked))
            for uuid, bus, model, index, first, last, present, acked in rows
        ]

    def remember_gpus(self, boot_id: str, gpus: list[InventoryGpu]) -> None:
        """Add GPUs, or update them as written (first_seen stays the first one stored)."""
        with self._transaction(("gpu_inventory",)) as db:
            for gpu in gpus:
                db.execute(
                    "INSERT INTO gpu_inventory (boot_id, uuid, pci_bus_id, model, gpu, first_seen, last_seen, present,"
                    " acked) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (boot_id, uuid) DO UPDATE SET"
                    " pci_bus_id = excluded.pci_bus_id, model = excluded.model, gpu = excluded.gpu,"
                    " last_seen = excluded.last_seen, present = excluded.present, acked = excluded.acked",
                    (
                        boot_id,
                        gpu.uuid,
                        gpu.pci_bus_id,
                        gpu.model,
                        gpu.index,
                        gpu.first_seen_seconds,
                        gpu.last_seen_seconds,
                        int(gpu.present),
                        int(gpu.acked),
                    ),
                )

    def xid_counts(self, boot_id: str) -> list[XidCount]:
        rows = self._query(
            "SELECT gpu, uuid, xid, count, last_seen FROM xid_counts WHERE boot_id = ? ORDER BY gpu, xid", (boot_id,)
        )
        return [
            XidCount(None if gpu == _UNKNOWN_GPU else gpu, uuid, xid, count, seen)
            for gpu, uuid, xid, count, seen in rows
        ]

    def save_xid_counts(self, boot_id: str, counts: list[XidCount]) -> None:
        """Store these counters as they are now (a counter only grows: the rows are replaced)."""
        with self._transaction(("xid_counts",)) as db:
            db.executemany(
                "INSERT INTO xid_counts (boot_id, gpu, xid, uuid, count, last_seen) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (boot_id, gpu, xid) DO UPDATE SET uuid = excluded.uuid, count = excluded.count,"
                " last_seen = excluded.last_seen",
                [
                    (boot_id, _UNKNOWN_GPU if c.gpu is None else c.gpu, c.xid, c.uuid, c.count, c.last_seen_seconds)
                    for c in counts
                ],
            )

    def xid_marks(self, boot_id: str) -> list[XidMark]:
        rows = self._query(
            "SELECT gpu, xid, action, reason, seen FROM xid_marks WHERE boot_id = ? ORDER BY gpu, xid", (boot_id,)
        )
        return [XidMark(*row) for row in rows]

    def replace_xid_marks(self, boot_id: str, marks: list[XidMark]) -> None:
        """The health window as it is now: marks that aged out or were cleared (GPU reset) go."""
        with self._transaction(("xid_marks",)) as db:
            db.execute("DELETE FROM xid_marks WHERE boot_id = ?", (boot_id,))
            db.executemany(
                "INSERT INTO xid_marks (boot_id, gpu, xid, action, reason, seen) VALUES (?, ?, ?, ?, ?, ?)",
                [(boot_id, m.gpu, m.xid, m.action, m.reason, m.seen_seconds) for m in marks],
            )

    def clear_xid_marks(self, boot_id: str, gpu: int | str | None = None, xid: int | None = None) -> list[XidMark]:
        """Take Xids out of the health window (`gpu-agent ack`): every mark, or those of one GPU (its
        index, or its UUID as the inventory knows it), or of one Xid on it. The marks taken out;
        the counters stay. A running daemon follows (agent.daemon.node_memory)."""
        with self._transaction(("xid_marks",)) as db:
            if isinstance(gpu, str):
                row = db.execute(
                    "SELECT gpu FROM gpu_inventory WHERE boot_id = ? AND uuid = ?", (boot_id, gpu)
                ).fetchone()
                if row is None:
                    return []
                gpu = int(row[0])
            rows = db.execute(
                "SELECT gpu, xid, action, reason, seen FROM xid_marks WHERE boot_id = ?"
                " AND (? IS NULL OR gpu = ?) AND (? IS NULL OR xid = ?) ORDER BY gpu, xid",
                (boot_id, gpu, gpu, xid, xid),
            ).fetchall()
            db.execute(
                "DELETE FROM xid_marks WHERE boot_id = ? AND (? IS NULL OR gpu = ?) AND (? IS NULL OR xid = ?)",
                (boot_id, gpu, gpu, xid, xid),
            )
        return [XidMark(*row) for row in rows]

    def clock_event_totals(self, boot_id: str) -> list[ClockEventTotal]:
        rows = self._query(
            "SELECT gpu, uuid, reason, seconds, active_since, active_since_boottime FROM clock_event_totals"
            " WHERE boot_id = ?"
            " ORDER BY gpu, reason",
            (boot_id,),
        )
        return [ClockEventTotal(*row) for row in rows]

    def replace_clock_event_totals(self, boot_id: str, totals: list[ClockEventTotal]) -> None:
        """The throttle watcher's totals as they are now (a board replaced at an index starts afresh)."""
        with self._transaction(("clock_event_totals",)) as db:
            db.execute("DELETE FROM clock_event_totals WHERE boot_id = ?", (boot_id,))
            db.executemany(
                "INSERT INTO clock_event_totals (boot_id, gpu, uuid, reason, seconds, active_since,"
                " active_since_boottime) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(boot_id, *_total_row(t)) for t in totals],
            )

    def probe_streaks(self, boot_id: str) -> list[ProbeStreak]:
        rows = self._query(
            "SELECT service, up, consecutive_failures FROM probe_streaks WHERE boot_id = ? ORDER BY service",
            (boot_id,),
        )
        return [ProbeStreak(service, None if up is None else bool(up), failures) for service, up, failures in rows]

    def replace_probe_streaks(self, boot_id: str, streaks: list[ProbeStreak]) -> None:
        """The prober's streaks as they are now (a service dropped from the configuration goes)."""
        with self._transaction(("probe_streaks",)) as db:
            db.execute("DELETE FROM probe_streaks WHERE boot_id = ?", (boot_id,))
            db.executemany(
                "INSERT INTO probe_streaks (boot_id, service, up, consecutive_failures) VALUES (?, ?, ?, ?)",
                [(boot_id, s.service, None if s.up is None else int(s.up), s.consecutive_failures) for s in streaks],
            )
