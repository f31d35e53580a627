"""A stand-in for an inference server (sglang, vLLM): answers `/health` the way they do, and can be
told to misbehave.

    python3 -m agent.demo.standin --port 30000 [--host 127.0.0.1] [--control-file F] [--pid-file P]
                                 [--ready-after-seconds S] [--sim-state-dir D --sim-profile h200 --gpus 0,1]
                                 [--daemon]
    python3 -m agent.demo.standin --stop --pid-file P

Here: the server, its HTTP answers and its process (the pid file, `--daemon`, `--stop`, signals);
its traffic and the /metrics page it renders: agent/demo/standin_traffic.py. Only the standard
library is used (plus the repository's simulated backend when asked for), so it also runs under a
bare `python3`, e.g. inside the systemd sandbox, from a tree that holds the two modules and their
packages' `__init__.py` (agent/demo/standin_process.py `STANDIN_FILES`). What it answers, how it
misbehaves on request, its traffic and metrics: docs/simulator.md, "The stand-in server".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType

if not __package__:
    # Run as a file (python3 DIR/agent/demo/standin.py, as a unit's ExecStart may): its traffic module
    # comes from the tree this file is in, whether or not an agent is installed.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.demo.standin_traffic import FLAVORS, MODEL_NAME, Traffic, run_traffic

MODES = ("ok", "503", "hang", "exit")
CRASH_EXIT_STATUS = 3
TRAFFIC_TICK_SECONDS = 0.25
HEALTH_PATHS = ("/health", "/health_generate", "/v1/models", "/metrics")


class Behaviour:
    """The current mode: from the control file when one is given and says something, else from signals."""

    def __init__(self, control_file: Path | None, ready_after_seconds: float) -> None:
        self.control_file = control_file
        self.signalled = "ok"
        self.ready_at = time.monotonic() + ready_after_seconds
        self.changed = threading.Event()

    def mode(self) -> str:
        if self.control_file is not None:
            try:
                word = self.control_file.read_text(encoding="utf-8").strip().lower()
            except OSError:
                word = ""
            if word in MODES and word != "ok":
                return word
            if word and word not in MODES:
                print(f"standin: unknown control word {word!r}", file=sys.stderr)
        if self.signalled != "ok":
            return self.signalled
        return "503" if time.monotonic() < self.ready_at else "ok"

    def on_signal(self, mode: str) -> Callable[[int, FrameType | None], None]:
        def handler(_signum: int, _frame: FrameType | None) -> None:
            self.signalled = mode
            self.changed.set()

        return handler


def make_handler(
    behaviour: Behaviour,
    stop: threading.Event,
    traffic: Traffic | None = None,
    slowdown: Callable[[], float] = lambda: 1.0,
    draining: Callable[[], bool] = lambda: False,
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            # vLLM has no /health_generate: a generate probe finds it out by this 404.
            vllm = traffic is not None and traffic.flavor == "vllm"
            unknown = path not in HEALTH_PATHS or (path == "/metrics" and traffic is None)
            if unknown or (vllm and path == "/health_generate"):
                self._answer(404, b"not found")
                return
            if self._serving():
                self._answer_ok(path)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            request = self.rfile.read(length) if length else b""
            if self.path.split("?")[0] != "/v1/completions":
                self._answer(404, b"not found")
                return
            if not self._serving():
                return
            try:
                # Standard library only (this file runs under a bare python3): a body nested too deep
                # for json is a RecursionError, one bad request, never the server's end.
                model = json.loads(request or b"{}").get("model")
            except (ValueError, AttributeError, RecursionError):
                model = None
            if model != MODEL_NAME:
                self._answer(404, json.dumps({"error": f"model {model!r} does not exist"}).encode(), "application/json")
                return
            choice = {"index": 0, "text": " pong", "finish_reason": "length"}
            body = {"object": "text_completion", "model": MODEL_NAME, "choices": [choice]}
            self._answer(200, json.dumps(body).encode(), "application/json")

        def _serving(self) -> bool:
            """Wait out a hang; answer 503 when told to; True when the request should be served."""
            mode = behaviour.mode()
            while mode == "hang" and not stop.is_set():
                stop.wait(0.05)
                mode = behaviour.mode()
            if mode == "hang":
                return False
            if mode != "ok":
                self._answer(503, b"Service Unavailable")
                return False
            return True

        def _answer_ok(self, path: str) -> None:
            if path == "/metrics" and traffic is not None:
                traffic.advance_to(time.monotonic(), slowdown(), draining())  # counters as of this request
                self._answer(200, traffic.render().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/v1/models":
                model = {"id": MODEL_NAME, "object": "model", "owned_by": "standin"}
                self._answer(200, json.dumps({"object": "list", "data": [model]}).encode(), "application/json")
            else:
                self._answer(200, b"OK")

        def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


class SimGpus:
    """This process as a compute process on simulated GPUs (the backend's state file is shared)."""

    def __init__(self, state_dir: str, profile: str, gpus: list[int]) -> None:
        from agent.backend.sim import SimulatedBackend

        self.backend = SimulatedBackend(profile, state_dir, counter_clock=time.monotonic)
        self.backend.init()
        self.gpus = gpus

    def _pids(self, gpu: int) -> list[int]:
        return [p.pid for p in self.backend.compute_processes(gpu)]

    def attach(self) -> None:
        for gpu in self.gpus:
            self.backend.set_processes(gpu, [*self._pids(gpu), os.getpid()])

    def detach(self) -> None:
        for gpu in self.gpus:
            self.backend.set_processes(gpu, [p for p in self._pids(gpu) if p != os.getpid()])

    def slowdown(self) -> float:
        """How much slower than its best the slowest of our GPUs runs now: its maximum graphics clock
        over its current one (2.0 under a thermal slowdown that halves the clock)."""
        from agent.backend.base import ClockDomain

        factor = 1.0
        for gpu in self.gpus:
            try:
                current = self.backend.clock_mhz(gpu, ClockDomain.GRAPHICS)
                best = self.backend.max_clock_mhz(gpu, ClockDomain.GRAPHICS)
            except Exception:  # noqa: S112  # nosec B112 (a lost or failing GPU is skipped; the agent reports it)
                continue
            factor = max(factor, best / max(current, 1))
        return factor


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited server stays one until its parent, often init, reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def read_pid(pid_file: Path) -> int | None:
    """The pid in the file; None while there is none (no server, or one between stop and start)."""
    try:
        return int(pid_file.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None


def write_pid(pid_file: Path) -> None:
    """Publish this process's pid by rename, so a reader sees the old file, none, or the whole new
    one, never a half-written one."""
    partial = pid_file.with_name(f".{pid_file.name}.{os.getpid()}")
    partial.write_text(f"{os.getpid()}\n", encoding="utf-8")
    partial.replace(pid_file)


def stop_server(pid_file: Path, timeout_seconds: float = 10.0) -> int:
    """SIGTERM the server named by the pid file and wait for it to go; 0 also when none runs."""
    pid = read_pid(pid_file)
    if pid is None:
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return 0
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if not running(pid):
            return 0
        time.sleep(0.02)
    print(f"standin: pid {pid} still running after {timeout_seconds:g} s", file=sys.stderr)
    return 1


#: How much of what a server that died during start wrote to stderr `--daemon` passes on.
START_STDERR_TAIL_BYTES = 2048


def daemonize(pid_file: Path, timeout_seconds: float = 20.0) -> None:
    """Fork; the parent exits 0 once the child wrote the pid file (1 if it died first, passing on
    the tail of what it wrote to stderr: why it could not start), the child returns, detached from
    the caller's session; its stderr goes to the parent until `detach_stderr`."""
    with contextlib.suppress(FileNotFoundError):
        pid_file.unlink()
    errors_read, errors_write = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        os.close(errors_read)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):
            os.dup2(devnull, fd)
        os.dup2(errors_write, 2)
        os.close(errors_write)
        os.close(devnull)
        return
    os.close(errors_write)
    os.set_blocking(errors_read, False)
    written = bytearray()
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(errors_read, 65536):
                written += chunk
                del written[:-START_STDERR_TAIL_BYTES]
        if os.waitpid(child, os.WNOHANG)[0] == child:
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(errors_read, 65536):
                    written += chunk
            tail = bytes(written[-START_STDERR_TAIL_BYTES:]).decode("utf-8", "replace").strip()
            print("standin: server exited during start" + (f": {tail}" if tail else ""), file=sys.stderr)
            sys.exit(1)
        if read_pid(pid_file) == child:
            sys.exit(0)
        time.sleep(0.02)
    print(f"standin: server not listening after {timeout_seconds:g} s", file=sys.stderr)
    sys.exit(1)


def detach_stderr() -> None:
    """A daemonized server that started: its stderr goes nowhere from now on."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    parser.add_argument("--daemon", action="store_true")
    parser.add_argument("--stop", action="store_true")
    parser.add_argument("--control-file", type=Path)
    parser.add_argument("--pid-file", type=Path)
    parser.add_argument("--ready-after-seconds", type=float, default=0.0)
    parser.add_argument("--sim-state-dir")
    parser.add_argument("--sim-profile", default="h200")
    parser.add_argument("--gpus", default="0", help="comma-separated simulated GPU indices")
    parser.add_argument("--flavor", choices=FLAVORS, default="sglang", help="whose /metrics families to export")
    parser.add_argument("--metric-names", choices=("current", "legacy"), default="current")
    parser.add_argument("--request-rate", type=float, default=8.0, help="simulated requests per second")
    parser.add_argument("--max-running", type=int, default=32, help="requests served at once; the rest wait")
    parser.add_argument(
        "--concurrency", type=int, help="closed loop: this many clients instead of --request-rate (a benchmark)"
    )
    parser.add_argument("--dp-ranks", type=int, default=1, help="sglang: scheduler families per data-parallel rank")
    parser.add_argument(
        "--tp-ranks", type=int, default=1, help="sglang: TP ranks exporting each batch (all schedulers' metrics)"
    )
    parser.add_argument("--drain-file", type=Path, help="while it exists, no new requests arrive (a drained node)")
    parser.add_argument(
        "--drain-seconds", type=float, default=5.0, help="how long the running requests take to finish when drained"
    )
    args = parser.parse_args(argv)
    if args.stop:
        if args.pid_file is None:
            parser.error("--stop needs --pid-file")
        return stop_server(args.pid_file)
    if args.port is None:
        parser.error("--port is required")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.daemon:
        if args.pid_file is None:
            parser.error("--daemon needs --pid-file")
        daemonize(args.pid_file)

    behaviour = Behaviour(args.control_file, args.ready_after_seconds)
    stop = threading.Event()
    exit_status = [0]
    traffic = Traffic(
        args.flavor,
        args.request_rate,
        args.max_running,
        legacy_names=args.metric_names == "legacy",
        dp_ranks=args.dp_ranks,
        concurrency=args.concurrency,
        drain_seconds=args.drain_seconds,
        tp_ranks=args.tp_ranks,
    )
    sim = (
        SimGpus(args.sim_state_dir, args.sim_profile, [int(g) for g in args.gpus.split(",")])
        if args.sim_state_dir
        else None
    )
    pace = sim.slowdown if sim is not None else (lambda: 1.0)
    drain_file: Path | None = args.drain_file
    draining = (lambda: drain_file.exists()) if drain_file is not None else (lambda: False)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(behaviour, stop, traffic, pace, draining))
    server.daemon_threads = True

    def shut_down(status: int) -> None:
        exit_status[0] = status
        stop.set()
        # shutdown() blocks until serve_forever returns, so never call it from that thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, lambda _s, _f: shut_down(0))
    signal.signal(signal.SIGINT, lambda _s, _f: shut_down(0))
    signal.signal(signal.SIGUSR1, behaviour.on_signal("503"))
    signal.signal(signal.SIGUSR2, behaviour.on_signal("hang"))
    signal.signal(signal.SIGHUP, behaviour.on_signal("ok"))

    def watch_for_exit() -> None:
        while not stop.wait(0.1):
            if behaviour.mode() == "exit":
                shut_down(CRASH_EXIT_STATUS)

    if sim is not None:
        try:
            sim.attach()
        except Exception as exc:  # a lost GPU, say: the reason is what the start command reports
            print(f"standin: cannot run on simulated GPUs {args.gpus}: {exc}", file=sys.stderr)
            server.server_close()
            return 1
    if drain_file is not None:
        # A server that starts takes requests again (as its node re-registers with the load balancer).
        with contextlib.suppress(FileNotFoundError):
            drain_file.unlink()
    threading.Thread(
        target=run_traffic, args=(traffic, pace, stop, TRAFFIC_TICK_SECONDS, draining), daemon=True
    ).start()
    if args.pid_file is not None:
        write_pid(args.pid_file)
    if args.daemon:
        detach_stderr()
    threading.Thread(target=watch_for_exit, daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        server.server_close()
        if sim is not None:
            sim.detach()
        if args.pid_file is not None and read_pid(args.pid_file) == os.getpid():
            with contextlib.suppress(OSError):
                args.pid_file.unlink()
    return exit_status[0]


if __name__ == "__main__":
    sys.exit(main())
