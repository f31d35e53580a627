"""How often the daemon's parts run and how long the loop waits for them, and the bookkeeping of
each part's last run (the `gpu_agent_collector_*` metrics)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from agent.backend.errors import GpuError
from agent.daemon.bounded import StaleGpu
from agent.state import CollectorStatus

T = TypeVar("T")


@dataclass
class LoopTiming:
    call_timeout_seconds: float = 2.0  # one GPU's whole sample; past it the GPU is stale
    stall_loops: float = 3.0  # the watchdog stops pinging once the loop is this many intervals late
    # How long one loop waits for the policy step or for opening the backend before going on
    # without it (the work keeps running and its result is taken by a later loop). None: one
    # interval, so a slow update-initramfs or a hung nvmlInit never costs the watchdog.
    step_wait_seconds: float | None = None

    def step_wait(self, interval_seconds: float) -> float:
        if self.step_wait_seconds is not None:
            return self.step_wait_seconds
        return max(self.call_timeout_seconds, interval_seconds)

    def stall_seconds(self, interval_seconds: float) -> float:
        """How late the loop may be before it counts as stalled (watchdog, stale metrics)."""
        return self.stall_loops * interval_seconds + self.call_timeout_seconds


def due(now: float, last: float, every_seconds: float) -> bool:
    """Whether periodic work is due on the wall clock; a clock stepped backwards makes it due at once
    rather than wait for the clock to catch up with the old time (an hour without policy checks)."""
    elapsed = now - last
    return elapsed >= every_seconds or elapsed < 0


def timed(name: str, work: Callable[[], T], record: Callable[[CollectorStatus], None]) -> T:
    """`work()`, its duration and outcome recorded as the collector `name`; a failure is re-raised."""
    started = time.monotonic()
    try:
        result = work()
    except (GpuError, StaleGpu, OSError) as exc:
        record(CollectorStatus(name, False, time.monotonic() - started, str(exc)))
        raise
    record(CollectorStatus(name, True, time.monotonic() - started))
    return result
