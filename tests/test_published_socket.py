"""The socket a daemon publishes for the config it runs (agent/api.py, agent/daemon/socket_record.py):
`status` finds the daemon through it without reading the config, still finds it after the config
was edited (and says so), and falls back to the config when the record is missing, not trusted, not
about this config, or its socket is not the one the daemon bound."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import edit, running_agent, serving_daemon

from agent import api
from agent.defaults import DEFAULT_RUNTIME_DIR

pytestmark = pytest.mark.real_daemon

CHANGED = "has changed since the daemon read it"


def status(config_path: Path, runtime_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "status", *extra, "--config", str(config_path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, api.RUNTIME_DIR_VARIABLE: str(runtime_dir)},
    )


def record_of(config_path: Path, runtime_dir: Path) -> Path:
    found = api.published_path(str(config_path), str(runtime_dir))
    assert found is not None
    return Path(found)


def runtime_dir_of(tmp_path: Path) -> Path:
    """Where a daemon of `write_agent_config(tmp_path)` publishes: the runtime directory under its host_root."""
    return tmp_path / "host" / DEFAULT_RUNTIME_DIR.lstrip("/")


def test_status_reaches_the_daemon_that_runs_an_edited_config_and_says_so(tmp_path: Path) -> None:
    runtime_dir = runtime_dir_of(tmp_path)
    with serving_daemon(tmp_path, mode="observe") as (daemon, config_path, _):
        record = json.loads(record_of(config_path, runtime_dir).read_text())
        assert record["socket"] == daemon.live.config.api.socket
        assert record["state_dir"] == daemon.live.config.state_dir
        shown = json.loads(status(config_path, runtime_dir, "--json").stdout)
        assert (shown["source"], shown["note"]) == ("daemon", "")
        # The socket moved in the file, not yet reloaded: the published one is the daemon's.
        moved = tmp_path / "moved.sock"
        edit(config_path, f"socket: {daemon.live.config.api.socket}", f"socket: {moved}")
        shown = json.loads(status(config_path, runtime_dir, "--json").stdout)
        assert shown["source"] == "daemon"
        assert f"{config_path} {CHANGED}" in shown["note"]
        screen = status(config_path, runtime_dir).stdout
        assert "(daemon)" in screen.splitlines()[0] and CHANGED in screen
        # A reload that is refused (not YAML) leaves the record as it was: still the old file's.
        text = config_path.read_text()
        config_path.write_text("mode: [observe\n")
        assert daemon.reloader.reload() is False
        assert CHANGED in json.loads(status(config_path, runtime_dir, "--json").stdout)["note"]
        # Applied: the new socket is published with the file read, and nothing is said.
        config_path.write_text(text)
        assert daemon.reloader.reload() is True
        assert json.loads(record_of(config_path, runtime_dir).read_text())["socket"] == str(moved)
        shown = json.loads(status(config_path, runtime_dir, "--json").stdout)
        assert (shown["source"], shown["note"]) == ("daemon", "")
    assert not record_of(config_path, runtime_dir).exists(), "the record outlived its daemon"


def test_a_stopped_daemons_record_is_gone_and_a_killed_ones_matches_nothing(tmp_path: Path) -> None:
    runtime_dir = runtime_dir_of(tmp_path)
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        record = record_of(agent.config_path, runtime_dir)
        assert json.loads(record.read_text())["pid"] == agent.process.pid
        agent.process.send_signal(signal.SIGKILL)
        agent.process.wait()
    # Left behind, its socket file too: nobody listens on it, and status reads the node directly.
    assert record.exists()
    done = status(agent.config_path, runtime_dir, "--json")
    assert json.loads(done.stdout)["source"] == "direct", done.stderr
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        assert json.loads(record.read_text())["pid"] == agent.process.pid
        agent.signal(signal.SIGTERM)
        agent.process.wait(timeout=15)
    assert not record.exists()


@pytest.fixture
def published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path, socket.socket]]:
    """A config, a listening socket and the record naming both in a runtime directory status reads."""
    runtime_dir = tmp_path / "run"
    monkeypatch.setenv(api.RUNTIME_DIR_VARIABLE, str(runtime_dir))
    config_path = tmp_path / "agent.yaml"
    config_path.write_text("mode: observe\n")
    socket_path = tmp_path / "agent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind(str(socket_path))
        listening.listen()
        bound = os.stat(socket_path)
        record = record_of(config_path, runtime_dir)
        record.parent.mkdir(parents=True)
        record.write_text(
            api.published_record(
                str(config_path),
                api.file_identity(os.stat(config_path)),
                str(socket_path),
                [bound.st_dev, bound.st_ino],
                str(tmp_path / "state"),
            )
        )
        yield config_path, record, listening


def test_a_record_is_read_back_while_its_config_and_socket_are_the_ones_named(
    published: tuple[Path, Path, socket.socket],
) -> None:
    config_path, _record, listening = published
    found = api.read_published(str(config_path))
    assert found is not None
    assert (found.socket, found.state_dir) == (listening.getsockname(), str(config_path.parent / "state"))
    assert not found.config_changed()
    os.utime(config_path, ns=(1, 1))  # written again, same size: a change all the same
    assert found.config_changed()
    config_path.unlink()
    assert found.config_changed()


def test_a_record_others_could_have_written_is_not_read(published: tuple[Path, Path, socket.socket]) -> None:
    config_path, record, _ = published
    record.chmod(0o666)
    assert api.read_published(str(config_path)) is None
    record.chmod(0o644)
    record.parent.chmod(0o777)
    assert api.read_published(str(config_path)) is None
    record.parent.chmod(0o755)
    assert api.read_published(str(config_path)) is not None


def test_a_record_whose_socket_was_bound_again_is_not_read(published: tuple[Path, Path, socket.socket]) -> None:
    config_path, _, listening = published
    path = listening.getsockname()
    os.unlink(path)
    assert api.read_published(str(config_path)) is None  # gone
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as another:
        another.bind(path)  # another daemon on that path since
        assert api.read_published(str(config_path)) is None


@pytest.mark.parametrize(
    "change",
    [
        lambda r: {**r, "config": "/etc/gpu-agent/other.yaml"},
        lambda r: {**r, "schema": 2},
        lambda r: {**r, "socket": "relative.sock"},
        lambda r: {**r, "socket_file": [True, r["socket_file"][1]]},
        lambda r: {**r, "config_file": "yesterday"},
        lambda r: {**r, "state_dir": None},
        lambda r: [r],
        lambda r: {**r, "padding": "x" * api.MAX_PUBLISHED_BYTES},
    ],
    ids=["another config", "schema", "relative socket", "bool inode", "config file", "state_dir", "list", "too large"],
)
def test_a_record_that_does_not_hold_together_is_not_read(
    published: tuple[Path, Path, socket.socket], change: Callable[[Any], Any]
) -> None:
    config_path, record, _ = published
    assert api.read_published(str(config_path)) is not None
    record.write_text(json.dumps(change(json.loads(record.read_text()))))
    assert api.read_published(str(config_path)) is None


def test_the_record_is_named_as_systemd_escape_names_the_config_path() -> None:
    paths = ["/etc/gpu-agent/agent.yaml", "/srv/a b/é-1.yaml", "/.hidden/x:y_z.yaml", "//a//b/./c.yaml"]
    expected = {
        "/etc/gpu-agent/agent.yaml": "etc-gpu\\x2dagent-agent.yaml",
        "//a//b/./c.yaml": "a-b-c.yaml",
    }
    for path, name in expected.items():
        assert api.escaped_path(path) == name
    assert api.published_path("/" + "x" * 250) is not None  # 255 bytes with .json: the most a name holds
    assert api.published_path("/" + "x" * 251) is None
    if shutil.which("systemd-escape") is None:
        pytest.skip("systemd-escape not installed: the names above only")
    for path in paths:
        done = subprocess.run(["systemd-escape", "--path", path], capture_output=True, text=True, check=True)
        assert api.escaped_path(path) == done.stdout.strip(), path


def test_status_with_no_record_asks_the_configs_socket(tmp_path: Path) -> None:
    runtime_dir = runtime_dir_of(tmp_path)
    with serving_daemon(tmp_path, mode="observe") as (daemon, config_path, _):
        record_of(config_path, runtime_dir).unlink()
        shown = json.loads(status(config_path, runtime_dir, "--json").stdout)
        assert (shown["source"], shown["note"]) == ("daemon", "")
        # and the config's socket moved, not reloaded: the config names no daemon, the node is read
        edit(config_path, f"socket: {daemon.live.config.api.socket}", f"socket: {tmp_path / 'moved.sock'}")
        assert json.loads(status(config_path, runtime_dir, "--json").stdout)["source"] == "direct"
