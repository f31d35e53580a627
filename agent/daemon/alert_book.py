"""The alerts the agent pushes to Alertmanager: each is an alert of the catalogue that the agent's own
verdict holds now (agent/daemon/alert_found.py finds them), firing while it holds and resolved (`endsAt`)
when it no longer does (the fault fixed, acknowledged, or gone), sent to every Alertmanager of
`remediation.alertmanager_url` and retried until each has it (agent/daemon/alert_delivery.py).

An alert waits its `for` (the catalogue's, or `alerts.for_seconds`) before it fires, as a Prometheus
rule does, unless a rule's `alertmanager` step raised it: then it fires at once. The book is kept in the
store, so a restarted agent goes on where it was: an alert still holding keeps its start (no second
page), one pending keeps its `for` on the same boot, a resolution not yet delivered is delivered. For
`SETTLE_SECONDS` after a restart an alert from the store that does not hold yet is not resolved: the
first loops have not seen everything the last run had (a probe streak, a scrape window).

Durations run on CLOCK_BOOTTIME; `startsAt`/`endsAt` are wall time, as Alertmanager reads them.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.events import iso_utc
from agent.host.boottime import boottime_seconds
from agent.logs import get_logger
from agent.store.alerts import AlertRow, AlertTables
from agent.store.db import StoreError

log = get_logger()

#: How long a rule's raise waits for its alert to hold (the verdict follows the event within a loop or two).
RAISE_SECONDS = 120.0
#: After a restart, how long an alert from the store may not hold before it is resolved.
SETTLE_SECONDS = 30.0
#: A firing push tells Alertmanager it holds this long (`endsAt`): an agent that dies leaves its alerts
#: firing for as long as Prometheus keeps a silent node's, then Alertmanager resolves them itself.
FIRING_VALIDITY_SECONDS = 600.0


@dataclass(frozen=True)
class Found:
    """An alert the agent's verdict holds now: its whole label set and its text."""

    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    for_seconds: float


@dataclass(frozen=True)
class _Raise:
    names: frozenset[str]
    match: Mapping[str, str]
    url: str | None
    overrides: Mapping[str, str]
    until: float  # CLOCK_BOOTTIME


def alert_key(labels: Mapping[str, str]) -> str:
    """An alert's identity: its labels, as Alertmanager's fingerprint is."""
    return json.dumps(sorted(labels.items()))


@dataclass
class _Changes:
    rows: dict[str, AlertRow] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)
    news: bool = False  # an alert fired or resolved: Alertmanager should hear it now

    def put(self, row: AlertRow) -> AlertRow:
        self.rows[row.key] = row
        self.gone.discard(row.key)
        return row

    def drop(self, key: str) -> None:
        self.rows.pop(key, None)
        self.gone.add(key)


