"""The .deb and .rpm packages built by scripts/build-packages: contents, metadata, scriptlets,
lint, an RPM installed into an empty root, and the install-time environment built from a
package's wheels. tests/test_package_e2e.py installs the Debian 12 one in a real systemd."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from pydantic import BaseModel
from systemd_sandbox import lock_or_wait

pytestmark = pytest.mark.real_daemon

REPO = Path(__file__).resolve().parent.parent
BUILD_OUT = REPO / "build" / "test-packages"


def _load_build() -> ModuleType:
    # packaging/ is not a Python package (the name belongs to PyPI's `packaging`): load the file.
    spec = importlib.util.spec_from_file_location("gpu_agent_package_build", REPO / "packaging" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build = _load_build()
TARGETS = build.TARGETS
VERSION: str = build.project_version()  # PEP 440: the wheel's, `gpu-agent --version`
PKG_VERSION: str = build.package_version()  # the .deb and .rpm upstream version
DEB_TARGETS = sorted(name for name, t in TARGETS.items() if t.packager == "deb")
RULES = sorted(p.name for p in (REPO / "rules").glob("*.yaml"))


@functools.cache
def build_packages(release: int = 1, targets: tuple[str, ...] | None = None) -> dict[str, Path]:
    """Build (once per test session) the packages of `targets` (default: all) into build/.

    The session's workers (scripts/test runs two) share build/packages and build/test-packages:
    one builds at a time, and a package this run already built is taken as it is, never built
    again under a worker that may be installing it."""
    names = tuple(targets) if targets else tuple(TARGETS)
    out = BUILD_OUT / f"release-{release}"
    built = {name: out / TARGETS[name].filename(PKG_VERSION, release) for name in names}
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid-{os.getpid()}"
    done = out / ".built-in-this-run"  # this run's id, then the targets it built
    BUILD_OUT.mkdir(parents=True, exist_ok=True)
    with open(BUILD_OUT / ".lock", "a+b") as lock:
        lock_or_wait(lock, "the package build", timeout_seconds=1800)
        recorded = done.read_text().split() if done.is_file() else []
        already = set(recorded[1:]) if recorded[:1] == [run] else set()
        missing = [name for name in names if name not in already or not built[name].is_file()]
        if missing:
            argv = [sys.executable, str(REPO / "packaging" / "build.py"), "--out", str(out), "--release", str(release)]
            for name in missing:
                argv += ["--target", name]
            # Reproducible by default: the build takes the last commit's time, not one given by hand.
            env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            # The version is the checkout's when the build ran: a commit made since this module was
            # imported (VERSION above) would name other files.
            assert all(built[name].is_file() for name in missing), f"not built: {built} ({proc.stdout[-2000:]})"
            done.write_text(" ".join([run, *sorted(already | set(missing))]) + "\n")
    return built


@pytest.fixture(scope="module")
def packages() -> dict[str, Path]:
    return build_packages()


def run(*argv: str | Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"{argv}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def needs(*tools: str) -> pytest.MarkDecorator:
    missing = [t for t in tools if shutil.which(t) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (apt-get install lintian rpmlint rpm)")


def stage(target: str) -> Path:
    """What build.py generated for the target's release 1 (build_packages's default)."""
    return REPO / "build" / "packages" / "stage" / f"{target}-1"


def wheel_names(target: str) -> list[str]:
    return sorted(p.name for p in (stage(target) / "wheels").iterdir())


def expected_files(target: str) -> set[str]:
    """Every regular file a package carries, by absolute path."""
    t = TARGETS[target]
    files = {
        "/usr/bin/gpu-agent",
        "/opt/gpu-agent/lib/install-env",
        f"{t.unit_dir}/gpu-agent.service",
        "/etc/gpu-agent/agent.yaml",
        "/usr/share/man/man8/gpu-agent.8.gz",
        "/usr/share/man/man5/gpu-agent-config.5.gz",
        "/usr/share/man/man5/gpu-agent-rules.5.gz",
        "/usr/share/doc/gpu-agent/bench/README.md",
        *(f"/usr/share/doc/gpu-agent/docs/{p.name}" for p in (REPO / "docs").glob("*.md")),
        "/usr/share/doc/gpu-agent/README.md",
        "/usr/share/gpu-agent/grafana/gpu-agent-dashboard.json",
        "/usr/share/gpu-agent/prometheus/gpu-agent-alerts.yaml",
        "/opt/gpu-agent/lib/legacy-rules.sha256",
        *(f"/opt/gpu-agent/lib/legacy-rules/{p.name}" for p in (REPO / "packaging/legacy-rules").glob("*.yaml")),
        "/usr/share/bash-completion/completions/gpu-agent",
        "/usr/share/gpu-agent/prometheus/gpu-agent-dcgm-compat.yaml",
        "/usr/share/gpu-agent/prometheus/gpu-agent-recording.yaml",
        "/usr/share/gpu-agent/alertmanager/gpu-agent-alertmanager.yaml",
    }
    files |= {f"/usr/share/gpu-agent/rules.d/{name}" for name in RULES}
    files |= {f"/opt/gpu-agent/wheels/{name}" for name in wheel_names(target)}
    if t.packager == "deb":
        files |= {
            "/usr/share/doc/gpu-agent/copyright",
            "/usr/share/doc/gpu-agent/changelog.Debian.gz",
            "/usr/share/doc/gpu-agent/NEWS.Debian.gz",
            "/usr/share/lintian/overrides/gpu-agent",
            "/usr/share/zsh/vendor-completions/_gpu-agent",
        }
    else:
        files |= {
            "/usr/share/licenses/gpu-agent/copyright",
            "/usr/share/licenses/gpu-agent/Apache-2.0",
            "/usr/share/zsh/site-functions/_gpu-agent",
        }
    return files


def _clone_of_this_tree(directory: Path) -> Path:
    """A fresh clone of HEAD with the working tree's uncommitted changes applied: the same
    commit, the same version (agent/version.py), in another directory."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(directory)], check=True)
    diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--binary"], capture_output=True, check=True)
    if diff.stdout:
        subprocess.run(["git", "-C", str(directory), "apply", "-"], input=diff.stdout, check=True)
    return directory


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (a host name of its own)"
)
def test_two_builds_are_identical_across_host_name_umask_directory_and_time(
    packages: dict[str, Path], tmp_path: Path
) -> None:
    """The session's packages, built in this checkout, and a clone of this tree built later in
    another directory, under another umask, host name (a UTS namespace) and time zone: the same
    bytes. (The session's build is one of the two: a third build would only cost CI a minute.)"""
    current_umask = os.umask(0o022)
    os.umask(current_umask)
    umask = "027" if current_umask != 0o027 else "022"
    host, zone = "another-host.example.org", "Asia/Tokyo"
    assert socket.gethostname() != host and os.environ.get("TZ") != zone
    clone = _clone_of_this_tree(tmp_path / "elsewhere" / "checkout")
    out = tmp_path / "out"
    build_argv = [sys.executable, "packaging/build.py", "--out", str(out), "--target", "debian12", "--target", "el10"]
    script = f"umask {umask} && hostname {host} && cd {clone} && exec {shlex.join(build_argv)}"
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    proc = subprocess.run(
        ["unshare", "--uts", "sh", "-c", script], capture_output=True, text=True, env={**env, "TZ": zone}, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".deb", ".rpm")}
    here = {packages[target].name: packages[target].read_bytes() for target in ("debian12", "el10")}
    assert elsewhere.keys() == here.keys()
    for name in here:
        assert elsewhere[name] == here[name], name
    if shutil.which("rpm"):
        assert run("rpm", "-qp", "--queryformat", "%{BUILDHOST}", packages["el10"]) == "reproducible"


# -- .deb ----------------------------------------------------------------------------------------


