"""The remediator: new events into the event store, the rules evaluated against the snapshot (a
pure function), the decided actions journaled and queued for the action worker, and the catalogue's
alerts the published snapshot holds kept in the push book, which the alert delivery thread sends to
Alertmanager (never on the loop). A store that cannot be opened
or written (state dir full, read-only) turns remediation off until it works again; the events
meanwhile wait, bounded, and none is lost or handled twice."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from agent.alerts.book import PushBook
from agent.alerts.evaluate import found_alerts
from agent.config import AgentConfig, Mode
from agent.daemon.action_worker import ActionWorker, target_fields
from agent.daemon.alert_delivery import AlertDelivery
from agent.events import Event
from agent.logger import get_logger
from agent.policy.holds import PolicyHolds
from agent.rules.actions.context import ActionContext
from agent.rules.actions.footprint import Footprint, footprint
from agent.rules.config import Rule, load_rules
from agent.rules.engine import evaluate, gpus_by_service
from agent.rules.model import ActionOutcome, Decision, Outcome
from agent.rules.params import NODE_CHANGING_ACTIONS, ActionKind
from agent.rules.sources import describe as describe_rules
from agent.rules.sources import resolve_rules
from agent.services.managers import ServiceManager
from agent.state import CollectorStatus, NodeSnapshot, RecentRemediation, RemediationCount, RemediationFailing
from agent.store.attempt_clock import AttemptClock, ClockReading
from agent.store.database import Store, StoredRemediation, StoreError
from agent.store.db import TableCache
from agent.watch.episodes import Episodes
from agent.watch.xid import XidWatcher

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


class Remediator:
    def __init__(
        self,
        config: AgentConfig,
        context: Callable[[PushBook], ActionContext | None],
        on_fixed: Callable[[Decision, Footprint], None],
        clock: Callable[[], float],
        attempt_clock: AttemptClock | None = None,
        managers: Callable[[AgentConfig], Mapping[str, ServiceManager]] | None = None,
        holds: PolicyHolds | None = None,
    ) -> None:
        self.config = config
        self.store: Store | None = None
        self.rules: list[Rule] = []
        self.rules_sources: tuple[str, ...] = ()
        self.rules_read = False  # the rules dirs were read (start, reload): `rules` is what they gave
        self.episodes = Episodes(config.state_dir)
        self.attempt_clock = attempt_clock or AttemptClock("")
        self.alerts = PushBook(lambda: self.store, self.attempt_clock.boot_id, clock)
        self.alert_delivery = AlertDelivery(self.alerts)
        self.worker = ActionWorker(
            lambda: context(self.alerts),
            lambda: self.store,
            on_fixed,
            clock,
            self.attempt_clock,
            (lambda: (self.config, managers(self.config))) if managers is not None else None,
            lambda decision: footprint(decision, self.config),
            holds,
        )
        self.status: CollectorStatus | None = None
        self._store_failed_monotonic: float | None = None  # when opening the store last failed
        self._unstored: list[Event] = []  # keyed events the store could not take yet
        # Shown every loop, changed by a remediation now and then: read again only after a write.
        self._counts: TableCache[Store, tuple[RemediationCount, ...]] = TableCache(
            "remediation_totals", lambda store: tuple(store.remediation_counts())
        )
        self._recent: TableCache[Store, tuple[RecentRemediation, ...]] = TableCache(
            "remediations", lambda store: tuple(_recent(store.remediations(limit=RECENT_REMEDIATIONS)))
        )
        self._failing: TableCache[Store, tuple[RemediationFailing, ...]] = TableCache(
            "remediations", lambda store: tuple(store.failing_rules())
        )

    def start(self) -> None:
        """The rules, the event store and the action worker; a store that cannot open is retried later."""
        self.reconfigure(self.config, load_rules_dir(self.config))
        try:
            self.store = Store.open(self.config.state_dir)
        except StoreError as exc:
            log.error(
                "event store unavailable: remediation is off until it can be opened",
                error=str(exc),
                retry_seconds=STORE_RETRY_SECONDS,
            )
            self.status = CollectorStatus("remediation", False, 0.0, str(exc))
            self._store_failed_monotonic = time.monotonic()
        if self.store is not None:
            self._recover(self.store)
        self.worker.start()
        self.alert_delivery.start()

    def stop(self) -> None:
        self.worker.stop()
        self.alert_delivery.stop()
        if self.store is not None:
            self.store.close()

    def reconfigure(self, config: AgentConfig, loaded: LoadedRules) -> None:
        self.config = config
        self.rules = loaded.rules
        self.rules_sources = loaded.sources
        self.rules_read = True

    def rules_loaded(self) -> int | None:
        """How many rules run, for the verdict; None before the dirs were read or with remediation
        turned off (`remediation.rules_dirs: []`)."""
        return len(self.rules) if self.rules_read and self.config.remediation.rules_dirs else None

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
        if self.store is None:
            return ()
        try:
            return cache.get(self.store)
        except StoreError as exc:
            log.error("cannot read the store", what=what, error=str(exc))
            return ()

    def _evaluate(self, store: Store, snapshot: NodeSnapshot, keyed_events: list[Event], now: float) -> None:
        new = [keyed for keyed in keyed_events if store.record_event(keyed)]
        history = self.worker.history(store, now)
        services = gpus_by_service(self.config.services)
        for decision in evaluate(snapshot, new, self.rules, history, now, services):
            self._act(decision, now)
        for event in new:
            store.mark_handled(event.key)

    def _act(self, decision: Decision, now: float) -> None:
        observed = self._observe_only(decision)
        if decision.action is None or decision.dry_run or observed:
            outcome = Outcome.SUPPRESSED if decision.action is None else Outcome.DRY_RUN
            detail = _would(decision) if observed else decision.reason
            self._record(ActionOutcome(decision, outcome, detail, now, now), self.attempt_clock.reading(now))
            log.info(
                f"action {outcome.value}",
                rule=decision.rule,
                action=decision.action.kind.value if decision.action else None,
                reason=decision.reason,
                **target_fields(decision),
            )
            return
        self.worker.submit(decision, now)  # journaled first: a StoreError leaves the event unhandled
        log.info(
            "action started",
            rule=decision.rule,
            action=decision.action.kind.value,
            attempt=decision.attempt,
            reason=decision.reason,
            **target_fields(decision),
        )

    def _observe_only(self, decision: Decision) -> bool:
        """In observe mode an action that changes the node is recorded as what the agent would have
        done (a dry run), not sent to the worker to be refused: the operator sees the decision, and a
        refusal keeps meaning a safety check said no."""
        action = decision.action
        return action is not None and action.kind in NODE_CHANGING_ACTIONS and self.config.mode is Mode.OBSERVE

    def push_alerts(self, snapshot: NodeSnapshot) -> None:
        """The catalogue's alerts the published snapshot holds, into the push book; the delivery thread
        is told at once when one fired or resolved (nothing outbound runs on the loop). Evaluated only
        while there is somewhere to push or something kept."""
        urls = self.config.remediation.alertmanager_urls
        found = found_alerts(snapshot, self.config) if self.alerts.wanted(urls) else []
        if self.alerts.update(found, urls):
            self.alert_delivery.poke()

    def _recover(self, store: Store) -> None:
        try:
            self.worker.recover(store)
        except StoreError as exc:
            log.error("cannot read the remediation journal: interrupted actions are not rolled back", error=str(exc))

    def _reopen_store(self) -> Store | None:
        """A store that could not be opened (state dir full, read-only) is tried again now and then."""
        if self.store is not None or self._store_failed_monotonic is None:
            return self.store
        if time.monotonic() - self._store_failed_monotonic < STORE_RETRY_SECONDS:
            return None
        try:
            self.store = Store.open(self.config.state_dir)
        except StoreError as exc:
            self._store_failed_monotonic = time.monotonic()
            self.status = CollectorStatus("remediation", False, 0.0, str(exc))
            return None
        log.info("event store open again: remediation resumes", path=str(self.store.path))
        self._recover(self.store)
        self._store_failed_monotonic = None
        return self.store

    def _keep_unstored(self, keyed_events: list[Event]) -> None:
        """Events the store could not take wait for the next loop (bounded: a store down for days must
        not grow the agent); the oldest go first, and that is logged."""
        dropped = len(keyed_events) - MAX_UNSTORED_EVENTS
        if dropped > 0:
            log.error("event store unusable for long: oldest unstored events dropped", dropped=dropped)
        self._unstored = keyed_events[-MAX_UNSTORED_EVENTS:]

    def _record(self, outcome: ActionOutcome, reading: ClockReading) -> None:
        if self.store is None:
            return
        try:
            self.store.record_outcome(outcome, reading)
        except StoreError as exc:
            log.error("could not record a remediation", error=str(exc), rule=outcome.decision.rule)


def fixed_xids(xid: XidWatcher) -> Callable[[Decision, Footprint], None]:
    """What a successful action fixed, out of the Xid health window: a GPU reset every Xid of its GPU,
    a service restart the app-level Xids of the GPUs it touched (its processes' own faults). The
    counters stay."""

    def fixed(decision: Decision, touched: Footprint) -> None:
        kind = decision.action.kind if decision.action is not None else None
        if kind is ActionKind.RESET_GPU and decision.target.gpu is not None:
            xid.clear(decision.target.gpu)
        elif kind is ActionKind.RESTART_SERVICE:
            xid.restarted(touched)

    return fixed


def _would(decision: Decision) -> str:
    """What the agent would have done, as "observe mode: would restart service sglang (rule ...)"."""
    target = decision.target
    what = target.service or (f"GPU {target.gpu}" if target.gpu is not None else "the node")
    kind = decision.action.kind.value if decision.action is not None else "act"
    return f"observe mode: would {kind.replace('_', ' ')} {what} (rule {decision.rule})"


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
    masked = [str(m.mask) for m in resolved.masked]
    log.info("rules loaded", files=[str(p) for p in resolved.paths], masked=masked, count=len(rules))
    return LoadedRules(rules, tuple(line.strip() for line in describe_rules(resolved)))
