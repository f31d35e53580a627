"""Report-only policy items: VBIOS minimum, the driver (version, branch, CUDA for each service,
fabric manager on NVSwitch systems) and next-boot readiness. They report drift and never write."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import wait_until
from host.test_boot_readiness import NEW, ubuntu_tree

from agent.backend.sim import SimulatedBackend
from agent.config import GPU_ITEMS, AgentConfig
from agent.config.desired import DriverPolicy, NodePolicy
from agent.config.service_entry import ServiceConfig
from agent.host.paths import HostPaths
from agent.policy import driver, next_boot, vbios
from agent.policy.base import GpuContext, HostContext
from agent.policy.engine import PolicyEngine
from agent.policy.item import enforce
from agent.policy.plan import ApplyOutcome, PlanStatus
from agent.rules.actions.kinds.reboot import next_boot_problem

H200_VBIOS = "96.00.A5.00.1A"


@pytest.fixture
def backend(tmp_path: Path) -> SimulatedBackend:
    sim = SimulatedBackend("h200", tmp_path / "state", writable_items=GPU_ITEMS)
    sim.init()
    return sim


def host_with(tmp_path: Path, backend: SimulatedBackend | None) -> HostContext:
    return HostContext(HostPaths.at(tmp_path / "root"), backend=backend)


def write(root: Path, host_path: str, text: str) -> None:
    path = root / host_path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def dpkg(root: Path, **packages: str) -> None:
    write(
        root,
        "/var/lib/dpkg/status",
        "\n".join(f"Package: {n}\nStatus: install ok installed\nVersion: {v}\n" for n, v in packages.items()),
    )


# -- VBIOS ---------------------------------------------------------------------------------------------


def test_vbios_at_or_above_the_minimum_is_in_sync(backend: SimulatedBackend) -> None:
    ctx = GpuContext(backend, 0, backend.identity(0))
    assert vbios.ITEM.plan(ctx, H200_VBIOS).plan.status is PlanStatus.IN_SYNC
    assert vbios.ITEM.plan(ctx, "96.00.9F.00.01").plan.status is PlanStatus.IN_SYNC


def test_older_vbios_is_drift_that_apply_refuses(backend: SimulatedBackend) -> None:
    ctx = GpuContext(backend, 0, backend.identity(0))
    done = vbios.ITEM.plan(ctx, "96.00.AF.00.01")
    assert (done.plan.status, done.plan.actual, done.plan.desired) == (
        PlanStatus.DRIFT,
        H200_VBIOS,
        ">= 96.00.AF.00.01",
    )
    assert done.plan.changes == (
        "update the VBIOS of GPU 0 to 96.00.AF.00.01 or newer (report-only: the agent never flashes a VBIOS)",
    )
    result = enforce(vbios.ITEM, ctx, "96.00.AF.00.01", done)
    assert result.outcome is ApplyOutcome.FAILED and "report-only" in result.detail


def test_vbios_min_must_be_dotted_hex() -> None:
    with pytest.raises(ValueError, match="vbios_min"):
        AgentConfig.model_validate({"policy": {"gpus": [{"match": {"index": 0}, "vbios_min": "96.0.A5"}]}})


# -- driver --------------------------------------------------------------------------------------------


def driver_want(services: tuple[tuple[str, str], ...] = (), **policy: str) -> driver.DriverWant:
    return driver.DriverWant(DriverPolicy.model_validate(policy), services)


def test_driver_version_pinned_and_met(tmp_path: Path, backend: SimulatedBackend) -> None:
    dpkg(tmp_path / "root", **{"nvidia-driver-580-server": "580.159.04-0ubuntu1"})
    done = driver.ITEM.plan(host_with(tmp_path, backend), driver_want(version="580.159.04", branch="datacenter"))
    assert done.plan.status is PlanStatus.IN_SYNC
    assert done.plan.actual == "580.159.04 (datacenter, CUDA 13.0)"


def test_driver_other_version_and_branch_are_drift(tmp_path: Path, backend: SimulatedBackend) -> None:
    dpkg(tmp_path / "root", **{"nvidia-driver-580": "580.159.04-0ubuntu1"})
    done = driver.ITEM.plan(host_with(tmp_path, backend), driver_want(version="580.172.08", branch="datacenter"))
    assert done.plan.status is PlanStatus.DRIFT
    assert done.plan.changes == (
        "install NVIDIA driver 580.172.08 (loaded: 580.159.04) (report-only: the agent never installs or removes drivers)",
        "install the datacenter driver branch (installed: desktop) (report-only: the agent never installs or removes drivers)",
    )


def test_driver_min_version(tmp_path: Path, backend: SimulatedBackend) -> None:
    ctx = host_with(tmp_path, backend)
    assert driver.ITEM.plan(ctx, driver_want(min_version="580.95")).plan.status is PlanStatus.IN_SYNC
    assert driver.ITEM.plan(ctx, driver_want(min_version="580.172")).plan.status is PlanStatus.DRIFT


def test_a_service_built_for_newer_cuda_than_the_driver_supports_is_drift(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    ctx = host_with(tmp_path, backend)
    fine = driver.ITEM.plan(ctx, driver_want((("sglang", "12.8"), ("vllm", "13.0"))))
    assert fine.plan.status is PlanStatus.IN_SYNC
    too_new = driver.ITEM.plan(ctx, driver_want((("sglang", "13.1"),)))
    assert too_new.plan.status is PlanStatus.DRIFT
    assert too_new.plan.changes[0].startswith("sglang needs CUDA 13.1; driver 580.159.04 supports CUDA 13.0")


def test_services_cuda_version_alone_plans_the_driver_item() -> None:
    config = AgentConfig.model_validate({"services": [{"name": "sglang", "cuda_version": "12.4"}]})
    want = driver.ITEM.desired(config.policy.node, config)
    assert want is not None and want.services_cuda == (("sglang", "12.4"),)
    assert driver.ITEM.desired(NodePolicy(), AgentConfig(backend="simulated")) is None
    reporting = driver.ITEM.desired(NodePolicy(), AgentConfig(backend="nvml"))
    assert reporting is not None and reporting.policy == DriverPolicy()


def test_nvswitch_needs_the_fabric_manager_at_the_driver_version(tmp_path: Path, backend: SimulatedBackend) -> None:
    root = tmp_path / "root"
    # The driver registers the nvidia-nvswitch char device on every host (seen on a 1-GPU H200 VM):
    # only an NVSwitch PCI device (vendor 0x10de, class 0x0680xx) makes this an NVSwitch system.
    write(root, "/proc/devices", "Character devices:\n195 nvidia\n239 nvidia-nvswitch\n")
    write(root, "/sys/bus/pci/devices/0000:3b:00.0/vendor", "0x10de\n")
    write(root, "/sys/bus/pci/devices/0000:3b:00.0/class", "0x030200\n")  # the GPU
    ctx = host_with(tmp_path, backend)
    assert driver.ITEM.plan(ctx, driver_want()).plan.status is PlanStatus.IN_SYNC
    write(root, "/sys/bus/pci/devices/0000:05:00.0/vendor", "0x10de\n")
    write(root, "/sys/bus/pci/devices/0000:05:00.0/class", "0x068000\n")  # an NVSwitch
    missing = driver.ITEM.plan(ctx, driver_want())
    assert missing.plan.changes[0].startswith("install nvidia-fabricmanager 580.159.04 (NVSwitch system)")
    dpkg(root, **{"nvidia-fabricmanager-580": "580.95.05-1"})
    stale = driver.ITEM.plan(ctx, driver_want())
    assert stale.plan.changes[0].startswith("install nvidia-fabricmanager 580.159.04 (installed: 580.95.05-1)")
    dpkg(root, **{"nvidia-fabricmanager-580": "580.159.04-1"})
    assert driver.ITEM.plan(ctx, driver_want()).plan.status is PlanStatus.IN_SYNC


def test_an_unknown_branch_is_not_a_verdict(tmp_path: Path, backend: SimulatedBackend) -> None:
    done = driver.ITEM.plan(host_with(tmp_path, backend), driver_want(branch="datacenter"))
    assert done.plan.status is PlanStatus.ERROR
    assert "branch cannot be told" in done.plan.detail


def test_no_driver_at_all(tmp_path: Path) -> None:
    done = driver.ITEM.plan(host_with(tmp_path, None), driver_want(version="580.159.04"))
    assert (done.plan.status, done.plan.actual) == (PlanStatus.ERROR, "not loaded")


def test_driver_apply_refuses_and_writes_nothing(tmp_path: Path, backend: SimulatedBackend) -> None:
    ctx = host_with(tmp_path, backend)
    want = driver_want(version="580.172.08")
    result = enforce(driver.ITEM, ctx, want, driver.ITEM.plan(ctx, want))
    assert result.outcome is ApplyOutcome.FAILED and "never installs" in result.detail
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").rglob("*"))


# -- next boot -----------------------------------------------------------------------------------------


def test_next_boot_is_checked_by_default_only_on_real_gpus() -> None:
    assert next_boot.ITEM.desired(NodePolicy(), AgentConfig(backend="nvml")) == "ready"
    assert next_boot.ITEM.desired(NodePolicy(), AgentConfig(backend="simulated")) is None
    assert next_boot.ITEM.desired(NodePolicy(next_boot="ready"), AgentConfig(backend="simulated")) == "ready"
    assert next_boot.ITEM.desired(NodePolicy(next_boot="ignore"), AgentConfig(backend="nvml")) is None


def test_next_boot_ready_and_not_ready(tmp_path: Path, backend: SimulatedBackend) -> None:
    ubuntu_tree(tmp_path / "root")
    ctx = host_with(tmp_path, backend)
    ready = next_boot.ITEM.plan(ctx, "ready").plan
    assert (ready.status, ready.actual) == (PlanStatus.IN_SYNC, f"{NEW}: ready")
    (tmp_path / "root" / f"lib/modules/{NEW}/updates/dkms/nvidia.ko").unlink()
    os.utime(tmp_path / "root/boot", (5, 5))  # as an install or removal changes the tree's times
    broken = next_boot.ITEM.plan(ctx, "ready").plan
    assert broken.status is PlanStatus.DRIFT
    assert broken.changes == (f"{NEW}: nvidia 580.159.04 module missing (report-only: fix before rebooting)",)


def test_next_boot_verdict_is_kept_until_boot_changes(tmp_path: Path, backend: SimulatedBackend) -> None:
    ubuntu_tree(tmp_path / "root")
    ctx = host_with(tmp_path, backend)
    assert next_boot.ITEM.plan(ctx, "ready").plan.status is PlanStatus.IN_SYNC
    module = tmp_path / "root" / f"lib/modules/{NEW}/updates/dkms/nvidia.ko"
    module.unlink()  # /boot and /lib/modules themselves keep their times: the verdict is reused
    assert next_boot.ITEM.plan(ctx, "ready").plan.status is PlanStatus.IN_SYNC
    os.utime(tmp_path / "root/lib/modules", (7, 7))  # a kernel or module package installed
    assert next_boot.ITEM.plan(ctx, "ready").plan.status is PlanStatus.DRIFT


def test_plan_exits_2_when_the_next_boot_is_not_ready(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ubuntu_tree(root, module_for=None)
    config = tmp_path / "agent.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "backend": "simulated",
                "simulated": {"profile": "h200"},
                "host_root": str(root),
                "state_dir": str(tmp_path / "state"),
                "policy": {"node": {"next_boot": "ready"}},
            }
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "plan", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "next_boot" in done.stdout and "module missing" in done.stdout


def test_engine_plans_report_only_items_and_apply_leaves_them_failed(tmp_path: Path, backend: SimulatedBackend) -> None:
    ubuntu_tree(tmp_path / "root", module_for=None)
    config = AgentConfig.model_validate(
        {
            "backend": "simulated",
            "mode": "enforce",
            "host_root": str(tmp_path / "root"),
            "policy": {"node": {"next_boot": "ready", "driver": {"version": "580.159.04"}}},
            "services": [ServiceConfig(name="sglang", cuda_version="13.0").model_dump(exclude_defaults=True)],
        }
    )
    engine = PolicyEngine(config, backend, HostContext(HostPaths.at(tmp_path / "root")))
    plan = {p.item: p for p in engine.plan().items}
    assert plan["driver"].status is PlanStatus.IN_SYNC
    assert plan["next_boot"].status is PlanStatus.DRIFT
    results = {r.plan.item: r for r in engine.apply().results}
    assert results["next_boot"].outcome is ApplyOutcome.FAILED


def test_reboot_is_refused_when_the_next_boot_is_not_ready(tmp_path: Path, backend: SimulatedBackend) -> None:
    ubuntu_tree(tmp_path / "root", module_for=None)
    problem = next_boot_problem(host_with(tmp_path, backend))
    assert problem == f"{NEW} — nvidia 580.159.04 module missing"
    ubuntu_tree(tmp_path / "other")
    assert next_boot_problem(HostContext(HostPaths.at(tmp_path / "other"), backend=backend)) is None


def test_a_hung_next_boot_check_is_the_items_error_and_never_holds_the_plan(
    tmp_path: Path, backend: SimulatedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that hangs (a disk, a file on a dead mount) blocks the check's own worker: a plan waits
    for it at most the context's wait, counted from the check's start, and no second check starts."""
    ubuntu_tree(tmp_path / "root")
    release = threading.Event()
    started: list[float] = []
    real_check = next_boot.check_next_boot

    def hanging_check(*args: Any) -> Any:
        started.append(time.monotonic())
        release.wait(30)
        return real_check(*args)

    monkeypatch.setattr(next_boot, "check_next_boot", hanging_check)
    ctx = replace(host_with(tmp_path, backend), boot_check_wait_seconds=0.3)
    try:
        began = time.monotonic()
        first = next_boot.ITEM.plan(ctx, "ready").plan
        assert 0.25 <= time.monotonic() - began < 2.0
        assert first.status is PlanStatus.ERROR
        assert first.detail.startswith("the next-boot check is still running")
        began = time.monotonic()
        again = next_boot.ITEM.plan(ctx, "ready").plan  # waited once already: answered at once
        assert time.monotonic() - began < 0.2
        assert again.status is PlanStatus.ERROR
        monkeypatch.setattr(next_boot, "CHECK_DEADLINE_SECONDS", 0.5)
        time.sleep(0.5)
        hung = next_boot.ITEM.plan(ctx, "ready").plan
        assert hung.status is PlanStatus.ERROR
        assert "has not finished in" in hung.detail and "no new check starts" in hung.detail
        assert next_boot_problem(ctx) is not None and "could not be checked" in str(next_boot_problem(ctx))
        assert len(started) == 1
    finally:
        release.set()
    wait_until(lambda: next_boot.ITEM.plan(ctx, "ready").plan.status is PlanStatus.IN_SYNC, 5.0, "the check to end")
    assert len(started) == 1  # what the hung check found once it ended is the verdict


