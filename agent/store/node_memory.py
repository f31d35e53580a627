"""The node's memory across agent restarts: which GPUs this boot had, what the Xid and throttle
watchers counted, and the service prober's failure streaks.

A restart of the agent is not a reboot: a GPU that fell off the bus is still gone, its Xids still
happened. So the daemon keeps, per boot (`/proc/sys/kernel/random/boot_id` under host_root), the
GPU inventory, the Xid counters and health window, the time per clock-event reason with the start
of each slowdown active now, and each service's declared state and failure streak in the store
(agent/store/database.py), and reads them back when it starts. A reboot starts a new, empty memory. Each
part is written only when it changed since the last write.

Every loop, `remember` refreshes the inventory with the GPUs that answer and adds a sample for
each remembered GPU that is missing (not enumerated at all), `up=False` and read as lost: it stays
in `status` and `/metrics` (gpu_agent_gpu_up 0, health unhealthy) until it answers again or an
operator acknowledges it gone (`gpu-agent ack gpu:UUID`); then it is dropped from the samples.

`expected_gpu_count(snapshot)` is the number of GPUs the node should have: the snapshot's GPUs,
remembered missing ones included, acknowledged ones not. The publisher exports it as
`gpu_agent_gpus_expected`.

`read_remembered` is the same memory read once, read-only, for `gpu-agent status --direct`: the
one-off read then judges the node with what the daemon knows (an Xid seen an hour ago, a slowdown
held for minutes, a GPU gone, a service declared down), and reaches the daemon's verdict.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from agent.backend.base import GpuIdentity
from agent.backend.errors import GpuErrorKind
from agent.host.paths import BOOT_ID_PATH as BOOT_ID_PATH
from agent.host.paths import HostPaths
from agent.logger import get_logger
from agent.services.health import HealthProber
from agent.state import GpuSample, NodeSnapshot, ServiceStatus, XidCount
from agent.store.boot import BootTables
from agent.store.database import (
    DB_NAME,
    RETENTION_SECONDS,
    InventoryGpu,
    ProbeStreak,
    Store,
    StoreError,
)
from agent.store.db import TableCache
from agent.store.schema import BUSY_TIMEOUT_SECONDS
from agent.watch.throttle import ClockEventTotal, ThrottleWatcher
from agent.watch.xid import XidMark, XidWatcher

log = get_logger()

UNKNOWN_BOOT = "unknown"  # no boot id readable: one memory for every boot (a reboot is not seen)
LAST_SEEN_EVERY_SECONDS = 60.0  # how stale an answering GPU's stored last_seen may get
PRUNE_EVERY_SECONDS = 3600.0
MISSING_READ_ERROR = "inventory"  # read_errors key of a remembered GPU that was not enumerated


def read_boot_id(paths: HostPaths) -> str:
    """The boot this memory belongs to; UNKNOWN_BOOT where no boot id can be read."""
    return paths.boot_id() or UNKNOWN_BOOT


def expected_gpu_count(snapshot: NodeSnapshot) -> int:
    """GPUs this node should have: every GPU in the snapshot, a remembered missing one included
    (the daemon's snapshot carries those; an acknowledged one is left out of it)."""
    return len({sample.uuid or f"index:{sample.index}" for sample in snapshot.gpus})


def _missing_sample(gpu: InventoryGpu, index: int, now: float) -> GpuSample:
    return GpuSample(
        index,
        gpu.uuid,
        gpu.model,
        gpu.pci_bus_id,
        up=False,
        timestamp_seconds=now,
        read_errors={MISSING_READ_ERROR: GpuErrorKind.GPU_LOST.value},
    )


def _inventory_row(known: InventoryGpu | None, sample: GpuSample, now: float) -> InventoryGpu | None:
    """The inventory row for a sampled GPU if it needs writing; None if the stored one will do."""
    if known is None:
        return InventoryGpu(sample.uuid, sample.pci_bus_id, sample.name, sample.index, now, now, present=sample.up)
    fresh = replace(
        known,
        pci_bus_id=sample.pci_bus_id or known.pci_bus_id,
        model=sample.name or known.model,
        index=sample.index,
        present=sample.up,
        acked=known.acked and not sample.up,  # answering again: expected again
        last_seen_seconds=now if sample.up else known.last_seen_seconds,
    )
    if replace(fresh, last_seen_seconds=known.last_seen_seconds) != known:
        return fresh
    if sample.up and now - known.last_seen_seconds >= LAST_SEEN_EVERY_SECONDS:
        return fresh
    return None


def with_missing(
    samples: Sequence[GpuSample], stored: dict[str, InventoryGpu], now: float
) -> tuple[list[GpuSample], list[InventoryGpu]]:
    """`samples` with the remembered GPUs that did not answer added (down) and the acknowledged ones
    that still do not answer left out, by index; and the inventory rows that need writing."""
    changed: list[InventoryGpu] = []
    kept: list[GpuSample] = []
    for sample in samples:
        known = stored.get(sample.uuid) if sample.uuid else None
        if known is not None and known.acked and not sample.up:
            continue  # acknowledged gone: NVML may still count it, the operator does not
        if sample.uuid:
            update = _inventory_row(known, sample, now)
            if update is not None:
                changed.append(update)
        kept.append(sample)
    seen = {sample.uuid for sample in samples}
    used = {sample.index for sample in kept}
    for gpu in stored.values():
        if gpu.uuid in seen or gpu.acked:
            continue
        # Its old index, unless another GPU answers there now (NVML renumbers): then a free one.
        index = gpu.index if gpu.index not in used else max(used, default=-1) + 1
        used.add(index)
        kept.append(_missing_sample(gpu, index, now))
        if gpu.present:
            changed.append(replace(gpu, present=False))
    return sorted(kept, key=lambda sample: sample.index), changed


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


class NodeMemory:
    """Reads and writes the node memory for the daemon. `store` returns the open store, or None
    while there is none (not opened yet, or unusable): then nothing is remembered and the samples
    pass through unchanged."""

    def __init__(self, store: Callable[[], Store | None], boot_id: str, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self.boot_id = boot_id
        self._clock = clock
        self._loaded = False
        self._inventory: dict[str, InventoryGpu] = {}
        # Read every loop, written once in a while: read from the store again only after a write.
        self._inventory_reads: TableCache[Store, dict[str, InventoryGpu]] = TableCache(
            "gpu_inventory", lambda store: {gpu.uuid: gpu for gpu in store.inventory(self.boot_id)}
        )
        self._marks_reads: TableCache[Store, list[XidMark]] = TableCache(
            "xid_marks", lambda store: store.xid_marks(self.boot_id)
        )
        self._saved_counts: list[XidCount] = []
        self._saved_marks: list[XidMark] = []
        self._saved_clock_events: list[ClockEventTotal] = []
        self._saved_streaks: list[ProbeStreak] = []
        self._last_prune_seconds = float("-inf")

    def load(
        self,
        identities: dict[int, GpuIdentity],
        xid: XidWatcher,
        throttle: ThrottleWatcher | None = None,
        prober: HealthProber | None = None,
    ) -> None:
        """Once, before the first collection with a store: the remembered GPUs seed the collector's
        identities (a GPU NVML still counts but cannot identify keeps its name), the Xid watcher
        gets its counters and health window back, the throttle watcher its totals and active
        slowdowns, the prober its streaks."""
        store = self._store()
        if store is None or self._loaded:
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
        for gpu in inventory:
            if not gpu.acked and gpu.index not in identities:
                identities[gpu.index] = GpuIdentity(gpu.index, gpu.uuid, gpu.model, gpu.pci_bus_id, "", "", -1)
        xid.restore(counts, marks)
        self._saved_counts, self._saved_marks = counts, marks
        if throttle is not None:
            throttle.restore(clock_events)
            self._saved_clock_events = clock_events
        if prober is not None:
            prober.restore(streaks)
            self._saved_streaks = streaks
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
        store = self._store()
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

    def follow_acks(self, xid: XidWatcher) -> None:
        """Xids an operator marked dealt with (`gpu-agent ack` took them out of the stored health
        window since the last save) leave the watcher's window too, before this loop's verdict."""
        store = self._store()
        if store is None or not self._loaded or not self._saved_marks:
            return
        try:
            stored = self._marks_reads.get(store)
        except StoreError as exc:
            log.error("node memory unreadable", error=str(exc))
            return
        gone = {(m.gpu, m.xid) for m in self._saved_marks} - {(m.gpu, m.xid) for m in stored}
        if gone:
            xid.forget(gone)
            log.info("Xids acknowledged as dealt with", marks=sorted(gone))
        self._saved_marks = stored

    def save(
        self,
        xid: XidWatcher,
        now: float,
        throttle: ThrottleWatcher | None = None,
        prober: HealthProber | None = None,
    ) -> None:
        """The Xid counters and health window, the throttle totals and the probe streaks, each when it
        changed; the history pruned now and then."""
        store = self._store()
        if store is None or not self._loaded:
            return
        counts = xid.counts()
        marks = xid.marks()
        try:
            if throttle is not None:
                clock_events = throttle.totals()
                if clock_events != self._saved_clock_events:
                    store.replace_clock_event_totals(self.boot_id, clock_events)
                    self._saved_clock_events = clock_events
            if prober is not None:
                streaks = prober.streaks()
                if streaks != self._saved_streaks:
                    store.replace_probe_streaks(self.boot_id, streaks)
                    self._saved_streaks = streaks
            if counts != self._saved_counts:
                store.save_xid_counts(self.boot_id, counts)
                self._saved_counts = counts
            if marks != self._saved_marks:
                store.replace_xid_marks(self.boot_id, marks)
                self._saved_marks = marks
            if now - self._last_prune_seconds >= PRUNE_EVERY_SECONDS:
                self._last_prune_seconds = now
                store.prune(now - RETENTION_SECONDS)
        except StoreError as exc:
            log.error("could not save the node memory", error=str(exc))
