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
`truncate`, cut there), never read whole. Interim answers (1xx: `100 Continue`, `103 Early
Hints`) are skipped, as RFC 9110 section 15.2 has a client do: the final answer after them is the
answer. Redirects are not followed (they would carry our headers, tokens included, elsewhere; a
probe must judge the server it was pointed at): a 3xx is the answer, unless the caller of `get`
allows a few to the same scheme, host and port (the scrape does). Proxies from the environment are
used only when asked: a local server is reached directly.

This module is the boundary: whatever the URL, the server or the network does (a Location that is
not a URL, a port out of range, a status line that is not HTTP, a header or a chunk that cannot be
decoded, anything http.client or urllib raises) comes out as HttpReadError, whose `detail` is
bounded and printable. Each caller turns that one error into its own.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import queue
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from agent.printable import printable

_READ_CHUNK_BYTES = 64 * 1024
#: Sent on one http.client connection of our own; anything else (a proxy) goes through urllib.
_DIRECT_SCHEMES = frozenset({"http", "https"})
#: Interim answers skipped before the final one: a server may send several (102 Processing while it
#: works), never this many; each costs only its status line and headers, read and dropped.
MAX_INTERIM_ANSWERS = 100
#: What of the server's own words (a status line, a Location) an error quotes.
_QUOTED_CHARS = 120
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


class HttpReadError(Exception):
    """No usable answer: refused, reset, timed out, too large, not HTTP, a URL that cannot be
    requested. `detail` says which, without the URL (the caller names the target the way it may be
    shown), bounded and with control characters escaped."""

    def __init__(self, detail: str) -> None:
        detail = quoted(detail, 4 * _QUOTED_CHARS)
        super().__init__(detail)
        self.detail = detail


def quoted(text: str, limit: int = _QUOTED_CHARS) -> str:
    """A server's words as an error may carry them: at most `limit` characters, escaped."""
    return printable(text if len(text) <= limit else text[:limit] + "…")


class HttpTimedOut(HttpReadError):
    """No complete answer within the total deadline."""


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes  # empty unless the status is 2xx
    location: str | None = None  # a 3xx answer's Location header (`get` follows one to the same origin if asked)


class _FinalResponse(http.client.HTTPResponse):
    """An answer whose interim (1xx) answers are skipped: http.client skips `100 Continue` only and
    takes any other 1xx (a `103 Early Hints` before the `200 OK`) for the answer itself. `101
    Switching Protocols` is final: it is never asked for, and what follows it is not HTTP."""

    def _read_status(self) -> tuple[str, int, str]:
        for _ in range(MAX_INTERIM_ANSWERS):
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 100 <= status < 200 or status == 101:
                return str(version), int(status), str(reason)
            http.client.parse_headers(self.fp)  # the interim answer's headers: read and dropped
        raise HttpReadError(f"more than {MAX_INTERIM_ANSWERS} interim (1xx) answers")


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
    response_class = _FinalResponse

    def connect(self) -> None:
        super().connect()
        self.exchange.track(self.sock)


class _TrackedHTTPSConnection(_TrackedHTTPConnection, http.client.HTTPSConnection):
    """The same over TLS: its `connect` runs HTTPSConnection's (connect, then the handshake) before
    the tracking, so the socket tracked is the TLS one, as the exchange will read it."""


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
    """A 3xx is the answer, and nothing of its Location is read here (urllib's own handler parses
    it before asking whether to follow: a Location that is not a URL raised from the opener)."""

    def http_error_302(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: http.client.HTTPMessage,
    ) -> None:
        return None

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


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
    words = str(exc)
    return HttpReadError(f"{type(exc).__name__}: {quoted(words)}" if words else type(exc).__name__)


class _Attempt:
    """The request as run by the worker thread: its answer, or the error to report."""

    def __init__(
        self,
        request: urllib.request.Request,
        deadline_seconds: float,
        max_bytes: int,
        proxies: bool,
        truncate: bool,
        shown_seconds: float | None = None,
    ) -> None:
        self.request = request
        self.deadline_seconds = deadline_seconds
        # The whole deadline, for the words of a timeout: a redirect's request has only what is left.
        self.shown_seconds = deadline_seconds if shown_seconds is None else shown_seconds
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
            self.error = _error_of(exc, self.shown_seconds)

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


