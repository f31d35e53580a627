"""Whatever a server answers, each reader of outside data gives a result or its own error, never
another exception: the scrape a ScrapeError, the health and generate probes a failed probe, the
drain an "unreadable" wait, a webhook an ActionError, the agent's alert push the `alerts` collector's
error. The boundary that makes it so
is agent/host/http_read.py; these tests drive every reader through a real socket server in this
process that answers with random status lines, headers, Locations, interim (1xx) answers and
bodies. A `302 Location: http://127.0.0.1:99999/metrics` raised ValueError out of the scrape (and so
out of a sweep's measurement and a drain), and a `103 Early Hints` before `200 OK` made a healthy
server "unhealthy (HTTP 103)" and its page unreadable.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slow_endpoint import read_request

from agent.config.service_entry import ServiceConfig
from agent.daemon.alert_book import Found, PushBook
from agent.daemon.alert_delivery import AlertDelivery
from agent.host import http_read
from agent.printable import printable
from agent.rules.actions.base import ActionError
from agent.rules.actions.http_client import post_json
from agent.services.drain import DrainWait, wait_until_idle
from agent.services.generate_probe import generate_probe
from agent.services.prober import http_probe
from agent.services.scrape import ScrapeError, ServerReading, fetch_text, scrape

DEADLINE_SECONDS = 1.0
PAGE = b"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0\n"
#: The longest error detail a reader may carry: a server's words are quoted, bounded and escaped.
MAX_DETAIL_CHARS = 700


class ScriptedServer:
    """A real HTTP listener in this process: each connection gets its request read, then `answer`
    (the raw bytes of whatever a server may send), then the connection is closed."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.answer = b""
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.requests += 1
            threading.Thread(target=self._serve, args=(conn, self.answer), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket, answer: bytes) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(5.0)
            read_request(conn)
            conn.sendall(answer)
            conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    listening = ScriptedServer()
    yield listening
    listening.close()


def detail_of(text: str) -> str:
    """An error's words, checked: bounded, and nothing in them that `printable` would escape (no
    control or invisible character: they are shown as they are)."""
    assert len(text) <= MAX_DETAIL_CHARS, text[:200]
    assert printable(text) == text, repr(text[:200])
    return text


def read_scrape(origin: str) -> str:
    try:
        return "page: " + fetch_text(origin + "/metrics", DEADLINE_SECONDS)
    except ScrapeError as exc:
        return detail_of(str(exc))


def read_scrape_and_parse(origin: str) -> str:
    try:
        reading = scrape(origin + "/metrics", None, DEADLINE_SECONDS)
    except ScrapeError as exc:
        return detail_of(str(exc))
    assert isinstance(reading, ServerReading)
    return f"running {reading.running}"


def read_health(origin: str) -> str:
    ok, detail = http_probe(origin + "/health", DEADLINE_SECONDS)
    return f"{ok} {detail_of(detail)}"


def read_generate(kind: str | None) -> Callable[[str], str]:
    def probe(origin: str) -> str:
        ok, detail = generate_probe(origin, kind, DEADLINE_SECONDS)
        return f"{ok} {detail_of(detail)}"

    return probe


def read_drain(origin: str) -> str:
    service = ServiceConfig.model_validate({"name": "llm", "health_url": origin + "/health", "kind": "sglang"})
    # A timeout of 0: one reading of the gauge, and the wait ends whatever it says.
    waited = wait_until_idle(
        service, 0.0, monotonic=time.monotonic, sleep=time.sleep, cancel=threading.Event(), poll_seconds=0.1
    )
    assert isinstance(waited, DrainWait)
    return f"{waited.outcome} {detail_of(waited.detail)}"


def read_webhook(origin: str) -> str:
    try:
        return f"HTTP {post_json(origin + '/hook/token', {'a': 1}, DEADLINE_SECONDS, {'X-Token': 'secret'})}"
    except ActionError as exc:
        detail = detail_of(str(exc))
        assert "token" not in detail and "secret" not in detail, detail  # no path, no header value
        return detail


