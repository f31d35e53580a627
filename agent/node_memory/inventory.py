"""The boot a node memory belongs to, and a loop's samples as the memory sees them: the GPUs it
remembers that did not answer added (down, read as lost), the acknowledged ones that still do not
answer left out, and the inventory rows that need writing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from agent.backend.errors import GpuErrorKind
from agent.host.paths import HostPaths
from agent.state import GpuSample
from agent.store.boot_tables import InventoryGpu

UNKNOWN_BOOT = "unknown"  # no boot id readable: one memory for every boot (a reboot is not seen)
LAST_SEEN_EVERY_SECONDS = 60.0  # how stale an answering GPU's stored last_seen may get
MISSING_READ_ERROR = "inventory"  # read_errors key of a remembered GPU that was not enumerated


def read_boot_id(paths: HostPaths) -> str:
    """The boot this memory belongs to; UNKNOWN_BOOT where no boot id can be read."""
    return paths.boot_id() or UNKNOWN_BOOT


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
