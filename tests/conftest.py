"""Fixtures shared by more than one test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nvml_replay import Replay, install_replay

from agent.backend.nvml import NvmlBackend


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch) -> Replay:
    """The recorded H200 answers in place of the NVML library."""
    return install_replay(monkeypatch)


@pytest.fixture
def backend(replay: Replay) -> Iterator[NvmlBackend]:
    """The NVML backend over the recorded H200 answers, initialised (a module whose tests need
    another backend defines its own `backend` fixture, which takes precedence)."""
    nvml = NvmlBackend()
    nvml.init()
    yield nvml
    nvml.shutdown()


#: The longest modules (packages, chroots, the systemd sandbox, the soak and the fault tables; each a
#: minute or more): with workers (scripts/test runs two, a module to a worker) they are handed out
#: first, so no worker is left with one of them at the end while the other idles. They alternate
#: between needing the packages and root file system and not: each worker starts with two modules,
#: and on a fresh host the first package module waits minutes for the build and debootstrap, which
#: a second one would wait for too. What they share outside their own directories is locked: the
#: package build (tests/test_packaging.py), the root file system and the one sandbox a host runs
#: (tests/systemd_sandbox.py).
LONGEST_MODULES = (
    "test_package_dist_upgrade.py",
    "test_soak_short.py",
    "test_package_e2e.py",
    "test_fault_agreement.py",
    "test_package_rpm_scriptlets.py",
    "test_fault_matrix.py",
    "test_package_nosystemd.py",
    "test_packaging.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a worker of pytest-xdist: one process alone keeps the usual order
        rank = {name: n for n, name in enumerate(LONGEST_MODULES)}
        items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable
