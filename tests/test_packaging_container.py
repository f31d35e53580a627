"""Package scripts where a container runs them: no systemd running (the scripts say they left the
service alone, RPM's as well as Debian's), and an environment whose pip settings are not the
package's business. tests/test_package_nosystemd.py installs the Debian 12 package into a root
without systemd for real."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_packaging import DEB_TARGETS, TARGETS, build_packages, install_env, python_for, run, run_script

pytestmark = pytest.mark.real_daemon

SKIPPED = {
    "start": "gpu-agent: systemd is not running: gpu-agent.service was not started; run 'gpu-agent run' by hand",
    "stop": "gpu-agent: systemd is not running: no service to stop (stop a 'gpu-agent run' started by hand)",
}
CASES = {
    # (script, arguments): which message it gives when no systemd runs
    ("deb/postinst", "configure"): "start",
    ("deb/postinst", "configure 0.1.0-1~bookworm"): "start",
    ("deb/prerm", "remove"): "stop",
    ("rpm/post", "1"): "start",
    ("rpm/post", "2"): "start",
    ("rpm/preun", "0"): "stop",
}


@pytest.mark.parametrize(("script", "arguments"), list(CASES))
@pytest.mark.parametrize("systemd", [False, True], ids=["no-systemd", "systemd"])
def test_scripts_say_when_they_leave_the_service_alone(
    tmp_path: Path, script: str, arguments: str, systemd: bool
) -> None:
    proc, recorded = run_script(tmp_path, script, arguments, systemd)
    assert proc.returncode == 0, proc.stderr
    message = SKIPPED[CASES[(script, arguments)]]
    assert (message in proc.stderr) is not systemd, proc.stderr
    if not systemd:
        # Nothing that needs a running systemd: at most the offline preset and disable of RPM.
        assert not [c for c in recorded if c.startswith("deb-systemd-invoke")], recorded
        assert all(c.startswith("systemctl --no-reload ") for c in recorded if c.startswith("systemctl")), recorded


@pytest.fixture
def host_package_root(tmp_path: Path) -> Path:
    """The .deb built for this host's /usr/bin/python3, unpacked under tmp_path."""
    target = next((n for n in DEB_TARGETS if python_for(TARGETS[n].python) == "/usr/bin/python3"), None)
    if target is None:
        pytest.skip("no deb target for /usr/bin/python3 (with venv and ensurepip)")
    run("dpkg-deb", "--extract", build_packages()[target], tmp_path)
    return tmp_path


def test_install_env_ignores_the_callers_pip_settings(
    host_package_root: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apt or dnf run from a shell (or an image build) whose pip settings send installs elsewhere:
    the environment is still built from the bundled wheels alone, where it belongs."""
    elsewhere = tmp_path_factory.mktemp("pip-settings")
    (elsewhere / "pip.conf").write_text(f"[global]\nfind-links = {elsewhere / 'more-links'}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(elsewhere / "pip.conf"))
    monkeypatch.setenv("PIP_TARGET", str(elsewhere / "target"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(elsewhere / "links"))
    built = install_env(host_package_root, "build")
    assert built.returncode == 0, built.stderr
    assert str(elsewhere) not in built.stderr, built.stderr  # no "Location ... is ignored" warnings
    assert not (elsewhere / "target").exists()
    venv = host_package_root / "opt/gpu-agent/venv"
    version = subprocess.run(
        [venv / "bin/python", "-I", "-m", "agent.cli", "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.startswith("gpu-agent "), version.stderr
