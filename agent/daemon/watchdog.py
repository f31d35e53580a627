"""systemd's watchdog: WATCHDOG=1 only while the loop keeps completing, so a wedged loop (a
deadlock, a hung call outside the bounded lanes) gets the agent restarted."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from agent.logs import get_logger

if TYPE_CHECKING:
    from agent.daemon.live import Live

log = get_logger()


class Watchdog:
    """Reads of the daemon's live parts (agent/daemon/live.py): systemd's notifier, the stop flag,
    and the loop's interval of the moment (how late the loop may be follows a reloaded interval)."""

    def __init__(self, *, live: Live) -> None:
        self.live = live
        self.heartbeat_seconds = time.monotonic()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """A loop completed."""
        self.heartbeat_seconds = time.monotonic()

    def loop_healthy(self) -> bool:
        live = self.live
        return time.monotonic() - self.heartbeat_seconds <= live.timing.stall_seconds(live.config.interval_seconds)

    def start(self) -> None:
        """Ping at half the period systemd asked for, if it asked (WATCHDOG_USEC)."""
        period = self.live.publisher.notifier.watchdog_seconds
        if period is None:
            return
        self._thread = threading.Thread(target=self._ping, args=(period / 2,), name="watchdog", daemon=True)
        self._thread.start()

    def _ping(self, period_seconds: float) -> None:
        while not self.live.stop_requested.wait(period_seconds):
            if self.loop_healthy():
                self.live.publisher.notifier.watchdog()
            else:
                log.error("main loop stalled: withholding watchdog pings so systemd restarts the agent")
