"""gpu-agent's version and the commit it was built from, the same for the wheel, the packages,
`gpu-agent --version`, `gpu_agent_build_info{version,revision}` and `gpu-agent status`.

- A commit tagged `vX.Y.Z` (and a clean tree) is the release X.Y.Z.
- Any other commit is a pre-release of the next version: `NEXT.devN+gSHORT` (PEP 440), where N is
  the number of commits in its history (`git rev-list --count HEAD`: the same in every full clone,
  with or without tags, and higher for every later commit) and NEXT is the larger of
  NEXT_RELEASE and the newest reachable tag with its last number raised. Changes not committed
  add `.dirty`. The packages spell it `NEXT~devN+gSHORT` (`debian_version`), which dpkg and rpm
  sort below NEXT and above every earlier pre-release.

Where a source tree's version comes from (`from_tree`), first match wins:
1. `GPU_AGENT_VERSION` (and `GPU_AGENT_REVISION`, the commit): the builder names it;
2. git, only when the tree is its repository's top level: a tree unpacked inside another
   repository (a distribution's packaging repository, a monorepo) is not that repository;
3. `.git_archival.txt`, which `git archive` fills (export-subst, .gitattributes): the commit, its
   time and the refs that name it. An export has no history to count, so only a release (a tag
   `vX.Y.Z` on the exported commit) can be named from it; any other export is refused. An sdist's
   copy (setup.py writes it) names the version the sdist was made with.
Nothing else is guessed: without a source a build fails and says how to give one.

A built wheel carries the result in agent/_build_info.py (written by setup.py), so an installed
agent needs neither git nor its checkout. This module imports nothing of the agent: setup.py and
packaging/build.py load it by path.
"""

from __future__ import annotations

import functools
import importlib
import os

TYPE_CHECKING = False  # typing itself is a tenth of `--version`'s start-up
if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

# The version the next release from this branch gets; raise it after tagging a release (a tag at
# or above it is handled without: the next commit counts from the tag's version).
NEXT_RELEASE = "0.2.0"
#: A release tag, `vX.Y.Z` (a pattern for re.fullmatch: `re` loads only where git is asked).
TAG = r"v(\d+)\.(\d+)\.(\d+)"
UNKNOWN_REVISION = "unknown"
#: The builder's own version, for a tree with neither git nor a filled archival file.
VERSION_VARIABLE = "GPU_AGENT_VERSION"
REVISION_VARIABLE = "GPU_AGENT_REVISION"
#: What `git archive` fills in (export-subst): at the tree's top level, beside setup.py.
ARCHIVAL_FILE = ".git_archival.txt"
#: The versions this scheme makes (and a builder may name): X.Y.Z, X.Y.Z.devN, either with +LOCAL.
_VERSION_SHAPE = r"\d+\.\d+\.\d+(\.dev\d+)?(\+[a-z0-9]+(\.[a-z0-9]+)*)?"
HOW_TO_NAME_ONE = (
    f"build from a git clone with its history, export a release tag (git archive vX.Y.Z fills {ARCHIVAL_FILE}), "
    f"or name the version: {VERSION_VARIABLE}=X.Y.Z (and {REVISION_VARIABLE}=COMMIT)"
)


class VersionError(Exception):
    pass


class BuildInfo:
    """A version and its commit. A plain class: `gpu-agent --version` imports no more than it needs
    (dataclasses alone is a tenth of its start-up)."""

    __slots__ = ("revision", "version")

    def __init__(self, version: str, revision: str) -> None:
        self.version = version  # PEP 440
        self.revision = revision  # the full commit hash, or "unknown"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BuildInfo):
            return NotImplemented
        return (self.version, self.revision) == (other.version, other.revision)

    def __hash__(self) -> int:
        return hash((self.version, self.revision))

    def __repr__(self) -> str:
        return f"BuildInfo(version={self.version!r}, revision={self.revision!r})"

    @property
    def package_version(self) -> str:
        return debian_version(self.version)


def debian_version(version: str) -> str:
    """The Debian and RPM upstream version of a PEP 440 one: `.devN` becomes `~devN`, sorting
    below the release (`0.2.0~dev12+g1a2b3c4` < `0.2.0`)."""
    return version.replace(".dev", "~dev", 1)


def _numbers(version: str) -> tuple[int, int, int]:
    import re

    found = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", version)
    if found is None:
        raise VersionError(f"{version!r} is not X.Y.Z")
    major, minor, patch = (int(n) for n in found.groups())
    return major, minor, patch


