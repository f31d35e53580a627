"""The stand-in server (agent/demo/standin.py) as a child process, for tests, benchmarks and the
demo: a free port, a wait until it listens, and `StandinServer` with its control file."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from agent.demo.standin import MODES

#: What the stand-in runs from under a bare python3, outside an installed agent (a unit in the
#: systemd sandbox): these files under one directory DIR, started as `python3 DIR/agent/demo/standin.py`.
STANDIN_FILES = (
    "agent/__init__.py",
    "agent/demo/__init__.py",
    "agent/demo/standin.py",
    "agent/demo/standin_traffic.py",
)


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
        script = str(Path(__file__).resolve().with_name("standin.py"))
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
