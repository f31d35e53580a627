"""`/metrics` and `/healthz` over HTTP on a daemon thread, from the collector's rendering of the latest snapshot.

`/metrics` is gzipped when the scraper asks for it (`Accept-Encoding: gzip`, which Prometheus sends
on every scrape): a scrape of an 8-GPU node is a few kilobytes instead of tens. Each snapshot is
rendered (and compressed) once per format, however often it is scraped.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from agent.api_server import ServingThread
from agent.logs import get_logger
from agent.metrics.collector import SnapshotCollector, SnapshotGetter
from agent.names.metric_families import DEFAULT_SWITCHES, FamilySwitches
from agent.state import NodeSnapshot
from agent.verdict import attention_items, node_problem

log = get_logger()

# A client that stalls mid-request must not pin a server thread forever.
_REQUEST_TIMEOUT_SECONDS = 10.0
#: zlib's level 6: a 50 KB scrape in well under a millisecond, within a few percent of level 9's size.
_GZIP_LEVEL = 6


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header takes gzip (`gzip`, `gzip;q=0.5`, `*`; not `gzip;q=0`)."""
    for part in accept_encoding.split(","):
        coding, _, parameters = part.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "x-gzip", "*"):
            continue
        quality = parameters.strip().lower()
        if quality.startswith("q="):
            try:
                return float(quality[2:]) > 0
            except ValueError:
                return False
        return True
    return False


def parse_listen(listen: str) -> tuple[str, int]:
    """Split "HOST:PORT" or "[V6]:PORT" into (host, port); an empty host means every IPv4 address."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen address {listen!r} must be HOST:PORT")
    # An exporter listens on every interface unless told otherwise (metrics.listen narrows it).
    return host.removeprefix("[").removesuffix("]") or "0.0.0.0", int(port)  # noqa: S104  # nosec B104


class _Handler(BaseHTTPRequestHandler):
    server: _MetricsHTTPServer
    timeout = _REQUEST_TIMEOUT_SECONDS
    protocol_version = "HTTP/1.1"
    # headers and body go out in two writes; with Nagle the body waits for the delayed ACK (~40 ms)
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            compressed = accepts_gzip(self.headers.get("Accept-Encoding", ""))
            try:
                body = self.server.render(encoder, content_type, compressed)
            except Exception as exc:
                # A bad snapshot must cost one scrape (Prometheus marks the target down), not the server.
                log.exception("rendering metrics failed")
                self._reply(500, "text/plain; charset=utf-8", f"rendering metrics failed: {exc}\n".encode())
                return
            self._reply(200, content_type, body, gzipped=compressed)
        elif path == "/healthz":
            status, health = self.server.health()
            self._reply(status, "application/json", json.dumps(health).encode() + b"\n")
        elif path == "/":
            page = b'<html><body><a href="/metrics">/metrics</a> <a href="/healthz">/healthz</a></body></html>\n'
            self._reply(200, "text/html; charset=utf-8", page)
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found\n")

    def _reply(self, status: int, content_type: str, body: bytes, *, gzipped: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        if self.path.startswith("/metrics"):
            self.send_header("Vary", "Accept-Encoding")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics http request", client=self.address_string(), detail=format % args)


class _MetricsHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        health: Callable[[], tuple[int, dict[str, object]]],
        get_snapshot: SnapshotGetter,
        collector: SnapshotCollector,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.registry = registry
        self.health = health
        self.get_snapshot = get_snapshot
        self.collector = collector
        # One rendering per snapshot, switches, format and encoding: the loop publishes a snapshot
        # every interval, Prometheus (and dashboards, and people with curl) may scrape more often.
        self._rendered: dict[tuple[str, bool], tuple[NodeSnapshot, FamilySwitches, bytes]] = {}
        self._render_lock = threading.Lock()
        super().__init__(address, _Handler)

    def render(self, encoder: Callable[[CollectorRegistry], bytes], content_type: str, gzipped: bool = False) -> bytes:
        snapshot = self.get_snapshot()
        with self._render_lock:
            switches = self.collector.switches
            cached = self._rendered.get((content_type, gzipped))
            # the cache holds the snapshot itself, so `is` cannot be fooled by a reused id()
            if snapshot is not None and cached is not None and cached[0] is snapshot and cached[1] is switches:
                return cached[2]
            body = encoder(self.registry)
            if gzipped:
                body = gzip.compress(body, compresslevel=_GZIP_LEVEL, mtime=0)
            if snapshot is not None:
                self._rendered[(content_type, gzipped)] = (snapshot, switches, body)
            return body


class MetricsServer:
    """`/metrics` and `/healthz` of `get_snapshot()` on "HOST:PORT" (port 0: any free port, see `.port`),
    served from the start on a daemon thread; `close()` stops it and frees the port.

    `get_snapshot` must only return a reference (the loop publishes a new frozen snapshot by
    swapping it), so a scrape never waits on the loop or the GPU backend.
    `stale_after_seconds`: `/healthz` answers 503 once the last snapshot is older than this.
    `switches`: the families shown whole (`metrics.families`).
    """

    def __init__(
        self,
        listen: str,
        get_snapshot: SnapshotGetter,
        *,
        stale_after_seconds: float | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        switches: FamilySwitches = DEFAULT_SWITCHES,
    ) -> None:
        self._get_snapshot = get_snapshot
        self._stale_after_seconds = stale_after_seconds
        self._clock = clock  # a snapshot no loop published is as old as its wall-clock timestamp says
        self._monotonic = monotonic  # a published one, as old as the monotonic clock says
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = SnapshotCollector(get_snapshot, switches=switches)
        self.registry.register(self._collector)
        self._server = _MetricsHTTPServer(
            parse_listen(listen), self.registry, self._health, get_snapshot, self._collector
        )
        bound = self._server.server_address
        self.host: str = str(bound[0])
        self.port: int = int(bound[1])
        self._serving = ServingThread(self._server, "metrics-http")
        self._serving.start()

    def _health(self) -> tuple[int, dict[str, object]]:
        """200 while snapshots keep coming; 503 before the first one, once the last is too old, or while
        the node has a problem (no driver, no or missing GPUs). The body carries the verdict's
        attention lines (a service down, a next boot not ready, ...): worth a look, not a reason to
        take the node out of rotation."""
        snapshot = self._get_snapshot()
        if snapshot is None:
            return 503, {"status": "starting", "detail": "no snapshot yet"}
        published = snapshot.published_monotonic_seconds
        since = self._clock() - snapshot.timestamp_seconds if published is None else self._monotonic() - published
        age_seconds = max(0.0, since)
        needs = attention_items(snapshot)
        body: dict[str, object] = {
            "status": "ok",
            "snapshot_age_seconds": round(age_seconds, 3),
            "attention": [item.text for item in needs],
            "causes": [item.cause.value for item in needs],
        }
        if self._stale_after_seconds is not None and age_seconds > self._stale_after_seconds:
            body["status"] = "stale"
            body["detail"] = f"last snapshot is {age_seconds:.0f} s old (limit {self._stale_after_seconds:g} s)"
            return 503, body
        problem = node_problem(snapshot)
        if problem is not None:
            # No driver or missing GPUs: the agent runs, but the node is not one to send work to.
            body.update(status="problem", cause=problem.cause.value, detail=problem.detail)
            return 503, body
        return 200, body

    @property
    def switches(self) -> FamilySwitches:
        return self._collector.switches

    @switches.setter
    def switches(self, switches: FamilySwitches) -> None:
        """The families shown from the next scrape on (a reload of `metrics.families`)."""
        self._collector.switches = switches

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._serving.stop()
