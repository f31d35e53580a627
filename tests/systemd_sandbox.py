"""A real systemd, booted in a sandbox, for tests that need units to start, restart and fail for real
on a build host whose PID 1 is not systemd.

    with SystemdSandbox(tmp_path) as sandbox:
        for name in STANDIN_FILES:                          # agent/demo/standin_process.py
            sandbox.copy_in(name, f"/opt/standin/{name}")
        sandbox.install_unit("sglang.service", UNIT_TEXT)   # written, then daemon-reload
        sandbox.systemctl("start", "sglang.service")
        SystemdManager(sandbox.systemctl_argv)             # the agent's manager, aimed at the sandbox

How (DESIGN.md section 5): a Debian bookworm minbase root file system with systemd, systemd-sysv,
dbus and python3 is built once by debootstrap and cached (`GPU_AGENT_SANDBOX_CACHE`, default
/var/tmp/gpu-agent-sandbox; one directory per package set). Each sandbox boots it through an
overlay (the cache stays pristine; the writes land under the sandbox's own directory) in
`unshare --pid --fork --mount --uts --ipc --propagation private`, with proc, sys, dev, run and tmp
mounted as the recipe says, and `chroot ROOT /lib/systemd/systemd --system`. Commands reach it
through `nsenter -t PID -p -m -u -i -r -w ...`.

Differences from the bare recipe, to keep the host out of reach:
- every mount is made inside the new mount namespace, so all of them vanish with it: even a
  killed test leaves no mount behind. Files are written through `/proc/PID/root`, the namespace's
  view of the sandbox's `/`;
- `container=gpu-agent-sandbox` is in systemd's environment: systemd then knows it is in a
  container and skips what would reach the host (swap, loop and DM devices at shutdown, udev);
- `/dev` is a private tmpfs with its own device nodes and a plain file as `/dev/console`:
  systemd chowns and chmods its console and ttys, and with the host's `/dev` bound in that
  changed the host's `/dev/null` (it became `0620 root:tty`). `/proc/sys` is read-only
  (systemd-sysctl would change the host's sysctls).

The network namespace is the host's: a service in the sandbox listening on 127.0.0.1 is reachable
from the test. Where no systemd runs the host, the cgroup tree is the host's too, the sandbox's
systemd takes it as its own, and so only one sandbox runs at a time on a host (a lock in the cache
directory; a second one says so and waits, up to GPU_AGENT_SANDBOX_LOCK_TIMEOUT seconds, default
1800). Where systemd is PID 1 (a server, a VM) the tree is that systemd's: the sandbox starts in a
scope of its own with its cgroup delegated (`systemd-run --scope -p Delegate=yes`, as
systemd-nspawn runs a container), in a cgroup namespace rooted there, with a cgroup2 file system of
that namespace as its /sys/fs/cgroup: its systemd manages that subtree alone. That needs the
unified hierarchy (cgroup v2), the default since Debian 11, Ubuntu 21.10 and RHEL 9.
Needs root, debootstrap, unshare, nsenter and chroot, and systemd-run on a systemd host
(`missing_requirements()`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

SUITE = "bookworm"
BASE_PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3")
DEFAULT_CACHE_DIR = "/var/tmp/gpu-agent-sandbox"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
READY_MARKER = ".gpu-agent-sandbox-ready"
DEFAULT_LOCK_TIMEOUT_SECONDS = 1800.0  # a whole e2e run of another checkout holds the lock this long at most
TOOLS = ("debootstrap", "unshare", "nsenter", "chroot", "mount")
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


class SandboxError(RuntimeError):
    pass


def root_is_a_mount_point(mountinfo: str) -> bool:
    """Whether `/` is a mount point in this mount namespace (`/proc/self/mountinfo`, field 5): in a
    plain chroot it is not, and `unshare --propagation private` cannot change its propagation."""
    return any(len(fields) > 4 and fields[4] == "/" for fields in (line.split() for line in mountinfo.splitlines()))


def missing_requirements(mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """Why a sandbox cannot run here (a pytest skip reason), or None."""
    if os.geteuid() != 0:
        return "the systemd sandbox needs root (debootstrap, unshare, mounts)"
    missing = [tool for tool in TOOLS if shutil.which(tool, path=_ENV["PATH"]) is None]
    if missing:
        return f"the systemd sandbox needs {', '.join(missing)} (apt-get install -y debootstrap util-linux)"
    try:
        mounts = mountinfo.read_text()
    except OSError as exc:
        return f"the systemd sandbox needs {mountinfo} to tell the mounts: {exc.strerror or exc}"
    if not root_is_a_mount_point(mounts):
        return (
            "/ is not a mount point here (a chroot?): the sandbox's mount namespace cannot be made private "
            "(run the tests where / is a mount, e.g. in a container or VM)"
        )
    if host_runs_systemd():
        if shutil.which("systemd-run", path=_ENV["PATH"]) is None:
            return "the host runs systemd: the sandbox needs systemd-run for a scope of its own"
        if not cgroup_is_unified(mounts):
            return (
                "the host's systemd keeps cgroup v1 hierarchies: the sandbox needs the unified one "
                "(boot with systemd.unified_cgroup_hierarchy=1)"
            )
    return None


def host_runs_systemd() -> bool:
    """Whether systemd is this host's PID 1: then the sandbox gets a delegated scope of its own."""
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


