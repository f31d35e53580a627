"""A SIGHUP applies the new config whole or not at all: listeners move (the new one up before the
old one closes), and a change only a restart applies is refused whole and shown as attention."""

from __future__ import annotations

import grp
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from daemon_harness import edit, free_port, running_agent, serving_daemon
from helpers import wait_until

from agent import api, api_server
from agent.daemon.publisher import systemd_status_line

pytestmark = pytest.mark.real_daemon

WAIT_SECONDS = 10.0


def metrics_answer(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # 503 is an answer
    except OSError:
        return False


def status_cli(config_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "status", *extra, "--config", str(config_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )


def config_lines(config_path: Path) -> list[str]:
    """The verdict's lines about the config, as `status --json` gives them."""
    document = json.loads(status_cli(config_path, "--json").stdout)
    return [line for line in document["verdict"]["attention"] if line.startswith("config ")]


def test_sighup_moves_the_metrics_listener_and_the_status_socket(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        new_port = free_port()
        new_socket = tmp_path / "moved.sock"
        edit(agent.config_path, f"127.0.0.1:{agent.port}", f"127.0.0.1:{new_port}")
        edit(agent.config_path, f"socket: {agent.socket_path}", f"socket: {new_socket}")
        agent.signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in agent.log(), WAIT_SECONDS, "the reload")
        assert metrics_answer(new_port)
        assert not metrics_answer(agent.port), "the old metrics port still answers"
        assert api.call(new_socket, "status")["source"] == "daemon"
        assert not agent.socket_path.exists()
        # the CLI follows the config to the new socket: the daemon answers, no direct read
        assert json.loads(status_cli(agent.config_path, "--json").stdout)["source"] == "daemon"
        assert config_lines(agent.config_path) == []


def test_a_listener_that_cannot_be_bound_keeps_everything_as_it_was(tmp_path: Path) -> None:
    with serving_daemon(tmp_path) as (daemon, config_path, port), socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        edit(config_path, f"127.0.0.1:{port}", f"127.0.0.1:{busy}")
        edit(config_path, "mode: enforce", "mode: observe")
        assert daemon.reloader.reload() is False
        # refused whole: the old port serves, the mode change in the same edit is not taken either
        assert metrics_answer(port)
        assert daemon.live.config.metrics.listen == f"127.0.0.1:{port}"
        assert daemon.live.config.mode.value == "enforce"
        snapshot = daemon.live.publisher.get()
        assert snapshot is not None
        assert f"cannot bind metrics.listen 127.0.0.1:{busy}" in snapshot.reload_error
        assert "still serving on the previous address" in snapshot.reload_error
        # and said where the operator looks: `status` (exit 2) and STATUS=
        result = status_cli(config_path)
        assert result.returncode == 2, result.stdout
        assert f"config reload failed (running the previous config): cannot bind metrics.listen 127.0.0.1:{busy}" in (
            result.stdout
        )
        assert "config reload failed" in systemd_status_line(snapshot)
        # a later reload that binds clears it
        edit(config_path, f"127.0.0.1:{busy}", f"127.0.0.1:{port}")
        assert daemon.reloader.reload() is True
        snapshot = daemon.live.publisher.get()
        assert snapshot is not None and snapshot.reload_error == ""
        assert config_lines(config_path) == []


def test_a_state_dir_change_is_refused_whole_and_shown_until_a_restart(tmp_path: Path) -> None:
    with serving_daemon(tmp_path) as (daemon, config_path, _port):
        state = str(daemon.live.config.state_dir)
        edit(config_path, f"state_dir: {state}", f"state_dir: {tmp_path / 'elsewhere'}")
        edit(config_path, "mode: enforce", "mode: observe")
        assert daemon.reloader.reload() is False
        assert daemon.live.config.state_dir == state and daemon.live.config.mode.value == "enforce"
        result = status_cli(config_path)
        assert result.returncode == 2
        assert "config change needs a restart: state_dir" in result.stdout
        document = json.loads(status_cli(config_path, "--json").stdout)
        assert "config change needs a restart: state_dir" in document["verdict"]["attention"]
        snapshot = daemon.live.publisher.get()
        assert snapshot is not None
        assert "config change needs a restart: state_dir" in systemd_status_line(snapshot)
        assert "all healthy" not in systemd_status_line(snapshot)
        # the next loop's snapshot still says so
        daemon.loop_once()
        snapshot = daemon.live.publisher.get()
        assert snapshot is not None and snapshot.config_pending_restart == ("state_dir",)
        # the file put back: nothing waits for a restart any more
        edit(config_path, f"state_dir: {tmp_path / 'elsewhere'}", f"state_dir: {state}")
        assert daemon.reloader.reload() is True
        assert config_lines(config_path) == []


def test_backend_and_host_root_changes_are_named_too(tmp_path: Path) -> None:
    with serving_daemon(tmp_path) as (daemon, config_path, _port):
        edit(config_path, "backend: simulated", "backend: nvml")
        edit(config_path, f"host_root: {tmp_path / 'host'}", f"host_root: {tmp_path}")
        assert daemon.reloader.reload() is False
        snapshot = daemon.live.publisher.get()
        assert snapshot is not None and snapshot.config_pending_restart == ("backend", "host_root")
        assert daemon.live.config.backend == "simulated"


def test_a_group_change_on_the_same_socket_swaps_it_without_a_gap(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    with serving_daemon(tmp_path) as (daemon, config_path, _port):
        socket_path = Path(daemon.live.config.api.socket)
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
        text = config_path.read_text().replace(
            f"api: {{socket: {socket_path}}}", f"api: {{socket: {socket_path}, group: {group}}}"
        )
        config_path.write_text(text)
        assert daemon.reloader.reload() is True
        # the old server closed without taking the new socket with it
        assert stat.S_ISSOCK(socket_path.lstat().st_mode)
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o660
        assert socket_path.stat().st_gid == os.getgid()
        assert api.call(socket_path, "status")["source"] == "daemon"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_the_socket_group_never_follows_a_link_planted_at_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attacker who swaps the socket path for a link between bind and chown/chmod gets nothing."""
    group = grp.getgrgid(os.getgid()).gr_name
    victim = tmp_path / "victim"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    path = tmp_path / "agent.sock"
    activate = api_server._Server.server_activate

    def plant_link(server: api_server._Server) -> None:
        activate(server)
        path.unlink(missing_ok=True)
        path.symlink_to(victim)

    monkeypatch.setattr(api_server._Server, "server_activate", plant_link)
    server = api_server.ApiServer(path, {"ping": lambda _p: "pong"}, group=group)
    server.start()
    try:
        assert stat.S_IMODE(victim.stat().st_mode) == 0o600, "chmod followed the planted link"
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert stat.S_IMODE(path.lstat().st_mode) == 0o660
        assert api.call(path, "ping") == "pong"
    finally:
        server.close()
    assert not path.exists()
    assert victim.read_text() == "secret\n"
