"""GPU backends: the NVML one (real hardware) and the simulated one (tests, demo)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `agent.backend.errors` alone stays light: `gpu-agent status` imports it
    from agent.backend.base import GpuBackend
    from agent.config import AgentConfig


def load_checked_config(path: str | Path, dropin_edits: Mapping[str, str | None] | None = None) -> AgentConfig:
    """The config in `path` (agent.config.load_config) with the check only the simulator can make: a
    `simulated.profile` that does not load is a ConfigError naming the file, line and key, so
    check-config, `run` and a reload report it instead of the backend failing when it opens. Then
    the policy drop-ins beside it (agent.policy.dropins; `dropin_edits` as `with_dropins` takes them)."""
    from agent.config import load_config
    from agent.policy.dropins import with_dropins

    config = load_config(path, checks=[(("simulated", "profile"), _validate_profile)])
    return with_dropins(config, path, dropin_edits)


def _validate_profile(value: Any) -> str:
    # The simulator loads only for a config that names a profile: an NVML node's config never does.
    from agent.backend.sim.profiles import validate_profile

    return validate_profile(value)


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
