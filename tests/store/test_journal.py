"""The remediation journal (agent.store.database, agent.daemon.action_worker) and the attempt clock
(agent.store.attempt_clock): an action is on record before it runs, recovery rolls back what a killed
run left down, and cooldowns count only time that really elapsed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from action_kinds import ActionKind, action_spec
from helpers import FakeClock, WaitingTask, live_parts, make_event, wait_until

from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.daemon.action_worker import ActionWorker, ClockHistory
from agent.events import EventKind
from agent.rules.actions.steps import services_left_down
from agent.rules.model import ActionOutcome, Decision, Outcome, Target
from agent.services.managers import CommandManager
from agent.store.attempt_clock import AttemptClock, ClockReading, elapsed_seconds
from agent.store.database import Store

BOOT = "boot-a"
GPU0 = Target(0, "GPU-0")


def decision(key: str = "e1", rule: str = "reset", action: ActionKind = ActionKind.RESET_GPU) -> Decision:
    event = make_event(key=key)
    return Decision(rule, event, GPU0, action_spec(action), 0, 1, "because", dry_run=False)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    opened = Store.open(tmp_path / "state")
    yield opened  # type: ignore[misc]
    opened.close()


def test_an_action_is_on_record_counted_and_its_event_handled_before_it_runs(store: Store) -> None:
    clock = FakeClock()
    chosen = decision()
    row_id = store.begin_remediation(chosen, AttemptClock(BOOT, clock.monotonic).reading(clock()))
    assert store.handled(chosen.event.key)
    (row,) = store.remediations()
    assert row.outcome is Outcome.RUNNING and row.counted
    assert store.attempts("reset", GPU0.key, 0.0) == [clock()]
    store.journal_step(row_id, "stopped sglang")
    store.journal_step(row_id, "reset GPU 0")
    (entry,) = store.running_remediations()
    assert entry.steps == ("stopped sglang", "reset GPU 0") and entry.action == "reset_gpu"
    store.finish_remediation(row_id, ActionOutcome(chosen, Outcome.SUCCESS, "all done", clock(), clock() + 3))
    store.close_interrupted(row_id, "late", clock() + 4)  # closed already: changes nothing, counts nothing
    (row,) = store.remediations()
    assert (row.outcome, row.detail, row.steps) == (Outcome.SUCCESS, "all done", ("stopped sglang", "reset GPU 0"))
    assert store.running_remediations() == []
    assert [(c.outcome, c.count) for c in store.remediation_counts()] == [("success", 1)]


def test_services_left_down_reads_the_steps_back() -> None:
    assert services_left_down(["stopped a", "stopped b", "reset GPU 0", "started a"]) == ["b"]
    assert services_left_down(["restarting a"]) == ["a"]
    assert services_left_down(["restarting a", "restarted a"]) == []


# -- recovery: a real command-managed "service" (shell scripts that log) ---------------------------


def command_service(tmp_path: Path, active: bool) -> tuple[ServiceConfig, Path]:
    log = tmp_path / "service.log"
    script = tmp_path / "svc.sh"
    script.write_text(f'#!/bin/sh\necho "$1" >> {log}\n[ "$1" != status ] || exit {0 if active else 3}\n')
    os.chmod(script, 0o755)
    service = ServiceConfig(
        name="sglang",
        manager="command",
        start_command=[str(script), "start"],
        stop_command=[str(script), "stop"],
        status_command=[str(script), "status"],
    )
    return service, log


def recovering_worker(store: Store, service: ServiceConfig) -> ActionWorker:
    live = live_parts(AgentConfig(services=[service]), FakeClock(), boot=BOOT, store=store)
    live.managers = lambda: {service.name: CommandManager()}  # type: ignore[method-assign]
    return ActionWorker(live=live)


@pytest.mark.parametrize("active", [False, True], ids=["down", "already-up"])
def test_recovery_starts_a_service_an_interrupted_reset_left_stopped(
    tmp_path: Path, store: Store, active: bool
) -> None:
    service, log = command_service(tmp_path, active)
    clock = FakeClock()
    row_id = store.begin_remediation(decision(), AttemptClock(BOOT, clock.monotonic).reading(clock()))
    store.journal_step(row_id, "stopped sglang")  # then the agent was killed
    worker = recovering_worker(store, service)
    worker.recover(store)
    worker.start()
    wait_until(lambda: not store.running_remediations(), 10, "the interrupted row closed")
    worker.stop(5)
    (row,) = store.remediations()
    assert row.outcome is Outcome.INTERRUPTED and row.counted
    assert "last step: stopped sglang" in row.detail
    if active:
        assert log.read_text().split() == ["status"] and "sglang already running" in row.detail
    else:
        assert log.read_text().split() == ["status", "start"] and "started sglang again" in row.detail


@pytest.mark.parametrize("earlier_boot", ["boot-before", ""], ids=["earlier-boot", "unknown-boot"])
def test_an_action_a_reboot_interrupted_is_reported_not_rolled_back(
    tmp_path: Path, store: Store, earlier_boot: str
) -> None:
    service, log = command_service(tmp_path, active=False)
    clock = FakeClock()
    row_id = store.begin_remediation(decision(), AttemptClock(earlier_boot, clock.monotonic).reading(clock()))
    store.journal_step(row_id, "stopped sglang")  # then the node rebooted
    worker = recovering_worker(store, service)  # this boot: BOOT
    worker.recover(store)
    worker.start()
    wait_until(lambda: not store.running_remediations(), 10, "the interrupted row closed")
    worker.stop(5)
    assert not log.exists(), "nothing was started, not even asked about"
    (row,) = store.remediations()
    assert row.outcome is Outcome.INTERRUPTED
    assert row.detail == (
        "interrupted on an earlier boot (last step: stopped sglang); not rolled back; it had stopped sglang,"
        " left as this boot has it"
    )
    (reported,) = [e for e in store.events() if e.event.kind is EventKind.REMEDIATION_INTERRUPTED]
    assert reported.handled
    assert reported.event.data["services_stopped"] == ["sglang"]
    assert reported.event.data["boot_id"] == (earlier_boot or None)


def test_a_queued_action_not_yet_started_at_stop_is_closed_not_run(tmp_path: Path, store: Store) -> None:
    ran = threading.Event()
    clock = FakeClock()
    worker = ActionWorker(live=live_parts(AgentConfig(), clock, boot=BOOT, store=store, context=ran.set))
    worker.submit(decision(), clock())
    worker.lanes.stopping.set()
    worker.start()
    worker.stop(5)
    assert not ran.is_set()
    (row,) = store.remediations()
    assert row.outcome is Outcome.INTERRUPTED and "not started" in row.detail
    assert not row.counted, "an action that never ran is no attempt"


# -- the attempt clock ------------------------------------------------------------------------------


def history_after(clock: FakeClock, store: Store, boot_now: str = BOOT) -> ClockHistory:
    return ClockHistory(store, AttemptClock(boot_now, clock.monotonic).reading(clock()))


def test_a_wall_clock_stepped_back_past_the_cooldown_does_not_skip_it(store: Store) -> None:
    clock = FakeClock()
    store.begin_remediation(decision(), AttemptClock(BOOT, clock.monotonic).reading(clock()))
    clock.advance(10)
    clock.step_wall(-400)  # more than a 300 s cooldown back
    last = history_after(clock, store).last_attempt("reset", GPU0.key)
    assert last is not None and clock() - last == pytest.approx(10.0)  # 290 s of cooldown left, not 0
    clock.step_wall(+7200)  # a forward step is not elapsed time either, within a boot
    last = history_after(clock, store).last_attempt("reset", GPU0.key)
    assert last is not None and clock() - last == pytest.approx(10.0)
    clock.advance(300)
    last = history_after(clock, store).last_attempt("reset", GPU0.key)
    assert last is not None and clock() - last == pytest.approx(310.0)


def test_window_counts_attempts_by_elapsed_time(store: Store) -> None:
    clock = FakeClock()
    store.begin_remediation(decision("e1"), AttemptClock(BOOT, clock.monotonic).reading(clock()))
    clock.advance(100)
    store.begin_remediation(decision("e2"), AttemptClock(BOOT, clock.monotonic).reading(clock()))
    clock.step_wall(-5000)
    history = history_after(clock, store)
    assert len(history.attempts("reset", GPU0.key, clock() - 3600)) == 2  # both still in a 1 h window
    assert len(history.attempts("reset", GPU0.key, clock() - 50)) == 1


def test_across_a_reboot_only_the_wall_clock_relates_readings_and_never_backwards() -> None:
    then = ClockReading(1000.0, "boot-a", 50.0)
    assert elapsed_seconds(then, ClockReading(1500.0, "boot-b", 5.0)) == 500.0
    assert elapsed_seconds(then, ClockReading(600.0, "boot-b", 5.0)) == 0.0
    assert elapsed_seconds(then, ClockReading(600.0, "boot-a", 80.0)) == 30.0
    assert elapsed_seconds(ClockReading(1000.0, "", 50.0), ClockReading(900.0, "", 80.0)) == 0.0  # unknown boot
    assert elapsed_seconds(ClockReading(1000.0, "boot-a", None), ClockReading(1200.0, "boot-a", 80.0)) == 200.0


def test_the_history_of_a_finished_action_still_counts_it(store: Store) -> None:
    clock = FakeClock()
    chosen = decision()
    row_id = store.begin_remediation(chosen, AttemptClock(BOOT, clock.monotonic).reading(clock()))
    store.finish_remediation(row_id, ActionOutcome(chosen, Outcome.FAILED, "no", clock(), clock()))
    clock.advance(5)
    assert len(history_after(clock, store).attempts("reset", GPU0.key, 0.0)) == 1


def test_an_action_with_nowhere_to_go_is_no_attempt(store: Store) -> None:
    """An alert with no Alertmanager configured tried nothing: it is on record as not configured,
    and does not use up its rule's attempts (nor open its circuit)."""
    clock = FakeClock()
    chosen = decision(rule="page", action=ActionKind.ALERTMANAGER)
    row_id = store.begin_remediation(chosen, AttemptClock(BOOT, clock.monotonic).reading(clock()))
    outcome = ActionOutcome(chosen, Outcome.NOT_CONFIGURED, "no Alertmanager configured", clock(), clock())
    store.finish_remediation(row_id, outcome)
    (row,) = store.remediations()
    assert (row.outcome, row.counted) == (Outcome.NOT_CONFIGURED, False)
    assert store.attempts("page", GPU0.key, 0.0) == []
    assert [(c.outcome, c.count) for c in store.remediation_counts()] == [("not_configured", 1)]


