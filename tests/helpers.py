"""What many tests need, written once: a bounded wait, a clock the test moves, an event builder,
the context actions run in, the daemon's live parts for a part tested alone, the live processes, a
local HTTP server, a task that waits to be aborted."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import EllipsisType
from typing import Any, TypeVar

from snapshots import TIMESTAMP_SECONDS, gpu_uuid
from systemd_sandbox import live_processes as live_processes  # its home: the sandbox needs the standard library alone

from agent.backend.base import GpuBackend
from agent.config import AgentConfig
from agent.daemon.alert_book import PushBook
from agent.daemon.live import Live
from agent.daemon.sd_notify import SdNotifier
from agent.daemon.timing import LoopTiming
from agent.events import Event, EventKind, Severity, SuggestedAction
from agent.policy.base import HostContext
from agent.policy.engine import PolicyEngine
from agent.rules.actions.context import ActionContext
from agent.services.managers import ServiceManager
from agent.services.prober import HealthProber
from agent.store.attempt_clock import AttemptClock
from agent.store.database import Store

T = TypeVar("T")

POLL_SECONDS = 0.01


def wait_until(
    predicate: Callable[[], T],
    timeout_seconds: float,
    what: str | Callable[[], str],
    *,
    poll_seconds: float = POLL_SECONDS,
) -> T:
    """Poll `predicate` until it returns something true and return that; an AssertionError naming
    `what` once `timeout_seconds` have passed (a callable `what` is asked then, to say what was seen
    last). The predicate runs at least once, and once more at the deadline, so a slow machine fails
    only when the condition really did not come true."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            described = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_seconds:g} s waiting for {described}")
        time.sleep(poll_seconds)


class FakeClock:
    """A clock that moves only when the test says so.

    Calling it reads the wall clock, so it goes wherever code takes `clock: Callable[[], float]`
    (time.time); `monotonic()` is the monotonic reading beside it. `advance` moves both, as time
    passing does; `step_wall` moves only the wall clock, either way, as NTP or an operator does.
    """

    def __init__(self, wall_seconds: float = 1_800_000_000.0, monotonic_seconds: float = 1000.0) -> None:
        self.wall_seconds = wall_seconds
        self.monotonic_seconds = monotonic_seconds

    def __call__(self) -> float:
        return self.wall_seconds

    def wall(self) -> float:
        return self.wall_seconds

    def monotonic(self) -> float:
        return self.monotonic_seconds

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "time passing cannot go backwards: step_wall() steps the wall clock back"
        self.wall_seconds += seconds
        self.monotonic_seconds += seconds

    def step_wall(self, seconds: float) -> None:
        """A wall-clock step (negative: back); the monotonic clock does not notice."""
        self.wall_seconds += seconds


def make_event(
    kind: EventKind = EventKind.XID,
    gpu: int | None = 0,
    *,
    uuid: str | EllipsisType | None = ...,
    severity: Severity = Severity.CRITICAL,
    message: str | None = None,
    timestamp_seconds: float = TIMESTAMP_SECONDS,
    source: str = "test",
    key: str | None = None,
    suggested_action: SuggestedAction = SuggestedAction.NONE,
    **data: Any,
) -> Event:
    """An event as a watcher would make it; keyword arguments beyond Event's fields become `data`.

    By default the uuid is the one tests/snapshots.py gives GPU `gpu` (None without a GPU) and the key
    is unique per kind, target, data and time, so two calls that differ in anything are two faults.
    """
    resolved_uuid = (gpu_uuid(gpu) if gpu is not None else None) if isinstance(uuid, EllipsisType) else uuid
    return Event(
        kind=kind,
        severity=severity,
        gpu=gpu,
        uuid=resolved_uuid,
        message=f"{kind.value} on GPU {gpu}" if message is None else message,
        timestamp_seconds=timestamp_seconds,
        source=source,
        key=key or f"{kind.value}:{resolved_uuid or gpu}:{sorted(data.items())}:{timestamp_seconds:.3f}",
        data=data,
        suggested_action=suggested_action,
    )


def action_context(
    config: AgentConfig, backend: GpuBackend, host: HostContext, managers: Mapping[str, ServiceManager], **fields: Any
) -> ActionContext:
    """What actions reach on a node: `config` on `backend` and `host` with its policy engine, and a
    prober of the config's services through `managers`; `fields` set ActionContext's other fields."""
    return ActionContext(
        config=config,
        backend=backend,
        policy=PolicyEngine(config, backend, host),
        host=host,
        managers=managers,
        prober=HealthProber(config.services, managers),
        **{"alerts": PushBook(), **fields},
    )


#: What a test server answers a GET with: (status, headers, body).
HttpAnswer = tuple[int, Mapping[str, str], bytes]


def live_parts(
    config: AgentConfig,
    clock: FakeClock,
    *,
    boot: str = "boot",
    store: Store | None = None,
    context: Callable[[], object] | None = None,
) -> Live:
    """The daemon's live parts (agent/daemon/live.py), made as the daemon makes them, for one part
    tested alone: on the test's clock, its attempts kept under `boot`, `store` open (the remediator
    would have opened it), and every action given `context` (None: as with no GPU backend open)."""
    live = Live(
        config,
        config_path=None,
        config_identity=None,
        timing=LoopTiming(),
        clock=clock,
        boottime=clock.monotonic,
        notifier=SdNotifier(None, None),
    )
    live.attempt_clock = AttemptClock(boot, clock.monotonic)
    live.store = store
    if context is not None:
        live.action_context = context  # type: ignore[method-assign]
    return live


@contextlib.contextmanager
def http_server(answer: Callable[[str], HttpAnswer]) -> Iterator[str]:
    """A local HTTP server answering every GET with `answer(path)`; yields its base URL
    (`http://127.0.0.1:PORT`) and is shut down on the way out."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, headers, body = answer(self.path)
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class WaitingTask:
    """A task for the action worker (a tune sweep's stand-in) on `gpus`: runs until it is aborted,
    and says why."""

    name = "test task"

    def __init__(self, gpus: frozenset[int] | None = None) -> None:
        self.gpus = gpus
        self.started = threading.Event()
        self.aborted = threading.Event()
        self.reason = ""

    def run(self) -> None:
        self.started.set()
        self.aborted.wait(10)

    def abort(self, reason: str) -> None:
        self.reason = reason
        self.aborted.set()
