"""The RPM's scriptlets run for real, by rpm itself: upgrades from the package that installed the
rules in /etc/gpu-agent/rules.d as %config files (an admin's edit, deletion and own file), with a
config the new version rejects and then with the printed fix, back to the old package, and forward
again; after every step `check-config` lists exactly the rules the admin had.

No EL10 root can be had here (no network but PyPI and Debian's archive), so the root is the cached
Debian 12 root of the other e2e tests (tests/systemd_sandbox.py) with Debian's rpm in it, and the
packages are the EL10 recipe (packaging/nfpm.yaml, the same scriptlets) built for that root's
python3.11 (`Target("el10-cp311", ...)`: install-env refuses wheels of another ABI). rpm installs
with --nodeps (its database knows no python3) and --force-debian (Debian's rpm asks for it). No
systemd runs in the root: the restart's place is checked in tests/test_packaging.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from systemd_sandbox import cached_rootfs
from test_package_nosystemd import Chroot
from test_packaging import REPO, RULES

TOOLS = ("unshare", "chroot", "mount", "debootstrap")
_MISSING = [tool for tool in TOOLS if shutil.which(tool) is None]
pytestmark = [
    pytest.mark.real_daemon,
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (an overlay mount and chroot)"),
    pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} (scripts/install-test-deps)"),
]

LEGACY_COMMIT = "b8c3c15"  # the last commit whose packages installed the rules in /etc/gpu-agent/rules.d
PACKAGES_IN_ROOT = "/mnt/gpu-agent-rpms"
ADMIN_RULES = "/etc/gpu-agent/rules.d"
SHIPPED_RULES = "/usr/share/gpu-agent/rules.d"
RPM = ["rpm", "--nodeps", "--force-debian", "--nosignature"]
SITE_RULES = "rules: []\n"
# Valid for the old package, rejected by this one (power_limit_watts <= 10000 now).
REJECTED_CONFIG = """mode: observe
backend: nvml
policy:
  gpus:
    - match: {model: "*"}
      power_limit_watts: 20000
remediation:
  rules_dir: /etc/gpu-agent/rules.d
"""
GOOD_CONFIG = REJECTED_CONFIG.replace("20000", "600")
BUILD_RPM = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_agent_build_under_test", sys.argv[1])
build = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = build
spec.loader.exec_module(build)
target = build.Target("el10-cp311", "rpm", "3.11", ".el10", "/usr/lib/systemd/system", "el10", "EL10 recipe, cp311")
print(build.build([target], Path(sys.argv[2]), Path(sys.argv[3]), 1)[0])
"""


