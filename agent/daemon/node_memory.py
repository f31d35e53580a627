"""The daemon's side of the node memory (agent/node_memory/): loaded into the watchers, the prober
and the collector's identities once the store is open, the inventory refreshed from every loop's
samples, an operator's acknowledgements followed, and what the watchers counted saved for the next
start."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from agent.backend.base import GpuIdentity
from agent.logs import get_logger
from agent.node_memory.inventory import with_missing
from agent.state import GpuSample, ProbeStreak, XidCount
from agent.store.boot_tables import InventoryGpu
from agent.store.database import RETENTION_SECONDS, Store, StoreError
from agent.store.db import TableCache
from agent.watch.throttle import ClockEventTotal
from agent.watch.xid import XidMark

if TYPE_CHECKING:
    from agent.daemon.live import Live

log = get_logger()
T = TypeVar("T")

PRUNE_EVERY_SECONDS = 3600.0


class NodeMemory:
    """Reads and writes the node memory for the daemon, through its live parts (agent/daemon/live.py):
    the store, the boot the memory is kept under, the collector's identities, the Xid and throttle
    watchers and the prober. Loaded once, when the store opens (`Live.when_store_opens`); until then
    (no store yet, or none usable) nothing is remembered and the samples pass through unchanged."""

    def __init__(self, *, live: Live) -> None:
        self.live = live
        self.boot_id = live.memory_boot_id
        self._loaded = False
        self._inventory: dict[str, InventoryGpu] = {}
        # Read every loop, written once in a while: read from the store again only after a write.
        self._inventory_reads = TableCache("gpu_inventory", self._read_inventory)
        self._marks_reads = TableCache("xid_marks", self._read_marks)
        self._saved_counts: list[XidCount] = []
        self._saved_marks: list[XidMark] = []
        self._saved_clock_events: list[ClockEventTotal] = []
        self._saved_streaks: list[ProbeStreak] = []
        self._last_prune_seconds = float("-inf")

    def load(self, store: Store) -> None:
        """Once, when the store opens (before the first collection, if it opens at start): the
        remembered GPUs seed the collector's identities (a GPU NVML still counts but cannot identify
        keeps its name), the Xid watcher gets its counters and health window back, the throttle
        watcher its totals and active slowdowns, the prober its streaks."""
        if self._loaded:
            return
        try:
            store.start_boot(self.boot_id)
            inventory = store.inventory(self.boot_id)
            counts = store.xid_counts(self.boot_id)
            marks = store.xid_marks(self.boot_id)
            clock_events = store.clock_event_totals(self.boot_id)
            streaks = store.probe_streaks(self.boot_id)
        except StoreError as exc:
            log.error("node memory unreadable: starting without it", error=str(exc))
            return
        self._loaded = True
        self._inventory = {gpu.uuid: gpu for gpu in inventory}
        identities = self.live.collector.identities
        for gpu in inventory:
            if not gpu.acked and gpu.index not in identities:
                identities[gpu.index] = GpuIdentity(gpu.index, gpu.uuid, gpu.model, gpu.pci_bus_id, "", "", -1)
        self.live.watchers.xid.restore(counts, marks)
        self.live.watchers.throttle.restore(clock_events)
        self.live.prober.restore(streaks)
        self._saved_counts, self._saved_marks = counts, marks
        self._saved_clock_events, self._saved_streaks = clock_events, streaks
        log.info(
            "node memory loaded",
            boot_id=self.boot_id,
            gpus=len(inventory),
            missing=sum(1 for gpu in inventory if not gpu.present and not gpu.acked),
            xid_counters=len(counts),
            clock_event_totals=len(clock_events),
            probe_streaks=len(streaks),
        )

    def remember(self, samples: Sequence[GpuSample], now: float) -> list[GpuSample]:
        """This loop's samples, with the inventory refreshed from them: remembered missing GPUs
        added, acknowledged ones that still do not answer left out."""
        store = self.live.store
        if store is None or not self._loaded:
            return list(samples)
        try:
            stored = dict(self._inventory_reads.get(store))  # `gpu-agent ack` writes it too
        except StoreError as exc:
            log.error("node memory unreadable", error=str(exc))
            stored = self._inventory
        kept, changed = with_missing(samples, stored, now)
        if changed:
            try:
                store.remember_gpus(self.boot_id, changed)
            except StoreError as exc:
                log.error("could not update the GPU inventory", error=str(exc))
            else:
                stored.update((gpu.uuid, gpu) for gpu in changed)
        self._inventory = stored
        return kept

    def follow_acks(self) -> None:
        """Xids an operator marked dealt with (`gpu-agent ack` took them out of the stored health
        window since the last save) leave the watcher's window too, before this loop's verdict."""
        store = self.live.store
        if store is None or not self._loaded or not self._saved_marks:
            return
        try:
            stored = self._marks_reads.get(store)
        except StoreError as exc:
            log.error("node memory unreadable", error=str(exc))
            return
        gone = {(m.gpu, m.xid) for m in self._saved_marks} - {(m.gpu, m.xid) for m in stored}
        if gone:
            self.live.watchers.xid.forget(gone)
            log.info("Xids acknowledged as dealt with", marks=sorted(gone))
        self._saved_marks = stored

    def save(self, now: float) -> None:
        """The Xid counters and health window, the throttle totals and the probe streaks, each when it
        changed; the history pruned now and then."""
        store = self.live.store
        if store is None or not self._loaded:
            return
        xid = self.live.watchers.xid
        counts = xid.counts()
        marks = xid.marks()
        clock_events = self.live.watchers.throttle.totals()
        streaks = self.live.prober.streaks()
        try:
            self._saved_clock_events = self._written(
                self._saved_clock_events, clock_events, store.replace_clock_event_totals
            )
            self._saved_streaks = self._written(self._saved_streaks, streaks, store.replace_probe_streaks)
            self._saved_counts = self._written(self._saved_counts, counts, store.save_xid_counts)
            self._saved_marks = self._written(self._saved_marks, marks, store.replace_xid_marks)
            if now - self._last_prune_seconds >= PRUNE_EVERY_SECONDS:
                self._last_prune_seconds = now
                store.prune(now - RETENTION_SECONDS)
        except StoreError as exc:
            log.error("could not save the node memory", error=str(exc))

    def _written(self, saved: list[T], current: list[T], write: Callable[[str, list[T]], None]) -> list[T]:
        """`current`, written to the store under this boot first when it is not what was `saved`
        there (a StoreError leaves `saved` as it was: the next save tries again)."""
        if current != saved:
            write(self.boot_id, current)
        return current

    def _read_inventory(self, store: Store) -> dict[str, InventoryGpu]:
        return {gpu.uuid: gpu for gpu in store.inventory(self.boot_id)}

    def _read_marks(self, store: Store) -> list[XidMark]:
        return store.xid_marks(self.boot_id)
