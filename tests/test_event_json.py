"""The one JSON form of an event: what `status --json`, `events --json` and the store's columns carry."""

from __future__ import annotations

import json

from helpers import make_event
from snapshots import TIMESTAMP_SECONDS, gpu_uuid, node_snapshot

from agent.documents import snapshot_document
from agent.events import EventKind, Severity, SuggestedAction, event_from_json, event_json


def test_event_json_fields_and_values() -> None:
    event = make_event(
        EventKind.XID,
        1,
        message="Xid 48 on GPU 1",
        source="nvml",
        suggested_action=SuggestedAction.RESET_GPU,
        xid=48,
    )
    assert event_json(event) == {
        "kind": "xid",
        "severity": "critical",
        "gpu": 1,
        "uuid": gpu_uuid(1),
        "message": "Xid 48 on GPU 1",
        "timestamp_seconds": TIMESTAMP_SECONDS,
        "source": "nvml",
        "suggested_action": "reset_gpu",
        "data": {"xid": 48},
    }


def test_event_from_json_is_the_inverse_through_json_text() -> None:
    event = make_event(EventKind.GPU_LOST, None, severity=Severity.FATAL, key="gpu_lost:node", reason="gone")
    document = json.loads(json.dumps(event_json(event)))
    back = event_from_json(document, event.key)
    assert back == event and back.data == event.data and back.suggested_action is event.suggested_action


def test_status_document_carries_event_json() -> None:
    snapshot = node_snapshot()
    document = snapshot_document(snapshot, source="daemon")
    assert document["recent_events"] == [event_json(e) for e in snapshot.recent_events]