def read_alertmanager(origin: str) -> str:
    """The agent's push of one alert, then its resolution: each round's error is the `alerts`
    collector's, whatever the server answered."""
    book = PushBook()
    delivery = AlertDelivery(book, timeout_seconds=DEADLINE_SECONDS)
    errors = []
    for found in ([Found("GpuLost", {"alertname": "GpuLost", "instance": "node"}, {"summary": "test"}, 0.0)], []):
        book.update(found, (origin,))
        delivery.poke()
        delivery.deliver()
        assert delivery.status is not None
        errors.append(delivery.status.last_error)
    return "; ".join(detail_of(error) for error in errors if error)


READERS: dict[str, Callable[[str], str]] = {
    "scrape": read_scrape,
    "scrape and parse": read_scrape_and_parse,
    "health probe": read_health,
    "generate probe (sglang)": read_generate("sglang"),
    "generate probe (vllm)": read_generate("vllm"),
    "generate probe (either)": read_generate(None),
    "drain": read_drain,
    "webhook": read_webhook,
    "alertmanager": read_alertmanager,
}


def answer(interim: list[bytes], status: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    return b"".join(interim) + status + b"\r\n" + head + b"\r\n" + body


# -- what a server may answer ---------------------------------------------------------------------

latin1 = st.text(st.characters(max_codepoint=255), max_size=30).map(lambda text: text.encode("latin-1"))
CODES = st.sampled_from([100, 101, 102, 103, 150, 199, 200, 204, 299, 301, 302, 303, 307, 308, 404, 500, 503, 999])
VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/0.9", b"HTTP/2", b"HTTP/1.1x", b"http/1.1", b"ICY"])
status_lines = st.one_of(
    st.builds(lambda version, code: version + b" " + code + b" Reason", VERSIONS, CODES.map(lambda c: str(c).encode())),
    st.builds(
        lambda code: b"HTTP/1.1 " + code + b" X",
        st.sampled_from([b"abc", b"2_00", b"+200", b"-1", b"0", b"1000", b"20", b"", b"\xff\xfe"]),
    ),
    latin1,
    st.just(b"HTTP/1.1 200 " + b"x" * 70_000),  # longer than http.client reads as one line
)
LOCATIONS = st.one_of(
    st.sampled_from(
        [
            b"http://127.0.0.1:99999/metrics",  # a port out of range
            b"http://[::1/metrics",  # an IPv6 host never closed
            b"http://127.0.0.1:abc/metrics",
            b"http://[::1]:0/metrics",
            b"//elsewhere.example/metrics",
            b"https://127.0.0.1/metrics",
            b"/metrics",  # the same origin: followed until the redirects run out
            b"metrics/\x00",
            b"",
            b"http://\xff\xfe/",
            b"file:///etc/passwd",
        ]
    ),
    latin1,
)
HEADER_VALUES: dict[bytes, st.SearchStrategy[bytes]] = {
    b"Location": LOCATIONS,
    b"Content-Length": st.sampled_from([b"0", b"5", b"64", b"abc", b"-1", b"99999999999999999999", b"1, 2"]),
    b"Transfer-Encoding": st.sampled_from([b"chunked", b"gzip", b"identity", b"chunked, chunked"]),
    b"Content-Type": st.sampled_from([b"text/plain", b"application/json", b"\xff"]),
    b"Content-Encoding": st.sampled_from([b"gzip", b"br"]),
    b"Connection": st.sampled_from([b"close", b"keep-alive"]),
    b"Link": latin1,
}
headers = st.lists(
    st.one_of(
        st.sampled_from(sorted(HEADER_VALUES)).flatmap(lambda name: HEADER_VALUES[name].map(lambda v: (name, v))),
        st.tuples(latin1, latin1),
    ),
    max_size=5,
) | st.just([(b"X-Many", b"y")] * 150)  # more headers than http.client takes
interim_answers = st.lists(
    st.builds(
        lambda code, fields: answer([], b"HTTP/1.1 " + code, fields, b""),
        st.sampled_from([b"100", b"102", b"103"]),
        headers,
    ),
    max_size=3,
)
bodies = st.one_of(
    st.binary(max_size=100),
    st.sampled_from(
        [
            PAGE,
            b'{"data": [{"id": "m"}], "choices": [{}]}',
            b"5\r\nhello\r\n0\r\n\r\n",  # a chunked body
            b"zz\r\nhello\r\n",  # chunks that are not
            b"\x1f\x8b\x08\x00garbage",  # gzip that is not
        ]
    ),
)
answers = st.builds(answer, interim_answers, status_lines, headers, bodies)

PROPERTY = settings(
    max_examples=120,
    deadline=timedelta(seconds=30),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


@PROPERTY
@given(answers)
def test_any_answer_is_each_readers_result_or_its_own_error(server: ScriptedServer, raw: bytes) -> None:
    server.answer = raw
    for reader in READERS.values():
        reader(server.origin)  # no other exception: each reader's checks are in the reader


# -- interim answers ------------------------------------------------------------------------------

EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"


def final(status: bytes, body: bytes) -> bytes:
    return answer([], b"HTTP/1.1 " + status, [(b"Content-Length", str(len(body)).encode())], body)


@pytest.mark.parametrize("interim", [EARLY_HINTS, EARLY_HINTS * 3, b"HTTP/1.1 100 Continue\r\n\r\n" + EARLY_HINTS])
def test_interim_answers_before_the_final_one_are_skipped(server: ScriptedServer, interim: bytes) -> None:
    """A server that sends `103 Early Hints` before its `200 OK` is a healthy server whose page is
    read: it was "unhealthy (HTTP 103)" with an unreadable page."""
    server.answer = interim + final(b"200 OK", PAGE)
    assert http_probe(server.origin + "/health", DEADLINE_SECONDS) == (True, "HTTP 200")
    assert scrape(server.origin + "/metrics", "sglang", DEADLINE_SECONDS).running == 0
    assert read_drain(server.origin) == "idle "
    assert generate_probe(server.origin, "sglang", DEADLINE_SECONDS)[0]
    assert post_json(server.origin + "/hook", {}, DEADLINE_SECONDS) == 200
    server.answer = interim + final(b"503 Service Unavailable", b"")
    assert http_probe(server.origin + "/health", DEADLINE_SECONDS) == (False, "HTTP 503")


def test_endless_interim_answers_are_an_error_not_a_spin(server: ScriptedServer) -> None:
    server.answer = EARLY_HINTS * (http_read.MAX_INTERIM_ANSWERS + 1) + final(b"200 OK", PAGE)
    assert http_probe(server.origin + "/health", DEADLINE_SECONDS) == (
        False,
        f"more than {http_read.MAX_INTERIM_ANSWERS} interim (1xx) answers",
    )


def test_switching_protocols_unasked_is_a_final_answer_that_fails(server: ScriptedServer) -> None:
    server.answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n" + final(b"200 OK", PAGE)
    assert http_probe(server.origin + "/health", DEADLINE_SECONDS) == (False, "HTTP 101")


# -- redirects ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("location", "why"),
    [
        (b"http://127.0.0.1:99999/metrics", "not a URL (Port out of range 0-65535)"),
        (b"http://[::1/metrics", "not a URL (Invalid IPv6 URL)"),
    ],
)
def test_a_redirect_to_a_location_that_is_not_a_url_is_each_readers_error(
    server: ScriptedServer, location: bytes, why: str
) -> None:
    """The scrape raised ValueError out of `fetch_text` (a sweep ended without its restore, a drain
    failed its restart with "internal error: ValueError"); the webhook's opener did the same inside."""
    server.answer = answer([], b"HTTP/1.1 302 Found", [(b"Location", location), (b"Content-Length", b"0")], b"")
    with pytest.raises(ScrapeError, match=re.escape(f"redirected to '{location.decode()}', {why}")):
        fetch_text(server.origin + "/metrics", DEADLINE_SECONDS)
    assert read_drain(server.origin).startswith("unreadable redirected to")
    assert http_probe(server.origin + "/health", DEADLINE_SECONDS) == (False, "HTTP 302")
    with pytest.raises(ActionError, match=r": HTTP 302$"):
        post_json(server.origin + "/hook", {}, DEADLINE_SECONDS)


def test_a_long_status_line_is_quoted_short_and_escaped(server: ScriptedServer) -> None:
    server.answer = b"\x1b[31m" + b"x" * 5000 + b"\r\n\r\n"
    ok, detail = http_probe(server.origin + "/health", DEADLINE_SECONDS)
    assert not ok
    assert detail.startswith("BadStatusLine: \\x1b[31mxxx") and detail.endswith("…"), detail
    assert len(detail) < 200
