"""VBIOS version (report-only): a profile can name the oldest VBIOS its boards may run
(`vbios_min`), for known bugs such as a PCIe link that downshifts after a reset. Flashing a VBIOS
is NVIDIA's tooling and a maintenance window, never the agent's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from agent.host.driver import vbios_tuple
from agent.policy.base import GpuContext
from agent.policy.gpu_item import ProfileGpuItem
from agent.policy.item import Planned, planned
from agent.policy.plan import ItemPlan, PlanStatus
from agent.policy.report_only import OperatorTask, refuse


class VbiosItem(ProfileGpuItem[str, OperatorTask]):
    def want_text(self, want: str) -> str:
        return f">= {want}"

    def read(self, ctx: GpuContext, want: str) -> Planned[OperatorTask]:
        """From the identity the engine read: no getter of its own."""
        actual = ctx.identity.vbios_version
        desired = self.want_text(want)
        try:
            older = vbios_tuple(actual) < vbios_tuple(want)
        except ValueError as exc:
            return planned(ItemPlan(self.name, ctx.gpu, PlanStatus.ERROR, desired, actual or "?", str(exc)))
        if not older:
            return planned(ItemPlan(self.name, ctx.gpu, PlanStatus.IN_SYNC, desired, actual))
        task = OperatorTask(f"update the VBIOS of GPU {ctx.gpu} to {want} or newer", "the agent never flashes a VBIOS")
        return planned(ItemPlan(self.name, ctx.gpu, PlanStatus.DRIFT, desired, actual), [task])

    def apply(self, ctx: GpuContext, changes: Sequence[OperatorTask]) -> str:
        return refuse(changes)


ITEM: Final = VbiosItem("vbios", lambda profile: profile.vbios_min, missing="reports no VBIOS version")
