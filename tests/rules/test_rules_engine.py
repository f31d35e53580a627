"""The rule engine against the real store: conditions, targets, escalation and storm protection.

`Loop` does what the daemon does once per loop (record the new events, evaluate, record every
decision's outcome, mark the events handled), so restart scenarios are a `reopen()` away: a new
Store on the same file is exactly what an agent restart gives the engine.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import EllipsisType
from typing import Any, Literal

import pytest
from helpers import make_event
from snapshots import gpu_uuid, h200_snapshot

from agent.events import Event, EventKind, Severity, SuggestedAction
from agent.rules.config import Rule
from agent.rules.engine import EXHAUSTED_STEP, evaluate, gpus_by_service
from agent.rules.model import ActionOutcome, Decision, Outcome, Target
from agent.state import NodeSnapshot, ServiceStatus
from agent.store.database import Store

T0 = 1_780_000_000.0
HOUR = 3600.0

ServiceGpus = Mapping[str, list[int] | Literal["all"]]


def make_rule(
    name: str = "r", match: dict[str, Any] | None = None, actions: list[Any] | None = None, **fields: Any
) -> Rule:
    return Rule.model_validate(
        {"name": name, "match": match or {"xid": {"codes": [48]}}, "actions": actions or ["reset_gpu"], **fields}
    )


def event(
    kind: EventKind = EventKind.XID,
    gpu: int | None = 0,
    at: float = T0,
    key: str | None = None,
    severity: Severity = Severity.CRITICAL,
    suggested: SuggestedAction = SuggestedAction.NONE,
    uuid: str | EllipsisType | None = ...,
    **data: Any,
) -> Event:
    """make_event in this module's words: `at` the event's time, `suggested` its remedy."""
    return make_event(
        kind, gpu, uuid=uuid, severity=severity, timestamp_seconds=at, key=key, suggested_action=suggested, **data
    )


def xid(code: int, gpu: int | None = 0, at: float = T0, **fields: Any) -> Event:
    return event(EventKind.XID, gpu=gpu, at=at, xid=code, **fields)


def snapshot(at: float = T0, gpus: int = 4, **fields: Any) -> NodeSnapshot:
    return h200_snapshot(at, gpus, **fields)


def service(name: str, failures: int) -> ServiceStatus:
    return ServiceStatus(name, f"{name}.service", up=failures == 0, consecutive_failures=failures)


class Loop:
    def __init__(self, state_dir: Path, rules: Sequence[Rule], service_gpus: ServiceGpus | None = None) -> None:
        self.state_dir = state_dir
        self.rules = list(rules)
        self.service_gpus: ServiceGpus = service_gpus if service_gpus is not None else {"sglang": "all"}
        self.store = Store.open(state_dir, now_seconds=T0)

    def reopen(self, now: float) -> None:
        self.store.close()
        self.store = Store.open(self.state_dir, now_seconds=now)

    def run(self, now: float, events: Iterable[Event] = (), snap: NodeSnapshot | None = None) -> list[Decision]:
        fresh = [e for e in events if self.store.record_event(e)]
        decisions = evaluate(snap, fresh, self.rules, self.store, now, self.service_gpus)
        for decision in decisions:
            if decision.action is None:
                outcome = Outcome.SUPPRESSED
            else:
                outcome = Outcome.DRY_RUN if decision.dry_run else Outcome.SUCCESS
            self.store.record_outcome(ActionOutcome(decision, outcome, decision.reason, now, now + 1.0))
        for fresh_event in fresh:
            self.store.mark_handled(fresh_event.key)
        return decisions


@pytest.fixture
def loop_factory(tmp_path: Path) -> Iterable[Any]:
    loops: list[Loop] = []

    def build(rules: Sequence[Rule], service_gpus: ServiceGpus | None = None) -> Loop:
        loop = Loop(tmp_path / f"state{len(loops)}", rules, service_gpus)
        loops.append(loop)
        return loop

    yield build
    for loop in loops:
        loop.store.close()


def acted(decisions: Sequence[Decision]) -> list[Decision]:
    return [d for d in decisions if d.action is not None]


def kinds(decisions: Sequence[Decision]) -> list[str | None]:
    return [d.action.kind if d.action else None for d in decisions]


# -- conditions ----------------------------------------------------------------------------------

PCIE_AT_LEAST_CRITICAL = {"event": {"kinds": ["pcie_degraded"], "min_severity": "critical"}}
RECOVERY_BY_REBOOT = {"event": {"kinds": ["recovery_action"], "suggested_actions": ["reboot"]}}
RECOVERY_AT_LEAST_RESET = {"event": {"kinds": ["recovery_action"], "min_suggested_action": "reset_gpu"}}


def recovery(suggested: SuggestedAction) -> Event:
    """A recovery-action event whose remedy is `suggested`."""
    return event(EventKind.RECOVERY_ACTION, suggested=suggested)


EVENT_CASES = [
    # (condition, event, matches)
    ({"xid": {"codes": [13, 31]}}, xid(13), True),
    ({"xid": {"codes": [13, 31]}}, xid(48), False),
    ({"xid": {"buckets": ["RESTART_APP"]}}, xid(31), True),
    ({"xid": {"buckets": ["RESTART_APP"]}}, xid(79), False),
    ({"xid": {"buckets": ["RESTART_BM"]}}, xid(79), True),
    ({"xid": {"buckets": ["UNKNOWN"]}}, xid(998), True),  # not in the catalog
    ({"xid": {"catalog_action": "reset_gpu"}}, xid(48), True),
    ({"xid": {"catalog_action": "reset_gpu"}}, xid(79), False),  # the catalog says reboot
    ({"xid": {"catalog_action": ["reset_gpu", "reboot"]}}, xid(79), True),
    ({"xid": {"catalog_action": "alert"}}, xid(998), True),  # the catalog's verdict for a code it lacks
    ({"xid": {"catalog_action": "alert", "except_codes": [998]}}, xid(998), False),
    ({"xid": {"catalog_action": "restart_service", "codes": [48]}}, xid(48), True),
    ({"xid": {"codes": [13]}}, event(EventKind.XID, xid="13"), False),  # not an int: a bug upstream, no guess
    ({"xid": {"codes": [1]}}, event(EventKind.XID, xid=True), False),
    ({"xid": {"codes": [13]}}, event(EventKind.ECC_UNCORRECTED, xid=13), False),
    ({"gpu_lost": {}}, event(EventKind.GPU_LOST), True),
    ({"gpu_lost": None}, event(EventKind.GPU_RECOVERED), False),
    ({"ecc_uncorrected": {}}, event(EventKind.ECC_UNCORRECTED), True),
    ({"ecc_uncorrected": {}}, event(EventKind.ECC_CORRECTED), False),
    ({"row_remap": {"failed": True}}, event(EventKind.ROW_REMAP_FAILED), True),
    ({"row_remap": {"failed": True}}, event(EventKind.ROW_REMAP_PENDING), False),
    ({"row_remap": {"pending": True}}, event(EventKind.ROW_REMAP_PENDING), True),
    ({"row_remap": {"pending": True, "failed": True}}, event(EventKind.ROW_REMAP_FAILED), True),
    ({"policy_drift": {"reappeared": 2}}, event(EventKind.POLICY_DRIFT, item="power_limit", reappeared=2), True),
    ({"policy_drift": {"reappeared": 2}}, event(EventKind.POLICY_DRIFT, item="power_limit", reappeared=1), False),
    ({"policy_drift": {"reappeared": 1}}, event(EventKind.POLICY_DRIFT, item="power_limit"), False),
    (
        {"policy_drift": {"reappeared": 1, "items": ["ecc"]}},
        event(EventKind.POLICY_DRIFT, item="power_limit", reappeared=5),
        False,
    ),
    ({"event": {"kinds": ["pcie_degraded"]}}, event(EventKind.PCIE_DEGRADED, severity=Severity.INFO), True),
    (PCIE_AT_LEAST_CRITICAL, event(EventKind.PCIE_DEGRADED, severity=Severity.WARNING), False),
    (PCIE_AT_LEAST_CRITICAL, event(EventKind.PCIE_DEGRADED, severity=Severity.FATAL), True),
    (RECOVERY_BY_REBOOT, recovery(SuggestedAction.RESET_GPU), False),
    (RECOVERY_BY_REBOOT, recovery(SuggestedAction.REBOOT), True),
    # The one ranking of remedies: reset_gpu and reboot are at least reset_gpu, the rest are milder.
    (RECOVERY_AT_LEAST_RESET, recovery(SuggestedAction.REBOOT), True),
    (RECOVERY_AT_LEAST_RESET, recovery(SuggestedAction.RESET_GPU), True),
    (RECOVERY_AT_LEAST_RESET, recovery(SuggestedAction.CONTACT_SUPPORT), False),
]


@pytest.mark.parametrize(("condition", "fault", "matches"), EVENT_CASES)
def test_event_conditions(loop_factory: Any, condition: dict[str, Any], fault: Event, matches: bool) -> None:
    loop = loop_factory([make_rule(match=condition, actions=["alertmanager"])])
    decisions = loop.run(T0, [fault], snapshot())
    assert kinds(decisions) == (["alertmanager"] if matches else [])
    if matches:
        assert decisions[0].event == fault
        assert decisions[0].target == Target(fault.gpu, fault.uuid)


THROTTLE = {"throttle": {"reasons": ["hw_thermal_slowdown", "sw_thermal_slowdown"], "held_seconds": 60}}


@pytest.mark.parametrize(
    ("active", "matches"),
    [
        ({(1, "hw_thermal_slowdown"): T0 - 61}, True),
        ({(1, "hw_thermal_slowdown"): T0 - 60}, True),
        ({(1, "hw_thermal_slowdown"): T0 - 59}, False),  # not held long enough yet
        ({(1, "sw_power_cap"): T0 - 600}, False),  # a reason the rule does not name
        ({}, False),
    ],
)
def test_throttle_condition(loop_factory: Any, active: dict[tuple[int, str], float], matches: bool) -> None:
    loop = loop_factory([make_rule(match=THROTTLE, actions=["alertmanager"])])
    decisions = loop.run(T0, snap=snapshot(throttle_active_since=active))
    assert kinds(decisions) == (["alertmanager"] if matches else [])
    if matches:
        (decision,) = decisions
        assert decision.target == Target(1, gpu_uuid(1))
        assert decision.event.kind is EventKind.THROTTLE_STARTED
        assert decision.event.severity is Severity.CRITICAL  # hardware slowdown
        since = active[(1, "hw_thermal_slowdown")]
        assert decision.event.key == f"throttle:{gpu_uuid(1)}:hw_thermal_slowdown:{since:.3f}/r"
        assert decision.event.data["held_seconds"] == T0 - since


def test_throttle_episode_is_one_fault(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(match=THROTTLE, actions=["alertmanager"], cooldown_seconds=0)])
    since = T0 - 61
    assert kinds(loop.run(T0, snap=snapshot(T0, throttle_active_since={(2, "sw_thermal_slowdown"): since}))) == [
        "alertmanager"
    ]
    # The same episode, still held, on later loops and after an agent restart: nothing new.
    assert loop.run(T0 + 5, snap=snapshot(T0 + 5, throttle_active_since={(2, "sw_thermal_slowdown"): since})) == []
    loop.reopen(T0 + 10)
    assert loop.run(T0 + 10, snap=snapshot(T0 + 10, throttle_active_since={(2, "sw_thermal_slowdown"): since})) == []
    # It ended and a new one began: a new fault once it is held long enough.
    again = T0 + 100
    assert loop.run(T0 + 130, snap=snapshot(T0 + 130, throttle_active_since={(2, "sw_thermal_slowdown"): again})) == []
    assert kinds(
        loop.run(T0 + 161, snap=snapshot(T0 + 161, throttle_active_since={(2, "sw_thermal_slowdown"): again}))
    ) == ["alertmanager"]


def test_two_throttle_rules_with_different_hold_times_each_see_the_episode(loop_factory: Any) -> None:
    short = make_rule("short", match=THROTTLE, actions=["alertmanager"])
    long = make_rule(
        "long", match={"throttle": {"reasons": ["hw_thermal_slowdown"], "held_seconds": 300}}, actions=["alertmanager"]
    )
    loop = loop_factory([short, long])
    active = {(0, "hw_thermal_slowdown"): T0}
    assert [d.rule for d in loop.run(T0 + 61, snap=snapshot(T0 + 61, throttle_active_since=active))] == ["short"]
    assert [d.rule for d in loop.run(T0 + 301, snap=snapshot(T0 + 301, throttle_active_since=active))] == ["long"]


def test_throttle_gpu_filter(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(match=THROTTLE, actions=["alertmanager"], gpus=[0, 1])])
    active = {(1, "hw_thermal_slowdown"): T0 - 100, (3, "hw_thermal_slowdown"): T0 - 100}
    assert [d.target.gpu for d in loop.run(T0, snap=snapshot(throttle_active_since=active))] == [1]


SERVICE_RULE = {"service_unhealthy": {"probes": 3}}


@pytest.mark.parametrize(
    ("condition", "services", "expected"),
    [
        (SERVICE_RULE, [service("sglang", 3)], ["sglang"]),
        (SERVICE_RULE, [service("sglang", 2)], []),
        (SERVICE_RULE, [service("vllm", 7), service("sglang", 4)], ["sglang", "vllm"]),  # sorted by name
        (
            {"service_unhealthy": {"probes": 3, "services": ["vllm"]}},
            [service("sglang", 9), service("vllm", 3)],
            ["vllm"],
        ),
        (SERVICE_RULE, [ServiceStatus("sglang", "sglang.service", up=None)], []),
    ],
)
def test_service_unhealthy_condition(
    loop_factory: Any, condition: dict[str, Any], services: list[ServiceStatus], expected: list[str]
) -> None:
    loop = loop_factory([make_rule(match=condition, actions=["restart_service"])], {"sglang": [0], "vllm": [1]})
    decisions = loop.run(T0, snap=snapshot(services=tuple(services)))
    assert [d.target for d in decisions] == [Target(service=name) for name in expected]
    assert [d.action.params for d in decisions if d.action] == [{"service": name} for name in expected]


def test_service_down_escalates_while_it_stays_down(loop_factory: Any) -> None:
    rule = make_rule(
        match=SERVICE_RULE,
        actions=["restart_service"],
        cooldown_seconds=300,
        max_attempts=3,
        on_exhausted=[{"alertmanager": {"summary": "page the on-call"}}],
    )
    loop = loop_factory([rule])
    seen: list[tuple[float, str | None, int]] = []
    for second in range(0, 1500, 5):  # one loop every 5 s, the service never comes back
        now = T0 + second
        for decision in loop.run(now, snap=snapshot(now, services=(service("sglang", 3 + second // 5),))):
            seen.append((second, decision.action.kind if decision.action else None, decision.step))
    # Restarts at 0, 300, 600 (cooldown), the circuit at the next loop after the third cooldown; no
    # "still in cooldown" decision on any of the loops between.
    assert seen == [
        (0, "restart_service", 0),
        (300, "restart_service", 0),
        (600, "restart_service", 0),
        (900, "alertmanager", EXHAUSTED_STEP),
    ]


# -- escalation, cooldown, attempts ---------------------------------------------------------------


def test_escalation_follows_the_ladder_and_repeats_the_last_step(loop_factory: Any) -> None:
    rule = make_rule(
        match={"xid": {"codes": [48]}},
        actions=["reset_gpu", "recommend_reboot", {"alertmanager": {"summary": "page the on-call"}}],
        cooldown_seconds=0,
        max_attempts=5,
    )
    loop = loop_factory([rule])
    steps = []
    for n in range(5):
        (decision,) = loop.run(T0 + n * 60, [xid(48, at=T0 + n * 60)])
        steps.append((decision.attempt, decision.step, decision.action.kind if decision.action else None))
    assert steps == [
        (1, 0, "reset_gpu"),
        (2, 1, "recommend_reboot"),
        (3, 2, "alertmanager"),
        (4, 2, "alertmanager"),
        (5, 2, "alertmanager"),
    ]
    assert loop.store.remediations()[2].params["summary"] == "page the on-call"


def test_cooldown_suppresses_with_time_left(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(cooldown_seconds=300, max_attempts=10)])
    assert kinds(loop.run(T0, [xid(48, at=T0)])) == ["reset_gpu"]
    (suppressed,) = loop.run(T0 + 60, [xid(48, at=T0 + 60)])
    assert suppressed.action is None
    assert suppressed.reason == "cooldown: 240 s left"
    (again,) = loop.run(T0 + 301, [xid(48, at=T0 + 301)])
    assert (again.action is not None, again.attempt, again.step) == (True, 2, 0)


def test_attempts_slide_out_of_the_window(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(actions=["reset_gpu", "recommend_reboot"], cooldown_seconds=0, max_attempts=2)])
    assert kinds(loop.run(T0, [xid(48, at=T0)])) == ["reset_gpu"]
    assert kinds(loop.run(T0 + 60, [xid(48, at=T0 + 60)])) == ["recommend_reboot"]
    # An hour after the first two the window is empty again: the ladder starts over, no circuit.
    (decision,) = loop.run(T0 + HOUR + 61, [xid(48, at=T0 + HOUR + 61)])
    assert (kinds([decision]), decision.attempt) == (["reset_gpu"], 1)


@pytest.mark.parametrize("restart_between_faults", [False, True])
def test_ten_faults_give_three_actions_then_one_circuit(loop_factory: Any, restart_between_faults: bool) -> None:
    rule = make_rule(
        match={"xid": {"codes": [48]}},
        actions=["reset_gpu", "recommend_reboot"],
        cooldown_seconds=60,
        max_attempts=3,
        window_seconds=HOUR,
        on_exhausted=[{"alertmanager": {"summary": "page the on-call"}}],
    )
    loop = loop_factory([rule])
    decisions: list[Decision] = []
    for n in range(10):
        now = T0 + n * 120  # every 2 minutes: past the cooldown, all ten within the hour
        if restart_between_faults and n:
            loop.reopen(now)
        decisions += loop.run(now, [xid(48, gpu=3, at=now)])
    assert len(decisions) == 10
    ladder = [d for d in decisions if d.action is not None and d.step >= 0]
    assert kinds(ladder) == ["reset_gpu", "recommend_reboot", "recommend_reboot"]
    assert [d.attempt for d in ladder] == [1, 2, 3]
    exhausted = [d for d in decisions if d.step == EXHAUSTED_STEP]
    assert kinds(exhausted) == ["alertmanager"]
    assert decisions.index(exhausted[0]) == 3
    assert all(d.action is None and d.reason.startswith("circuit open") for d in decisions[4:])
    (circuit,) = loop.store.circuits()
    assert (circuit.rule, circuit.target_key, circuit.gpu, circuit.uuid) == ("r", f"gpu:{gpu_uuid(3)}", 3, gpu_uuid(3))


def test_circuit_without_on_exhausted_is_a_decision_without_action(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(cooldown_seconds=0, max_attempts=1)])
    assert kinds(loop.run(T0, [xid(48, at=T0)])) == ["reset_gpu"]
    (opening,) = loop.run(T0 + 1, [xid(48, at=T0 + 1)])
    assert (opening.action, opening.step) == (None, EXHAUSTED_STEP)
    assert "circuit opens" in opening.reason
    assert [c.rule for c in loop.store.circuits()] == ["r"]
    (after,) = loop.run(T0 + 2, [xid(48, at=T0 + 2)])
    assert after.action is None and after.step != EXHAUSTED_STEP and after.reason.startswith("circuit open")


def test_repeats_within_one_call_count_too(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(cooldown_seconds=0, max_attempts=2, on_exhausted=["recommend_reboot"])])
    decisions = loop.run(T0, [xid(48, at=T0 + i / 10, key=f"k{i}") for i in range(5)])
    # Two resets of one GPU in one evaluation would be pointless: the second is a duplicate (not an
    # attempt), so attempts 2.. keep running into the duplicate until the window fills another way.
    assert kinds(decisions)[0] == "reset_gpu"
    assert decisions[1].action is None and decisions[1].reason.startswith("duplicate: reset_gpu of GPU 0")
    loop2 = loop_factory(
        [
            make_rule(
                "n", actions=["alertmanager"], cooldown_seconds=0, max_attempts=2, on_exhausted=["recommend_reboot"]
            )
        ]
    )
    decisions = loop2.run(T0, [xid(48, at=T0 + i / 10, key=f"k{i}") for i in range(5)])
    assert kinds(decisions) == ["alertmanager", "alertmanager", "recommend_reboot", None, None]
    assert [d.attempt for d in decisions[:3]] == [1, 2, 3]


def test_cooldown_counts_decisions_of_the_same_call(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(actions=["alertmanager"], cooldown_seconds=300)])
    decisions = loop.run(T0, [xid(48, at=T0, key="a"), xid(48, at=T0, key="b")])
    assert kinds(decisions) == ["alertmanager", None]
    assert decisions[1].reason == "cooldown: 300 s left"


def test_wall_clock_stepped_back_does_not_stretch_the_cooldown(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(cooldown_seconds=300, max_attempts=10)])
    assert kinds(loop.run(T0, [xid(48, at=T0)])) == ["reset_gpu"]
    # The clock jumped back a day: the last attempt looks a day in the future, not "in cooldown for a day".
    assert kinds(loop.run(T0 - 86400, [xid(48, at=T0 - 86400)])) == ["reset_gpu"]


# -- ack -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("selector", ["r", "all", "gpu:3", f"gpu:{gpu_uuid(3)}", gpu_uuid(3)])
def test_ack_rearms_the_rule(loop_factory: Any, selector: str) -> None:
    loop = loop_factory([make_rule(actions=["reset_gpu", "recommend_reboot"], cooldown_seconds=0, max_attempts=2)])
    for n in range(4):
        loop.run(T0 + n, [xid(48, gpu=3, at=T0 + n)])
    assert loop.store.circuit_open("r", f"gpu:{gpu_uuid(3)}")
    assert loop.store.ack(selector, now_seconds=T0 + 10) == 1
    assert not loop.store.circuit_open("r", f"gpu:{gpu_uuid(3)}")
    (decision,) = loop.run(T0 + 20, [xid(48, gpu=3, at=T0 + 20)])
    assert (kinds([decision]), decision.attempt, decision.step) == (["reset_gpu"], 1, 0)


def test_ack_of_another_rule_or_gpu_changes_nothing(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(cooldown_seconds=0, max_attempts=1)])
    for n in range(3):
        loop.run(T0 + n, [xid(48, gpu=3, at=T0 + n)])
    assert loop.store.ack("other-rule") == 0
    assert loop.store.ack("gpu:2") == 0
    assert loop.store.ack("service:sglang") == 0
    assert loop.run(T0 + 10, [xid(48, gpu=3, at=T0 + 10)])[0].action is None


def test_ack_by_service_for_gpu_faults_aimed_at_services(loop_factory: Any) -> None:
    rule = make_rule(match={"xid": {"codes": [13]}}, actions=["restart_service"], cooldown_seconds=0, max_attempts=1)
    loop = loop_factory([rule], {"sglang": [0, 1], "vllm": [2, 3]})
    loop.run(T0, [xid(13, gpu=2, at=T0, pid=7, process_service="vllm")])
    loop.run(T0 + 1, [xid(13, gpu=3, at=T0 + 1, pid=7, process_service="vllm")])  # opens vllm's circuit
    assert loop.store.circuit_open("r", "service:vllm")
    assert loop.store.ack("service:vllm") == 1
    assert kinds(loop.run(T0 + 2, [xid(13, gpu=3, at=T0 + 2, pid=7, process_service="vllm")])) == ["restart_service"]


# -- handled events ---------------------------------------------------------------------------


def test_handled_events_never_come_back_after_a_restart(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(cooldown_seconds=0, max_attempts=10)])
    fault = xid(48, at=T0)
    assert kinds(loop.run(T0, [fault])) == ["reset_gpu"]
    assert loop.run(T0 + 5, [fault]) == []  # a watcher that reports it again
    loop.reopen(T0 + 10)
    assert loop.run(T0 + 10, [fault]) == []
    # Even handed straight to the engine, bypassing record_event: the history says handled.
    assert evaluate(None, [fault], loop.rules, loop.store, T0 + 20, {}) == []
    assert [r.event_key for r in loop.store.remediations()] == [fault.key]


def test_duplicate_keys_in_one_call_are_one_fault(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(cooldown_seconds=0, max_attempts=10, actions=["alertmanager"])])
    fault = xid(48, at=T0)
    assert len(evaluate(None, [fault, fault, fault], loop.rules, loop.store, T0, {})) == 1


# -- dry run ------------------------------------------------------------------------------------


def test_dry_run_rules_decide_count_and_escalate_without_acting(loop_factory: Any) -> None:
    loop = loop_factory(
        [make_rule(actions=["reset_gpu", "recommend_reboot"], cooldown_seconds=0, max_attempts=2, dry_run=True)]
    )
    decisions = [d for n in range(3) for d in loop.run(T0 + n, [xid(48, at=T0 + n)])]
    assert [d.dry_run for d in decisions] == [True, True, True]
    assert kinds(decisions) == ["reset_gpu", "recommend_reboot", None]
    assert decisions[2].step == EXHAUSTED_STEP
    assert [r.outcome for r in loop.store.remediations()] == [Outcome.DRY_RUN, Outcome.DRY_RUN, Outcome.SUPPRESSED]


def test_dry_run_rule_does_not_block_a_live_reset(loop_factory: Any) -> None:
    dry = make_rule("dry", dry_run=True)
    live = make_rule("live")
    loop = loop_factory([dry, live])
    decisions = loop.run(T0, [xid(48, at=T0)])
    assert [(d.rule, d.dry_run, kinds([d])[0]) for d in decisions] == [
        ("dry", True, "reset_gpu"),
        ("live", False, "reset_gpu"),
    ]


# -- targets -------------------------------------------------------------------------------------

SERVICES: ServiceGpus = {"sglang": [0, 1], "vllm": [2, 3], "embed": "all"}
# Any Xid a rule restarts services for; not an app-level one (those restart only the faulting
# process's service, below).
GPU_RULE = {"xid": {"codes": [92]}}


def test_gpu_fault_restarts_each_service_on_that_gpu(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(match=GPU_RULE, actions=["restart_service", "reset_gpu"])], SERVICES)
    decisions = loop.run(T0, [xid(92, gpu=2, at=T0)])
    assert [d.target for d in decisions] == [Target(2, gpu_uuid(2), "embed"), Target(2, gpu_uuid(2), "vllm")]
    assert [d.action.params for d in decisions if d.action] == [{"service": "embed"}, {"service": "vllm"}]


def test_escalation_is_counted_per_service_and_a_gpu_reset_decided_once(loop_factory: Any) -> None:
    loop = loop_factory(
        [make_rule(match=GPU_RULE, actions=["restart_service", "reset_gpu"], cooldown_seconds=0)], SERVICES
    )
    loop.run(T0, [xid(92, gpu=2, at=T0)])
    decisions = loop.run(T0 + 1, [xid(92, gpu=2, at=T0 + 1)])
    assert [(d.target.service, kinds([d])[0], d.step) for d in decisions] == [
        ("embed", "reset_gpu", 1),
        ("vllm", None, 1),
    ]
    assert (
        decisions[1].reason
        == "duplicate: reset_gpu of GPU 2 already decided in this evaluation by rule r for service:embed"
    )
    assert decisions[0].target.gpu == 2


def test_an_xid_storm_across_gpus_restarts_a_shared_service_once(loop_factory: Any) -> None:
    loop = loop_factory(
        [make_rule(match=GPU_RULE, actions=["restart_service"], cooldown_seconds=300)], {"sglang": "all"}
    )
    decisions = loop.run(T0, [xid(92, gpu=g, at=T0 + g / 100) for g in range(8)])
    assert kinds(decisions) == ["restart_service"] + [None] * 7
    assert {d.target.key for d in decisions} == {"service:sglang"}


def test_named_service_and_unknown_gpu(loop_factory: Any) -> None:
    named = make_rule("named", match=GPU_RULE, actions=[{"restart_service": {"service": "sglang"}}])
    loop = loop_factory([named], SERVICES)
    assert [d.target for d in loop.run(T0, [xid(92, gpu=3, at=T0)])] == [Target(3, gpu_uuid(3), "sglang")]
    any_service = make_rule("any", match=GPU_RULE, actions=["restart_service"])
    loop = loop_factory([any_service], SERVICES)
    decisions = loop.run(T0, [xid(92, gpu=None, at=T0)])
    assert [d.target for d in decisions] == [Target(None, None, s) for s in ("embed", "sglang", "vllm")]


def test_restart_with_no_service_on_the_gpu_is_suppressed(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(match=GPU_RULE, actions=["restart_service"])], {"sglang": [0]})
    (decision,) = loop.run(T0, [xid(92, gpu=1, at=T0)])
    assert decision.action is None and decision.target == Target(1, gpu_uuid(1))
    assert "no service uses GPU 1" in decision.reason


def test_uuid_and_index_are_completed_from_the_snapshot(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(actions=["alertmanager"], cooldown_seconds=0, max_attempts=10)])
    (by_index,) = loop.run(T0, [event(EventKind.XID, gpu=2, uuid=None, xid=48, key="a")], snapshot())
    (by_uuid,) = loop.run(T0, [event(EventKind.XID, gpu=None, uuid=gpu_uuid(1), xid=48, key="b")], snapshot())
    assert by_index.target == Target(2, gpu_uuid(2))
    assert by_uuid.target == Target(1, gpu_uuid(1))


def test_gpu_filter_and_node_targets(loop_factory: Any) -> None:
    some = make_rule("some", actions=["alertmanager"], gpus=[0])
    every = make_rule("every", actions=["alertmanager"])
    loop = loop_factory([some, every])
    assert [(d.rule, d.target) for d in loop.run(T0, [xid(48, gpu=1, at=T0)])] == [("every", Target(1, gpu_uuid(1)))]
    # A fault whose GPU is unknown: a rule limited to some GPUs cannot tell, one for all GPUs targets the node.
    assert [(d.rule, d.target) for d in loop.run(T0, [xid(48, gpu=None, at=T0 + 1)])] == [("every", Target())]


def test_reset_without_a_gpu_is_suppressed(loop_factory: Any) -> None:
    loop = loop_factory([make_rule()])
    (decision,) = loop.run(T0, [xid(48, gpu=None, at=T0)])
    assert decision.action is None and decision.reason == "reset_gpu: the fault names no GPU"


def test_gpus_by_service_reads_agent_config() -> None:
    from agent.config import config_from_text

    config = config_from_text("services:\n  - {name: sglang, gpus: [0, 1]}\n  - {name: vllm}\n")
    assert gpus_by_service(config.services) == {"sglang": [0, 1], "vllm": "all"}


# -- determinism -----------------------------------------------------------------------------------


def test_output_does_not_depend_on_input_order(tmp_path: Path) -> None:
    rules = [
        make_rule("app", match=GPU_RULE, actions=["restart_service"], cooldown_seconds=0, max_attempts=3),
        make_rule("reset", actions=["reset_gpu"], cooldown_seconds=0),
        make_rule("lost", match={"gpu_lost": {}}, actions=["recommend_reboot"]),
    ]
    faults = [xid(92, gpu=g % 4, at=T0 + (g % 3)) for g in range(6)] + [xid(48, gpu=g, at=T0) for g in range(4)]
    faults += [event(EventKind.GPU_LOST, gpu=g, at=T0 + 2) for g in (1, 3)]
    results = []
    for seed in range(5):
        shuffled = faults[:]
        random.Random(seed).shuffle(shuffled)
        with Store.open(tmp_path / f"s{seed}", now_seconds=T0) as store:
            decisions = evaluate(snapshot(), shuffled, rules, store, T0, SERVICES)
        results.append([(d.rule, d.event.key, d.target, kinds([d]), d.reason) for d in decisions])
        times = [d.event.timestamp_seconds for d in decisions]
        assert times == sorted(times)  # oldest events first
    assert all(result == results[0] for result in results)


#: What the kernel log names for an Xid in sglang's own process.
SGLANG_PROCESS: dict[str, Any] = {"pid": 4242, "process": "python3", "process_service": "sglang"}


def test_app_level_xid_restarts_only_the_faulting_process_service(loop_factory: Any) -> None:
    rules = [make_rule(match={"xid": {"codes": [13]}}, actions=["restart_service"], cooldown_seconds=0)]
    loop = loop_factory(rules, SERVICES)
    (mine,) = loop.run(T0, [xid(13, gpu=2, at=T0, pid=7, process="python3", process_service="vllm")])
    assert (mine.target, kinds([mine])) == (Target(2, gpu_uuid(2), "vllm"), ["restart_service"])
    (theirs,) = loop.run(T0 + 1, [xid(13, gpu=2, at=T0 + 1, pid=8, process="x", process_service=None)])
    assert theirs.action is None and theirs.target == Target(2, gpu_uuid(2))
    assert "pid 8 (x) belongs to no configured service" in theirs.reason
    named = make_rule("named", match={"xid": {"codes": [13]}}, actions=[{"restart_service": {"service": "embed"}}])
    loop = loop_factory([named], SERVICES)
    (other,) = loop.run(T0, [xid(13, gpu=2, at=T0, pid=7, process="python3", process_service="vllm")])
    assert other.action is None and "belongs to service vllm, not one this rule restarts" in other.reason


def test_the_rest_of_a_burst_is_cooldown_not_exhaustion(loop_factory: Any) -> None:
    loop = loop_factory(
        [
            make_rule(
                match={"xid": {"codes": [13, 45]}}, actions=["restart_service"], cooldown_seconds=300, max_attempts=1
            )
        ]
    )
    assert kinds(loop.run(T0, [xid(13, at=T0, **SGLANG_PROCESS)])) == ["restart_service"]
    (burst,) = loop.run(T0 + 1, [xid(45, at=T0 + 1, **SGLANG_PROCESS)])
    assert burst.reason == "cooldown: 299 s left"
    assert loop.store.circuits() == []
    (later,) = loop.run(T0 + 400, [xid(13, at=T0 + 400, **SGLANG_PROCESS)])
    assert (later.step, later.reason.split(":")[0]) == (
        EXHAUSTED_STEP,
        "1 attempts within 3600 s reached max_attempts 1",
    )


def test_evaluate_only_reads_the_history(loop_factory: Any) -> None:
    loop = loop_factory([make_rule(cooldown_seconds=0, max_attempts=10)])
    loop.run(T0, [xid(48, at=T0)])
    faults = [xid(48, gpu=g, at=T0 + 1) for g in range(3)]
    first = evaluate(snapshot(), faults, loop.rules, loop.store, T0 + 1, {})
    second = evaluate(snapshot(), faults, loop.rules, loop.store, T0 + 1, {})
    assert first == second
    assert [d.attempt for d in first] == [2, 1, 1]
    assert len(loop.store.remediations()) == 1
    assert not any(loop.store.handled(f.key) for f in faults)
