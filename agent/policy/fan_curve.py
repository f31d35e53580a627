"""Fan curve: drive each fan of an air-cooled board from the GPU temperature instead of the
vBIOS's own curve, which favours quiet over headroom. Fan-less (SXM) boards have nothing to do.

The item plans against the temperature of the moment; re-evaluating the curve as the
temperature moves is the daemon's loop. The target of each plan is remembered in
`ctx.item_state["fan_curve"]` so hysteresis can hold it while the GPU cools by less than the margin,
and `apply` sets the speed that plan chose.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agent.backend.errors import GpuError, GpuErrorKind
from agent.config.desired import FanCurve
from agent.names.policy_items import FAN_CURVE
from agent.policy.base import GpuContext
from agent.policy.gpu_item import ProfileGpuItem, not_applicable_plan, run_restore
from agent.policy.item import Planned, RestorableGpuItem, compared, planned
from agent.policy.plan import ItemPlan, ItemResult, PlanStatus

_NO_FANS = "has no fans: no fan curve to enforce"
# A fan at a manual speed reads back within a point or two of what was set; closer is in sync.
_SPEED_TOLERANCE_PERCENT = 2


@dataclass(frozen=True)
class _Target:
    """The speed the curve asked for and the temperature that asked, for hysteresis."""

    curve: FanCurve
    percent: int
    set_at_celsius: int


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
    held = ctx.item_state.get(FAN_CURVE)
    if isinstance(held, _Target) and held.curve == curve:
        cooled_enough = celsius <= held.set_at_celsius - curve.hysteresis_celsius
        if percent == held.percent or (percent < held.percent and not cooled_enough):
            return held
    target = _Target(curve, percent, celsius)
    ctx.item_state[FAN_CURVE] = target
    return target


def _range_problems(curve: FanCurve, min_percent: int, max_percent: int) -> list[str]:
    return [
        f"fan curve point {celsius} C -> {percent}% is outside this board's fan speed range"
        f" {min_percent}-{max_percent}%"
        for celsius, percent in curve.points
        if not min_percent <= percent <= max_percent
    ]


@dataclass(frozen=True)
class SetFan:
    """One fan to a manual speed (`percent`, from the curve at `at_celsius`), or back to automatic
    (`percent` None). `manual_before`: how the fan was found, None when that could not be read."""

    gpu: int
    fan: int
    percent: int | None
    at_celsius: int = 0
    manual_before: bool | None = None

    @property
    def text(self) -> str:
        if self.percent is None:
            return f"return fan {self.fan} of GPU {self.gpu} to automatic control"
        return f"set fan {self.fan} of GPU {self.gpu} to {self.percent}% ({self.at_celsius} C on the curve)"


class FanCurveItem(ProfileGpuItem[FanCurve, SetFan], RestorableGpuItem[FanCurve, SetFan]):
    def want_text(self, want: FanCurve) -> str:
        return _curve_text(want)

    def read(self, ctx: GpuContext, want: FanCurve) -> Planned[SetFan]:
        want_text = self.want_text(want)
        fans = ctx.backend.fan_count(ctx.gpu)
        if fans == 0:
            return planned(not_applicable_plan(self.name, ctx, want_text, _NO_FANS))
        # Never clamp: a curve written for another board would silently run hotter or louder than declared.
        problems = _range_problems(want, *ctx.backend.fan_speed_range_percent(ctx.gpu))
        if problems:
            detail = "; ".join(problems)
            return planned(ItemPlan(self.name, ctx.gpu, PlanStatus.ERROR, want_text, "unknown", detail=detail))
        celsius = ctx.backend.temperature_celsius(ctx.gpu)
        target = _target(ctx, want, celsius)
        readings = [
            (ctx.backend.fan_manual(ctx.gpu, fan), ctx.backend.fan_speed_percent(ctx.gpu, fan)) for fan in range(fans)
        ]
        actual = ", ".join(
            f"fan {fan} {speed}% {'manual' if manual else 'automatic'}" for fan, (manual, speed) in enumerate(readings)
        )
        changes = [
            SetFan(ctx.gpu, fan, target.percent, target.set_at_celsius, manual)
            for fan, (manual, speed) in enumerate(readings)
            if not manual or abs(speed - target.percent) > _SPEED_TOLERANCE_PERCENT
        ]
        detail = f"GPU at {celsius} C"
        if _curve_percent(want, celsius) < target.percent:
            release_celsius = target.set_at_celsius - want.hysteresis_celsius
            detail += f"; holding {target.percent}% until it cools to {release_celsius} C (hysteresis)"
        desired = f"{target.percent}% ({target.set_at_celsius} C on the curve)"
        return compared(self.name, ctx.gpu, desired, actual, changes, detail)

    def apply(self, ctx: GpuContext, changes: Sequence[SetFan]) -> str:
        for change in changes:
            if change.percent is None:
                ctx.backend.set_fan_automatic(change.gpu, change.fan)
            else:
                ctx.backend.set_fan_speed_percent(change.gpu, change.fan, change.percent)
        done: list[str] = []
        to_automatic = [c.fan for c in changes if c.percent is None]
        if to_automatic:
            done.append(f"{_fans_text(to_automatic)} of GPU {ctx.gpu} back to automatic control")
        for percent, at_celsius in dict.fromkeys((c.percent, c.at_celsius) for c in changes if c.percent is not None):
            fans = [c.fan for c in changes if c.percent == percent]
            done.append(f"{_fans_text(fans)} of GPU {ctx.gpu} set to {percent}% ({at_celsius} C on the curve)")
        return "; ".join(done)

    def restore(self, ctx: GpuContext) -> ItemResult:
        """Every fan back to automatic (vBIOS) control. A fan whose control mode cannot be read is
        reset anyway: a fan left at a fixed low speed is the one failure this must never cause."""
        ctx.item_state.pop(self.name, None)  # the curve starts over if it is enforced again

        def read() -> Planned[SetFan]:
            fans = ctx.backend.fan_count(ctx.gpu)
            if fans == 0:
                return planned(not_applicable_plan(self.name, ctx, "automatic", _NO_FANS))
            modes = [_manual(ctx, fan) for fan in range(fans)]
            names = {True: "manual", False: "automatic", None: "control mode unknown"}
            changes = [SetFan(ctx.gpu, fan, None, manual_before=m) for fan, m in enumerate(modes) if m is not False]
            actual = ", ".join(f"fan {fan} {names[manual]}" for fan, manual in enumerate(modes))
            return compared(self.name, ctx.gpu, "automatic", actual, changes)

        # A fan whose mode still cannot be read was reset all the same: only one reading manual failed.
        def settled(after: Planned[SetFan]) -> bool:
            return after.plan.status is PlanStatus.IN_SYNC or (
                after.plan.status is PlanStatus.DRIFT and all(c.manual_before is None for c in after.changes)
            )

        return run_restore(self, ctx, read, "automatic", settled)


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


ITEM: Final = FanCurveItem(
    FAN_CURVE,
    lambda profile: profile.fan_curve,
    missing="has no software-controllable fans: no fan curve to enforce",
)


def restore(ctx: GpuContext) -> ItemResult:
    """Fans back to automatic on one GPU: what the daemon runs on every exit path."""
    return ITEM.restore(ctx)
