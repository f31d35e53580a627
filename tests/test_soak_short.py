"""The soak (bench/soak.py) in CI: one simulated hour of random faults on 8 simulated GPUs, in seconds.

No exception anywhere, no event lost between the watchers and the store, no rule over its
max_attempts or inside its cooldown, and a Python heap that stops growing once warmed up. The
long run and its figures: `python3 -m bench.soak --hours 6`.
"""

from __future__ import annotations

from pathlib import Path

from bench.soak import run_soak

# A leak of one small object per GPU per loop (8 GPUs, 720 loops an hour) is several MiB an hour;
# the agent's own caches fill during the first half and stay flat after.
HEAP_SLOPE_LIMIT_KIB_PER_HOUR = 2048


def test_one_simulated_hour_of_random_faults(tmp_path: Path) -> None:
    result = run_soak(tmp_path, simulated_seconds=3600, profile="h200x8", seed=7)
    summary = result.summary()
    assert result.loops == 720 and result.gpus == 8
    assert result.exceptions == []
    assert sum(result.faults.values()) > 50, result.faults
    assert result.events_produced > 20 and result.events_lost == [], result.events_lost[:10]
    assert result.attempts_over_limit == []
    assert result.cooldown_violations == []
    assert sum(result.outcomes.values()) > 0, "the rules acted on some of the faults"
    slope = summary["heap_slope_kib_per_hour"]
    assert slope is not None and slope < HEAP_SLOPE_LIMIT_KIB_PER_HOUR, summary
    print(f"\nsoak: {summary}")
