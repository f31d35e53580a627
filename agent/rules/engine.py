"""The rule engine: pure. Snapshot, new events, rules, attempt history and the time go in; decisions
come out. No I/O and no clock: everything it knows is passed to `evaluate`.

Faults
------
Event-driven conditions (xid, gpu_lost, ecc_uncorrected, row_remap, policy_drift, event) match the
events passed in, each event once (duplicate keys are folded, events the history calls handled are
skipped), oldest first. State conditions read the snapshot and synthesize an event:

- `throttle`: a slowdown reason held for at least `held_seconds` (the snapshot's `throttle_held_seconds`,
  measured on CLOCK_BOOTTIME, so a wall-clock step is not time held) is one fault per episode, keyed
  `throttle:<uuid>:<reason>:<active_since>/<rule>` (the rule name is part of the key because two
  rules with different hold times each see the episode once).
- `service_unhealthy`: a service with at least `probes` failed probes in a row is a fault on every
  loop it stays down (keyed by the snapshot time), so the ladder escalates while it stays down. On
  such a held fault, cooldown and an open circuit produce no decision at all: a "still in cooldown"
  entry every loop would bury the history.

Targets
-------
A GPU fault targets `Target(gpu, uuid)` (the uuid or index filled in from the snapshot when the
event lacks it). A rule with a step aimed at services (its kind's `targets` is `Targets.SERVICES`:
restart_service) instead targets each service using that GPU (`services[].gpus`; every service
when the GPU is unknown; a service named in the step is used as is), one decision per service,
`Target(gpu, uuid, service)`: attempts are then counted per service, so an Xid storm on eight GPUs
of one tensor-parallel server restarts it once. Every step of the ladder aims at that target (a
kind aimed at the GPU, `Targets.GPU`, at `target.gpu`: nothing runs for a fault that names none).
A `service_unhealthy` fault targets `Target(service=...)`; a fault without GPU or service targets
the node, `Target()`.

Whose fault: an app-level Xid (catalog action restart_service: 13, 31, 43, ...) is the faulting
process's own, so a service is restarted for it only when that process is the service's (the
event's `process_service`, read from the process when the kernel log named its pid). Another
user's CUDA process, or a process the kernel log did not name, restarts nothing: the decision is
kept without an action and says whose process it was.

Storm protection, per (rule, target key), counting the decisions of this call as attempts too
------------------------------------------------------------------------------------------------
1. circuit open (in the history, or opened by this call): SUPPRESSED.
2. less than `cooldown_seconds` since the last attempt: SUPPRESSED ("cooldown: 240 s left"). It
   comes before 3 so that the rest of a burst (one crash logs Xid 13 then 45) is not taken for
   "the last attempt did not help".
3. attempts in the last `window_seconds` >= `max_attempts`: the circuit opens. The decisions for
   `on_exhausted` come out once, with step EXHAUSTED_STEP (-1); with no `on_exhausted`, one
   decision without an action and the same step. Recording a decision with that step opens the
   circuit in the store (`Store.record_outcome`), so every decision must be recorded, suppressed
   ones included. The circuit stays open until `gpu-agent ack`.
4. otherwise: attempt N uses ladder step N-1; past the end, the last step repeats.

Within one call, a kind decided once per GPU or per node (its `once`: one GPU reset per GPU, one
reboot and one reboot recommendation per node) is decided once, whichever rules ask; a second
decision for the same is SUPPRESSED as a duplicate. A suppressed decision has `action=None` and
its `reason` says why. Decisions of a `dry_run` rule carry `dry_run=True`.

The output order is deterministic: event-driven faults (by time, then key) across the rules in
their order, then state faults rule by rule (GPUs by index, services by name).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from agent.config.service_entry import ServiceConfig
from agent.events import Event, EventKind, Severity, SuggestedAction
from agent.rules.actions.kind import Once, Targets
from agent.rules.actions.registry import KINDS
from agent.rules.config import Rule
from agent.rules.model import ActionSpec, Decision, Target
from agent.rules.params import ServiceParams
from agent.state import NodeSnapshot
from agent.watch import xid_catalog

EXHAUSTED_STEP = -1
#: `Event.source` of the events the engine synthesizes from the snapshot.
SOURCE = "rules"

ServiceGpus = Mapping[str, list[int] | Literal["all"]]

_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2, Severity.FATAL: 3}


class AttemptHistory(Protocol):
    """What the engine needs to know about the past; `agent.store.database.Store` implements it."""

    def attempts(self, rule: str, target_key: str, since_seconds: float) -> list[float]:
        """Times of the attempts (not acknowledged away) at or after `since_seconds`, oldest first."""
        ...

    def last_attempt(self, rule: str, target_key: str) -> float | None: ...

    def circuit_open(self, rule: str, target_key: str) -> bool: ...

    def handled(self, event_key: str) -> bool: ...


def gpus_by_service(services: Iterable[ServiceConfig]) -> dict[str, list[int] | Literal["all"]]:
    """`services:` from agent.yaml as `evaluate` wants it: service name -> GPU indices or "all"."""
    return {service.name: service.gpus for service in services}


@dataclass
class _Fault:
    rule: Rule
    event: Event
    gpu: int | None
    uuid: str | None
    held: bool  # a state that lasts (service down): no decision while it can only be suppressed


@dataclass
class _Tally:
    decided: int = 0
    exhausted: bool = False


class _Call:
    """Bookkeeping of one evaluate() call: its own decisions count as attempts."""

    def __init__(self, history: AttemptHistory, now_seconds: float, service_gpus: ServiceGpus) -> None:
        self.history = history
        self.now = now_seconds
        self.service_gpus = service_gpus
        self.tallies: dict[tuple[str, str], _Tally] = {}
        self.reserved: dict[tuple[str, bool], str] = {}

    def decide(self, fault: _Fault) -> list[Decision]:
        decisions: list[Decision] = []
        for target in self._targets(fault):
            decisions += self._decide_target(fault, target)
        return decisions

    def _targets(self, fault: _Fault) -> list[Target]:
        rule = fault.rule
        if rule.match.service_unhealthy is not None:
            return [Target(service=str(fault.event.data["service"]))]
        if rule.aims_at_services:
            services = self._services(rule, fault.gpu)
            if _app_level(fault.event):
                services = [name for name in services if name == fault.event.data.get("process_service")]
            if services:
                return [Target(fault.gpu, fault.uuid, service) for service in services]
        return [Target(fault.gpu, fault.uuid)]

    def _services(self, rule: Rule, gpu: int | None) -> list[str]:
        # A step aimed at services (Targets.SERVICES) takes ServiceParams: ActionType checks it.
        named = [
            options.service for options in (s.spec().options for s in rule.steps) if isinstance(options, ServiceParams)
        ]
        names = {name for name in named if name is not None}
        if None in named:
            names |= {
                name
                for name, gpus in self.service_gpus.items()
                if gpus == "all" or gpu is None or gpu in gpus  # an unknown GPU may be any of them
            }
        return sorted(names)

    def _decide_target(self, fault: _Fault, target: Target) -> list[Decision]:
        rule, now = fault.rule, self.now
        tally = self.tallies.setdefault((rule.name, target.key), _Tally())
        count = len(self.history.attempts(rule.name, target.key, now - rule.window_seconds)) + tally.decided
        step = min(count, len(rule.actions) - 1)

        def suppressed(reason: str) -> list[Decision]:
            return [Decision(rule.name, fault.event, target, None, step, count + 1, reason, rule.dry_run)]

        if tally.exhausted or self.history.circuit_open(rule.name, target.key):
            if fault.held:
                return []
            return suppressed(f"circuit open: attempts exhausted; `gpu-agent ack {rule.name}` re-arms the rule")
        last = now if tally.decided else self.history.last_attempt(rule.name, target.key)
        if last is not None:
            # abs(): a wall clock stepped backwards must not stretch the cooldown by the size of the step.
            left = rule.cooldown_seconds - abs(now - last)
            if left > 0:
                return [] if fault.held else suppressed(f"cooldown: {math.ceil(left)} s left")
        # After the cooldown: the Xids one crash logs a second apart, or a service still loading after
        # the last restart, must not count as "the last attempt did not help".
        if count >= rule.max_attempts:
            tally.exhausted = True
            return self._exhausted(fault, target, count)
        spec, problem = self._resolve(rule.actions[step].spec(), target, rule, fault.event)
        if spec is None:
            return suppressed(problem)
        tally.decided += 1
        reason = (
            f"attempt {count + 1} of {rule.max_attempts} within {rule.window_seconds:g} s: "
            f"step {step + 1} of {len(rule.actions)}, {spec.kind}"
        )
        return [Decision(rule.name, fault.event, target, spec, step, count + 1, reason, rule.dry_run)]

    def _exhausted(self, fault: _Fault, target: Target, count: int) -> list[Decision]:
        rule = fault.rule
        why = (
            f"{count} attempts within {rule.window_seconds:g} s reached max_attempts {rule.max_attempts}: "
            f"circuit opens until `gpu-agent ack {rule.name}`"
        )
        if not rule.on_exhausted:
            return [Decision(rule.name, fault.event, target, None, EXHAUSTED_STEP, count + 1, why, rule.dry_run)]
        decisions: list[Decision] = []
        for step in rule.on_exhausted:
            spec, problem = self._resolve(step.spec(), target, rule, fault.event)
            reason = why if spec is not None else f"{why}; {problem}"
            decisions.append(
                Decision(rule.name, fault.event, target, spec, EXHAUSTED_STEP, count + 1, reason, rule.dry_run)
            )
        return decisions

    def _resolve(self, spec: ActionSpec, target: Target, rule: Rule, event: Event) -> tuple[ActionSpec | None, str]:
        """The step's action aimed at the target, or (None, why it cannot run)."""
        kind, options = KINDS[spec.kind], spec.options
        if kind.targets is Targets.SERVICES:
            assert isinstance(options, ServiceParams)  # ActionType checks it
            service = options.service or target.service
            if _app_level(event) and (service is None or service != event.data.get("process_service")):
                return None, f"{spec.kind}: {_not_a_service(event)}: no service restarted"
            if service is None:
                return None, f"{spec.kind}: no service uses GPU {target.gpu} (services[].gpus in agent.yaml)"
            spec = ActionSpec(options.model_copy(update={"service": service}))
        elif kind.targets is Targets.GPU and target.gpu is None:
            return None, f"{spec.kind}: the fault names no GPU"
        if kind.once is not Once.PER_TARGET:
            what = f"{spec.kind} of GPU {target.gpu}" if kind.once is Once.PER_GPU else spec.kind
            owner = self.reserved.get((what, rule.dry_run))
            if owner is not None:
                return None, f"duplicate: {what} already decided in this evaluation by {owner}"
            self.reserved[(what, rule.dry_run)] = f"rule {rule.name} for {target.key}"
        return spec, ""


