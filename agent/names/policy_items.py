"""The names of the policy items: the one list every other part derives its names from.

Config keys (`policy.modes`), the backend's write guard (which setter belongs to which item),
the registry of item implementations and `gpu-agent restore` all take their names from here,
and mypy checks every literal use against these types. Each list is written once, as its Literal
type; the tuples are read from the types. This module imports nothing from the agent, so the config
and the backend can use it without importing the items themselves. It is no part of the fast start
(agent/cli/fast_start.py): it loads `typing`.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

#: GPU settings the agent writes through the backend's setters, in the order `gpu-agent plan` lists them.
SettableGpuItemName = Literal["power_limit", "locked_clocks", "fan_curve", "persistence", "ecc"]
#: Report-only items: the agent plans them (drift is reported) and never writes them.
ReportOnlyItemName = Literal["vbios", "driver", "next_boot"]
GpuItemName = Literal[SettableGpuItemName, "vbios"]
NodeItemName = Literal["transparent_hugepages", "triton_cache", "nouveau", "driver", "next_boot"]
ItemName = Literal[GpuItemName, NodeItemName]
#: Not a policy item: the permission to reset GPUs, granted only in enforce mode (remediation). It
#: sits beside the items because the backend's write guard holds it with them.
GpuResetName = Literal["gpu_reset"]

SETTABLE_GPU_ITEM_NAMES: Final[tuple[SettableGpuItemName, ...]] = get_args(SettableGpuItemName)
REPORT_ONLY_ITEM_NAMES: Final[tuple[ReportOnlyItemName, ...]] = get_args(ReportOnlyItemName)
GPU_ITEM_NAMES: Final[tuple[GpuItemName, ...]] = get_args(GpuItemName)
NODE_ITEM_NAMES: Final[tuple[NodeItemName, ...]] = get_args(NodeItemName)
ITEM_NAMES: Final[tuple[ItemName, ...]] = get_args(ItemName)
GPU_RESET_ITEM: Final[GpuResetName] = "gpu_reset"

#: The names other parts compare plans and writable items against (mypy checks each against the lists above).
POWER_LIMIT: Final[SettableGpuItemName] = "power_limit"
LOCKED_CLOCKS: Final[SettableGpuItemName] = "locked_clocks"
FAN_CURVE: Final[SettableGpuItemName] = "fan_curve"
DRIVER: Final[NodeItemName] = "driver"
NEXT_BOOT: Final[NodeItemName] = "next_boot"
