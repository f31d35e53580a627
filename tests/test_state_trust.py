"""Trust at start: the state dir, the database and the socket's directory must be root's alone and be
what they claim (a directory, a regular file); a FIFO where the database should be hangs nothing."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from daemon_harness import running_agent, write_agent_config

from agent.host.paths import HostPaths
from agent.store.database import DB_NAME, Store, StoreError
from agent.trust import state_directory_problem
from agent.verdict import reboot_recommended

pytestmark = pytest.mark.real_daemon

T = TypeVar("T")
NOBODY = pwd.getpwnam("nobody").pw_uid


def finishes(seconds: float, work: Callable[[], T]) -> T:
    """`work()`'s answer or exception, failing the test (not hanging it) past `seconds`."""
    answer: list[T] = []
    raised: list[BaseException] = []

    def run() -> None:
        try:
            answer.append(work())
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if raised:
        raise raised[0]
    return answer[0]


def test_a_state_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, -1)
    with pytest.raises(StoreError, match=f"state_dir {state} is not safe: .*owned by uid {NOBODY}, not root"):
        Store.open(state)
    # Created under a directory someone else owns: refused before it exists.
    with pytest.raises(StoreError, match="not safe"):
        Store.open(state / "below")


def test_a_state_dir_others_can_write_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    with pytest.raises(StoreError, match="writable by group or others"):
        Store.open(state)


@pytest.mark.parametrize("name", [DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm"])
def test_a_fifo_in_place_of_the_database_is_refused_not_waited_on(tmp_path: Path, name: str) -> None:
    os.mkfifo(tmp_path / name, 0o600)
    with pytest.raises(StoreError, match="is a FIFO, not a regular file"):
        finishes(10, lambda: Store.open(tmp_path))


def test_a_database_that_is_a_symlink_or_someone_elses_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.db"
    Store.open(tmp_path / "first").close()
    os.replace(tmp_path / "first" / DB_NAME, elsewhere)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / DB_NAME).symlink_to(elsewhere)
    with pytest.raises(StoreError, match="is a symlink"):
        Store.open(tmp_path / "state")
    (tmp_path / "state" / DB_NAME).unlink()
    os.replace(elsewhere, tmp_path / "state" / DB_NAME)
    os.chown(tmp_path / "state" / DB_NAME, NOBODY, -1)
    with pytest.raises(StoreError, match=f"owned by uid {NOBODY}"):
        Store.open(tmp_path / "state")


def test_state_files_the_daemon_reads_back_never_hang_it(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "reboot-recommended")
    flag = finishes(10, lambda: reboot_recommended(tmp_path, HostPaths.at(tmp_path / "host")))
    assert flag == "reboot-recommended flag present (unreadable)"


def test_not_a_directory_is_named(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "state")
    assert state_directory_problem(tmp_path / "state", "state_dir") == (
        f"state_dir {tmp_path / 'state'}: {tmp_path / 'state'} is a FIFO, not a directory"
    )
    assert state_directory_problem(tmp_path / "new" / "state", "state_dir") is None  # created in a safe place


@pytest.mark.parametrize("which", ["state", "socket"])
def test_run_refuses_to_start_on_a_state_or_socket_dir_another_user_owns(tmp_path: Path, which: str) -> None:
    config, _ = write_agent_config(tmp_path)
    target = tmp_path / which
    target.mkdir(mode=0o755)
    if which == "socket":
        text = config.read_text().replace(str(tmp_path / "agent.sock"), str(target / "agent.sock"))
        config.write_text(text)
    os.chown(target, NOBODY, -1)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    what = "state_dir" if which == "state" else "api.socket's directory"
    assert f"gpu-agent: refusing to start: {what} {target}" in done.stderr
    assert f"owned by uid {NOBODY}, not root" in done.stderr
    assert time.monotonic() - started < 30


def test_a_fifo_at_the_database_hangs_neither_start_nor_sigterm(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir(mode=0o700)
    os.mkfifo(tmp_path / "state" / DB_NAME, 0o600)
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        agent.signal(signal.SIGTERM)
        assert agent.process.wait(timeout=15) == 0
    assert "is a FIFO, not a regular file" in agent.log()
