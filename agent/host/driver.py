"""What the installed NVIDIA driver is, and whether it is the one the node should run (report-only:
the agent never installs or removes drivers).

- The loaded driver's version comes from NVML (or /proc/driver/nvidia/version without it).
- Its branch can be told from the package that installed it: Ubuntu's `nvidia-driver-NNN-server`
  (and `-server-open`) is the datacenter (production) branch; a plain `nvidia-driver-NNN` is the
  desktop branch (Game Ready/Studio); NVIDIA's CUDA repository ships `cuda-drivers` and datacenter
  builds. The dpkg status file is read under host_root; on RPM systems `rpm -q` runs only when the
  host root is `/`. When nothing tells it, the branch is unknown (None), never guessed.
- On NVSwitch systems (HGX) the fabric manager's version must equal the driver's: after a driver
  update without the matching fabric manager, CUDA cannot start on any GPU.
- The CUDA version a driver supports (NVML's `nvmlSystemGetCudaDriverVersion`, e.g. 13000 -> 13.0)
  must be at least the version each service's image was built for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.host.boot_readiness import ToolRunner
from agent.host.paths import HostPaths

DPKG_STATUS = "/var/lib/dpkg/status"
# A host with thousands of packages has a status file of a few MB; far more is not dpkg's.
_DPKG_STATUS_LIMIT_BYTES = 64 * 1024 * 1024
_RPM_QUERY = ["rpm", "-qa", "--qf", "%{NAME} %{VERSION}\n", "nvidia-driver*", "cuda-drivers*", "nvidia-fabric*"]


@dataclass(frozen=True)
class DriverPackages:
    driver: tuple[str, str] | None  # (package name, version) of the installed driver package
    fabric_manager: tuple[str, str] | None
    cuda_drivers: bool  # NVIDIA's CUDA-repository meta package is installed

    @property
    def branch(self) -> str | None:
        """ "datacenter" | "desktop" | None (cannot be told)."""
        if self.cuda_drivers:
            return "datacenter"
        if self.driver is None:
            return None
        name = self.driver[0]
        if re.fullmatch(r"nvidia-driver-\d+-server(-open)?", name):
            return "datacenter"
        if re.fullmatch(r"nvidia-driver-\d+(-open)?", name):
            return "desktop"
        return None


def version_tuple(version: str) -> tuple[int, ...]:
    """`580.159.04` -> (580, 159, 4); a Debian revision (`-0ubuntu1`) or epoch is dropped."""
    version = version.split(":", 1)[-1].split("-", 1)[0]
    return tuple(int(part) for part in re.findall(r"\d+", version))


def _dpkg_installed(paths: HostPaths) -> dict[str, str]:
    try:
        text = paths.read_text(DPKG_STATUS, _DPKG_STATUS_LIMIT_BYTES)
    except (OSError, UnicodeDecodeError):
        return {}
    installed: dict[str, str] = {}
    for stanza in text.split("\n\n"):
        fields = dict(
            (key.strip(), value.strip())
            for key, sep, value in (line.partition(":") for line in stanza.splitlines())
            if sep
        )
        if fields.get("Status", "").endswith("installed") and "Package" in fields:
            installed[fields["Package"]] = fields.get("Version", "")
    return installed


def _rpm_installed(run: ToolRunner | None) -> dict[str, str]:
    answer = run(_RPM_QUERY) if run is not None else None
    if not answer:
        return {}
    return dict(line.split(None, 1) for line in answer.splitlines() if len(line.split(None, 1)) == 2)


def driver_packages(paths: HostPaths, run: ToolRunner | None = None) -> DriverPackages:
    installed = _dpkg_installed(paths) or _rpm_installed(run)
    drivers = sorted(
        (name, version) for name, version in installed.items() if re.fullmatch(r"nvidia-driver(-\d+)?(-\S+)?", name)
    )
    fabric = sorted((name, version) for name, version in installed.items() if name.startswith("nvidia-fabricmanager"))
    cuda = any(name.startswith("cuda-drivers") for name in installed)
    return DriverPackages(drivers[-1] if drivers else None, fabric[-1] if fabric else None, cuda)


def cuda_version_text(nvml_value: int) -> str:
    """NVML's CUDA driver version integer (13000) as `13.0`."""
    return f"{nvml_value // 1000}.{nvml_value % 1000 // 10}"


def cuda_supported(driver_cuda: str, image_cuda: str) -> bool:
    """A driver runs images built for its CUDA major.minor or older (without the forward-compatibility
    package, which a host-level check cannot see)."""
    return version_tuple(driver_cuda)[:2] >= version_tuple(image_cuda)[:2]


def fabric_manager_matches(driver_version: str, fabric: tuple[str, str] | None) -> bool | None:
    """None when no fabric manager is installed (fine on PCIe boards; the caller decides for NVSwitch)."""
    if fabric is None:
        return None
    return version_tuple(fabric[1])[:3] == version_tuple(driver_version)[:3]


def vbios_tuple(vbios: str) -> tuple[int, ...]:
    """VBIOS versions are dotted hex (`96.00.AF.00.01`): compare part by part as numbers."""
    parts = vbios.strip().split(".")
    try:
        return tuple(int(part, 16) for part in parts)
    except ValueError as exc:
        raise ValueError(f"not a VBIOS version: {vbios!r} (expected dotted hex like 96.00.AF.00.01)") from exc
