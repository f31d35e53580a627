"""The Debian 12 package in a root without systemd, as in a container: installed with apt without
its Recommends (systemd, python3-systemd), run by hand, upgraded and purged, while no systemd runs.

The root is the systemd sandbox's cached Debian 12 root (tests/systemd_sandbox.py,
`cached_rootfs`) through an overlay, with systemd purged from the overlay, entered with chroot(8)
in a mount namespace of its own: /run is an empty tmpfs, so /run/systemd/system (systemd's "I am
running" directory, which the maintainer scripts test) does not exist, and no systemctl exists.
strace records every program the package manager starts, so "no systemctl was called" is checked
on what ran, not on what the scripts say. The packages are the ones tests/test_packaging.py and
tests/test_package_e2e.py build (`build_packages`, cached per session); apt fetches their
dependencies from Debian's archive, as in the sandbox e2e test.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import pytest
from helpers import wait_until
from hosttree import make_host_tree
from systemd_sandbox import cached_rootfs
from test_packaging import BUILD_OUT, PKG_VERSION, REPO, VERSION, build_packages

from agent.demo.standin_process import free_port

TOOLS = ("unshare", "chroot", "mount", "debootstrap", "strace")
_MISSING = [tool for tool in TOOLS if shutil.which(tool) is None]
pytestmark = [
    pytest.mark.real_daemon,
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (an overlay mount and chroot)"),
    pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} (scripts/install-test-deps)"),
]

PACKAGES_IN_ROOT = "/mnt/gpu-agent-packages"  # BUILD_OUT, read-only
SCRIPTS_IN_ROOT = "/mnt/gpu-agent-scripts"  # scripts/, read-only
TEST_DIR = "/srv/gpu-agent-test"  # the simulated config and its host tree
CHROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
SKIPPED_START = "gpu-agent: systemd is not running: gpu-agent.service was not started"
SKIPPED_STOP = "gpu-agent: systemd is not running: no service to stop"
METRICS_PORT = free_port()
SIMULATED_CONFIG = f"""mode: observe
backend: simulated
simulated: {{profile: h200x2}}
host_root: {TEST_DIR}/host
interval_seconds: 1
metrics: {{listen: "127.0.0.1:{METRICS_PORT}"}}
policy:
  gpus:
    - {{match: {{model: "NVIDIA H200*"}}, power_limit_watts: 600}}
