"""The shipped rules (rules/*.yaml) and the rules-file loader.

The default rules are run through the real engine and store: a table of faults and the first
action each one gets, the Xid catalog's verdict for every code, and the escalations that matter
in the field (Xid 79 is never met with a reset, however often it repeats).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
from action_kinds import ActionKind
from helpers import make_event
from snapshots import gpu_uuid, h200_snapshot

from agent.config import ConfigError
from agent.events import Event, EventKind, SuggestedAction
from agent.rules.actions.raise_alert import alerts_of
from agent.rules.config import Rule, load_rules
from agent.rules.engine import EXHAUSTED_STEP, evaluate
from agent.rules.model import ActionOutcome, Decision, Outcome, Target
from agent.services.latency_cause import CauseFinding, SloBreach, regression_event
from agent.state import NodeSnapshot, ServiceFigures, ServiceStatus
from agent.store.database import Store
from agent.watch import xid_catalog
from agent.watch.kernel_log import RECOVERY_ACTION_XID

RULES_DIR = Path(__file__).resolve().parents[2] / "rules"
T0 = 1_780_000_000.0
HOUR = 3600.0


def default_rules() -> list[Rule]:
    return load_rules([RULES_DIR])


def event(
    kind: EventKind, gpu: int | None = 3, at: float = T0, suggested: SuggestedAction = SuggestedAction.NONE, **data: Any
) -> Event:
    """An event on GPU 3 at `at`; the remedy it suggests is part of its key (two remedies, two faults)."""
    key = f"{kind.value}:{gpu}:{sorted(data.items())}:{suggested.value}:{at:.3f}"
    return make_event(kind, gpu, timestamp_seconds=at, key=key, suggested_action=suggested, **data)


def xid(code: int, gpu: int = 3, at: float = T0, pid: int | None = 4242, owner: str | None = "sglang") -> Event:
    """An Xid the kernel log reported for process `pid`, a process of service `owner` (None: nobody's)."""
    return event(EventKind.XID, gpu=gpu, at=at, xid=code, pid=pid, process="python3", process_service=owner)


def snapshot(at: float = T0, **fields: Any) -> NodeSnapshot:
    return h200_snapshot(at, 8, **fields)


class Node:
    """An 8-GPU node serving sglang on every GPU, with the default rules and a real store."""

    def __init__(self, state_dir: Path) -> None:
        self.rules = default_rules()
        self.store = Store.open(state_dir, now_seconds=T0)

    def run(self, now: float, events: Iterable[Event] = (), snap: NodeSnapshot | None = None) -> list[Decision]:
        fresh = [e for e in events if self.store.record_event(e)]
        decisions = evaluate(snap or snapshot(now), fresh, self.rules, self.store, now, {"sglang": "all"})
        for decision in decisions:
            result = Outcome.SUPPRESSED if decision.action is None else Outcome.SUCCESS
            self.store.record_outcome(ActionOutcome(decision, result, "", now, now))
        for fresh_event in fresh:
            self.store.mark_handled(fresh_event.key)
        return decisions


@pytest.fixture
def node(tmp_path: Path) -> Any:
    built = Node(tmp_path)
    yield built
    built.store.close()


def gpu_match(gpu: int | None) -> dict[str, str]:
    return {} if gpu is None else {"gpu": str(gpu), "uuid": gpu_uuid(gpu)}


def actions(decisions: Sequence[Decision]) -> list[tuple[str, str]]:
    return [(d.rule, d.action.kind) for d in decisions if d.action is not None]


# -- the shipped files ------------------------------------------------------------------------------


def test_default_rules_load_without_reboot_permission() -> None:
    rules = default_rules()
    assert [r.name for r in rules][:2] == ["xid-restart-service", "xid-reset-gpu"]  # 10-xid.yaml first
    assert len({r.name for r in rules}) == len(rules)
    assert all(r.description for r in rules)
    assert all(step.kind != ActionKind.REBOOT for r in rules for step in (*r.actions, *r.on_exhausted))
    assert all(re.fullmatch(r".*/rules/\d\d-[a-z-]+\.yaml:\d+", r.source) for r in rules)


def test_every_default_rule_says_why() -> None:
    files = sorted(RULES_DIR.glob("*.yaml"))
    assert len(files) >= 4
    for file in files:
        lines = file.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.startswith("  - name:"):
                before = [text for text in lines[:number] if text.strip()]
                assert before[-1].strip().startswith("#"), f"{file.name}:{number + 1} has no comment above it"


FIRST_ACTIONS = [
    # (fault, expected (rule, action) decisions on its first occurrence)
    (xid(13), [("xid-restart-service", "restart_service")]),
    (xid(31), [("xid-restart-service", "restart_service")]),
    (xid(43), [("xid-restart-service", "restart_service")]),
    (xid(45), [("xid-restart-service", "restart_service")]),
    (xid(94), [("xid-restart-service", "restart_service")]),
    (xid(48), [("xid-reset-gpu", "reset_gpu")]),
    (xid(64), [("xid-reset-gpu", "reset_gpu")]),
    (xid(95), [("xid-reset-gpu", "reset_gpu")]),
    (xid(119), [("xid-reset-gpu", "reset_gpu")]),
    (xid(79), [("xid-board-fault", "recommend_reboot")]),
    (xid(110), [("xid-board-fault", "recommend_reboot")]),
    (xid(92), [("xid-notify", "alertmanager")]),
    (xid(54), [("xid-notify", "alertmanager")]),
    (xid(145), [("xid-notify", "alertmanager")]),
    (xid(63), []),  # the pending remap is reported by the memory watcher (row-remap-pending-alert)
    (xid(154), []),  # the recovery action it names comes as a RECOVERY_ACTION event
    (event(EventKind.GPU_LOST, suggested=SuggestedAction.REBOOT), [("gpu-lost", "recommend_reboot")]),
    (event(EventKind.GPU_RESET_REQUIRED, suggested=SuggestedAction.RESET_GPU), [("gpu-reset-required", "reset_gpu")]),
    (
        event(EventKind.RECOVERY_ACTION, suggested=SuggestedAction.RESET_GPU, recovery_action="GPU Reset Required"),
        [("gpu-reset-required", "reset_gpu")],
    ),
    (
        event(EventKind.RECOVERY_ACTION, suggested=SuggestedAction.REBOOT, recovery_action="Node Reboot Required"),
        [("driver-requests-reboot", "recommend_reboot")],
    ),
    (event(EventKind.RECOVERY_ACTION, suggested=SuggestedAction.ALERT, recovery_action="Drain P2P"), []),
    (event(EventKind.ECC_UNCORRECTED, new_errors=1), [("ecc-uncorrected-alert", "alertmanager")]),
    (event(EventKind.ECC_CORRECTED, new_errors=12), []),
    (event(EventKind.ROW_REMAP_FAILED), [("row-remap-failed-alert", "alertmanager")]),
    (event(EventKind.ROW_REMAP_PENDING), [("row-remap-pending-alert", "alertmanager")]),
    (event(EventKind.THROTTLE_STARTED, reason="hw_thermal_slowdown"), []),  # the held state decides, not the edge
    (event(EventKind.PCIE_DEGRADED), []),
    (event(EventKind.NVLINK_ERRORS, suggested=SuggestedAction.ALERT), [("nvlink-alert", "alertmanager")]),
    (event(EventKind.NVLINK_DOWN, suggested=SuggestedAction.RESET_GPU), [("nvlink-alert", "alertmanager")]),
    (event(EventKind.NVLINK_UP), []),
    (
        event(EventKind.FABRIC_UNREGISTERED, suggested=SuggestedAction.RESTART_SERVICE),
        [("fabric-unregistered-alert", "alertmanager")],
    ),
]


def fault_id(fault: Event) -> str:
    if fault.kind is EventKind.XID:
        return f"xid{fault.data['xid']}"
    return f"{fault.kind.value}-{fault.suggested_action.value}"


@pytest.mark.parametrize(("fault", "expected"), FIRST_ACTIONS, ids=[fault_id(f) for f, _ in FIRST_ACTIONS])
def test_first_action_for_each_fault(node: Node, fault: Event, expected: list[tuple[str, str]]) -> None:
    decisions = node.run(T0, [fault])
    assert actions(decisions) == expected
    if expected:
        target = decisions[0].target
        assert (target.gpu, target.uuid) == (3, gpu_uuid(3))
    if expected and expected[0][1] == "restart_service":
        assert decisions[0].target == Target(3, gpu_uuid(3), "sglang")


@pytest.mark.parametrize(
    ("active", "expected"),
    [
        ({(5, "hw_thermal_slowdown"): T0 - 61}, [("clock-slowdown-held", "alertmanager")]),
        ({(5, "sw_thermal_slowdown"): T0 - 90}, [("clock-slowdown-held", "alertmanager")]),
        ({(5, "hw_power_brake_slowdown"): T0 - 60}, [("clock-slowdown-held", "alertmanager")]),
        ({(5, "hw_thermal_slowdown"): T0 - 30}, []),
        ({(5, "sw_power_cap"): T0 - 3000}, []),  # the power limiter doing its job
        # One hardware slowdown raises two reasons: one alert for the GPU.
        ({(5, "hw_slowdown"): T0 - 61, (5, "hw_thermal_slowdown"): T0 - 61}, [("clock-slowdown-held", "alertmanager")]),
    ],
)
def test_held_slowdowns(node: Node, active: dict[tuple[int, str], float], expected: list[tuple[str, str]]) -> None:
    assert actions(node.run(T0, snap=snapshot(throttle_active_since=active))) == expected


@pytest.mark.parametrize(("failures", "expected"), [(2, []), (3, [("service-unhealthy-restart", "restart_service")])])
def test_service_probe_failures(node: Node, failures: int, expected: list[tuple[str, str]]) -> None:
    status = ServiceStatus("sglang", "sglang.service", up=False, consecutive_failures=failures)
    assert actions(node.run(T0, snap=snapshot(services=(status,)))) == expected


def latency_regression(finding: CauseFinding, at: float = T0) -> Event:
    """The event the daemon makes of a breached SLO (agent.services.latency_cause), not a hand-built copy."""
    figures = ServiceFigures("sglang", "sglang", at, 300.0, running=9, waiting=0)
    return regression_event("sglang", [SloBreach("e2e_p95", 2.1, 1.5, 120)], finding, figures, at)


@pytest.mark.parametrize(
    ("finding", "target_gpu"),
    [
        (CauseFinding("thermal_slowdown", 4, gpu_uuid(4), "GPU 4 thermal slowdown for 42 s at 91 C"), 4),
        (CauseFinding("queueing", None, None, "queueing: waiting requests grew from 0 to 40 on clean GPUs"), None),
    ],
)
def test_a_latency_regression_alerts_with_its_cause_and_never_restarts(
    node: Node, finding: CauseFinding, target_gpu: int | None
) -> None:
    decisions = node.run(T0, [latency_regression(finding)])
    assert actions(decisions) == [("service-latency-regression-alert", "alertmanager")]
    assert decisions[0].target.gpu == target_gpu
    assert decisions[0].action is not None
    # the step raises the service's InferenceLatencyAboveSlo, whose `event` text carries the cause
    assert alerts_of(decisions[0]) == (["InferenceLatencyAboveSlo"], {"service": "sglang"} | gpu_match(target_gpu))
    assert decisions[0].event.message == f"service sglang: e2e p95 2.10 s > 1.5 s; likely cause: {finding.summary}"
    # Still breached later: never a restart, whatever the ladder reaches.
    later = [latency_regression(finding, T0 + k * 1000) for k in range(1, 12)]
    assert {a for _, a in actions([d for e in later for d in node.run(e.timestamp_seconds, [e])])} <= {"alertmanager"}


# NVIDIA's catalog action for a code -> the action the default rules start with.
CATALOG_TO_RULE_ACTION = {
    "restart_service": ["restart_service"],
    "reset_gpu": ["reset_gpu"],
    "reboot": [
        "recommend_reboot"
    ],  # the agent recommends; rebooting takes remediation.allow_reboot and a rule of your own
    "alert": ["alertmanager"],
    "none": [],
}


def test_default_xid_rules_follow_the_catalog(tmp_path: Path) -> None:
    rules = default_rules()
    mismatches = []
    for code, info in sorted(xid_catalog.catalog().entries.items()):
        if info.name == "Unused" or code == RECOVERY_ACTION_XID:
            continue
        with Store.open(tmp_path / str(code), now_seconds=T0) as store:
            decisions = evaluate(snapshot(), [xid(code)], rules, store, T0, {"sglang": "all"})
        got = [d.action.kind for d in decisions if d.action is not None]
        if got != CATALOG_TO_RULE_ACTION[info.action]:
            mismatches.append((code, info.action, got))
    assert mismatches == []


def test_xid_rules_resolve_the_catalog_when_they_load(tmp_path: Path) -> None:
    text = (
        "rules:\n"
        "  - name: resets\n    match:\n      xid: {catalog_action: reset_gpu}\n    actions: [reset_gpu]\n"
        "  - name: notify\n    match:\n      xid: {catalog_action: [alert, reboot], except_codes: [154, 79]}\n"
        "    actions: [alertmanager]\n"
        "  - name: listed\n    match:\n      xid: {codes: [13], buckets: [RESET_GPU]}\n    actions: [alertmanager]\n"
    )
    resets, notify, listed = load_rules([write(tmp_path, "10-x.yaml", text)])
    catalog = xid_catalog.catalog().entries
    assert resets.match.xid is not None and notify.match.xid is not None and listed.match.xid is not None
    assert resets.match.xid.resolved_codes == {
        c for c, info in catalog.items() if info.action is SuggestedAction.RESET_GPU
    }
    assert {48, 64, 95} <= resets.match.xid.resolved_codes
    assert notify.match.xid.resolved_codes == {
        c for c, info in catalog.items() if info.action in (SuggestedAction.ALERT, SuggestedAction.REBOOT)
    } - {154, 79}
    assert listed.match.xid.resolved_codes == {13} | {
        c for c, info in catalog.items() if info.resolution == "RESET_GPU"
    }
    # A code the catalog lacks is judged "alert": it follows catalog_action alert, not an explicit list.
    assert xid_catalog.lookup(900) is None
    assert notify.match.xid.matches(900) and not resets.match.xid.matches(900) and not listed.match.xid.matches(900)
    assert not notify.match.xid.matches(79) and not notify.match.xid.matches(154)
    assert notify.match.xid.matches(110)  # catalog action reboot


def test_shipped_xid_rules_copy_no_code_lists() -> None:
    text = (RULES_DIR / "10-xid.yaml").read_text()
    conditions = [line.strip() for line in text.splitlines() if line.strip().startswith("xid:")]
    assert conditions == [
        "xid: {catalog_action: restart_service}",
        "xid: {catalog_action: reset_gpu}",
        "xid: {catalog_action: reboot}",
        "xid: {catalog_action: alert, except_codes: [154]}",
    ]


# -- escalations that matter ------------------------------------------------------------------------


def test_xid_79_is_never_met_with_a_reset(node: Node) -> None:
    seen: list[Decision] = []
    for n in range(48):  # every 30 minutes for a day, through both watchers
        now = T0 + n * 1800
        seen += node.run(now, [xid(79, at=now), event(EventKind.GPU_LOST, at=now, suggested=SuggestedAction.REBOOT)])
    assert not any(d.action is not None and d.action.kind == ActionKind.RESET_GPU for d in seen)
    assert {d.action.kind for d in seen if d.action is not None} == {ActionKind.RECOMMEND_REBOOT}
    # Both watchers seeing the same loss in the same loop: one recommendation, the other a duplicate.
    assert len(actions(seen[:2])) == 1
    assert [d.reason.split(":")[0] for d in seen[:2] if d.action is None] == ["duplicate"]


def test_app_xids_restart_three_times_an_hour_then_alert(node: Node) -> None:
    decisions = []
    for n in range(8):
        now = T0 + n * 400  # past the 300 s cooldown each time
        decisions += node.run(now, [xid(13, gpu=n % 8, at=now)])
    assert actions(decisions) == [("xid-restart-service", "restart_service")] * 3 + [
        ("xid-restart-service", "alertmanager")
    ]
    assert decisions[3].step == EXHAUSTED_STEP  # GpuAgentRemediationFailing for the rule, raised at once
    assert alerts_of(decisions[3]) == (["GpuAgentRemediationFailing"], {"rule": "xid-restart-service"})
    assert all(d.action is None for d in decisions[4:])
    assert node.store.ack("service:sglang") == 1
    assert actions(node.run(T0 + 5000, [xid(13, at=T0 + 5000)])) == [("xid-restart-service", "restart_service")]


@pytest.mark.parametrize("code", [13, 31, 43])
def test_another_users_app_xid_restarts_nothing(node: Node, code: int) -> None:
    """Any local CUDA user can make an app-level Xid on a GPU sglang uses: it is that process's fault."""
    (decision,) = node.run(T0, [xid(code, pid=5151, owner=None)])
    assert decision.action is None
    assert decision.reason == (
        "restart_service: the faulting process pid 5151 (python3) belongs to no configured service:"
        " no service restarted"
    )
    (unknown,) = node.run(T0 + 1, [xid(code, at=T0 + 1, pid=None, owner=None)])
    assert unknown.action is None and "the faulting process is unknown" in unknown.reason
    assert actions(node.run(T0 + 2, [xid(code, at=T0 + 2)])) == [("xid-restart-service", "restart_service")]


def test_reset_class_xid_resets_then_recommends_a_reboot_then_alerts(node: Node) -> None:
    kinds = []
    for n in range(4):
        now = T0 + n * 700  # past the 600 s cooldown
        kinds += [d.action.kind if d.action else None for d in node.run(now, [xid(48, at=now)])]
    assert kinds == ["reset_gpu", "recommend_reboot", "alertmanager", None]


def test_a_service_that_stays_down_is_restarted_three_times_then_alerted(node: Node) -> None:
    got = []
    for second in range(0, 3600, 10):
        now = T0 + second
        status = ServiceStatus("sglang", "sglang.service", up=False, consecutive_failures=3 + second // 10)
        got += [(second, d.action.kind) for d in node.run(now, snap=snapshot(now, services=(status,))) if d.action]
    assert got == [(0, "restart_service"), (300, "restart_service"), (600, "restart_service"), (900, "alertmanager")]


# -- the loader ----------------------------------------------------------------------------------------


def write(directory: Path, name: str, text: str, mode: int = 0o644) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    path.chmod(mode)
    return path


def problems(paths: Sequence[Path], allow_reboot: bool = False) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_rules(paths, allow_reboot=allow_reboot)
    return [str(p) for p in caught.value.problems]


GOOD = """\
rules:
  - name: one
    match: {gpu_lost: }
    actions: [recommend_reboot]
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "rules:\n  - name: a\n    match: {gpu_lost: {}}\n    actions:\n      - restart: {}\n",
            ":5 rules[0].actions[0].restart: unknown key (did you mean 'restart_service'?)",
        ),
        (
            "rules:\n  - name: a\n    match:\n      gpu_lost: {}\n      ecc_uncorrected: {}\n    actions: [reset_gpu]\n",
            ":3 rules[0].match: needs exactly one condition (got gpu_lost, ecc_uncorrected)",
        ),
        (
            "rules:\n  - name: a\n    match: {gpu_lost: {}}\n    actions:\n      - {reset_gpu: {}, alertmanager: {}}\n",
            ":5 rules[0].actions[0]: needs exactly one action kind per step (write two steps for two actions) (got reset_gpu, alertmanager)",
        ),
        (
            "rules:\n  - name: a\n    match:\n      xid: {buckets: [RESTART_APPS]}\n    actions: [reset_gpu]\n",
            ":4 rules[0].match.xid.buckets: unknown resolution bucket RESTART_APPS",
        ),
        (
            "rules:\n  - name: a\n    match:\n      xid: {}\n    actions: [reset_gpu]\n",
            ":4 rules[0].match.xid: needs codes, buckets and/or catalog_action",
        ),
        (
            "rules:\n  - name: a\n    match:\n      xid: {catalog_action: check_mechanicals}\n    actions: [reset_gpu]\n",
            ":4 rules[0].match.xid: no Xid has catalog action check_mechanicals (the catalog uses: alert, none, reboot,",
        ),
        (
            "rules:\n  - name: a\n    match:\n      xid: {catalog_action: [reboot, reboots]}\n    actions: [reset_gpu]\n",
            ":4 rules[0].match.xid.catalog_action[1]: must be 'none', 'alert', 'restart_service', 'check_mechanicals',",
        ),
        (
            "rules:\n  - name: a\n    match:\n      xid: {codes: [13, 48], except_codes: [48]}\n    actions: [reset_gpu]\n",
            ":4 rules[0].match.xid: codes 48 are both listed and excepted",
        ),
        (
            "rules:\n  - name: a\n    match:\n      throttle: {reasons: [gpu_idle]}\n    actions: [alertmanager]\n",
            ":4 rules[0].match.throttle.reasons: not a slowdown reason: gpu_idle",
        ),
        (
            "rules:\n  - name: a\n    match: {gpu_lost: {}}\n    actions:\n      - run_hook: {argv: [drain.sh]}\n",
            ":5 rules[0].actions[0].run_hook.argv: the program must be an absolute path, not 'drain.sh'",
        ),
        (
            "rules:\n  - name: a\n    match: {gpu_lost: {}}\n    actions:\n      - webhook: {url: ftp://x}\n",
            ":5 rules[0].actions[0].webhook.url: must be an http:// or https:// URL",
        ),
        (
            "rules:\n  - name: a\n    match: {gpu_lost: {}}\n    actions: [alertmanager: {annotations: {bad-name: x}}]\n",
            ":4 rules[0].actions[0].alertmanager.annotations: not a Prometheus label name: bad-name",
        ),
        (
            "rules:\n  - name: a\n    match: {gpu_lost: {}}\n    actions: []\n",
            ":4 rules[0].actions: List should have at least 1 item after validation, not 0",
        ),
        (
            "rules:\n  - name: a\n    match: {gpu_lost: {}}\n    actions: [reset_gpu]\n    max_attempts: 0\n",
            ":5 rules[0].max_attempts: must be >= 1",
        ),
        (
            "rules:\n  - name: a\n    match: {gpu_lost: {}}\n    actions: [reset_gpu]\n    window_seconds: 5000000\n",
            ":5 rules[0].window_seconds: must be <= 2.592e+06",
        ),
        (
            "rules:\n  - name: Bad Name\n    match: {gpu_lost: {}}\n    actions: [reset_gpu]\n",
            ":2 rules[0].name: must be lowercase letters, digits, '-', '_' and '.'",
        ),
        (
            "rules:\n  - name: all\n    match: {gpu_lost: {}}\n    actions: [reset_gpu]\n",
            ":2 rules[0].name: 'all' is reserved",
        ),
        (
            "rules:\n  - name: a\n    match: {service_unhealthy: {}}\n    actions: [reset_gpu]\n",
            ":2 rules[0]: reset_gpu needs a GPU: service_unhealthy faults have none",
        ),
        (
            "rules:\n  - name: a\n    match: {service_unhealthy: {}}\n    gpus: [0]\n    actions: [restart_service]\n",
            ":2 rules[0]: gpus does not apply to service_unhealthy",
        ),
        ("rules:\n  - name: a\n    match: {gpu_lost: {}\n", ":4: invalid YAML"),
        ("- just\n- a list\n", ":1: must be a YAML mapping with a `rules` list"),
        ("rules:\n  - name: a\n    name: b\n", ":3 rules[0].name: duplicate key"),
        ("rule:\n  - name: a\n", ":1 rule: unknown key (did you mean 'rules'?)"),
    ],
)
def test_rule_file_errors_name_file_and_line(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, "10-bad.yaml", text)
    found = problems([tmp_path])
    assert any(p.startswith(str(path) + expected) for p in found), found


def test_reboot_needs_permission_from_agent_config(tmp_path: Path) -> None:
    text = "rules:\n  - name: lost\n    match: {gpu_lost: {}}\n    actions:\n      - recommend_reboot\n      - reboot\n"
    path = write(tmp_path, "50-reboot.yaml", text)
    assert problems([tmp_path]) == [
        f"{path}:6 rules[0].actions[1].reboot: not allowed: set remediation.allow_reboot: true in agent.yaml to let rules reboot"
    ]
    (rule,) = load_rules([tmp_path], allow_reboot=True)
    assert [step.kind for step in rule.actions] == [ActionKind.RECOMMEND_REBOOT, ActionKind.REBOOT]


def test_duplicate_rule_names_across_files_name_both(tmp_path: Path) -> None:
    first = write(tmp_path, "10-a.yaml", GOOD)
    second = write(tmp_path, "20-b.yaml", "# another file\n" + GOOD)
    assert problems([tmp_path]) == [f"{second}:3 rules[0].name: duplicate rule name 'one', first defined at {first}:2"]


def test_problems_of_every_file_are_reported_together(tmp_path: Path) -> None:
    write(tmp_path, "10-a.yaml", "rules:\n  - name: a\n    match: {nope: {}}\n    actions: [reset_gpu]\n")
    write(tmp_path, "20-b.yaml", "rules:\n  - name: b\n    match: {gpu_lost: {}}\n    actions: [explode]\n")
    found = problems([tmp_path])
    assert [p.split(" ")[0].rsplit("/", 1)[1] for p in found] == ["10-a.yaml:3", "20-b.yaml:4"]


def test_files_in_name_order_skipping_others(tmp_path: Path) -> None:
    write(tmp_path, "20-b.yaml", GOOD.replace("one", "b"))
    write(tmp_path, "10-a.yaml", GOOD.replace("one", "a"))
    write(tmp_path, "15-old.yaml.dpkg-old", GOOD.replace("one", "old"))
    write(tmp_path, ".#10-a.yaml", GOOD.replace("one", "lock"))
    write(tmp_path, "README", "not rules")
    extra = write(tmp_path / "elsewhere", "extra.yaml", GOOD.replace("one", "extra"))
    assert [r.name for r in load_rules([tmp_path, extra])] == ["a", "b", "extra"]
    assert load_rules([write(tmp_path / "empty", "00-empty.yaml", "")]) == []


def test_shorthands(tmp_path: Path) -> None:
    (rule,) = load_rules([write(tmp_path, "r.yaml", GOOD)])
    assert rule.match.kind == "gpu_lost"
    assert [step.spec().kind for step in rule.actions] == [ActionKind.RECOMMEND_REBOOT]
    assert rule.source == f"{tmp_path / 'r.yaml'}:2"
    assert (rule.cooldown_seconds, rule.max_attempts, rule.window_seconds, rule.dry_run, rule.gpus) == (
        300.0,
        3,
        3600.0,
        False,
        "all",
    )


def test_writable_by_others_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "10-a.yaml", GOOD, mode=0o666)
    assert problems([tmp_path]) == [
        f"{path}: refused: {path} is writable by group or others (mode 0666): whoever can change it controls"
        f" what gpu-agent does as root; run `chmod go-w {path}`"
    ]


def test_a_rules_dir_others_may_write_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "rules.d", "10-a.yaml", GOOD)
    (tmp_path / "rules.d").chmod(0o777)
    assert problems([tmp_path / "rules.d"]) == [
        f"{tmp_path / 'rules.d'}: refused: {tmp_path / 'rules.d'} is writable by group or others (mode 0777)"
    ]


def test_missing_rules_dir_is_an_error(tmp_path: Path) -> None:
    assert problems([tmp_path / "rules.d"]) == [f"{tmp_path / 'rules.d'}: no such file or directory"]


def test_a_dangling_or_looping_rules_link_says_so(tmp_path: Path) -> None:
    (tmp_path / "gone.yaml").symlink_to(tmp_path / "deleted.yaml")
    (tmp_path / "loop.yaml").symlink_to("loop.yaml")
    assert problems([tmp_path / "gone.yaml", tmp_path / "loop.yaml"]) == [
        f"{tmp_path / 'gone.yaml'}: broken symbolic link to {tmp_path / 'deleted.yaml'}",
        f"{tmp_path / 'loop.yaml'}: symbolic link loop",
    ]
