"""The shared test helpers do what the tests that use them rely on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import LONGEST_MODULES
from helpers import FakeClock, make_event, wait_until
from snapshots import gpu_uuid

from agent.events import EventKind


def test_wait_until_returns_the_first_true_result() -> None:
    answers = iter([None, [], ["ready"]])
    assert wait_until(lambda: next(answers), 1.0, "an answer", poll_seconds=0.001) == ["ready"]


def test_wait_until_names_what_it_waited_for() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="waiting for the moon"):
        wait_until(lambda: False, 0.05, "the moon")
    assert time.monotonic() - started >= 0.05
    seen = [3]
    with pytest.raises(AssertionError, match=r"waiting for recovery; still \[3\]"):
        wait_until(lambda: False, 0.01, lambda: f"recovery; still {seen}")


def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(wall_seconds=100.0, monotonic_seconds=5.0)
    assert (clock(), clock.wall(), clock.monotonic()) == (100.0, 100.0, 5.0)
    clock.advance(10)
    assert (clock(), clock.monotonic()) == (110.0, 15.0)
    clock.step_wall(-3600)  # NTP steps the wall clock back; monotonic time does not notice
    assert (clock(), clock.monotonic()) == (110.0 - 3600, 15.0)
    with pytest.raises(AssertionError):
        clock.advance(-1)


def test_make_event_defaults_follow_the_gpu() -> None:
    event = make_event(EventKind.XID, 2, xid=79)
    assert (event.gpu, event.uuid, event.data) == (2, gpu_uuid(2), {"xid": 79})
    assert make_event(EventKind.SERVICE_UNHEALTHY, None).uuid is None
    assert make_event(EventKind.XID, 2, xid=79).key == event.key
    assert make_event(EventKind.XID, 2, xid=13).key != event.key


def test_every_module_handed_out_first_exists() -> None:
    """A renamed module would silently drop out of the longest-first order (tests/conftest.py),
    and with it the balance of the two workers scripts/test runs."""
    tests = Path(__file__).parent
    assert [name for name in LONGEST_MODULES if not list(tests.rglob(name))] == []
