"""Host writes never follow a symlink (agent.host.safe_fs), checked by racing them: another process
swaps a path component between a real directory or file and a symlink to a victim, as fast as it
can, while the write runs thousands of times; the victim's mode, owner and content never change."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from hosttree import NOBODY_ID, ScriptedHostContext, make_host_tree, unprivileged_identity
from race import attempts, fingerprint, swapping

from agent.host import safe_fs
from agent.host.paths import HostPaths
from agent.policy import thp
from agent.policy.item import enforce, plan_item
from agent.policy.plan import ApplyOutcome
from agent.policy.triton_cache import TritonCacheItem, TritonCacheWant

ROUNDS = 2000


def victim_file(tmp_path: Path) -> Path:
    victim = tmp_path / "victim" / "secret"
    victim.parent.mkdir(mode=0o700)
    victim.write_bytes(b"root's secret\n")
    victim.chmod(0o600)
    return victim


def race(run: Callable[[], None], rounds: int = ROUNDS) -> tuple[int, int]:
    """Call run() at least `rounds` times, until both a success and a refusal came: (succeeded,
    refused because a link was met)."""

    def attempt() -> str:
        try:
            run()
        except safe_fs.UnsafePathError:
            return "refused"
        return "done"

    counts = attempts(attempt, {"done", "refused"}, rounds)
    return counts.get("done", 0), counts.get("refused", 0)


# -- plain behaviour ------------------------------------------------------------------------------


def test_writes_create_parents_and_set_modes_exactly(tmp_path: Path) -> None:
    old_umask = os.umask(0o077)
    try:
        safe_fs.write_file_atomic(tmp_path, "/etc/x.d/a.conf", b"one\n", 0o644)
        safe_fs.write_file_atomic(tmp_path, "/etc/x.d/a.conf", b"two\n", 0o640)
        safe_fs.ensure_directory(tmp_path, "/var/cache/triton", os.geteuid(), os.getegid(), 0o2775)
    finally:
        os.umask(old_umask)
    conf = tmp_path / "etc/x.d/a.conf"
    assert conf.read_bytes() == b"two\n" and stat.S_IMODE(conf.stat().st_mode) == 0o640
    assert sorted(os.listdir(conf.parent)) == ["a.conf"]  # no temp file left
    assert stat.S_IMODE((tmp_path / "var/cache/triton").stat().st_mode) == 0o2775
    assert stat.S_IMODE((tmp_path / "var/cache").stat().st_mode) == 0o755


@pytest.mark.parametrize("where", ["/etc", "/etc/x.d"])
def test_a_symlink_anywhere_on_the_path_is_refused(tmp_path: Path, where: str) -> None:
    victim = victim_file(tmp_path)
    root = tmp_path / "host"
    (root / "etc/x.d").mkdir(parents=True)
    link = root / where.lstrip("/")
    link.rename(tmp_path / "moved")
    link.symlink_to(victim.parent)
    before = fingerprint(victim.parent)
    with pytest.raises(safe_fs.UnsafePathError, match=f"{where} is a symlink, refused"):
        safe_fs.write_file_atomic(root, "/etc/x.d/secret", b"mine")
    with pytest.raises(safe_fs.UnsafePathError):
        safe_fs.ensure_directory(root, "/etc/x.d/secret", NOBODY_ID, NOBODY_ID, 0o777)
    assert fingerprint(victim.parent) == before and fingerprint(victim)[:3] == (0o100600, 0, 0)


def test_the_last_component_is_never_followed(tmp_path: Path) -> None:
    victim = victim_file(tmp_path)
    (tmp_path / "host/sys").mkdir(parents=True)
    (tmp_path / "host/sys/enabled").symlink_to(victim)
    (tmp_path / "host/cache").symlink_to(victim)
    with pytest.raises(safe_fs.UnsafePathError):
        safe_fs.write_existing(tmp_path / "host", "/sys/enabled", b"never")
    with pytest.raises(safe_fs.UnsafePathError):
        safe_fs.ensure_directory(tmp_path / "host", "/cache", NOBODY_ID, NOBODY_ID, 0o755)
    # A rename replaces the link itself, never the file it points to.
    safe_fs.write_file_atomic(tmp_path / "host", "/sys/enabled", b"never")
    assert (tmp_path / "host/sys/enabled").read_bytes() == b"never"
    assert not (tmp_path / "host/sys/enabled").is_symlink()
    assert victim.read_bytes() == b"root's secret\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match=r"\.\."):
        safe_fs.write_file_atomic(tmp_path / "host", "/sys/../../victim/secret", b"x")


# -- races ----------------------------------------------------------------------------------------


def attacker_dir(path: Path) -> Path:
    """A directory a service user owns, as a cache path's parent often is."""
    path.mkdir(parents=True)
    os.chown(path, NOBODY_ID, NOBODY_ID)
    return path


