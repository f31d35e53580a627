"""One HTTP exchange with a total deadline and a size bound: every request the agent makes to a
server (an inference server's `/metrics`, its health and generate probes, a webhook, Alertmanager)
goes through `exchange`.

A socket timeout bounds each read or write, not the request: a server that sends its headers or
its body one byte every few seconds, or accepts and never answers while the name lookup or the TLS
handshake drags on, would hold the caller for as long as it likes. Here the request runs in a
worker thread that the caller waits for until the deadline; at the deadline the caller shuts the
connection's socket down (which ends a read or write blocked in the worker at once) and reports a
timeout. So connect, headers and body share one deadline. Only a name lookup, which nothing can
interrupt, may outlive the deadline, in the worker and bounded by the resolver's own timeouts; the
caller has returned by then.

The body is read a chunk at a time up to `max_bytes`: a larger answer is an error (or, with
`truncate`, cut there), never read whole. Redirects are not followed (they would carry our headers,
tokens included, elsewhere; a probe must judge the server it was pointed at): a 3xx is an answer
with its `location`, which a caller may follow itself under its own rules. Proxies from the
environment are used only when asked: a local server is reached directly.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

_READ_CHUNK_BYTES = 64 * 1024


class HttpReadError(Exception):
    """No usable answer: refused, reset, timed out, too large, not HTTP. `detail` says which,
    without the URL (the caller names the target the way it may be shown)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class HttpTimedOut(HttpReadError):
    """No complete answer within the total deadline."""


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes  # empty unless the status is 2xx
    location: str | None = None  # a 3xx answer's Location header: the caller decides whether to follow


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


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying context for every https request: building it loads the system's CA store,
    which was four fifths of the daemon's CPU when each scrape and probe built its own. CA
    certificates installed later take effect at the next start."""
    return ssl.create_default_context()


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, exchange: _Exchange) -> None:
        self.tls = _tls_context()
        super().__init__(context=self.tls)
        self._connection = _tracked(_TrackedHTTPSConnection, exchange)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req, context=self.tls)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 3xx is the answer


def _describe(exc: BaseException, timeout_seconds: float) -> str:
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason
    elif isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout_seconds:g} s"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _Attempt:
    """The request as run by the worker thread: its answer, or the error to report."""

    def __init__(
        self, request: urllib.request.Request, deadline_seconds: float, max_bytes: int, proxies: bool, truncate: bool
    ) -> None:
        self.request = request
        self.deadline_seconds = deadline_seconds
        self.max_bytes = max_bytes
        self.proxies = proxies
        self.truncate = truncate
        self.exchange = _Exchange()
        self.answer: HttpAnswer | None = None
        self.error: HttpReadError | None = None

    def run(self) -> None:
        handlers: list[urllib.request.BaseHandler] = [
            _NoRedirect(),
            _HTTPHandler(self.exchange),
            _HTTPSHandler(self.exchange),
        ]
        if not self.proxies:
            handlers.append(urllib.request.ProxyHandler({}))
        opener = urllib.request.build_opener(*handlers)
        try:
            # The socket timeout too: a worker the caller has given up on ends on its own.
            with opener.open(self.request, timeout=self.deadline_seconds) as response:
                self.answer = HttpAnswer(int(response.status), self._body(response))
        except urllib.error.HTTPError as exc:
            self.answer = HttpAnswer(int(exc.code), b"", exc.headers.get("Location") if exc.headers else None)
            exc.close()
        except HttpReadError as exc:
            self.error = exc
        except Exception as exc:  # whatever the exchange raised is this request's failure, not the worker's
            self.error = HttpReadError(_describe(exc, self.deadline_seconds))

    def _body(self, response: http.client.HTTPResponse) -> bytes:
        if self.truncate and self.max_bytes == 0:
            return b""  # the status is the whole answer wanted: a body that never ends is not waited for
        length = response.getheader("Content-Length")
        if not self.truncate and length is not None and length.isdigit() and int(length) > self.max_bytes:
            raise HttpReadError(f"response is {int(length)} bytes, more than the {self.max_bytes} byte limit")
        chunks: list[bytes] = []
        size = 0
        while size <= self.max_bytes:
            # read1: at most one read from the socket, so a chunk never waits for a full buffer.
            chunk = response.read1(_READ_CHUNK_BYTES)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            chunks.append(chunk)
        if self.truncate:
            return b"".join(chunks)[: self.max_bytes]
        raise HttpReadError(f"response larger than the {self.max_bytes} byte limit")


def exchange(
    request: urllib.request.Request,
    deadline_seconds: float,
    max_bytes: int,
    *,
    proxies: bool = False,
    truncate: bool = False,
) -> HttpAnswer:
    """Send `request` and read the answer within `deadline_seconds` in all (connect, headers,
    body), at most `max_bytes` of body (more is an HttpReadError; with `truncate`, the first
    `max_bytes`). Any status is an answer; the body is read for 2xx only. Raises HttpTimedOut past
    the deadline, HttpReadError for every other failure."""
    attempt = _Attempt(request, deadline_seconds, max_bytes, proxies, truncate)
    worker = threading.Thread(target=attempt.run, name="gpu-agent-http", daemon=True)
    worker.start()
    worker.join(deadline_seconds)
    if worker.is_alive():
        attempt.exchange.cut()
        raise HttpTimedOut(f"timed out after {deadline_seconds:g} s")
    if attempt.error is not None:
        raise attempt.error
    assert attempt.answer is not None  # the worker sets one or the other
    return attempt.answer


def get(
    url: str, deadline_seconds: float, max_bytes: int, *, truncate: bool = False, accept: str | None = None
) -> HttpAnswer:
    """GET a local server's `url` (http or https; checked by the caller) with `exchange`, no proxy."""
    headers = {"User-Agent": "gpu-agent", "Accept-Encoding": "identity"}
    if accept is not None:
        headers["Accept"] = accept
    request = urllib.request.Request(url, headers=headers)  # noqa: S310
    return exchange(request, deadline_seconds, max_bytes, truncate=truncate)
