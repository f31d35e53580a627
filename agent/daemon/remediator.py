"""The remediator: new events into the event store, the rules evaluated against the snapshot (a
pure function), the decided actions journaled and queued for the action worker, and the catalogue's
alerts the published snapshot holds kept in the push book, which the alert delivery thread sends to
Alertmanager (never on the loop). A store that cannot be opened or written (state dir full,
read-only) turns remediation off until it works again; the events meanwhile wait, bounded, and none
is lost or handled twice."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from agent.config import AgentConfig
from agent.daemon.action_worker import ActionWorker, target_fields
from agent.daemon.alert_delivery import AlertDelivery
from agent.daemon.alert_found import found_alerts
from agent.events import Event
from agent.logs import get_logger
from agent.rules.actions.dispatch import observe_mode
from agent.rules.config import Rule, ignored_parameters, load_rules
from agent.rules.engine import evaluate, gpus_by_service
from agent.rules.model import ActionOutcome, Decision, Outcome
from agent.rules.sources import describe as describe_rules
from agent.rules.sources import resolve_rules
from agent.state import CollectorStatus, NodeSnapshot, RecentRemediation, RemediationCount, RemediationFailing
from agent.store.attempt_clock import ClockReading
from agent.store.database import Store, StoredRemediation, StoreError
from agent.store.db import TableCache
from agent.watch.episodes import Episodes

if TYPE_CHECKING:
    from agent.daemon.live import Live

log = get_logger()
T = TypeVar("T")

STORE_RETRY_SECONDS = 30.0
MAX_UNSTORED_EVENTS = 10_000


#: Decisions the status screen lists.
RECENT_REMEDIATIONS = 10


def _recent(stored: Sequence[StoredRemediation]) -> Iterator[RecentRemediation]:
    for r in stored:
        shown = r.detail or r.reason
        yield RecentRemediation(r.started_seconds, r.rule, r.action, r.target_key, r.outcome.value, shown)


def _read_counts(store: Store) -> tuple[RemediationCount, ...]:
    return tuple(store.remediation_counts())


def _read_recent(store: Store) -> tuple[RecentRemediation, ...]:
    return tuple(_recent(store.remediations(limit=RECENT_REMEDIATIONS)))


def _read_failing(store: Store) -> tuple[RemediationFailing, ...]:
    return tuple(store.failing_rules())


class Remediator:
    """Reads of the daemon's live parts (agent/daemon/live.py): the config of the moment, the store
    (which it opens, and opens again after it could not), the attempt clock and the push book of alerts."""

    def __init__(self, *, live: Live) -> None:
        self.live = live
        self.rules: list[Rule] = []
        self.rules_sources: tuple[str, ...] = ()
        self.rules_read = False  # the rules dirs were read (start, reload): `rules` is what they gave
        self.episodes = Episodes(live.config.state_dir)  # state_dir never changes while the daemon runs
        self.alert_delivery = AlertDelivery(live.alerts)
        self.worker = ActionWorker(live=live)
        self.status: CollectorStatus | None = None
        self._store_failed_monotonic: float | None = None  # when opening the store last failed
        self._unstored: list[Event] = []  # keyed events the store could not take yet
        # Shown every loop, changed by a remediation now and then: read again only after a write.
        self._counts = TableCache("remediation_totals", _read_counts)
        self._recent = TableCache("remediations", _read_recent)
        self._failing = TableCache("remediations", _read_failing)

    def start(self) -> None:
        """The rules, the event store and the action worker; a store that cannot open is retried later."""
        self.reconfigure(load_rules_dir(self.live.config))
        try:
            store = Store.open(self.live.config.state_dir)
        except StoreError as exc:
            log.error(
                "event store unavailable: remediation is off until it can be opened",
                error=str(exc),
                retry_seconds=STORE_RETRY_SECONDS,
            )
            self.status = CollectorStatus("remediation", False, 0.0, str(exc))
            self._store_failed_monotonic = time.monotonic()
        else:
            self._opened(store)
        self.worker.start()
        self.alert_delivery.start()

    def stop(self) -> None:
        self.worker.stop()
        self.alert_delivery.stop()
        if self.live.store is not None:
            self.live.store.close()

    def reconfigure(self, loaded: LoadedRules) -> None:
        """The rules a reload read (the config they go with is the live one)."""
        self.rules = loaded.rules
        self.rules_sources = loaded.sources
        self.rules_read = True

    def rules_loaded(self) -> int | None:
        """How many rules run, for the verdict; None before the dirs were read or with remediation
        turned off (`remediation.rules_dirs: []`)."""
        return len(self.rules) if self.rules_read and self.live.config.remediation.rules_dirs else None

    def remediate(self, snapshot: NodeSnapshot, events: Sequence[Event], now: float) -> None:
        """Store new events, evaluate the rules (pure), queue the actions: the loop never waits on one."""
        store = self._reopen_store()
        if store is None and self._store_failed_monotonic is None:
            return  # no store at all (an embedded daemon that never started its services)
        # Keyed once: a clearing event closes its episode once, however often it has to be retried. A
        # retried event the store took before it failed, but no rule saw, is offered again by the store.
        keyed_events = self._unstored + [self.episodes.keyed(event) for event in events]
        self._unstored = []
        if store is None:
            self._keep_unstored(keyed_events)
            return
        started = time.monotonic()
        try:
            self._evaluate(store, snapshot, keyed_events, now)
        except StoreError as exc:
            self.status = CollectorStatus("remediation", False, time.monotonic() - started, str(exc))
            log.error("remediation step failed: the event store is unusable", error=str(exc))
            self._keep_unstored(keyed_events)
            return
        self.status = CollectorStatus("remediation", True, time.monotonic() - started)

    def counts(self) -> tuple[RemediationCount, ...]:
        return self._read(self._counts, "remediation counts")

    def failing(self) -> tuple[RemediationFailing, ...]:
        """The rules that cannot fix their fault now (the store's last outcomes and open circuits)."""
        return self._read(self._failing, "failing remediations")

    def recent(self) -> tuple[RecentRemediation, ...]:
        """The newest decisions, for the status screen."""
        return self._read(self._recent, "recent remediations")

    def _read(self, cache: TableCache[Store, tuple[T, ...]], what: str) -> tuple[T, ...]:
        """What the loop shows of the store; nothing while there is no store or it cannot be read."""
        store = self.live.store
        if store is None:
            return ()
        try:
            return cache.get(store)
        except StoreError as exc:
            log.error("cannot read the store", what=what, error=str(exc))
            return ()

    def _evaluate(self, store: Store, snapshot: NodeSnapshot, keyed_events: list[Event], now: float) -> None:
        new = [keyed for keyed in keyed_events if store.record_event(keyed)]
        history = self.worker.history(store, now)
        services = gpus_by_service(self.live.config.services)
        for decision in evaluate(snapshot, new, self.rules, history, now, services):
            self._act(decision, now)
        for event in new:
            store.mark_handled(event.key)

    def _act(self, decision: Decision, now: float) -> None:
        # In observe mode an action that changes the node is recorded as what the agent would have
        # done, never queued: the operator sees the decision, and a refusal keeps meaning a safety
        # check said no.
        observed = observe_mode(decision, self.live.config.mode)
        if decision.action is None or decision.dry_run or observed is not None:
            outcome = Outcome.SUPPRESSED if decision.action is None else Outcome.DRY_RUN
            detail = observed.detail if observed is not None else decision.reason
            self._record(ActionOutcome(decision, outcome, detail, now, now), self.live.attempt_clock.reading(now))
            log.info(
                f"action {outcome.value}",
                rule=decision.rule,
                action=decision.action.kind if decision.action else None,
                reason=decision.reason,
                **target_fields(decision),
            )
            return
        self.worker.submit(decision, now)  # journaled first: a StoreError leaves the event unhandled
        log.info(
            "action started",
            rule=decision.rule,
            action=decision.action.kind,
            attempt=decision.attempt,
            reason=decision.reason,
            **target_fields(decision),
        )

    def push_alerts(self, snapshot: NodeSnapshot) -> None:
        """The catalogue's alerts the published snapshot holds, into the push book; the delivery thread
        is told at once when one fired or resolved (nothing outbound runs on the loop). Evaluated only
        while there is somewhere to push or something kept."""
        config, alerts = self.live.config, self.live.alerts
        urls = config.remediation.alertmanager_urls
        found = found_alerts(snapshot, config) if alerts.wanted(urls) else []
        if alerts.update(found, urls):
            self.alert_delivery.poke()

    def _opened(self, store: Store) -> None:
        """The store is open: every part reads it from now on (the node memory loads), and what an
        earlier run left half-done is rolled back first."""
        self.live.store_opened(store)
        try:
            self.worker.recover(store)
        except StoreError as exc:
            log.error("cannot read the remediation journal: interrupted actions are not rolled back", error=str(exc))

    def _reopen_store(self) -> Store | None:
        """A store that could not be opened (state dir full, read-only) is tried again now and then."""
        if self.live.store is not None or self._store_failed_monotonic is None:
            return self.live.store
        if time.monotonic() - self._store_failed_monotonic < STORE_RETRY_SECONDS:
            return None
        try:
            store = Store.open(self.live.config.state_dir)
        except StoreError as exc:
            self._store_failed_monotonic = time.monotonic()
            self.status = CollectorStatus("remediation", False, 0.0, str(exc))
            return None
        log.info("event store open again: remediation resumes", path=str(store.path))
        self._opened(store)
        self._store_failed_monotonic = None
        return store

    def _keep_unstored(self, keyed_events: list[Event]) -> None:
        """Events the store could not take wait for the next loop (bounded: a store down for days must
        not grow the agent); the oldest go first, and that is logged."""
        dropped = len(keyed_events) - MAX_UNSTORED_EVENTS
        if dropped > 0:
            log.error("event store unusable for long: oldest unstored events dropped", dropped=dropped)
        self._unstored = keyed_events[-MAX_UNSTORED_EVENTS:]

    def _record(self, outcome: ActionOutcome, reading: ClockReading) -> None:
        self.live.write_store(
            "could not record a remediation",
            lambda store: store.record_outcome(outcome, reading),
            rule=outcome.decision.rule,
        )


@dataclass(frozen=True)
class LoadedRules:
    rules: list[Rule]
    sources: tuple[str, ...]  # each file read or masked and where it came from, for `status`


def load_rules_dir(config: AgentConfig) -> LoadedRules:
    """Rules from rules_dirs (agent/rules/sources.py: shipped defaults, admin overrides and masks);
    missing dirs are logged, an invalid file is a ConfigError."""
    if not config.remediation.rules_dirs:
        log.info("remediation is off: remediation.rules_dirs is empty")
        return LoadedRules([], ())
    resolved = resolve_rules(Path(d) for d in config.remediation.rules_dirs)
    for warning in resolved.warnings():
        log.warning("rules not as expected", problem=warning)
    rules = load_rules(resolved.paths, allow_reboot=config.remediation.allow_reboot)
    for ignored in ignored_parameters(rules):
        log.warning("rules not as expected", problem=ignored)
    masked = [str(m.mask) for m in resolved.masked]
    log.info("rules loaded", files=[str(p) for p in resolved.paths], masked=masked, count=len(rules))
    return LoadedRules(rules, tuple(line.strip() for line in describe_rules(resolved)))
