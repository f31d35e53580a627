"""The socket this daemon serves, published for `gpu-agent status`, `ack`, `tune` and shell completion
(agent/api.py `read_published` reads it): RUNTIME/by-config/NAME.json under host_root (on a node,
/run/gpu-agent/by-config/etc-gpu\\x2dagent-agent.yaml.json), NAME the config file's path as
`systemd-escape --path` writes it. It names the socket and its inode, the config file's identity
when the daemon read it, and state_dir.

Written at start and after each reload that is applied (a new config file, perhaps a new socket),
never after one that is refused: the record then still says which file the daemon runs, and
`status` says the file on disk has changed. Removed at stop while it is still this daemon's. A record
that cannot be written costs `status` its fast path only (it reads the config instead): logged once,
never the daemon's failure.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from agent.api import MAX_PUBLISHED_BYTES, file_identity, published_path, published_record
from agent.logs import get_logger

if TYPE_CHECKING:
    from pathlib import Path

    from agent.config import AgentConfig
    from agent.host.paths import HostPaths

log = get_logger()


def config_file_identity(path: str | Path | None) -> list[int] | None:
    """The identity of the config file at `path` now (agent/api.py `file_identity`); None without one.
    Taken just before the file is read: an edit made between the two leaves the record older than the
    file, which `status` reports as a change, never the other way round."""
    if path is None:
        return None
    try:
        return file_identity(os.stat(path))
    except OSError:
        return None


class SocketRecord:
    """This daemon's record. `read_identity`: the config file's identity taken just before the
    daemon read it at start (`config_file_identity`); None: taken now."""

    def __init__(self, paths: HostPaths, config_path: Path | None, read_identity: list[int] | None) -> None:
        self._paths = paths
        self._config = None if config_path is None else str(config_path)
        self._read_identity = read_identity or config_file_identity(self._config)
        self._written: tuple[str, str] | None = None  # (record path, text) this daemon wrote last
        self._failed = False

    def reading(self) -> None:
        """The config file is about to be read again (a reload): what it is now is what is read."""
        self._read_identity = config_file_identity(self._config)

    def publish(self, config: AgentConfig, socket_file: tuple[int, int] | None) -> None:
        """The record for `config`, served on the socket whose (device, inode) is `socket_file`;
        nothing on a built-in config (no file to name) or without a socket."""
        if self._config is None or socket_file is None:
            return
        path = published_path(self._config)
        if path is None:
            self._failure("the config file's path is too long to name its record", self._config)
            return
        socket = config.api.socket
        text = published_record(self._config, self._read_identity, socket, list(socket_file), config.state_dir)
        try:
            self._paths.write_file_atomic(path, text, mode=0o644)  # status runs as whoever asks
        except (OSError, ValueError) as exc:
            self._failure(str(exc), path)
            return
        self._written = (path, text)

    def withdraw(self) -> None:
        """At stop: the record goes, unless another daemon running the same config file wrote its own since."""
        if self._written is None:
            return
        path, text = self._written
        self._written = None
        try:
            if self._paths.read_bytes(path, MAX_PUBLISHED_BYTES) == text.encode():
                self._paths.remove_file(path)
        except (OSError, ValueError) as exc:
            log.warning("cannot remove the published socket record", path=path, error=str(exc))

    def _failure(self, reason: str, path: str) -> None:
        if not self._failed:
            log.warning(
                "cannot publish the socket for `gpu-agent status`; it reads the config instead",
                path=path,
                error=reason,
            )
        self._failed = True
