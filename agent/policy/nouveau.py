"""nouveau blacklisted and not loaded, so the NVIDIA driver can own the GPUs.

Blacklisting is a modprobe configuration (`blacklist nouveau` stops loading by alias,
`options nouveau modeset=0` keeps it from taking the console if something loads it anyway).
modprobe reads it from the root filesystem and from the initramfs, so the initramfs is rebuilt
after the file is written, and a nouveau already loaded stays until the next reboot.

Every modprobe configuration directory counts, not only our file: NVIDIA's installers and distro
packages ship their own blacklist, and a host that has one is in sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from agent.config import AgentConfig
from agent.config.desired import NodePolicy
from agent.host.paths import HostPaths
from agent.policy import next_boot
from agent.policy.base import HostContext
from agent.policy.item import ChangeFailed, HostItem, Planned, planned
from agent.policy.plan import ItemPlan, PlanStatus

CONF = "/etc/modprobe.d/gpu-agent-nouveau.conf"
CONF_CONTENT = (
    "# Managed by gpu-agent (policy.node.nouveau): keeps nouveau off the NVIDIA GPUs.\n"
    "# Local edits are overwritten; drop `nouveau:` from the policy to manage this file yourself.\n"
    "blacklist nouveau\n"
    "options nouveau modeset=0\n"
)
# kmod's search order; a file name seen in an earlier directory hides the same name in later ones.
MODPROBE_DIRS = (
    "/etc/modprobe.d",
    "/run/modprobe.d",
    "/usr/local/lib/modprobe.d",
    "/usr/lib/modprobe.d",
    "/lib/modprobe.d",
)
BLACKLIST = ("blacklist", "nouveau")
MODESET_OFF = "modeset=0"

Blacklisted = Literal["blacklisted"]


_DEBIAN = ("update-initramfs", "-u")
_REDHAT = ("dracut", "-f")
#: How each tool is told which kernel's image to rebuild (the one that boots next, not the running one).
_KERNEL_OPTION: dict[tuple[str, ...], tuple[str, ...]] = {_DEBIAN: ("-k",), _REDHAT: ("--kver",)}
_FAMILIES = {
    "debian": _DEBIAN,
    "ubuntu": _DEBIAN,
    "rhel": _REDHAT,
    "rocky": _REDHAT,
    "fedora": _REDHAT,
    "centos": _REDHAT,
}


def initramfs_command(os_release: dict[str, str]) -> tuple[str, ...] | None:
    """The command that rebuilds this distribution's initramfs; None when gpu-agent does not know it."""
    for distro in [os_release.get("ID", ""), *os_release.get("ID_LIKE", "").split()]:
        if distro in _FAMILIES:
            return _FAMILIES[distro]
    return None


@dataclass(frozen=True)
class _Observed:
    blacklist_in: str | None  # the file that says `blacklist nouveau`
    modeset_in: str | None  # the file that says `options nouveau modeset=0`
    loaded: bool
    initramfs: tuple[str, ...] | None  # the rebuild command
    distro: str

    @property
    def blacklisted(self) -> bool:
        return self.blacklist_in is not None and self.modeset_in is not None


def _modprobe_files(paths: HostPaths) -> list[str]:
    seen: dict[str, str] = {}
    for directory in MODPROBE_DIRS:
        for found in sorted(paths.path(directory).glob("*.conf")):
            # modprobe skips what is not a regular file; so do we.
            if found.is_file():
                seen.setdefault(found.name, f"{directory}/{found.name}")
    return [seen[name] for name in sorted(seen)]


def _loaded(paths: HostPaths) -> bool:
    try:
        modules = paths.read_text("/proc/modules")
    except FileNotFoundError:
        modules = ""
    return any(line.startswith("nouveau ") for line in modules.splitlines()) or paths.exists("/sys/module/nouveau")


def _observe(paths: HostPaths) -> _Observed:
    """Raises OSError when a file that should be readable is not."""
    blacklist_in: str | None = None
    modeset_in: str | None = None
    for conf in _modprobe_files(paths):
        # A stray Latin-1 comment must not hide the lines that matter.
        for line in paths.read_text(conf, errors="replace").splitlines():
            words = line.split("#", 1)[0].split()
            if tuple(words) == BLACKLIST and blacklist_in is None:
                blacklist_in = conf
            if words[:2] == ["options", "nouveau"] and MODESET_OFF in words[2:] and modeset_in is None:
                modeset_in = conf
    os_release = paths.os_release()
    return _Observed(
        blacklist_in, modeset_in, _loaded(paths), initramfs_command(os_release), os_release.get("ID", "unknown")
    )


def _actual(seen: _Observed) -> str:
    if seen.blacklisted:
        where = sorted({c for c in (seen.blacklist_in, seen.modeset_in) if c is not None})
        state = f"blacklisted ({', '.join(where)})"
    elif seen.blacklist_in is not None:
        state = "blacklisted without modeset=0"
    elif seen.modeset_in is not None:
        state = "modeset=0 but not blacklisted"
    else:
        state = "not blacklisted"
    return f"{state}, {'loaded' if seen.loaded else 'not loaded'}"