@needs("dpkg-deb")
@pytest.mark.parametrize("target", DEB_TARGETS)
def test_deb_contents(packages: dict[str, Path], target: str) -> None:
    listing = run("dpkg-deb", "--contents", packages[target])
    files = {}
    for line in listing.splitlines():
        mode, owner, _size, _date, _time, path = line.split(maxsplit=5)
        assert owner == "root/root", line
        if not mode.startswith("d"):
            files[path.removeprefix(".")] = mode
    assert set(files) == expected_files(target)
    assert files["/usr/bin/gpu-agent"] == "-rwxr-xr-x"
    assert files["/opt/gpu-agent/lib/install-env"] == "-rwxr-xr-x"
    assert {m for p, m in files.items() if p not in ("/usr/bin/gpu-agent", "/opt/gpu-agent/lib/install-env")} == {
        "-rw-r--r--"
    }
    abi = TARGETS[target].abi
    compiled = [n for n in wheel_names(target) if re.search(r"-cp3\d+-cp3\d+-", n)]
    assert compiled and all(f"-{abi}-{abi}-" in n for n in compiled), compiled


@needs("dpkg-deb")
@pytest.mark.parametrize("target", DEB_TARGETS)
def test_deb_control(packages: dict[str, Path], target: str) -> None:
    t = TARGETS[target]
    fields = run("dpkg-deb", "--field", packages[target])
    control = dict(re.findall(r"^([\w-]+): (.*)$", fields, re.MULTILINE))
    assert control["Package"] == "gpu-agent"
    assert control["Version"] == f"{PKG_VERSION}-{t.release(1)}"
    assert control["Architecture"] == "amd64"
    assert control["Section"] == "admin"
    depends = [d.strip() for d in control["Depends"].split(",")]
    assert depends == [
        f"python3 (>= {t.python}~)",
        f"python3 (<< {t.python_next})",
        "python3-venv",
        "libudev1",
        "init-system-helpers (>= 1.54~)",
        "procps",
    ]
    # Without systemd (containers, gVisor) the package configures and the agent runs by hand.
    assert [d.strip() for d in control["Recommends"].split(",")] == ["systemd", "python3-systemd"]
    assert control["Homepage"] == build.DEFAULT_HOMEPAGE
    # The agent runs (and says "no driver") without NVIDIA's packages: never a dependency.
    assert "nvidia" not in fields.lower().split("description:")[0]


@needs("dpkg-deb")
def test_deb_conffiles_and_scripts(packages: dict[str, Path], tmp_path: Path) -> None:
    run("dpkg-deb", "--control", packages["debian12"], tmp_path)
    conffiles = (tmp_path / "conffiles").read_text().split()
    # Only agent.yaml: an upgrade replaces the shipped rules (/usr/share) and never prompts.
    assert conffiles == ["/etc/gpu-agent/agent.yaml"]
    for script in ("preinst", "postinst", "prerm", "postrm"):
        assert (tmp_path / script).read_bytes() == (REPO / "packaging" / "deb" / script).read_bytes()
        assert os.access(tmp_path / script, os.X_OK)


@needs("dpkg-deb")
def test_deb_ships_the_repository_files(packages: dict[str, Path], tmp_path: Path) -> None:
    run("dpkg-deb", "--extract", packages["ubuntu24.04"], tmp_path)
    same = {
        "usr/lib/systemd/system/gpu-agent.service": "systemd/gpu-agent.service",
        "etc/gpu-agent/agent.yaml": "packaging/agent.yaml",
        "usr/bin/gpu-agent": "packaging/gpu-agent",
        "opt/gpu-agent/lib/install-env": "packaging/install-env",
        "usr/share/gpu-agent/grafana/gpu-agent-dashboard.json": "packaging/grafana/gpu-agent-dashboard.json",
        "usr/share/gpu-agent/prometheus/gpu-agent-alerts.yaml": "packaging/prometheus/gpu-agent-alerts.yaml",
        "opt/gpu-agent/lib/legacy-rules.sha256": "packaging/legacy-rules.sha256",
        "usr/share/gpu-agent/prometheus/gpu-agent-dcgm-compat.yaml": "packaging/prometheus/gpu-agent-dcgm-compat.yaml",
        "usr/share/gpu-agent/prometheus/gpu-agent-recording.yaml": "packaging/prometheus/gpu-agent-recording.yaml",
        "usr/share/gpu-agent/alertmanager/gpu-agent-alertmanager.yaml": "packaging/alertmanager/gpu-agent-alertmanager.yaml",
        **{f"usr/share/gpu-agent/rules.d/{n}": f"rules/{n}" for n in RULES},
    }
    for installed, source in same.items():
        assert (tmp_path / installed).read_bytes() == (REPO / source).read_bytes(), installed
    man = gzip.decompress((tmp_path / "usr/share/man/man8/gpu-agent.8.gz").read_bytes())
    assert man == (REPO / "packaging" / "gpu-agent.8").read_bytes()
    wheels = tmp_path / "opt/gpu-agent/wheels"
    assert (wheels / "ABI").read_text() == "cp312\n"
    assert (wheels / "VERSION").read_text() == f"{PKG_VERSION}-1~noble\n"
    lock = (wheels / "requirements.txt").read_text().splitlines()[1:]
    locked = sorted(line.split("==")[0] for line in lock)
    assert locked == sorted(build.Wheel.parse(p).project for p in wheels.glob("*.whl"))
    assert all(re.search(r" --hash=sha256:[0-9a-f]{64}$", line) for line in lock)


#: Tags a newer lintian than the targets' own raises on what those targets do as their
#: distribution wants. aliased-location (Debian 13's lintian): the Ubuntu 22.04 and Debian 12
#: packages keep the unit in /lib/systemd/system, where those releases' debhelper puts units;
#: moving it to /usr/lib on a system where /lib links to /usr/lib would let dpkg delete it on an
#: upgrade from a package that had it in /lib (the file loss DEP 17 describes). An override in
#: the package cannot say so: Debian 12's lintian refuses an override of a tag it does not know.
SPLIT_USR_TAGS = ("aliased-location",)


Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def on_this_host(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True)


def lintian_findings(debs: dict[str, str], runner: Runner = on_this_host) -> list[str]:
    """What the lintian `runner` reaches says of the .deb packages (target name -> path as the
    runner sees it), each judged by its own target's rules: SPLIT_USR_TAGS only where the unit is
    in /lib. Empty when clean (and the package's one override in use: a stale one is reported)."""
    split_usr = [t for t in debs if TARGETS[t].unit_dir == "/lib/systemd/system"]
    known = [tag for tag in SPLIT_USR_TAGS if runner(["lintian-explain-tags", tag]).returncode == 0]
    findings = []
    for group, suppressed in ((split_usr, known), ([t for t in debs if t not in split_usr], [])):
        argv = ["lintian", "--no-cfg", "--pedantic", "--display-experimental", "--show-overrides"]
        argv += ["--suppress-tags", ",".join(suppressed)] if suppressed else []
        proc = runner([*argv, *(debs[t] for t in group)])
        findings += [line for line in proc.stdout.splitlines() if re.match(r"[EWIPXC]: ", line)]
        overridden = {line.split()[2] for line in proc.stdout.splitlines() if line.startswith("O: ")}
        if overridden != {"dir-or-file-in-opt"}:
            findings.append(f"overrides used: {sorted(overridden)}")
        # (Its exit status is 2 whenever --show-overrides shows one, so stderr tells a failed run.)
        errors = proc.stderr.replace("running with root privileges is not recommended!\n", "")
        findings += [f"stderr: {line}" for line in errors.splitlines()]
    return findings


def rpmlint_output(rpm: str, config: str, runner: Runner = on_this_host) -> str:
    """rpmlint's report on the RPM with the package's configuration; '' when clean."""
    proc = runner(["rpmlint", "-c", config, rpm])
    return "" if proc.returncode == 0 and "0 errors, 0 warnings" in proc.stdout else proc.stdout + proc.stderr


@needs("lintian")
def test_lintian_clean(packages: dict[str, Path]) -> None:
    """Clean by this host's lintian (Debian 12's here; tests/test_package_dist_upgrade.py runs
    Debian 13's)."""
    assert [t for t in DEB_TARGETS if TARGETS[t].unit_dir == "/lib/systemd/system"] == ["debian12", "ubuntu22.04"]
    assert lintian_findings({t: str(packages[t]) for t in DEB_TARGETS}) == []


