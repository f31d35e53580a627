"""The systemd sandbox where systemd is PID 1 (a server, a VM), where the e2e tests run as on a
build host without it: a scope of its own, its cgroup delegated, a cgroup namespace rooted there
(tests/systemd_sandbox.py).

Such a host is made here from the sandbox itself: one is booted as the host, its /sys/fs/cgroup a
cgroup2 hierarchy as today's systemd hosts have (this host's own, or the unified one of its hybrid
layout). In it, tests/systemd_sandbox.py (which needs the standard library alone) boots a second
sandbox from the same cached root file system, as the e2e tests would on that host, and drives a
unit there. Where the test host itself runs systemd, the e2e tests show it directly: skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from systemd_sandbox import SystemdSandbox, cached_rootfs, cgroup_is_unified, host_runs_systemd, missing_requirements

TESTS = Path(__file__).resolve().parent
HOST_CGROUP = Path("/sys/fs/cgroup")


def cgroup2_root() -> Path | None:
    """A cgroup2 hierarchy of this host to be the booted host's /sys/fs/cgroup."""
    mounts = Path("/proc/self/mountinfo").read_text()
    if cgroup_is_unified(mounts):
        return HOST_CGROUP
    unified = HOST_CGROUP / "unified"  # the hybrid layout: v1 controllers, the unified hierarchy beside them
    return unified if (unified / "cgroup.procs").exists() else None


_SKIP = missing_requirements() or (
    "the host runs systemd: the e2e tests themselves run in delegated scopes" if host_runs_systemd() else None
)
pytestmark = [pytest.mark.real_daemon, pytest.mark.e2e, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]

CACHE_INSIDE = "/srv/gpu-agent-sandbox-cache"  # the cached root file system, bound read-only
TESTS_INSIDE = "/srv/gpu-agent-tests"
INNER = f"""
import json, subprocess, sys
sys.path.insert(0, "{TESTS_INSIDE}")
from systemd_sandbox import SystemdSandbox, cgroup_is_unified, host_runs_systemd

found = {{"systemd_host": host_runs_systemd(), "unified": cgroup_is_unified(open("/proc/self/mountinfo").read())}}
with SystemdSandbox("/tmp/inner") as inner:  # its writable layer on tmpfs: overlayfs takes none on overlayfs
    found["scope"] = inner.scope
    found["state"] = inner.run(["systemctl", "is-system-running"], check=False).stdout.strip()
    inner.run(["systemd-run", "--wait", "--quiet", "--unit=probe", "sh", "-c", "echo probe ran"])
    found["journal"] = inner.run(["journalctl", "--no-pager", "-o", "cat", "-u", "probe"]).stdout
    unified = [line for line in inner.run(["cat", "/proc/1/cgroup"]).stdout.splitlines() if line.startswith("0::")]
    found["init_cgroup"] = unified[0] if unified else None
    found["host_view"] = subprocess.run(
        ["systemctl", "show", "--property=ControlGroup", "--value", inner.scope], capture_output=True, text=True
    ).stdout.strip()
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def systemd_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemdSandbox]:
    cgroup = cgroup2_root()
    if cgroup is None:
        pytest.skip("no cgroup2 hierarchy here to make a systemd host of the unified kind")
    with SystemdSandbox(tmp_path_factory.mktemp("systemd-host"), cgroup_root=cgroup) as host:
        rootfs = cached_rootfs()
        host.bind(rootfs, f"{CACHE_INSIDE}/{rootfs.name}")
        host.bind(TESTS, TESTS_INSIDE)
        yield host


def test_a_sandbox_boots_and_runs_units_on_a_systemd_host(systemd_host: SystemdSandbox) -> None:
    proc = systemd_host.run(
        ["env", f"GPU_AGENT_SANDBOX_CACHE={CACHE_INSIDE}", "python3", "-c", INNER], check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["systemd_host"] and found["unified"], found
    assert found["state"] in ("running", "degraded"), found
    assert "probe ran" in found["journal"], found
    # The sandbox's systemd runs in the scope the host's delegated to it, and made its own tree there.
    assert found["host_view"].endswith(f"/{found['scope']}"), found
    assert found["init_cgroup"] == f"0::{found['host_view']}/init.scope", found
