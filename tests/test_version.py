"""Versions from the source (agent/version.py): a tag is a release, every other commit a higher
pre-release of the next version with the commit in it; the package spelling sorts the same way
in dpkg and rpm; a built wheel knows its version without git."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from agent.version import BuildInfo, VersionError, current, debian_version, from_git, from_tree, package_notice

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


# -- trees that are no checkout: an export, a tarball, an sdist ------------------------------------


def export(repo: Path, ref: str, into: Path) -> Path:
    """`git archive REF` of `repo` unpacked into `into`: what a tarball of it holds."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref], capture_output=True, check=True, env=GIT_ENV)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def export_release(repo: Path, version: str, into: Path) -> Path:
    """A release tarball of `repo`'s HEAD, unpacked: HEAD tagged vVERSION (the tag gone after)."""
    git(repo, "tag", f"v{version}")
    try:
        return export(repo, f"v{version}", into)
    finally:
        git(repo, "tag", "-d", f"v{version}")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This project's tree (its committed files, the working tree's changes included) as the one
    commit of a repository of its own: tagged or exported by the tests as they need."""
    repo = tmp_path_factory.mktemp("project")
    files = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in (f.decode() for f in files if f):
        source = REPO / name
        if source.is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, repo / name)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "the project")
    return repo


def tree_build(tree: Path) -> ModuleType:
    """packaging/build.py of `tree`, loaded as its own module (it takes the version of its own tree)."""
    spec = importlib.util.spec_from_file_location(f"build_of_{tree.name}", tree / "packaging" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def no_version_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GPU_AGENT_VERSION", "GPU_AGENT_REVISION", "SOURCE_DATE_EPOCH"):
        monkeypatch.delenv(name, raising=False)


def test_an_export_inside_another_repository_is_not_that_repository(
    project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A distribution's packaging repository (or a monorepo) holding an export of an untagged
    commit: the build refuses and says how to name the version, instead of counting the commits
    of the repository around it."""
    outer = tmp_path / "packaging-repo"
    outer.mkdir()
    git(outer, "init", "-q", "-b", "main")
    outer_head = commit(outer, "the distribution's packaging")
    tree = export(project, "HEAD", outer / "upstream")
    with pytest.raises(VersionError) as refused:
        from_tree(tree, environ={})
    assert "no release tag names" in str(refused.value) and "GPU_AGENT_VERSION=X.Y.Z" in str(refused.value)
    # What a builder runs: refused before anything is built.
    assert tree_build(tree).main(["--target", "debian12", "--out", str(tmp_path / "out")]) == 1
    said = capsys.readouterr().err
    assert said.startswith(f"build-packages: no version for {tree}: ") and "GPU_AGENT_VERSION=X.Y.Z" in said, said
    assert outer_head[:7] not in said and not (tmp_path / "out").exists()
    with pytest.raises(VersionError, match="not the top level"):
        from_git(tree)
    # Named by the builder: that version, of the commit the archival file names.
    named = from_tree(tree, environ={"GPU_AGENT_VERSION": "0.2.0"})
    assert named == BuildInfo("0.2.0", git(project, "rev-parse", "HEAD"))
    with pytest.raises(VersionError, match=r"expected X\.Y\.Z"):
        from_tree(tree, environ={"GPU_AGENT_VERSION": "0.2"})


def test_a_tarball_of_a_release_tag_names_the_release(project: Path, tmp_path: Path) -> None:
    tree = export_release(project, "7.8.9", tmp_path / "gpu-agent-7.8.9")
    head = git(project, "rev-parse", "HEAD")
    assert from_tree(tree, environ={}) == BuildInfo("7.8.9", head)
    build = tree_build(tree)
    # The version and commit a clone of the tag gives, and the commit's time as SOURCE_DATE_EPOCH.
    assert (build.project_version(), build.project_info().revision) == ("7.8.9", head)
    assert build.source_date_epoch() == int(git(project, "log", "-1", "--format=%ct"))


