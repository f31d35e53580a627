"""GPU power limit (nvidia-smi -pl): a lower cap trades peak throughput for heat and power headroom."""

from __future__ import annotations

from dataclasses import replace

from agent.config import GpuProfile
from agent.policy.base import GpuContext, ItemPlan, ItemResult, Outcome, PlanStatus
from agent.policy.gpu_item import (
    POWER_TOLERANCE_WATTS,
    format_watts,
    guarded_apply,
    guarded_plan,
    guarded_restore,
)

NAME = "power_limit"
_MISSING = "has no settable power limit"


def desired(profile: GpuProfile) -> float | None:
    return profile.power_limit_watts


def _set_change(gpu: int, from_watts: float, to_watts: float) -> str:
    return (
        f"set power limit of GPU {gpu} from {format_watts(from_watts)} W to {format_watts(to_watts)} W"
        f" (nvidia-smi -i {gpu} -pl {format_watts(to_watts)})"
    )


def plan(ctx: GpuContext, want: float) -> ItemPlan:
    want_text = f"{format_watts(want)} W"

    def read() -> ItemPlan:
        min_watts, max_watts = ctx.backend.power_limit_constraints_watts(ctx.gpu)
        actual_watts = ctx.backend.power_limit_watts(ctx.gpu)
        in_sync = ItemPlan(NAME, ctx.gpu, PlanStatus.IN_SYNC, want_text, f"{format_watts(actual_watts)} W")
        allowed = f"{format_watts(min_watts)}-{format_watts(max_watts)} W"
        # NVML would reject it anyway; clamping silently would hide a config written for another board.
        if not min_watts <= want <= max_watts:
            return replace(
                in_sync, status=PlanStatus.ERROR, detail=f"{want_text} is outside this board's range {allowed}"
            )
        if abs(actual_watts - want) <= POWER_TOLERANCE_WATTS:
            return in_sync
        return replace(
            in_sync,
            status=PlanStatus.DRIFT,
            detail=f"allowed {allowed}",
            changes=(_set_change(ctx.gpu, actual_watts, want),),
        )

    return guarded_plan(NAME, ctx, want_text, _MISSING, read)


def _set_and_verify(ctx: GpuContext, plan: ItemPlan, watts: float) -> ItemResult:
    before = plan.actual
    ctx.backend.set_power_limit_watts(ctx.gpu, watts)
    # Re-read: a board may accept the call and still enforce another limit (e.g. a host-level cap).
    now_watts = ctx.backend.power_limit_watts(ctx.gpu)
    if abs(now_watts - watts) > POWER_TOLERANCE_WATTS:
        return ItemResult(
            plan,
            Outcome.FAILED,
            f"set {format_watts(watts)} W but GPU {ctx.gpu} reports {format_watts(now_watts)} W",
        )
    return ItemResult(plan, Outcome.APPLIED, f"power limit {before} -> {format_watts(now_watts)} W")


def apply(ctx: GpuContext, want: float, plan: ItemPlan) -> ItemResult:
    return guarded_apply(plan, lambda: _set_and_verify(ctx, plan, want))


def restore(ctx: GpuContext) -> ItemResult:
    """Back to the board's default power limit; reads first, so an unchanged board is not written."""

    def read() -> ItemPlan:
        default_watts = ctx.backend.default_power_limit_watts(ctx.gpu)
        actual_watts = ctx.backend.power_limit_watts(ctx.gpu)
        in_sync = abs(actual_watts - default_watts) <= POWER_TOLERANCE_WATTS
        return ItemPlan(
            NAME,
            ctx.gpu,
            PlanStatus.IN_SYNC if in_sync else PlanStatus.DRIFT,
            f"default {format_watts(default_watts)} W",
            f"{format_watts(actual_watts)} W",
            changes=() if in_sync else (_set_change(ctx.gpu, actual_watts, default_watts),),
        )

    restore_plan = guarded_plan(NAME, ctx, "default", _MISSING, read)
    return guarded_restore(
        restore_plan, lambda: _set_and_verify(ctx, restore_plan, ctx.backend.default_power_limit_watts(ctx.gpu))
    )
