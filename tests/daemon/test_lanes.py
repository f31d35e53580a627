"""Lanes, not one queue (agent.daemon.lanes, agent.daemon.action_worker, agent.rules.actions.footprint):
a job waits only for an earlier one that touches one of its GPUs, an alert or a reboot recommendation
never waits, and a repair ends only the sweep on its own GPUs."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from action_kinds import ActionKind, action_spec
from helpers import FakeClock, WaitingTask, live_parts, make_event, wait_until

from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.daemon import action_worker
from agent.daemon.action_worker import ActionWorker
from agent.daemon.lanes import LaneJob, Lanes
from agent.rules.actions.footprint import footprint
from agent.rules.actions.kind import Footprint, Lane
from agent.rules.model import ActionOutcome, Decision, Outcome, Target
from agent.store.database import Store


class Gate:
    """A job's work that says when it ran and waits until it is let go."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.go = threading.Event()
        self.ran = threading.Event()

    def __call__(self) -> None:
        self.log.append(self.name)
        self.ran.set()
        assert self.go.wait(10)


def test_a_job_waits_only_for_the_earlier_jobs_it_overlaps() -> None:
    lanes = Lanes()
    log: list[str] = []
    gates = {name: Gate(name, log) for name in ("gpu0", "gpu1", "gpu0-again", "node", "gpu1-later", "alert")}
    jobs = [
        ("gpu0", Lane.GPUS, frozenset({0})),
        ("gpu1", Lane.GPUS, frozenset({1})),
        ("gpu0-again", Lane.GPUS, frozenset({0})),
        ("node", Lane.NODE, None),
        ("gpu1-later", Lane.GPUS, frozenset({1})),
        ("alert", Lane.NOTIFY, frozenset()),
    ]
    for name, lane, gpus in jobs:
        lanes.put(LaneJob(name, lane, gpus, gates[name]))
    lanes.start()
    for name in ("gpu0", "gpu1", "alert"):  # nothing before them overlaps them
        assert gates[name].ran.wait(5), name
    assert not gates["gpu0-again"].ran.wait(0.2), "GPU 0 is taken"
    gates["gpu0"].go.set()
    assert gates["gpu0-again"].ran.wait(5)
    gates["gpu1"].go.set()
    # The whole-node job waits for every job before it, and the GPU 1 job after it waits for it.
    assert not gates["node"].ran.wait(0.2) and not gates["gpu1-later"].ran.is_set()
    gates["gpu0-again"].go.set()
    assert gates["node"].ran.wait(5) and not gates["gpu1-later"].ran.wait(0.2)
    gates["node"].go.set()
    assert gates["gpu1-later"].ran.wait(5)
    for gate in gates.values():
        gate.go.set()
    assert lanes.stop(5) == []
    assert log.index("gpu0") < log.index("gpu0-again") < log.index("node") < log.index("gpu1-later")


def decision(kind: ActionKind, gpu: int, key: str) -> Decision:
    return Decision(f"rule-{key}", make_event(gpu=gpu, key=key), Target(gpu=gpu), action_spec(kind), 0, 1, "", False)


