"""What the daemon does not redo every loop (its CPU at a 1 s loop is measured in bench/cli_speed.py)."""

from __future__ import annotations

from pathlib import Path

from daemon_harness import write_agent_config

from agent.config import load_config
from agent.daemon import Daemon
from agent.daemon.sd_notify import SdNotifier


def test_the_driver_version_is_read_once_per_backend_session(tmp_path: Path) -> None:
    config_path, _ = write_agent_config(tmp_path)
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    try:
        assert daemon.loop_once().driver_version == "580.159.04"
        backend = daemon.session.backend
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
        daemon.session.close()
        assert daemon.loop_once().driver_version == "580.159.04"
        assert daemon.session.backend is not backend
    finally:
        daemon.shutdown()
