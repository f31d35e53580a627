"""systemd/gpu-agent.service: systemd's own verifier and security assessment, and the directives
the agent relies on (tests/test_package_e2e.py runs it for real)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "gpu-agent.service"
MAN_PAGE = REPO / "packaging" / "gpu-agent.8"
MAX_EXPOSURE = 3.0

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze (systemd)")


def directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every directive, repeated keys kept in order."""
    found = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.append((section, key.strip(), value.strip()))
    return found


def values(key: str, section: str = "Service") -> list[str]:
    return [v for s, k, v in directives(UNIT.read_text()) if s == section and k == key]


def value(key: str, section: str = "Service") -> str:
    found = values(key, section)
    assert len(found) == 1, f"{key}= appears {len(found)} times"
    return found[0]


@pytest.fixture
def verifiable_unit(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The unit as systemd-analyze can verify it on a build host where gpu-agent is not installed.

    `verify` checks that every Exec*= program exists and is executable, and runs `man` for each
    Documentation=man: entry. The host has neither /usr/bin/gpu-agent nor the man page (the
    package installs both), so the copy points its Exec lines at an executable stand-in in
    tmp_path, and MANPATH points at the man page from the source tree: everything else in the
    file is verified exactly as shipped.
    """
    if shutil.which("man") is None:
        pytest.skip("verify runs man for Documentation=man: (apt-get install man-db)")
    program = tmp_path / "bin" / "gpu-agent"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    for page in (*MAN_PAGE.parent.glob("*.5"), *MAN_PAGE.parent.glob("*.8")):
        section = tmp_path / "man" / f"man{page.suffix[1:]}"
        section.mkdir(parents=True, exist_ok=True)
        shutil.copy(page, section / page.name)
    unit = tmp_path / "gpu-agent.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/gpu-agent", str(program)))
    return unit, {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "MANPATH": str(tmp_path / "man"), "LANG": "C.UTF-8"}


def test_systemd_analyze_verify_is_silent(verifiable_unit: tuple[Path, dict[str, str]]) -> None:
    unit, env = verifiable_unit
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, env=env)
    # Unknown or misspelled keys and bad values only warn on stderr, so stderr must be empty.
    assert proc.stderr == ""
    assert proc.returncode == 0


def test_systemd_analyze_verify_catches_a_broken_unit(verifiable_unit: tuple[Path, dict[str, str]]) -> None:
    """The check above can fail: a misspelled key and a missing program are reported."""
    unit, env = verifiable_unit
    unit.write_text(
        unit.read_text().replace("ProtectHome=yes", "ProtectHomes=yes").replace("ExecStart=", "ExecStart=/nonexistent ")
    )
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, env=env)
    assert "'ProtectHomes'" in proc.stderr
    assert "/nonexistent" in proc.stderr


def exposure(unit: Path) -> float:
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "SYSTEMD_COLORS": "0"},
    )
    found = re.search(r"Overall exposure level for gpu-agent\.service: (\d+\.\d)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    return float(found.group(1))


def test_security_exposure_at_most_3(tmp_path: Path) -> None:
    unit = tmp_path / "gpu-agent.service"
    shutil.copy(UNIT, unit)
    assert exposure(unit) <= MAX_EXPOSURE


def test_security_assessment_notices_a_weaker_unit(tmp_path: Path) -> None:
    unit = tmp_path / "gpu-agent.service"
    text = UNIT.read_text()
    unit.write_text(text.replace("ProtectSystem=strict", "ProtectSystem=no").replace("PrivateTmp=yes", "PrivateTmp=no"))
    assert exposure(unit) > MAX_EXPOSURE


def test_notify_watchdog_and_restart() -> None:
    assert value("Type") == "notify"
    assert value("NotifyAccess") == "main"
    assert value("ExecStart") == "/usr/bin/gpu-agent run --log-format journal"
    # The config is checked before the daemon is signalled (tests/test_package_e2e.py reloads both ways).
    assert values("ExecReload") == ["/usr/bin/gpu-agent check-config", "/bin/kill -HUP $MAINPID"]
    assert value("WatchdogSec") == "30"
    assert value("Restart") == "on-failure"
    assert value("RestartSec") == "5s"
    assert int(value("StartLimitBurst", "Unit")) >= 3
    assert int(value("StartLimitIntervalSec", "Unit")) >= 60
    assert value("WantedBy", "Install") == "multi-user.target"


def test_fans_restored_after_every_stop() -> None:
    # No "-" prefix: a failed restore marks the unit failed instead of passing silently.
    assert value("ExecStopPost") == "/usr/bin/gpu-agent restore"


def test_directories_match_the_agent_defaults() -> None:
    from agent.config import AgentConfig
    from agent.defaults import DEFAULT_CONFIG_PATH

    defaults = AgentConfig()
    assert defaults.api.socket == f"/run/{value('RuntimeDirectory')}/agent.sock"
    assert value("RuntimeDirectoryMode") == "0755"
    assert defaults.state_dir == f"/var/lib/{value('StateDirectory')}"
    assert Path(DEFAULT_CONFIG_PATH).parent == Path("/etc") / value("ConfigurationDirectory")
    # systemd mounts ConfigurationDirectory= writable: the agent must not rewrite its own config.
    assert value("ReadOnlyPaths") == str(Path(DEFAULT_CONFIG_PATH).parent)


def test_gpu_devices_reachable_without_private_devices() -> None:
    assert not values("PrivateDevices"), "PrivateDevices= hides /dev/nvidia*"
    assert value("DevicePolicy") == "closed"
    assert values("DeviceAllow") == ["char-nvidia* rw", "/dev/kmsg r"]


def test_capabilities_are_exactly_the_needed_ones() -> None:
    assert set(value("CapabilityBoundingSet").split()) == {"CAP_SYS_ADMIN", "CAP_SYSLOG", "CAP_CHOWN", "CAP_FOWNER"}
    assert value("AmbientCapabilities") == ""
    assert value("NoNewPrivileges") == "yes"
    assert value("User") == "root"


def test_writable_paths_are_the_policy_targets() -> None:
    assert value("ProtectSystem") == "strict"
    writable = [p for line in values("ReadWritePaths") for p in line.split()]
    assert writable == [
        "-/sys/kernel/mm/transparent_hugepage",
        "-/etc/modprobe.d",
        "-/etc/systemd/system",
        "-/var/cache",
    ]
    from agent.policy import nouveau, triton_cache

    assert Path(nouveau.CONF).parent == Path("/etc/modprobe.d")
    assert triton_cache.SYSTEMD_DIR == "/etc/systemd/system"


def test_sockets_and_system_calls() -> None:
    assert set(value("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert values("SystemCallFilter") == ["@system-service", "~@resources"]
    assert value("SystemCallArchitectures") == "native"
    for key in ("ProtectHome", "PrivateTmp", "ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups"):
        assert value(key) == "yes", key


def test_every_directive_is_explained() -> None:
    """Each directive (or a run of related ones) sits under a comment that says why."""
    lines = UNIT.read_text().splitlines()
    unexplained = []
    for index, line in enumerate(lines):
        if not line or line.startswith(("#", "[")):
            continue
        back = index - 1
        while back >= 0 and lines[back] and not lines[back].startswith(("#", "[")):
            back -= 1
        if back < 0 or not lines[back].startswith("#"):
            unexplained.append(line)
    # Description=, Documentation= and the [Install] target explain themselves.
    assert unexplained == [
        "Description=GPU node agent (policy, fault watchers, remediation, metrics)",
        "Documentation=man:gpu-agent(8) man:gpu-agent-config(5) man:gpu-agent-rules(5)",
        "WantedBy=multi-user.target",
    ]
