"""The names of the policy items: the one list every other part derives its names from.

Config keys (`policy.modes`), the backend's write guard (which setter belongs to which item),
the registry of item implementations and `gpu-agent restore` all take their names from here,
and mypy checks every literal use against these types. This module imports nothing from the
agent, so the config and the backend can use it without importing the items themselves.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final, Literal

    #: GPU settings the agent writes through the backend's setters.
    SettableGpuItemName = Literal["power_limit", "locked_clocks", "fan_curve", "persistence", "ecc"]
    #: Report-only items: the agent plans them (drift is reported) and never writes them.
    ReportOnlyItemName = Literal["vbios", "driver", "next_boot"]
    GpuItemName = Literal[SettableGpuItemName, "vbios"]
    NodeItemName = Literal["transparent_hugepages", "triton_cache", "nouveau", "driver", "next_boot"]
    ItemName = Literal[GpuItemName, NodeItemName]
    #: Not a policy item: the permission to reset GPUs, granted only in enforce mode (remediation). It
    #: sits beside the items because the backend's write guard holds it with them.
    GpuResetName = Literal["gpu_reset"]

# The same names as plain tuples, which need no `typing` (`gpu-agent status` imports this module,
# and typing is a tenth of its start): mypy checks each against the types above, and
# tests/policy/test_names.py that each type and its tuple hold the same names.
#: In the order `gpu-agent plan` lists them.
SETTABLE_GPU_ITEM_NAMES: tuple[SettableGpuItemName, ...] = (
    "power_limit",
    "locked_clocks",
    "fan_curve",
    "persistence",
    "ecc",
)
REPORT_ONLY_ITEM_NAMES: tuple[ReportOnlyItemName, ...] = ("vbios", "driver", "next_boot")
GPU_ITEM_NAMES: tuple[GpuItemName, ...] = (*SETTABLE_GPU_ITEM_NAMES, "vbios")
NODE_ITEM_NAMES: tuple[NodeItemName, ...] = ("transparent_hugepages", "triton_cache", "nouveau", "driver", "next_boot")
ITEM_NAMES: tuple[ItemName, ...] = (*GPU_ITEM_NAMES, *NODE_ITEM_NAMES)
GPU_RESET_ITEM: Final[GpuResetName] = "gpu_reset"

#: The names other parts compare plans and writable items against (mypy checks each against the lists above).
POWER_LIMIT: Final[SettableGpuItemName] = "power_limit"
LOCKED_CLOCKS: Final[SettableGpuItemName] = "locked_clocks"
FAN_CURVE: Final[SettableGpuItemName] = "fan_curve"
DRIVER: Final[NodeItemName] = "driver"
NEXT_BOOT: Final[NodeItemName] = "next_boot"

_LITERAL_NAMES = {
    "SettableGpuItemName": SETTABLE_GPU_ITEM_NAMES,
    "ReportOnlyItemName": REPORT_ONLY_ITEM_NAMES,
    "GpuItemName": GPU_ITEM_NAMES,
    "NodeItemName": NODE_ITEM_NAMES,
    "ItemName": ITEM_NAMES,
    "GpuResetName": (GPU_RESET_ITEM,),
}


def __getattr__(name: str) -> object:
    """The Literal types at run time (the config's pydantic models validate against them), made
    from the tuples when first asked for."""
    if name not in _LITERAL_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from typing import Literal

    made = Literal[_LITERAL_NAMES[name]]  # type: ignore[valid-type]
    globals()[name] = made
    return made
