"""The status API: one JSON request line in, one JSON response line out, over a Unix socket. This
module is the protocol and its client (`gpu-agent status` imports it); agent/api_server.py serves it.

Requests: {"method": "status"} | {"method": "ping"} | {"method": "ack", "params": {"selector": TEXT}}
(agent/daemon/ack_api.py); the advisor adds `tune_start`, `tune_status`, `tune_abort` and
`tune_passive` (agent/tune/runner.py).
Responses: {"ok": true, "result": ...} or {"ok": false, "error": "..."}.

The socket is root-only (0600) unless a group is configured (0660, that group); `denied_reason` tells
a caller the socket refuses which group to join. Methods that change the node (`privileged`: starting
or aborting a tune sweep, `ack`) answer only a peer running as root or as the agent's own user
(SO_PEERCRED), so a group given read access cannot set power limits or re-arm rules.

The published socket: a running daemon writes which socket it serves for the config file it runs
into its runtime directory, one record per config file (agent/daemon/socket_record.py), so that
`gpu-agent status` finds the daemon without reading the config (no YAML, no trust walk of it) and
still finds it when the config was edited since the daemon read it, which it then says
(`read_published`, `Published.config_changed`). The record is trusted as the config is: read only
from a directory and a file that no one but root (or the agent's own user) could have written, and
only while its socket is the very one the daemon bound (a daemon killed, or another one bound on
that path since, leaves a record that matches nothing: the caller falls back to the config).
"""

from __future__ import annotations

import _socket
import json
import os
import stat
from collections.abc import Mapping

from agent import TYPE_CHECKING
from agent.defaults import DEFAULT_RUNTIME_DIR
from agent.host import safe_json

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any


class ApiError(Exception):
    """A request the API understood but refuses; its message goes back to the client."""


def denied_reason(path: str | Path) -> str:
    """Why this user may not talk to the daemon on `path` (connect said EACCES), and what would let it:
    the group to join when the socket has one (`api.group`), else root."""
    import grp
    import os
    import pwd

    uid = os.geteuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid {uid}"
    try:
        found = os.stat(path)
    except OSError:
        return f"permission denied on {path}: its directory is closed to {user}; run it as root (sudo)"
    try:
        group = grp.getgrgid(found.st_gid)
    except KeyError:
        return f"permission denied on {path}: it answers root only; run it as root (sudo)"
    if found.st_gid == 0 or found.st_mode & 0o060 != 0o060:
        return (
            f"permission denied on {path}: it answers root only (api.group is not set); run it as root (sudo),"
            " or name a group of operators in agent.yaml (`api: {group: NAME}`), reload the daemon and join it"
        )
    if user in group.gr_mem or found.st_gid == os.getegid():
        return (
            f"permission denied on {path}: {user} is in group {group.gr_name}, but this session is not yet:"
            f" log in again (or `newgrp {group.gr_name}`)"
        )
    return (
        f"permission denied on {path}: it answers root and group {group.gr_name} only; join it"
        f" (`sudo usermod -aG {group.gr_name} {user}`, then log in again) or run it as root (sudo)"
    )


