"""What every policy item produces: a plan (desired vs actual) and, when enforced, a result.

Data only: the snapshot (agent.state), the verdict, the exporter and the JSON documents read these
without importing the items, the engine or the host (tests/test_layout.py keeps it a leaf).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PlanStatus(str, Enum):
    IN_SYNC = "in_sync"
    DRIFT = "drift"
    NOT_APPLICABLE = "not_applicable"  # the board/host has no such setting (fans on an SXM H200)
    REBOOT_REQUIRED = "reboot_required"  # desired state is set but takes effect after a reboot
    ERROR = "error"  # unreadable, or the desired value is impossible on this device
    HELD = "held"  # off its desired value because a running job drives it (a tune sweep): not drift


class ApplyOutcome(str, Enum):
    APPLIED = "applied"
    UNCHANGED = "unchanged"  # nothing to do
    SKIPPED = "skipped"  # observe mode, not applicable, or the plan was an error
    REBOOT_REQUIRED = "reboot_required"
    FAILED = "failed"


#: The `driver` item's fact naming the services whose `cuda_version` the loaded driver is too old for.
CUDA_TOO_OLD_FACT = "cuda_too_old"
#: A drifting item's fact naming the job whose hold outlived it: the policy loop may not put it back.
HELD_BY_ENDED_JOB_FACT = "held_by_ended_job"


@dataclass(frozen=True)
class ItemPlan:
    item: str
    gpu: int | None  # None for node items
    status: PlanStatus
    desired: str
    actual: str
    detail: str = ""  # why: "allowed 200-700 W", "ECC enable pending until reboot"
    changes: tuple[str, ...] = ()  # what apply would do, in words an operator recognises
    error_kind: str | None = None  # GpuErrorKind value when a GPU call failed
    #: What a report-only item found, for metrics and JSON: (name, value) pairs, e.g. the kernel
    #: that boots next, the driver's branch and CUDA version.
    facts: tuple[tuple[str, str], ...] = ()

    @property
    def in_sync(self) -> bool:
        return self.status in (PlanStatus.IN_SYNC, PlanStatus.NOT_APPLICABLE)


@dataclass(frozen=True)
class ItemResult:
    plan: ItemPlan
    outcome: ApplyOutcome
    detail: str = ""
