"""The simulator's power curve (agent/backend/sim/physics.py): power follows the clock, a lower cap
lowers the clock a busy GPU reaches, and tokens per joule (work at the clock over the power) peak
inside the power-limit range on both built-in boards, as docs/simulator.md says."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.backend.base import ClockDomain
from agent.backend.sim import SimulatedBackend, load_profile
from agent.backend.sim.physics import busy_power_mw, capped_clock_ratio


def tokens_per_joule_by_limit(tmp_path: Path, profile: str) -> dict[float, float]:
    """Set each limit on a busy simulated GPU and read back its clock and power, as NVML would."""
    backend = SimulatedBackend(profile, tmp_path / profile, writable_items={"power_limit"})
    backend.init()
    backend.set_processes(0, [4242])
    low, high = backend.power_limit_constraints_watts(0)
    found: dict[float, float] = {}
    limit = low
    while limit <= high:
        backend.set_power_limit_watts(0, limit)
        found[limit] = backend.clock_mhz(0, ClockDomain.SM) / backend.power_usage_watts(0)
        limit += 10
    return found


@pytest.mark.parametrize(("profile", "best_watts"), [("h200", 320), ("rtx-pro-6000", 260)])
def test_tokens_per_joule_peak_inside_the_range(tmp_path: Path, profile: str, best_watts: float) -> None:
    curve = tokens_per_joule_by_limit(tmp_path, profile)
    limits = sorted(curve)
    best = max(curve, key=curve.__getitem__)
    assert limits[0] < best < limits[-1]
    assert abs(best - best_watts) <= 20  # docs/simulator.md's table
    assert curve[best] > 1.1 * curve[limits[0]] and curve[best] > 1.1 * curve[limits[-1]]


@pytest.mark.parametrize("profile", ["h200", "rtx-pro-6000"])
def test_power_follows_the_clock_and_a_cap_lowers_the_clock(tmp_path: Path, profile: str) -> None:
    model = load_profile(profile).models[0]
    ratios = [i / 10 for i in range(11)]
    powers = [busy_power_mw(model, x) for x in ratios]
    assert powers == sorted(powers) and powers[-1] == model.load_power_mw
    assert powers[0] < model.power_limit_constraints_mw[0]  # the lowest limit is reachable
    caps = [capped_clock_ratio(model, watts * 1000) for watts in (200, 300, 400, 500)]
    assert caps == sorted(caps) and 0 < caps[0] < caps[-1] < 1
    backend = SimulatedBackend(profile, tmp_path / "locked", writable_items={"locked_clocks"})
    backend.init()
    backend.set_processes(0, [4242])
    full = backend.power_usage_watts(0)
    half = model.max_clocks_mhz.graphics // 2 // 15 * 15
    backend.set_locked_clocks_mhz(0, ClockDomain.GRAPHICS, half, half)
    assert backend.power_usage_watts(0) < full * 0.6  # a locked lower clock draws less
