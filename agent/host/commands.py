"""Running a host command the agent does not trust to behave: argv only (never a shell), a scrubbed
environment (`MINIMAL_ENV`), its own process group, a timeout that kills that whole group, and its
output captured through a file rather than a pipe, so a command that leaves a daemon behind holding
stdout does not stall the agent. Only the last `output_limit_bytes` of the output are kept.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: The whole environment of every command the agent runs: nothing inherited (no secrets, no
#: LD_PRELOAD, no PYTHONPATH), a PATH of system directories only.
MINIMAL_ENV: dict[str, str] = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
OUTPUT_LIMIT_BYTES = 4096


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


def _tail(data: bytes, limit_bytes: int) -> str:
    if len(data) <= limit_bytes:
        return data.decode("utf-8", "replace").strip()
    return f"[{len(data) - limit_bytes} bytes cut] " + data[-limit_bytes:].decode("utf-8", "replace").strip()


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
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(
            list(argv),
            executable=executable,
            pass_fds=tuple(pass_fds),
            stdin=subprocess.PIPE,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=dict(MINIMAL_ENV if env is None else env),
            start_new_session=True,
            close_fds=True,
        )
        returncode: int | None
        try:
            proc.communicate(input=stdin, timeout=timeout_seconds)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            # The group, not only the child: a hook's own children must not outlive its timeout.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
        output.seek(0)
        text = _tail(output.read(), output_limit_bytes)
    return ProcessResult(tuple(argv), returncode, text, time.monotonic() - started)
