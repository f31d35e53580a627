"""The NVIDIA driver the node runs (report-only: the agent never installs or removes drivers).

`policy.node.driver: {version: 580.159.04}` or `{min_version: 580.95, branch: datacenter}`; the
loaded version is NVML's answer (the kernel module's, from /proc/driver/nvidia/version, when NVML
cannot be asked). The same item carries the checks whose fix is a driver change:

- every service's `cuda_version` (the CUDA its image was built for) must be supported by the
  driver, so a driver downgrade is seen before the service crashes on start;
- on NVSwitch systems (HGX) the fabric manager must be installed at the driver's exact version:
  a mismatch after a driver update leaves every GPU unable to run CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agent.backend.errors import GpuError
from agent.config import AgentConfig
from agent.config.desired import DriverPolicy, NodePolicy
from agent.host import file_reads
from agent.host.boot_readiness import host_tool_runner, running_driver_version
from agent.host.driver import (
    cuda_supported,
    cuda_version_text,
    driver_packages,
    fabric_manager_matches,
    version_tuple,
)
from agent.policy.base import HostContext
from agent.policy.item import HostItem, Planned, planned
from agent.policy.plan import CUDA_TOO_OLD_FACT, ItemPlan, PlanStatus
from agent.policy.report_only import OperatorTask, refuse

_WHY = "the agent never installs or removes drivers"


@dataclass(frozen=True)
class DriverWant:
    policy: DriverPolicy
    services_cuda: tuple[tuple[str, str], ...]  # (service, CUDA version its image was built for)


def _desired_text(policy: DriverPolicy) -> str:
    parts = [policy.version or (f">= {policy.min_version}" if policy.min_version else "any")]
    if policy.branch:
        parts.append(policy.branch)
    return " ".join(parts)


NVIDIA_PCI_VENDOR = "0x10de"
#: NVSwitch chips are PCI bridges of class "other" (0x0680). The driver registers its
#: `nvidia-nvswitch` character device (/proc/devices) even where there is no switch, as on a
#: single-GPU H200 VM, so only the PCI devices themselves tell.
NVSWITCH_PCI_CLASS = "0x0680"
_ATTRIBUTE_LIMIT_BYTES = 4096


def _nvswitch_present(ctx: HostContext) -> bool:
    devices = ctx.paths.path("/sys/bus/pci/devices")
    try:
        entries = sorted(devices.iterdir())
    except OSError:
        return False
    for entry in entries:
        try:
            vendor = file_reads.read_text(entry / "vendor", _ATTRIBUTE_LIMIT_BYTES).strip()
            pci_class = file_reads.read_text(entry / "class", _ATTRIBUTE_LIMIT_BYTES).strip()
        except OSError:
            continue
        if vendor == NVIDIA_PCI_VENDOR and pci_class.startswith(NVSWITCH_PCI_CLASS):
            return True
    return False


class DriverItem(HostItem[DriverWant, OperatorTask]):
    name: Final = "driver"

    def desired(self, node: NodePolicy, config: AgentConfig) -> DriverWant | None:
        services = tuple((s.name, s.cuda_version) for s in config.services if s.cuda_version)
        # On real GPUs the item always runs: with nothing pinned it is in sync and still reports the
        # loaded driver, its branch and CUDA version (status, gpu_agent_driver_info).
        if node.driver is None and not services and config.backend != "nvml":
            return None
        return DriverWant(node.driver or DriverPolicy(), services)

    def _loaded(self, ctx: HostContext) -> tuple[str | None, str | None, GpuError | None]:
        """(driver version, CUDA version it supports, why a read failed); NVML first, the kernel
        module's file when NVML cannot be asked."""
        if ctx.backend is None:
            return running_driver_version(ctx.paths), None, None
        try:
            version = ctx.backend.driver_version()
            cuda = cuda_version_text(ctx.backend.cuda_driver_version())
        except GpuError as exc:
            return running_driver_version(ctx.paths), None, exc
        return version, cuda, None

    def plan(self, ctx: HostContext, want: DriverWant) -> Planned[OperatorTask]:
        desired = _desired_text(want.policy)
        version, cuda, failed = self._loaded(ctx)
        if version is None or failed is not None:
            # What was asked cannot be told: an error, never a guess from half the answers.
            why = f"the driver could not be read: {failed}" if failed else "no NVIDIA driver is loaded"
            kind = failed.kind.value if failed else None
            return planned(
                ItemPlan(self.name, None, PlanStatus.ERROR, desired, version or "not loaded", why, error_kind=kind)
            )
        packages = driver_packages(ctx.paths, host_tool_runner(ctx.paths))
        branch = packages.branch
        actual = " ".join([version, f"({branch or 'branch unknown'}, CUDA {cuda or '?'})"])
        tasks: list[OperatorTask] = []
        policy = want.policy
        if policy.version is not None and version_tuple(version) != version_tuple(policy.version):
            tasks.append(OperatorTask(f"install NVIDIA driver {policy.version} (loaded: {version})", _WHY))
        if policy.min_version is not None and version_tuple(version) < version_tuple(policy.min_version):
            tasks.append(OperatorTask(f"install NVIDIA driver {policy.min_version} or newer (loaded: {version})", _WHY))
        if policy.branch is not None and branch is not None and branch != policy.branch:
            tasks.append(OperatorTask(f"install the {policy.branch} driver branch (installed: {branch})", _WHY))
        too_old = [
            f"{service} needs CUDA {needs}; driver {version} supports CUDA {cuda}"
            for service, needs in want.services_cuda
            if cuda is not None and not cuda_supported(cuda, needs)
        ]
        tasks += [OperatorTask(text, _WHY) for text in too_old]
        if _nvswitch_present(ctx):
            matches = fabric_manager_matches(version, packages.fabric_manager)
            if matches is None:
                tasks.append(OperatorTask(f"install nvidia-fabricmanager {version} (NVSwitch system)", _WHY))
            elif not matches:
                installed = packages.fabric_manager[1] if packages.fabric_manager else "?"
                tasks.append(OperatorTask(f"install nvidia-fabricmanager {version} (installed: {installed})", _WHY))
        facts: tuple[tuple[str, str], ...] = (
            ("version", version),
            ("branch", branch or ""),
            ("cuda_version", cuda or ""),
        )
        if too_old:
            # the verdict's "driver too old" line (agent/verdict.py), whatever the item's mode
            facts += ((CUDA_TOO_OLD_FACT, "; ".join(too_old)),)
        notes = []
        if policy.branch is not None and branch is None:
            notes.append("the branch cannot be told from the installed packages")
        detail = "; ".join(notes)
        if tasks:
            return planned(ItemPlan(self.name, None, PlanStatus.DRIFT, desired, actual, detail, facts=facts), tasks)
        status = PlanStatus.ERROR if notes else PlanStatus.IN_SYNC
        return planned(ItemPlan(self.name, None, status, desired, actual, detail, facts=facts))

    def apply(self, ctx: HostContext, changes: Sequence[OperatorTask]) -> str:
        return refuse(changes)


ITEM: Final = DriverItem()
