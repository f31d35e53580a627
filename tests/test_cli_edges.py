"""The CLI's edges, as an operator meets them, with real processes: a stdout that cannot be written,
numbers out of range, and a caller the status socket or the state directory refuses (run as nobody:
the tests run as root, and skip with the reason otherwise)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hosttree import make_host_tree
from test_cli import gpu_agent, write_config

from agent.api_server import ApiServer

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


# -- a caller the socket or the state directory refuses -------------------------------------------

NOBODY = "nobody"


def nobody_ids() -> tuple[int, int]:
    entry = pwd.getpwnam(NOBODY)
    return entry.pw_uid, entry.pw_gid


def as_nobody(*argv: str, groups: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    """The CLI as nobody, dropped to by util-linux's setpriv (no capability left), in `groups` only."""
    uid, gid = nobody_ids()
    setpriv = shutil.which("setpriv")
    assert setpriv is not None
    supplementary = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return subprocess.run(
        [setpriv, f"--reuid={uid}", f"--regid={gid}", *supplementary, sys.executable, "-m", "agent.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        cwd="/",
    )


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory root owns and anyone may read: what a real node's /etc/gpu-agent and host tree are."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the CLI as another user")
    try:
        nobody_ids()
    except KeyError:
        pytest.skip("no user `nobody` on this host")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed")
    if as_nobody("--version").returncode != 0:
        pytest.skip("this checkout's interpreter is not readable by nobody")
    directory = Path(tempfile.mkdtemp(prefix="gpu-agent-edges-", dir="/tmp"))
    directory.chmod(0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def node_config(directory: Path, backend: str = "simulated") -> Path:
    """An agent.yaml anyone may read; its state_dir root's alone, as the unit makes it (0700)."""
    make_host_tree(directory / "host", kernel_sysfs=False)
    for path in (directory / "host", *(directory / "host").rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    (directory / "state").mkdir(mode=0o700)
    (directory / "run").mkdir(mode=0o755)
    config = directory / "agent.yaml"
    config.write_text(
        f"backend: {backend}\nsimulated: {{profile: h200x2}}\nhost_root: {directory / 'host'}\n"
        f"state_dir: {directory / 'state'}\napi: {{socket: {directory / 'run/agent.sock'}}}\n"
        "remediation: {rules_dirs: []}\n"
    )
    config.chmod(0o644)
    return config


def a_group_nobody_is_not_in() -> grp.struct_group:
    _, gid = nobody_ids()
    for group in grp.getgrall():
        if group.gr_gid not in (0, gid) and NOBODY not in group.gr_mem:
            return group
    pytest.skip("no group without nobody in it")


def test_a_user_the_root_only_socket_refuses_is_told_so_not_that_no_daemon_answered(open_dir: Path) -> None:
    config = node_config(open_dir)
    server = ApiServer(open_dir / "run/agent.sock", {"status": lambda _p: {"starting": True}})
    server.start()
    try:
        result = as_nobody("status", "--config", str(config))
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stderr.startswith(
            f"gpu-agent: permission denied on {open_dir / 'run/agent.sock'}: it answers root only"
            " (api.group is not set); run it as root (sudo), or name a group of operators"
        ), result.stderr
        assert "no daemon answered" not in result.stdout + result.stderr
        assert "Traceback" not in result.stderr
    finally:
        server.close()


def test_a_user_outside_the_sockets_group_is_told_which_group_to_join(open_dir: Path) -> None:
    config = node_config(open_dir)
    group = a_group_nobody_is_not_in()
    server = ApiServer(open_dir / "run/agent.sock", {"status": lambda _p: {"starting": True}}, group=group.gr_name)
    server.start()
    try:
        outside = as_nobody("status", "--config", str(config))
        assert outside.returncode == 1, outside.stderr
        assert (
            f"it answers root and group {group.gr_name} only; join it (`sudo usermod -aG {group.gr_name} nobody`"
            in outside.stderr
        )
    finally:
        server.close()


def test_a_user_who_may_not_read_the_simulated_gpus_gets_one_line_not_a_traceback(open_dir: Path) -> None:
    config = node_config(open_dir)
    assert gpu_agent("status", "--direct", "--config", str(config)).returncode in (0, 2)  # root writes its state
    result = as_nobody("status", "--config", str(config))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == (
        f"gpu-agent: this user may not read the GPUs: the simulated GPUs in {open_dir / 'state/simulated-gpus.json'}"
        " are not readable by this user; run it as root (sudo)\n"
    )


def test_what_a_user_may_not_read_is_no_finding(open_dir: Path) -> None:
    """A reboot recommendation in a state_dir only root may read: root is told, nobody is told it
    cannot read the directory, not that a reboot is recommended."""
    config = node_config(open_dir, backend="nvml")
    (open_dir / "state/reboot-recommended").write_text(json.dumps({"reason": "Xid 79: GPU fell off the bus"}))
    as_root = gpu_agent("status", "--config", str(config))
    assert "REBOOT RECOMMENDED: Xid 79: GPU fell off the bus" in as_root.stdout, as_root.stdout + as_root.stderr
    result = as_nobody("status", "--config", str(config))
    assert "Traceback" not in result.stderr, result.stderr
    assert "REBOOT" not in result.stdout and "reboot recommended" not in result.stdout, result.stdout
    assert (
        f"this user may not read {open_dir / 'state'}: the daemon's node memory (Xid history, held slowdowns)"
        " and its reboot recommendation are not included" in result.stdout
    ), result.stdout
