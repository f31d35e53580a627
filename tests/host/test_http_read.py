"""Every HTTP read from a server has one total deadline covering connect, headers and body, and a
size bound (agent/host/http_read.py): the scrape, the health probe, the generate probe and the
webhook POST, each against real misbehaving server processes (tests/slow_endpoint.py). A server
that trickles its response headers one byte at a time keeps every socket read short of its
timeout; before, the scrape and the probes waited for it as long as it dripped."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from slow_endpoint import SlowEndpoint

from agent.config.service_entry import ServiceConfig
from agent.host import http_read
from agent.rules.actions.base import ActionError
from agent.rules.actions.http_client import post_json
from agent.services.generate_probe import generate_probe
from agent.services.prober import HealthProber, http_probe
from agent.services.scrape import ScrapeError, fetch_text

DEADLINE_SECONDS = 1.0
MARGIN_SECONDS = 0.8


def _scrape(url: str) -> str:
    try:
        fetch_text(url + "/metrics", DEADLINE_SECONDS)
    except ScrapeError as exc:
        return str(exc)
    return "answered"


def _health(url: str) -> str:
    return http_probe(url + "/health", DEADLINE_SECONDS)[1]


def _generate_sglang(url: str) -> str:
    return generate_probe(url, "sglang", DEADLINE_SECONDS)[1]


def _generate_vllm(url: str) -> str:
    return generate_probe(url, "vllm", DEADLINE_SECONDS)[1]


def _webhook(url: str) -> str:
    try:
        post_json(url + "/hook", {"a": 1}, DEADLINE_SECONDS)
    except ActionError as exc:
        return str(exc)
    return "answered"


READERS: dict[str, Callable[[str], str]] = {
    "scrape": _scrape,
    "health probe": _health,
    "generate probe (sglang)": _generate_sglang,
    "generate probe (vllm)": _generate_vllm,
    "webhook": _webhook,
}


@pytest.mark.parametrize("mode", ["drip", "silent"])
@pytest.mark.parametrize("reader", READERS)
def test_every_read_from_a_server_ends_at_its_total_deadline(reader: str, mode: str) -> None:
    with SlowEndpoint(mode, "--interval", "0.2") as server:
        answers: list[str] = []
        started = time.monotonic()
        # On a thread of its own, so that a reader without a total deadline fails this test
        # instead of hanging it.
        worker = threading.Thread(target=lambda: answers.append(READERS[reader](server.url())), daemon=True)
        worker.start()
        worker.join(DEADLINE_SECONDS + MARGIN_SECONDS + 2.0)
        took = time.monotonic() - started
        assert answers, f"no answer after {took:.1f} s"
        assert "timed out" in answers[0], answers[0]
        assert DEADLINE_SECONDS - 0.05 <= took < DEADLINE_SECONDS + MARGIN_SECONDS, took
        assert server.wait_for("gone 1", timeout_seconds=5)  # the reader hung up, not left dripping


def test_a_socket_timeout_in_the_worker_is_the_same_timeout_as_the_callers_deadline() -> None:
    """The worker's socket times out on what is left of the deadline, so it can fire a moment
    before the caller's wait: that is still HttpTimedOut, worded with the whole deadline (a scrape
    once reported "timed out after 0.299996 s" for its 0.3 s). The attempt runs on this thread, so
    the socket's timeout is the only one in play."""
    with SlowEndpoint("silent") as server:
        request = urllib.request.Request(server.url("/"))
        attempt = http_read._Attempt(request, 0.3, 4096, proxies=False, truncate=False)
        attempt.run()
    assert isinstance(attempt.error, http_read.HttpTimedOut)
    assert attempt.error.detail == "timed out after 0.3 s"


def test_an_answer_larger_than_the_bound_is_an_error_and_a_truncated_read_stops_there(tmp_path: Path) -> None:
    body = tmp_path / "body"
    body.write_bytes(b"x" * 200_000)
    with SlowEndpoint("file", "--body", str(body)) as server:
        with pytest.raises(http_read.HttpReadError, match="more than the 65536 byte limit"):
            http_read.get(server.url("/"), 2.0, 65536)
        assert http_read.get(server.url("/"), 2.0, 4096, truncate=True).body == b"x" * 4096
        assert generate_probe(server.url(), "vllm", 2.0) == (
            False,
            "response is 200000 bytes, more than the 65536 byte limit",
        )


