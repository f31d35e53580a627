"""A stand-in for an inference server (sglang, vLLM): answers `/health` the way they do, and can be
told to misbehave.

    python3 -m agent.standin --port 30000 [--host 127.0.0.1] [--control-file F] [--pid-file P]
                                 [--ready-after-seconds S] [--sim-state-dir D --sim-profile h200 --gpus 0,1]
                                 [--daemon]
    python3 -m agent.standin --stop --pid-file P

`--daemon` forks the server into the background and returns once it listens (its pid in the pid
file); `--stop` sends SIGTERM to the pid in the pid file and waits until it is gone. Together they
are the start and stop commands of a service with `manager: command`.

`GET /health` (and `/health_generate`, `/v1/models`) answers 200 with body `OK` while healthy. The
control file, re-read on every request and every 0.1 s, holds one word:

    ok      healthy (also when the file is missing or empty)
    503     answer 503 Service Unavailable (a server that is up but not serving)
    hang    accept the connection and never answer (a wedged server)
    exit    exit now with status 3 (a crash)

Signals do the same without a file: SIGUSR1 -> 503, SIGUSR2 -> hang, SIGHUP -> ok; SIGTERM exits 0.
`--ready-after-seconds` answers 503 for that long after start, like a server loading its weights.

With `--sim-state-dir`, the process registers its pid as a compute process on `--gpus` of the
simulated backend whose state lives there (as a real server holds its GPUs) and removes it on exit,
so stopping the service frees the GPU the way it does on a real node.

Only the standard library is used (plus the repository's simulated backend when asked for), so it
also runs under a bare `python3`, e.g. inside the systemd sandbox.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType

MODES = ("ok", "503", "hang", "exit")
CRASH_EXIT_STATUS = 3
HEALTH_PATHS = ("/health", "/health_generate", "/v1/models")


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


def make_handler(behaviour: Behaviour, stop: threading.Event) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path.split("?")[0] not in HEALTH_PATHS:
                self._answer(404, b"not found")
                return
            mode = behaviour.mode()
            while mode == "hang" and not stop.is_set():
                stop.wait(0.05)
                mode = behaviour.mode()
            if mode == "hang":
                return
            if mode == "ok":
                self._answer(200, b"OK")
            else:
                self._answer(503, b"Service Unavailable")

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


class SimGpus:
    """This process as a compute process on simulated GPUs (the backend's state file is shared)."""

    def __init__(self, state_dir: str, profile: str, gpus: list[int]) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from agent.backend.sim import SimulatedBackend

        self.backend = SimulatedBackend(profile, state_dir)
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


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited server stays one until its parent, often init, reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def stop_server(pid_file: Path, timeout_seconds: float = 10.0) -> int:
    """SIGTERM the server named by the pid file and wait for it to go; 0 also when none runs."""
    try:
        pid = int(pid_file.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
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


def daemonize(pid_file: Path, timeout_seconds: float = 20.0) -> None:
    """Fork; the parent exits 0 once the child wrote the pid file (1 if it died first), the child
    returns, detached from the caller's session and output."""
    with contextlib.suppress(FileNotFoundError):
        pid_file.unlink()
    child = os.fork()
    if child == 0:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        return
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if os.waitpid(child, os.WNOHANG)[0] == child:
            print("standin: server exited during start", file=sys.stderr)
            sys.exit(1)
        with contextlib.suppress(OSError):
            if pid_file.read_text(encoding="utf-8").strip() == str(child):
                sys.exit(0)
        time.sleep(0.02)
    print(f"standin: server not listening after {timeout_seconds:g} s", file=sys.stderr)
    sys.exit(1)


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
    args = parser.parse_args(argv)
    if args.stop:
        if args.pid_file is None:
            parser.error("--stop needs --pid-file")
        return stop_server(args.pid_file)
    if args.port is None:
        parser.error("--port is required")
    if args.daemon:
        if args.pid_file is None:
            parser.error("--daemon needs --pid-file")
        daemonize(args.pid_file)

    behaviour = Behaviour(args.control_file, args.ready_after_seconds)
    stop = threading.Event()
    exit_status = [0]
    server = ThreadingHTTPServer((args.host, args.port), make_handler(behaviour, stop))
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

    sim = (
        SimGpus(args.sim_state_dir, args.sim_profile, [int(g) for g in args.gpus.split(",")])
        if args.sim_state_dir
        else None
    )
    if sim is not None:
        sim.attach()
    if args.pid_file is not None:
        args.pid_file.write_text(f"{os.getpid()}\n", encoding="utf-8")
    threading.Thread(target=watch_for_exit, daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        server.server_close()
        if sim is not None:
            sim.detach()
        if args.pid_file is not None:
            with contextlib.suppress(OSError):
                if args.pid_file.read_text(encoding="utf-8").strip() == str(os.getpid()):
                    args.pid_file.unlink()
    return exit_status[0]


# -- for tests: the stand-in as a child process ---------------------------------------------------


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_listening(port: int, timeout_seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
        time.sleep(0.02)
    return False


class StandinServer:
    """`python inference_standin.py` as a child process with a control file in `directory`."""

    def __init__(self, directory: Path, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.control_file = directory / f"standin-{self.port}.control"
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"

    def argv(self) -> list[str]:
        script = str(Path(__file__).resolve())
        return [sys.executable, script, "--port", str(self.port), "--control-file", str(self.control_file)]

    def start(self) -> StandinServer:
        self.set_mode("ok")
        self.proc = subprocess.Popen([*self.argv(), *self.extra_args], stdin=subprocess.DEVNULL)
        if not wait_listening(self.port):
            self.stop()
            raise RuntimeError(f"stand-in did not listen on port {self.port}")
        return self

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.control_file.write_text(mode + "\n", encoding="utf-8")

    def stop(self) -> int | None:
        """SIGTERM and reap; the exit status (None when it had to be killed)."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.terminate()
        try:
            return proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None

    def __enter__(self) -> StandinServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