def _resolve_gpu(event: Event, snapshot: NodeSnapshot | None) -> tuple[int | None, str | None]:
    gpu, uuid = event.gpu, event.uuid or None
    if snapshot is not None:
        if gpu is None and uuid is not None:
            gpu = next((s.index for s in snapshot.gpus if s.uuid == uuid), None)
        if uuid is None and gpu is not None:
            uuid = next((s.uuid for s in snapshot.gpus if s.index == gpu and s.uuid), None)
    return gpu, uuid


def _event_matches(rule: Rule, event: Event) -> bool:
    match = rule.match
    kind = event.kind
    if match.xid is not None:
        code = event.data.get("xid")
        # bool is an int; a True in the data is a bug upstream, not Xid 1.
        return (
            kind is EventKind.XID and isinstance(code, int) and not isinstance(code, bool) and match.xid.matches(code)
        )
    if match.gpu_lost is not None:
        return kind is EventKind.GPU_LOST
    if match.ecc_uncorrected is not None:
        return kind is EventKind.ECC_UNCORRECTED
    if match.row_remap is not None:
        return (match.row_remap.pending and kind is EventKind.ROW_REMAP_PENDING) or (
            match.row_remap.failed and kind is EventKind.ROW_REMAP_FAILED
        )
    if match.policy_drift is not None:
        drift = match.policy_drift
        reappeared = event.data.get("reappeared", 0)
        return (
            kind is EventKind.POLICY_DRIFT
            and isinstance(reappeared, int)
            and reappeared >= drift.reappeared
            and (drift.items is None or event.data.get("item") in drift.items)
        )
    if match.event is not None:
        condition = match.event
        return (
            kind in condition.kinds
            and _SEVERITY_RANK[event.severity] >= _SEVERITY_RANK[condition.min_severity]
            and (condition.suggested_actions is None or event.suggested_action in condition.suggested_actions)
            and event.suggested_action.rank >= condition.min_suggested_action.rank
        )
    return False  # a state condition: read from the snapshot, not from events