"""


class Chroot:
    """`lower` through an overlay whose writes land in `directory`, entered with chroot.

    Every command gets a mount namespace of its own (all its mounts vanish with it): the overlay,
    /proc, a private /dev with the usual device nodes (the host's is never bound in), an empty
    /run, and each of `binds` (host directory -> absolute path inside, read-only when so marked).
    unshare, sh and chroot exec one another, so the process a caller starts is the command itself:
    a signal sent to it reaches the command."""

    def __init__(self, lower: Path, directory: Path, binds: Sequence[tuple[Path, str, bool]] = ()) -> None:
        self.lower = lower
        self.directory = directory
        self.binds = tuple(binds)
        for name in ("root", "upper", "work"):
            (directory / name).mkdir(parents=True, exist_ok=True)

    def argv(self, command: Sequence[str]) -> list[str]:
        root = shlex.quote(str(self.directory / "root"))
        layers = f"lowerdir={self.lower},upperdir={self.directory / 'upper'},workdir={self.directory / 'work'}"
        lines = [
            "set -e",
            f"mount -t overlay overlay -o {shlex.quote(layers)} {root}",
            f"mount -t proc proc {root}/proc",
            f"mount -t tmpfs -o mode=0755,nosuid tmpfs {root}/dev",
            *(
                f"mknod -m 666 {root}/dev/{name} c {major} {minor}"
                for name, major, minor in (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("urandom", 1, 9))
            ),
            f"ln -s /proc/self/fd {root}/dev/fd",
            f"mkdir {root}/dev/pts && mount -t devpts -o newinstance,ptmxmode=0666 devpts {root}/dev/pts",
            f"ln -s pts/ptmx {root}/dev/ptmx",
            f"mount -t tmpfs -o mode=0755 tmpfs {root}/run",
        ]
        for source, target, read_only in self.binds:
            inside = f"{root}{shlex.quote(target)}"
            lines += [f"mkdir -p {inside}", f"mount --bind {shlex.quote(str(source))} {inside}"]
            if read_only:
                lines.append(f"mount -o remount,bind,ro {inside}")
        lines.append(f"exec chroot {root} {shlex.join(command)}")
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)]

    def run(self, command: Sequence[str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self.argv(command), capture_output=True, text=True, timeout=timeout, env=CHROOT_ENV, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{shlex.join(command)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        return proc

    def popen(self, command: Sequence[str], output: IO[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(command), stdout=output, stderr=subprocess.STDOUT, text=True, env=CHROOT_ENV)

    def traced(self, command: Sequence[str], trace: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """run(), with every program started inside and every file looked up (found or not) in `trace`."""
        calls = "execve,execveat,stat,lstat,newfstatat,statx,access,faccessat,faccessat2"
        strace = ["strace", "-f", "-qq", "-e", f"trace={calls}", "-o", str(trace)]
        return subprocess.run(
            [*strace, *self.argv(command)], capture_output=True, text=True, timeout=timeout, env=CHROOT_ENV
        )


def programs_started(trace: Path) -> list[str]:
    """Every program execve was asked to run (found or not)."""
    return re.findall(r'^\d+ +execve\("([^"]*)"', trace.read_text(), re.M)


def systemctl_lookups(trace: Path) -> list[str]:
    """The trace lines where something went for a systemctl: ran it, or looked for it (a shell
    looks a command up on PATH, stat by stat, before it runs it, and finds none here). Only
    deb-systemd-helper's own check whether systemctl is installed (-x /bin/systemctl) is not a
    call, and is left out."""
    program: dict[str, str] = {}
    lookups = []
    for line in trace.read_text().splitlines():
        found = re.match(r'(\d+) +(\w+)\((?:AT_FDCWD, )?"([^"]*)"', line)
        if found is None:
            continue
        pid, call, path = found.groups()
        if call == "execve" and "ENOENT" not in line:
            program[pid] = path
        if path.endswith("/systemctl") and not program.get(pid, "").endswith("/deb-systemd-helper"):
            lookups.append(line)
    return lookups


def installed(root: Chroot, package: str) -> bool:
    status = root.run(["dpkg-query", "-W", "-f", "${Status}", package], check=False).stdout
    return status == "install ok installed"


def in_root(package: Path) -> str:
    return f"{PACKAGES_IN_ROOT}/{package.relative_to(BUILD_OUT)}"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chroot]:
    """The cached Debian 12 root, systemd purged, apt's lists fresh, the simulated node's files in."""
    packages = build_packages()  # the same call as tests/test_packaging.py's fixture: one build a session
    test_dir = tmp_path_factory.mktemp("nosystemd-node")
    make_host_tree(test_dir / "host")
    (test_dir / "agent.yaml").write_text(SIMULATED_CONFIG)
    binds = [
        (BUILD_OUT, PACKAGES_IN_ROOT, True),
        (test_dir, TEST_DIR, False),
        (REPO / "scripts", SCRIPTS_IN_ROOT, True),
    ]
    chroot = Chroot(cached_rootfs(), tmp_path_factory.mktemp("nosystemd-root"), binds)
    chroot.run(["apt-get", "update", "-q"], timeout=300)
    chroot.run(["apt-get", "purge", "-y", "-q", "--allow-remove-essential", "systemd", "systemd-sysv"])
    assert packages["debian12"].is_file()
    yield chroot


def test_the_root_has_no_systemd(root: Chroot) -> None:
    for package in ("systemd", "systemd-sysv", "python3-systemd"):
        assert not installed(root, package), package
    found = root.run(["sh", "-c", "command -v systemctl"], check=False)
    assert found.returncode != 0 and found.stdout == ""
    assert root.run(["test", "-e", "/run/systemd/system"], check=False).returncode == 1


def test_install_without_recommends_configures_and_skips_the_service(root: Chroot, tmp_path: Path) -> None:
    deb = in_root(build_packages()["debian12"])
    trace = tmp_path / "install.trace"
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", deb]
    proc = root.traced(argv, trace)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    # Configured (not half-configured), its Recommends left out, and the scripts said why nothing started.
    assert installed(root, "gpu-agent")
    assert root.run(["dpkg-query", "-W", "-f", "${Version}", "gpu-agent"]).stdout == f"{PKG_VERSION}-1~bookworm"
    assert not installed(root, "systemd") and not installed(root, "python3-systemd")
    assert SKIPPED_START in output, output[-4000:]
    started = programs_started(trace)
    assert any(p.endswith("/opt/gpu-agent/lib/install-env") for p in started), "postinst did not run"
    assert systemctl_lookups(trace) == []
    # The unit is enabled the Debian way (a symlink): a systemd installed later starts it at boot.
    wants = "/etc/systemd/system/multi-user.target.wants/gpu-agent.service"
    assert root.run(["readlink", wants]).stdout.strip() == "/lib/systemd/system/gpu-agent.service"


def test_the_agent_runs_by_hand_without_python3_systemd(root: Chroot, tmp_path: Path) -> None:
    assert root.run(["gpu-agent", "--version"]).stdout.splitlines()[0] == f"gpu-agent {VERSION}"
    # The environment sees the system site-packages, where python3-systemd would be: it is not.
    no_module = root.run(["/opt/gpu-agent/venv/bin/python", "-I", "-c", "import systemd.journal"], check=False)
    assert no_module.returncode == 1 and "No module named 'systemd'" in no_module.stderr
    shipped = root.run(["gpu-agent", "check-config", "--strict"]).stdout
    assert "/etc/gpu-agent/agent.yaml: ok (observe mode, nvml backend" in shipped
    config = f"{TEST_DIR}/agent.yaml"
    assert root.run(["gpu-agent", "check-config", "--config", config]).stdout.startswith(f"{config}: ok")
    plan = root.run(["gpu-agent", "plan", "--config", config], check=False)
    assert plan.returncode == 2, plan.stdout + plan.stderr  # 2: drift, what the policy asks for
    assert "set power limit of GPU 0 from 700 W to 600 W" in plan.stdout
    assert "set power limit of GPU 1 from 700 W to 600 W" in plan.stdout

    # The journal format without python3-systemd and without journald: the native-socket sender
    # finds no socket and each entry's message goes to stderr.
    log = tmp_path / "run.log"
    with log.open("w") as output:
        daemon = root.popen(["gpu-agent", "run", "--log-format", "journal", "--config", config], output)
    try:
        wait_until(lambda: "serving metrics=" in log.read_text(), 60, lambda: f"the daemon serving:\n{log.read_text()}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        status = daemon.wait(60)
    text = log.read_text()
    assert status == 0, text
    assert f"serving metrics=127.0.0.1:{METRICS_PORT} socket=/run/gpu-agent/agent.sock" in text.splitlines()
    assert "GPU backend open backend=simulated driver=" in text
    assert "Traceback" not in text and not any(line.startswith("{") for line in text.splitlines()), text


def test_upgrade_then_purge_without_systemd(root: Chroot, tmp_path: Path) -> None:
    old_env = root.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip()
    deb = in_root(build_packages(release=2, targets=("debian12",))["debian12"])
    upgrade_trace = tmp_path / "upgrade.trace"
    upgrade = root.traced(["apt-get", "install", "-y", "-q", "--no-install-recommends", deb], upgrade_trace)
    output = upgrade.stdout + upgrade.stderr
    assert upgrade.returncode == 0, output[-4000:]
    assert installed(root, "gpu-agent")
    assert root.run(["dpkg-query", "-W", "-f", "${Version}", "gpu-agent"]).stdout == f"{PKG_VERSION}-2~bookworm"
    assert SKIPPED_START in output, output[-4000:]
    new_env = root.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip()
    assert new_env != old_env and f"{PKG_VERSION}-2~bookworm" in new_env
    # The old environment is pruned: nothing runs from it that systemd would have restarted.
    assert root.run(["sh", "-c", "ls -d /opt/gpu-agent/env-*"]).stdout.split() == [new_env]
    assert root.run(["gpu-agent", "--version"]).stdout.splitlines()[0] == f"gpu-agent {VERSION}"

    purge_trace = tmp_path / "purge.trace"
    purge = root.traced(["apt-get", "purge", "-y", "-q", "gpu-agent"], purge_trace)
    output = purge.stdout + purge.stderr
    assert purge.returncode == 0, output[-4000:]
    assert SKIPPED_STOP in output, output[-4000:]
    assert root.run(["dpkg-query", "-W", "gpu-agent"], check=False).returncode != 0
    leftovers = ["/opt/gpu-agent", "/etc/gpu-agent", "/var/lib/gpu-agent", "/usr/bin/gpu-agent"]
    leftovers.append("/etc/systemd/system/multi-user.target.wants/gpu-agent.service")
    assert root.run(["ls", "-d", *leftovers], check=False).stdout == ""
    for trace in (upgrade_trace, purge_trace):
        assert systemctl_lookups(trace) == [], trace.name


def test_install_test_deps_leaves_no_service_running_or_enabled(root: Chroot) -> None:
    """scripts/install-test-deps installing Alertmanager, whose package starts it (here through
    its init script: no systemd runs) and enables it at boot: in the end it neither runs nor is
    enabled, and the policy-rc.d that held it back is gone. (Checked in the one command: every
    command gets a /run of its own here, and a daemon's pid file with it.)"""
    service = "prometheus-alertmanager"
    assert not installed(root, service)
    script = f"""
{SCRIPTS_IN_ROOT}/install-test-deps {service}
if /etc/init.d/{service} status >/dev/null 2>&1; then echo running; fi
ls /etc/rc2.d /etc/rc3.d /etc/rc5.d | grep '^S.*{service}$' || true
ls /etc/systemd/system/multi-user.target.wants 2>/dev/null | grep {service} || true
ls /usr/sbin/policy-rc.d 2>/dev/null || true
"""
    found = root.run(["sh", "-ec", script], timeout=600).stdout
    assert installed(root, service)
    assert found.split() == [], found
    # What a plain install does, for contrast: the package enables it (a link for systemd, S links for init).
    assert root.run(["ls", "/etc/rc2.d"]).stdout.count(service) == 1  # K01...: disabled, not removed
