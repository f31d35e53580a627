"""Fan curve: drive each fan of an air-cooled board from the GPU temperature instead of the
vBIOS's own curve, which favours quiet over headroom. Fan-less (SXM) boards have nothing to do.

The module plans against the temperature of the moment; re-evaluating the curve as the
temperature moves is the daemon's loop. The target set at each step is remembered in
`ctx.item_state` so hysteresis can hold it while the GPU cools by less than the margin.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from agent.backend.errors import GpuError, GpuErrorKind
from agent.config import FanCurve, GpuProfile
from agent.policy.base import GpuContext, ItemPlan, ItemResult, Outcome, PlanStatus
from agent.policy.gpu_item import guarded_apply, guarded_plan, guarded_restore, not_applicable_plan

NAME = "fan_curve"
_NO_FANS = "has no fans: no fan curve to enforce"
_MISSING = "has no software-controllable fans: no fan curve to enforce"
# A fan at a manual speed reads back within a point or two of what was set; closer is in sync.
_SPEED_TOLERANCE_PERCENT = 2


@dataclass(frozen=True)
class _Target:
    """The speed the curve asked for and the temperature that asked, for hysteresis."""

    curve: FanCurve
    percent: int
    set_at_celsius: int


def desired(profile: GpuProfile) -> FanCurve | None:
    return profile.fan_curve


def _curve_text(curve: FanCurve) -> str:
    return "curve " + ", ".join(f"{celsius} C {percent}%" for celsius, percent in curve.points)


def _curve_percent(curve: FanCurve, celsius: int) -> int:
    """Linear between points, flat below the first and above the last; whole percent, halves up."""
    points = curve.points
    if celsius <= points[0][0]:
        return points[0][1]
    for (low_celsius, low_percent), (high_celsius, high_percent) in itertools.pairwise(points):
        if celsius <= high_celsius:
            fraction = (celsius - low_celsius) / (high_celsius - low_celsius)
            return math.floor(low_percent + (high_percent - low_percent) * fraction + 0.5)
    return points[-1][1]


def _target(ctx: GpuContext, curve: FanCurve, celsius: int) -> _Target:
    """The curve's speed at `celsius`, except that a falling temperature only lowers the speed
    once it is `hysteresis_celsius` below the temperature that set the current one, so a GPU
    hovering around a point does not make the fans hunt."""
    percent = _curve_percent(curve, celsius)
    held = ctx.item_state.get(NAME)
    if isinstance(held, _Target) and held.curve == curve:
        cooled_enough = celsius <= held.set_at_celsius - curve.hysteresis_celsius
        if percent == held.percent or (percent < held.percent and not cooled_enough):
            return held
    target = _Target(curve, percent, celsius)
    ctx.item_state[NAME] = target
    return target


def _range_problems(curve: FanCurve, min_percent: int, max_percent: int) -> list[str]:
    return [
        f"fan curve point {celsius} C -> {percent}% is outside this board's fan speed range"
        f" {min_percent}-{max_percent}%"
        for celsius, percent in curve.points
        if not min_percent <= percent <= max_percent
    ]


def plan(ctx: GpuContext, want: FanCurve) -> ItemPlan:
    want_text = _curve_text(want)

    def read() -> ItemPlan:
        fans = ctx.backend.fan_count(ctx.gpu)
        if fans == 0:
            return not_applicable_plan(NAME, ctx, want_text, _NO_FANS)
        # Never clamp: a curve written for another board would silently run hotter or louder than declared.
        problems = _range_problems(want, *ctx.backend.fan_speed_range_percent(ctx.gpu))
        if problems:
            return ItemPlan(NAME, ctx.gpu, PlanStatus.ERROR, want_text, "unknown", detail="; ".join(problems))
        celsius = ctx.backend.temperature_celsius(ctx.gpu)
        target = _target(ctx, want, celsius)
        readings = [
            (ctx.backend.fan_manual(ctx.gpu, fan), ctx.backend.fan_speed_percent(ctx.gpu, fan)) for fan in range(fans)
        ]
        actual = ", ".join(
            f"fan {fan} {speed}% {'manual' if manual else 'automatic'}" for fan, (manual, speed) in enumerate(readings)
        )
        changes = tuple(
            f"set fan {fan} of GPU {ctx.gpu} to {target.percent}% ({target.set_at_celsius} C on the curve)"
            for fan, (manual, speed) in enumerate(readings)
            if not manual or abs(speed - target.percent) > _SPEED_TOLERANCE_PERCENT
        )
        detail = f"GPU at {celsius} C"
        if _curve_percent(want, celsius) < target.percent:
            release_celsius = target.set_at_celsius - want.hysteresis_celsius
            detail += f"; holding {target.percent}% until it cools to {release_celsius} C (hysteresis)"
        return ItemPlan(
            NAME,
            ctx.gpu,
            PlanStatus.DRIFT if changes else PlanStatus.IN_SYNC,
            f"{target.percent}% ({target.set_at_celsius} C on the curve)",
            actual,
            detail=detail,
            changes=changes,
        )

    return guarded_plan(NAME, ctx, want_text, _MISSING, read)


def apply(ctx: GpuContext, want: FanCurve, plan: ItemPlan) -> ItemResult:
    def write() -> ItemResult:
        # Re-read the temperature: the curve is evaluated again, with the same hysteresis memory.
        target = _target(ctx, want, ctx.backend.temperature_celsius(ctx.gpu))
        fans = ctx.backend.fan_count(ctx.gpu)
        for fan in range(fans):
            ctx.backend.set_fan_speed_percent(ctx.gpu, fan, target.percent)
        # No read-back here: the engine re-plans after apply, which compares every fan with the target.
        return ItemResult(
            plan,
            Outcome.APPLIED,
            f"{_fans_text(list(range(fans)))} of GPU {ctx.gpu} set to {target.percent}%"
            f" ({target.set_at_celsius} C on the curve)",
        )

    return guarded_apply(plan, write)


def _fans_text(fans: list[int]) -> str:
    return ("fan " if len(fans) == 1 else "fans ") + ", ".join(str(fan) for fan in fans)


def _manual(ctx: GpuContext, fan: int) -> bool | None:
    """Whether software holds this fan; None when that cannot be read (an older control-policy API,
    or the read failing), so restore resets the fan anyway. Only a lost GPU is past helping."""
    try:
        return ctx.backend.fan_manual(ctx.gpu, fan)
    except GpuError as exc:
        if exc.kind is GpuErrorKind.GPU_LOST:
            raise
        return None


def restore(ctx: GpuContext) -> ItemResult:
    """Every fan back to automatic (vBIOS) control. A fan whose control mode cannot be read is
    reset anyway: a fan left at a fixed low speed is the one failure this must never cause."""
    ctx.item_state.pop(NAME, None)

    def read() -> ItemPlan:
        fans = ctx.backend.fan_count(ctx.gpu)
        if fans == 0:
            return not_applicable_plan(NAME, ctx, "automatic", _NO_FANS)
        modes = [_manual(ctx, fan) for fan in range(fans)]
        names = {True: "manual", False: "automatic", None: "control mode unknown"}
        changes = tuple(
            f"return fan {fan} of GPU {ctx.gpu} to automatic control"
            for fan, manual in enumerate(modes)
            if manual is not False
        )
        return ItemPlan(
            NAME,
            ctx.gpu,
            PlanStatus.DRIFT if changes else PlanStatus.IN_SYNC,
            "automatic",
            ", ".join(f"fan {fan} {names[manual]}" for fan, manual in enumerate(modes)),
            changes=changes,
        )

    restore_plan = guarded_plan(NAME, ctx, "automatic", _MISSING, read)

    def write() -> ItemResult:
        reset = [fan for fan in range(ctx.backend.fan_count(ctx.gpu)) if _manual(ctx, fan) is not False]
        for fan in reset:
            ctx.backend.set_fan_automatic(ctx.gpu, fan)
        still_manual = [fan for fan in reset if _manual(ctx, fan)]
        if still_manual:
            return ItemResult(restore_plan, Outcome.FAILED, f"{_fans_text(still_manual)} of GPU {ctx.gpu} still manual")
        return ItemResult(
            restore_plan, Outcome.APPLIED, f"{_fans_text(reset)} of GPU {ctx.gpu} back to automatic control"
        )

    return guarded_restore(restore_plan, write)