def test_a_decided_action_aborts_a_running_task_and_runs_after_it(store: Store) -> None:
    """A fault never waits for an experiment: the remediation aborts the sweep, then runs. An alert
    neither waits for the sweep nor ends it (a sweep's own cap raises alerts)."""
    ran: list[str] = []
    clock = FakeClock()
    live = live_parts(AgentConfig(), clock, boot=BOOT, store=store, context=lambda: ran.append("action"))
    worker = ActionWorker(live=live)
    task = WaitingTask()
    worker.start()
    worker.lanes.submit_task(task)
    assert task.started.wait(5)
    assert worker.lanes.busy() == "test task is running"
    worker.submit(decision("alert", rule="alert", action=ActionKind.ALERTMANAGER), clock())
    wait_until(lambda: ran == ["action"], 5, "the alert run beside the task")
    assert not task.aborted.is_set()
    worker.submit(decision(), clock())
    assert task.aborted.wait(5) and task.reason == "remediation reset needs the node"
    wait_until(lambda: ran == ["action", "action"], 5, "the action run once the task gave the node back")
    wait_until(lambda: worker.lanes.busy() is None, 5, "the worker idle again")
    worker.stop(5)


def test_stopping_the_worker_aborts_its_task(store: Store) -> None:
    clock = FakeClock()
    worker = ActionWorker(live=live_parts(AgentConfig(), clock, boot=BOOT, store=store))
    task = WaitingTask()
    worker.start()
    worker.lanes.submit_task(task)
    assert task.started.wait(5)
    worker.stop(5)
    assert task.reason == "the agent is stopping"
