"""`gpu-agent events` names each event's GPU once."""

from __future__ import annotations

from helpers import make_event

from agent.events import EventKind
from agent.render import history_text
from agent.store.database import StoredEvent


def test_the_gpu_is_named_once_whether_or_not_the_message_names_it() -> None:
    named = make_event(EventKind.XID, 0, message="GPU 0 (00000000:3B:00.0): Xid 79, fallen off the bus")
    bare = make_event(EventKind.POLICY_DRIFT, 1, message="power_limit drifted (650 W, want 600 W)")
    text = history_text([StoredEvent(named, True), StoredEvent(bare, True)], [])
    assert "GPU 0 GPU 0" not in text
    assert "GPU 0 (00000000:3B:00.0): Xid 79" in text
    assert "GPU 1 power_limit drifted" in text