def _app_level(event: Event) -> bool:
    """An Xid whose fault is the application's own context (catalog action restart_service)."""
    code = event.data.get("xid")
    if event.kind is not EventKind.XID or not isinstance(code, int):
        return False
    return xid_catalog.verdict(code).action is SuggestedAction.RESTART_SERVICE


def _not_a_service(event: Event) -> str:
    pid, process = event.data.get("pid"), event.data.get("process")
    if pid is None:
        return "the faulting process is unknown (no kernel-log line named its pid)"
    owner = event.data.get("process_service")
    name = f" ({process})" if process else ""
    whose = f"belongs to service {owner}, not one this rule restarts" if owner else "belongs to no configured service"
    return f"the faulting process pid {pid}{name} {whose}"


def _pending_events(events: Sequence[Event], history: AttemptHistory) -> list[Event]:
    unique: dict[str, Event] = {}
    for event in events:
        unique.setdefault(event.key, event)
    fresh = [event for key, event in unique.items() if not history.handled(key)]
    return sorted(fresh, key=lambda e: (e.timestamp_seconds, e.key))


def _throttle_faults(rule: Rule, snapshot: NodeSnapshot, now_seconds: float) -> list[_Fault]:
    condition = rule.match.throttle
    if condition is None:
        return []
    uuids = {s.index: s.uuid for s in snapshot.gpus if s.uuid}
    faults: list[_Fault] = []
    for (gpu, reason), since in sorted(snapshot.throttle_active_since.items()):
        # Held time comes from the watcher's boot clock: now - since would count a wall-clock step.
        held_seconds = snapshot.throttle_held_seconds.get((gpu, reason), 0.0)
        if reason not in condition.reasons or not rule.watches_gpu(gpu) or held_seconds < condition.held_seconds:
            continue
        uuid = uuids.get(gpu)
        hardware = reason.startswith("hw_")
        event = Event(
            kind=EventKind.THROTTLE_STARTED,
            severity=Severity.CRITICAL if hardware else Severity.WARNING,
            gpu=gpu,
            uuid=uuid,
            message=f"GPU {gpu}: {reason} held for {held_seconds:.0f} s",
            timestamp_seconds=now_seconds,
            source=SOURCE,
            key=f"throttle:{uuid or f'gpu{gpu}'}:{reason}:{since:.3f}/{rule.name}",
            data={"reason": reason, "active_since_seconds": since, "held_seconds": held_seconds},
            suggested_action=SuggestedAction.CHECK_MECHANICALS,
        )
        faults.append(_Fault(rule, event, gpu, uuid, held=False))
    return faults


