"""What the GPU policy items share: the item shape, one mapping from `GpuError` to plans, and restore.

Each GPU item is a `ProfileGpuItem`: constructed with its name, the profile field that holds
its desired value and what a board without the setting lacks, it says only how to read the board
(`read`) and how to write it (`apply`).

A getter failing in `plan` is a report, not a crash: NOT_SUPPORTED means the board has no
such setting (NOT_APPLICABLE), any other kind is an ERROR carrying the kind. A setter failing
in `apply` raises; `enforce` and `run_restore` turn it into a FAILED result. `WriteRefused` is
deliberately not caught in restore: it means observe mode stopped a write, and the engine
reports that itself.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from functools import partial
from typing import Any, Final, TypeVar

from agent.backend.errors import GpuError, GpuErrorKind
from agent.config.desired import GpuProfile
from agent.names.policy_items import GpuItemName
from agent.policy.base import GpuContext, describe_error
from agent.policy.item import Change, GpuItem, Planned, planned
from agent.policy.plan import ApplyOutcome, ItemPlan, ItemResult, PlanStatus

C = TypeVar("C", bound=Change)
W = TypeVar("W")

#: Watts NVML reports in milliwatts and boards round limits; closer than this counts as equal.
POWER_TOLERANCE_WATTS = 0.5


def enabled_text(enabled: bool) -> str:
    return "enabled" if enabled else "disabled"


def format_watts(watts: float) -> str:
    """`600.0` -> `600`, `262.5` -> `262.5`: NVML's milliwatt resolution, no trailing zeros."""
    return f"{watts:.3f}".rstrip("0").rstrip(".")


def not_applicable_plan(item: str, ctx: GpuContext, desired: str, reason: str) -> ItemPlan:
    """`reason` completes "NVIDIA H200 (GPU 0) ...", e.g. "has no fans: no fan curve to enforce"."""
    detail = f"{ctx.identity.name} (GPU {ctx.gpu}) {reason}"
    return _unread_plan(item, ctx, PlanStatus.NOT_APPLICABLE, desired, "not supported", detail)


def error_plan(item: str, ctx: GpuContext, desired: str, exc: GpuError) -> ItemPlan:
    return _unread_plan(item, ctx, PlanStatus.ERROR, desired, "unknown", describe_error(exc), exc.kind.value)


def _unread_plan(
    item: str,
    ctx: GpuContext,
    status: PlanStatus,
    desired: str,
    actual: str,
    detail: str,
    error_kind: str | None = None,
) -> ItemPlan:
    """The plan of a setting the GPU did not give (`actual` says how): nothing to change."""
    return ItemPlan(item, ctx.gpu, status, desired, actual, detail, error_kind=error_kind)


def guarded_read(item: str, ctx: GpuContext, desired: str, missing: str, read: Callable[[], Planned[C]]) -> Planned[C]:
    """Runs `read` (getters only); a GpuError becomes NOT_APPLICABLE (`missing` says what the
    board lacks, as for `not_applicable_plan`) or an ERROR plan naming the kind."""
    try:
        return read()
    except GpuError as exc:
        if exc.kind is GpuErrorKind.NOT_SUPPORTED:
            return planned(not_applicable_plan(item, ctx, desired, f"{missing} ({exc})"))
        return planned(error_plan(item, ctx, desired, exc))


class ProfileGpuItem(GpuItem[W, C]):
    """A GPU setting whose desired value is one field of the GPU profile.

    `plan` is the item's `read` behind `guarded_read`: a getter failing becomes NOT_APPLICABLE
    (the board lacks the setting: `missing` says what, completing "NVIDIA H200 (GPU 0) ...") or
    an ERROR plan naming the kind.
    """

    scope: Final = "gpu"

    def __init__(self, name: GpuItemName, field: Callable[[GpuProfile], W | None], missing: str) -> None:
        self._name: Final = name
        self._field = field
        self.missing = missing

    @property
    def name(self) -> GpuItemName:
        return self._name

    def desired(self, profile: GpuProfile) -> W | None:
        return self._field(profile)

    def want_text(self, want: W) -> str:
        """The desired value as a plan shows it."""
        return str(want)

    def plan(self, ctx: GpuContext, want: W) -> Planned[C]:
        return guarded_read(self.name, ctx, self.want_text(want), self.missing, partial(self.read, ctx, want))

    @abc.abstractmethod
    def read(self, ctx: GpuContext, want: W) -> Planned[C]:
        """The plan, from getters only; a GpuError it raises becomes the plan `plan` returns."""


def _in_sync(after: Planned[Any]) -> bool:
    return after.plan.status is PlanStatus.IN_SYNC


def run_restore(
    item: ProfileGpuItem[Any, C],
    ctx: GpuContext,
    read: Callable[[], Planned[C]],
    default: str,
    settled: Callable[[Planned[C]], bool] = _in_sync,
) -> ItemResult:
    """Plan the way back to the `default` (`read`), write it with the item's `apply`, read once more.

    `settled` judges that last read (in sync, unless the item knows better). A plan that could not
    read the device is a FAILED restore: `gpu-agent restore` must not claim success for a GPU it
    could not even look at. A plan with nothing to change writes nothing.
    """
    done = guarded_read(item.name, ctx, default, item.missing, read)
    plan = done.plan
    if plan.status is PlanStatus.ERROR:
        return ItemResult(plan, ApplyOutcome.FAILED, plan.detail)
    if plan.status is not PlanStatus.DRIFT:
        outcome = ApplyOutcome.UNCHANGED if plan.status is PlanStatus.IN_SYNC else ApplyOutcome.SKIPPED
        return ItemResult(plan, outcome, plan.detail)
    try:
        summary = item.apply(ctx, done.changes)
    except GpuError as exc:
        return ItemResult(plan, ApplyOutcome.FAILED, describe_error(exc))
    after = guarded_read(item.name, ctx, default, item.missing, read)
    if settled(after):
        return ItemResult(plan, ApplyOutcome.APPLIED, summary)
    return ItemResult(plan, ApplyOutcome.FAILED, f"{summary}, but GPU {ctx.gpu} still reads {after.plan.actual}")
