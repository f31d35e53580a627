"""The two tiers of a sample: the slow tier's fields are named once, and a fast-tier sample carries them."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from agent.backend.sim import SimulatedBackend
from agent.collect import carry_slow_fields, sample_gpu
from agent.readings.table import SLOW_TIER_FIELDS
from agent.state import GpuSample


def test_the_slow_tier_fills_exactly_its_named_fields_and_a_fast_sample_carries_them(tmp_path: Path) -> None:
    backend = SimulatedBackend("h200x2", tmp_path)
    backend.init()
    full = sample_gpu(backend, 0, slow=True)
    fast = sample_gpu(backend, 0, slow=False)
    only_slow = {
        f.name for f in fields(GpuSample) if getattr(full, f.name) is not None and getattr(fast, f.name) is None
    }
    # retired pages on an H200; the fabric on a node without NVSwitches
    unsupported = {name for name in SLOW_TIER_FIELDS if getattr(full, name) is None}
    assert unsupported == {"retired_pages_pending", "fabric_state", "fabric_status"}
    assert only_slow == set(SLOW_TIER_FIELDS) - unsupported
    assert all(getattr(fast, name) is None for name in SLOW_TIER_FIELDS)
    carried = carry_slow_fields(full, fast)
    assert {name: getattr(carried, name) for name in SLOW_TIER_FIELDS} == {
        name: getattr(full, name) for name in SLOW_TIER_FIELDS
    }
    assert carried.temperature_celsius == fast.temperature_celsius