def test_deb_copyright_is_dep5_and_covers_every_wheel(packages: dict[str, Path]) -> None:
    text = (stage("debian12") / "copyright").read_text()
    paragraphs = [dict(re.findall(r"^([\w-]+): (.*)$", p, re.MULTILINE)) for p in text.split("\n\n")]
    assert paragraphs[0]["Format"].startswith("https://www.debian.org/doc/packaging-manuals/copyright-format/1.0")
    covered = {p["Files"].rsplit("/", 1)[-1]: p["License"] for p in paragraphs if "Files" in p}
    assert covered.pop("*") == "Apache-2.0"
    bundled = {n for n in wheel_names("debian12") if n.endswith(".whl") and not n.startswith("gpu_agent-")}
    assert set(covered) == bundled
    assert covered[next(n for n in bundled if n.startswith("pyudev-"))] == "LGPL-2.1-or-later"
    assert "/usr/share/common-licenses/LGPL-2.1" in text


# -- .rpm ----------------------------------------------------------------------------------------


def rpm_query(package: Path, *args: str) -> str:
    return run("rpm", "-qp", "--nosignature", *args, package)


@needs("rpm")
def test_rpm_metadata_and_requires(packages: dict[str, Path]) -> None:
    rpm = packages["el10"]
    header = rpm_query(rpm, "--queryformat", "%{NAME} %{VERSION} %{RELEASE} %{ARCH}\n%{LICENSE}")
    first, license_tag = header.split("\n", 1)
    assert first == f"gpu-agent {PKG_VERSION} 1.el10 x86_64"
    assert license_tag.startswith("Apache-2.0 AND ")
    assert "LGPL-2.1-or-later" in license_tag and "(MIT OR Apache-2.0)" in license_tag
    requires = {line.strip() for line in rpm_query(rpm, "--requires").splitlines()}
    assert {"python3", "python(abi) = 3.12", "libudev.so.1()(64bit)", "util-linux"} <= requires
    assert not {"systemd", "python3-systemd"} & requires
    assert not any("nvidia" in r.lower() for r in requires)
    assert set(rpm_query(rpm, "--recommends").split()) == {"systemd", "python3-systemd"}
    # What each scriptlet runs, required around it (as rpmbuild declares a scriptlet's interpreter);
    # %pre runs shell built-ins alone.
    by_scriptlet: dict[str, set[str]] = {}
    for line in rpm_query(rpm, "--queryformat", "[%{REQUIREFLAGS:deptype} %{REQUIRENAME}\n]").splitlines():
        kind, name = line.split(" ", 1)
        by_scriptlet.setdefault(kind, set()).add(name)
    assert by_scriptlet["pre"] == {"/bin/sh"}
    assert by_scriptlet["post"] == {"/bin/sh", "python3", "coreutils", "grep", "util-linux"}
    assert by_scriptlet["preun"] == {"/bin/sh", "coreutils"}
    assert by_scriptlet["postun"] == {"/bin/sh"}
    assert by_scriptlet["posttrans"] == {"/bin/sh", "coreutils", "grep"}
    assert {"python3", "util-linux"} <= by_scriptlet["manual"]  # still required at run time
    # The header was rewritten to declare them: every digest rpm checks still holds.
    checked = run("rpm", "-Kv", "--nosignature", rpm)
    assert checked.count(": OK") == 4 and "Header SHA256 digest: OK" in checked, checked
    assert rpm_query(rpm, "--queryformat", "%{URL}") == build.DEFAULT_HOMEPAGE
    flags: dict[str, str] = {}
    for line in rpm_query(rpm, "--queryformat", "[%{FILEFLAGS:fflags} %{FILENAMES}\n]").splitlines():
        flag, path = line.split(" ", 1)
        flags[path] = flag
    config = sorted(path for path, flag in flags.items() if "c" in flag)
    assert config == ["/etc/gpu-agent/agent.yaml"]
    assert all("n" in flags[path] for path in config), "config files must be %config(noreplace)"
    assert "l" in flags["/usr/share/licenses/gpu-agent/Apache-2.0"]
    assert "d" in flags["/usr/share/man/man8/gpu-agent.8.gz"]


@needs("rpm")
def test_rpm_contents_and_scriptlets(packages: dict[str, Path]) -> None:
    rpm = packages["el10"]
    query = "[%{FILEMODES:perms} %{FILEUSERNAME}:%{FILEGROUPNAME} %{FILEFLAGS:fflags}. %{FILENAMES}\n]"
    listing = rpm_query(rpm, "--queryformat", query)
    files, ghosts = {}, set()
    for line in listing.splitlines():
        mode, owner, flags, path = line.split(" ", 3)
        assert owner == "root:root", line
        if "g" in flags:
            ghosts.add(path)
        elif not mode.startswith("d"):
            files[path] = mode
    assert set(files) == expected_files("el10")
    assert ghosts == set()
    assert files["/usr/bin/gpu-agent"] == "-rwxr-xr-x"
    dirs = {line.split(" ", 3)[3] for line in listing.splitlines() if line.startswith("d")}
    assert {
        "/opt/gpu-agent",
        f"/opt/gpu-agent/env-{PKG_VERSION}-1.el10",  # install-env builds the environment there
        "/opt/gpu-agent/wheels",
        "/etc/gpu-agent",
        "/etc/gpu-agent/rules.d",
        "/usr/share/gpu-agent/rules.d",
        "/usr/share/doc/gpu-agent",
        "/usr/share/licenses/gpu-agent",
    } <= dirs
    scripts = rpm_query(rpm, "--scripts")
    scriptlets = (
        ("preinstall", "pre"),
        ("postinstall", "post"),
        ("preuninstall", "preun"),
        ("postuninstall", "postun"),
        ("posttrans", "posttrans"),
    )
    for name, source in scriptlets:
        body = re.search(rf"^{name} scriptlet \(using /bin/sh\):\n(.*?)(?=^\w+ scriptlet|\Z)", scripts, re.M | re.S)
        assert body, f"no {name} scriptlet"
        assert body.group(1).strip() == (REPO / "packaging" / "rpm" / source).read_text().strip()


@needs("rpmlint")
def test_rpmlint_clean(packages: dict[str, Path]) -> None:
    assert rpmlint_output(str(packages["el10"]), str(REPO / "packaging" / "rpm" / "rpmlint.toml")) == ""


@needs("rpm")
def test_rpm_installs_its_layout_into_an_empty_root(packages: dict[str, Path], tmp_path: Path) -> None:
    """`rpm --root` into an empty directory, then verify and erase.

    --noscripts: the scriptlets run /bin/sh, python3 and systemctl inside the root, and an empty
    root has none of them. What they run is install-env (exercised below and in the Debian e2e
    test, which runs the same script) and systemctl; their text is checked above.
    --nodeps: the root has no python3 or systemd packages to satisfy the requirements.
    """
    root = tmp_path / "root"
    root.mkdir()
    rpm = packages["el10"]
    run("rpm", "--root", root, "--nodeps", "--noscripts", "--nosignature", "-i", rpm)
    for path in expected_files("el10"):
        assert (root / path.lstrip("/")).is_file(), path
    assert os.access(root / "usr/bin/gpu-agent", os.X_OK)
    assert (root / "usr/lib/systemd/system/gpu-agent.service").read_bytes() == (
        REPO / "systemd" / "gpu-agent.service"
    ).read_bytes()
    assert run("rpm", "--root", root, "-q", "gpu-agent").strip() == f"gpu-agent-{PKG_VERSION}-1.el10.x86_64"
    # Every file as packaged: digests, modes, owners.
    assert run("rpm", "--root", root, "-V", "--nodeps", "gpu-agent") == ""
    # The environment install-env builds (here by hand: --noscripts) is the package's directory.
    environment = f"opt/gpu-agent/env-{PKG_VERSION}-1.el10"
    (root / environment / "bin").mkdir()
    (root / "opt/gpu-agent/venv").symlink_to(Path(environment).name)
    owner = run("rpm", "--root", root, "-qf", f"/{environment}").strip()
    assert owner == f"gpu-agent-{PKG_VERSION}-1.el10.x86_64"
    assert run("rpm", "--root", root, "-V", "--nodeps", "gpu-agent") == ""
    run("rm", "-r", root / environment / "bin", root / "opt/gpu-agent/venv")  # install-env remove, in %preun
    run("rpm", "--root", root, "--nodeps", "--noscripts", "-e", "gpu-agent")
    for path in ("opt/gpu-agent", "etc/gpu-agent", "usr/bin/gpu-agent", "usr/share/gpu-agent"):
        assert not (root / path).exists(), path


# -- the environment built at install time -----------------------------------------------------------


