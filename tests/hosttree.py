"""A fake host tree for tests: the /sys, /proc, /etc and /boot files gpu-agent reads, under a tmp root.

`make_host_tree(tmp_path)` returns the `HostPaths` to hand to the code under test. By default the
tree's sysfs emulates the kernel's choice files: writing `never` to a file reading
`always [madvise] never` leaves it reading `always madvise [never]`, and a word the file does not
offer is refused with EINVAL, as the kernel does. `kernel_sysfs=False` gives plain files instead,
where a write simply replaces the content.

Also here, for tests that need them: `ScriptedHostContext` (host-wide commands answered from a
script rather than run) and `run_unprivileged` (run a function as a non-root user, also when the
tests themselves run as root).
"""

from __future__ import annotations

import errno
import grp
import os
import pickle
import pwd
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from agent.host.paths import HostPaths
from agent.policy.base import CommandResult, HostContext

THP_ENABLED_DEFAULT = "always [madvise] never"
THP_DEFRAG_DEFAULT = "always defer defer+madvise [madvise] never"

OS_RELEASES = {
    "ubuntu": (
        'PRETTY_NAME="Ubuntu 24.04.1 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\nVERSION="24.04.1 LTS (Noble Numbat)"\n'
        "VERSION_CODENAME=noble\nID=ubuntu\nID_LIKE=debian\n"
    ),
    "rocky": (
        'NAME="Rocky Linux"\nVERSION="10.0"\nID="rocky"\nID_LIKE="rhel centos fedora"\nVERSION_ID="10.0"\n'
        'PLATFORM_ID="platform:el10"\nPRETTY_NAME="Rocky Linux 10.0"\n'
    ),
}

# /proc/modules lines as a GPU host shows them; nouveau and nvidia exclude each other in practice.
_NVIDIA_MODULES = (
    "nvidia_uvm 1789952 0 - Live 0x0000000000000000 (POE)",
    "nvidia_drm 122880 0 - Live 0x0000000000000000 (POE)",
    "nvidia_modeset 1605632 1 nvidia_drm, Live 0x0000000000000000 (POE)",
    "nvidia 60604416 2 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (POE)",
)
_NOUVEAU_MODULES = (
    "nouveau 3096576 0 - Live 0x0000000000000000",
    "drm_ttm_helper 16384 1 nouveau, Live 0x0000000000000000",
    "ttm 110592 2 nouveau,drm_ttm_helper, Live 0x0000000000000000",
)


def _kernel_choices(text: str) -> list[str] | None:
    """The words of a kernel choice file (`always [madvise] never`), or None for any other content."""
    words = text.split()
    if sum(1 for w in words if w.startswith("[") and w.endswith("]")) != 1:
        return None
    return [w.strip("[]") for w in words]


@dataclass(frozen=True)
class KernelSysfsPaths(HostPaths):
    """HostPaths whose `write_sysfs` behaves like the kernel on a choice file."""

    def write_sysfs(self, absolute: str, value: str) -> None:
        target = self.path(absolute)
        choices = _kernel_choices(target.read_text(encoding="utf-8"))
        if choices is None:
            super().write_sysfs(absolute, value)
            return
        word = value.strip()
        if word not in choices:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(target))
        target.write_text(" ".join(f"[{c}]" if c == word else c for c in choices) + "\n", encoding="utf-8")


def _write(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="utf-8")


def make_host_tree(
    root: Path,
    *,
    thp_enabled: str | None = THP_ENABLED_DEFAULT,
    thp_defrag: str | None = THP_DEFRAG_DEFAULT,
    os_release: str | None = "ubuntu",
    nouveau_loaded: bool = False,
    kernel_release: str = "6.8.0-45-generic",
    kernel_sysfs: bool = True,
) -> HostPaths:
    """Build a host tree under `root` and return its HostPaths.

    thp_enabled/thp_defrag: content of the THP sysfs files; None leaves the file out (both None:
    a kernel without THP). os_release: a key of OS_RELEASES, raw os-release text, or None for no
    file. nouveau_loaded: nouveau instead of nvidia in /proc/modules and /sys/module.
    """
    thp = root / "sys/kernel/mm/transparent_hugepage"
    for name, content in (("enabled", thp_enabled), ("defrag", thp_defrag)):
        if content is not None:
            _write(thp / name, content + "\n")
    modules = _NOUVEAU_MODULES if nouveau_loaded else _NVIDIA_MODULES
    _write(root / "proc/modules", "".join(line + "\n" for line in modules))
    for line in modules:
        (root / "sys/module" / line.split()[0]).mkdir(parents=True, exist_ok=True)
    _write(root / "proc/sys/kernel/osrelease", kernel_release + "\n")
    if os_release is not None:
        _write(root / "etc/os-release", OS_RELEASES.get(os_release, os_release))
    for directory in ("etc/modprobe.d", "etc/systemd/system", "boot", "var/cache"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    return KernelSysfsPaths(root) if kernel_sysfs else HostPaths(root)


@dataclass
class ScriptedHostContext(HostContext):
    """A HostContext that answers host-wide commands from a script instead of running them.

    Every argv is recorded in `calls`. `results` maps a program name to (returncode, output);
    a program in `missing` raises FileNotFoundError as subprocess does; anything else succeeds
    with no output.
    """

    results: dict[str, tuple[int, str]] = field(default_factory=dict)
    missing: frozenset[str] = frozenset()
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def run_command(self, argv: Sequence[str], outside_sandbox: bool = False) -> CommandResult:
        self.calls.append(tuple(argv))
        if argv[0] in self.missing:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
        returncode, output = self.results.get(argv[0], (0, ""))
        return CommandResult(tuple(argv), ran=True, returncode=returncode, output=output)


NOBODY_ID = 65534
T = TypeVar("T")


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    user: str
    group: str


def unprivileged_identity() -> Identity:
    """Who `run_unprivileged` runs as: the current user when not root, else nobody."""
    uid, gid = (os.geteuid(), os.getegid()) if os.geteuid() != 0 else (NOBODY_ID, NOBODY_ID)
    return Identity(uid, gid, pwd.getpwuid(uid).pw_name, grp.getgrgid(gid).gr_name)


def run_unprivileged(fn: Callable[[], T]) -> T:
    """Call `fn` as `unprivileged_identity()`.

    As root (CI), root ignores file modes and may chown anything, so the call runs in a forked
    child that drops to nobody; its return value comes back pickled. The files it touches must
    be reachable by nobody (pytest's own tmp dirs are private to the user running it).
    """
    if os.geteuid() != 0:
        return fn()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY_ID)
            os.setuid(NOBODY_ID)
            try:
                payload = pickle.dumps((True, fn()))
            except BaseException as exc:  # the parent re-raises it; the child must reach os._exit
                payload = pickle.dumps((False, f"{type(exc).__name__}: {exc}"))
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(payload)
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    if not data:
        raise AssertionError("unprivileged child died before answering")
    ok, value = pickle.loads(data)  # our own child's answer
    if not ok:
        raise AssertionError(f"unprivileged child raised {value}")
    result: T = value
    return result
