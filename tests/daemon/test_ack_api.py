"""The status API's `ack` method (agent/daemon/ack_api.py) on a real store: what a request may ask,
and what an acknowledgement does to the daemon's own store and health window."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.api import ApiError
from agent.daemon.ack_api import MAX_SELECTOR_CHARS, ack_handlers
from agent.rules.model import Target
from agent.store.database import Store
from agent.watch.xid import XidMark

BOOT = "boot-1"


def daemon_live(store: Store | None, forget: Callable[[set[tuple[int, int]]], None] | None = None) -> SimpleNamespace:
    """What `ack` reads of the daemon's live parts (agent/daemon/live.py): its store, the boot its
    node memory is kept under, and the Xid watcher whose window an ack takes marks out of."""
    xid = SimpleNamespace(forget=forget or (lambda marks: None))
    return SimpleNamespace(store=store, memory_boot_id=BOOT, watchers=SimpleNamespace(xid=xid))


@pytest.mark.parametrize(
    ("params", "said"),
    [
        ({}, "ack needs a selector"),
        ({"selector": 7}, "ack needs a selector"),
        ({"selector": ""}, "ack needs a selector"),
        ({"selector": "x" * (MAX_SELECTOR_CHARS + 1)}, "ack needs a selector"),
        ({"selector": "gpu:" + "9" * 23}, "is not a GPU index (0-4294967295)"),
        ({"selector": "xid:1000@0"}, "Xid 1000 is not a code the driver reports (1-999)"),
    ],
)
def test_a_request_the_store_must_not_see_is_an_error(tmp_path: Path, params: dict[str, object], said: str) -> None:
    with Store.open(tmp_path) as store:
        ack = ack_handlers(daemon_live(store))["ack"]
        with pytest.raises(ApiError, match=re.escape(said)):
            ack(params)


def test_without_a_store_nothing_is_acknowledged() -> None:
    ack = ack_handlers(daemon_live(None))["ack"]
    with pytest.raises(ApiError, match="event store is not open"):
        ack({"selector": "all"})


def test_an_ack_rearms_in_the_store_and_takes_the_xids_out_of_the_window(tmp_path: Path) -> None:
    forgotten: list[set[tuple[int, int]]] = []
    with Store.open(tmp_path) as store:
        store.replace_xid_marks(BOOT, [XidMark(1, 48, "reset_gpu", "Xid 48", 1.0), XidMark(2, 13, "alert", "x", 1.0)])
        store.open_circuit("xid-reset-gpu", Target(gpu=1, uuid="GPU-1"), "attempts ran out")
        answer = ack_handlers(daemon_live(store, forgotten.append))["ack"]({"selector": "gpu:1"})
        assert answer == {"rearmed": 1, "gone": (), "cleared": ((1, 48),), "reboot": False}
        assert store.circuits() == [] and [(m.gpu, m.xid) for m in store.xid_marks(BOOT)] == [(2, 13)]
    assert forgotten == [{(1, 48)}]
