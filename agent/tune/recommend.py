"""Pure judgements over measured steps: is the traffic good enough to measure, did a step miss the
SLO, which setting to recommend and what it is expected to change.

Traffic: a step whose request rate is under the floor measures noise (too thin). The offered load
must stay put between steps, or a change in tokens/J is the traffic's, not the setting's. By
Little's law (in flight = rate x latency) a slower setting raises the latency, so one of the two
moves by design: open-loop traffic (users arriving on their own) keeps its request rate, a
benchmark's closed loop (N clients) keeps its requests in flight. A step where both moved more than
`max_traffic_change` from the first step is uneven, and the sweep stops.

The recommendation: among the steps within the SLO, the most tokens per joule whose tokens per
second stay within `throughput_tolerance` of the best seen at any step. It says the rule in words,
the SM clock it gives up (the headroom for a peak), when the step is at the edge of the range
measured and which way to extend it, and what the step with the most tokens per joule would cost
when the tolerance ruled it out. Its snippet is written against the profile in force.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from agent.config.service_entry import ServiceSlo
from agent.services.latency_cause import check_slo
from agent.state import ServiceFigures
from agent.tune.defaults import KNOB_UNITS
from agent.tune.model import Recommendation, StepReading, SweptGpu, TuneDocument, TuneKind


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


def percent(ratio: float) -> str:
    """0.05 -> "5 %", as the rule is written."""
    return f"{ratio * 100:g} %"


def rule_text(tolerance: float, slo: dict[str, float]) -> str:
    """The rule the recommendation applies, in words."""
    latency = "p95 under the objective" if slo else "no latency objective to hold (services[].slo sets one)"
    return f"most tokens per joule with {latency} and tokens/s within {percent(tolerance)} of the best"


def recommend(document: TuneDocument) -> tuple[Recommendation | None, str]:
    """The recommended step and why; (None, why not) when no step qualifies."""
    request, steps = document.request, document.steps
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
        return None, f"no step within the SLO kept tokens/s within {percent(request.throughput_tolerance)} of the best"
    chosen = max(candidates, key=lambda s: s.tokens_per_joule or 0.0)
    base = baseline(steps)
    unit = KNOB_UNITS[request.kind]
    rule = rule_text(request.throughput_tolerance, document.slo)
    e2e_change = None
    if base is not None and base.e2e_p95_seconds is not None and chosen.e2e_p95_seconds is not None:
        e2e_change = chosen.e2e_p95_seconds - base.e2e_p95_seconds
    gpu_model = document.swept[0].model if document.swept else "*"
    recommendation = Recommendation(
        setting=chosen.setting,
        gpu_model=gpu_model,
        snippet=snippet(request.kind, chosen.setting, document.swept),
        tokens_per_joule_change_ratio=_ratio(chosen.tokens_per_joule, base.tokens_per_joule if base else None),
        tokens_per_second_change_ratio=_ratio(chosen.tokens_per_second, base.tokens_per_second if base else None),
        e2e_p95_change_seconds=e2e_change,
        reason=f"{chosen.setting:g} {unit}: {rule} ({best_tps:.1f}/s)",
        rule=rule,
        sm_clock_change_ratio=_ratio(chosen.mean_sm_mhz, base.mean_sm_mhz if base else None),
        edge=edge(document, chosen, measured),
        tradeoff=tradeoff(document, chosen, within_slo, best_tps, base),
        targets=targets(document.swept),
    )
    return recommendation, recommendation.reason


def edge(document: TuneDocument, chosen: StepReading, measured: Sequence[StepReading]) -> str:
    """When the chosen step is the lowest or highest setting measured, the best may lie beyond it:
    which way, and the flag (and value) that extends the sweep there; or that the board goes no further."""
    request = document.request
    settings = sorted({s.setting for s in measured})
    if len(settings) < 2 or chosen.setting not in (settings[0], settings[-1]):
        return ""
    unit = KNOB_UNITS[request.kind]
    lower = chosen.setting == settings[0]
    where = "lowest" if lower else "highest"
    bound = None if document.setting_range is None else document.setting_range[0 if lower else 1]
    if bound is not None and (chosen.setting <= bound if lower else chosen.setting >= bound):
        return f"{chosen.setting:g} {unit} is the {where} setting measured and the board's {where}: nothing beyond it"
    beyond = chosen.setting - request.step if lower else chosen.setting + request.step
    if bound is not None:
        beyond = max(beyond, bound) if lower else min(beyond, bound)
    # The flag that moves that end: a descending sweep ends low (--to), an ascending one starts low (--from).
    flag = "--to" if lower == (request.stop < request.start) else "--from"
    direction = "below" if lower else "above"
    return (
        f"{chosen.setting:g} {unit} is the {where} setting measured: the best may lie {direction} it"
        f" (extend the sweep with {flag} {beyond:g})"
    )


def tradeoff(
    document: TuneDocument,
    chosen: StepReading,
    within_slo: Sequence[StepReading],
    best_tps: float,
    base: StepReading | None,
) -> str:
    """The step with the most tokens per joule within the objective, when the tolerance ruled it
    out: what it gains and costs against the current setting, and the tolerance that takes it."""
    efficient = max(within_slo, key=lambda s: s.tokens_per_joule or 0.0)
    if efficient.setting == chosen.setting or efficient.tokens_per_second is None or best_tps <= 0:
        return ""
    unit = KNOB_UNITS[document.request.kind]
    short = 1.0 - efficient.tokens_per_second / best_tps
    gains = [
        f"{change * 100:+.1f} % {what}"
        for change, what in (
            (_ratio(efficient.tokens_per_joule, base.tokens_per_joule if base else None), "tokens/J"),
            (_ratio(efficient.tokens_per_second, base.tokens_per_second if base else None), "tokens/s"),
        )
        if change is not None
    ]
    needed = math.ceil(short * 100) / 100
    return (
        f"the most tokens per joule within the objective is at {efficient.setting:g} {unit}"
        + (f" ({', '.join(gains)} against the current setting)" if gains else "")
        + f", but its tokens/s are {short * 100:.1f} % under the best, outside the"
        f" {percent(document.request.throughput_tolerance)} tolerance (--tolerance {needed:g} takes it)"
    )


def targets(swept: Sequence[SweptGpu]) -> str:
    """What the recommendation is for: the model when every GPU of it was swept, else the GPUs."""
    whole = sorted({g.model for g in swept if g.whole_model})
    parts = [f"every {model} (GPU {', '.join(str(g.gpu) for g in swept if g.model == model)})" for model in whole]
    parts += [f"GPU {g.gpu} ({g.uuid})" for g in swept if not g.whole_model]
    return "; ".join(parts)


# -- the agent.yaml snippet, written against the profile in force ------------------------------------


def knob_settings(kind: str, setting: float, settings: dict[str, Any]) -> dict[str, Any]:
    """The key a recommendation sets, as agent.yaml spells it: a clock lock keeps its memory clocks."""
    value = round(setting)
    if kind == "power":
        return {"power_limit_watts": value}
    locked = dict(settings.get("locked_clocks") or {})
    locked["gpu_mhz"] = [value, value]
    return {"locked_clocks": {"gpu_mhz": locked.pop("gpu_mhz"), **locked}}


def yaml_lines(match: str, settings: dict[str, Any], comment: str = "") -> list[str]:
    """One profile as a `policy.gpus` entry (JSON flow values, which YAML reads as they are)."""
    lines = [f"    - match: {match}" + (f"  # {comment}" if comment else "")]
    return lines + [f"      {key}: {_flow(value)}" for key, value in settings.items()]


#: Words YAML reads as something other than a string: a plain word among these is quoted.
_YAML_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"})


def _flow(value: Any) -> str:
    """A value as agent.yaml spells it: flow mappings and lists, a plain word bare, the rest quoted."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_flow(inner)}" for key, inner in value.items()) + "}"
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", value) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)