@dataclass(frozen=True)
class WriteBlacklist:
    """Write our modprobe file; `unknown_distro`: the distribution whose initramfs gpu-agent cannot rebuild."""

    unknown_distro: str | None = None

    @property
    def text(self) -> str:
        return f"write {CONF}"


@dataclass(frozen=True)
class RebuildInitramfs:
    argv: tuple[str, ...]

    @property
    def text(self) -> str:
        return f"run: {' '.join(self.argv)}"


NouveauChange = WriteBlacklist | RebuildInitramfs


def _rebuild(ctx: HostContext, argv: tuple[str, ...]) -> tuple[bool, str]:
    """Run the initramfs rebuild: (failed, what happened)."""
    command = " ".join(argv)
    try:
        result = ctx.run_command(argv, outside_sandbox=True)
    except OSError as exc:
        return True, f"`{command}` could not run: {exc}"
    if not result.ran:
        return False, f"initramfs not rebuilt ({result.output}); run `{command}`"
    if result.returncode != 0:
        return True, f"`{command}` failed ({result.ended}): {result.output}"
    return False, f"initramfs rebuilt (`{command}`)"


def _stale_initramfs(host: HostContext, command: tuple[str, ...]) -> tuple[str, RebuildInitramfs] | None:
    """With the blacklist in place, the image the next boot uses is read (agent.host.boot_readiness, cached
    until /boot changes): one that still carries nouveau without the blacklist is rebuilt for that
    kernel. An image that cannot be read or found is not a reason to rebuild (next_boot reports it)."""
    try:
        verdict = next_boot.readiness(host)
    except next_boot.BootCheckFailed:
        return None
    if verdict.kernel is None or verdict.initramfs is None or verdict.initramfs.verdict != "nouveau included":
        return None
    kernel = verdict.kernel.release
    return kernel, RebuildInitramfs((*command, *_KERNEL_OPTION.get(command, ()), kernel))


class NouveauItem(HostItem[Blacklisted, NouveauChange]):
    name: Final = "nouveau"

    def desired(self, node: NodePolicy, config: AgentConfig) -> Blacklisted | None:
        return node.nouveau

    def plan(self, host: HostContext, want: Blacklisted) -> Planned[NouveauChange]:
        desired_text = "blacklisted, not loaded"
        try:
            seen = _observe(host.paths)
        except OSError as exc:
            return planned(
                ItemPlan(self.name, None, PlanStatus.ERROR, desired_text, "unreadable", detail=f"cannot read: {exc}")
            )
        changes: list[NouveauChange] = []
        notes: list[str] = []
        if not seen.blacklisted:
            if seen.initramfs is not None:
                changes += [WriteBlacklist(), RebuildInitramfs(seen.initramfs)]
            else:
                changes.append(WriteBlacklist(unknown_distro=seen.distro))
                notes.append(f"unknown distribution ({seen.distro}): rebuild the initramfs by hand after apply")
        elif seen.initramfs is not None:
            stale = _stale_initramfs(host, seen.initramfs)
            if stale is not None:
                kernel, rebuild = stale
                changes.append(rebuild)
                notes.append(f"the initramfs of {kernel} (the next boot) still loads nouveau")
        if seen.loaded:
            notes.append("nouveau is loaded; reboot to unload it")
        if changes:
            status = PlanStatus.DRIFT
        elif seen.loaded:
            status = PlanStatus.REBOOT_REQUIRED
        else:
            status = PlanStatus.IN_SYNC
        return planned(ItemPlan(self.name, None, status, desired_text, _actual(seen), detail="; ".join(notes)), changes)

    def apply(self, host: HostContext, changes: Sequence[NouveauChange]) -> str:
        done: list[str] = []
        for change in changes:
            if isinstance(change, WriteBlacklist):
                try:
                    host.paths.write_file_atomic(CONF, CONF_CONTENT)
                except OSError as exc:
                    raise ChangeFailed(f"cannot write {CONF}: {exc}") from exc
                done.append(f"wrote {CONF}")
                if change.unknown_distro is not None:
                    done.append(f"unknown distribution ({change.unknown_distro}): rebuild the initramfs by hand")
                continue
            # A failed rebuild is reported once; the file stays, so later plans read in sync and the
            # operator reruns the command. Judging the image by its mtime was rejected: `update-initramfs
            # -u` rebuilds the newest kernel's image, not always the running one's, and a check that never
            # settles would rebuild the initramfs on every loop.
            failed, what = _rebuild(host, change.argv)
            done.append(what)
            if failed:
                raise ChangeFailed("; ".join(done))
        return "; ".join(done)


ITEM: Final = NouveauItem()
