"""A server's /metrics behind a redirect, through a real HTTP server process: followed on the same
scheme, host and port (vLLM answered `307 /metrics -> /metrics/` for a while), within the one
deadline and a bounded number of hops; never to another host or scheme."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.standin_process import free_port, wait_listening
from agent.services.scrape import MAX_REDIRECTS, ScrapeError, fetch_text, scrape

PAGE = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 7.0\n'

SERVER = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    PORT = int(sys.argv[1])
    PAGE = sys.argv[2].encode()
    MOVES = {
        "/metrics": (307, "/metrics/"),
        "/absolute": (301, f"http://127.0.0.1:{PORT}/metrics/"),
        "/relative": (308, "metrics/"),
        "/loop": (302, "/loop"),
        "/elsewhere": (307, f"http://127.0.0.2:{PORT}/metrics/"),
        "/other-port": (307, f"http://127.0.0.1:{PORT + 1}/metrics/"),
        "/https": (307, f"https://127.0.0.1:{PORT}/metrics/"),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path in MOVES:
                status, location = MOVES[self.path]
                self.send_response(status)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path == "/metrics/":
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(PAGE)))
                self.end_headers()
                self.wfile.write(PAGE)
                return
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
    """
)


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[str]:
    script = tmp_path / "redirecting_server.py"
    script.write_text(SERVER)
    port = free_port()
    process = subprocess.Popen([sys.executable, str(script), str(port), PAGE])
    try:
        assert wait_listening(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("path", ["/metrics", "/absolute", "/relative"])
def test_a_same_origin_redirect_is_followed(origin: str, path: str) -> None:
    assert fetch_text(origin + path, timeout_seconds=2.0) == PAGE
    assert scrape(origin + path, timeout_seconds=2.0).running == 7


@pytest.mark.parametrize("path", ["/elsewhere", "/other-port", "/https"])
def test_a_redirect_to_another_host_port_or_scheme_is_refused(origin: str, path: str) -> None:
    with pytest.raises(ScrapeError, match="redirected to another origin"):
        fetch_text(origin + path, timeout_seconds=2.0)


def test_redirects_are_bounded(origin: str) -> None:
    with pytest.raises(ScrapeError, match=f"more than {MAX_REDIRECTS} redirects"):
        fetch_text(origin + "/loop", timeout_seconds=2.0)
