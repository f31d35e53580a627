"""Versions from the source (agent/version.py): a tag is a release, every other commit a higher
pre-release of the next version with the commit in it; the package spelling sorts the same way
in dpkg and rpm; a built wheel knows its version without git."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.version import BuildInfo, VersionError, current, debian_version, from_git

REPO = Path(__file__).resolve().parent.parent
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.org",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.org",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
    "PATH": os.environ["PATH"],
}


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=GIT_ENV, check=True)
    return proc.stdout.strip()


def commit(repo: Path, text: str) -> str:
    (repo / "file").write_text(text)
    git(repo, "add", "file")
    git(repo, "commit", "-q", "-m", text)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q", "-b", "main")
    return tmp_path


def test_an_untagged_history_counts_its_commits_towards_the_next_release(repo: Path) -> None:
    commit(repo, "one")
    second = commit(repo, "two")
    assert from_git(repo, "0.2.0") == BuildInfo(f"0.2.0.dev2+g{second[:7]}", second)
    third = commit(repo, "three")
    assert from_git(repo, "0.2.0").version == f"0.2.0.dev3+g{third[:7]}"


def test_a_tag_is_the_release_and_the_next_commit_a_pre_release_of_the_one_after(repo: Path) -> None:
    commit(repo, "one")
    tagged = commit(repo, "two")
    git(repo, "tag", "v0.2.0")
    git(repo, "tag", "not-a-release")
    assert from_git(repo, "0.2.0") == BuildInfo("0.2.0", tagged)
    after = commit(repo, "three")
    # NEXT_RELEASE not raised after the tag: the version still goes up.
    assert from_git(repo, "0.2.0").version == f"0.2.1.dev3+g{after[:7]}"
    assert from_git(repo, "0.3.0").version == f"0.3.0.dev3+g{after[:7]}"


def test_uncommitted_changes_are_marked(repo: Path) -> None:
    commit(repo, "one")
    git(repo, "tag", "v1.0.0")
    (repo / "file").write_text("changed")
    info = from_git(repo, "0.2.0")
    assert info.version.startswith("1.0.1.dev1+g") and info.version.endswith(".dirty"), info


def test_a_shallow_clone_is_refused(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    for text in ("one", "two", "three"):
        commit(repo, text)
    clone = tmp_path_factory.mktemp("shallow") / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(clone)], check=True, env=GIT_ENV)
    with pytest.raises(VersionError, match="shallow"):
        from_git(clone, "0.2.0")


VERSIONS_IN_ORDER = [
    "0.1.0",
    "0.2.0.dev12+g1a2b3c4",
    "0.2.0.dev12+g1a2b3c4.dirty",
    "0.2.0.dev13+g0fffff0",
    "0.2.0.dev100+g0000000",
    "0.2.0",
    "0.2.1.dev101+gabcdef0",
]


def test_pep440_order() -> None:
    packaging_version = pytest.importorskip("packaging.version")
    parsed = [packaging_version.Version(v) for v in VERSIONS_IN_ORDER]
    assert parsed == sorted(parsed)


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="needs dpkg")
@pytest.mark.parametrize("suffix", ["-1~bookworm", "-1~trixie", "-2~jammy"])
def test_dpkg_sorts_the_package_versions_like_pep440(suffix: str) -> None:
    for older, newer in itertools.pairwise(VERSIONS_IN_ORDER):
        a, b = debian_version(older) + suffix, debian_version(newer) + suffix
        assert subprocess.run(["dpkg", "--compare-versions", a, "lt", b]).returncode == 0, (a, b)
    # The legacy packages (0.1.0-N) are below every build of this scheme.
    assert (
        subprocess.run(["dpkg", "--compare-versions", "0.1.0-9~bookworm", "lt", "0.2.0~dev1+g0-1~bookworm"]).returncode
        == 0
    )


@pytest.mark.skipif(shutil.which("rpm") is None, reason="needs rpm")
def test_rpm_sorts_the_package_versions_like_pep440() -> None:
    pairs = [
        (f"{debian_version(a)}-1.el10", f"{debian_version(b)}-1.el10") for a, b in itertools.pairwise(VERSIONS_IN_ORDER)
    ]
    lua = "".join(f'print(rpm.vercmp("{a}", "{b}") .. " ") ' for a, b in pairs)
    proc = subprocess.run(["rpm", "--eval", f"%{{lua: {lua}}}"], capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["-1"] * len(pairs), list(zip(pairs, proc.stdout.split()))


def test_the_checkout_reports_its_own_commit() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    info = current()
    assert info.revision == git(REPO, "rev-parse", "HEAD")
    assert f"+g{info.revision[:7]}" in info.version or "+" not in info.version


def test_cli_version_names_version_and_revision() -> None:
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "--version"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    info = current()
    assert proc.stdout == f"gpu-agent {info.version}\nrevision {info.revision}\n"


def test_a_built_wheel_knows_its_version_without_git(tmp_path: Path) -> None:
    """pip wheel from the checkout, unpacked where no git and no checkout can be found."""
    out = tmp_path / "wheel"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("gpu_agent-*.whl")
    info = current()
    assert wheel.name == f"gpu_agent-{info.version}-py3-none-any.whl"
    site = tmp_path / "site"
    shutil.unpack_archive(wheel, site, "zip")
    code = "from agent.version import current; i = current(); print(i.version, i.revision)"
    env = {"PATH": "/nonexistent", "PYTHONPATH": str(site)}  # no git to run, no checkout on the path
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=site)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == [info.version, info.revision]
