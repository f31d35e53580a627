"""Events from the source threads (the NVML event wait, the kernel log, the service prober) into
the loop: queued, taken once per loop (or at once, between loops), logged, and the last
`RECENT_EVENTS` kept for the status view."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

from agent.events import Event
from agent.logs import get_logger

log = get_logger()

RECENT_EVENTS = 100


class EventIntake:
    def __init__(self, wake: threading.Event) -> None:
        self.wake = wake  # set on every event: the loop reacts before its next tick
        self.recent: tuple[Event, ...] = ()
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def put(self, events: Sequence[Event]) -> None:
        for event in events:
            self._queue.put(event)
            self.wake.set()

    def take(self, more: Sequence[Event] = ()) -> list[Event]:
        """Everything queued so far, then `more` (the prober's events)."""
        events: list[Event] = []
        while True:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return events + list(more)

    def give_back(self, events: Sequence[Event]) -> None:
        """Events taken before there was a snapshot to judge them against: kept for the first loop."""
        for event in events:
            self._queue.put(event)

    def note(self, events: Sequence[Event]) -> None:
        for event in events:
            log.info(event.message, kind=event.kind.value, gpu=event.gpu, gpu_uuid=event.uuid, **_event_fields(event))
        self.recent = (*self.recent, *events)[-RECENT_EVENTS:]


def _event_fields(event: Event) -> dict[str, Any]:
    fields: dict[str, Any] = {"severity": event.severity.value, "source": event.source}
    if "xid" in event.data:
        fields["xid"] = event.data["xid"]
    return fields