def test_a_generate_probe_answered_with_60000_brackets_is_a_counted_failure(tmp_path: Path) -> None:
    """The reply of 60 000 `[` raised RecursionError in the probe thread: the failure was never
    counted and the service never declared unhealthy."""
    body = tmp_path / "body"
    body.write_bytes(b"[" * 60_000)
    with SlowEndpoint("file", "--body", str(body)) as server:
        assert generate_probe(server.url(), "vllm", 2.0) == (False, "/v1/models lists no model")
        service = ServiceConfig.model_validate(
            {"name": "llm", "health_url": server.url("/health"), "probe": "generate", "kind": "vllm"}
        )
        prober = HealthProber([service])
        for _ in range(service.unhealthy_after_probes):
            assert not prober.probe_once("llm").ok
    (status,) = prober.statuses()
    assert (status.up, status.consecutive_failures) == (False, service.unhealthy_after_probes)
    assert [e.kind.value for e in prober.take_events()] == ["service_unhealthy"]


def test_reads_share_one_tls_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request built its own verifying context, loading the system's CA store every time:
    four fifths of the daemon's CPU with two scraped and probed services at a 1 s loop."""
    built: list[object] = []
    real = http_read.ssl.create_default_context

    def counted() -> object:
        built.append(real())
        return built[-1]

    monkeypatch.setattr(http_read.ssl, "create_default_context", counted)
    body = tmp_path / "body"
    body.write_bytes(b"ok")
    with SlowEndpoint("file", "--body", str(body)) as server:
        for _ in range(5):
            assert http_read.get(server.url("/"), 2.0, 4096).body == b"ok"
    assert len(built) <= 1  # none when an earlier test already made the one context


@pytest.fixture
def attempt_threads(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The thread each request ran on, in order."""
    threads: list[threading.Thread] = []
    run = http_read._Attempt.run

    def recorded(attempt: http_read._Attempt) -> None:
        threads.append(threading.current_thread())
        run(attempt)

    monkeypatch.setattr(http_read._Attempt, "run", recorded)
    return threads


@pytest.fixture
def ok_body(tmp_path: Path) -> Path:
    body = tmp_path / "body"
    body.write_bytes(b"ok")
    return body


def test_requests_one_after_another_share_one_worker_and_build_no_opener(
    monkeypatch: pytest.MonkeyPatch, attempt_threads: list[threading.Thread], ok_body: Path
) -> None:
    """Each request built a urllib opener of ten handlers and started a thread of its own: with
    two scraped and probed services that was a third of the daemon's CPU on the build host. A
    direct request is now one http.client connection on a worker kept for the next request."""
    openers: list[object] = []
    build_opener = http_read.urllib.request.build_opener
    monkeypatch.setattr(http_read.urllib.request, "build_opener", lambda *h: openers.append(h) or build_opener(*h))
    with SlowEndpoint("file", "--body", str(ok_body)) as server:
        for _ in range(5):
            assert http_read.get(server.url("/"), 2.0, 4096).body == b"ok"
    assert openers == []
    assert len(attempt_threads) == 5 and len(set(attempt_threads)) == 1, attempt_threads
    assert threading.current_thread() not in attempt_threads


def test_a_worker_left_behind_at_the_deadline_serves_no_other_request_and_ends(
    attempt_threads: list[threading.Thread], ok_body: Path
) -> None:
    # A byte every 0.2 s: the worker's socket never times out on its own (a silent server's would,
    # at the same 0.5 s, and a worker that ends its request in time is rightly kept), so only the
    # caller's total deadline ends the request and leaves the worker behind.
    with (
        SlowEndpoint("drip", "--interval", "0.2") as dripping,
        SlowEndpoint("file", "--body", str(ok_body)) as answering,
    ):
        with pytest.raises(http_read.HttpTimedOut, match=r"timed out after 0\.5 s"):
            http_read.get(dripping.url("/"), 0.5, 4096)
        started = time.monotonic()
        assert http_read.get(answering.url("/"), 2.0, 4096).body == b"ok"
        assert time.monotonic() - started < 1.0
        left_behind, answered = attempt_threads
        assert answered is not left_behind
        left_behind.join(5.0)
        assert not left_behind.is_alive()
