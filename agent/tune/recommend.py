"""Pure judgements over measured steps: is the traffic good enough to measure, did a step miss the
SLO, which setting to recommend and what it is expected to change.

Traffic: a step whose request rate is under the floor measures noise (too thin). The offered load
must stay put between steps, or a change in tokens/J is the traffic's, not the setting's. By
Little's law (in flight = rate x latency) a slower setting raises the latency, so one of the two
moves by design: open-loop traffic (users arriving on their own) keeps its request rate, a
benchmark's closed loop (N clients) keeps its requests in flight. A step where both moved more than
`max_traffic_change` from the first step is uneven, and the sweep stops.

The recommendation: among the steps within the SLO, the best tokens per joule whose tokens per
second stay within `throughput_tolerance` of the best seen at any step.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.config import ServiceSlo
from agent.services.latency_cause import check_slo
from agent.services.window import ServiceFigures
from agent.tune.defaults import KNOB_UNITS
from agent.tune.model import Recommendation, StepReading, TuneKind, TuneRequest


def slo_breaches(slo: ServiceSlo | None, figures: ServiceFigures | None) -> tuple[str, ...]:
    """The objectives a step's window misses, as text ("e2e_p95 1.92 s > 1.5 s")."""
    return tuple(f"{b.objective} {b.observed_seconds:.3g} s > {b.limit_seconds:g} s" for b in check_slo(slo, figures))


def thin_traffic(step: StepReading, min_request_rate: float) -> str | None:
    """Why the step's traffic is too thin to measure, or None."""
    if step.request_rate is None:
        return "the server's metrics show no finished requests (no e2e latency histogram)"
    if step.request_rate < min_request_rate:
        return f"{step.request_rate:.2f} requests/s, below the floor of {min_request_rate:g}/s"
    return None


def _changed(value: float | None, reference: float | None, limit: float) -> bool:
    if value is None or reference is None or reference <= 0:
        return True
    return abs(value / reference - 1.0) > limit


def uneven_traffic(first: StepReading, step: StepReading, max_change: float) -> str | None:
    """Why the offered load moved between `first` and `step`, or None (see the module docstring)."""
    rate_moved = _changed(step.request_rate, first.request_rate, max_change)
    flight_moved = _changed(step.requests_in_flight, first.requests_in_flight, max_change)
    if rate_moved and flight_moved:
        return (
            f"the offered load moved: {_num(first.request_rate)} -> {_num(step.request_rate)} requests/s and"
            f" {_num(first.requests_in_flight)} -> {_num(step.requests_in_flight)} in flight"
            f" (more than {max_change:.0%} both)"
        )
    return None


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def baseline(steps: Sequence[StepReading]) -> StepReading | None:
    return next((s for s in steps if s.baseline), None)


def _ratio(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old <= 0:
        return None
    return new / old - 1.0


def snippet(kind: TuneKind, setting: float, gpu_model: str) -> str:
    """The agent.yaml lines that make the recommendation the node's policy for that GPU model."""
    value = round(setting)
    knob = f"power_limit_watts: {value}" if kind == "power" else f"locked_clocks: {{gpu_mhz: [{value}, {value}]}}"
    return f'policy:\n  gpus:\n    - match: {{model: "{gpu_model}"}}\n      {knob}'


def recommend(request: TuneRequest, steps: Sequence[StepReading], gpu_model: str) -> tuple[Recommendation | None, str]:
    """The recommended step and why; (None, why not) when no step qualifies."""
    measured = [s for s in steps if s.tokens_per_joule is not None and s.tokens_per_second is not None]
    if not measured:
        return None, "no step measured tokens per joule"
    within_slo = [s for s in measured if not s.slo_breaches]
    if not within_slo:
        return None, "every step missed the service's SLO"
    best_tps = max(s.tokens_per_second or 0.0 for s in measured)
    floor = best_tps * (1.0 - request.throughput_tolerance)
    candidates = [s for s in within_slo if (s.tokens_per_second or 0.0) >= floor]
    if not candidates:
        return None, f"no step within the SLO kept tokens/s within {request.throughput_tolerance:.0%} of the best"
    chosen = max(candidates, key=lambda s: s.tokens_per_joule or 0.0)
    base = baseline(steps)
    unit = KNOB_UNITS[request.kind]
    reason = (
        f"best tokens/J within the SLO with tokens/s within {request.throughput_tolerance:.0%}"
        f" of the best seen ({best_tps:.1f}/s)"
    )
    e2e_change = None
    if base is not None and base.e2e_p95_seconds is not None and chosen.e2e_p95_seconds is not None:
        e2e_change = chosen.e2e_p95_seconds - base.e2e_p95_seconds
    recommendation = Recommendation(
        setting=chosen.setting,
        gpu_model=gpu_model,
        snippet=snippet(request.kind, chosen.setting, gpu_model),
        tokens_per_joule_change_ratio=_ratio(chosen.tokens_per_joule, base.tokens_per_joule if base else None),
        tokens_per_second_change_ratio=_ratio(chosen.tokens_per_second, base.tokens_per_second if base else None),
        e2e_p95_change_seconds=e2e_change,
        reason=f"{chosen.setting:g} {unit}: {reason}",
    )
    return recommendation, recommendation.reason