def _request(url: str, data: bytes | None, headers: Mapping[str, str]) -> urllib.request.Request:
    """The request for `url` (http or https); user:password@ in it is sent as basic auth (urllib
    takes it for part of the host name). HttpReadError for a URL that cannot be requested, worded
    without the URL (a webhook's path and user info carry tokens)."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (read for its check: a port that is not a number, or out of range, raises)
    except ValueError as exc:
        raise HttpReadError(f"not a URL that can be requested ({quoted(str(exc))})") from None
    if parts.scheme not in _DIRECT_SCHEMES or not parts.hostname:
        raise HttpReadError("not an http(s) URL")
    added = dict(headers)
    if parts.username is not None:
        userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        added["Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode()
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    try:
        return urllib.request.Request(url, data=data, headers=added)  # noqa: S310 (http and https only)
    except ValueError:
        raise HttpReadError("not a URL that can be requested") from None


def exchange(
    url: str,
    deadline_seconds: float,
    max_bytes: int,
    *,
    data: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    proxies: bool = False,
    truncate: bool = False,
    shown_seconds: float | None = None,
) -> HttpAnswer:
    """Send a request to `url` (a POST of `data`, or a GET) and read the answer within
    `deadline_seconds` in all (connect, headers, body), at most `max_bytes` of body (more is an
    HttpReadError; with `truncate`, the first `max_bytes`). Any final status is an answer; the body
    is read for 2xx only. Raises HttpTimedOut past the deadline (worded with `shown_seconds`, the
    caller's whole deadline, when given), HttpReadError for every other failure."""
    request = _request(url, data, headers or {})
    attempt = _Attempt(request, deadline_seconds, max_bytes, proxies, truncate, shown_seconds)
    worker = _take_worker()
    worker.submit(attempt)
    if not attempt.done.acquire(timeout=max(deadline_seconds, 0.0)):
        attempt.exchange.cut()
        worker.end()  # left behind: it ends when its request does, and serves no other
        raise HttpTimedOut(f"timed out after {attempt.shown_seconds:g} s")
    _keep_worker(worker)
    if attempt.error is not None:
        raise attempt.error
    assert attempt.answer is not None  # the worker sets one or the other
    return attempt.answer


def _origin(url: str) -> tuple[str, str, int]:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, (parts.hostname or "").lower(), port


def _redirect_target(current: str, location: str) -> str:
    """Where a redirect from `current` to `location` leads, if it stays on `current`'s scheme, host
    and port; HttpReadError for one anywhere else, and for a Location that is not a URL."""
    try:
        target = urllib.parse.urljoin(current, location)
        elsewhere = _origin(target) != _origin(current)
    except ValueError as exc:
        raise HttpReadError(f"redirected to {quoted(location)!r}, not a URL ({quoted(str(exc))})") from None
    if elsewhere:
        raise HttpReadError(f"redirected to another origin ({quoted(target)}): not followed")
    return target


def get(
    url: str,
    deadline_seconds: float,
    max_bytes: int,
    *,
    truncate: bool = False,
    accept: str | None = None,
    same_origin_redirects: int = 0,
) -> HttpAnswer:
    """GET a local server's `url` (http or https) with `exchange`, no proxy. Up to
    `same_origin_redirects` redirects to the same scheme, host and port are followed, all within
    the one deadline; one elsewhere, or more of them, is an HttpReadError."""
    headers = {"User-Agent": "gpu-agent", "Accept-Encoding": "identity"}
    if accept is not None:
        headers["Accept"] = accept
    deadline = time.monotonic() + deadline_seconds
    current = url
    for _ in range(same_origin_redirects + 1):
        left = deadline - time.monotonic()
        if left <= 0:
            raise HttpTimedOut(f"timed out after {deadline_seconds:g} s")
        answer = exchange(current, left, max_bytes, headers=headers, truncate=truncate, shown_seconds=deadline_seconds)
        if not same_origin_redirects or answer.status not in _REDIRECT_STATUSES or not answer.location:
            return answer
        current = _redirect_target(current, answer.location)
    raise HttpReadError(f"more than {same_origin_redirects} redirects")
