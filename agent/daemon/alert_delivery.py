"""Alertmanager traffic off the main loop: resolving the alerts a clearing event ends and
re-sending the active ones run on their own thread, so a slow or silent Alertmanager (each request
has a total deadline, but several of them add up) never delays a loop or systemd's `WATCHDOG=1`.

The queue is bounded: refreshes coalesce into one pending refresh, and beyond `MAX_PENDING`
clearing events the oldest are dropped (logged; their alerts stay active and Alertmanager resolves
them after its own `resolve_timeout`, since nothing refreshes a resolved fault's alert for long).
"""

from __future__ import annotations

import threading
from collections import deque

from agent.events import CLEARS, Event
from agent.logger import get_logger
from agent.rules.actions.alertmanager import AlertTracker

log = get_logger()

MAX_PENDING = 256
STOP_TIMEOUT_SECONDS = 2.0


class AlertDelivery:
    def __init__(self, tracker: AlertTracker, max_pending: int = MAX_PENDING) -> None:
        self.tracker = tracker
        self._clearing: deque[Event] = deque(maxlen=max_pending)
        self._refresh = False
        self._stopping = False
        self._dropped = 0
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def resolve_cleared(self, events: list[Event]) -> None:
        """Queue the clearing events among `events` (returns at once)."""
        clearing = [e for e in events if CLEARS.get(e.kind)]
        if not clearing:
            return
        with self._ready:
            room = self._clearing.maxlen or 0
            self._dropped += max(0, len(self._clearing) + len(clearing) - room)
            self._clearing.extend(clearing)
            self._ready.notify()

    def refresh(self) -> None:
        """Queue one re-send of the active alerts (a refresh already pending covers this one)."""
        with self._ready:
            self._refresh = True
            self._ready.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="alerts", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = STOP_TIMEOUT_SECONDS) -> None:
        """Stop after the request in flight; one still running past the timeout is left to its daemon thread."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def _next(self) -> tuple[list[Event], bool] | None:
        with self._ready:
            while not (self._stopping or self._clearing or self._refresh):
                self._ready.wait()
            if self._stopping:
                return None
            if self._dropped:
                log.warning("alert queue full: oldest clearing events dropped", dropped=self._dropped)
                self._dropped = 0
            clearing, refresh = list(self._clearing), self._refresh
            self._clearing.clear()
            self._refresh = False
            return clearing, refresh

    def _run(self) -> None:
        while (work := self._next()) is not None:
            clearing, refresh = work
            for event in clearing:
                try:
                    self.tracker.resolve_cleared(event)
                except Exception:  # one broken resolve must not end deliveries
                    log.exception("could not resolve the alerts of a clearing event", kind=event.kind.value)
            if refresh:
                for error in self.tracker.refresh():
                    log.warning("could not refresh an alert", error=error)