def test_race_on_the_cache_directory_itself(tmp_path: Path) -> None:
    victim = victim_file(tmp_path)
    svc = attacker_dir(tmp_path / "host/var/cache/svc")
    (svc / "triton").mkdir()
    (svc / "swap").symlink_to(victim)
    before = fingerprint(victim)
    with swapping(svc / "triton", svc / "swap"):
        done, refused = race(
            lambda: safe_fs.ensure_directory(tmp_path / "host", "/var/cache/svc/triton", NOBODY_ID, NOBODY_ID, 0o755)
        )
    assert fingerprint(victim) == before
    assert done and refused, (done, refused)  # both states were met: the race ran


def test_race_on_a_parent_of_the_cache_directory(tmp_path: Path) -> None:
    victim_dir = tmp_path / "victim"
    (victim_dir / "triton").mkdir(parents=True, mode=0o700)
    (victim_dir / "triton").chmod(0o700)
    cache = attacker_dir(tmp_path / "host/var/cache")
    (cache / "svc").mkdir()
    (cache / "swap").symlink_to(victim_dir)
    before = fingerprint(victim_dir / "triton")
    with swapping(cache / "svc", cache / "swap"):
        done, refused = race(
            lambda: safe_fs.ensure_directory(tmp_path / "host", "/var/cache/svc/triton", NOBODY_ID, NOBODY_ID, 0o755)
        )
    assert fingerprint(victim_dir / "triton") == before
    assert done and refused, (done, refused)


def test_race_on_a_dropin_directory(tmp_path: Path) -> None:
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "gpu-agent-triton.conf").write_text("victim's\n")
    system = attacker_dir(tmp_path / "host/etc/systemd/system")
    (system / "sglang.service.d").mkdir()
    (system / "swap").symlink_to(victim_dir)
    before = fingerprint(victim_dir), fingerprint(victim_dir / "gpu-agent-triton.conf")
    with swapping(system / "sglang.service.d", system / "swap"):
        done, refused = race(
            lambda: safe_fs.write_file_atomic(
                tmp_path / "host", "/etc/systemd/system/sglang.service.d/gpu-agent-triton.conf", b"ours\n"
            )
        )
    assert (fingerprint(victim_dir), fingerprint(victim_dir / "gpu-agent-triton.conf")) == before
    assert done and refused, (done, refused)


def test_race_on_a_sysfs_file(tmp_path: Path) -> None:
    victim = victim_file(tmp_path)
    paths = make_host_tree(tmp_path / "host", kernel_sysfs=False)
    thp_dir = tmp_path / "host/sys/kernel/mm/transparent_hugepage"
    (thp_dir / "swap").symlink_to(victim)
    before = fingerprint(victim)
    with swapping(thp_dir / "enabled", thp_dir / "swap"):
        done, refused = race(lambda: paths.write_sysfs(f"{thp.SYSFS_DIR}/enabled", "never"))
    assert fingerprint(victim) == before
    assert done and refused, (done, refused)


def test_race_against_the_triton_cache_item(tmp_path: Path) -> None:
    """The policy item end to end: plan and apply, again and again, while the service user swaps
    the cache directory with a link to a root-only file."""
    victim = victim_file(tmp_path)
    make_host_tree(tmp_path / "host")
    svc = attacker_dir(tmp_path / "host/var/cache/svc")
    (svc / "triton").mkdir()
    (svc / "swap").symlink_to(victim)
    ctx = ScriptedHostContext(HostPaths(tmp_path / "host"))
    nobody = unprivileged_identity()
    want = TritonCacheWant("/var/cache/svc/triton", nobody.user, nobody.group, 0o755, ("sglang.service",))
    before = fingerprint(victim)

    def attempt() -> str:
        item = TritonCacheItem()
        return enforce(item, ctx, want, plan_item(item, ctx, want)).outcome.value

    with swapping(svc / "triton", svc / "swap"):
        outcomes = attempts(attempt, {ApplyOutcome.FAILED.value}, 300)
    assert fingerprint(victim) == before
    # ... while the real directory, wherever the swaps left it, was given to the service user.
    (real,) = [entry for entry in (svc / "triton", svc / "swap") if not entry.is_symlink()]
    assert (real.stat().st_uid, stat.S_IMODE(real.stat().st_mode)) == (NOBODY_ID, 0o755), outcomes
    assert (tmp_path / "host/etc/systemd/system/sglang.service.d/gpu-agent-triton.conf").exists()


def test_the_harness_catches_a_write_that_follows_links(tmp_path: Path) -> None:
    """The old repair (lstat the path, then chmod it by name) loses this race: proof that the
    harness can fail a primitive that follows links, so its passes above mean something."""
    victim = victim_file(tmp_path)
    svc = attacker_dir(tmp_path / "host/var/cache/svc")
    (svc / "triton").mkdir()
    (svc / "swap").symlink_to(victim)
    target = svc / "triton"

    def old_repair() -> None:
        try:
            if not stat.S_ISLNK(os.lstat(target).st_mode):
                os.chmod(target, 0o755)
        except OSError:
            pass

    with swapping(svc / "triton", svc / "swap"):
        for _ in range(50_000):
            old_repair()
            if stat.S_IMODE(victim.stat().st_mode) != 0o600:
                break
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755
