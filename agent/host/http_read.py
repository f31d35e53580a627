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
caller has returned by then. A worker whose request was answered in time is kept for the next
request (a few are kept idle); one left behind at a deadline serves no other and ends with its
request. A request without a proxy is sent on an http.client connection of its own, with the
headers urllib would send; one through a proxy from the environment goes through urllib's opener.

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
import queue
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

_READ_CHUNK_BYTES = 64 * 1024
#: Sent on one http.client connection of our own; anything else (a proxy) goes through urllib.
_DIRECT_SCHEMES = frozenset({"http", "https"})


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


def _error_of(exc: BaseException, timeout_seconds: float) -> HttpReadError:
    """What the exchange raised, as this module's error. A socket timeout is HttpTimedOut: the
    socket's timeouts are what is left of the total deadline, so it can fire a moment before the
    caller's own wait does, and both are the same failure."""
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason
    elif isinstance(exc, urllib.error.URLError):
        return HttpReadError(str(exc.reason))
    if isinstance(exc, TimeoutError):
        return HttpTimedOut(f"timed out after {timeout_seconds:g} s")
    if isinstance(exc, OSError) and exc.strerror:
        return HttpReadError(exc.strerror.lower())
    return HttpReadError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


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
        # Held until the worker has set `answer` or `error` (a bare lock: cheaper than an Event).
        self.done = threading.Lock()
        self.done.acquire()

    def run(self) -> None:
        try:
            if self.proxies or self.request.type not in _DIRECT_SCHEMES or "@" in self.request.host:
                self.answer = self._through_urllib()
            else:
                self.answer = self._direct()
        except HttpReadError as exc:
            self.error = exc
        except Exception as exc:  # whatever the exchange raised is this request's failure, not the worker's
            self.error = _error_of(exc, self.deadline_seconds)

    def _direct(self) -> HttpAnswer:
        """The request on one http.client connection, as urllib's handlers would send it (the same
        headers, `Connection: close`), without building an opener of ten handlers for each one."""
        request = self.request
        connection: _TrackedHTTPConnection | _TrackedHTTPSConnection
        if request.type == "https":
            connection = _tracked(_TrackedHTTPSConnection, self.exchange)(
                request.host, timeout=self.deadline_seconds, context=_tls_context()
            )
        else:
            connection = _tracked(_TrackedHTTPConnection, self.exchange)(request.host, timeout=self.deadline_seconds)
        headers = {name.title(): value for name, value in request.header_items()}
        headers.setdefault("Host", request.host)
        if request.data is not None:
            headers.setdefault("Content-Type", "application/x-www-form-urlencoded")
        headers["Connection"] = "close"
        try:
            connection.request(request.get_method(), request.selector, request.data, headers)
            with connection.getresponse() as response:
                if 200 <= response.status < 300:
                    return HttpAnswer(int(response.status), self._body(response))
                # Any other status is the answer (urllib's HTTPError, redirects not followed).
                return HttpAnswer(int(response.status), b"", response.getheader("Location"))
        finally:
            connection.close()

    def _through_urllib(self) -> HttpAnswer:
        """Through urllib's opener: proxies from the environment, and whatever URL the direct
        path does not take."""
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
                return HttpAnswer(int(response.status), self._body(response))
        except urllib.error.HTTPError as exc:
            exc.close()
            return HttpAnswer(int(exc.code), b"", exc.headers.get("Location") if exc.headers else None)

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


class _Worker:
    """A thread that runs one request after another. A caller that gets its answer in time hands
    the worker back for the next request; one whose deadline passed leaves it behind, told to end
    once its request does (the socket is shut, so that is soon): a hung request never holds up
    the next one, which gets a worker of its own."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[_Attempt | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="gpu-agent-http", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (attempt := self._inbox.get()) is not None:
            try:
                attempt.run()
            finally:  # whatever escapes run(), the caller is not kept waiting for the deadline
                attempt.done.release()

    def submit(self, attempt: _Attempt) -> None:
        self._inbox.put(attempt)

    def end(self) -> None:
        """End after the request in hand, if any."""
        self._inbox.put(None)


#: Workers waiting for a request; a few callers (the scrapes, the probes) ask at once at most.
_IDLE_WORKERS_KEPT = 4
_idle_workers: list[_Worker] = []
_idle_lock = threading.Lock()


def _take_worker() -> _Worker:
    with _idle_lock:
        if _idle_workers:
            return _idle_workers.pop()
    return _Worker()


def _keep_worker(worker: _Worker) -> None:
    with _idle_lock:
        if len(_idle_workers) < _IDLE_WORKERS_KEPT:
            _idle_workers.append(worker)
            return
    worker.end()


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
    worker = _take_worker()
    worker.submit(attempt)
    if not attempt.done.acquire(timeout=max(deadline_seconds, 0.0)):
        attempt.exchange.cut()
        worker.end()  # left behind: it ends when its request does, and serves no other
        raise HttpTimedOut(f"timed out after {deadline_seconds:g} s")
    _keep_worker(worker)
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
