"""Alertmanager alerts: posted to the v2 API, remembered until resolved (the alertmanager action
kind builds them from a decision: agent/rules/actions/kinds/alertmanager.py).

Alertmanager resolves an alert it has not heard about for `resolve_timeout` (5 m by default), so
the `AlertTracker` re-sends the active ones on `refresh()` (one request per Alertmanager, every
alert in it) and resolves them (the same labels with `endsAt`) when their condition clears.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.events import CLEARS, Event
from agent.logger import get_logger
from agent.rules.actions.base import ActionError, iso
from agent.rules.actions.http_client import post_json
from agent.rules.params import DEFAULT_HTTP_DEADLINE_SECONDS

log = get_logger()

ALERTS_API_PATH = "/api/v2/alerts"


@dataclass(frozen=True)
class Alert:
    """One Alertmanager alert; its labels are its identity."""

    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    starts_at_seconds: float

    @property
    def key(self) -> frozenset[tuple[str, str]]:
        return frozenset(self.labels.items())

    def to_json(self, ends_at_seconds: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "startsAt": iso(self.starts_at_seconds),
        }
        if ends_at_seconds is not None:
            body["endsAt"] = iso(ends_at_seconds)
        return body


def alerts_url(base_url: str) -> str:
    return base_url.rstrip("/") + ALERTS_API_PATH


def post_alert(base_url: str, alert: Alert, deadline_seconds: float = DEFAULT_HTTP_DEADLINE_SECONDS) -> None:
    post_json(alerts_url(base_url), [alert.to_json()], deadline_seconds)


def resolve_alert(
    base_url: str, alert: Alert, now_seconds: float, deadline_seconds: float = DEFAULT_HTTP_DEADLINE_SECONDS
) -> None:
    """Tell Alertmanager the alert ended now: the same labels with `endsAt`."""
    post_json(alerts_url(base_url), [alert.to_json(ends_at_seconds=now_seconds)], deadline_seconds)


class AlertTracker:
    """The alerts the agent raised and has not resolved yet, and where each went. Every request it
    makes ends within `timeout_seconds` (a total deadline, however slowly Alertmanager answers)."""

    def __init__(
        self, timeout_seconds: float = DEFAULT_HTTP_DEADLINE_SECONDS, clock: Callable[[], float] = time.time
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._active: dict[frozenset[tuple[str, str]], tuple[str, Alert]] = {}

    def fire(self, base_url: str, alert: Alert) -> Alert:
        """Post the alert (raises ActionError) and remember it; an alert already active keeps its start."""
        with self._lock:
            known = self._active.get(alert.key)
        if known is not None:
            alert = Alert(alert.labels, alert.annotations, known[1].starts_at_seconds)
        post_alert(base_url, alert, self.timeout_seconds)
        with self._lock:
            self._active[alert.key] = (base_url, alert)
        return alert

    def active(self) -> list[Alert]:
        with self._lock:
            return [alert for _, alert in self._active.values()]

    def resolve(self, match: Mapping[str, str]) -> list[Alert]:
        """Resolve every active alert whose labels include `match`; returns those resolved. One
        that could not be posted stays active and is tried again by the next call."""
        with self._lock:
            chosen = [
                (key, url, alert)
                for key, (url, alert) in self._active.items()
                if all(alert.labels.get(k) == v for k, v in match.items())
            ]
        resolved: list[Alert] = []
        for key, url, alert in chosen:
            try:
                resolve_alert(url, alert, self.clock(), self.timeout_seconds)
            except ActionError as exc:
                log.warning("could not resolve alert", alertname=alert.labels.get("alertname"), error=str(exc))
                continue
            with self._lock:
                self._active.pop(key, None)
            resolved.append(alert)
        return resolved

    def resolve_cleared(self, event: Event) -> list[Alert]:
        """Resolve the alerts a clearing event ends (SERVICE_HEALTHY ends SERVICE_UNHEALTHY for that
        service, THROTTLE_ENDED the same reason's THROTTLE_STARTED, ...: see CLEARS)."""
        cleared = CLEARS.get(event.kind)
        if not cleared:
            return []
        identity = {
            "service": event.data.get("service"),
            "uuid": event.uuid,
            "gpu": event.gpu,
            "reason": event.data.get("reason"),
        }
        match = {k: str(v) for k, v in identity.items() if v is not None and v != ""}
        resolved: list[Alert] = []
        for kind in sorted(cleared, key=lambda k: k.value):
            resolved += self.resolve({**match, "event": kind.value})
        return resolved

    def refresh(self) -> list[str]:
        """Re-send every active alert so Alertmanager does not time it out: one request per
        Alertmanager with all of its alerts, so the time it takes is bounded by the number of
        Alertmanagers, not of alerts. Returns the errors."""
        by_url: dict[str, list[dict[str, Any]]] = {}
        with self._lock:
            for url, alert in self._active.values():
                by_url.setdefault(url, []).append(alert.to_json())
        errors: list[str] = []
        for url, alerts in by_url.items():
            try:
                post_json(alerts_url(url), alerts, self.timeout_seconds)
            except ActionError as exc:
                errors.append(str(exc))
        return errors
