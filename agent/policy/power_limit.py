"""GPU power limit (nvidia-smi -pl): a lower cap trades peak throughput for heat and power headroom."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agent.policy.base import GpuContext
from agent.policy.gpu_item import POWER_TOLERANCE_WATTS, ProfileGpuItem, format_watts, run_restore
from agent.policy.item import Planned, RestorableGpuItem, compared, planned
from agent.policy.plan import ItemPlan, ItemResult, PlanStatus


@dataclass(frozen=True)
class SetPowerLimit:
    gpu: int
    from_watts: float
    to_watts: float

    @property
    def text(self) -> str:
        return (
            f"set power limit of GPU {self.gpu} from {format_watts(self.from_watts)} W"
            f" to {format_watts(self.to_watts)} W (nvidia-smi -i {self.gpu} -pl {format_watts(self.to_watts)})"
        )


class PowerLimitItem(ProfileGpuItem[float, SetPowerLimit], RestorableGpuItem[float, SetPowerLimit]):
    def want_text(self, want: float) -> str:
        return f"{format_watts(want)} W"

    def read(self, ctx: GpuContext, want: float) -> Planned[SetPowerLimit]:
        want_text = self.want_text(want)
        min_watts, max_watts = ctx.backend.power_limit_constraints_watts(ctx.gpu)
        actual_watts = ctx.backend.power_limit_watts(ctx.gpu)
        actual_text = f"{format_watts(actual_watts)} W"
        allowed = f"{format_watts(min_watts)}-{format_watts(max_watts)} W"
        # NVML would reject it anyway; clamping silently would hide a config written for another board.
        if not min_watts <= want <= max_watts:
            detail = f"{want_text} is outside this board's range {allowed}"
            return planned(ItemPlan(self.name, ctx.gpu, PlanStatus.ERROR, want_text, actual_text, detail))
        if abs(actual_watts - want) <= POWER_TOLERANCE_WATTS:
            return planned(ItemPlan(self.name, ctx.gpu, PlanStatus.IN_SYNC, want_text, actual_text))
        return planned(
            ItemPlan(self.name, ctx.gpu, PlanStatus.DRIFT, want_text, actual_text, f"allowed {allowed}"),
            [SetPowerLimit(ctx.gpu, actual_watts, want)],
        )

    def apply(self, ctx: GpuContext, changes: Sequence[SetPowerLimit]) -> str:
        for change in changes:
            ctx.backend.set_power_limit_watts(change.gpu, change.to_watts)
        return "; ".join(f"power limit {format_watts(c.from_watts)} W -> {format_watts(c.to_watts)} W" for c in changes)

    def restore(self, ctx: GpuContext) -> ItemResult:
        """Back to the board's default power limit."""

        def read() -> Planned[SetPowerLimit]:
            default_watts = ctx.backend.default_power_limit_watts(ctx.gpu)
            actual_watts = ctx.backend.power_limit_watts(ctx.gpu)
            in_sync = abs(actual_watts - default_watts) <= POWER_TOLERANCE_WATTS
            return compared(
                self.name,
                ctx.gpu,
                f"default {format_watts(default_watts)} W",
                f"{format_watts(actual_watts)} W",
                [] if in_sync else [SetPowerLimit(ctx.gpu, actual_watts, default_watts)],
            )

        return run_restore(self, ctx, read, "default")


ITEM: Final = PowerLimitItem(
    "power_limit", lambda profile: profile.power_limit_watts, missing="has no settable power limit"
)
