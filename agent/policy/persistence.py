"""Persistence mode (nvidia-smi -pm): keeps the driver initialised with no client, so the first
CUDA call after idle does not pay seconds of driver start-up.

The mode resets at every boot. nvidia-persistenced is the preferred way to hold it (NVIDIA
deprecates the legacy -pm flag in its favour); the agent re-applies it on each loop either way,
so a node where the daemon is missing or was stopped still converges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from agent.config.desired import EnabledState
from agent.policy.base import GpuContext
from agent.policy.gpu_item import ProfileGpuItem, enabled_text
from agent.policy.item import Planned, compared


@dataclass(frozen=True)
class SetPersistence:
    gpu: int
    enabled: bool

    @property
    def text(self) -> str:
        verb = "enable" if self.enabled else "disable"
        return f"{verb} persistence mode on GPU {self.gpu} (nvidia-smi -i {self.gpu} -pm {int(self.enabled)})"


class PersistenceItem(ProfileGpuItem[EnabledState, SetPersistence]):
    def read(self, ctx: GpuContext, want: EnabledState) -> Planned[SetPersistence]:
        actual = enabled_text(ctx.backend.persistence_enabled(ctx.gpu))
        return compared(
            self.name, ctx.gpu, want, actual, [] if actual == want else [SetPersistence(ctx.gpu, want == "enabled")]
        )

    def apply(self, ctx: GpuContext, changes: Sequence[SetPersistence]) -> str:
        for change in changes:
            ctx.backend.set_persistence(change.gpu, change.enabled)
        # A change is only planned when the mode differs, so it was the opposite before.
        return "; ".join(
            f"persistence mode {enabled_text(not c.enabled)} -> {enabled_text(c.enabled)}" for c in changes
        )


ITEM: Final = PersistenceItem("persistence", lambda profile: profile.persistence, missing="has no persistence mode")
