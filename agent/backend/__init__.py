"""GPU backends: the NVML one (real hardware) and the simulated one (tests, demo)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `agent.backend.errors` alone stays light: `gpu-agent status` imports it
    from agent.backend.base import GpuBackend
    from agent.config import AgentConfig


def open_backend(config: AgentConfig, writable_items: Iterable[str] | None = None) -> GpuBackend:
    """The configured backend, initialised. Only `writable_items` may be changed through it;
    by default the items the config puts in enforce mode."""
    writable = config.writable_items() if writable_items is None else frozenset(writable_items)
    backend: GpuBackend
    if config.backend == "simulated":
        from agent.backend.sim import SimulatedBackend

        backend = SimulatedBackend(
            config.simulated.profile,
            Path(config.state_dir),
            writable_items=writable,
            privileged=config.simulated.privileged,
            counter_clock=time.monotonic,  # energy, violation times and GPM grow while the node runs
        )
    else:
        from agent.backend.nvml import NvmlBackend

        backend = NvmlBackend(writable_items=writable)
    backend.init()
    return backend
