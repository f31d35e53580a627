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


#: The longest modules (packages, chroots, the systemd sandbox; each a minute or more): with workers
#: (scripts/test runs two, a module to a worker) they are handed out first, so no worker is left
#: with one of them at the end while the other idles. What they share outside their own
#: directories is locked: the package build (tests/test_packaging.py), the root file system and
#: the one sandbox a host runs (tests/systemd_sandbox.py).
LONGEST_MODULES = (
    "test_package_dist_upgrade.py",
    "test_package_e2e.py",
    "test_package_rpm_scriptlets.py",
    "test_package_nosystemd.py",
    "test_packaging.py",
    "test_soak_short.py",
    "test_fault_agreement.py",
    "test_fault_matrix.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a worker of pytest-xdist: one process alone keeps the usual order
        rank = {name: n for n, name in enumerate(LONGEST_MODULES)}
        items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable
