"""Probing the health of the inference services.

`HealthProber` GETs each service's `health_url` (200-299 = healthy, anything else, a refused
connection or no answer within `probe_timeout_seconds` = a failed probe); with `probe: generate`
it sends the server's cheapest real request instead (`agent.services.generate_probe`). After
`unhealthy_after_probes` consecutive failures the service is declared unhealthy; one success
declares it healthy again. SERVICE_UNHEALTHY and SERVICE_HEALTHY events are emitted on those
transitions only (collect them with `take_events()`), so a service that stays down is one fault,
not one event per probe. A service without a health URL is probed by asking its manager whether
it runs (`systemctl is-active`, or the `status_command`). The declared states and streaks
survive an agent restart on the same boot (`streaks`/`restore`, kept by agent/daemon/node_memory.py): a restart
mid-outage neither starts the count again nor reports the outage a second time.

While the agent itself restarts a service (`expect_down`, `wait_healthy`), failed probes are not
counted: the agent must not report, and a rule must not act on, an outage it caused on purpose,
which would otherwise turn one restart into a restart storm while the model loads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agent.config.service_entry import ServiceConfig
from agent.events import Event, EventKind, Severity, SuggestedAction
from agent.host import http_read
from agent.logs import get_logger
from agent.services.generate_probe import generate_probe
from agent.services.managers import ServiceError, ServiceManager
from agent.state import ProbeStreak, ServiceStatus

log = get_logger()

#: How often `wait_healthy` probes at most: a restarted server should be seen as soon as it answers.
READY_POLL_SECONDS = 1.0
_BODY_READ_BYTES = 4096


# -- health probing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    service: str
    ok: bool
    latency_seconds: float | None  # None when the probe asked the manager instead of HTTP
    detail: str  # "HTTP 200", "HTTP 503", "timed out after 2 s", "connection refused", ...
    timestamp_seconds: float


@dataclass
class _Tracked:
    service: ServiceConfig
    up: bool | None = None  # the declared state; None until the first verdict
    consecutive_failures: int = 0
    last_latency_seconds: float | None = None
    detail: str = ""
    expected_down_until: float = 0.0  # on the prober's monotonic clock


def http_probe(url: str, timeout_seconds: float) -> tuple[bool, str]:
    """GET url within `timeout_seconds` in all (connect, headers, body): (healthy, what happened).
    The local server itself is asked, never a proxy; a redirect is an answer, not followed."""
    try:
        answer = http_read.get(url, timeout_seconds, _BODY_READ_BYTES, truncate=True)
    except http_read.HttpReadError as exc:
        return False, exc.detail
    return 200 <= answer.status < 300, f"HTTP {answer.status}"


class HealthProber:
    """Probes the configured services and keeps their declared state (see the module docstring)."""

    def __init__(
        self,
        services: Sequence[ServiceConfig],
        managers: Mapping[str, ServiceManager] | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.managers = dict(managers or {})
        self.clock = clock  # wall time: when a probe ran, in its result and events
        self.sleep = sleep
        self.monotonic = monotonic  # `wait_healthy`'s deadline and `expect_down`'s window
        self._lock = threading.Lock()
        self._tracked = {s.name: _Tracked(s) for s in services}
        self._events: list[Event] = []
        #: Called (from a probe thread) when a transition event is ready: the daemon wakes its loop.
        self.on_event: Callable[[], None] | None = None

    def names(self) -> list[str]:
        return list(self._tracked)

    def service(self, name: str) -> ServiceConfig:
        return self._tracked[name].service

    def can_probe(self, name: str) -> bool:
        """A health URL, or a manager that can tell whether the service runs."""
        tracked = self._tracked.get(name)
        if tracked is None:
            return False
        if tracked.service.health_url is not None:
            return True
        if name not in self.managers:
            return False
        return tracked.service.manager == "systemd" or tracked.service.status_command is not None

    def probe_once(self, name: str) -> ProbeResult:
        """Probe one service now, update its declared state, queue an event on a transition."""
        service = self._tracked[name].service
        if service.health_url is not None:
            started = time.monotonic()
            try:
                if service.probe == "generate" and service.origin is not None:
                    ok, detail = generate_probe(service.origin, service.kind, service.probe_timeout_seconds)
                else:
                    ok, detail = http_probe(service.health_url, service.probe_timeout_seconds)
            except Exception as exc:  # whatever the answer did to the probe, it is a failed probe, counted
                log.exception("service probe crashed", service=name)
                ok, detail = False, f"unreadable answer: {type(exc).__name__}"
            latency: float | None = time.monotonic() - started
        else:
            latency = None
            manager = self.managers.get(name)
            if manager is None:
                raise ValueError(f"service {name} has no health_url and no manager to ask")
            try:
                active = manager.is_active(service)
            except ServiceError as exc:
                active, detail = False, str(exc)
            else:
                if active is None:
                    raise ValueError(f"service {name} has no health_url and its manager cannot tell if it runs")
                detail = "active" if active else "not active"
            ok = bool(active)
        result = ProbeResult(name, ok, latency, detail, self.clock())
        self._record(result)
        return result

    def _record(self, result: ProbeResult) -> None:
        before = len(self._events)
        self._record_locked(result)
        if len(self._events) != before and self.on_event is not None:
            self.on_event()

    def _record_locked(self, result: ProbeResult) -> None:
        with self._lock:
            tracked = self._tracked[result.service]
            tracked.last_latency_seconds = result.latency_seconds
            if result.ok:
                tracked.consecutive_failures = 0
                tracked.expected_down_until = 0.0
                tracked.detail = result.detail
                if tracked.up is False:
                    self._events.append(self._event(tracked, EventKind.SERVICE_HEALTHY, result))
                tracked.up = True
                return
            if self.monotonic() < tracked.expected_down_until:
                tracked.detail = f"restart in progress: {result.detail}"
                return
            tracked.consecutive_failures += 1
            tracked.detail = result.detail
            if tracked.up is not False and tracked.consecutive_failures >= tracked.service.unhealthy_after_probes:
                tracked.up = False
                self._events.append(self._event(tracked, EventKind.SERVICE_UNHEALTHY, result))

    @staticmethod
    def _event(tracked: _Tracked, kind: EventKind, result: ProbeResult) -> Event:
        service = tracked.service
        how = service.health_url or f"{service.manager} manager"
        if kind is EventKind.SERVICE_UNHEALTHY:
            severity = Severity.CRITICAL
            failures = tracked.consecutive_failures
            message = f"service {service.name} unhealthy: {failures} failed probes of {how} ({result.detail})"
            action = SuggestedAction.RESTART_SERVICE
        else:
            severity = Severity.INFO
            message = f"service {service.name} healthy again ({how}: {result.detail})"
            action = SuggestedAction.NONE
        return Event(
            kind=kind,
            severity=severity,
            gpu=None,
            uuid=None,
            message=message,
            timestamp_seconds=result.timestamp_seconds,
            source="probe",
            key=f"{kind.value}:{service.name}",
            data={
                "service": service.name,
                "unit": service.shown_unit,
                "health_url": service.health_url,
                "consecutive_failures": tracked.consecutive_failures,
                "detail": result.detail,
                "latency_seconds": result.latency_seconds,
            },
            suggested_action=action,
        )

    def take_events(self) -> list[Event]:
        """The transition events since the last call (oldest first)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def statuses(self) -> list[ServiceStatus]:
        with self._lock:
            return [
                ServiceStatus(
                    name=t.service.name,
                    unit=t.service.shown_unit,
                    up=t.up,
                    consecutive_failures=t.consecutive_failures,
                    last_latency_seconds=t.last_latency_seconds,
                    detail=t.detail,
                )
                for t in self._tracked.values()
            ]

    def streaks(self) -> list[ProbeStreak]:
        """Each service's declared state and failure streak, for the store."""
        with self._lock:
            return [ProbeStreak(name, t.up, t.consecutive_failures) for name, t in self._tracked.items()]

    def restore(self, streaks: list[ProbeStreak]) -> None:
        """The streaks an earlier run of the agent on this boot left, so `unhealthy_after_probes` counts
        on across a restart mid-outage and a service declared down stays down until a probe succeeds.
        A service without a verdict in this run yet (only failures, or no probe) takes the stored
        verdict, and its failures add to the stored streak; one this run has judged keeps its own."""
        with self._lock:
            for stored in streaks:
                tracked = self._tracked.get(stored.service)
                if tracked is None or tracked.up is not None:
                    continue
                tracked.up = stored.up
                tracked.consecutive_failures += stored.consecutive_failures

    def expect_down(self, name: str, seconds: float) -> None:
        """The agent is taking the service down on purpose: do not count failed probes for a while.

        A successful probe ends the window early; `seconds=0` ends it now.
        """
        with self._lock:
            self._tracked[name].expected_down_until = self.monotonic() + seconds

    def wait_healthy(self, name: str, timeout_seconds: float) -> ProbeResult:
        """Probe until the service answers or the time is up; the last probe says which.

        Failures while waiting are expected (the server is loading) and are not counted.
        """
        service = self._tracked[name].service
        deadline = self.monotonic() + timeout_seconds
        self.expect_down(name, timeout_seconds)
        poll_seconds = min(service.probe_interval_seconds, READY_POLL_SECONDS)
        while True:
            result = self.probe_once(name)
            remaining = deadline - self.monotonic()
            if result.ok or remaining <= 0:
                return result
            self.sleep(min(poll_seconds, remaining))


class ProberThread:
    """Probes every probeable service at its own interval, one thread per service, so a hanging
    server delays nobody else's probes. `stop()` returns within one probe timeout."""

    def __init__(self, prober: HealthProber) -> None:
        self.prober = prober
        self._stop = threading.Event()
        self._threads = {
            name: threading.Thread(target=self._loop, args=(name,), name=f"probe-{name}", daemon=True)
            for name in prober.names()
            if prober.can_probe(name)
        }

    def start(self) -> None:
        for thread in self._threads.values():
            thread.start()

    def _loop(self, name: str) -> None:
        interval = self.prober.service(name).probe_interval_seconds
        while not self._stop.is_set():
            try:
                self.prober.probe_once(name)
            except Exception:  # a probe bug must not end the probing of this service for good
                log.exception("service probe failed", service=name)
            self._stop.wait(interval)

    def stop(self) -> None:
        self._stop.set()
        for name, thread in self._threads.items():
            if thread.is_alive():
                thread.join(self.prober.service(name).probe_timeout_seconds + 1.0)