def snippet(kind: TuneKind, setting: float, swept: Sequence[SweptGpu]) -> str:
    """The agent.yaml lines that make the recommendation the policy of exactly the swept GPUs: the
    key to change in their profile where that profile is theirs alone, else a profile of their own
    (by model when every GPU of it was swept, else by uuid) to put before it, with every other key
    of the profile in force copied, since the first matching profile wins."""
    lines = ["policy:", "  gpus:"]
    groups: dict[int | None, list[SweptGpu]] = {}
    for gpu in swept:
        groups.setdefault(gpu.profile, []).append(gpu)
    for number, members in groups.items():
        first = members[0]
        if number is not None and first.profile_alone:
            knob = knob_settings(kind, setting, first.settings)
            lines += yaml_lines(first.profile_match, knob, f"policy.gpus[{number}]: change this key")
            continue
        where = f"before policy.gpus[{number}], its other keys copied" if number is not None else "no profile had it"
        models = {g.model for g in members}
        if all(g.whole_model for g in members) and len(models) == 1:
            entries = [(f"{{model: {json.dumps(first.model)}}}", first.settings)]
        else:
            entries = [(f"{{uuid: {json.dumps(g.uuid)}}}", g.settings) for g in members]
        for match, settings in entries:
            lines += yaml_lines(match, {**settings, **knob_settings(kind, setting, settings)}, where)
    return "\n".join(lines)
