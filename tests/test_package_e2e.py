"""The Debian 12 package installed with apt in a real systemd (tests/systemd_sandbox.py): the
hardened unit starts, notifies, answers `gpu-agent status`, logs structured journal entries, is
restarted by its watchdog, restarts a stand-in sglang.service by rule, refuses a reload whose
config or rules the check rejects (systemctl reload fails, the daemon is not signalled), upgrades
keeping its configuration, keeps the running daemon when an upgrade finds a config it rejects
(and `status` says what runs is not the installed package), leaves nothing behind when purged,
and goes to and from the previous package layout (rules as conffiles in /etc) without a prompt,
keeping an admin's changed rule as an override and their masks, on a host that had that layout
and on one that never had it.

The sandbox is a Debian 12 (bookworm) root file system, so the cp311 package is the one under
test. Its dependencies (python3-venv, python3-systemd) come from Debian's archive through the
sandbox's apt, as they would on a server. The GPUs are the simulated backend's; the host tree it
reads is a fake one inside the sandbox.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from helpers import wait_until
from hosttree import make_host_tree
from systemd_sandbox import SystemdSandbox, missing_requirements
from test_packaging import PKG_VERSION, REPO, RULES, VERSION, build_packages

from agent.demo.standin_process import free_port

pytestmark = [
    pytest.mark.real_daemon,
    pytest.mark.e2e,
    pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements())),
]

UNIT = "gpu-agent.service"
HOST_ROOT = "/srv/gpu-agent-host"
DEB = "/root/gpu-agent.deb"
APT_ENV = ["env", "DEBIAN_FRONTEND=noninteractive"]
ADMIN_RULES = "/etc/gpu-agent/rules.d"
SGLANG_PORT = free_port()
METRICS_PORT = free_port()
# The stand-in runs from the package's own environment: agent/demo/standin.py is part of gpu-agent.
SGLANG_UNIT = f"""[Unit]
Description=sglang stand-in

[Service]
ExecStart=/opt/gpu-agent/venv/bin/python -m agent.demo.standin --port {SGLANG_PORT} --control-file /run/sglang.control
"""
# Watchdog and restart delays shortened for the test: the shipped 30 s / 5 s are checked by
# tests/test_unit_file.py; here the mechanism is what counts.
FAST_WATCHDOG = "[Service]\nWatchdogSec=6s\nRestartSec=1s\n"
SIMULATED_CONFIG = f"""mode: enforce
backend: simulated
simulated: {{profile: h200x2}}
host_root: {HOST_ROOT}
interval_seconds: 1
metrics: {{listen: "127.0.0.1:{METRICS_PORT}"}}
services:
  - name: sglang
    unit: sglang.service
    health_url: "http://127.0.0.1:{SGLANG_PORT}/health"
    probe_interval_seconds: 1
    probe_timeout_seconds: 1
    ready_timeout_seconds: 30