def python_for(version: str) -> str | None:
    """A CPython `version` interpreter with venv and ensurepip: the system one, or another on
    PATH or in pyenv's versions (this machine kind has several there)."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    candidates = ["/usr/bin/python3", shutil.which(f"python{version}")]
    candidates += sorted(str(p) for p in pyenv.glob(f"{version}.*/bin/python{version}"))
    for candidate in candidates:
        if candidate is None or not Path(candidate).exists():
            continue
        proc = subprocess.run(
            [candidate, "-c", "import ensurepip, venv, sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if proc.returncode == 0 and proc.stdout.strip() == version:
            return candidate
    return None


@pytest.fixture
def extracted(packages: dict[str, Path], tmp_path: Path) -> Path:
    """The package for this host's /usr/bin/python3 (Debian 12: cp311), unpacked under tmp_path."""
    target = next((n for n in DEB_TARGETS if python_for(TARGETS[n].python) == "/usr/bin/python3"), None)
    if target is None:
        pytest.skip("no deb target for /usr/bin/python3 (with venv and ensurepip)")
    run("dpkg-deb", "--extract", packages[target], tmp_path)
    return tmp_path


def relocate_config(root: Path) -> Path:
    """The extracted package's agent.yaml with its rules directories under `root`, the override
    directory made: check-config holds every configured rules directory to existing (only the
    default /etc/gpu-agent/rules.d may be absent, and under `root` it is no longer the default)."""
    config = root / "etc/gpu-agent/agent.yaml"
    text = config.read_text()
    if str(root) not in text:
        for rules in ("/usr/share/gpu-agent/rules.d", "/etc/gpu-agent/rules.d"):
            text = text.replace(rules, f"{root}{rules}")
        config.write_text(text)
    (root / "etc/gpu-agent/rules.d").mkdir(parents=True, exist_ok=True)
    return config


def install_env(root: Path, action: str, python: str = "/usr/bin/python3") -> subprocess.CompletedProcess[str]:
    """Run the package's install-env under `root` (`action`: its arguments, split at spaces)."""
    if (root / "etc/gpu-agent/agent.yaml").exists():
        relocate_config(root)
    env = {
        **os.environ,
        "GPU_AGENT_PREFIX": str(root / "opt/gpu-agent"),
        "GPU_AGENT_PYTHON": python,
        "GPU_AGENT_CONFIG": str(root / "etc/gpu-agent/agent.yaml"),
        "GPU_AGENT_RULES_DIR": str(root / "etc/gpu-agent/rules.d"),
    }
    return subprocess.run(
        [root / "opt/gpu-agent/lib/install-env", *action.split()], capture_output=True, text=True, env=env, timeout=300
    )


@needs("dpkg-deb")
@pytest.mark.parametrize("target", DEB_TARGETS)
def test_bundled_wheels_run_on_the_target_python(packages: dict[str, Path], tmp_path: Path, target: str) -> None:
    """Each package's wheel set is complete and importable on its distribution's Python version
    (Ubuntu 22.04: 3.10, Ubuntu 24.04 and EL10: 3.12, Debian 12: 3.11, Debian 13: 3.13), wherever this machine has
    that interpreter."""
    python = python_for(TARGETS[target].python)
    if python is None:
        pytest.skip(f"no Python {TARGETS[target].python} with venv on this machine")
    run("dpkg-deb", "--extract", packages[target], tmp_path)
    built = install_env(tmp_path, "build", python)
    assert built.returncode == 0, built.stderr
    venv = tmp_path / "opt/gpu-agent/venv"
    modules = ("agent.cli", "pydantic_core", "yaml", "psutil", "pynvml", "pyudev", "prometheus_client", "structlog")
    code = f"import importlib; print('\\n'.join(importlib.import_module(m).__file__ for m in {modules!r}))"
    files = run(venv / "bin/python", "-I", "-c", code).splitlines()
    # All from the bundled wheels, none from the interpreter's own site-packages.
    assert all(f.startswith(f"{venv}/lib/python{TARGETS[target].python}/site-packages/") for f in files), files
    config = relocate_config(tmp_path)
    checked = run(venv / "bin/python", "-I", "-m", "agent.cli", "check-config", "--config", config, "--strict")
    shipped = sum(len(yaml.safe_load((REPO / "rules" / name).read_text())["rules"]) for name in RULES)
    assert (
        f"observe mode, nvml backend, 0 GPU profiles, 0 services); {shipped} rules from {len(RULES)} files" in checked
    )


def envs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "opt/gpu-agent").glob("env-*"))


@needs("dpkg-deb")
def test_install_env_builds_upgrades_and_removes(extracted: Path) -> None:
    prefix = extracted / "opt/gpu-agent"
    first = install_env(extracted, "build")
    assert first.returncode == 0, first.stderr
    link = prefix / "venv"
    assert link.is_symlink() and envs(extracted) == [Path(os.readlink(link)).name]
    python = link / "bin" / "python"
    version = run(python, "-I", "-m", "agent.cli", "--version")
    assert version.splitlines()[0] == f"gpu-agent {VERSION}"

    # A second build (an upgrade) switches the link; prune drops the old environment.
    old = os.readlink(link)
    assert install_env(extracted, "build").returncode == 0
    assert os.readlink(link) != old and len(envs(extracted)) == 2
    assert install_env(extracted, "prune").returncode == 0
    assert envs(extracted) == [Path(os.readlink(link)).name]

    assert install_env(extracted, "remove").returncode == 0
    assert not link.exists() and not link.is_symlink() and envs(extracted) == []


@needs("dpkg-deb")
def test_install_env_refuses_a_tampered_wheel_and_keeps_the_current_one(extracted: Path) -> None:
    assert install_env(extracted, "build").returncode == 0
    link = extracted / "opt/gpu-agent/venv"
    current = os.readlink(link)
    wheel = next((extracted / "opt/gpu-agent/wheels").glob("structlog-*.whl"))
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    proc = install_env(extracted, "build")
    assert proc.returncode != 0
    assert "hash" in proc.stderr.lower(), proc.stderr
    assert os.readlink(link) == current
    assert envs(extracted) == [Path(current).name]  # the failed attempt cleaned up after itself


@needs("dpkg-deb")
def test_install_env_refuses_wheels_for_another_python(extracted: Path) -> None:
    (extracted / "opt/gpu-agent/wheels/ABI").write_text("cp39\n")
    proc = install_env(extracted, "build")
    assert proc.returncode != 0
    assert "the bundled wheels are for cp39" in proc.stderr
    assert envs(extracted) == []


@needs("dpkg-deb")
def test_install_env_keeps_the_current_environment_when_the_new_version_rejects_the_config(extracted: Path) -> None:
    assert install_env(extracted, "build").returncode == 0
    link = extracted / "opt/gpu-agent/venv"
    current = os.readlink(link)
    config = extracted / "etc/gpu-agent/agent.yaml"
    text = config.read_text()
    line = text[: text.index("mode: observe")].count("\n") + 1
    config.write_text(text.replace("mode: observe", "mode: obsrve", 1))
    upgrade = install_env(extracted, "build")
    assert upgrade.returncode == 3
    assert f"{config}:{line} mode: must be" in upgrade.stderr
    assert "the current environment stays" in upgrade.stderr
    assert os.readlink(link) == current and envs(extracted) == [Path(current).name]
    # A first install has nothing to keep: the new environment, but still exit 3 (do not start it).
    assert install_env(extracted, "remove").returncode == 0
    first = install_env(extracted, "build")
    assert first.returncode == 3 and link.is_symlink()


def test_install_env_migrate_rules_drops_unchanged_old_defaults_and_keeps_changed_ones(tmp_path: Path) -> None:
    _, admin = legacy_layout(tmp_path)
    # What the earlier package installed as conffiles (rules/ at b8c3c15), not today's defaults.
    legacy = REPO / "packaging/legacy-rules"
    for old in legacy.glob("*.yaml"):
        shutil.copy(old, admin / old.name)
    (admin / "20-thermal.yaml").write_text((legacy / "20-thermal.yaml").read_text() + "# tuned here\n")
    (admin / "60-site.yaml").write_text("rules: []\n")
    proc = install_env(tmp_path, "migrate-rules")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in admin.iterdir()) == ["20-thermal.yaml", "60-site.yaml"]
    assert f"kept {admin / '20-thermal.yaml'} (changed here)" in proc.stderr