def cgroup_is_unified(mountinfo: str) -> bool:
    """Whether /sys/fs/cgroup is a cgroup2 file system (`/proc/self/mountinfo`: the type follows
    the ` - ` separator; of mounts stacked there, the last one is the one seen)."""
    seen = None
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) > 4 and parts[4] == "/sys/fs/cgroup":
            seen = rest.split()[:1]
    return seen == ["cgroup2"]


def cache_dir() -> Path:
    return Path(os.environ.get("GPU_AGENT_SANDBOX_CACHE") or DEFAULT_CACHE_DIR)


def cached_rootfs(extra_packages: Sequence[str] = (), cache: Path | None = None, timeout_seconds: float = 1200) -> Path:
    """The root file system for SUITE with BASE_PACKAGES + extra_packages: built by debootstrap the
    first time (about a minute, about 300 MB), then reused. Safe against concurrent builders."""
    packages = sorted({*BASE_PACKAGES, *extra_packages})
    base = cache or cache_dir()
    digest = hashlib.sha256(f"{SUITE} {' '.join(packages)}".encode()).hexdigest()[:10]
    rootfs = base / f"{SUITE}-{digest}"
    if (rootfs / READY_MARKER).exists():
        return rootfs
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "a+b") as lock:
        lock_or_wait(lock, "the root file system build")
        if (rootfs / READY_MARKER).exists():
            return rootfs
        partial = rootfs.with_name(rootfs.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        mirror = os.environ.get("GPU_AGENT_SANDBOX_MIRROR") or DEFAULT_MIRROR
        argv = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", SUITE, str(partial), mirror]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_seconds, env=_ENV, check=False)
        if proc.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise SandboxError(f"{shlex.join(argv)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        (partial / READY_MARKER).write_text(" ".join(packages) + "\n", encoding="utf-8")
        shutil.rmtree(rootfs, ignore_errors=True)
        partial.rename(rootfs)
    return rootfs


def lock_or_wait(lock: BinaryIO, what: str, timeout_seconds: float | None = None) -> None:
    """flock `lock`, saying on stderr who waits for what instead of hanging silently; SandboxError
    after the timeout (GPU_AGENT_SANDBOX_LOCK_TIMEOUT, default DEFAULT_LOCK_TIMEOUT_SECONDS)."""
    if timeout_seconds is None:
        timeout_seconds = float(os.environ.get("GPU_AGENT_SANDBOX_LOCK_TIMEOUT") or DEFAULT_LOCK_TIMEOUT_SECONDS)
    deadline = time.monotonic() + timeout_seconds
    told = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise SandboxError(
                    f"gave up after {timeout_seconds:.0f} s waiting for {lock.name}: another test run holds {what} "
                    "(wait for it to finish, or raise GPU_AGENT_SANDBOX_LOCK_TIMEOUT)"
                ) from None
            if not told:
                print(
                    f"systemd_sandbox: waiting up to {timeout_seconds:.0f} s for {lock.name}, held by another "
                    f"test run ({what})",
                    file=sys.stderr,
                    flush=True,
                )
                told = True
            time.sleep(1.0)


def live_processes(reading: str) -> Iterator[tuple[int, str]]:
    """Each live process's pid with the text of its /proc/PID/`reading` (NUL bytes as spaces); one
    that exits while it is read is passed over."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / reading).read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        yield int(entry.name), text


def _children(pid: int) -> list[int]:
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    return [child for child, stat in live_processes("stat") if int(stat.rpartition(")")[2].split()[1]) == pid]


class SystemdSandbox:
    """A booted systemd in its own PID/mount/UTS/IPC namespaces (see the module docstring).

    `directory`: where this sandbox keeps its writable layer (a test's tmp_path); removed on exit.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        extra_packages: Sequence[str] = (),
        boot_timeout_seconds: float = 90.0,
        cgroup_root: Path | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.extra_packages = tuple(extra_packages)
        self.boot_timeout_seconds = boot_timeout_seconds
        # A cgroup2 directory to mount as the sandbox's /sys/fs/cgroup in place of the host's
        # (tests/test_sandbox_on_systemd.py: a sandbox that is a systemd host of the unified kind).
        self.cgroup_root = cgroup_root
        # On a systemd host: the scope the sandbox runs in, its cgroup delegated to the sandbox's systemd.
        self.delegated = host_runs_systemd()
        self.scope = f"gpu-agent-sandbox-{os.getpid()}-{id(self):x}.scope"
        self.mountpoint = self.directory / "root"  # the sandbox's / inside its mount namespace
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._host_lock: BinaryIO | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> SystemdSandbox:
        try:
            self.boot()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _boot_script(self, lower: Path) -> str:
        root = shlex.quote(str(self.mountpoint))
        upper = shlex.quote(str(self.directory / "upper"))
        work = shlex.quote(str(self.directory / "work"))
        return f"""
set -e
mount -t overlay overlay -o lowerdir={shlex.quote(str(lower))},upperdir={upper},workdir={work} {root}
mount -t proc proc {root}/proc
mount --bind {root}/proc/sys {root}/proc/sys
mount -o remount,bind,ro {root}/proc/sys
mount --rbind /sys {root}/sys
{self._cgroup_mount(root)}mount -t tmpfs -o mode=0755,nosuid tmpfs {root}/dev
mknod -m 666 {root}/dev/null c 1 3
mknod -m 666 {root}/dev/zero c 1 5
mknod -m 666 {root}/dev/full c 1 7
mknod -m 666 {root}/dev/random c 1 8
mknod -m 666 {root}/dev/urandom c 1 9
mknod -m 666 {root}/dev/tty c 5 0
: > {root}/dev/console
mkdir -m 755 {root}/dev/pts {root}/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts {root}/dev/pts
ln -s pts/ptmx {root}/dev/ptmx
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs {root}/dev/shm
ln -s /proc/self/fd {root}/dev/fd
ln -s /proc/self/fd/0 {root}/dev/stdin
ln -s /proc/self/fd/1 {root}/dev/stdout
ln -s /proc/self/fd/2 {root}/dev/stderr
mount -t tmpfs tmpfs {root}/run
mount -t tmpfs tmpfs {root}/tmp
exec chroot {root} /lib/systemd/systemd --system --unit=multi-user.target
"""

    def _cgroup_mount(self, root: str) -> str:
        """The sandbox's /sys/fs/cgroup: on a systemd host a cgroup2 file system of its own cgroup
        namespace (the delegated scope is its root); else the host's, as /sys brought it."""
        if self.delegated:
            # The host's hierarchy (what /sys brought) goes first: the kernel mounts no file system
            # on the root of a mount of itself.
            cgroup = f"{root}/sys/fs/cgroup"
            return f"while mountpoint -q {cgroup}; do umount -R {cgroup}; done\nmount -t cgroup2 gpu-agent-sandbox {cgroup}\n"
        if self.cgroup_root is not None:
            return f"mount --bind {shlex.quote(str(self.cgroup_root))} {root}/sys/fs/cgroup\n"
        return ""

    def boot(self) -> None:
        lower = cached_rootfs(self.extra_packages)
        self._host_lock = open(lower.parent / ".running.lock", "a+b")  # noqa: SIM115 (held until close)
        try:
            lock_or_wait(self._host_lock, "the one systemd sandbox a host may run")
        except SandboxError:
            self._host_lock.close()
            self._host_lock = None
            raise
        for name in ("root", "upper", "work"):
            (self.directory / name).mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "boot.log", "wb")  # noqa: SIM115 (the child keeps writing to it)
        argv = ["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--propagation", "private"]
        if self.delegated:
            scope = [
                "systemd-run",
                "--scope",
                "--quiet",
                "--collect",
                "--property=Delegate=yes",
                f"--unit={self.scope}",
            ]
            argv = [*scope, "--", *argv, "--cgroup"]
        self._proc = subprocess.Popen(
            [*argv, "sh", "-c", self._boot_script(lower)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**_ENV, "container": "gpu-agent-sandbox"},
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + self.boot_timeout_seconds
        self._pid = self._wait_for_init(deadline)
        self._wait_running(deadline)

    def _wait_for_init(self, deadline: float) -> int:
        """The host PID of the namespace's PID 1 (unshare's child), once it runs systemd."""
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SandboxError(f"sandbox exited ({self._proc.returncode}) before booting: {self.boot_log()}")
            for pid in _children(self._proc.pid):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                        return pid
            time.sleep(0.05)
        raise SandboxError(f"systemd did not start in time: {self.boot_log()}")

    def _wait_running(self, deadline: float) -> None:
        state = ""
        while time.monotonic() < deadline:
            proc = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
            state = proc.stdout.strip()
            if state in ("running", "degraded"):
                return
            if self._proc is not None and self._proc.poll() is not None:
                break
            time.sleep(0.2)
        failed = self.run(["systemctl", "--failed", "--no-pager"], check=False).stdout if self.alive else ""
        raise SandboxError(f"systemd not running in time (state {state!r}):\n{failed}\n{self.boot_log()}")

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._pid is not None

    def boot_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "boot.log").read_text(errors="replace")[-4000:]
        return ""

    def close(self, timeout_seconds: float = 30.0) -> None:
        """Power the sandbox off (systemd stops its units), kill it if that takes too long, and
        remove its writable layer. The mounts live in its namespace and vanish with it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            if self._pid is not None:
                self.run(["systemctl", "poweroff", "--no-block"], check=False, timeout=10)
            try:
                proc.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                # SIGKILL to a PID namespace's init ends every process in the namespace.
                for pid in [self._pid] if self._pid is not None else _children(proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self._proc = None
        self._pid = None
        for name in ("upper", "work", "root"):
            shutil.rmtree(self.directory / name, ignore_errors=True)
        if self._host_lock is not None:
            self._host_lock.close()
            self._host_lock = None

    # -- talking to it ------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self._pid is None:
            raise SandboxError("the sandbox is not running")
        return self._pid

    @property
    def command_prefix(self) -> list[str]:
        """argv prefix running a program inside the sandbox: in its namespaces, with its systemd's
        root and working directory (entering a mount namespace starts from that namespace's own
        root, which is not the caller's where the caller is in a chroot: a sandbox in a sandbox)."""
        return ["nsenter", "-t", str(self.pid), "-p", "-m", "-u", "-i", "-r", "-w"]

    @property
    def systemctl_argv(self) -> list[str]:
        """For `SystemdManager(systemctl_argv=...)`: the agent's systemctl calls land in the sandbox."""
        return [*self.command_prefix, "systemctl"]

    @property
    def root(self) -> Path:
        """The sandbox's `/` as the host can read and write it (through the namespace's view)."""
        return Path(f"/proc/{self.pid}/root")

    def run(
        self, argv: Sequence[str], check: bool = True, timeout: float = 60.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside the sandbox (no shell); CalledProcessError when check and it fails."""
        proc = subprocess.run(
            [*self.command_prefix, *argv],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_ENV,
            check=False,
        )
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, list(argv), proc.stdout, proc.stderr)
        return proc

    def systemctl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", *args], check=check, timeout=timeout)

    def path(self, absolute: str) -> Path:
        """A path inside the sandbox, as the host reaches it."""
        if not absolute.startswith("/"):
            raise ValueError(f"sandbox path must be absolute: {absolute!r}")
        return self.root / absolute.lstrip("/")

    def copy_in(self, src: str | os.PathLike[str], dst: str, mode: int | None = None) -> Path:
        """Copy a host file or directory to `dst` (absolute, inside the sandbox)."""
        target = self.path(dst)
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(src).is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True)
        else:
            shutil.copy2(src, target)
            if mode is not None:
                target.chmod(mode)
        return target

    def bind(self, src: str | os.PathLike[str], dst: str) -> None:
        """Mount a host directory read-only at `dst` (absolute, inside the sandbox). Done in the
        sandbox's mount namespace outside its root, where the host's paths are still reachable."""
        self.path(dst).mkdir(parents=True, exist_ok=True)
        inside = f"{self.mountpoint}{dst}"
        for options in (["--bind", str(src)], ["-o", "remount,bind,ro"]):
            argv = ["nsenter", "-t", str(self.pid), "-m", "mount", *options, inside]
            subprocess.run(argv, capture_output=True, text=True, timeout=60, env=_ENV, check=True)

    def write_file(self, dst: str, text: str, mode: int = 0o644) -> Path:
        target = self.path(dst)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        target.chmod(mode)
        return target

    def install_unit(self, name: str, text: str) -> Path:
        """Write /etc/systemd/system/NAME and reload systemd."""
        path = self.write_file(f"/etc/systemd/system/{name}", text)
        self.systemctl("daemon-reload")
        return path

    def unit_property(self, unit: str, name: str) -> str:
        return self.systemctl("show", f"--property={name}", "--value", unit).stdout.strip()