def build_rpm(source: Path, out: Path) -> Path:
    argv = [sys.executable, "-c", BUILD_RPM, str(source / "packaging/build.py"), str(out), str(out / "work")]
    built = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    return Path(built.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def rpms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The old layout's package (rebuilt from git) and this tree's, in one directory."""
    source = tmp_path_factory.mktemp("old-source")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", LEGACY_COMMIT], capture_output=True, check=False)
    if archive.returncode != 0:
        pytest.skip(f"commit {LEGACY_COMMIT} is not in this checkout's history")
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    out = tmp_path_factory.mktemp("rpms")
    return {"old": build_rpm(source, out / "old"), "new": build_rpm(REPO, out / "new")}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, rpms: dict[str, Path]) -> Iterator[Chroot]:
    directory = rpms["old"].parent.parent
    chroot = Chroot(cached_rootfs(), tmp_path_factory.mktemp("rpm-root"), [(directory, PACKAGES_IN_ROOT, True)])
    chroot.run(["apt-get", "update", "-q"], timeout=300)
    chroot.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "rpm", "python3-venv"], timeout=600)
    yield chroot


def in_root(package: Path, rpms: dict[str, Path]) -> str:
    return f"{PACKAGES_IN_ROOT}/{package.relative_to(rpms['old'].parent.parent)}"


def admin_rules(root: Chroot) -> dict[str, str]:
    """/etc/gpu-agent/rules.d's *.yaml: each file's text, each link's target as `-> TARGET`."""
    script = f'cd {ADMIN_RULES} && for f in *.yaml; do if [ -L "$f" ]; then echo "$f -> $(readlink "$f")"; else echo "$f $(sha256sum < "$f" | cut -c1-12)"; fi; done'
    return dict(line.split(" ", 1) for line in root.run(["sh", "-c", script]).stdout.splitlines())


def rules_line(checked: str) -> str:
    """The old check-config's summary of the rules: `N rules from DIR`."""
    return checked.strip().rsplit("; ", 1)[1]


def expected_listing() -> list[str]:
    lines = []
    for name in sorted([*RULES, "70-site.yaml"]):
        if name == "20-thermal.yaml":
            lines.append(f"{ADMIN_RULES}/{name} (overrides {SHIPPED_RULES}/{name})")
        elif name == "70-site.yaml":
            lines.append(f"{ADMIN_RULES}/{name}")
        elif name != "40-memory.yaml":
            lines.append(f"{SHIPPED_RULES}/{name}")
    return [*lines, f"{ADMIN_RULES}/40-memory.yaml: masked (disables {SHIPPED_RULES}/40-memory.yaml)"]


def listed_rules(root: Chroot) -> list[str]:
    checked = root.run(["gpu-agent", "check-config"]).stdout
    return [line.strip() for line in checked.splitlines()[1:]]


def test_rpm_upgrades_and_downgrades_keep_the_admins_rules(root: Chroot, rpms: dict[str, Path]) -> None:
    old, new = in_root(rpms["old"], rpms), in_root(rpms["new"], rpms)
    root.run([*RPM, "-i", old], timeout=600)
    assert sorted(admin_rules(root)) == [
        "10-xid.yaml",
        "20-thermal.yaml",
        "30-service.yaml",
        "40-memory.yaml",
        "50-gpu-state.yaml",
    ]
    # The admin: one rule tuned, one deleted, one file of their own, and a config this version rejects.
    root.run(["sh", "-c", f"echo '# tuned here' >> {ADMIN_RULES}/20-thermal.yaml && rm {ADMIN_RULES}/40-memory.yaml"])
    root.run(["sh", "-c", f"printf '{SITE_RULES}' > {ADMIN_RULES}/70-site.yaml"])
    root.run(["sh", "-c", f"cat > /etc/gpu-agent/agent.yaml <<'EOF'\n{REJECTED_CONFIG}EOF"])
    old_rules = admin_rules(root)
    old_checked = root.run(["gpu-agent", "check-config"]).stdout
    old_env = root.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip()

    # 1. Upgrade with a config the new version rejects: the old environment stays, and with it
    #    every rule the old daemon reads (rpm deleted the unchanged %config copies; %posttrans puts
    #    them back), the deleted one masked.
    upgrade = root.run([*RPM, "-U", new], timeout=600)
    output = upgrade.stdout + upgrade.stderr
    assert f"{ADMIN_RULES}/40-memory.yaml was deleted here: masked it" in output, output[-3000:]
    assert "gpu-agent keeps running the previous version" in output, output[-3000:]
    assert root.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip() == old_env
    assert admin_rules(root) == {**old_rules, "40-memory.yaml": "-> /dev/null"}
    assert root.run(["gpu-agent", "check-config"]).stdout == old_checked
    assert root.run(["sh", "-c", "ls -A /opt/gpu-agent | grep '^\\.'"], check=False).stdout == ""

    # 2. The config fixed, the printed fix (its systemctl aside: no systemd here) finishes the move.
    root.run(["sh", "-c", f"cat > /etc/gpu-agent/agent.yaml <<'EOF'\n{GOOD_CONFIG}EOF"])
    fix = output[output.index("Fix the config, then run ") :].split("then run ", 1)[1].splitlines()[0]
    steps = [step for step in fix.split(" && ") if not step.startswith("systemctl ")]
    assert len(steps) == 2 and steps[0].endswith("install-env upgrade"), fix
    for step in steps:
        root.run(["sh", "-c", step], timeout=600)
    assert root.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip() != old_env
    new_layout = {"20-thermal.yaml": old_rules["20-thermal.yaml"], "40-memory.yaml": "-> /dev/null"}
    assert admin_rules(root) == {**new_layout, "70-site.yaml": old_rules["70-site.yaml"]}
    assert listed_rules(root) == expected_listing()

    # 3. Back to the old package: its rules as the admin had them (the mask stands for the deletion:
    #    the old daemon skips a link to /dev/null).
    root.run([*RPM, "-U", "--oldpackage", old], timeout=600)
    assert admin_rules(root) == {**old_rules, "40-memory.yaml": "-> /dev/null"}
    assert rules_line(root.run(["gpu-agent", "check-config"]).stdout) == rules_line(old_checked)

    # 4. Forward again, with a config the new version accepts.
    root.run([*RPM, "-U", new], timeout=600)
    assert admin_rules(root) == {**new_layout, "70-site.yaml": old_rules["70-site.yaml"]}
    assert listed_rules(root) == expected_listing()
    assert root.run(["sh", "-c", "ls -d /opt/gpu-agent/env-*"]).stdout.count("\n") == 1
