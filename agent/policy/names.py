"""The names of the policy items: the one list every other part derives its names from.

Config keys (`policy.modes`), the backend's write guard (which setter belongs to which item),
the registry of item implementations and `gpu-agent restore` all take their names from here,
and mypy checks every literal use against these types. This module imports nothing from the
agent, so the config and the backend can use it without importing the items themselves.
"""

from __future__ import annotations

from typing import Literal, get_args

#: GPU settings the agent writes through the backend's setters.
SettableGpuItemName = Literal["power_limit", "locked_clocks", "fan_curve", "persistence", "ecc"]
#: Report-only items: the agent plans them (drift is reported) and never writes them.
ReportOnlyItemName = Literal["vbios", "driver", "next_boot"]
GpuItemName = Literal[SettableGpuItemName, "vbios"]
NodeItemName = Literal["transparent_hugepages", "triton_cache", "nouveau", "driver", "next_boot"]
ItemName = Literal[GpuItemName, NodeItemName]

#: In the order `gpu-agent plan` lists them.
GPU_ITEM_NAMES: tuple[GpuItemName, ...] = (*get_args(SettableGpuItemName), "vbios")
SETTABLE_GPU_ITEM_NAMES: tuple[SettableGpuItemName, ...] = get_args(SettableGpuItemName)
REPORT_ONLY_ITEM_NAMES: tuple[ReportOnlyItemName, ...] = get_args(ReportOnlyItemName)
NODE_ITEM_NAMES: tuple[NodeItemName, ...] = get_args(NodeItemName)
ITEM_NAMES: tuple[ItemName, ...] = (*GPU_ITEM_NAMES, *NODE_ITEM_NAMES)
