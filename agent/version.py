"""gpu-agent's version and the commit it was built from, the same for the wheel, the packages,
`gpu-agent --version`, `gpu_agent_build_info{version,revision}` and `gpu-agent status`.

- A commit tagged `vX.Y.Z` (and a clean tree) is the release X.Y.Z.
- Any other commit is a pre-release of the next version: `NEXT.devN+gSHORT` (PEP 440), where N is
  the number of commits in its history (`git rev-list --count HEAD`: the same in every full clone,
  with or without tags, and higher for every later commit) and NEXT is the larger of
  NEXT_RELEASE and the newest reachable tag with its last number raised. Changes not committed
  add `.dirty`. The packages spell it `NEXT~devN+gSHORT` (`debian_version`), which dpkg and rpm
  sort below NEXT and above every earlier pre-release.

A built wheel carries the result in agent/_build_info.py (written by setup.py), so an installed
agent needs neither git nor its checkout. This module imports nothing of the agent: setup.py and
packaging/build.py load it by path.
"""

from __future__ import annotations

import functools
import importlib

TYPE_CHECKING = False  # typing itself is a tenth of `--version`'s start-up
if TYPE_CHECKING:
    from pathlib import Path

# The version the next release from this branch gets; raise it after tagging a release (a tag at
# or above it is handled without: the next commit counts from the tag's version).
NEXT_RELEASE = "0.2.0"
#: A release tag, `vX.Y.Z` (a pattern for re.fullmatch: `re` loads only where git is asked).
TAG = r"v(\d+)\.(\d+)\.(\d+)"
UNKNOWN_REVISION = "unknown"


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
    # agent/_build_info.py).
    import subprocess

    proc = subprocess.run(  # nosec B607
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False, timeout=30
    )
    if proc.returncode != 0:
        raise VersionError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout.strip()


def from_git(repo: Path, next_release: str = NEXT_RELEASE) -> BuildInfo:
    """The version of the checkout at `repo` (see the module's docstring). A shallow clone has no
    reliable commit count: VersionError (fetch the history: `git fetch --unshallow`)."""
    import re

    revision = _git(repo, "rev-parse", "--verify", "HEAD^{commit}")
    if _git(repo, "rev-parse", "--is-shallow-repository") == "true":
        raise VersionError(f"{repo} is a shallow clone: its commit count is not the history's")
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no") != ""
    here = sorted(
        (_numbers(t[1:]) for t in _git(repo, "tag", "--points-at", "HEAD").split() if re.fullmatch(TAG, t)),
        reverse=True,
    )
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


@functools.cache
def current() -> BuildInfo:
    """This agent's version: baked into the wheel it was installed from, else its git checkout's,
    else NEXT_RELEASE as dev0 of an unknown revision (a copy without its history)."""
    try:
        baked = importlib.import_module("agent._build_info")
    except ImportError:
        pass
    else:
        return BuildInfo(str(baked.VERSION), str(baked.REVISION))
    import subprocess
    from pathlib import Path

    checkout = Path(__file__).resolve().parent.parent
    if (checkout / ".git").exists():
        try:
            return from_git(checkout)
        except (VersionError, OSError, subprocess.TimeoutExpired):
            pass
    return BuildInfo(f"{NEXT_RELEASE}.dev0", UNKNOWN_REVISION)


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