class PushBook:
    """Thread-safe: the loop updates it, the delivery thread reads and acknowledges what it sent, the
    action worker raises alerts."""

    def __init__(
        self,
        store: Callable[[], AlertTables | None] = lambda: None,
        boot_id: str = "",
        clock: Callable[[], float] = time.time,
        boottime: Callable[[], float] = boottime_seconds,
    ) -> None:
        self._store = store
        self.boot_id = boot_id
        self._clock = clock
        self.monotonic = boottime  # CLOCK_BOOTTIME: what `for` and the settling are measured on
        self._lock = threading.Lock()
        self._alerts: dict[str, AlertRow] = {}
        self._raises: list[_Raise] = []
        self._urls: tuple[str, ...] = ()
        self._loaded = False
        self._resend = False
        self._settle_until: float | None = None

    # -- what changes it ------------------------------------------------------------------------

    def raise_alerts(
        self,
        names: Iterable[str],
        match: Mapping[str, str],
        url: str | None = None,
        overrides: Mapping[str, str] | None = None,
    ) -> None:
        """Fire the alerts of these names that agree with `match` as soon as the verdict holds them,
        without their `for` (a rule's step: this fault pages now); to `url` too when given, with
        `overrides` over their annotations."""
        with self._lock:
            self._raises.append(
                _Raise(frozenset(names), dict(match), url, dict(overrides or {}), self.monotonic() + RAISE_SECONDS)
            )

    def wanted(self, urls: tuple[str, ...]) -> bool:
        """Whether alerts need finding: there is an Alertmanager, a raise waits, or an alert is kept."""
        self._load()
        with self._lock:
            return bool(urls or self._raises or self._alerts)

    def update(self, found: Iterable[Found], urls: tuple[str, ...]) -> bool:
        """This loop's alerts. Returns whether one fired or resolved (to be delivered now)."""
        self._load()
        now, tick = self._clock(), self.monotonic()
        changes = _Changes()
        with self._lock:
            self._urls = urls
            self._raises = [r for r in self._raises if r.until >= tick]
            held = {self._hold(alert, changes, now, tick) for alert in found}
            settling = self._settle_until is not None and tick < self._settle_until
            for key, row in list(self._alerts.items()):
                if key in held or settling:
                    continue
                if row.starts_at is None:
                    changes.drop(key)  # pending, never fired: nobody heard of it
                elif row.ends_at is None:
                    changes.put(replace(row, ends_at=now, delivered=()))
                    changes.news = True
                elif now - row.ends_at > FIRING_VALIDITY_SECONDS:
                    changes.drop(key)  # Alertmanager has timed it out by itself
            self._apply(changes)
            news, self._resend = changes.news or self._resend, False
        return news

    def _hold(self, alert: Found, changes: _Changes, now: float, tick: float) -> str:
        """`alert` holds now: pending, fired once its `for` has passed (or a raise asked), kept firing."""
        key = alert_key(alert.labels)
        raises = [r for r in self._raises if alert.name in r.names and _includes(alert.labels, r.match)]
        current = self._alerts.get(key)
        if current is not None and current.ends_at is not None:
            current = None  # resolved, and holds again: a new alert
        extra = {r.url for r in raises if r.url} | set(current.urls if current else ())
        if not self._urls and not extra:
            return key  # nowhere to push it: not kept
        overrides = {**(current.overrides if current else {}), **{k: v for r in raises for k, v in r.overrides.items()}}
        row = current or AlertRow(key, dict(alert.labels), {}, self.boot_id, tick, None, None, False, {}, ())
        if row.starts_at is None and row.boot_id != self.boot_id:
            row = replace(row, boot_id=self.boot_id, pending_since=tick)  # its `for` started on another boot
        row = replace(
            row,
            annotations={**alert.annotations, **overrides},
            raised=row.raised or bool(raises),
            overrides=overrides,
            urls=tuple(sorted(extra)),
        )
        pending_since = tick if row.pending_since is None else row.pending_since
        if row.starts_at is None and (row.raised or tick - pending_since >= alert.for_seconds):
            row = replace(row, starts_at=now)
            changes.news = True
        if row != self._alerts.get(key):
            changes.put(row)
        return key

    def _apply(self, changes: _Changes) -> None:
        """Into the book and the store (a store that fails keeps the book; the next change writes again)."""
        self._alerts.update(changes.rows)
        for key in changes.gone:
            self._alerts.pop(key, None)
        if not changes.rows and not changes.gone:
            return
        store = self._store()
        if store is None:
            return
        try:
            store.save_pushed_alerts(changes.rows.values(), changes.gone)
        except StoreError as exc:
            log.error("could not keep the pushed alerts", error=str(exc))

    def _load(self) -> None:
        """Once, when the store is there: the alerts an earlier run left."""
        if self._loaded:
            return
        store = self._store()
        if store is None:
            return
        try:
            rows = store.pushed_alerts()
        except StoreError as exc:
            log.error("pushed alerts unreadable: starting without them", error=str(exc))
            rows = []
        with self._lock:
            self._loaded = True
            self._alerts = {row.key: row for row in rows}
            if rows:
                self._settle_until = self.monotonic() + SETTLE_SECONDS
            # what an earlier run left firing, or resolved and not delivered, goes out now
            self._resend = any(row.starts_at is not None for row in rows)

    # -- what the delivery thread sends ----------------------------------------------------------

    def payloads(self) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        """Per Alertmanager, (key, alert as the v2 API takes it) for every alert it should hear now:
        the firing ones, and the resolutions it has not acknowledged."""
        now = self._clock()
        found: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        with self._lock:
            for key, row in self._alerts.items():
                if row.starts_at is None:
                    continue
                ends = row.ends_at if row.ends_at is not None else now + FIRING_VALIDITY_SECONDS
                body = {
                    "labels": dict(row.labels),
                    "annotations": dict(row.annotations),
                    "startsAt": iso_utc(row.starts_at),
                    "endsAt": iso_utc(ends),
                }
                for url in dict.fromkeys((*self._urls, *row.urls)):
                    if row.ends_at is None or url_id(url) not in row.delivered:
                        found.setdefault(url, []).append((key, body))
        return found

    def delivered(self, url: str, keys: Iterable[str]) -> None:
        """`url` took these alerts: a resolution every Alertmanager has is done with."""
        changes = _Changes()
        with self._lock:
            for key in keys:
                row = self._alerts.get(key)
                if row is None or row.ends_at is None or url_id(url) in row.delivered:
                    continue
                row = replace(row, delivered=(*row.delivered, url_id(url)))
                if {url_id(u) for u in (*self._urls, *row.urls)} <= set(row.delivered):
                    changes.drop(key)
                else:
                    changes.put(row)
            self._apply(changes)

    def active(self) -> list[AlertRow]:
        """The alerts kept now, pending, firing or resolved and not yet delivered everywhere."""
        with self._lock:
            return sorted(self._alerts.values(), key=lambda row: row.key)


def url_id(url: str) -> str:
    """What the store keeps of an Alertmanager's URL (which may carry a token): a digest."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def _includes(labels: Mapping[str, str], match: Mapping[str, str]) -> bool:
    """The alert is the raised fault's: every label of `match` it carries has that value (the fault as
    the event knows it; what the alert does not carry, the latency alert's GPU of the cause, says nothing)."""
    return all(labels[name] == value for name, value in match.items() if name in labels)
