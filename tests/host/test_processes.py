"""The one process runner (agent.host.processes): every bound it promises, against real children.

A child that floods its output costs the agent only the tail; one that never exits is killed at
its deadline with its whole process group; one that leaves a grandchild holding the pipe open does
not stall the agent; none sees the agent's own environment. The layout test keeps every other
agent module on this runner (tests/test_layout.py)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_until

from agent.host.processes import (
    MINIMAL_ENV,
    OUTPUT_LIMIT_BYTES,
    ProcessNotStarted,
    ProcessStream,
    ProcessTimedOut,
    run_process,
)

FLOOD_BYTES = 100 * 1000 * 1000
#: The start of a child that leaves a grandchild holding the output pipe open for a minute.
GRANDCHILD = "import os, sys, time\nif os.fork() == 0:\n    time.sleep(60)\n    os._exit(0)\n"


def python(script: str) -> list[str]:
    return [sys.executable, "-c", script]


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie waiting for whoever reaps it (not us: a grandchild)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def environment_of(output: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


# -- a flood: 100 MB -----------------------------------------------------------------------------


def test_a_100_mb_flood_leaves_only_the_tail_and_counts_the_rest() -> None:
    script = f"import sys\nfor _ in range({FLOOD_BYTES // 1_000_000}):\n    sys.stdout.write('x' * 1_000_000)\nsys.stdout.write('END')\n"
    result = run_process(python(script), 120)
    assert result.returncode == 0
    assert result.output_cut_bytes == FLOOD_BYTES + 3 - OUTPUT_LIMIT_BYTES
    assert result.output == f"[{result.output_cut_bytes} bytes cut] " + "x" * (OUTPUT_LIMIT_BYTES - 3) + "END"


def test_a_100_mb_flood_on_stderr_kept_apart_leaves_the_answer_whole() -> None:
    """A tool's answer is its stdout; what it says on stderr is a bounded tail beside it."""
    script = (
        "import sys\n"
        f"for _ in range({FLOOD_BYTES // 1_000_000}):\n    sys.stderr.write('w' * 1_000_000)\n"
        "sys.stderr.write('last warning')\nprint('the answer')\n"
    )
    result = run_process(python(script), 120, separate_errors=True)
    assert (result.returncode, result.output, result.output_cut_bytes) == (0, "the answer", 0)
    assert result.errors.startswith("[") and result.errors.endswith("wwwlast warning")
    assert len(result.errors) < OUTPUT_LIMIT_BYTES + 40


def test_a_stream_hands_a_100_mb_flood_to_its_reader_whole() -> None:
    with ProcessStream(["head", "-c", str(FLOOD_BYTES), "/dev/zero"], timeout_seconds=120) as stream:
        total = 0
        while chunk := stream.read(1 << 20):
            total += len(chunk)
    assert (total, stream.returncode) == (FLOOD_BYTES, 0)


# -- a child that never exits ------------------------------------------------------------------------


def test_a_command_that_never_exits_is_killed_with_its_group_at_the_deadline(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = (
        "import os, time\n"
        "child = os.fork()\n"
        "if child == 0:\n    time.sleep(60)\n    os._exit(0)\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child}}')\n"
        "print('waiting', flush=True)\n"
        "time.sleep(60)\n"
    )
    began = time.monotonic()
    result = run_process(python(script), 1.0)
    assert result.timed_out and result.ended.startswith("timed out after 1.")
    assert time.monotonic() - began < 5
    assert result.output == "waiting"
    child, grandchild = (int(pid) for pid in pids.read_text().split())
    assert gone(child)
    wait_until(lambda: gone(grandchild), 5, "the grandchild killed with its group")


def test_a_stream_read_past_its_deadline_raises_and_kills_the_child() -> None:
    stream = ProcessStream(
        python("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)"), timeout_seconds=1.0
    )
    with stream:
        pid = int(stream.read(100))
        began = time.monotonic()
        with pytest.raises(ProcessTimedOut):
            stream.read(100)
        assert time.monotonic() - began < 3
    assert gone(pid) and stream.returncode == -9


def test_closing_a_follower_kills_it_and_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    script = (
        "import os, time\n"
        "child = os.fork()\n"
        "if child == 0:\n    time.sleep(60)\n    os._exit(0)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child))\n"
        "while True:\n    print('line', flush=True)\n    time.sleep(0.05)\n"
    )
    with ProcessStream(python(script), timeout_seconds=None) as stream:
        first = stream.read_within(100, 10)
        assert first is not None and first.startswith(b"line\n")  # more lines may have come by now
        wait_until(pid_file.exists, 10, "the follower to start its child")
    assert stream.returncode == -9
    wait_until(lambda: gone(int(pid_file.read_text())), 5, "the follower's child killed with its group")


# -- a grandchild holding the pipe ---------------------------------------------------------------


def test_a_grandchild_holding_the_pipe_does_not_stall_the_agent() -> None:
    """A start command that leaves a server behind returns as soon as the command itself exits;
    the server is left running (it is the service)."""
    began = time.monotonic()
    result = run_process(python(GRANDCHILD + "print(os.getpid(), 'started', flush=True)\n"), 30)
    assert time.monotonic() - began < 3
    assert result.returncode == 0 and result.output.endswith("started")


def test_a_stream_ends_when_its_child_exits_though_a_grandchild_holds_the_pipe() -> None:
    with ProcessStream(
        python(GRANDCHILD + "sys.stdout.write('last words')\nsys.exit(3)\n"), timeout_seconds=30
    ) as stream:
        began = time.monotonic()
        output = b""
        while chunk := stream.read(100):
            output += chunk
        assert time.monotonic() - began < 3
    assert (output, stream.returncode) == (b"last words", 3)


# -- the environment -------------------------------------------------------------------------------


def test_a_secret_in_the_agents_environment_never_reaches_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_AGENT_TEST_SECRET", "hunter2")
    monkeypatch.setenv("LD_PRELOAD", "/tmp/evil.so")
    result = run_process(["env"], 10, extra_env={"TRITON_CACHE_DIR": "/var/cache/triton"})
    assert environment_of(result.output) == {**MINIMAL_ENV, "TRITON_CACHE_DIR": "/var/cache/triton"}
    assert "hunter2" not in result.output
    with ProcessStream(["env"], timeout_seconds=10) as stream:
        streamed = stream.read(1 << 16).decode()
    assert environment_of(streamed) == MINIMAL_ENV


# -- what cannot start -----------------------------------------------------------------------------


def test_a_program_that_cannot_start_is_a_typed_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-program")
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ProcessNotStarted) as caught:
        run_process([missing], 10)
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOENT
    assert caught.value.filename == missing and caught.value.strerror == "No such file or directory"
    with pytest.raises(ProcessNotStarted) as refused:
        run_process(["env"], 10, extra_env={"A=B": "c"})
    assert refused.value.errno == errno.EINVAL
    assert len(os.listdir("/proc/self/fd")) == descriptors  # its pipes closed again


