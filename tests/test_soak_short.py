"""The soak (bench/soak.py) in CI: one simulated hour of random faults on 8 simulated GPUs, in seconds,
with a `manager: command` service and two daemon restarts.

No exception anywhere, no event lost between the watchers and the store, no rule over its
max_attempts or inside its cooldown, and a Python heap that stops growing once warmed up. The caps
are judged from the hook's own log of its runs (simulated time, GPU), not from the store the agent
writes, so a storm protection that forgets attempts (across a restart, or at all) fails here. The
long run and its figures: `python3 -m bench.soak --hours 6`.
"""

from __future__ import annotations

from pathlib import Path

from bench.soak import HOOK_MAX_ATTEMPTS, HOOK_RULE, run_soak

# A leak of one small object per GPU per loop (8 GPUs, 720 loops an hour) is several MiB an hour;
# the agent's own caches fill during the first half and stay flat after.
HEAP_SLOPE_LIMIT_KIB_PER_HOUR = 2048


def test_one_simulated_hour_of_random_faults(tmp_path: Path) -> None:
    result = run_soak(tmp_path, simulated_seconds=3600, profile="h200x8", seed=7, restart_every_loops=240)
    summary = result.summary()
    assert result.loops == 720 and result.gpus == 8
    assert result.daemon_restarts == 2
    assert result.exceptions == []
    assert sum(result.faults.values()) > 50, result.faults
    assert result.events_produced > 20 and result.events_lost == [], result.events_lost[:10]
    # the hook really ran, and more than once on some GPU: the caps were tested, not idle
    assert result.hook_runs > 8, summary
    seen, limit = result.max_attempts_in_window[f"{HOOK_RULE} (hook log)"]
    assert 2 <= seen <= limit == HOOK_MAX_ATTEMPTS, summary
    assert result.attempts_over_limit == []
    assert result.cooldown_violations == []
    assert result.service_restarts > 0, "the service restart path ran against a real command service"
    assert sum(result.outcomes.values()) > 0, "the rules acted on some of the faults"
    slope = summary["heap_slope_kib_per_hour"]
    assert slope is not None and slope < HEAP_SLOPE_LIMIT_KIB_PER_HOUR, summary
    print(f"\nsoak: {summary}")
