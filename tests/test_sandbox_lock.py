"""The systemd sandbox's host lock: a second run says it waits, and gives up with a message."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

import pytest
from systemd_sandbox import SandboxError, lock_or_wait


def test_a_held_lock_is_waited_for_with_a_message_then_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / ".running.lock"
    with open(path, "a+b") as holder, open(path, "a+b") as waiter:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(SandboxError, match=r"gave up after 2 s waiting for .*\.running\.lock: another test run"):
            lock_or_wait(waiter, "the sandbox", timeout_seconds=2)
    assert f"waiting up to 2 s for {path}, held by another test run (the sandbox)" in capfd.readouterr().err


def test_the_lock_is_taken_once_the_other_run_lets_go(tmp_path: Path) -> None:
    path = tmp_path / ".running.lock"
    with open(path, "a+b") as holder, open(path, "a+b") as waiter:
        fcntl.flock(holder, fcntl.LOCK_EX)
        threading.Timer(1.0, lambda: fcntl.flock(holder, fcntl.LOCK_UN)).start()
        lock_or_wait(waiter, "the sandbox", timeout_seconds=30)
        with open(path, "a+b") as third, pytest.raises(BlockingIOError):
            fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
