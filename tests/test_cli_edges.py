"""The CLI's edges, as an operator meets them, with real processes: a stdout that cannot be written,
numbers out of range."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import gpu_agent, write_config

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


# -- numbers ----------------------------------------------------------------------------------------

TOO_BIG = "9" * 23  # beyond SQLite's 64-bit integers


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["ack", f"gpu:{TOO_BIG}"], f"'gpu:{TOO_BIG}': GPU {TOO_BIG} is not a GPU index (0-4294967295)"),
        (["ack", f"xid:48@{TOO_BIG}"], f"GPU {TOO_BIG} is not a GPU index (0-4294967295)"),
        (["ack", f"xid:{TOO_BIG}@1"], f"Xid {TOO_BIG} is not a code the driver reports (1-999)"),
        (["ack", "xid:0@1"], "Xid 0 is not a code the driver reports (1-999)"),
        (["events", "--since", f"{TOO_BIG}{TOO_BIG}d"], "at most 3650d"),
        (["events", "--since", "²s"], "give a duration like 90s"),
        (["events", "--since", "1e9s"], "give a duration like 90s"),
        (["xid", "explain", TOO_BIG], "an Xid code is a whole number from 1 to 999"),
        (["xid", "explain", "0"], "an Xid code is a whole number from 1 to 999"),
        (["inject", "xid", "13", "--gpu", "0", "--pid", TOO_BIG], "a pid is a whole number from 1 to 4194304"),
        (["inject", "processes", "--gpu", "0", "-5"], "a pid is a whole number from 1 to 4194304"),
    ],
)
def test_a_number_out_of_range_is_a_usage_error_before_anything_is_opened(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    result = gpu_agent(*argv, "--config", str(write_config(tmp_path)))
    assert result.returncode == 2, result.stdout + result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "state").exists()  # refused before the store (or the simulated node) was touched


def test_an_index_in_digits_that_are_not_ascii_names_no_gpu(tmp_path: Path) -> None:
    """`gpu:²` reads as digits to Python's isdigit() but int() refuses it: it is no index, so a UUID
    that matches nothing."""
    result = gpu_agent("ack", "gpu:²", "--config", str(write_config(tmp_path)))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "gpu:²: nothing to acknowledge" in result.stderr
