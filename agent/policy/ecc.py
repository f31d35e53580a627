"""ECC mode (nvidia-smi -e): NVML stores a pending mode that becomes current at the next reboot
(or GPU reset), so this item can be right, wrong, or right-after-a-reboot."""

from __future__ import annotations

from agent.backend.base import EnabledPending
from agent.config import EnabledState, GpuProfile
from agent.policy.base import GpuContext, ItemPlan, ItemResult, Outcome, PlanStatus
from agent.policy.gpu_item import enabled_text, guarded_apply, guarded_plan

NAME = "ecc"
_MISSING = "has no ECC memory mode"


def desired(profile: GpuProfile) -> EnabledState | None:
    return profile.ecc


def _mode_text(mode: EnabledPending) -> str:
    """`enabled`, or `enabled (pending disabled)` while a change waits for a reboot."""
    current = enabled_text(mode.current)
    return current if mode.pending == mode.current else f"{current} (pending {enabled_text(mode.pending)})"


def plan(ctx: GpuContext, want: EnabledState) -> ItemPlan:
    want_on = want == "enabled"

    def read() -> ItemPlan:
        mode = ctx.backend.ecc_mode(ctx.gpu)
        actual = _mode_text(mode)
        if mode.pending == want_on and mode.current == want_on:
            return ItemPlan(NAME, ctx.gpu, PlanStatus.IN_SYNC, want, actual)
        verb = "enable" if want_on else "disable"
        if mode.pending == want_on:
            # Already set; nothing more the agent can do short of rebooting, which is the operator's call.
            return ItemPlan(
                NAME,
                ctx.gpu,
                PlanStatus.REBOOT_REQUIRED,
                want,
                actual,
                detail=f"ECC {verb} pending; takes effect after reboot",
            )
        # Current may already match: a pending opposite mode would still flip it at the next reboot.
        after = "" if mode.current == want_on else "; takes effect after reboot"
        return ItemPlan(
            NAME,
            ctx.gpu,
            PlanStatus.DRIFT,
            want,
            actual,
            changes=(f"{verb} ECC on GPU {ctx.gpu} (nvidia-smi -i {ctx.gpu} -e {int(want_on)}){after}",),
        )

    return guarded_plan(NAME, ctx, want, _MISSING, read)


def apply(ctx: GpuContext, want: EnabledState, plan: ItemPlan) -> ItemResult:
    want_on = want == "enabled"

    def write() -> ItemResult:
        ctx.backend.set_ecc_mode(ctx.gpu, want_on)
        now = ctx.backend.ecc_mode(ctx.gpu)
        if now.pending != want_on:
            return ItemResult(plan, Outcome.FAILED, f"set ECC {want} but GPU {ctx.gpu} reports {_mode_text(now)}")
        if now.current != want_on:
            verb = "enable" if want_on else "disable"
            return ItemResult(plan, Outcome.REBOOT_REQUIRED, f"ECC {verb} pending; takes effect after reboot")
        # Only a stray pending mode was undone: the current mode was right all along.
        return ItemResult(plan, Outcome.APPLIED, f"ECC {plan.actual} -> {_mode_text(now)}")

    return guarded_apply(plan, write)
