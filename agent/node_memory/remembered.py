"""The daemon's node memory read once, read-only, for `gpu-agent status --direct` (nothing created,
migrated or pruned: the daemon owns the store)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from agent.node_memory.inventory import with_missing
from agent.state import GpuSample, ProbeStreak, ServiceStatus, XidCount
from agent.store.boot_tables import BootTables, InventoryGpu
from agent.store.database import DB_NAME
from agent.store.db import StoreError
from agent.store.schema import BUSY_TIMEOUT_SECONDS
from agent.watch.throttle import ClockEventTotal, ThrottleWatcher
from agent.watch.xid import XidMark, XidWatcher


@dataclass(frozen=True)
class RememberedNode:
    """The daemon's memory of this boot, as `read_remembered` found it."""

    inventory: list[InventoryGpu]
    xid_counts: list[XidCount]
    xid_marks: list[XidMark]
    clock_events: list[ClockEventTotal]
    streaks: list[ProbeStreak]

    def samples(self, samples: Sequence[GpuSample], now: float) -> list[GpuSample]:
        """A one-off read's samples as the daemon would see them: a GPU that answers too little to be
        identified named as remembered at its index (the daemon's collector keeps identities), and
        remembered missing GPUs added."""
        by_index = {gpu.index: gpu for gpu in self.inventory if not gpu.acked}
        named = [
            replace(sample, uuid=known.uuid, name=sample.name or known.model, pci_bus_id=known.pci_bus_id)
            if not sample.uuid and (known := by_index.get(sample.index)) is not None
            else sample
            for sample in samples
        ]
        return with_missing(named, {gpu.uuid: gpu for gpu in self.inventory}, now)[0]

    def restore(self, xid: XidWatcher, throttle: ThrottleWatcher) -> None:
        """The watchers as the daemon left them: Xid counters and health window, held slowdowns."""
        xid.restore(self.xid_counts, self.xid_marks)
        throttle.restore(self.clock_events)

    def services(self, declared: Sequence[tuple[str, str]]) -> tuple[ServiceStatus, ...]:
        """The configured services (name, unit) in the state the daemon's probes declared them."""
        streaks = {streak.service: streak for streak in self.streaks}
        found = []
        for name, unit in declared:
            streak = streaks.get(name)
            if streak is None:
                found.append(ServiceStatus(name, unit, None))
                continue
            failed = streak.consecutive_failures
            detail = f"declared down by the daemon's probes ({failed} failed in a row)" if streak.up is False else ""
            found.append(ServiceStatus(name, unit, streak.up, failed, None, detail))
        return tuple(found)


def read_remembered(state_dir: str | Path, boot_id: str) -> RememberedNode | None:
    """The daemon's node memory of `boot_id`, read-only (nothing created, migrated or pruned: the
    daemon owns the store); None when there is no store. An unreadable one raises StoreError."""
    path = Path(state_dir) / DB_NAME
    if not path.is_file():
        return None
    try:
        connection = sqlite3.connect(
            f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_SECONDS, check_same_thread=False
        )
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(f"cannot open {path}: {exc}") from exc
    tables = BootTables(path, connection)
    try:
        return RememberedNode(
            tables.inventory(boot_id),
            tables.xid_counts(boot_id),
            tables.xid_marks(boot_id),
            tables.clock_event_totals(boot_id),
            tables.probe_streaks(boot_id),
        )
    finally:
        tables.close()