"""


def wait_for(
    what: str, predicate: Callable[[], bool], timeout_seconds: float = 30.0, sandbox: SystemdSandbox | None = None
) -> None:

    def described() -> str:
        context = f"\njournalctl -u {UNIT}:\n{journal(sandbox)[-4000:]}" if sandbox is not None else ""
        return f"{what}{context}"

    wait_until(predicate, timeout_seconds, described, poll_seconds=0.2)


def main_pid(sandbox: SystemdSandbox, unit: str = UNIT) -> int:
    return int(sandbox.unit_property(unit, "MainPID"))


def active(sandbox: SystemdSandbox, unit: str = UNIT) -> bool:
    return sandbox.unit_property(unit, "ActiveState") == "active"


def journal(sandbox: SystemdSandbox, *args: str) -> str:
    return sandbox.run(["journalctl", "--no-pager", "-u", UNIT, *args]).stdout


def journal_entries(sandbox: SystemdSandbox) -> list[dict[str, str]]:
    return [json.loads(line) for line in journal(sandbox, "-o", "json").splitlines() if line.startswith("{")]


def apt_install(sandbox: SystemdSandbox, deb: Path) -> None:
    sandbox.copy_in(deb, DEB)
    proc = sandbox.run([*APT_ENV, "apt-get", "install", "-y", "-q", DEB], check=False, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def packages() -> dict[str, Path]:
    return build_packages()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory, packages: dict[str, Path]) -> Iterator[SystemdSandbox]:
    with SystemdSandbox(tmp_path_factory.mktemp("sandbox")) as booted:
        update = booted.run(["apt-get", "update", "-q"], check=False, timeout=300)
        assert update.returncode == 0, f"apt-get update in the sandbox failed: {update.stdout}{update.stderr}"
        apt_install(booted, packages["debian12"])
        yield booted


def test_install_enables_and_starts_the_shipped_config(sandbox: SystemdSandbox) -> None:
    assert sandbox.systemctl("is-enabled", UNIT).stdout.strip() == "enabled"
    wait_for("gpu-agent active", lambda: active(sandbox))
    # Type=notify: active means the daemon sent READY=1; its STATUS= line is in systemd's hands.
    assert sandbox.unit_property(UNIT, "Type") == "notify"
    assert sandbox.unit_property(UNIT, "StatusText")
    shipped = (Path(__file__).resolve().parent.parent / "packaging" / "agent.yaml").read_text()
    assert sandbox.path("/etc/gpu-agent/agent.yaml").read_text() == shipped
    # No NVIDIA driver in the sandbox: the shipped nvml config runs and says so.
    assert "libnvidia-ml.so.1 not found" in journal(sandbox)
    venv = sandbox.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip()
    assert venv == f"/opt/gpu-agent/env-{PKG_VERSION}-1~bookworm", venv
    # Bytecode compiled at install: the service may not write /opt (ProtectSystem=strict), and a
    # daemon that compiles its modules at start keeps ~16 MB more RSS (docs/performance.md).
    sources = list(next(sandbox.path(venv).glob("lib/python3*/site-packages/agent")).rglob("*.py"))
    uncompiled = [p for p in sources if not list((p.parent / "__pycache__").glob(f"{p.stem}.cpython-*.pyc"))]
    assert sources and not uncompiled, uncompiled[:5]
    version = sandbox.run(["gpu-agent", "--version"]).stdout
    assert version.splitlines()[0] == f"gpu-agent {VERSION}"
    # The shipped rules live under /usr/share; /etc/gpu-agent/rules.d is the admin's, empty.
    shipped_rules = sorted(p.name for p in sandbox.path("/usr/share/gpu-agent/rules.d").iterdir())
    assert shipped_rules == RULES
    assert list(sandbox.path("/etc/gpu-agent/rules.d").iterdir()) == []
    checked = sandbox.run(["gpu-agent", "check-config", "--strict"]).stdout
    assert all(f"  /usr/share/gpu-agent/rules.d/{name}" in checked for name in RULES), checked
    assert sandbox.path("/usr/share/bash-completion/completions/gpu-agent").is_file()


@pytest.fixture(scope="module")
def simulated(sandbox: SystemdSandbox) -> SystemdSandbox:
    """The agent reconfigured for a simulated 2x H200 node watching a stand-in sglang.service."""
    make_host_tree(sandbox.path(HOST_ROOT))
    # kmod's directory (not in a minimal Debian root): the unit makes it writable when it exists.
    sandbox.run(["mkdir", "-p", "/etc/modprobe.d"])
    sandbox.install_unit("sglang.service", SGLANG_UNIT)
    sandbox.systemctl("start", "sglang.service")
    sandbox.write_file(f"/etc/systemd/system/{UNIT}.d/50-test-watchdog.conf", FAST_WATCHDOG)
    sandbox.write_file("/etc/gpu-agent/agent.yaml", SIMULATED_CONFIG)
    sandbox.run(["gpu-agent", "check-config"])
    sandbox.systemctl("daemon-reload")
    sandbox.systemctl("restart", UNIT)
    assert active(sandbox)
    return sandbox


def test_the_sandbox_is_in_force(simulated: SystemdSandbox) -> None:
    pid = main_pid(simulated)
    status = simulated.run(["cat", f"/proc/{pid}/status"]).stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    # CAP_CHOWN (0), CAP_FOWNER (3), CAP_SYS_ADMIN (21), CAP_SYSLOG (34), nothing else.
    assert int(fields["CapBnd"], 16) == (1 << 0) | (1 << 3) | (1 << 21) | (1 << 34)
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"  # the system-call filter

    def writable(path: str) -> str:
        """Whether the daemon, in its own mount namespace, can create a file in `path`."""
        probe = f"touch {path}/.probe 2>&1 && rm {path}/.probe && echo writable"
        argv = ["nsenter", "-t", str(pid), "-m", "-r", "-w", "sh", "-c", probe]
        return simulated.run(argv, check=False).stdout.strip()

    for path in ("/usr", "/etc", "/etc/gpu-agent", "/opt/gpu-agent", "/var/lib/dpkg", HOST_ROOT):
        assert writable(path).endswith("Read-only file system"), path
    for path in ("/var/lib/gpu-agent", "/run/gpu-agent", "/etc/modprobe.d", "/etc/systemd/system", "/var/cache"):
        assert writable(path) == "writable", path
    # ProtectHome=yes: the daemon's /root is an empty, inaccessible directory.
    simulated.write_file("/root/secret", "not for the agent\n")
    listing = ["nsenter", "-t", str(pid), "-m", "-r", "-w", "ls", "-A", "/root"]
    assert simulated.run(listing).stdout == ""


def test_status_through_the_socket(simulated: SystemdSandbox) -> None:
    proc = simulated.run(["gpu-agent", "status", "--json"], check=False)
    document = json.loads(proc.stdout)
    assert proc.returncode == document["verdict"]["exit_code"] in (0, 2), proc.stderr  # 2: attention needed
    assert document["source"] != "direct", document.get("note")
    assert len(document["gpus"]) == 2
    assert simulated.path("/run/gpu-agent/agent.sock").is_socket()
    assert "H200" in simulated.run(["gpu-agent", "status"], check=False).stdout


def test_reload_keeps_the_daemon(simulated: SystemdSandbox) -> None:
    before = main_pid(simulated)
    simulated.systemctl("reload", UNIT)
    wait_for("config reloaded", lambda: "config reloaded" in journal(simulated))
    assert main_pid(simulated) == before
    assert active(simulated)


def test_a_reload_the_check_rejects_fails_and_leaves_the_daemon_alone(simulated: SystemdSandbox) -> None:
    """A typo in agent.yaml, then a broken rules file: `systemctl reload` exits non-zero, the
    check's error is in the unit's journal, and the daemon never got the signal (it logs neither a
    reload nor a failed one, and its view of the config is untouched)."""
    good = simulated.path("/etc/gpu-agent/agent.yaml").read_text()
    pid = main_pid(simulated)
    broken_rules = f"{ADMIN_RULES}/60-broken.yaml"
    cases = [
        ("/etc/gpu-agent/agent.yaml", good.replace("interval_seconds: 1", "interval_seconds: -1"), "interval_seconds"),
        (broken_rules, "rules:\n  - name: half a rule\n", "60-broken.yaml"),
    ]
    try:
        for path, text, named in cases:
            before = journal(simulated, "-o", "cat")
            simulated.write_file(path, text)
            reload = simulated.systemctl("reload", UNIT, check=False)
            assert reload.returncode != 0, reload.stdout + reload.stderr
            added = journal(simulated, "-o", "cat")[len(before) :]
            assert named in added, added
            assert "config reload" not in added, added  # the daemon's own words for a SIGHUP
            assert main_pid(simulated) == pid and active(simulated)
            simulated.write_file("/etc/gpu-agent/agent.yaml", good)
            simulated.run(["rm", "-f", broken_rules])
        document = json.loads(simulated.run(["gpu-agent", "status", "--json"], check=False).stdout)
        assert not any("reload" in line for line in document["verdict"]["attention"]), document["verdict"]
    finally:
        simulated.write_file("/etc/gpu-agent/agent.yaml", good)
        simulated.run(["rm", "-f", broken_rules])
    simulated.systemctl("reload", UNIT)


def test_journal_has_structured_fields(simulated: SystemdSandbox) -> None:
    simulated.run(["gpu-agent", "inject", "xid", "31", "--gpu", "1", "--source", "nvml"])

    def xid_entry() -> dict[str, str] | None:
        for entry in journal_entries(simulated):
            if entry.get("XID") == "31":
                return entry
        return None

    wait_for("an Xid 31 journal entry", lambda: xid_entry() is not None)
    entry = xid_entry()
    assert entry is not None
    assert entry["SYSLOG_IDENTIFIER"] == "gpu-agent"
    assert entry["_SYSTEMD_UNIT"] == UNIT
    assert re.fullmatch(r"GPU-[0-9a-f-]+", entry["GPU_UUID"]), entry["GPU_UUID"]
    assert entry["GPU"] == "1"
    # The point of the fields: journalctl can select on them.
    assert entry["MESSAGE"] in journal(simulated, "XID=31", "-o", "cat").splitlines()


def test_watchdog_restarts_a_hung_daemon(simulated: SystemdSandbox) -> None:
    before = main_pid(simulated)
    restarts = int(simulated.unit_property(UNIT, "NRestarts"))
    # A stopped process sends no WATCHDOG=1: systemd kills it with SIGABRT (and SIGCONT) after
    # WatchdogSec and Restart=on-failure starts a new one.
    simulated.run(["kill", "-STOP", str(before)])
    wait_for(
        "a new daemon after the watchdog fired",
        lambda: main_pid(simulated) not in (0, before) and active(simulated),
        timeout_seconds=60,
    )
    assert int(simulated.unit_property(UNIT, "NRestarts")) == restarts + 1
    log = journal(simulated)
    assert "Watchdog timeout" in log
    # faulthandler's dump of every thread (the wrapper runs python -X faulthandler).
    assert "Fatal Python error: Aborted" in log
    # ExecStopPost ran `gpu-agent restore` after the kill (an H200 has no fans to give back).
    after_kill = log[log.rindex("Watchdog timeout") :]
    assert re.search(r"gpu-agent\[\d+\]: fan_curve +0 +skipped", after_kill), after_kill[-3000:]


def test_unhealthy_service_restarted_by_rule(simulated: SystemdSandbox) -> None:
    # The agent drives systemd units only on the real host tree (host_root /): with an empty
    # policy and the simulated backend, enforce mode changes nothing else in the sandbox.
    simulated.write_file("/etc/gpu-agent/agent.yaml", SIMULATED_CONFIG.replace(HOST_ROOT, "/"))
    simulated.systemctl("restart", UNIT)
    wait_for("sglang active", lambda: active(simulated, "sglang.service"))
    before = main_pid(simulated, "sglang.service")
    simulated.write_file("/run/sglang.control", "503\n")
    # 30-service.yaml (shipped): 3 failed probes, 1 s apart here -> restart_service through systemctl.
    wait_for(
        "sglang restarted by the agent",
        lambda: main_pid(simulated, "sglang.service") not in (0, before),
        timeout_seconds=45,
        sandbox=simulated,
    )
    simulated.write_file("/run/sglang.control", "ok\n")
    wait_for(
        "the restart logged",
        lambda: any(
            e.get("RULE") == "service-unhealthy-restart"
            and e.get("ACTION") == "restart_service"
            and e.get("MESSAGE", "").startswith("action finished")
            for e in journal_entries(simulated)
        ),
    )


def test_upgrade_with_a_config_it_rejects_keeps_the_running_daemon(simulated: SystemdSandbox) -> None:
    """The daemon runs on a config it loaded earlier; the config on disk is now one the new
    version rejects: apt completes, the old environment and the daemon stay, and the package
    output and the journal say why and what to do."""
    good = simulated.path("/etc/gpu-agent/agent.yaml").read_text()
    wait_for("gpu-agent active", lambda: active(simulated))
    old_pid = main_pid(simulated)
    old_env = simulated.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip()
    simulated.write_file("/etc/gpu-agent/agent.yaml", good.replace("interval_seconds: 1", "interval_seconds: -1"))
    upgrade = build_packages(release=2, targets=("debian12",))["debian12"]
    simulated.copy_in(upgrade, DEB)
    proc = simulated.run([*APT_ENV, "apt-get", "install", "-y", "-q", DEB], check=False, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "interval_seconds" in output and "gpu-agent keeps running the previous version" in output, output[-3000:]
    status = simulated.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", "gpu-agent"]).stdout
    assert status == f"install ok installed {PKG_VERSION}-2~bookworm"
    assert simulated.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip() == old_env
    assert active(simulated) and main_pid(simulated) == old_pid
    logged = simulated.run(["journalctl", "--no-pager", "-t", "gpu-agent", "-p", "err", "-o", "cat"]).stdout
    assert "the new version rejects /etc/gpu-agent/agent.yaml" in logged
    # `status` (run from the environment that stayed) says the installed package is not what runs.
    said = simulated.run(["gpu-agent", "status"], check=False).stderr
    assert f"is not the installed package's ({PKG_VERSION}-2~bookworm): the upgrade kept" in said, said
    # Fixed, the way the message says: the new environment takes over.
    simulated.write_file("/etc/gpu-agent/agent.yaml", good)
    simulated.run(["/opt/gpu-agent/lib/install-env", "build"], timeout=300)
    simulated.systemctl("restart", UNIT)
    assert f"{PKG_VERSION}-2~bookworm" in simulated.run(["readlink", "/opt/gpu-agent/venv"]).stdout
    assert "warning" not in simulated.run(["gpu-agent", "check-config"]).stderr


def test_upgrade_keeps_config_then_remove_and_purge_leave_nothing(simulated: SystemdSandbox) -> None:
    config = simulated.path("/etc/gpu-agent/agent.yaml").read_text()
    upgrade = build_packages(release=3, targets=("debian12",))["debian12"]
    old_pid = main_pid(simulated)
    old_env = simulated.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip()
    apt_install(simulated, upgrade)
    assert simulated.run(["dpkg-query", "-W", "-f", "${Version}", "gpu-agent"]).stdout == f"{PKG_VERSION}-3~bookworm"
    # The changed conffile is kept (the shipped one did not change between the releases).
    assert simulated.path("/etc/gpu-agent/agent.yaml").read_text() == config
    new_env = simulated.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip()
    assert new_env != old_env and f"{PKG_VERSION}-3~bookworm" in new_env
    assert sorted(p.name for p in simulated.path("/opt/gpu-agent").glob("env-*")) == [Path(new_env).name]
    wait_for("the daemon restarted", lambda: active(simulated) and main_pid(simulated) not in (0, old_pid))
    # It runs from the new environment (its compiled modules are mapped from there).
    assert f"{new_env}/lib/" in simulated.run(["cat", f"/proc/{main_pid(simulated)}/maps"]).stdout

    # The test's own drop-in is not the package's to remove.
    simulated.run(["rm", "-r", f"/etc/systemd/system/{UNIT}.d"])
    remove = simulated.run([*APT_ENV, "apt-get", "remove", "-y", "-q", "gpu-agent"], check=False, timeout=300)
    assert remove.returncode == 0, remove.stdout + remove.stderr
    # Removal stops and disables the service and removes the environment; config and state stay.
    assert simulated.unit_property(UNIT, "LoadState") == "not-found"
    assert simulated.run(["find", "/etc/systemd", "/lib/systemd", "-name", "gpu-agent*"]).stdout == ""
    assert not simulated.path("/opt/gpu-agent").exists()
    assert simulated.path("/etc/gpu-agent/agent.yaml").read_text() == config
    assert simulated.path("/var/lib/gpu-agent").is_dir()

    purge = simulated.run([*APT_ENV, "apt-get", "purge", "-y", "-q", "gpu-agent"], check=False, timeout=300)
    assert purge.returncode == 0, purge.stdout + purge.stderr
    for path in ("/opt/gpu-agent", "/etc/gpu-agent", "/var/lib/gpu-agent", "/run/gpu-agent", "/usr/bin/gpu-agent"):
        assert not simulated.path(path).exists(), path
    assert simulated.run(["dpkg-query", "-W", "gpu-agent"], check=False).returncode != 0
    # The inference service is not the package's: it keeps running.
    assert active(simulated, "sglang.service")


LEGACY_COMMIT = "b8c3c15"  # the last commit whose packages installed the rules in /etc/gpu-agent/rules.d
SITE_RULES = "rules: []\n"  # an admin's own file: read, and kept through every path


@pytest.fixture(scope="module")
def legacy_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Debian 12 package of the commit before the rules moved, rebuilt from git."""
    source = tmp_path_factory.mktemp("old-source")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", LEGACY_COMMIT], capture_output=True, check=False)
    if archive.returncode != 0:
        pytest.skip(f"commit {LEGACY_COMMIT} is not in this checkout's history")
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    out = tmp_path_factory.mktemp("old-packages")
    argv = [sys.executable, str(source / "packaging/build.py"), "--target", "debian12", "--out", str(out)]
    built = subprocess.run([*argv, "--work", str(out / "work")], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    return next(out.glob("*.deb"))


def admin_rules(sandbox: SystemdSandbox) -> dict[str, str]:
    """/etc/gpu-agent/rules.d: each file's text, each link's target as `-> TARGET`."""
    found = {}
    for path in sorted(sandbox.path(ADMIN_RULES).iterdir()):
        found[path.name] = f"-> {os.readlink(path)}" if path.is_symlink() else path.read_text()
    return found


def listed_rules(sandbox: SystemdSandbox) -> list[str]:
    """The rules files `gpu-agent check-config` says count, one line each (after the summary)."""
    checked = sandbox.run(["gpu-agent", "check-config"]).stdout
    return [line.strip() for line in checked.splitlines()[1:]]


def expected_listing(changed: str | None, masked: list[str], added: str) -> list[str]:
    shipped = "/usr/share/gpu-agent/rules.d"
    lines = []
    for name in sorted([*RULES, added]):
        if name == changed:
            lines.append(f"{ADMIN_RULES}/{name} (overrides {shipped}/{name})")
        elif name == added:
            lines.append(f"{ADMIN_RULES}/{name}")
        elif name not in masked:
            lines.append(f"{shipped}/{name}")
    return [*lines, *(f"{ADMIN_RULES}/{name}: masked (disables {shipped}/{name})" for name in masked)]


def old_rules_line(sandbox: SystemdSandbox) -> str:
    """The old check-config's summary of the rules it reads: `N rules from DIR`."""
    return sandbox.run(["gpu-agent", "check-config"]).stdout.strip().rsplit("; ", 1)[1]


def apt_output(sandbox: SystemdSandbox, deb: Path, *options: str) -> str:
    """apt-get install of `deb`, stdin closed: a conffile prompt would fail it, as it stopped `apt-get install -y`."""
    sandbox.copy_in(deb, DEB)
    proc = sandbox.run([*APT_ENV, "apt-get", "install", "-y", "-q", *options, DEB], check=False, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout + proc.stderr


def test_the_admins_rules_survive_the_old_layout_both_ways(
    sandbox: SystemdSandbox, packages: dict[str, Path], legacy_package: Path
) -> None:
    """A host that never had the old layout: this package, one shipped rule masked and a file of the
    admin's own; back to the package of the commit before the rules moved (conffiles in /etc):
    the mask stays, and the old daemon skips it. There an edit of one rule and the deletion of
    another; then this package, back to the old one, and forward again: apt never prompts, and
    every step keeps exactly the rules the admin had. (The service is not waited for: the shipped
    config's port, 9481, is the host's here, and may be taken.)"""
    # From a clean slate (the tests before purge the package; run alone, the fixture installed it).
    sandbox.run([*APT_ENV, "apt-get", "purge", "-y", "-q", "gpu-agent"], check=False, timeout=300)
    sandbox.run(["rm", "-rf", f"/etc/systemd/system/{UNIT}.d"])
    apt_install(sandbox, packages["debian12"])
    sandbox.run(["ln", "-s", "/dev/null", f"{ADMIN_RULES}/40-memory.yaml"])
    sandbox.write_file(f"{ADMIN_RULES}/70-site.yaml", SITE_RULES)
    assert listed_rules(sandbox) == expected_listing(None, ["40-memory.yaml"], "70-site.yaml")

    # Back, on a host dpkg never saw the old layout on: the mask stays, the old rules come.
    output = apt_output(sandbox, legacy_package, "--allow-downgrades")
    assert f"{ADMIN_RULES}/40-memory.yaml masks a rule the older package ships: kept" in output, output[-3000:]
    legacy = REPO / "packaging/legacy-rules"
    shipped_then = {p.name: p.read_text() for p in legacy.glob("*.yaml")}
    assert admin_rules(sandbox) == {
        **shipped_then,
        "40-memory.yaml": "-> /dev/null",
        "70-site.yaml": SITE_RULES,
    }
    counted = sum(len(yaml.safe_load(text)["rules"]) for name, text in shipped_then.items() if name != "40-memory.yaml")
    assert old_rules_line(sandbox) == f"{counted} rules from {ADMIN_RULES}"

    # The old layout's own ways: one rule tuned, one deleted.
    changed = shipped_then["20-thermal.yaml"] + "# tuned on this node\n"
    sandbox.write_file(f"{ADMIN_RULES}/20-thermal.yaml", changed)
    sandbox.run(["rm", f"{ADMIN_RULES}/50-gpu-state.yaml"])
    old_rules = admin_rules(sandbox)
    old_line = old_rules_line(sandbox)
    masks = {"40-memory.yaml": "-> /dev/null", "50-gpu-state.yaml": "-> /dev/null"}
    new_layout = {"20-thermal.yaml": changed, **masks, "70-site.yaml": SITE_RULES}
    listing = expected_listing("20-thermal.yaml", ["40-memory.yaml", "50-gpu-state.yaml"], "70-site.yaml")
    upgrade = build_packages(release=3, targets=("debian12",))["debian12"]

    # Forward: the changed copy overrides, the deleted one is masked, the unchanged ones go.
    output = apt_output(sandbox, upgrade)
    assert f"kept {ADMIN_RULES}/20-thermal.yaml (changed here)" in output, output[-3000:]
    assert f"{ADMIN_RULES}/50-gpu-state.yaml was deleted here: masked it" in output, output[-3000:]
    assert admin_rules(sandbox) == new_layout
    assert listed_rules(sandbox) == listing
    # Back: the old package's rules as the admin left them, the deleted one masked now (the old
    # daemon skips a mask as it skipped the missing file).
    apt_output(sandbox, legacy_package, "--allow-downgrades")
    status = sandbox.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", "gpu-agent"]).stdout
    assert status.startswith("install ok installed 0.1.0-1~bookworm"), status
    assert admin_rules(sandbox) == {**old_rules, **masks}
    assert old_rules_line(sandbox) == old_line
    # And forward again, where dpkg now records the masks as the old package's conffiles.
    apt_output(sandbox, upgrade)
    assert admin_rules(sandbox) == new_layout
    assert listed_rules(sandbox) == listing
