"""Fixtures shared by more than one test module."""

from __future__ import annotations

from collections.abc import Iterator

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