def test_run_process_captures_output_and_truncates_to_the_tail(tmp_path: Path) -> None:
    result = run_process([sys.executable, "-c", "import sys; sys.stdout.write('x' * 10000 + 'END'); sys.exit(4)"], 10)
    assert result.returncode == 4
    assert result.output.endswith("END")
    assert result.output.startswith("[")
    assert "bytes cut]" in result.output
    assert len(result.output) < 4200


def test_run_process_does_not_wait_for_a_daemon_holding_stdout(tmp_path: Path) -> None:
    # A start command that leaves a server behind must return as soon as the command itself exits.
    script = "import os, time\nif os.fork() == 0:\n    time.sleep(5)\n    os._exit(0)\nprint('started')\n"
    began = time.monotonic()
    result = run_process([sys.executable, "-c", script], 10)
    assert time.monotonic() - began < 3
    assert (result.returncode, result.output) == (0, "started")


def test_run_process_keeps_a_bounded_tail_of_a_flood_in_memory_and_nothing_on_disk(tmp_path: Path) -> None:
    """300 MB of output (1.5 GB was an OOM kill under MemoryMax=1G, read whole from a temporary
    file that could fill the disk first): the agent's peak RSS stays far below the output's size,
    no file holds the output, and the tail is the command's last words."""
    flood = "head -c 300000000 /dev/zero | tr '\\0' x; echo; ls -l /proc/$PPID/fd/; echo END"
    probe = (
        "import sys\n"
        "from agent.host.processes import run_process\n"
        f"result = run_process(['/bin/sh', '-c', {flood!r}], 120)\n"
        # VmHWM, not getrusage's ru_maxrss: Linux carries the maxrss of the forked pytest process
        # (hundreds of MB late in a run) across execve into the child's figure.
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))\n"
        "print(result.returncode)\n"
        "sys.stdout.write(result.output)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, check=True)
    peak_kib, returncode, output = done.stdout.split("\n", 2)
    assert returncode == "0"
    assert int(peak_kib) < 150 * 1024, peak_kib  # the interpreter and the agent's imports: ~50 MB
    assert output.startswith("[2999") and "bytes cut] xxx" in output
    assert output.endswith("END")
    assert "pipe:[" in output and "(deleted)" not in output, output[-600:]


def test_run_process_kills_a_flooding_command_at_its_timeout_with_the_tail_read() -> None:
    began = time.monotonic()
    result = run_process(["/bin/sh", "-c", "yes flood"], 1.0)
    assert result.timed_out
    assert time.monotonic() - began < 2.5
    assert result.output.endswith("flood") and "bytes cut]" in result.output


def test_run_process_feeds_stdin_to_a_command_that_reads_it_and_one_that_does_not() -> None:
    data = b"e" * 300_000  # more than a pipe holds: written while the output is read
    echoed = run_process(["/bin/sh", "-c", "wc -c"], 10, stdin=data)
    assert (echoed.returncode, echoed.output) == (0, "300000")
    ignored = run_process(["/bin/sh", "-c", "echo ignored"], 10, stdin=data)
    assert (ignored.returncode, ignored.output) == (0, "ignored")
