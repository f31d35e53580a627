"""A stand-in for an inference server (sglang, vLLM): answers `/health` the way they do, and can be
told to misbehave.

    python3 inference_standin.py --port 30000 [--host 127.0.0.1] [--control-file F] [--pid-file P]
                                 [--ready-after-seconds S] [--sim-state-dir D --sim-profile h200 --gpus 0,1]

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
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-file", type=Path)
    parser.add_argument("--pid-file", type=Path)
    parser.add_argument("--ready-after-seconds", type=float, default=0.0)
    parser.add_argument("--sim-state-dir")
    parser.add_argument("--sim-profile", default="h200")
    parser.add_argument("--gpus", default="0", help="comma-separated simulated GPU indices")
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
