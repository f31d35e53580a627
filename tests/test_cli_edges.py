"""The CLI's edges, as an operator meets them, with real processes: a stdout that cannot be written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import write_config

# -- a stdout that cannot be written --------------------------------------------------------------

OUTPUT_COMMANDS = {
    "status": ["status", "--direct"],
    "events": ["events", "--json"],
    "help": ["--help"],
    "xid explain": ["xid", "explain", "79"],
}


def run_with_stdout(how: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """The CLI with its stdout closed (the shell's `>&-`), on /dev/full, or a pipe nobody reads."""
    command = [sys.executable, "-m", "agent.cli", *argv]
    if how == "closed":
        return subprocess.run(
            ["sh", "-c", 'exec "$@" >&-', "sh", *command], capture_output=False, stderr=subprocess.PIPE, text=True
        )
    if how == "full":
        with open("/dev/full", "w") as full:
            return subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: EPIPE
    try:
        return subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("name", OUTPUT_COMMANDS)
@pytest.mark.parametrize(
    ("how", "code", "said"),
    [
        ("closed", 1, "gpu-agent: cannot write the output: stdout is closed\n"),
        ("full", 1, "gpu-agent: cannot write the output: No space left on device\n"),
        ("reader gone", 0, ""),
    ],
)
def test_output_that_cannot_be_written_ends_the_command_cleanly(
    tmp_path: Path, name: str, how: str, code: int, said: str
) -> None:
    argv = OUTPUT_COMMANDS[name]
    if name in ("status", "events"):
        argv = [*argv, "--config", str(write_config(tmp_path, mode="observe"))]
    result = run_with_stdout(how, argv)
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
    assert result.returncode == code, result.stderr
    assert result.stderr.endswith(said), result.stderr
