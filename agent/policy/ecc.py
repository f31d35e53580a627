"""ECC mode (nvidia-smi -e): NVML stores a pending mode that becomes current at the next reboot
(or GPU reset), so this item can be right, wrong, or right-after-a-reboot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agent.backend.base import EnabledPending
from agent.config.desired import EnabledState
from agent.policy.base import GpuContext
from agent.policy.gpu_item import ProfileGpuItem, enabled_text
from agent.policy.item import Planned, planned
from agent.policy.plan import ItemPlan, PlanStatus


def _mode_text(mode: EnabledPending) -> str:
    """`enabled`, or `enabled (pending disabled)` while a change waits for a reboot."""
    current = enabled_text(mode.current)
    return current if mode.pending == mode.current else f"{current} (pending {enabled_text(mode.pending)})"


@dataclass(frozen=True)
class SetEcc:
    """Set the pending ECC mode; `after_reboot`: the current mode differs, so it takes a reboot."""

    gpu: int
    enabled: bool
    after_reboot: bool

    @property
    def text(self) -> str:
        verb = "enable" if self.enabled else "disable"
        after = "; takes effect after reboot" if self.after_reboot else ""
        return f"{verb} ECC on GPU {self.gpu} (nvidia-smi -i {self.gpu} -e {int(self.enabled)}){after}"


class EccItem(ProfileGpuItem[EnabledState, SetEcc]):
    def read(self, ctx: GpuContext, want: EnabledState) -> Planned[SetEcc]:
        want_on = want == "enabled"
        mode = ctx.backend.ecc_mode(ctx.gpu)
        actual = _mode_text(mode)
        if mode.pending == want_on and mode.current == want_on:
            return planned(ItemPlan(self.name, ctx.gpu, PlanStatus.IN_SYNC, want, actual))
        if mode.pending == want_on:
            # Already set; nothing more the agent can do short of rebooting, which is the operator's call.
            verb = "enable" if want_on else "disable"
            detail = f"ECC {verb} pending; takes effect after reboot"
            return planned(ItemPlan(self.name, ctx.gpu, PlanStatus.REBOOT_REQUIRED, want, actual, detail))
        # Current may already match: a pending opposite mode would still flip it at the next reboot.
        return planned(
            ItemPlan(self.name, ctx.gpu, PlanStatus.DRIFT, want, actual),
            [SetEcc(ctx.gpu, want_on, after_reboot=mode.current != want_on)],
        )

    def apply(self, ctx: GpuContext, changes: Sequence[SetEcc]) -> str:
        for change in changes:
            ctx.backend.set_ecc_mode(change.gpu, change.enabled)
        return "; ".join(f"ECC mode of GPU {c.gpu} set to {enabled_text(c.enabled)}" for c in changes)


ITEM: Final = EccItem("ecc", lambda profile: profile.ecc, missing="has no ECC memory mode")
