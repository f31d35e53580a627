"""The systemd sandbox's host lock: a second run says it waits, and gives up with a message; where no
sandbox can be made (a chroot whose / is not a mount point) the tests that need one skip, saying why."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

import pytest
from systemd_sandbox import SandboxError, cgroup_is_unified, lock_or_wait, missing_requirements, root_is_a_mount_point


def test_a_held_lock_is_waited_for_with_a_message_then_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / ".running.lock"
    with open(path, "a+b") as holder, open(path, "a+b") as waiter:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(SandboxError, match=r"gave up after 2 s waiting for .*\.running\.lock: another test run"):
            lock_or_wait(waiter, "the sandbox", timeout_seconds=2)
    assert f"waiting up to 2 s for {path}, held by another test run (the sandbox)" in capfd.readouterr().err


def test_the_lock_is_taken_once_the_other_run_lets_go(tmp_path: Path) -> None:
    path = tmp_path / ".running.lock"
    with open(path, "a+b") as holder, open(path, "a+b") as waiter:
        fcntl.flock(holder, fcntl.LOCK_EX)
        threading.Timer(1.0, lambda: fcntl.flock(holder, fcntl.LOCK_UN)).start()
        lock_or_wait(waiter, "the sandbox", timeout_seconds=30)
        with open(path, "a+b") as third, pytest.raises(BlockingIOError):
            fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)


HOST_MOUNTS = (
    "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n"
    "23 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"
)
#: In a chroot into /srv/build, the host's / is out of reach: no mount has / as its mount point.
CHROOT_MOUNTS = "40 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"


def test_a_chroot_whose_root_is_no_mount_point_is_a_skip_reason(tmp_path: Path) -> None:
    assert root_is_a_mount_point(HOST_MOUNTS)
    assert not root_is_a_mount_point(CHROOT_MOUNTS)
    host, chroot = tmp_path / "host-mountinfo", tmp_path / "chroot-mountinfo"
    host.write_text(HOST_MOUNTS)
    chroot.write_text(CHROOT_MOUNTS)
    earlier = missing_requirements(host)
    if earlier is not None and earlier.startswith("the systemd sandbox needs"):
        pytest.skip(f"checked before the mounts, and missing here: {earlier}")
    reason = missing_requirements(chroot)
    assert reason is not None and reason.startswith("/ is not a mount point here (a chroot?)"), reason


def test_only_the_unified_cgroup_hierarchy_is_taken_for_one() -> None:
    """A systemd host's sandbox needs cgroup2 at /sys/fs/cgroup (the unified hierarchy): the
    hybrid layout's tmpfs there, with v1 hierarchies under it, is not."""
    hybrid = "30 25 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n"
    hybrid += "31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw\n"
    unified = "30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
    assert cgroup_is_unified(HOST_MOUNTS + unified)
    assert not cgroup_is_unified(HOST_MOUNTS + hybrid)
    # The unified hierarchy mounted over the hybrid layout's tmpfs: what is seen is the last one.
    assert cgroup_is_unified(HOST_MOUNTS + hybrid + unified.replace("30 25", "40 30"))
    assert not cgroup_is_unified(HOST_MOUNTS)