def test_a_tarball_without_the_archival_file_needs_the_version_named(project: Path, tmp_path: Path) -> None:
    tree = export(project, "HEAD", tmp_path / "tree")
    (tree / ".git_archival.txt").unlink()
    with pytest.raises(VersionError, match=r"no \.git_archival\.txt filled by git archive"):
        from_tree(tree, environ={})
    # The checkout's own copy, its placeholders unfilled, names nothing either.
    shutil.copy(REPO / ".git_archival.txt", tree / ".git_archival.txt")
    with pytest.raises(VersionError, match=r"GPU_AGENT_VERSION=X\.Y\.Z"):
        from_tree(tree, environ={})
    named = {"GPU_AGENT_VERSION": "1.0.0.dev3+gabcdef0", "GPU_AGENT_REVISION": "abcdef0123"}
    assert from_tree(tree, environ=named) == BuildInfo("1.0.0.dev3+gabcdef0", "abcdef0123")


def pip_wheel(tree: Path, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "GPU_AGENT_VERSION"} | env
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(out), str(tree)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=environ)


def test_pip_wheel_of_an_export_names_the_release_or_fails(project: Path, tmp_path: Path) -> None:
    release = export_release(project, "7.8.9", tmp_path / "release")
    built = pip_wheel(release, tmp_path / "wheels")
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    assert wheel.name == "gpu_agent-7.8.9-py3-none-any.whl"
    shutil.unpack_archive(wheel, tmp_path / "site", "zip")
    info = (tmp_path / "site/agent/_build_info.py").read_text()
    assert f"VERSION = '7.8.9'\nREVISION = '{git(project, 'rev-parse', 'HEAD')}'" in info
    # An untagged export: refused with the way out, not built as 0.2.0.dev0 of an unknown commit.
    snapshot = export(project, "HEAD", tmp_path / "snapshot")
    refused = pip_wheel(snapshot, tmp_path / "refused")
    assert refused.returncode != 0
    assert "GPU_AGENT_VERSION=X.Y.Z" in refused.stdout + refused.stderr, refused.stderr[-3000:]
    assert not (tmp_path / "refused").exists() or not list((tmp_path / "refused").iterdir())


def test_a_wheel_built_from_an_sdist_keeps_the_checkouts_version(project: Path, tmp_path: Path) -> None:
    """`python -m build` makes the sdist first and the wheel from it: the sdist is no checkout, and
    its archival file names the version it was made with."""
    out, backend = tmp_path / "sdist", tmp_path / "backend"
    # The build backend pyproject.toml asks for, as pip's build isolation installs it.
    requires = re.search(r"^requires = \[\"(.+?)\"\]", (REPO / "pyproject.toml").read_text(), re.M)
    assert requires is not None
    argv = [sys.executable, "-m", "pip", "install", "-q", "--target", str(backend), requires.group(1)]
    subprocess.run(argv, check=True, capture_output=True, timeout=300)
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    env = {**os.environ, "PYTHONPATH": str(backend)}
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=project, env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    info = from_git(project)
    built = pip_wheel(out / made.stdout.strip().splitlines()[-1], tmp_path / "wheels")
    assert built.returncode == 0, built.stderr[-3000:]
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == [f"gpu_agent-{info.version}-py3-none-any.whl"]


# -- the code that runs against the installed package -------------------------------------------------

PACKAGED = "0.2.0~dev9+gabcdef0-2~bookworm"


@pytest.fixture
def package_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """/opt/gpu-agent as the package lays it out, with this process running from its `venv` link."""
    prefix = tmp_path / "opt/gpu-agent"
    (prefix / "wheels").mkdir(parents=True)
    (prefix / "lib").mkdir()
    (prefix / "lib/install-env").write_text("#!/bin/sh\n")
    (prefix / "wheels/VERSION").write_text(PACKAGED + "\n")
    monkeypatch.setattr(sys, "prefix", str(prefix / "venv"))
    return prefix


def run_from(prefix: Path, environment: str) -> None:
    (prefix / environment).mkdir()
    (prefix / "venv").unlink(missing_ok=True)
    (prefix / "venv").symlink_to(environment)


def test_no_notice_where_the_package_environment_runs(package_layout: Path) -> None:
    run_from(package_layout, f"env-{PACKAGED}.Ab12Cd")
    assert package_notice(None) is None
    assert package_notice("0.2.0.dev9+gabcdef0") is None
    (package_layout / "wheels/VERSION").unlink()  # no package: a checkout, pip install
    assert package_notice("0.1.0") is None


