"""The CLI's edges, as an operator meets them, with real processes: a stdout that cannot be written,
numbers out of range, a caller the status socket or the state directory refuses (run as nobody: the
tests run as root, and skip with the reason otherwise), and `ack` through a running daemon."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import running_agent
from helpers import wait_until
from hosttree import make_host_tree
from test_cli import gpu_agent, write_config

from agent.api_server import ApiServer
from agent.host.paths import HostPaths
from agent.node_memory.inventory import read_boot_id
from agent.rules.model import Target
from agent.store.database import Store
from agent.watch.xid import XidMark

pytestmark = pytest.mark.real_daemon

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
        for argv in (("status",), ("ack", "all"), ("tune", "--last")):
            result = as_nobody(*argv, "--config", str(config))
            assert result.returncode == 1, result.stdout + result.stderr
            assert (
                f": permission denied on {open_dir / 'run/agent.sock'}: it answers root only (api.group is not set);"
                " run it as root (sudo), or name a group of operators" in result.stderr.splitlines()[0]
            ), result.stderr
            assert "no daemon answer" not in result.stdout + result.stderr
            assert "Traceback" not in result.stderr
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


# -- ack goes through the daemon ------------------------------------------------------------------


def status_json(config: Path) -> dict[str, Any]:
    result = gpu_agent("status", "--json", "--config", str(config))
    assert result.returncode in (0, 2), result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def gpu_health(document: dict[str, Any], index: int) -> str:
    return str(next(g for g in document["gpus"] if g["index"] == index)["health"]["state"])


def test_ack_reaches_the_daemons_own_store_after_a_refused_reload_moved_state_dir(tmp_path: Path) -> None:
    """A reload that changes state_dir is refused (a restart applies it): the daemon keeps its store,
    the file names another. `ack` goes through the daemon, so it re-arms the circuit the daemon keeps
    and takes the Xid out of the verdict that the daemon gives."""
    moved = tmp_path / "moved-state"
    with running_agent(tmp_path, mode="observe") as agent:
        agent.notifications.wait_for("READY", "1")
        injected = gpu_agent("inject", "xid", "48", "--gpu", "1", "--config", str(agent.config_path))
        assert injected.returncode == 0, injected.stderr
        wait_until(lambda: gpu_health(status_json(agent.config_path), 1) == "unhealthy", 20, "Xid 48 in the verdict")
        uuid = next(g["uuid"] for g in status_json(agent.config_path)["gpus"] if g["index"] == 1)
        with Store.open(agent.state_dir) as store:
            store.open_circuit("xid-reset-gpu", Target(gpu=1, uuid=uuid), "attempts ran out")
        text = agent.config_path.read_text()
        agent.config_path.write_text(text.replace(f"state_dir: {agent.state_dir}", f"state_dir: {moved}"))
        agent.signal(signal.SIGHUP)
        wait_until(lambda: "config" in status_json(agent.config_path)["verdict"]["causes"], 20, "the refused reload")

        acked = gpu_agent("ack", "gpu:1", "--config", str(agent.config_path))

        assert acked.returncode == 0, acked.stdout + acked.stderr
        assert "gpu:1: Xid 48 on GPU 1 marked dealt with" in acked.stdout
        assert "gpu:1: 1 rule/target pair(s) re-armed" in acked.stdout
        with Store.open(agent.state_dir) as store:
            assert store.circuits() == []
        assert not (moved / "gpu-agent.db").exists()
        # the verdict the daemon gives follows with its next snapshot (the Xid would stay for the hour)
        wait_until(lambda: gpu_health(status_json(agent.config_path), 1) == "healthy", 5, "GPU 1 healthy again")


def test_ack_writes_the_store_file_when_no_daemon_answers(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    boot = read_boot_id(HostPaths.at(tmp_path / "host"))
    with Store.open(tmp_path / "state") as store:
        store.replace_xid_marks(boot, [XidMark(1, 48, "reset_gpu", "Xid 48: Double Bit ECC Error", 10.0)])
    acked = gpu_agent("ack", "xid:48@1", "--config", str(config))
    assert acked.returncode == 0, acked.stderr
    assert acked.stdout == (
        "xid:48@1: Xid 48 on GPU 1 marked dealt with: no longer in the verdict (the counts stay in status and"
        " /metrics)\n"
    )
    with Store.open(tmp_path / "state") as store:
        assert store.xid_marks(boot) == []


def test_a_member_of_the_sockets_group_reads_status_but_may_not_ack(open_dir: Path) -> None:
    """`api.group` opens the daemon's socket to a group for reading; `ack` changes what the daemon
    does (it re-arms rules), so the daemon answers it to root (or its own user) only. Outside the
    group, the user is told which group to join."""
    group = a_group_nobody_is_not_in()
    node = open_dir / "node"
    node.mkdir(mode=0o755)
    with running_agent(node, mode="observe") as agent:
        agent.notifications.wait_for("READY", "1")
        text = agent.config_path.read_text()
        agent.config_path.write_text(text.replace("api: {socket: ", f"api: {{group: {group.gr_name}, socket: "))
        agent.signal(signal.SIGHUP)
        wait_until(lambda: agent.socket_path.stat().st_gid == group.gr_gid, 20, "the socket given to the group")

        outside = as_nobody("status", "--config", str(agent.config_path))
        member_status = as_nobody("status", "--config", str(agent.config_path), groups=(group.gr_gid,))
        member_ack = as_nobody("ack", "all", "--config", str(agent.config_path), groups=(group.gr_gid,))

    assert outside.returncode == 1, outside.stderr
    assert (
        f"it answers root and group {group.gr_name} only; join it (`sudo usermod -aG {group.gr_name} nobody`"
        in outside.stderr
    )
    assert member_status.returncode in (0, 2) and "(daemon)" in member_status.stdout.splitlines()[0], member_status
    assert member_ack.returncode == 1, member_ack.stderr
    assert member_ack.stderr == (
        f"gpu-agent: daemon at {agent.socket_path}: ack changes the node: only root or the agent's own user may"
        " call it\n"
    )
