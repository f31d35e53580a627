"""What the five GPU policy items share: one mapping from `GpuError` to plans and results.

A getter failing in `plan` is a report, not a crash: NOT_SUPPORTED means the board has no
such setting (NOT_APPLICABLE), any other kind is an ERROR carrying the kind. A setter failing
in `apply` or `restore` is a FAILED result. `WriteRefused` is deliberately not caught here:
it means observe mode stopped a write, and the engine reports that itself.
"""

from __future__ import annotations

from collections.abc import Callable

from agent.backend.errors import GpuError, GpuErrorKind
from agent.policy.base import GpuContext, ItemPlan, ItemResult, Outcome, PlanStatus

#: Operator wording for each error kind; the kind's value follows it in brackets for grepping.
ERROR_LABELS: dict[GpuErrorKind, str] = {
    GpuErrorKind.NOT_SUPPORTED: "not supported by this board",
    GpuErrorKind.NO_PERMISSION: "no permission (changing GPU settings needs root)",
    GpuErrorKind.GPU_LOST: "GPU lost (fell off the bus)",
    GpuErrorKind.RESET_REQUIRED: "GPU needs a reset",
    GpuErrorKind.TIMEOUT: "GPU call timed out",
    GpuErrorKind.IN_USE: "GPU in use",
    GpuErrorKind.INVALID_ARGUMENT: "the driver rejected the value",
    GpuErrorKind.DRIVER_NOT_LOADED: "NVIDIA driver not loaded",
    GpuErrorKind.LIBRARY_NOT_FOUND: "NVML library not found",
    GpuErrorKind.VERSION_MISMATCH: "NVML library and kernel driver differ (driver upgraded, not reloaded)",
    GpuErrorKind.UNINITIALIZED: "NVML not initialised",
    GpuErrorKind.UNKNOWN: "unknown GPU error",
}

# What apply/restore report when the plan leaves nothing to write.
_NO_WRITE_OUTCOMES: dict[PlanStatus, Outcome] = {
    PlanStatus.IN_SYNC: Outcome.UNCHANGED,
    PlanStatus.NOT_APPLICABLE: Outcome.SKIPPED,
    PlanStatus.REBOOT_REQUIRED: Outcome.REBOOT_REQUIRED,
    PlanStatus.ERROR: Outcome.SKIPPED,
}

#: Watts NVML reports in milliwatts and boards round limits; closer than this counts as equal.
POWER_TOLERANCE_WATTS = 0.5


def describe_error(exc: GpuError) -> str:
    """`GPU lost (fell off the bus) [gpu_lost]: GPU 0: GPU is lost (nvmlDeviceGetPowerUsage)`."""
    return f"{ERROR_LABELS[exc.kind]} [{exc.kind.value}]: {exc}"


def enabled_text(enabled: bool) -> str:
    return "enabled" if enabled else "disabled"


def format_watts(watts: float) -> str:
    """`600.0` -> `600`, `262.5` -> `262.5`: NVML's milliwatt resolution, no trailing zeros."""
    return f"{watts:.3f}".rstrip("0").rstrip(".")


def not_applicable_plan(item: str, ctx: GpuContext, desired: str, reason: str) -> ItemPlan:
    """`reason` completes "NVIDIA H200 (GPU 0) ...", e.g. "has no fans: no fan curve to enforce"."""
    return ItemPlan(
        item=item,
        gpu=ctx.gpu,
        status=PlanStatus.NOT_APPLICABLE,
        desired=desired,
        actual="not supported",
        detail=f"{ctx.identity.name} (GPU {ctx.gpu}) {reason}",
    )


def error_plan(item: str, ctx: GpuContext, desired: str, exc: GpuError) -> ItemPlan:
    return ItemPlan(
        item=item,
        gpu=ctx.gpu,
        status=PlanStatus.ERROR,
        desired=desired,
        actual="unknown",
        detail=describe_error(exc),
        error_kind=exc.kind.value,
    )


def guarded_plan(item: str, ctx: GpuContext, desired: str, missing: str, read: Callable[[], ItemPlan]) -> ItemPlan:
    """Runs `read` (getters only); a GpuError becomes NOT_APPLICABLE (`missing` says what the
    board lacks, as for `not_applicable_plan`) or an ERROR plan naming the kind."""
    try:
        return read()
    except GpuError as exc:
        if exc.kind is GpuErrorKind.NOT_SUPPORTED:
            return not_applicable_plan(item, ctx, desired, f"{missing} ({exc})")
        return error_plan(item, ctx, desired, exc)


def guarded_apply(plan: ItemPlan, write: Callable[[], ItemResult]) -> ItemResult:
    """Runs `write` for a DRIFT plan; a GpuError becomes FAILED. Any other plan writes nothing,
    so calling apply twice, or on an in-sync plan, never touches the device."""
    if plan.status is not PlanStatus.DRIFT:
        return ItemResult(plan, _NO_WRITE_OUTCOMES[plan.status], plan.detail)
    try:
        return write()
    except GpuError as exc:
        return ItemResult(plan, Outcome.FAILED, describe_error(exc))


def guarded_restore(plan: ItemPlan, write: Callable[[], ItemResult]) -> ItemResult:
    """Like `guarded_apply`, but a plan that could not read the device is a FAILED restore:
    `gpu-agent restore` must not claim success for a GPU it could not even look at."""
    if plan.status is PlanStatus.ERROR:
        return ItemResult(plan, Outcome.FAILED, plan.detail)
    return guarded_apply(plan, write)