def test_a_repair_ends_only_the_sweep_on_its_gpus_and_an_alert_ends_none(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state")
    clock = FakeClock()
    ran: list[str] = []
    # The footprint of each decision is its kind's (a reset: its GPU; no services are configured).
    worker = ActionWorker(live=live_parts(AgentConfig(), clock, store=store, context=lambda: ran.append("ran")))
    task = WaitingTask(frozenset({0}))
    worker.start()
    try:
        worker.lanes.submit_task(task)
        assert task.started.wait(5)
        worker.submit(decision(ActionKind.RECOMMEND_REBOOT, 1, "xid79"), clock())
        worker.submit(decision(ActionKind.RESET_GPU, 1, "xid48"), clock())
        wait_until(lambda: len(ran) == 2, 5, "the recommendation and the reset on GPU 1 run beside the sweep")
        assert not task.aborted.is_set()
        worker.submit(decision(ActionKind.RESET_GPU, 0, "xid48-gpu0"), clock())
        assert task.aborted.wait(5) and task.reason == "remediation rule-xid48-gpu0 needs the node"
        wait_until(lambda: len(ran) == 3, 5, "the reset of GPU 0 once the sweep gave it back")
    finally:
        worker.stop(5)
        store.close()


SERVICES = [
    ServiceConfig(name="a", gpus=[0, 1]),
    ServiceConfig(name="b", gpus=[2, 3]),
    ServiceConfig(name="everywhere", gpus="all"),
]


@pytest.mark.parametrize(
    ("kind", "gpu", "options", "expected"),
    [
        (ActionKind.RESTART_SERVICE, 0, {"service": "a"}, frozenset({0, 1})),
        (ActionKind.RESTART_SERVICE, 2, {"service": "b"}, frozenset({2, 3})),
        (ActionKind.RESTART_SERVICE, 0, {"service": "everywhere"}, None),
        (ActionKind.RESTART_SERVICE, 0, {"service": "gone"}, frozenset()),
        (ActionKind.RESET_GPU, 5, {}, None),  # "everywhere" runs on it too: it stops the whole node's service
        (ActionKind.RUN_HOOK, 0, {"argv": ["/bin/true"]}, None),
        (ActionKind.REBOOT, 0, {}, None),
        (ActionKind.WEBHOOK, 0, {"url": "http://127.0.0.1:9/"}, frozenset()),
        (ActionKind.RECOMMEND_REBOOT, 0, {}, frozenset()),
        (ActionKind.ALERTMANAGER, 0, {}, frozenset()),
    ],
)
def test_the_footprint_of_each_action_kind(
    kind: ActionKind, gpu: int, options: dict[str, object], expected: Footprint
) -> None:
    config = AgentConfig(services=SERVICES)
    spec = action_spec(kind, options)
    chosen = Decision("rule", make_event(gpu=gpu), Target(gpu=gpu), spec, 0, 1, "", False)
    assert footprint(chosen, config) == expected


def test_a_reset_touches_its_gpu_and_every_gpu_of_the_services_it_stops() -> None:
    config = AgentConfig(services=SERVICES[:2])
    spec = action_spec(ActionKind.RESET_GPU)
    for gpu, expected in ((1, {0, 1}), (3, {2, 3}), (6, {6})):
        chosen = Decision("rule", make_event(gpu=gpu), Target(gpu=gpu), spec, 0, 1, "", False)
        assert footprint(chosen, config) == frozenset(expected)


def test_only_a_reset_that_worked_gives_its_gpu_a_fresh_xid_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kind that clears its GPU's Xid history (reset_gpu) does, once it succeeded; nothing else does."""
    went = {"reset-ok": Outcome.SUCCESS, "reset-failed": Outcome.FAILED, "restart-ok": Outcome.SUCCESS}
    monkeypatch.setattr(action_worker, "execute", lambda d, _ctx: ActionOutcome(d, went[d.event.key], "", 0.0, 0.0))
    store = Store.open(tmp_path / "state")
    clock = FakeClock()
    live = live_parts(AgentConfig(), clock, store=store, context=SimpleNamespace)
    worker = ActionWorker(live=live)
    fresh: list[int] = []
    monkeypatch.setattr(live.watchers.xid, "clear", fresh.append)
    worker.start()
    try:
        worker.submit(decision(ActionKind.RESET_GPU, 1, "reset-ok"), clock())
        worker.submit(decision(ActionKind.RESET_GPU, 2, "reset-failed"), clock())
        worker.submit(decision(ActionKind.RESTART_SERVICE, 3, "restart-ok"), clock())
        wait_until(
            lambda: all(r.outcome is not Outcome.RUNNING for r in store.remediations()), 5, "the three actions done"
        )
    finally:
        worker.stop(5)
        store.close()
    assert fresh == [1]
