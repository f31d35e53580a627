"""Every policy item implementation, keyed by its name in `agent.names.policy_items`.

The names module decides which items exist and their order; this module pairs each name with
its implementation and fails at import if one is missing or misnamed, so a new item cannot be
half-registered. mypy checks each implementation against its protocol.
"""

from __future__ import annotations

from typing import Any

from agent.names.policy_items import GPU_ITEM_NAMES, NODE_ITEM_NAMES, GpuItemName, NodeItemName
from agent.policy import (
    driver,
    ecc,
    fan_curve,
    locked_clocks,
    next_boot,
    nouveau,
    persistence,
    power_limit,
    thp,
    triton_cache,
    vbios,
)
from agent.policy.item import GpuItem, NodeItem, RestorableGpuItem

_GPU: dict[GpuItemName, GpuItem[Any, Any]] = {
    item.name: item
    for item in (power_limit.ITEM, locked_clocks.ITEM, fan_curve.ITEM, persistence.ITEM, ecc.ITEM, vbios.ITEM)
}
_NODE: dict[NodeItemName, NodeItem[Any, Any]] = {
    item.name: item for item in (thp.ITEM, triton_cache.ITEM, nouveau.ITEM, driver.ITEM, next_boot.ITEM)
}

#: In the order of `GPU_ITEM_NAMES`: how `gpu-agent plan` lists them.
GPU_ITEMS: tuple[GpuItem[Any, Any], ...] = tuple(_GPU.pop(name) for name in GPU_ITEM_NAMES)
NODE_ITEMS: tuple[NodeItem[Any, Any], ...] = tuple(_NODE.pop(name) for name in NODE_ITEM_NAMES)
if _GPU or _NODE:
    raise ImportError(f"policy items without a name in agent.names.policy_items: {sorted([*_GPU, *_NODE])}")

#: What `gpu-agent restore` resets, fans first: a fan left at a fixed low speed is the failure
#: restore exists to prevent.
RESTORABLE_ITEMS: tuple[RestorableGpuItem[Any, Any], ...] = (fan_curve.ITEM, locked_clocks.ITEM, power_limit.ITEM)
RESTORABLE_NAMES: frozenset[GpuItemName] = frozenset(item.name for item in RESTORABLE_ITEMS)