def call(path: str | Path, method: str, params: Mapping[str, Any] | None = None, timeout_seconds: float = 5.0) -> Any:
    """Client side: one request; raises OSError when no daemon answers, ApiError on an error response.
    Through `_socket`, the C module `socket` wraps: a client needs none of socket.py's enums and
    selectors, which cost `status` a fifteenth of a bare interpreter's start."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_seconds)
        sock.connect(str(path))
        sock.sendall(json.dumps({"method": method, "params": dict(params or {})}).encode() + b"\n")
        data = bytearray()
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        sock.close()
    response = safe_json.loads(data)
    if not response.get("ok"):
        raise ApiError(str(response.get("error")))
    return response["result"]


#: Where `read_published` looks instead of DEFAULT_RUNTIME_DIR (a test's or a bench's daemon, whose
#: host_root is a tree of its own, publishes under that tree).
RUNTIME_DIR_VARIABLE = "GPU_AGENT_RUNTIME_DIR"
#: The records' directory in the runtime directory.
PUBLISHED_DIRECTORY = "by-config"
MAX_PUBLISHED_BYTES = 4096
PUBLISHED_SCHEMA = 1
_NAME_MAX_BYTES = 255  # a file name's limit on Linux file systems
_KEPT = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:_.")


def escaped_path(path: str) -> str:
    """`path` as `systemd-escape --path` writes it: no leading, trailing or doubled `/`, each `/` left
    a `-`, and every byte but ASCII letters, digits, `:`, `_` and a `.` not in front as `\\xNN`
    (`/etc/gpu-agent/agent.yaml` -> `etc-gpu\\x2dagent-agent.yaml`)."""
    trimmed = "/".join(part for part in path.split("/") if part not in ("", "."))
    if not trimmed:
        return "-"
    escaped: list[str] = []
    for position, char in enumerate(trimmed):
        if char == "/":
            escaped.append("-")
        elif char in _KEPT and not (position == 0 and char == "."):
            escaped.append(char)
        else:
            escaped.extend(f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogateescape"))
    return "".join(escaped)


def published_path(config_path: str, runtime_dir: str = DEFAULT_RUNTIME_DIR) -> str | None:
    """The record of the daemon running the config at `config_path`: RUNTIME/by-config/NAME.json,
    NAME its absolute path escaped; None when that name is too long for a file (no record then)."""
    name = escaped_path(os.path.abspath(config_path)) + ".json"
    if len(name) > _NAME_MAX_BYTES:  # ASCII: a character is a byte
        return None
    return f"{runtime_dir}/{PUBLISHED_DIRECTORY}/{name}"


def file_identity(info: os.stat_result) -> list[int]:
    """What tells one version of a file from another without reading it: its device, inode,
    modification time (ns) and size. An editor's save (a new inode) and a write in place (a new
    mtime) both change it."""
    return [info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size]


def published_record(
    config_path: str, config_file: list[int] | None, socket_path: str, socket_file: list[int], state_dir: str
) -> str:
    """The record the daemon writes: the config file by its path and its identity when the daemon read
    it (None: it could not tell), the socket it bound and that socket's device and inode, its state_dir."""
    record = {
        "schema": PUBLISHED_SCHEMA,
        "config": os.path.abspath(config_path),
        "config_file": config_file,
        "socket": os.path.abspath(socket_path),
        "socket_file": socket_file,
        "state_dir": os.path.abspath(state_dir),
        "pid": os.getpid(),
    }
    return json.dumps(record) + "\n"


class Published:
    """A daemon's record, read back: the `socket` it serves for the config file at `config` and its
    `state_dir`. A plain class: `gpu-agent status` imports no more than it needs."""

    __slots__ = ("config", "config_file", "socket", "state_dir")

    def __init__(self, config: str, config_file: list[int] | None, socket: str, state_dir: str) -> None:
        self.config = config
        self.config_file = config_file
        self.socket = socket
        self.state_dir = state_dir

    def config_changed(self) -> bool:
        """The config file is not the one the daemon read (edited, replaced or removed since it started
        or last reloaded): the daemon runs what it read then."""
        try:
            return self.config_file is None or file_identity(os.stat(self.config)) != self.config_file
        except OSError:
            return True


def _ints(value: object, count: int) -> bool:
    return isinstance(value, list) and len(value) == count and all(type(n) is int for n in value)


def read_published(config_path: str) -> Published | None:
    """What the daemon running the config at `config_path` published, read from
    $GPU_AGENT_RUNTIME_DIR or DEFAULT_RUNTIME_DIR. None when there is no record, it is not trusted
    (agent/trust.py: a file or directory others could write), it does not hold together or names
    another config, or its socket is no longer the one the daemon bound."""
    from agent.trust import TooLargeError, UntrustedError, read_trusted

    config = os.path.abspath(config_path)
    path = published_path(config, os.environ.get(RUNTIME_DIR_VARIABLE) or DEFAULT_RUNTIME_DIR)
    if path is None:
        return None
    try:
        record = safe_json.loads(read_trusted(path, limit_bytes=MAX_PUBLISHED_BYTES))
    except (OSError, UntrustedError, TooLargeError, safe_json.JsonError):
        return None
    if not (
        isinstance(record, dict)
        and record.get("schema") == PUBLISHED_SCHEMA
        and record.get("config") == config
        and (record.get("config_file") is None or _ints(record.get("config_file"), 4))
        and _ints(record.get("socket_file"), 2)
        and all(isinstance(record.get(key), str) and record[key].startswith("/") for key in ("socket", "state_dir"))
    ):
        return None
    try:
        found = os.stat(record["socket"])
    except OSError:
        return None
    if not stat.S_ISSOCK(found.st_mode) or [found.st_dev, found.st_ino] != record["socket_file"]:
        return None
    return Published(config, record["config_file"], record["socket"], record["state_dir"])
