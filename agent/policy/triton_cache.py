"""The Triton kernel cache: a directory with a known owner and mode, handed to the services.

Triton compiles GPU kernels on first use and caches them under `TRITON_CACHE_DIR` (default
`~/.triton/cache`). A shared directory that survives restarts turns a cold start's minutes of
compilation into seconds; a wrong owner or mode makes every compile fail at startup. The
directory reaches each systemd inference service as a drop-in
`/etc/systemd/system/<unit>.d/gpu-agent-triton.conf` setting the environment variable. A service
sees a new environment only when restarted: apply reloads systemd but never restarts a service
(the operator or a remediation rule chooses when). A `manager: command` service has no unit to
carry a drop-in: the agent puts the variable in its start command's environment instead
(`triton_environments` below, which agent.services.managers hands it), and this item only names it.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agent.config import AgentConfig
from agent.config.desired import NodePolicy
from agent.host import safe_fs
from agent.policy.base import HostContext
from agent.policy.item import ChangeFailed, HostItem, Planned, compared, planned
from agent.policy.plan import ItemPlan, PlanStatus

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
    commands: tuple[str, ...] = ()  # `manager: command` services: the agent's start command passes it

    @property
    def summary(self) -> str:
        return f"{self.path} {self.owner}:{self.group} {self.mode_bits:04o}"


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
class Ownership:
    """The wanted owner and group, by name and as this process resolved them (it is the one that chowns)."""

    user: str
    group: str
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.user}:{self.group}"


@dataclass(frozen=True)
class _Observed:
    owner: Ownership
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
            current = ctx.paths.read_text(dropin_path(unit), errors="replace")
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
    owner = Ownership(want.owner, want.group, uid, gid)
    return _Observed(owner, create, chown, chmod, tuple(write), tuple(remove), parts[0], "; ".join(parts))


@dataclass(frozen=True)
class CreateDirectory:
    """Create the cache directory and give it the wanted owner (`chown`: not this process) and mode."""

    path: str
    owner: Ownership
    mode_bits: int
    chown: bool

    @property
    def text(self) -> str:
        return f"create {self.path} ({self.owner} {self.mode_bits:04o})"


@dataclass(frozen=True)
class ChownDirectory:
    path: str
    owner: Ownership
    found: str  # the directory as found, for the refusal when not root

    @property
    def text(self) -> str:
        return f"chown {self.owner} {self.path}"


@dataclass(frozen=True)
class ChmodDirectory:
    path: str
    mode_bits: int

    @property
    def text(self) -> str:
        return f"chmod {self.mode_bits:04o} {self.path}"


@dataclass(frozen=True)
class SetDropin:
    """Write the drop-in that gives `unit` TRITON_CACHE_DIR=`cache_path`, or remove it (`cache_path` None)."""

    unit: str
    cache_path: str | None

    @property
    def text(self) -> str:
        return f"{'remove' if self.cache_path is None else 'write'} {dropin_path(self.unit)}"


@dataclass(frozen=True)
class ReloadSystemd:
    @property
    def text(self) -> str:
        return f"run: {' '.join(RELOAD)}"


TritonChange = CreateDirectory | ChownDirectory | ChmodDirectory | SetDropin | ReloadSystemd


def _changes(want: TritonCacheWant, seen: _Observed) -> list[TritonChange]:
    changes: list[TritonChange] = []
    if seen.create:
        changes.append(CreateDirectory(want.path, seen.owner, want.mode_bits, seen.chown))
    else:
        if seen.chown:
            changes.append(ChownDirectory(want.path, seen.owner, seen.directory))
        if seen.chmod:
            changes.append(ChmodDirectory(want.path, want.mode_bits))
    changes.extend(SetDropin(unit, want.path) for unit in seen.write)
    changes.extend(SetDropin(unit, None) for unit in seen.remove)
    if seen.write or seen.remove:
        changes.append(ReloadSystemd())
    return changes


def _desired_text(want: TritonCacheWant) -> str:
    text = want.summary + (f"; TRITON_CACHE_DIR for {', '.join(want.units)}" if want.units else "")
    if want.commands:
        text += f"; TRITON_CACHE_DIR in the start command's environment of {', '.join(want.commands)}"
    return text


def _refuse_chown(path: str, owner: Ownership, found: str) -> None:
    if os.geteuid() != 0:
        raise ChangeFailed(f"cannot give {path} to {owner}: gpu-agent is not running as root (now: {found})")


# Owner and mode change on the directory's own descriptor, reached without following any link
# (agent.host.safe_fs): a service user who owns a parent cannot redirect them elsewhere.
def _set_owner(ctx: HostContext, path: str, owner: Ownership) -> None:
    with safe_fs.open_directory(ctx.paths.root, path) as fd:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (owner.uid, owner.gid):
            os.fchown(fd, owner.uid, owner.gid)


def _set_mode(ctx: HostContext, path: str, mode_bits: int) -> None:
    # After chown, which may clear the setgid bit.
    with safe_fs.open_directory(ctx.paths.root, path) as fd:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode_bits:
            os.fchmod(fd, mode_bits)


def _remove_dropin(ctx: HostContext, unit: str) -> None:
    ctx.paths.remove_file(dropin_path(unit))
    ctx.paths.remove_empty_directory(f"{SYSTEMD_DIR}/{unit}.d")


def _reload(ctx: HostContext) -> str:
    """Reload systemd so it sees the drop-ins; what happened, or ChangeFailed."""
    command = " ".join(RELOAD)
    try:
        reload = ctx.run_command(RELOAD)
    except OSError as exc:
        raise ChangeFailed(f"drop-ins written, but `{command}` could not run: {exc}") from exc
    if not reload.ran:
        return f"systemd not reloaded ({reload.output}); run `{command}`"
    if reload.returncode != 0:
        raise ChangeFailed(f"drop-ins written, but `{command}` failed ({reload.ended}): {reload.output}")
    return "systemd reloaded"


def _make(ctx: HostContext, change: TritonChange) -> str | None:
    """Make one change; a note for the operator, if it has one."""
    if isinstance(change, CreateDirectory):
        if change.chown:
            _refuse_chown(change.path, change.owner, f"{change.path} missing")
        # Created 0700, then chowned and chmodded on its own descriptor.
        ctx.paths.ensure_directory(change.path, change.owner.uid, change.owner.gid, change.mode_bits)
    elif isinstance(change, ChownDirectory):
        _refuse_chown(change.path, change.owner, change.found)
        _set_owner(ctx, change.path, change.owner)
    elif isinstance(change, ChmodDirectory):
        _set_mode(ctx, change.path, change.mode_bits)
    elif isinstance(change, SetDropin):
        if change.cache_path is None:
            _remove_dropin(ctx, change.unit)
        else:
            ctx.paths.write_file_atomic(dropin_path(change.unit), dropin_content(change.cache_path))
    else:
        return _reload(ctx)
    return None


class TritonCacheItem(HostItem[TritonCacheWant, TritonChange]):
    name: Final = "triton_cache"

    def desired(self, node: NodePolicy, config: AgentConfig) -> TritonCacheWant | None:
        cache = node.triton_cache
        if cache is None:
            return None
        # Ordered sets: each unit and command once, however many entries of `services` lead to it.
        units: dict[str, None] = {}
        commands: dict[str, None] = {}
        for name in cache.services:
            service = next((s for s in config.services if name in (s.name, s.unit_name)), None)
            if service is not None and service.manager == "command":
                commands[service.name] = None  # no unit exists for a drop-in to reach
            else:
                units[config.service_unit(name)] = None
        return TritonCacheWant(cache.path, cache.owner, cache.group, cache.mode_bits, tuple(units), tuple(commands))

    def plan(self, host: HostContext, want: TritonCacheWant) -> Planned[TritonChange]:
        try:
            seen = _observe(host, want)
        except _Unusable as exc:
            return planned(
                ItemPlan(
                    self.name, None, PlanStatus.ERROR, _desired_text(want), exc.actual or "unknown", detail=exc.detail
                )
            )
        changes = _changes(want, seen)
        detail = ""
        if seen.write or seen.remove:
            detail = f"restart {', '.join(seen.write + seen.remove)} after apply to pick up the environment"
        return compared(self.name, None, _desired_text(want), seen.actual, changes, detail)

    def apply(self, host: HostContext, changes: Sequence[TritonChange]) -> str:
        notes: list[str] = []
        for change in changes:
            try:
                note = _make(host, change)
            except OSError as exc:
                raise ChangeFailed(f"cannot apply: {exc}") from exc
            if note is not None:
                notes.append(note)
        restart = [c.unit for c in changes if isinstance(c, SetDropin)]
        if restart:
            notes.append(f"restart {', '.join(restart)} to pick up the new environment")
        done = ", ".join(c.text for c in changes if not isinstance(c, ReloadSystemd))
        return "; ".join([done, *notes])


def triton_environments(config: AgentConfig, host: HostContext) -> dict[str, dict[str, str]]:
    """TRITON_CACHE_DIR for each `manager: command` service `policy.node.triton_cache` lists (by
    name or unit), pointing at the cache directory as the host sees it."""
    cache = config.policy.node.triton_cache
    if cache is None:
        return {}
    listed = set(cache.services)
    return {
        service.name: {"TRITON_CACHE_DIR": str(host.paths.path(cache.path))}
        for service in config.services
        if service.manager == "command" and (service.name in listed or service.unit_name in listed)
    }


ITEM: Final = TritonCacheItem()
