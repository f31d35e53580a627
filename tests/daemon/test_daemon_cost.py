"""What the daemon does not redo every loop (its CPU at a 1 s loop is measured in bench/cli_speed.py)."""

from __future__ import annotations

import os
import select
import selectors
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import write_agent_config
from helpers import wait_until

from agent import api, api_server
from agent.config import load_config
from agent.daemon import Daemon
from agent.daemon.sd_notify import SdNotifier
from agent.host.paths import HostPaths
from agent.metrics.server import MetricsServer
from agent.watch.kmsg import KmsgSource


def test_the_driver_version_is_read_once_per_backend_session(tmp_path: Path) -> None:
    config_path, _ = write_agent_config(tmp_path)
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    try:
        assert daemon.loop_once().driver_version == "580.159.04"
        backend = daemon.live.session.backend
        assert backend is not None
        asked: list[str] = []
        read = backend.driver_version

        def counted() -> str:
            asked.append("driver_version")
            return read()

        backend.driver_version = counted  # type: ignore[method-assign]
        for _ in range(5):
            assert daemon.loop_once().driver_version == "580.159.04"
        assert asked == []
        # a new session (after a driver reload or upgrade) reads it again
        daemon.live.session.close()
        assert daemon.loop_once().driver_version == "580.159.04"
        assert daemon.live.session.backend is not backend
    finally:
        daemon.shutdown()


def test_idle_servers_sleep_until_a_client_comes_or_they_are_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """socketserver's serve_forever woke ten times a second to look at its stop flag; the metrics and
    API servers now wait without a timeout and are woken to stop."""
    waits: list[float | None] = []
    select = selectors.PollSelector.select

    def recorded(self: selectors.PollSelector, timeout: float | None = None) -> Any:
        waits.append(timeout)
        return select(self, timeout)

    monkeypatch.setattr(selectors.PollSelector, "select", recorded)
    threads_before = set(threading.enumerate())
    socket_server = api_server.ApiServer(tmp_path / "agent.sock", {"ping": lambda _p: "pong"})
    socket_server.start()
    metrics = MetricsServer("127.0.0.1:0", lambda: None)
    try:
        assert api.call(tmp_path / "agent.sock", "ping") == "pong"
        with urllib.request.urlopen(f"{metrics.url}/", timeout=5) as response:
            assert response.status == 200
    finally:
        socket_server.close()
        metrics.close()
    assert waits and set(waits) == {None}
    assert not [t for t in set(threading.enumerate()) - threads_before if t.name in ("api", "metrics-http")]
    assert not (tmp_path / "agent.sock").exists()


class _RecordingPoll:
    """select.poll, recording each timeout its poll() is given."""

    timeouts: list[float | None] = []

    def __init__(self) -> None:
        self._poll = _REAL_POLL()

    def register(self, fd: int, events: int) -> None:
        self._poll.register(fd, events)

    def poll(self, timeout: float | None = None) -> list[tuple[int, int]]:
        self.timeouts.append(timeout)
        return self._poll.poll(timeout)


_REAL_POLL = select.poll


def test_the_kernel_log_device_is_waited_on_without_a_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader of /dev/kmsg polled every 0.1 s for its stop flag; it now sleeps until a record
    comes or stop() wakes it. A terminal stands in for the device: a character device that
    blocks until written to."""
    primary, secondary = os.openpty()
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kmsg").symlink_to(os.ttyname(secondary))
    monkeypatch.setattr(select, "poll", _RecordingPoll)
    _RecordingPoll.timeouts = []
    source = KmsgSource(HostPaths.at(tmp_path), lambda _xid: None, start_monotonic_seconds=None)
    try:
        source.start()
        wait_until(lambda: bool(_RecordingPoll.timeouts), 10, "the reader waits on the device")
        assert source.status()[0], source.status()
    finally:
        source.stop(timeout_seconds=10)
        os.close(primary)
        os.close(secondary)
    assert set(_RecordingPoll.timeouts) == {None}
    assert source._thread is not None and not source._thread.is_alive()
