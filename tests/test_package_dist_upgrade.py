"""A Debian 12 -> 13 dist-upgrade keeps the agent: with the gpu-agent repository's suite switched
along with Debian's (bookworm -> trixie), apt upgrades the Debian 12 package to the Debian 13 one
(`~trixie` sorts above `~bookworm`) instead of removing it for its `python3 (<< 3.12)`, and the
new package builds its environment on python3.13. The upgraded root is then a Debian 13 build
host: its lintian and rpmlint find every package clean, as they must for `scripts/test` to pass
there (a newer linter judges more: tests/test_packaging.py says how each finding is handled).

The root is the cached Debian 12 root of the other e2e tests (tests/systemd_sandbox.py) through an
overlay, entered with chroot (tests/test_package_nosystemd.py's Chroot: no systemd runs, so the
scripts leave the service alone); Debian's archive provides both releases, and a local apt
repository (a directory with a Packages file per suite, written here) the two gpu-agent packages
that scripts/build-packages made.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from systemd_sandbox import DEFAULT_MIRROR, cached_rootfs
from test_package_nosystemd import Chroot
from test_packaging import (
    BUILD_OUT,
    DEB_TARGETS,
    PKG_VERSION,
    REPO,
    VERSION,
    build_packages,
    lintian_findings,
    rpmlint_output,
)

TOOLS = ("unshare", "chroot", "mount", "debootstrap", "dpkg-deb")
_MISSING = [tool for tool in TOOLS if shutil.which(tool) is None]
pytestmark = [
    pytest.mark.real_daemon,
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (an overlay mount and chroot)"),
    pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} (scripts/install-test-deps)"),
]

REPO_IN_ROOT = "/mnt/gpu-agent-repo"
PACKAGES_IN_ROOT = "/mnt/gpu-agent-packages"  # BUILD_OUT/release-1, every target's package
PACKAGING_IN_ROOT = "/mnt/gpu-agent-packaging"  # packaging/, for rpmlint's configuration
MIRROR = os.environ.get("GPU_AGENT_DEBIAN_MIRROR", DEFAULT_MIRROR)


def packages_index(deb: Path, filename: str) -> str:
    """The deb's Packages stanza (what apt-ftparchive writes), from its control file."""
    control = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout
    data = deb.read_bytes()
    extra = f"Filename: {filename}\nSize: {len(data)}\nSHA256: {hashlib.sha256(data).hexdigest()}\n"
    return control.rstrip("\n") + "\n" + extra + "\n"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A flat apt repository per suite: bookworm/ with the Debian 12 package, trixie/ with the 13."""
    built = build_packages()
    directory = tmp_path_factory.mktemp("apt-repo")
    for suite, target in (("bookworm", "debian12"), ("trixie", "debian13")):
        (directory / suite).mkdir()
        shutil.copy(built[target], directory / suite / built[target].name)
        index = packages_index(built[target], f"./{built[target].name}")
        (directory / suite / "Packages").write_text(index)
    return directory


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, repository: Path) -> Iterator[Chroot]:
    binds = [
        (repository, REPO_IN_ROOT, True),
        (BUILD_OUT / "release-1", PACKAGES_IN_ROOT, True),
        (REPO / "packaging", PACKAGING_IN_ROOT, True),
    ]
    yield Chroot(cached_rootfs(), tmp_path_factory.mktemp("dist-upgrade-root"), binds)


def sources(root: Chroot, suite: str) -> None:
    text = f"deb {MIRROR} {suite} main\ndeb [trusted=yes allow-insecure=yes] file:{REPO_IN_ROOT}/{suite} ./\n"
    root.run(["sh", "-c", f"rm -f /etc/apt/sources.list.d/*; printf '{text}' > /etc/apt/sources.list"])
    root.run(["apt-get", "update", "-q"], timeout=600)


def test_dist_upgrade_from_bookworm_to_trixie_keeps_the_agent(root: Chroot) -> None:
    sources(root, "bookworm")
    root.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "gpu-agent"], timeout=900)
    assert root.run(["dpkg-query", "-W", "-f", "${Version}", "gpu-agent"]).stdout == f"{PKG_VERSION}-1~bookworm"
    assert root.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip().endswith("-1~bookworm")

    sources(root, "trixie")
    env = ["env", "DEBIAN_FRONTEND=noninteractive"]
    options = ["-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold"]
    upgrade = root.run([*env, "apt-get", "full-upgrade", "-y", "-q", *options], check=False, timeout=1800)
    output = upgrade.stdout + upgrade.stderr
    assert upgrade.returncode == 0, output[-4000:]
    assert "Removing gpu-agent" not in output, output[-4000:]
    assert root.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", "gpu-agent"]).stdout == (
        f"install ok installed {PKG_VERSION}-1~trixie"
    )
    python = root.run(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()
    assert python == "3.13"
    venv = root.run(["readlink", "/opt/gpu-agent/venv"]).stdout.strip()
    assert venv == f"/opt/gpu-agent/env-{PKG_VERSION}-1~trixie"
    # Only the new environment is left, and the agent runs from it on python 3.13.
    assert root.run(["sh", "-c", "ls -d /opt/gpu-agent/env-*"]).stdout.split() == [venv]
    assert root.run(["gpu-agent", "--version"]).stdout.splitlines()[0] == f"gpu-agent {VERSION}"
    assert root.run(["sh", "-c", f"ls -d {venv}/lib/python3.13/site-packages/agent"]).returncode == 0
    assert "ok (observe mode, nvml backend" in root.run(["gpu-agent", "check-config"]).stdout


def test_debian_13s_linters_find_every_package_clean(root: Chroot) -> None:
    """Debian 13's lintian and rpmlint, in the root the test above upgraded, on every package:
    what `scripts/test` runs on a Debian 13 build host (tests/test_packaging.py, with this host's)."""
    assert root.run(["sh", "-c", ". /etc/os-release && echo $VERSION_CODENAME"]).stdout.strip() == "trixie"
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "lintian", "rpmlint", "rpm"]
    root.run(["env", "DEBIAN_FRONTEND=noninteractive", *install], timeout=900)
    built = build_packages()

    def inside(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return root.run(argv, check=False, timeout=600)

    debs = {t: f"{PACKAGES_IN_ROOT}/{built[t].name}" for t in DEB_TARGETS}
    assert lintian_findings(debs, inside) == []
    rpm = f"{PACKAGES_IN_ROOT}/{built['el10'].name}"
    assert rpmlint_output(rpm, f"{PACKAGING_IN_ROOT}/rpm/rpmlint.toml", inside) == ""
    # The linters are Debian 13's, which judge what Debian 12's did not.
    assert inside(["lintian-explain-tags", "aliased-location"]).returncode == 0
