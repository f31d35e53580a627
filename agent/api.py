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
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping

from agent import TYPE_CHECKING
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
    """Client side: one request; raises OSError when no daemon answers, ApiError on an error response."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_seconds)
        sock.connect(str(path))
        sock.sendall(json.dumps({"method": method, "params": dict(params or {})}).encode() + b"\n")
        data = bytearray()
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    response = safe_json.loads(data)
    if not response.get("ok"):
        raise ApiError(str(response.get("error")))
    return response["result"]