def test_a_daemon_not_restarted_since_the_upgrade_is_named(package_layout: Path) -> None:
    run_from(package_layout, f"env-{PACKAGED}.Ab12Cd")
    notice = package_notice("0.1.0")
    assert notice is not None
    assert notice.startswith(f"the running daemon is gpu-agent 0.1.0, not the installed package's {PACKAGED}")
    assert "systemctl restart gpu-agent" in notice


def test_an_environment_the_upgrade_did_not_switch_to_is_named(package_layout: Path) -> None:
    """The upgrade's new version rejected the config: the link stays on the previous environment,
    and `check-config` run from it would say ok."""
    run_from(package_layout, "env-0.2.0~dev8+g1234567-1~bookworm.Zz99Yy")
    notice = package_notice(None)
    assert notice is not None
    assert f"is not the installed package's ({PACKAGED}): the upgrade kept the previous environment" in notice
    install_env = package_layout / "lib/install-env"
    assert f"run {install_env} upgrade && systemctl restart gpu-agent && {install_env} prune" in notice


def test_check_config_and_status_give_the_notice(
    package_layout: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.api_server import ApiServer
    from agent.cli import main

    run_from(package_layout, f"env-{PACKAGED}.Ab12Cd")
    socket_path = tmp_path / "agent.sock"
    (tmp_path / "rules.d").mkdir()
    config = tmp_path / "agent.yaml"
    config.write_text(f"api: {{socket: {socket_path}}}\nremediation: {{rules_dirs: [{tmp_path / 'rules.d'}]}}\n")
    document = {"verdict": {"exit_code": 0}, "version": "0.1.0", "source": "daemon"}
    server = ApiServer(socket_path, {"status": lambda params: document})
    server.start()
    try:
        assert main(["check-config", "--config", str(config)]) == 0
        assert f"warning: the running daemon is gpu-agent 0.1.0, not the installed package's {PACKAGED}" in (
            capsys.readouterr().err
        )
        assert main(["check-config", "--strict", "--config", str(config)]) == 1
        capsys.readouterr()
        assert main(["status", "--json", "--config", str(config)]) == 0
        said = capsys.readouterr()
        assert json.loads(said.out)["version"] == "0.1.0"
        assert "warning: the running daemon is gpu-agent 0.1.0" in said.err
    finally:
        server.close()


def test_a_module_an_earlier_build_left_in_build_lib_is_not_in_the_wheel(project: Path, tmp_path: Path) -> None:
    """A module an earlier build of another commit left in the tree's build/lib, and since deleted,
    must not ship again (two builds of one commit would differ): each build has a directory of its own."""
    release = export_release(project, "7.8.9", tmp_path / "release")
    stale = release / "build" / "lib" / "agent" / "rules" / "actions" / "deleted_since.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("LEFT = 'by an earlier build'\n")
    built = pip_wheel(release, tmp_path / "wheels")
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "agent/rules/actions/dispatch.py" in names
    assert "agent/rules/actions/deleted_since.py" not in names


def test_two_builds_of_one_tree_at_once_both_make_their_wheel(project: Path, tmp_path: Path) -> None:
    """A package build and a test's wheel of the same checkout at the same time (two test workers):
    sharing the tree's build/ broke one of them ("File exists: build/bdist.../wheel/...dist-info")."""
    release = export_release(project, "7.8.9", tmp_path / "release")
    environ = {k: v for k, v in os.environ.items() if k != "GPU_AGENT_VERSION"}
    builds = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--wheel-dir",
                str(tmp_path / f"w{n}"),
                str(release),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environ,
        )
        for n in range(3)
    ]
    outputs = [build.communicate(timeout=600)[0] for build in builds]
    assert [build.returncode for build in builds] == [0, 0, 0], outputs
    assert [len(list((tmp_path / f"w{n}").glob("gpu_agent-7.8.9-*.whl"))) for n in range(3)] == [1, 1, 1]
    assert not (release / "build").exists()  # nothing left in the tree to ship with a later build
