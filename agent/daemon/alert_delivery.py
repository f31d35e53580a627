"""The agent's alerts to Alertmanager, off the main loop: a thread sends what the push book holds
(agent/daemon/alert_book.py) to every Alertmanager, one request each with all of its alerts, so a slow or
silent one (each request has a total deadline) never delays a loop or systemd's `WATCHDOG=1`.

It sends at once when an alert fired or resolved (`poke`), every REFRESH_SECONDS anyway (a firing
alert's `endsAt` lies FIRING_VALIDITY_SECONDS ahead, and must keep moving), and again after a failed
request, backing off from RETRY_FIRST_SECONDS to REFRESH_SECONDS, per Alertmanager. Its last round
is the `alerts` collector of `/metrics` and `gpu-agent status` (GpuAgentCollectorFailing when an
Alertmanager keeps refusing).
"""

from __future__ import annotations

import threading
import time

from agent.daemon.alert_book import PushBook
from agent.logs import get_logger
from agent.rules.actions.base import ActionError
from agent.rules.actions.http_client import post_json, redacted_url
from agent.rules.params import DEFAULT_HTTP_DEADLINE_SECONDS
from agent.state import CollectorStatus

log = get_logger()

ALERTS_API_PATH = "/api/v2/alerts"
REFRESH_SECONDS = 60.0
RETRY_FIRST_SECONDS = 1.0
STOP_TIMEOUT_SECONDS = 2.0


def alerts_url(base_url: str) -> str:
    return base_url.rstrip("/") + ALERTS_API_PATH


class AlertDelivery:
    def __init__(self, book: PushBook, timeout_seconds: float = DEFAULT_HTTP_DEADLINE_SECONDS) -> None:
        self.book = book
        self.timeout_seconds = timeout_seconds
        self.status: CollectorStatus | None = None  # None before the first round
        self._next_monotonic: dict[str, float] = {}  # per Alertmanager: when it is due
        self._backoff: dict[str, float] = {}
        self._poked = False
        self._stopping = False
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def poke(self) -> None:
        """An alert fired or resolved: every Alertmanager hears it at the next round, now (returns at once)."""
        with self._ready:
            self._poked = True
            self._next_monotonic = dict.fromkeys(self._next_monotonic, 0.0)
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

    def _wait(self) -> bool:
        """Until poked, stopped, an Alertmanager is due, or REFRESH_SECONDS passed; False when stopping."""
        with self._ready:
            idle_until = time.monotonic() + REFRESH_SECONDS
            while not self._stopping and not self._poked:
                wake = min(self._next_monotonic.values(), default=idle_until)
                if wake <= time.monotonic():
                    break
                self._ready.wait(wake - time.monotonic())
            self._poked = False
            return not self._stopping

    def _run(self) -> None:
        while self._wait():
            try:
                self.deliver()
            except Exception:  # one broken round must not end deliveries
                log.exception("alert delivery failed unexpectedly")

    def deliver(self) -> None:
        """One round: every Alertmanager that is due gets what it should hear now."""
        started = time.monotonic()
        errors: list[str] = []
        payloads = self.book.payloads()
        for url in set(self._next_monotonic) - set(payloads):
            del self._next_monotonic[url]  # nothing left for it
        for url, alerts in payloads.items():
            if self._next_monotonic.get(url, 0.0) > time.monotonic():
                continue
            try:
                post_json(alerts_url(url), [body for _, body in alerts], self.timeout_seconds)
            except ActionError as exc:
                errors.append(str(exc))
                backoff = min(self._backoff.get(url, RETRY_FIRST_SECONDS / 2) * 2, REFRESH_SECONDS)
                self._backoff[url] = backoff
                self._next_monotonic[url] = time.monotonic() + backoff
                log.warning("could not deliver alerts", alertmanager=redacted_url(url), error=str(exc), retry=backoff)
                continue
            self._backoff.pop(url, None)
            self._next_monotonic[url] = time.monotonic() + REFRESH_SECONDS
            self.book.delivered(url, [key for key, _ in alerts])
        if payloads:
            self.status = CollectorStatus("alerts", not errors, time.monotonic() - started, "; ".join(errors)[:300])