def _service_faults(rule: Rule, snapshot: NodeSnapshot) -> list[_Fault]:
    condition = rule.match.service_unhealthy
    if condition is None:
        return []
    faults: list[_Fault] = []
    for status in sorted(snapshot.services, key=lambda s: s.name):
        if condition.services is not None and status.name not in condition.services:
            continue
        if status.consecutive_failures < condition.probes:
            continue
        event = Event(
            kind=EventKind.SERVICE_UNHEALTHY,
            severity=Severity.CRITICAL,
            gpu=None,
            uuid=None,
            message=f"service {status.name}: {status.consecutive_failures} failed health probes in a row",
            timestamp_seconds=snapshot.timestamp_seconds,
            source=SOURCE,
            key=f"service_unhealthy:{status.name}:{snapshot.timestamp_seconds:.3f}/{rule.name}",
            data={
                "service": status.name,
                "unit": status.unit,
                "consecutive_failures": status.consecutive_failures,
                "detail": status.detail,
            },
            suggested_action=SuggestedAction.RESTART_SERVICE,
        )
        faults.append(_Fault(rule, event, None, None, held=True))
    return faults


def evaluate(
    snapshot: NodeSnapshot | None,
    events: Sequence[Event],
    rules: Sequence[Rule],
    history: AttemptHistory,
    now_seconds: float,
    service_gpus: ServiceGpus,
) -> list[Decision]:
    """Decisions for the new `events` and the state in `snapshot` (None: events only); see the module doc."""
    call = _Call(history, now_seconds, service_gpus)
    decisions: list[Decision] = []
    for event in _pending_events(events, history):
        gpu, uuid = _resolve_gpu(event, snapshot)
        for rule in rules:
            if _event_matches(rule, event) and rule.watches_gpu(gpu):
                decisions += call.decide(_Fault(rule, event, gpu, uuid, held=False))
    if snapshot is None:
        return decisions
    for rule in rules:
        for fault in (*_throttle_faults(rule, snapshot, now_seconds), *_service_faults(rule, snapshot)):
            if not history.handled(fault.event.key):
                decisions += call.decide(fault)
    return decisions
