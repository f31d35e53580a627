"""systemd's watchdog: WATCHDOG=1 only while the loop keeps completing, so a wedged loop (a
deadlock, a hung call outside the bounded lanes) gets the agent restarted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from agent.daemon.sd_notify import SdNotifier
from agent.logger import get_logger

log = get_logger()


class Watchdog:
    def __init__(self, notifier: SdNotifier, stall_seconds: Callable[[], float], stop: threading.Event) -> None:
        self.notifier = notifier
        self.stall_seconds = stall_seconds  # how late the loop may be (follows a reloaded interval)
        self.stop = stop
        self.heartbeat_seconds = time.monotonic()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """A loop completed."""
        self.heartbeat_seconds = time.monotonic()

    def loop_healthy(self) -> bool:
        return time.monotonic() - self.heartbeat_seconds <= self.stall_seconds()

    def start(self) -> None:
        """Ping at half the period systemd asked for, if it asked (WATCHDOG_USEC)."""
        period = self.notifier.watchdog_seconds
        if period is None:
            return
        self._thread = threading.Thread(target=self._ping, args=(period / 2,), name="watchdog", daemon=True)
        self._thread.start()

    def _ping(self, period_seconds: float) -> None:
        while not self.stop.wait(period_seconds):
            if self.loop_healthy():
                self.notifier.watchdog()
            else:
                log.error("main loop stalled: withholding watchdog pings so systemd restarts the agent")
