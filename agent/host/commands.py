"""Running a host command the agent does not trust to behave: argv only (never a shell), a scrubbed
environment (`MINIMAL_ENV`), its own process group, a timeout that kills that whole group, and its
output read from a pipe while it streams, keeping only its last `output_limit_bytes`: a command
that writes gigabytes costs neither memory nor disk. Once the command has ended, what is already in
the pipe is read for at most `_DRAIN_SECONDS`, so a daemon it leaves behind holding stdout does not
stall the agent.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: The whole environment of every command the agent runs: nothing inherited (no secrets, no
#: LD_PRELOAD, no PYTHONPATH), a PATH of system directories only.
MINIMAL_ENV: dict[str, str] = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
OUTPUT_LIMIT_BYTES = 4096
_DRAIN_SECONDS = 0.2
_POLL_SECONDS = 0.05  # how soon the command's exit is seen while something else holds its output open
_READ_CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class ProcessResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: killed after the timeout
    output: str  # stdout and stderr together, the last OUTPUT_LIMIT_BYTES of it
    duration_seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def describe(self) -> str:
        """`exit 3: <output>`, for details and errors."""
        status = f"timed out after {self.duration_seconds:.1f} s" if self.timed_out else f"exit {self.returncode}"
        return f"{status}: {self.output}" if self.output else status


class _Tail:
    """The last `limit_bytes` of a stream, and how much came before them: memory stays at about
    twice the limit whatever the command writes."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.kept = bytearray()
        self.total_bytes = 0

    def add(self, chunk: bytes) -> None:
        self.total_bytes += len(chunk)
        self.kept += chunk
        if len(self.kept) > 2 * self.limit_bytes:
            del self.kept[: -self.limit_bytes]

    def text(self) -> str:
        data = bytes(self.kept[-self.limit_bytes :]) if self.limit_bytes else b""
        cut = self.total_bytes - len(data)
        decoded = data.decode("utf-8", "replace").strip()
        return f"[{cut} bytes cut] {decoded}" if cut else decoded


def _drive(proc: subprocess.Popen[bytes], output_fd: int, stdin: bytes, tail: _Tail, deadline: float) -> int | None:
    """Feed stdin and keep the output's tail until the command exits (its return code) or the
    deadline passes (None, its group killed); then what is already in the pipe, briefly."""
    selector = selectors.DefaultSelector()
    selector.register(output_fd, selectors.EVENT_READ)
    pending = memoryview(stdin)
    assert proc.stdin is not None  # started with stdin=PIPE
    stdin_fd = proc.stdin.fileno()
    if pending:
        os.set_blocking(stdin_fd, False)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    returncode: int | None = None
    output_open = True
    drain_until: float | None = None  # set once the command has ended
    try:
        while output_open:
            now = time.monotonic()
            if drain_until is None:
                returncode = proc.poll()
                if returncode is None and now >= deadline:
                    # The group, not only the child: a hook's own children must not outlive its timeout.
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                if proc.returncode is not None:
                    # A daemon left behind may hold the output open: read what is there, not what it writes later.
                    drain_until = now + _DRAIN_SECONDS
            elif now >= drain_until:
                break
            wait = (drain_until if drain_until is not None else deadline) - now
            for key, _ in selector.select(min(max(wait, 0.0), _POLL_SECONDS)):
                if key.fd == output_fd:
                    chunk = os.read(output_fd, _READ_CHUNK_BYTES)
                    if chunk:
                        tail.add(chunk)
                    else:
                        output_open = False
                else:
                    try:
                        pending = pending[os.write(stdin_fd, pending[:_READ_CHUNK_BYTES]) :]
                    except (BrokenPipeError, BlockingIOError) as exc:
                        if isinstance(exc, BrokenPipeError):  # it does not read its stdin: fine
                            pending = pending[:0]
                    if not pending:
                        selector.unregister(stdin_fd)
                        proc.stdin.close()
    finally:
        selector.close()
        if not proc.stdin.closed:
            proc.stdin.close()
    if drain_until is None:  # the output ended first: the command is ending too
        try:
            proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        return proc.returncode
    return returncode


def run_process(
    argv: Sequence[str],
    timeout_seconds: float,
    *,
    stdin: bytes = b"",
    env: Mapping[str, str] | None = None,
    output_limit_bytes: int = OUTPUT_LIMIT_BYTES,
    executable: str | None = None,
    pass_fds: Sequence[int] = (),
) -> ProcessResult:
    """Run argv (never through a shell) in a new process group; on timeout kill the whole group.

    `executable`: the file to execute instead of argv[0], which the program still gets as its name
    (and the result still reports); `pass_fds`: descriptors the child keeps (agent.trust.run_trusted
    executes the descriptor it checked, `/proc/self/fd/N`). Raises OSError when the program cannot
    be executed at all.
    """
    started = time.monotonic()
    output_fd, child_output_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            list(argv),
            executable=executable,
            pass_fds=tuple(pass_fds),
            stdin=subprocess.PIPE,
            stdout=child_output_fd,
            stderr=subprocess.STDOUT,
            env=dict(MINIMAL_ENV if env is None else env),
            start_new_session=True,
            close_fds=True,
        )
    except BaseException:
        os.close(output_fd)
        raise
    finally:
        os.close(child_output_fd)
    tail = _Tail(output_limit_bytes)
    try:
        returncode = _drive(proc, output_fd, stdin, tail, started + timeout_seconds)
    finally:
        os.close(output_fd)
    return ProcessResult(tuple(argv), returncode, tail.text(), time.monotonic() - started)