def _git(repo: Path, *args: str) -> str:
    # git from PATH: only a developer's checkout or a build runs this (an installed agent reads
    # agent/_build_info.py). GIT_DIR and GIT_WORK_TREE would point it at another repository.
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}
    try:
        proc = subprocess.run(  # nosec B607
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False, timeout=30, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VersionError(f"git {' '.join(args)}: {exc}") from exc
    if proc.returncode != 0:
        raise VersionError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout.strip()


def _is_repository_top(tree: Path) -> bool:
    """Whether `tree` is a git repository's top level (or a worktree's): git is asked only then."""
    from pathlib import Path

    if not (tree / ".git").exists():
        return False
    return Path(_git(tree, "rev-parse", "--show-toplevel")).resolve() == tree.resolve()


def from_git(repo: Path, next_release: str = NEXT_RELEASE) -> BuildInfo:
    """The version of the checkout at `repo` (see the module's docstring). A shallow clone has no
    reliable commit count: VersionError (fetch the history: `git fetch --unshallow`); so has a
    directory that is not its repository's top level (the commits counted would be another tree's)."""
    import re

    if not _is_repository_top(repo):
        raise VersionError(f"{repo} is not the top level of a git repository")
    revision = _git(repo, "rev-parse", "--verify", "HEAD^{commit}")
    if _git(repo, "rev-parse", "--is-shallow-repository") == "true":
        raise VersionError(f"{repo} is a shallow clone: its commit count is not the history's")
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no") != ""
    here = _release_tags(_git(repo, "tag", "--points-at", "HEAD").split())
    if here and not dirty:
        return BuildInfo(".".join(str(n) for n in here[0]), revision)
    following = _numbers(next_release)
    reachable = [_numbers(t[1:]) for t in _git(repo, "tag", "--merged", "HEAD").split() if re.fullmatch(TAG, t)]
    if reachable:
        major, minor, patch = max(reachable)
        following = max(following, (major, minor, patch + 1))
    count = int(_git(repo, "rev-list", "--count", "HEAD"))
    local = f"g{revision[:7]}" + (".dirty" if dirty else "")
    return BuildInfo(f"{'.'.join(str(n) for n in following)}.dev{count}+{local}", revision)


def _release_tags(names: list[str]) -> list[tuple[int, int, int]]:
    """The release tags among `names`, highest first."""
    import re

    return sorted((_numbers(n[1:]) for n in names if re.fullmatch(TAG, n)), reverse=True)


def read_archival(tree: Path) -> dict[str, str] | None:
    """The fields of the tree's archival file when `git archive` filled it, else None (no file, or
    the checkout's own copy with its `$Format:...$` placeholders)."""
    try:
        text = (tree / ARCHIVAL_FILE).read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and not key.startswith("#"):
            fields[key.strip()] = value.strip()
    if "$Format:" in text or not fields.get("commit"):
        return None
    return fields


def from_archive(fields: Mapping[str, str]) -> BuildInfo:
    """The version of an export, from its archival file: the one it names (an sdist's), the release
    its tag names, else VersionError."""
    revision = fields["commit"]
    if fields.get("version"):
        return BuildInfo(fields["version"], revision)
    refs = [ref.strip() for ref in fields.get("refs", "").split(",")]
    tags = _release_tags([ref.removeprefix("tag: ") for ref in refs if ref.startswith("tag: ")])
    if not tags:
        raise VersionError(
            f"an export of commit {revision[:12]}, which no release tag names: a pre-release version counts "
            "the commits of its history, which an export does not have"
        )
    return BuildInfo(".".join(str(n) for n in tags[0]), revision)


def archival_text(info: BuildInfo, when: int | None) -> str:
    """The archival file of an sdist: what `git archive` would fill, and the version itself."""
    return f"commit: {info.revision}\ncommit-time: {when if when is not None else ''}\nversion: {info.version}\n"


def _named(environ: Mapping[str, str], revision: str) -> BuildInfo:
    import re

    version = environ[VERSION_VARIABLE].strip()
    if not re.fullmatch(_VERSION_SHAPE, version):
        raise VersionError(f"{VERSION_VARIABLE}={version!r}: expected X.Y.Z or X.Y.Z.devN, either with +LOCAL")
    return BuildInfo(version, environ.get(REVISION_VARIABLE, "").strip() or revision)


def from_tree(tree: Path, next_release: str = NEXT_RELEASE, environ: Mapping[str, str] | None = None) -> BuildInfo:
    """The version of the source tree at `tree` (see the module's docstring for the order), or
    VersionError saying why there is none and how to give one."""
    environ = os.environ if environ is None else environ
    archival = read_archival(tree)
    try:
        top = _is_repository_top(tree)
        if environ.get(VERSION_VARIABLE, "").strip():
            commit = _git(tree, "rev-parse", "--verify", "HEAD^{commit}") if top else None
            return _named(environ, commit or (archival or {}).get("commit") or UNKNOWN_REVISION)
        if top:
            return from_git(tree, next_release)
        if archival is not None:
            return from_archive(archival)
    except VersionError as exc:
        raise VersionError(f"no version for {tree}: {exc}; {HOW_TO_NAME_ONE}") from exc
    raise VersionError(
        f"no version for {tree}: not a git repository's top level, and no {ARCHIVAL_FILE} filled by git archive; "
        + HOW_TO_NAME_ONE
    )


def commit_time(tree: Path) -> int | None:
    """The Unix time of the tree's commit (git at its top level, else its archival file), or None:
    a build's SOURCE_DATE_EPOCH."""
    if _is_repository_top(tree):
        return int(_git(tree, "log", "-1", "--format=%ct"))
    archival = read_archival(tree)
    if archival is not None and archival.get("commit-time", "").isdigit():
        return int(archival["commit-time"])
    return None


@functools.cache
def current() -> BuildInfo:
    """This agent's version: baked into the wheel it was installed from, else its source tree's
    (`from_tree`), else NEXT_RELEASE as dev0 of an unknown revision (a copy that names none)."""
    try:
        baked = importlib.import_module("agent._build_info")
    except ImportError:
        pass
    else:
        return BuildInfo(str(baked.VERSION), str(baked.REVISION))
    from pathlib import Path

    try:
        return from_tree(Path(__file__).resolve().parent.parent)
    except VersionError:
        return BuildInfo(f"{NEXT_RELEASE}.dev0", UNKNOWN_REVISION)


def package_notice(daemon_version: str | None) -> str | None:
    """What `status` and `check-config` say when the code that runs is not the installed package's,
    else None (also outside a package). The package (packaging/build.py, install-env) keeps its
    version in `wheels/VERSION` beside the environment this agent runs from (`venv`, a link to
    `env-VERSION.XXXXXX`): an upgrade whose new version rejected the config left the link on the
    previous environment; a daemon not restarted since an upgrade runs another version."""
    import sys

    # os.path, not pathlib: `status` against a daemon imports no more than it needs.
    venv = sys.prefix  # /opt/gpu-agent/venv, as the wrapper runs it
    prefix = os.path.dirname(venv)
    install_env = os.path.join(prefix, "lib", "install-env")
    try:
        with open(os.path.join(prefix, "wheels", "VERSION"), encoding="utf-8") as file:
            package = file.read().strip()
    except OSError:
        return None
    if not package or not os.path.isfile(install_env):
        return None
    environment = os.path.realpath(venv)
    if os.path.basename(environment) != f"env-{package}" and not os.path.basename(environment).startswith(
        f"env-{package}."
    ):
        return (
            f"this gpu-agent ({current().package_version}, {environment}) is not the installed package's "
            f"({package}): the upgrade kept the previous environment, as it does when the new version rejects the "
            f"config (`journalctl -t gpu-agent` says why); fix the config, then run {install_env} upgrade && "
            f"systemctl restart gpu-agent && {install_env} prune"
        )
    if daemon_version is not None and debian_version(daemon_version) != package.rsplit("-", 1)[0]:
        return (
            f"the running daemon is gpu-agent {debian_version(daemon_version)}, not the installed package's "
            f"{package}: `systemctl restart gpu-agent` runs the installed one"
        )
    return None


def version_text() -> str:
    """What `gpu-agent --version` prints."""
    info = current()
    return f"gpu-agent {info.version}\nrevision {info.revision}\n"


def build_info_module(info: BuildInfo) -> str:
    """The text of agent/_build_info.py in a built wheel."""
    return (
        '"""Written by setup.py when the wheel was built (agent/version.py)."""\n\n'
        f"VERSION = {info.version!r}\nREVISION = {info.revision!r}\n"
    )
