"""The daemon's side of the status API (agent/api.py): the socket, its permissions, one thread per
client, and the dispatch of a request line to its handler."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import socket
import socketserver
import struct
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent.api import ApiError
from agent.host import safe_json
from agent.logs import get_logger

MAX_REQUEST_BYTES = 64 * 1024
REQUEST_TIMEOUT_SECONDS = 5.0

Handler = Callable[[Mapping[str, Any]], Any]


def handle_request(
    line: bytes, handlers: Mapping[str, Handler], may_call: Callable[[str], bool] | None = None
) -> dict[str, Any]:
    """Parse and dispatch one request line; never raises (every failure is an error response).
    `may_call(method)` False: the peer may not call that method."""
    try:
        request = safe_json.loads(line)
    except safe_json.JsonError as exc:  # 64 KB of `[` too: the line's size bounds the rest
        return {"ok": False, "error": f"invalid JSON: {exc}"}
    if not isinstance(request, dict):
        return {"ok": False, "error": "request must be a JSON object"}
    method = request.get("method")
    params = request.get("params", {})
    if not isinstance(method, str) or method not in handlers:
        return {"ok": False, "error": f"unknown method {method!r}; one of: {', '.join(sorted(handlers))}"}
    if not isinstance(params, dict):
        return {"ok": False, "error": "params must be a JSON object"}
    if may_call is not None and not may_call(method):
        return {"ok": False, "error": f"{method} changes the node: only root or the agent's own user may call it"}
    try:
        return {"ok": True, "result": handlers[method](params)}
    except ApiError as exc:
        return {"ok": False, "error": str(exc)}
    except Exception as exc:  # a handler's bug answers this client with an error, never kills its thread silently
        get_logger().exception("API method failed", method=method)
        return {"ok": False, "error": f"internal error in {method}: {type(exc).__name__}"}


class ServingThread:
    """`server` served on a daemon thread that sleeps until a client comes or `stop()` is called.

    socketserver's `serve_forever` wakes every poll interval to look at its stop flag: on an idle
    daemon, ten times a second for each server (about a quarter of the daemon's CPU on an H200).
    Here a pipe wakes the loop instead, so it stops at once and costs nothing while idle."""

    def __init__(self, server: socketserver.TCPServer, name: str) -> None:
        self.server = server
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        import selectors

        with selectors.PollSelector() as selector:
            selector.register(self.server.fileno(), selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while True:
                ready = [key.fileobj for key, _ in selector.select()]
                if self._wake_read in ready:
                    return
                # what serve_forever does once select() says a client is waiting
                self.server._handle_request_noblock()  # type: ignore[attr-defined]
                self.server.service_actions()

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Stop serving (a request being handled finishes on its own thread) and close the socket."""
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout_seconds)
        self.server.server_close()
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    # socketserver's default backlog of 5 turns a burst of `gpu-agent status` callers (a monitoring
    # script on every node, a fleet-wide ssh loop) into EAGAIN on connect.
    request_queue_size = 128
    handlers: Mapping[str, Handler]
    privileged: frozenset[str] = frozenset()


class _RequestHandler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.connection.settimeout(REQUEST_TIMEOUT_SECONDS)
        try:
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
        except OSError:
            return
        if len(line) > MAX_REQUEST_BYTES:
            response: dict[str, Any] = {"ok": False, "error": "request too large"}
        else:
            uid = _peer_uid(self.connection)
            trusted = uid is not None and uid in (0, os.geteuid())
            privileged = self.server.privileged
            response = handle_request(line, self.server.handlers, lambda method: trusted or method not in privileged)
        with contextlib.suppress(OSError):
            self.wfile.write(json.dumps(response, default=str).encode() + b"\n")


def _peer_uid(connection: socket.socket) -> int | None:
    """The connecting process's user (SO_PEERCRED: pid, uid, gid); None when it cannot be read."""
    try:
        credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return int(uid)


class ApiServer:
    """The socket at `path`, 0600 (0660 and group `group` when one is given), served on a thread.

    The socket is bound in a private directory beside `path`, given its group there, and renamed
    into place: it appears at `path` complete, nothing on the way follows a link someone planted at
    `path`, and an old server on the same path keeps answering until the new socket replaces it
    (a reload)."""

    def __init__(
        self,
        path: str | Path,
        handlers: Mapping[str, Handler],
        group: str | None = None,
        privileged: frozenset[str] = frozenset(),
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        gid = None if group is None else grp.getgrnam(group).gr_gid
        staging = Path(tempfile.mkdtemp(prefix=".", dir=self.path.parent))  # 0700, ours alone
        staged = staging / "s"
        # Created with its final mode: no window where others could connect. Group read/write is
        # what api.group asks for.
        old_umask = os.umask(0o177 if gid is None else 0o117)
        try:
            self._server = _Server(str(staged), _RequestHandler)
            try:
                if gid is not None:
                    os.chown(staged, -1, gid, follow_symlinks=False)
                bound = os.lstat(staged)
                # Replaces whatever is at `path` (a stale socket from a killed agent, a link) without following it.
                os.replace(staged, self.path)
            except BaseException:
                self._server.server_close()
                raise
        finally:
            os.umask(old_umask)
            staged.unlink(missing_ok=True)
            staging.rmdir()
        self._inode = (bound.st_dev, bound.st_ino)
        self._server.handlers = handlers
        self._server.privileged = privileged
        self._serving = ServingThread(self._server, "api")

    @property
    def socket_file(self) -> tuple[int, int]:
        """The bound socket's device and inode: what the daemon's published record names (agent/api.py)."""
        return self._inode

    def start(self) -> None:
        self._serving.start()

    def close(self) -> None:
        self._serving.stop()
        # A newer server may have taken the path over (a reload that changed api.group): leave its socket.
        with contextlib.suppress(FileNotFoundError):
            found = os.lstat(self.path)
            if (found.st_dev, found.st_ino) == self._inode:
                self.path.unlink()
