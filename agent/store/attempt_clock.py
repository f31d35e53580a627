"""The clock cooldowns and attempt windows are measured with: it survives restarts and never counts
a step of the wall clock backwards as time elapsed.

Every journaled attempt keeps three readings: the wall time (the persisted reference, what people
read), the boot id and CLOCK_BOOTTIME (monotonic within one boot, counting suspend too). Between
two readings of one boot the elapsed time is the boottime difference, whatever NTP or an operator
did to the wall clock meanwhile. Across a reboot only the wall clock relates the two, and a wall
time earlier than the attempt counts as no time elapsed: a clock stepped back cannot skip a cooldown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent.host.boottime import boottime_seconds


@dataclass(frozen=True)
class ClockReading:
    wall_seconds: float
    boot_id: str  # "" when unknown: never taken for the same boot
    boottime_seconds: float | None  # CLOCK_BOOTTIME; None when unknown (rows written before the journal)


def elapsed_seconds(then: ClockReading, now: ClockReading) -> float:
    """Time from `then` to `now`, never negative."""
    same_boot = bool(then.boot_id) and then.boot_id == now.boot_id
    if same_boot and then.boottime_seconds is not None and now.boottime_seconds is not None:
        return max(0.0, now.boottime_seconds - then.boottime_seconds)
    return max(0.0, now.wall_seconds - then.wall_seconds)


def effective_wall_seconds(then: ClockReading, now: ClockReading) -> float:
    """`then` placed on the current wall clock: now minus the time really elapsed since. What the rules
    engine compares with its `now` (cooldown, window), so a stepped clock moves both together."""
    return now.wall_seconds - elapsed_seconds(then, now)


class AttemptClock:
    """Readings for the journal: `boottime` and `boot_id` are injectable (tests: a FakeClock's monotonic)."""

    def __init__(self, boot_id: str, boottime: Callable[[], float] = boottime_seconds) -> None:
        self.boot_id = boot_id
        self.boottime = boottime

    def reading(self, wall_seconds: float) -> ClockReading:
        return ClockReading(wall_seconds, self.boot_id, self.boottime())
