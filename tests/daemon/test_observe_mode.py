"""Observe mode in the remediator: what would change the node is recorded as a dry run and never
queued, counted as an attempt, so the ladder still reaches the steps that only tell someone, and
those run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import FakeClock, live_parts, make_event, wait_until
from snapshots import node_snapshot

from agent.config import AgentConfig, Mode
from agent.daemon import action_worker
from agent.daemon.remediator import Remediator
from agent.events import EventKind
from agent.rules.config import Rule
from agent.rules.model import ActionOutcome, Decision, Outcome
from agent.store.database import Store

RULE = {
    "name": "xid-48",
    "match": {"xid": {"codes": [48]}},
    "actions": ["reset_gpu", {"webhook": {"url": "http://127.0.0.1:9/hook"}}],
    "cooldown_seconds": 0,
}


def test_a_reset_is_recorded_as_a_dry_run_and_the_ladder_goes_on_to_its_webhook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []

    def carried_out(decision: Decision, _ctx: object) -> ActionOutcome:
        assert decision.action is not None
        ran.append(decision.action.kind)
        return ActionOutcome(decision, Outcome.SUCCESS, "sent", 0.0, 0.0)

    monkeypatch.setattr(action_worker, "execute", carried_out)
    clock = FakeClock()
    config = AgentConfig(mode=Mode.OBSERVE, state_dir=str(tmp_path / "state"))
    store = Store.open(tmp_path / "state")
    remediator = Remediator(live=live_parts(config, clock, store=store, context=SimpleNamespace))
    remediator.rules = [Rule.model_validate(RULE)]
    remediator.worker.start()
    try:
        for _fault in range(2):
            now = clock()
            remediator.remediate(node_snapshot(), [make_event(EventKind.XID, 0, xid=48, timestamp_seconds=now)], now)
            clock.advance(1.0)
        wait_until(lambda: all(r.outcome is not Outcome.RUNNING for r in store.remediations()), 5, "the webhook done")
        recorded = [(r.action, r.outcome, r.detail, r.counted) for r in store.remediations()]
    finally:
        remediator.worker.stop(5)
        store.close()
    assert ran == ["webhook"]  # the reset never reached the worker
    assert recorded == [
        ("reset_gpu", Outcome.DRY_RUN, "observe mode: would run reset_gpu on GPU 0 (rule xid-48)", True),
        ("webhook", Outcome.SUCCESS, "sent", True),
    ]