def legacy_layout(tmp_path: Path) -> tuple[Path, Path]:
    """install-env and the legacy rules under tmp_path/opt/gpu-agent, an empty tmp_path/etc/gpu-agent/rules.d."""
    prefix, admin = tmp_path / "opt/gpu-agent", tmp_path / "etc/gpu-agent/rules.d"
    (prefix / "lib").mkdir(parents=True)
    shutil.copy(REPO / "packaging/install-env", prefix / "lib/install-env")
    shutil.copy(REPO / "packaging/legacy-rules.sha256", prefix / "lib/legacy-rules.sha256")
    shutil.copytree(REPO / "packaging/legacy-rules", prefix / "lib/legacy-rules")
    admin.mkdir(parents=True)
    return prefix, admin


def rules_dir(admin: Path) -> dict[str, str]:
    return {p.name: f"-> {os.readlink(p)}" if p.is_symlink() else p.read_text() for p in admin.iterdir()}


def test_install_env_restore_legacy_rules_undoes_the_migration(tmp_path: Path) -> None:
    """Forward (migrate-rules) and back (restore-legacy-rules): the old layout's directory again,
    the admin's change, addition and mask as they were."""
    _, admin = legacy_layout(tmp_path)
    legacy = REPO / "packaging/legacy-rules"
    for old in legacy.glob("*.yaml"):
        shutil.copy(old, admin / old.name)
    (admin / "20-thermal.yaml").write_text((legacy / "20-thermal.yaml").read_text() + "# tuned here\n")
    (admin / "40-memory.yaml").unlink()
    (admin / "40-memory.yaml").symlink_to("/dev/null")  # what preinst makes of a deleted one
    (admin / "60-site.yaml").write_text("rules: []\n")
    before = rules_dir(admin)
    assert install_env(tmp_path, "migrate-rules").returncode == 0
    assert sorted(p.name for p in admin.iterdir()) == ["20-thermal.yaml", "40-memory.yaml", "60-site.yaml"]
    proc = install_env(tmp_path, "restore-legacy-rules")
    assert proc.returncode == 0, proc.stderr
    assert rules_dir(admin) == before
    assert all(oct((admin / name).stat().st_mode & 0o777) == "0o644" for name in ("10-xid.yaml", "30-service.yaml"))


def test_a_dpkg_downgrade_parks_the_masks_and_gets_them_back(tmp_path: Path) -> None:
    """dpkg cannot unpack the old package's conffile over a mask: prerm parks it (the rule it
    masks never had a copy here: a host that never had the old layout), postrm puts it back after
    the unpack and drops the copy dpkg unpacked beside it; a downgrade that fails in between gets
    its masks back from postinst abort-upgrade (install-env unpark-masks)."""
    _, admin = legacy_layout(tmp_path)
    (admin / "40-memory.yaml").symlink_to("/dev/null")
    (admin / "60-site.yaml").symlink_to("/dev/null")  # the admin's own name: not the package's business
    parked = install_env(tmp_path, "restore-legacy-rules --park-masks")
    assert parked.returncode == 0, parked.stderr
    assert f"{admin / '40-memory.yaml'} masks a rule the older package ships: kept" in parked.stderr
    assert os.readlink(admin / "40-memory.yaml.gpu-agent-mask") == "/dev/null"
    assert not (admin / "40-memory.yaml").is_symlink() and os.readlink(admin / "60-site.yaml") == "/dev/null"
    assert (admin / "10-xid.yaml").is_file()  # the unchanged copies, as before
    # dpkg unpacks the old package: its conffile beside the parked mask.
    (admin / "40-memory.yaml.dpkg-new").write_text((REPO / "packaging/legacy-rules/40-memory.yaml").read_text())
    proc, _ = run_script(tmp_path / "postrm", "deb/postrm", "upgrade 0.1.0-2~bookworm", True, rules=admin)
    assert proc.returncode == 0, proc.stderr
    assert os.readlink(admin / "40-memory.yaml") == "/dev/null"
    assert not list(admin.glob("*.dpkg-new")) and not list(admin.glob("*.gpu-agent-mask"))
    # A failed downgrade: postinst abort-upgrade puts a parked mask back.
    assert install_env(tmp_path, "restore-legacy-rules --park-masks").returncode == 0
    assert install_env(tmp_path, "unpark-masks").returncode == 0
    assert os.readlink(admin / "40-memory.yaml") == "/dev/null" and not list(admin.glob("*.gpu-agent-mask"))


def test_migrate_rules_drops_the_copies_a_downgrade_left_beside_a_mask(tmp_path: Path) -> None:
    _, admin = legacy_layout(tmp_path)
    shipped = (REPO / "packaging/legacy-rules/40-memory.yaml").read_text()
    (admin / "40-memory.yaml").symlink_to("/dev/null")
    (admin / "40-memory.yaml.rpmnew").write_text(shipped)  # rpm's, installing the old package
    (admin / "30-service.yaml").symlink_to("/dev/null")
    (admin / "30-service.yaml.dpkg-new").write_text("changed by someone\n")
    proc = install_env(tmp_path, "migrate-rules")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in admin.iterdir()) == ["30-service.yaml", "30-service.yaml.dpkg-new", "40-memory.yaml"]
    assert f"left {admin / '30-service.yaml.dpkg-new'} (not a copy this package shipped)" in proc.stderr


