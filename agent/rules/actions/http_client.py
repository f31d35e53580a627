"""POST JSON to webhooks and Alertmanager, with a total deadline per request.

A socket timeout bounds each read or write, not the request: a server that sends one byte every
few seconds, or accepts and never answers while the name lookup or the TLS handshake drags on,
would hold the caller for as long as it likes. Here the request runs in a worker thread that the
caller waits for until the deadline; at the deadline the caller shuts the connection's socket down
(which ends a read or write blocked in the worker at once) and reports a timeout. Only a name
lookup, which nothing can interrupt, may outlive the deadline, in the worker and bounded by the
resolver's own timeouts; the caller has returned by then.

Redirects are not followed (they would carry our headers, tokens included, elsewhere); the URL's
path and query (tokens live there too) and header values never appear in errors. Proxies from the
environment (`https_proxy`, ...) are used as urllib uses them.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from agent.rules.actions.base import ActionError


class RequestTimedOut(ActionError):
    """No complete answer within the request's total deadline."""


def redacted_url(url: str) -> str:
    """scheme://host[:port]/… : enough to tell where it went, without the path's tokens."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}" + ("/…" if parts.path.strip("/") else "")


class _Exchange:
    """The sockets of one request, so that the caller can cut them at the deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._cut = False

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            cut = self._cut
        if cut:  # connected after the deadline: end it before a byte is sent
            _shut(sock)

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed: nothing left to cut
        sock.shutdown(socket.SHUT_RDWR)


class _TrackedHTTPConnection(http.client.HTTPConnection):
    exchange: _Exchange

    def connect(self) -> None:
        super().connect()
        self.exchange.track(self.sock)


class _TrackedHTTPSConnection(http.client.HTTPSConnection):
    exchange: _Exchange

    def connect(self) -> None:
        super().connect()
        self.exchange.track(self.sock)


_Tracked = TypeVar("_Tracked", _TrackedHTTPConnection, _TrackedHTTPSConnection)


def _tracked(connection_type: type[_Tracked], exchange: _Exchange) -> Callable[..., _Tracked]:
    """The connection factory `do_open` calls: connections whose sockets `exchange` can cut."""

    def connection(host: str, **kwargs: Any) -> _Tracked:
        made = connection_type(host, **kwargs)
        made.exchange = exchange
        return made

    return connection


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, exchange: _Exchange) -> None:
        super().__init__()
        self._connection = _tracked(_TrackedHTTPConnection, exchange)

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, exchange: _Exchange) -> None:
        self.tls = ssl.create_default_context()
        super().__init__(context=self.tls)
        self._connection = _tracked(_TrackedHTTPSConnection, exchange)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req, context=self.tls)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        # Following it would send our headers (tokens) to wherever the redirect points.
        return None


def _request(url: str, body: bytes, headers: Mapping[str, str]) -> urllib.request.Request:
    parts = urllib.parse.urlsplit(url)
    credentials = None
    if parts.username is not None:
        # urllib takes user:password@ for part of the host name: send it as basic auth instead.
        userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        credentials = "Basic " + base64.b64encode(userinfo.encode()).decode()
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    request = urllib.request.Request(url, data=body, method="POST")  # noqa: S310 (the caller checked the scheme)
    request.add_header("Content-Type", "application/json")
    request.add_header("User-Agent", "gpu-agent")
    if credentials is not None:
        request.add_header("Authorization", credentials)
    for name, value in headers.items():
        request.add_header(name, value)
    return request


class _Attempt:
    """The request as run by the worker thread: its status, or the error to report."""

    def __init__(self, request: urllib.request.Request, where: str, deadline_seconds: float) -> None:
        self.request = request
        self.where = where
        self.deadline_seconds = deadline_seconds
        self.exchange = _Exchange()
        self.status: int | None = None
        self.error: ActionError | None = None

    def run(self) -> None:
        opener = urllib.request.build_opener(_NoRedirect(), _HTTPHandler(self.exchange), _HTTPSHandler(self.exchange))
        try:
            # The socket timeout too: a worker the caller has given up on ends on its own.
            with opener.open(self.request, timeout=self.deadline_seconds) as response:
                self.status = int(response.status)
        except urllib.error.HTTPError as exc:
            self.error = ActionError(f"POST {self.where}: HTTP {exc.code}")
        except urllib.error.URLError as exc:
            self.error = ActionError(f"POST {self.where}: {exc.reason}")
        except (TimeoutError, OSError, http.client.HTTPException) as exc:
            self.error = ActionError(f"POST {self.where}: {str(exc) or type(exc).__name__}")


def post_json(url: str, payload: Any, deadline_seconds: float, headers: Mapping[str, str] | None = None) -> int:
    """POST payload as JSON and return the 2xx status within `deadline_seconds` in all; raises
    RequestTimedOut past the deadline, ActionError for any other failure (no secrets in either)."""
    where = redacted_url(url)
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ActionError(f"not an http(s) URL: {where}")
    body = json.dumps(payload, default=str).encode()
    attempt = _Attempt(_request(url, body, headers or {}), where, deadline_seconds)
    worker = threading.Thread(target=attempt.run, name="gpu-agent-http", daemon=True)
    worker.start()
    worker.join(deadline_seconds)
    if worker.is_alive():
        attempt.exchange.cut()
        raise RequestTimedOut(f"POST {where}: timed out: no complete answer within {deadline_seconds:g} s")
    if attempt.error is not None:
        raise attempt.error
    status = attempt.status
    if status is None or not 200 <= status < 300:
        raise ActionError(f"POST {where}: HTTP {status}")
    return status
