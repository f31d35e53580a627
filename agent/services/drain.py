"""Waiting for a server to finish its requests before it is stopped (services[].drain).

The drain hook (run by the action, agent.rules.actions.service_actions) tells the world to stop
sending requests; then `wait_until_idle` reads the server's own running-requests gauge
(`vllm:num_requests_running`, `sglang:num_running_reqs`, through agent.services.scrape: one scrape
at a time, each with its deadline, that reads that family alone, so a page whose other families are
past their bounds is still read) until it reads 0 or the time is up. A server whose page cannot be
read is not waited on, whatever went wrong (its scrape's one error, ScrapeError): one that cannot
answer /metrics is not serving requests either, and the restart that follows is what it needs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from agent.config.service_entry import ServiceConfig
from agent.services.scrape import DEFAULT_MAX_BYTES, ScrapeError, scrape

DrainOutcome = Literal["idle", "timed_out", "unreadable", "cancelled"]


@dataclass(frozen=True)
class DrainWait:
    outcome: DrainOutcome
    waited_seconds: float
    running: float | None  # the last reading of the running-requests gauge
    detail: str = ""  # why the gauge could not be read

    def describe(self, service: str) -> str:
        waited = f"{self.waited_seconds:.1f} s"
        if self.outcome == "idle":
            return f"{service} drained: no request running after {waited}"
        if self.outcome == "timed_out":
            return f"{service} still running {self.running:g} request(s) when its drain timed out after {waited}"
        if self.outcome == "cancelled":
            return f"agent stopping: drain of {service} cut short after {waited}"
        return f"{service}'s running requests unreadable ({self.detail}): not waited on"


def wait_until_idle(
    service: ServiceConfig,
    timeout_seconds: float,
    *,
    monotonic: Callable[[], float],
    sleep: Callable[[float], None],
    cancel: threading.Event,
    poll_seconds: float,
) -> DrainWait:
    """Poll the server's running-requests gauge until 0, the timeout, or `cancel`; the timeout runs
    on `monotonic` (a monotonic clock: a wall-clock step neither holds the restart nor cuts the drain)."""
    url = service.effective_metrics_url
    began = monotonic()
    deadline = began + timeout_seconds
    running: float | None = None
    while True:
        now = monotonic()
        left = deadline - now
        if url is None:
            return DrainWait("unreadable", now - began, None, "no metrics URL")
        # The last reading, at the deadline, still gets a real chance to answer (up to 1 s past it):
        # "still running N requests" is what the operator needs to read, not a scrape cut at 0 s.
        scrape_seconds = max(min(service.probe_timeout_seconds, left), min(service.probe_timeout_seconds, 1.0))
        try:
            reading = scrape(url, service.kind, scrape_seconds, DEFAULT_MAX_BYTES, figures=("running",))
        except ScrapeError as exc:
            return DrainWait("unreadable", monotonic() - began, running, str(exc))
        running = reading.running
        now = monotonic()
        if running is None:
            return DrainWait("unreadable", now - began, None, "no running-requests gauge on its page")
        if running <= 0:
            return DrainWait("idle", now - began, running)
        if now >= deadline:
            return DrainWait("timed_out", now - began, running)
        if cancel.is_set():
            return DrainWait("cancelled", now - began, running)
        sleep(min(poll_seconds, deadline - now))
