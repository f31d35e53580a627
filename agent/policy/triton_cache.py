"""The Triton kernel cache: a directory with a known owner and mode, handed to the services.

Triton compiles GPU kernels on first use and caches them under `TRITON_CACHE_DIR` (default
`~/.triton/cache`). A shared directory that survives restarts turns a cold start's minutes of
compilation into seconds; a wrong owner or mode makes every compile fail at startup. The
directory reaches each inference service as a systemd drop-in
`/etc/systemd/system/<unit>.d/gpu-agent-triton.conf` setting the environment variable. A service
sees a new environment only when restarted: apply reloads systemd but never restarts a service
(the operator or a remediation rule chooses when).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
from dataclasses import dataclass

from agent.config import AgentConfig, NodePolicy
from agent.policy.base import HostContext, ItemPlan, ItemResult, Outcome, PlanStatus

NAME = "triton_cache"
SYSTEMD_DIR = "/etc/systemd/system"
DROPIN_NAME = "gpu-agent-triton.conf"
RELOAD = ("systemctl", "daemon-reload")


@dataclass(frozen=True)
class TritonCacheWant:
    path: str
    owner: str
    group: str
    mode_bits: int
    units: tuple[str, ...]  # systemd units that get TRITON_CACHE_DIR, resolved from `services:`

    @property
    def summary(self) -> str:
        return f"{self.path} {self.owner}:{self.group} {self.mode_bits:04o}"


def desired(node: NodePolicy, config: AgentConfig) -> TritonCacheWant | None:
    cache = node.triton_cache
    if cache is None:
        return None
    units = tuple(dict.fromkeys(config.service_unit(name) for name in cache.services))
    return TritonCacheWant(cache.path, cache.owner, cache.group, cache.mode_bits, units)


def dropin_path(unit: str) -> str:
    return f"{SYSTEMD_DIR}/{unit}.d/{DROPIN_NAME}"


def dropin_content(cache_path: str) -> str:
    # systemd expands %-specifiers and splits Environment= on spaces: escape and quote for it.
    assignment = f"TRITON_CACHE_DIR={cache_path}".replace("%", "%%")
    if any(c.isspace() or c in "\"'\\" for c in assignment):
        assignment = '"' + assignment.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return (
        "# Managed by gpu-agent (policy.node.triton_cache); local edits are overwritten.\n"
        f"[Service]\nEnvironment={assignment}\n"
    )


class _Unusable(Exception):
    def __init__(self, actual: str, detail: str) -> None:
        super().__init__(detail)
        self.actual = actual
        self.detail = detail


@dataclass(frozen=True)
class _Observed:
    uid: int
    gid: int
    create: bool
    chown: bool
    chmod: bool
    write: tuple[str, ...]  # units whose drop-in is missing or outdated
    remove: tuple[str, ...]  # units no longer listed that still carry our drop-in
    directory: str  # the directory as found: "/var/cache/triton root:root 0755" or "... missing"
    actual: str


def _name_of_user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _name_of_group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _link_target(path: os.PathLike[str]) -> str:
    try:
        return os.readlink(path)
    except OSError:  # replaced since it was seen as a link
        return "(changed while being read)"


def _observe(ctx: HostContext, want: TritonCacheWant) -> _Observed:
    # Names resolve through this process's user database: it is the one that will chown.
    try:
        uid = pwd.getpwnam(want.owner).pw_uid
    except KeyError:
        raise _Unusable("", f"unknown user {want.owner!r}") from None
    try:
        gid = grp.getgrnam(want.group).gr_gid
    except KeyError:
        raise _Unusable("", f"unknown group {want.group!r}") from None

    target = ctx.paths.path(want.path)
    try:
        st = ctx.paths.lstat(want.path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _Unusable(f"{want.path} unreachable", f"cannot inspect {want.path}: {exc.strerror}") from None
    parts: list[str] = []
    if st is None:
        # A directory this process creates starts out as its own.
        create, chown, chmod = True, (uid, gid) != (os.geteuid(), os.getegid()), True
        parts.append(f"{want.path} missing")
    elif stat.S_ISLNK(st.st_mode):
        # chown/chmod through a link would land wherever it points: name the target instead.
        raise _Unusable(
            f"{want.path} is a symlink",
            f"{want.path} is a symlink to {_link_target(target)}; set triton_cache.path to the real directory",
        )
    elif not stat.S_ISDIR(st.st_mode):
        raise _Unusable(f"{want.path} is not a directory", f"{want.path} exists and is not a directory")
    else:
        create = False
        chown = (st.st_uid, st.st_gid) != (uid, gid)
        chmod = stat.S_IMODE(st.st_mode) != want.mode_bits
        parts.append(
            f"{want.path} {_name_of_user(st.st_uid)}:{_name_of_group(st.st_gid)} {stat.S_IMODE(st.st_mode):04o}"
        )

    expected = dropin_content(want.path)
    write: list[str] = []
    for unit in want.units:
        if "/" in unit or unit.startswith(".") or not unit:
            raise _Unusable(parts[0], f"{unit!r} is not a systemd unit name")
        try:
            current = ctx.paths.path(dropin_path(unit)).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            current = None
        except OSError as exc:
            raise _Unusable(parts[0], f"cannot read {dropin_path(unit)}: {exc.strerror}") from None
        if current != expected:
            write.append(unit)
            parts.append(f"drop-in {'missing' if current is None else 'outdated'} for {unit}")
    remove = sorted(
        found.parent.name.removesuffix(".d")
        for found in ctx.paths.path(SYSTEMD_DIR).glob(f"*.d/{DROPIN_NAME}")
        if found.parent.name.removesuffix(".d") not in want.units
    )
    parts.extend(f"stale drop-in for {unit}" for unit in remove)
    if want.units and not write:
        parts.append(f"TRITON_CACHE_DIR set for {', '.join(want.units)}")
    return _Observed(uid, gid, create, chown, chmod, tuple(write), tuple(remove), parts[0], "; ".join(parts))


def _changes(want: TritonCacheWant, seen: _Observed) -> tuple[str, ...]:
    changes: list[str] = []
    if seen.create:
        changes.append(f"create {want.path} ({want.owner}:{want.group} {want.mode_bits:04o})")
    else:
        if seen.chown:
            changes.append(f"chown {want.owner}:{want.group} {want.path}")
        if seen.chmod:
            changes.append(f"chmod {want.mode_bits:04o} {want.path}")
    changes.extend(f"write {dropin_path(unit)}" for unit in seen.write)
    changes.extend(f"remove {dropin_path(unit)}" for unit in seen.remove)
    if seen.write or seen.remove:
        changes.append(f"run: {' '.join(RELOAD)}")
    return tuple(changes)


def _desired_text(want: TritonCacheWant) -> str:
    return want.summary + (f"; TRITON_CACHE_DIR for {', '.join(want.units)}" if want.units else "")


def plan(ctx: HostContext, want: TritonCacheWant) -> ItemPlan:
    return _plan(ctx, want)


def _plan(ctx: HostContext, want: TritonCacheWant) -> ItemPlan:
    try:
        seen = _observe(ctx, want)
    except _Unusable as exc:
        return ItemPlan(NAME, None, PlanStatus.ERROR, _desired_text(want), exc.actual or "unknown", detail=exc.detail)
    changes = _changes(want, seen)
    detail = ""
    if seen.write or seen.remove:
        detail = f"restart {', '.join(seen.write + seen.remove)} after apply to pick up the environment"
    status = PlanStatus.DRIFT if changes else PlanStatus.IN_SYNC
    return ItemPlan(NAME, None, status, _desired_text(want), seen.actual, detail=detail, changes=changes)


def _fix_directory(ctx: HostContext, want: TritonCacheWant, seen: _Observed) -> str | None:
    """Create, chown, chmod as needed; the reason it cannot, or None."""
    if seen.chown and os.geteuid() != 0:
        return (
            f"cannot give {want.path} to {want.owner}:{want.group}: gpu-agent is not running as root "
            f"(now: {seen.directory})"
        )
    # Created, chowned and chmodded on its own descriptor, reached without following any link.
    ctx.paths.ensure_directory(want.path, seen.uid, seen.gid, want.mode_bits)
    return None


def _fix_dropins(ctx: HostContext, want: TritonCacheWant, seen: _Observed) -> None:
    for unit in seen.write:
        ctx.paths.write_file_atomic(dropin_path(unit), dropin_content(want.path))
    for unit in seen.remove:
        ctx.paths.remove_file(dropin_path(unit))
        ctx.paths.remove_empty_directory(f"{SYSTEMD_DIR}/{unit}.d")


def apply(ctx: HostContext, want: TritonCacheWant, plan: ItemPlan) -> ItemResult:
    # Look again rather than trust the plan: the host may have changed since it was made.
    try:
        seen = _observe(ctx, want)
    except _Unusable as exc:
        return ItemResult(plan, Outcome.FAILED, exc.detail)
    if not _changes(want, seen):
        return ItemResult(plan, Outcome.UNCHANGED)
    try:
        refused = _fix_directory(ctx, want, seen)
        if refused:
            return ItemResult(plan, Outcome.FAILED, refused)
        _fix_dropins(ctx, want, seen)
    except OSError as exc:
        return ItemResult(plan, Outcome.FAILED, f"cannot apply: {exc}")

    done = [c for c in _changes(want, seen) if not c.startswith("run: ")]
    notes: list[str] = []
    if seen.write or seen.remove:
        try:
            reload = ctx.run_command(RELOAD)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return ItemResult(plan, Outcome.FAILED, f"drop-ins written, but `{' '.join(RELOAD)}` could not run: {exc}")
        if not reload.ran:
            notes.append(f"systemd not reloaded ({reload.output}); run `{' '.join(RELOAD)}`")
        elif reload.returncode != 0:
            return ItemResult(
                plan,
                Outcome.FAILED,
                f"drop-ins written, but `{' '.join(RELOAD)}` failed (exit {reload.returncode}): {reload.output}",
            )
        else:
            notes.append("systemd reloaded")
        notes.append(f"restart {', '.join(seen.write + seen.remove)} to pick up the new environment")

    after = _plan(ctx, want)  # `plan` is the argument here
    if after.status is not PlanStatus.IN_SYNC:
        return ItemResult(plan, Outcome.FAILED, f"still not in sync after apply: {after.actual} {after.detail}".strip())
    return ItemResult(plan, Outcome.APPLIED, "; ".join([", ".join(done), *notes]))