def test_a_next_boot_check_that_raises_is_the_items_error(
    tmp_path: Path, backend: SimulatedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("parser bug")

    monkeypatch.setattr(next_boot, "check_next_boot", broken)
    ubuntu_tree(tmp_path / "root")
    plan = next_boot.ITEM.plan(host_with(tmp_path, backend), "ready").plan
    assert (plan.status, plan.detail) == (PlanStatus.ERROR, "the next-boot check failed: parser bug")


# -- what the report-only items export -------------------------------------------------------------------


def test_metrics_and_status_show_the_next_boot_and_the_driver(tmp_path: Path, backend: SimulatedBackend) -> None:
    from metrics.test_metrics import render
    from snapshots import node_snapshot

    from agent.documents import snapshot_document
    from agent.textview import status_text

    ubuntu_tree(tmp_path / "root", module_for=None)
    ctx = host_with(tmp_path, backend)
    boot_plan = next_boot.ITEM.plan(ctx, "ready").plan
    driver_plan = driver.ITEM.plan(ctx, driver_want(version="580.159.04")).plan
    snapshot = node_snapshot(policy=(boot_plan, driver_plan))
    text = render(snapshot)
    # the kernel and the whole reason are in `status`; the label is a bounded code
    assert 'gpu_agent_boot_ready{cause="module_missing"} 0.0' in text.splitlines()
    assert 'gpu_agent_driver_info{branch="",cuda_version="13.0",version="580.159.04"} 1.0' in text.splitlines()
    screen = status_text(snapshot_document(snapshot, source="daemon"))
    assert f"next boot: {NEW} — nvidia 580.159.04 module missing" in screen
    assert "driver: 580.159.04, CUDA 13.0" in screen


# -- nouveau: the rebuild is verified in the next boot's initramfs -------------------------------------------


@pytest.mark.parametrize(("blacklisted_image", "expected"), [(True, PlanStatus.IN_SYNC), (False, PlanStatus.DRIFT)])
def test_nouveau_reads_the_next_boots_initramfs(
    tmp_path: Path, backend: SimulatedBackend, blacklisted_image: bool, expected: PlanStatus
) -> None:
    from agent.policy import nouveau

    root = tmp_path / "root"
    ubuntu_tree(root, blacklist=blacklisted_image)
    write(root, nouveau.CONF, nouveau.CONF_CONTENT)
    write(root, "/etc/os-release", "ID=ubuntu\n")
    write(root, "/proc/modules", "nvidia 1 0 - Live 0x0\n")
    done = nouveau.ITEM.plan(host_with(tmp_path, backend), "blacklisted")
    assert done.plan.status is expected
    if expected is PlanStatus.DRIFT:
        assert done.plan.changes == (f"run: update-initramfs -u -k {NEW}",)
        assert f"the initramfs of {NEW} (the next boot) still loads nouveau" in done.plan.detail


def test_next_boot_does_not_apply_where_the_kernel_comes_from_outside(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    (tmp_path / "root/boot").mkdir(parents=True)
    ctx = host_with(tmp_path, backend)
    plan = next_boot.ITEM.plan(ctx, "ready").plan
    assert plan.status is PlanStatus.NOT_APPLICABLE
    assert next_boot_problem(ctx) is None  # and a reboot is not refused for it
