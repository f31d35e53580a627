"""Persistence mode (nvidia-smi -pm): keeps the driver initialised with no client, so the first
CUDA call after idle does not pay seconds of driver start-up.

The mode resets at every boot. nvidia-persistenced is the preferred way to hold it (NVIDIA
deprecates the legacy -pm flag in its favour); the agent re-applies it on each loop either way,
so a node where the daemon is missing or was stopped still converges.
"""

from __future__ import annotations

from agent.config import EnabledState, GpuProfile
from agent.policy.base import GpuContext, ItemPlan, ItemResult, Outcome, PlanStatus
from agent.policy.gpu_item import enabled_text, guarded_apply, guarded_plan

NAME = "persistence"
_MISSING = "has no persistence mode"


def desired(profile: GpuProfile) -> EnabledState | None:
    return profile.persistence


def plan(ctx: GpuContext, want: EnabledState) -> ItemPlan:
    def read() -> ItemPlan:
        actual = enabled_text(ctx.backend.persistence_enabled(ctx.gpu))
        if actual == want:
            return ItemPlan(NAME, ctx.gpu, PlanStatus.IN_SYNC, want, actual)
        verb = "enable" if want == "enabled" else "disable"
        flag = 1 if want == "enabled" else 0
        return ItemPlan(
            NAME,
            ctx.gpu,
            PlanStatus.DRIFT,
            want,
            actual,
            changes=(f"{verb} persistence mode on GPU {ctx.gpu} (nvidia-smi -i {ctx.gpu} -pm {flag})",),
        )

    return guarded_plan(NAME, ctx, want, _MISSING, read)


def apply(ctx: GpuContext, want: EnabledState, plan: ItemPlan) -> ItemResult:
    def write() -> ItemResult:
        ctx.backend.set_persistence(ctx.gpu, want == "enabled")
        now = enabled_text(ctx.backend.persistence_enabled(ctx.gpu))
        if now != want:
            return ItemResult(plan, Outcome.FAILED, f"set persistence mode {want} but GPU {ctx.gpu} reports {now}")
        return ItemResult(plan, Outcome.APPLIED, f"persistence mode {plan.actual} -> {now}")

    return guarded_apply(plan, write)