def test_wrapper_points_at_install_env_when_the_environment_is_missing(tmp_path: Path) -> None:
    if Path("/opt/gpu-agent").exists():
        pytest.skip("gpu-agent is installed on this machine")
    proc = subprocess.run([REPO / "packaging" / "gpu-agent", "--version"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "/opt/gpu-agent/lib/install-env" in proc.stderr


# -- maintainer scripts and scriptlets, with stand-ins for the commands they run ----------------------

#: What deb/postinst configure runs first, with or without systemd, first install or upgrade.
DEB_CONFIGURED = [
    "install-env unpark-masks",
    "install-env build",
    "install-env migrate-rules",
    "deb-systemd-helper --quiet was-enabled gpu-agent.service",
    "deb-systemd-helper enable gpu-agent.service",
]
SCRIPT_CASES = {
    # (script, arguments, systemd running): the commands it runs, in order
    # As %systemd_post: the preset decides whether it is enabled; nothing starts it.
    ("rpm/post", "1", True): [
        "install-env build",
        "restorecon -R /opt/gpu-agent",
        "systemctl --no-reload preset gpu-agent.service",
        "systemctl daemon-reload",
    ],
    # The restart of an upgrade is %posttrans's, once the old package's files are gone.
    ("rpm/post", "2", True): [
        "install-env build",
        "restorecon -R /opt/gpu-agent",
        "systemctl daemon-reload",
    ],
    # In a chroot or an image build (no systemd running): the preset decides, nothing starts.
    ("rpm/post", "1", False): [
        "install-env build",
        "restorecon -R /opt/gpu-agent",
        "systemctl --no-reload preset gpu-agent.service",
    ],
    ("rpm/preun", "0", True): ["systemctl --no-reload disable --now gpu-agent.service", "install-env remove"],
    ("rpm/preun", "1", True): [],
    ("rpm/postun", "0", True): ["systemctl daemon-reload"],
    ("rpm/postun", "1", True): ["systemctl daemon-reload"],
    # a first install starts the service, an upgrade restarts it; without systemd, neither
    ("deb/postinst", "configure", True): [
        *DEB_CONFIGURED,
        "systemctl --system daemon-reload",
        "deb-systemd-invoke start gpu-agent.service",
        "install-env prune",
    ],
    ("deb/postinst", "configure 0.1.0-1~bookworm", True): [
        *DEB_CONFIGURED,
        "systemctl --system daemon-reload",
        "deb-systemd-invoke try-restart gpu-agent.service",
        "install-env prune",
    ],
    ("deb/postinst", "configure", False): [*DEB_CONFIGURED, "install-env prune"],
    ("deb/prerm", "remove", True): ["deb-systemd-invoke stop gpu-agent.service", "install-env remove"],
    ("deb/prerm", "upgrade 0.2.1-1~bookworm", True): [],
    # Back to a package that installed the rules in /etc as conffiles: their unchanged copies return.
    ("deb/prerm", "upgrade 0.1.0-2~bookworm", True): ["install-env restore-legacy-rules --park-masks"],
    ("deb/postrm", "remove", True): ["deb-systemd-helper purge gpu-agent.service", "systemctl --system daemon-reload"],
    ("deb/postrm", "upgrade 0.1.0-2~bookworm", True): [],
}


def run_script(
    tmp_path: Path,
    script: str,
    arguments: str,
    systemd: bool,
    build_status: int = 0,
    *,
    current_status: int = 0,
    query_output: str = "",
    rules: Path | None = None,
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run a maintainer script with stand-ins on PATH recording the commands it runs;
    build_status: what the stand-in `install-env build` exits with (3: config rejected),
    current_status: `install-env is-current` (1: the new environment did not take over),
    query_output: what `rpm -q` and `dpkg-query -W` print (the installed package's files).
    The rules directory is `rules` (default tmp_path/rules.d), the package's state directory tmp_path/state."""
    calls = tmp_path / "calls"
    stubs = tmp_path / "bin"
    stubs.mkdir(parents=True)
    (tmp_path / "query-output").write_text(query_output)
    exits = {"build": build_status, "is-current": current_status}
    for name in ("systemctl", "deb-systemd-helper", "deb-systemd-invoke", "install-env", "restorecon", "logger"):
        status = (
            "".join(f'[ "$1" = {cmd} ] && exit {code}\n' for cmd, code in exits.items())
            if name == "install-env"
            else ""
        )
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{status}exit 0\n')
        (stubs / name).chmod(0o755)
    for name in ("rpm", "dpkg-query"):
        (stubs / name).write_text(
            f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> {calls}\ncat {tmp_path / "query-output"}\n'
        )
        (stubs / name).chmod(0o755)
    run_dir = tmp_path / "run-systemd-system"
    if systemd:
        run_dir.mkdir()
    rules, state = rules or tmp_path / "rules.d", tmp_path / "state"
    rules.mkdir(exist_ok=True)
    state.mkdir(exist_ok=True)
    text = (REPO / "packaging" / script).read_text()
    text = text.replace("/opt/gpu-agent/lib/install-env", str(stubs / "install-env"))
    text = text.replace("/opt/gpu-agent/lib/legacy-rules.sha256", str(REPO / "packaging/legacy-rules.sha256"))
    text = text.replace("/run/systemd/system", str(run_dir))
    text = text.replace("rules=/etc/gpu-agent/rules.d\n", f"rules={rules}\n")
    text = text.replace("state=/opt/gpu-agent\n", f"state={state}\n")
    text = text.replace("shipped=/usr/share/gpu-agent/rules.d\n", f"shipped={tmp_path / 'shipped'}\n")
    # Nothing of the real machine may be reached (the purge case is tested separately; the
    # config's path is only named in a message).
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "/etc/" not in code.replace(str(rules), "").replace("/etc/gpu-agent /var/lib/gpu-agent", "").replace(
        "/etc/gpu-agent/agent.yaml (", ""
    )
    assert "/run/" not in code.replace(str(run_dir), "")
    assert "/opt/gpu-agent" not in code.replace("restorecon -R /opt/gpu-agent", "").replace(
        "/opt/gpu-agent/lib/install-env", ""
    )
    script_file = tmp_path / "script"
    script_file.write_text(text)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "LANG": "C.UTF-8"}
    proc = subprocess.run(["sh", "-e", str(script_file), *arguments.split()], capture_output=True, text=True, env=env)
    return proc, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize(("script", "arguments", "systemd"), list(SCRIPT_CASES))
def test_maintainer_script_runs(tmp_path: Path, script: str, arguments: str, systemd: bool) -> None:
    """The script's commands, recorded by stand-ins on PATH. RPM's scriptlets never run in the
    other tests (no EL10 root here), so this is where their logic is checked."""
    proc, recorded = run_script(tmp_path, script, arguments, systemd)
    assert proc.returncode == 0, proc.stderr
    assert recorded == SCRIPT_CASES[(script, arguments, systemd)]


REJECTED_CASES = {
    # An upgrade whose new version rejects the config: no restart, no prune (the old environment
    # keeps running), no rules migration, a message in the package output and the journal; the
    # package still configures (exit 0), so apt and dnf carry on.
    ("deb/postinst", "configure 0.1.0-1~bookworm"): [
        "install-env unpark-masks",
        "install-env build",
        "deb-systemd-helper --quiet was-enabled gpu-agent.service",
        "deb-systemd-helper enable gpu-agent.service",
        "systemctl --system daemon-reload",
        "logger",
    ],
    ("rpm/post", "2"): ["install-env build", "restorecon -R /opt/gpu-agent", "systemctl daemon-reload", "logger"],
}


@pytest.mark.parametrize(("script", "arguments"), list(REJECTED_CASES))
def test_a_rejected_config_keeps_the_old_daemon_and_says_so(tmp_path: Path, script: str, arguments: str) -> None:
    proc, recorded = run_script(tmp_path, script, arguments, systemd=True, build_status=3)
    assert proc.returncode == 0, proc.stderr
    assert [c if not c.startswith("logger ") else "logger" for c in recorded] == REJECTED_CASES[(script, arguments)]
    message = (
        "the new version rejects /etc/gpu-agent/agent.yaml (see above); gpu-agent keeps running the previous version"
    )
    assert message in proc.stderr
    assert f"logger -t gpu-agent -p daemon.err gpu-agent: {message}" in recorded[-1]


@pytest.mark.parametrize("script", ["deb/postinst", "rpm/post"])
def test_a_failed_environment_build_fails_the_script(tmp_path: Path, script: str) -> None:
    proc, recorded = run_script(tmp_path, script, "configure" if script.startswith("deb") else "1", True, 1)
    assert proc.returncode == 1
    assert recorded[-1] == "install-env build" and recorded[:-1] in ([], ["install-env unpark-masks"])


def test_rpm_post_leaves_the_restart_of_an_upgrade_to_posttrans(tmp_path: Path) -> None:
    proc, recorded = run_script(tmp_path, "rpm/post", "2", systemd=True)
    assert proc.returncode == 0, proc.stderr
    assert not any("restart" in call for call in recorded), recorded
    assert (tmp_path / "state/.restart-pending").is_file()


def test_rpm_pre_lists_the_rules_an_admin_deleted_or_masked_under_the_old_layout(tmp_path: Path) -> None:
    """Upgrading a package that had no /usr/share/gpu-agent/rules.d: the rules it shipped that are
    gone or masked here are listed for %posttrans, with shell built-ins alone (no rpm query inside
    the transaction, nothing but /bin/sh required before the package's files are there)."""
    rules = tmp_path / "rules.d"
    rules.mkdir()
    for name in ("10-xid.yaml", "40-memory.yaml", "50-gpu-state.yaml"):
        (rules / name).write_text("kept\n")
    (rules / "30-service.yaml").symlink_to("/dev/null")
    proc, recorded = run_script(tmp_path, "rpm/pre", "2", True)
    assert proc.returncode == 0, proc.stderr
    assert recorded == []
    assert f"{rules}/20-thermal.yaml was deleted here: masked it" in proc.stderr
    # Every mask of such a rule, to make or made before, for %posttrans to put back after rpm removed it.
    listed = (tmp_path / "state/.legacy-rules-upgrade").read_text().split()
    assert listed == [f"{rules}/20-thermal.yaml", f"{rules}/30-service.yaml"]
    assert sorted(p.name for p in rules.iterdir()) == [
        "10-xid.yaml",
        "30-service.yaml",
        "40-memory.yaml",
        "50-gpu-state.yaml",
    ]


def test_rpm_pre_leaves_a_package_with_the_rules_under_usr_share_alone(tmp_path: Path) -> None:
    (tmp_path / "shipped").mkdir()
    proc, _ = run_script(tmp_path, "rpm/pre", "2", True)
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "rules.d").iterdir()) == []
    assert not (tmp_path / "state/.legacy-rules-upgrade").exists()
    # A first install: nothing to look at.
    (tmp_path / "fresh").mkdir()
    proc, _ = run_script(tmp_path / "fresh", "rpm/pre", "1", True)
    assert proc.returncode == 0 and not (tmp_path / "fresh/state/.legacy-rules-upgrade").exists()


def test_rpm_pre_names_the_rules_the_old_packages_shipped() -> None:
    listed = re.search(r"^    for name in (.+); do$", (REPO / "packaging/rpm/pre").read_text(), re.MULTILINE)
    assert listed is not None
    legacy = [
        line.split()[1]
        for line in (REPO / "packaging/legacy-rules.sha256").read_text().splitlines()
        if not line.startswith("#")
    ]
    assert listed.group(1).split() == legacy == sorted(p.name for p in (REPO / "packaging/legacy-rules").glob("*.yaml"))


def test_deb_preinst_masks_the_rules_an_admin_deleted_under_the_old_layout(tmp_path: Path) -> None:
    rules = tmp_path / "rules.d"
    rules.mkdir()
    (rules / "10-xid.yaml").write_text("kept\n")
    conffiles = (
        " /etc/gpu-agent/agent.yaml 0123\n"
        f" {rules}/10-xid.yaml 4567\n"
        f" {rules}/20-thermal.yaml 89ab\n"
        f" {rules}/40-memory.yaml cdef obsolete\n"
    )
    proc, recorded = run_script(tmp_path, "deb/preinst", "upgrade 0.1.0-1~bookworm", True, query_output=conffiles)
    assert proc.returncode == 0, proc.stderr
    assert recorded == ["dpkg-query -W -f=${Conffiles}\\n gpu-agent"]
    # 20-thermal: a conffile of the installed package, missing: deleted by the admin. 40-memory:
    # already moved by an earlier upgrade (obsolete), so its absence says nothing.
    assert sorted(p.name for p in rules.iterdir()) == ["10-xid.yaml", "20-thermal.yaml"]
    assert os.readlink(rules / "20-thermal.yaml") == "/dev/null"
    # A first install: no installed package to ask about.
    (tmp_path / "fresh").mkdir()
    fresh, recorded = run_script(tmp_path / "fresh", "deb/preinst", "install", True)
    assert fresh.returncode == 0 and recorded == []


POSTTRANS_CASES = {
    # (the new environment took over, a restart pending, an upgrade from the old layout): calls
    (True, True, True): [
        "install-env is-current",
        "install-env migrate-rules",
        "systemctl try-restart gpu-agent.service",
        "install-env prune",
    ],
    (True, False, False): ["install-env is-current", "install-env migrate-rules", "install-env prune"],
    # The new version rejected the config: the old daemon keeps its rules in /etc.
    (False, False, True): ["install-env is-current", "install-env restore-legacy-rules"],
    (False, False, False): ["install-env is-current"],
}


@pytest.mark.parametrize(("took_over", "pending", "legacy"), list(POSTTRANS_CASES))
def test_rpm_posttrans(tmp_path: Path, took_over: bool, pending: bool, legacy: bool) -> None:
    rules, state = tmp_path / "rules.d", tmp_path / "state"
    for directory in (rules, state):
        directory.mkdir()
    # What rpm leaves of the old package's %config rules: the changed one and the mask saved.
    (rules / "20-thermal.yaml.rpmsave").write_text("changed\n")
    (rules / "30-service.yaml.rpmsave").symlink_to("/dev/null")
    (rules / "99-own.yaml.rpmsave").write_text("never shipped\n")
    if pending:
        (state / ".restart-pending").touch()
    if legacy:
        # %pre's list of masks: 40-memory's, which rpm removed with the old package's files.
        (state / ".legacy-rules-upgrade").write_text(f"{rules / '40-memory.yaml'}\n")
    proc, recorded = run_script(tmp_path, "rpm/posttrans", "0", True, current_status=0 if took_over else 1)
    assert proc.returncode == 0, proc.stderr
    assert recorded == POSTTRANS_CASES[(took_over, pending, legacy)]
    masks = ["40-memory.yaml"] if legacy else []
    assert sorted(p.name for p in rules.iterdir()) == sorted(
        ["20-thermal.yaml", "30-service.yaml", *masks, "99-own.yaml.rpmsave"]
    )
    assert os.readlink(rules / "30-service.yaml") == "/dev/null"
    assert all(os.readlink(rules / name) == "/dev/null" for name in masks)
    assert list(state.iterdir()) == []


def test_deb_purge_removes_config_and_state(tmp_path: Path) -> None:
    etc, state = tmp_path / "etc-gpu-agent", tmp_path / "var-lib-gpu-agent"
    for directory in (etc / "rules.d", state):
        directory.mkdir(parents=True)
        (directory / "file").write_text("x")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("systemctl", "deb-systemd-helper"):
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {tmp_path / "calls"}\n')
        (stubs / name).chmod(0o755)
    text = (REPO / "packaging" / "deb" / "postrm").read_text()
    assert "rm -rf /etc/gpu-agent /var/lib/gpu-agent" in text
    text = text.replace("rm -rf /etc/gpu-agent /var/lib/gpu-agent", f"rm -rf {etc} {state}")
    text = text.replace("rules=/etc/gpu-agent/rules.d\n", f"rules={etc}/rules.d\n")
    text = text.replace("/run/systemd/system", str(tmp_path / "absent"))
    assert "/etc/gpu-agent" not in text and "/var/lib/gpu-agent" not in text
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "LANG": "C.UTF-8"}
    proc = subprocess.run(["sh", "-c", text, "postrm", "purge"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert not etc.exists() and not state.exists()
    assert (tmp_path / "calls").read_text() == "deb-systemd-helper purge gpu-agent.service\n"


# -- sources of the packages -----------------------------------------------------------------------


def test_man_page_names_every_command() -> None:
    from agent.cli.parser import build_parser

    man = (REPO / "packaging" / "gpu-agent.8").read_text()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert commands
    for name in commands:
        assert re.search(rf'^\.BI? "?{re.escape(name)}\b', man, re.MULTILINE), f"gpu-agent.8 lacks `{name}`"


def model_keys(model: type[BaseModel], prefix: str = "", described: set[type] | None = None) -> list[str]:
    """Every key of a pydantic model, nested ones dotted, a list of models marked `[]`. A model met
    again under another key (`policy.gpu_overrides[]` holds what `policy.gpus[]` does) is described
    once, under the first: the second key itself must be named, not its keys again."""
    described = set() if described is None else described
    keys = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        keys.append(path)
        annotation = field.annotation
        listed = typing.get_origin(annotation) is list
        for inner in typing.get_args(annotation) or (annotation,):
            for candidate in typing.get_args(inner) or (inner,):
                if isinstance(candidate, type) and issubclass(candidate, BaseModel) and candidate not in described:
                    described.add(candidate)
                    keys += model_keys(candidate, f"{path}[]." if listed else f"{path}.", described)
    return sorted(set(keys))


def man_text(page: str) -> str:
    """A man page's source with the font changes and escapes troff needs taken out."""
    text = (REPO / "packaging" / page).read_text()
    return re.sub(r"\\f[BIRP]", "", text).replace("\\-", "-").replace("\\&", "")


def test_config_man_page_describes_every_key() -> None:
    """gpu-agent-config(5) names every key of agent.yaml, as the models in agent/config/ have
    them: a new key without its entry fails here."""
    from agent.config import AgentConfig
    from agent.names.policy_items import ITEM_NAMES

    page = man_text("gpu-agent-config.5")
    keys = model_keys(AgentConfig)
    assert "policy.gpus[].match.model" in keys and "services[].drain.hook" in keys and len(keys) > 70
    assert [key for key in keys if key not in page] == []
    assert [item for item in ITEM_NAMES if f".BR {item}" not in page and f".B {item}" not in page] == []


def test_rules_man_page_describes_every_key() -> None:
    """gpu-agent-rules(5) names every key of a rule, every condition and every action kind the
    registry declares with its parameters, as agent/rules/config.py and the kinds have them."""
    from agent.rules.actions.registry import KINDS
    from agent.rules.config import Match, Rule

    page = man_text("gpu-agent-rules.5")
    wanted = [f".B {name}\n" for name in Rule.model_fields]
    wanted += [f"match.{key}" for key in model_keys(Match)]
    for kind, action in KINDS.items():
        wanted += [f".B {kind}\n", *(f"{kind}.{name}" for name in action.params.model_fields)]
    assert len(wanted) > 40
    assert [text for text in wanted if text not in page] == []


def test_every_relative_link_in_the_installed_docs_resolves(packages: dict[str, Path], tmp_path: Path) -> None:
    """The README, docs/ and what they link to are in the package as in the source tree: every
    relative link of every installed page names a file of the package."""
    run("dpkg-deb", "--extract", packages["debian12"], tmp_path)
    doc = tmp_path / "usr/share/doc/gpu-agent"
    pages = sorted(doc.rglob("*.md"))
    assert doc / "README.md" in pages and doc / "docs/metrics-reference.md" in pages
    dead = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL, not a file
            resolved = (page.parent / target).resolve()
            if not resolved.is_file() or doc.resolve() not in resolved.parents:
                dead.append(f"{page.relative_to(doc)}: {target}")
    assert dead == []
    assert re.findall(r"\]\((docs/[^)]+)\)", (doc / "README.md").read_text()), "the README links into docs/"


def test_shipped_config_observes_through_nvml() -> None:
    from agent.config import Mode, load_config

    config = load_config(REPO / "packaging" / "agent.yaml")
    assert config.mode is Mode.OBSERVE
    assert config.backend == "nvml"
    assert config.metrics.listen == "0.0.0.0:9481"
    assert config.remediation.rules_dirs == ["/usr/share/gpu-agent/rules.d", "/etc/gpu-agent/rules.d"]
    assert config.remediation.allow_reboot is False


def test_every_dependency_is_pinned() -> None:
    # A regex, not tomllib: the project supports Python 3.10, which has no tomllib.
    block = re.search(r"^dependencies = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(), re.MULTILINE | re.DOTALL)
    assert block
    dependencies = re.findall(r'"([^"]+)"', block.group(1))
    assert dependencies
    pins = build.pinned()
    for requirement in dependencies:
        name = build.normalize(re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0])
        assert name in pins, f"{name} (pyproject.toml) is not in packaging/bundle-requirements.txt"
        assert name in build.BUNDLED_LICENSES


def test_a_build_takes_what_one_of_the_same_commit_left_and_checks_it_again(tmp_path: Path) -> None:
    """The project's wheel of a committed tree, and the downloads for a wheel and pins, are taken
    from an earlier build's work directory (a commit builds the same bytes); a downloaded wheel
    changed since is still refused."""
    if build.committed_state() is None:
        pytest.skip("uncommitted changes here: every build builds its own wheel")
    wheel = build.build_project_wheel(tmp_path)
    built = wheel.stat().st_mtime_ns
    assert build.build_project_wheel(tmp_path) == wheel and wheel.stat().st_mtime_ns == built
    first = build.download_wheels(tmp_path, TARGETS["debian12"], wheel)
    structlog = next(w.path for w in first if w.project == "structlog")
    downloaded = structlog.stat().st_mtime_ns
    assert build.download_wheels(tmp_path, TARGETS["debian12"], wheel) == first
    assert structlog.stat().st_mtime_ns == downloaded
    structlog.write_bytes(structlog.read_bytes() + b"\0")
    with pytest.raises(build.BuildError, match=r"is not one packaging/bundle-requirements\.txt pins"):
        build.download_wheels(tmp_path, TARGETS["debian12"], wheel)


def test_every_bundled_wheel_is_pinned_by_hash(packages: dict[str, Path], tmp_path: Path) -> None:
    """The wheels the packages carry are the very files bundle-requirements.txt names; another
    file of a pinned version (a re-upload, a mirror's or a cache's other bytes) fails the build."""
    pins = build.pinned()
    for target in TARGETS:
        wheels = [build.Wheel.parse(p) for p in (stage(target) / "wheels").glob("*.whl")]
        assert {w.project for w in wheels} - {build.NAME} == set(pins), target
        build.check_pins(wheels, pins)
    genuine = next((stage("debian12") / "wheels").glob("structlog-*.whl"))
    tampered = tmp_path / genuine.name
    tampered.write_bytes(genuine.read_bytes() + b"\0")
    with pytest.raises(build.BuildError, match=r"its SHA-256 [0-9a-f]{64} is not one packaging/bundle-requirements"):
        build.check_pins([build.Wheel.parse(tampered)], pins)


def test_changelog_has_an_entry_per_release_and_one_for_this_build() -> None:
    entries = build.versioned_entries(build.changelog_entries(), VERSION, 1_764_547_200)
    releases = [str(e["semver"]) for e in build.changelog_entries() if e["date"] != build.UNRELEASED]
    text = build.debian_changelog(entries, TARGETS["debian12"], "1~bookworm")
    headers = re.findall(r"^gpu-agent \((.+?)\) bookworm; urgency=medium$", text, re.MULTILINE)
    if ".dev" in VERSION:  # a commit that is no release: its own entry, naming the commit
        assert headers == [f"{PKG_VERSION}-1~bookworm", *(f"{r}-1" for r in releases)]
        assert build.project_info().revision in " ".join(text.split())
    else:
        assert headers == [f"{PKG_VERSION}-1~bookworm", *(f"{r}-1" for r in releases[1:])]
    assert len(
        re.findall(r"^ -- .+ <.+>  \w{3}, \d{2} \w{3} \d{4} \d{2}:\d{2}:\d{2} \+0000$", text, re.MULTILINE)
    ) == len(headers)
    rpm = json.loads(build.rpm_changelog(entries, "1.el10"))
    assert [e["semver"] for e in rpm] == [h.replace("~bookworm", ".el10") for h in headers]


def test_news_and_the_rpm_changelog_tell_admins_about_the_rule_layout() -> None:
    """NEWS.Debian (apt-listchanges shows it before an upgrade) and the RPM %changelog carry the
    coming release's news: where the shipped rules are, how to mask one, what an upgrade and a
    downgrade keep."""
    entries = build.versioned_entries(build.changelog_entries(), VERSION, 1_764_547_200)
    news = build.debian_news(entries, TARGETS["debian12"], "1~bookworm")
    flat = " ".join(news.split())
    for said in (
        "/usr/share/gpu-agent/rules.d",
        "ln -s /dev/null /etc/gpu-agent/rules.d/40-memory.yaml",
        "becomes a mask",
    ):
        assert said in flat, said
    assert re.match(rf"gpu-agent \({re.escape(PKG_VERSION)}-1~bookworm\) bookworm; urgency=medium\n\n  The ", news)
    assert "*" not in news  # lintian: a NEWS entry is prose, not a changelog list
    rpm = " ".join(note["note"] for note in json.loads(build.rpm_changelog(entries, "1.el10"))[0]["changes"])
    assert "becomes a mask" in rpm and "not started on install" in rpm


def test_the_coming_releases_notes_go_to_its_builds_and_its_tag_needs_a_date() -> None:
    released = {"semver": "0.1.0", "date": "2026-11-29T00:00:00Z", "packager": "p <p@example.org>", "changes": []}
    coming = {"semver": "0.2.0", "date": build.UNRELEASED, "packager": "p <p@example.org>"}
    coming |= {"changes": [{"note": "rules moved"}], "news": ["read this"]}
    dev = build.versioned_entries([coming, released], "0.2.0.dev5+gabcdef0", 0)
    assert [e["semver"] for e in dev] == ["0.2.0.dev5+gabcdef0", "0.1.0"]
    assert dev[0]["changes"][1:] == [{"note": "rules moved"}] and dev[0]["news"] == ["read this"]
    with pytest.raises(build.BuildError, match="needs its date in place of unreleased"):
        build.versioned_entries([coming, released], "0.2.0", 0)
    with pytest.raises(build.BuildError, match=r"the unreleased entry is 0\.2\.0, this build leads to 0\.3\.0"):
        build.versioned_entries([coming, released], "0.3.0.dev5+gabcdef0", 0)
    # Tagged: the entry dated, the release build takes the file as it is.
    dated = coming | {"date": "2027-01-15T00:00:00Z"}
    assert [e["semver"] for e in build.versioned_entries([dated, released], "0.2.0", 0)] == ["0.2.0", "0.1.0"]
    with pytest.raises(build.BuildError, match="needs the newest entry"):
        build.versioned_entries([dated, released], "0.2.1", 0)
    with pytest.raises(build.BuildError, match="raise NEXT_RELEASE"):
        build.versioned_entries([dated, released], "0.2.0.dev5+gabcdef0", 0)
