"""Driver facts read under host_root: package branch, fabric manager match, CUDA and VBIOS comparisons."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.host.driver import (
    cuda_supported,
    cuda_version_text,
    driver_packages,
    fabric_manager_matches,
    vbios_tuple,
    version_tuple,
)
from agent.host.paths import HostPaths


def dpkg_status(root: Path, packages: dict[str, str], status: str = "install ok installed") -> HostPaths:
    stanzas = [
        f"Package: {name}\nStatus: {status}\nArchitecture: amd64\nVersion: {v}\n" for name, v in packages.items()
    ]
    path = root / "var/lib/dpkg/status"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(stanzas))
    return HostPaths.at(root)


@pytest.mark.parametrize(
    ("package", "branch"),
    [
        ("nvidia-driver-580-server", "datacenter"),
        ("nvidia-driver-580-server-open", "datacenter"),
        ("nvidia-driver-580", "desktop"),
        ("nvidia-driver-580-open", "desktop"),
    ],
)
def test_branch_from_the_ubuntu_package_name(tmp_path: Path, package: str, branch: str) -> None:
    found = driver_packages(dpkg_status(tmp_path, {package: "580.159.04-0ubuntu1", "libc6": "2.39"}))
    assert found.driver == (package, "580.159.04-0ubuntu1")
    assert found.branch == branch


def test_removed_packages_do_not_count(tmp_path: Path) -> None:
    paths = dpkg_status(tmp_path, {"nvidia-driver-580": "580.1"}, status="deinstall ok config-files")
    assert driver_packages(paths).driver is None
    assert driver_packages(paths).branch is None


def test_cuda_repository_means_datacenter_and_fabric_manager_is_found(tmp_path: Path) -> None:
    paths = dpkg_status(
        tmp_path,
        {
            "cuda-drivers-580": "580.159.04-1",
            "nvidia-fabricmanager-580": "580.159.04-1",
            "nvidia-driver-580": "580.159.04-1",
        },
    )
    found = driver_packages(paths)
    assert found.branch == "datacenter"
    assert fabric_manager_matches("580.159.04", found.fabric_manager) is True
    assert fabric_manager_matches("580.172.08", found.fabric_manager) is False


def test_no_package_database_and_no_tools_tells_nothing(tmp_path: Path) -> None:
    found = driver_packages(HostPaths.at(tmp_path))
    assert (found.driver, found.fabric_manager, found.branch) == (None, None, None)
    assert fabric_manager_matches("580.159.04", None) is None


def test_rpm_is_asked_only_through_the_tool_runner(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def run(argv: list[str]) -> str | None:
        calls.append(argv)
        return "nvidia-driver 580.159.04\nnvidia-fabricmanager 580.159.04\n"

    found = driver_packages(HostPaths.at(tmp_path), run)
    assert calls and calls[0][0] == "rpm"
    assert found.driver == ("nvidia-driver", "580.159.04")
    assert fabric_manager_matches("580.159.04", found.fabric_manager)


def test_versions_and_cuda() -> None:
    assert version_tuple("1:580.159.04-0ubuntu1") == (580, 159, 4)
    assert version_tuple("580.159.04") > version_tuple("580.95.05")
    assert cuda_version_text(13000) == "13.0" and cuda_version_text(12080) == "12.8"
    assert cuda_supported("12.8", "12.4") and cuda_supported("13.0", "13.0")
    assert not cuda_supported("12.2", "12.4")


def test_vbios_compares_as_hex_parts() -> None:
    assert vbios_tuple("96.00.AF.00.01") > vbios_tuple("96.00.9F.00.04")
    with pytest.raises(ValueError, match="dotted hex"):
        vbios_tuple("not-a-version")
