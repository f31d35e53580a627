"""What the clock-event ("throttle") reasons mean to the agent: which are slowdowns, and a mask's names
(the bits themselves: `CLOCK_EVENT_REASONS` in agent/backend/base.py)."""

from __future__ import annotations

from agent.backend.base import CLOCK_EVENT_REASONS

#: Reasons that mean the GPU runs slower than it should (idle and app-clock settings are benign).
SLOWDOWN_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)


def decode(mask: int) -> list[str]:
    """Active reason names in bit order; unknown bits as `unknown_0x...`."""
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    if unknown:
        names.append(f"unknown_{unknown:#x}")
    return names
