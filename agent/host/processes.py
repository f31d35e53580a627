"""Every process the agent starts, started here: the one runner (`tests/test_layout.py` keeps
`subprocess` out of every other agent module, the demo and the build-time version code aside).

Whatever the program, it gets:

- its argv as given, never a shell;
- an environment of `MINIMAL_ENV` plus only the variables its caller names (`extra_env`: a hook's
  `GPU_AGENT_*`, a service's `TRITON_CACHE_DIR`): nothing of the agent's own environment reaches
  it (no secret, no LD_PRELOAD, no PYTHONPATH);
- a process group of its own, and a total deadline on the monotonic clock at which that whole
  group is killed (a hook's own children do not outlive its timeout);
- its output read from a pipe as it streams, never spooled to a file.

Two shapes. `run_process` runs a command to its end and keeps only the last `output_limit_bytes`
of its output (stdout and stderr together unless `separate_errors`): a command that writes
gigabytes costs neither memory nor disk. Once the command has exited, what is already in the pipe
is read for at most `_DRAIN_SECONDS`, so a daemon it leaves behind holding stdout (a service's
start command) does not stall the agent. `ProcessStream` hands the output to its reader as it
comes (the zstd decompressor of an initramfs, journalctl following the kernel log): the same
rules, its stderr kept as a bounded tail, and closing it kills the group of a child still running.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

#: The environment every command starts from: nothing inherited, a PATH of system directories only.
MINIMAL_ENV: dict[str, str] = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
OUTPUT_LIMIT_BYTES = 4096
_DRAIN_SECONDS = 0.2
_POLL_SECONDS = 0.05  # how soon the command's exit is seen while something else holds its output open
_READ_CHUNK_BYTES = 64 * 1024


class ProcessNotStarted(OSError):
    """The program could not be executed at all: missing, not executable, or an argv or environment
    the kernel refuses (a NUL byte, a `=` in a variable's name). `strerror` says why."""


class ProcessTimedOut(TimeoutError):
    """A stream's total deadline passed while it was read: its process group has been killed."""


@dataclass(frozen=True)
class ProcessResult:
    argv: tuple[str, ...]
    returncode: int | None  # None: killed at its deadline
    #: The last output_limit_bytes of what it wrote (stdout and stderr together unless they were
    #: kept apart), decoded and stripped; `[N bytes cut] ` before it when more came.
    output: str
    duration_seconds: float
    output_cut_bytes: int = 0
    errors: str = ""  # stderr's tail when kept apart from the output

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def ended(self) -> str:
        """`exit 3`, or `timed out after 90.0 s`."""
        return f"timed out after {self.duration_seconds:.1f} s" if self.timed_out else f"exit {self.returncode}"

    def describe(self) -> str:
        """`exit 3: <output>`, for details and errors."""
        return f"{self.ended}: {self.output}" if self.output else self.ended


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

    @property
    def cut_bytes(self) -> int:
        return self.total_bytes - min(len(self.kept), self.limit_bytes)

    def text(self) -> str:
        data = bytes(self.kept[-self.limit_bytes :]) if self.limit_bytes else b""
        decoded = data.decode("utf-8", "replace").strip()
        return f"[{self.cut_bytes} bytes cut] {decoded}" if self.cut_bytes else decoded


class ProcessStream:
    """A running child whose output its reader takes as it comes; a context manager.

    `timeout_seconds`: the total deadline, from the start; None only for a follower that runs until
    its reader closes it (journalctl -f). `stdin`: bytes fed to it while its output is read;
    `stdin_fd`: a descriptor it reads by itself instead (a file the decompressor reads on from our
    offset). `executable`: the file to execute instead of argv[0], which the program still gets as
    its name; `pass_fds`: descriptors the child keeps (agent.trust.run_trusted executes the
    descriptor it checked, `/proc/self/fd/N`). Raises ProcessNotStarted.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        timeout_seconds: float | None,
        stdin: bytes = b"",
        stdin_fd: int | None = None,
        extra_env: Mapping[str, str] | None = None,
        separate_errors: bool = False,
        error_limit_bytes: int = OUTPUT_LIMIT_BYTES,
        executable: str | None = None,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.argv = tuple(argv)
        started = time.monotonic()
        self.started = started
        self.deadline = None if timeout_seconds is None else started + timeout_seconds
        self._errors = _Tail(error_limit_bytes)
        self._pending = memoryview(stdin)
        self._drain_until: float | None = None  # set once the child has exited
        self._output_open = True
        self._closed = False
        self._output_fd, child_output_fd = os.pipe()
        self._error_fd: int | None = None
        child_error_fd: int | None = None
        if separate_errors:
            self._error_fd, child_error_fd = os.pipe()
        child_stdin = subprocess.PIPE if stdin else (subprocess.DEVNULL if stdin_fd is None else stdin_fd)
        try:
            self._proc = subprocess.Popen(
                list(argv),
                executable=executable,
                pass_fds=tuple(pass_fds),
                stdin=child_stdin,
                stdout=child_output_fd,
                stderr=subprocess.STDOUT if child_error_fd is None else child_error_fd,
                env={**MINIMAL_ENV, **(extra_env or {})},
                start_new_session=True,
                close_fds=True,
            )
        except (OSError, ValueError) as exc:
            self._close_descriptors()
            code, reason = (
                (exc.errno, exc.strerror or str(exc)) if isinstance(exc, OSError) else (errno.EINVAL, str(exc))
            )
            raise ProcessNotStarted(code, reason, self.argv[0] if self.argv else "") from exc
        finally:
            for fd in (child_output_fd, child_error_fd):
                if fd is not None:
                    os.close(fd)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._output_fd, selectors.EVENT_READ)
        if self._error_fd is not None:
            self._selector.register(self._error_fd, selectors.EVENT_READ)
        if self._proc.stdin is not None:
            os.set_blocking(self._proc.stdin.fileno(), False)
            self._selector.register(self._proc.stdin.fileno(), selectors.EVENT_WRITE)

    def __enter__(self) -> ProcessStream:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    @property
    def returncode(self) -> int | None:
        """The child's exit status once it has been seen to end (negative: the signal)."""
        return self._proc.returncode

    def errors(self) -> str:
        """The tail of its stderr, when kept apart (`separate_errors`)."""
        return self._errors.text()

    def read(self, size: int, /) -> bytes:
        """At most `size` bytes of its output, waiting for them; b"" once the output has ended
        (closed, or the child exited and what it left in the pipe has been read). At the deadline
        its group is killed and ProcessTimedOut raised."""
        chunk = self._pump(size, None)
        assert chunk is not None  # no wait limit: only data or the end return
        return chunk

    def read_within(self, size: int, wait_seconds: float) -> bytes | None:
        """As `read`, but None when nothing came within `wait_seconds` (a follower's reader looks
        at its stop flag between reads)."""
        return self._pump(size, time.monotonic() + wait_seconds)

    def wait(self) -> int | None:
        """Wait for the child to exit, at most until the deadline; there its group is killed and
        the answer is None. Its stdin is closed first: nothing more is fed while waiting."""
        self._close_stdin()
        remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
        try:
            return self._proc.wait(remaining)
        except subprocess.TimeoutExpired:
            self._kill()
            return None

    def close(self) -> None:
        """End it: a child that closed its output is ending and gets a moment to exit by itself;
        one still running has its group killed. Reaped, its stderr's last words read, every
        descriptor closed."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.returncode is None and not self._output_open:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(_DRAIN_SECONDS)
            if self._proc.poll() is None:
                self._kill()
            self._drain_errors()
        finally:
            self._close_stdin()
            self._selector.close()
            self._close_descriptors()

    # -- the loop -----------------------------------------------------------------------------

    def _kill(self) -> None:
        # The group, not only the child: what it started must not outlive it. The child is not
        # reaped yet (it answered poll() with None), so its pid is still this group's.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()

    def _pump(self, size: int, until: float | None) -> bytes | None:
        """Feed stdin and keep stderr's tail until output comes (at most `size` bytes), the output
        ends (b""), `until` passes (None) or the deadline does (ProcessTimedOut)."""
        while self._output_open:
            now = time.monotonic()
            if self._drain_until is None:
                if self._proc.poll() is None and self.deadline is not None and now >= self.deadline:
                    self._kill()
                    raise ProcessTimedOut(f"{self.argv[0]} did not finish in {self.deadline - self.started:g} s")
                if self._proc.returncode is not None:
                    # A daemon left behind may hold the output open: read what is there, not what it writes later.
                    self._drain_until = now + _DRAIN_SECONDS
            elif now >= self._drain_until:
                self._end_output()
                break
            if until is not None and now >= until:
                return None
            limits = [t for t in (self._drain_until or self.deadline, until) if t is not None]
            wait = min(max(min(limits, default=now + _POLL_SECONDS) - now, 0.0), _POLL_SECONDS)
            for key, _ in self._selector.select(wait):
                if key.fd == self._output_fd:
                    chunk = os.read(self._output_fd, size)
                    if not chunk:
                        self._end_output()
                    return chunk
                if key.fd == self._error_fd:
                    self._read_errors()
                else:
                    self._feed_stdin()
        return b""

    def _end_output(self) -> None:
        self._output_open = False
        self._selector.unregister(self._output_fd)

    def _read_errors(self) -> bool:
        """One read of stderr into its tail; False at its end."""
        assert self._error_fd is not None
        chunk = os.read(self._error_fd, _READ_CHUNK_BYTES)
        if chunk:
            self._errors.add(chunk)
            return True
        self._selector.unregister(self._error_fd)
        os.close(self._error_fd)
        self._error_fd = None
        return False

    def _drain_errors(self) -> None:
        """What the ended child left on stderr, for at most _DRAIN_SECONDS (a daemon it left
        behind may hold stderr open)."""
        until = time.monotonic() + _DRAIN_SECONDS
        while self._error_fd is not None and (remaining := until - time.monotonic()) > 0:
            ready, _, _ = select.select([self._error_fd], [], [], remaining)
            if ready and not self._read_errors():
                return

    def _feed_stdin(self) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            self._pending = self._pending[os.write(stdin.fileno(), self._pending[:_READ_CHUNK_BYTES]) :]
        except BlockingIOError:
            return
        except BrokenPipeError:  # it does not read its stdin: fine
            self._pending = self._pending[:0]
        if not self._pending:
            self._close_stdin()

    def _close_stdin(self) -> None:
        stdin = self._proc.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(KeyError):
                self._selector.unregister(stdin.fileno())
            stdin.close()

    def _close_descriptors(self) -> None:
        for fd in (self._output_fd, self._error_fd):
            if fd is not None:
                os.close(fd)
        self._error_fd = None


def run_process(
    argv: Sequence[str],
    timeout_seconds: float,
    *,
    stdin: bytes = b"",
    extra_env: Mapping[str, str] | None = None,
    output_limit_bytes: int = OUTPUT_LIMIT_BYTES,
    separate_errors: bool = False,
    executable: str | None = None,
    pass_fds: Sequence[int] = (),
) -> ProcessResult:
    """Run argv to its end, at most `timeout_seconds`, keeping the tail of its output (see the
    module docstring; the arguments are ProcessStream's). Raises ProcessNotStarted (an OSError)
    when the program cannot be executed at all; a command killed at its deadline is a result."""
    output = _Tail(output_limit_bytes)
    with ProcessStream(
        argv,
        timeout_seconds=timeout_seconds,
        stdin=stdin,
        extra_env=extra_env,
        separate_errors=separate_errors,
        error_limit_bytes=output_limit_bytes,
        executable=executable,
        pass_fds=pass_fds,
    ) as stream:
        try:
            while chunk := stream.read(_READ_CHUNK_BYTES):
                output.add(chunk)
            returncode = stream.wait()
        except ProcessTimedOut:
            returncode = None
    return ProcessResult(
        stream.argv,
        returncode,
        output.text(),
        time.monotonic() - stream.started,
        output_cut_bytes=output.cut_bytes,
        errors=stream.errors(),
    )
