"""The boot-time clock: monotonic, counts suspend, starts at 0 each boot, and no wall-clock step moves it."""

from __future__ import annotations

import time


def boottime_seconds() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)
