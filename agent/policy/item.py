"""The policy item contract: what every item (power limit, THP, ...) provides, and the one path
from a plan to a verified write.

An item reads the device or host in `plan(target, want)` and returns a `Planned`: the `ItemPlan`
an operator reads, and the typed `Change` objects behind its lines. Each line of
`ItemPlan.changes` is the `text` of one change, so what `gpu-agent plan` shows and what `apply`
writes are one description. `apply(target, changes)` performs exactly those changes, in order,
and reads nothing back; `enforce` then plans the item once more, and that single fresh plan is the
verification: "applied" means the device or host now reads in sync.

Writing a new item: see docs/architecture.md, "Adding a policy item".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final, Generic, Literal, Protocol, TypeVar, runtime_checkable

from agent.backend.errors import GpuError, WriteRefused
from agent.config import AgentConfig
from agent.config.desired import GpuProfile, NodePolicy
from agent.names.policy_items import GpuItemName, ItemName, NodeItemName
from agent.policy.base import GpuContext, HostContext, describe_error
from agent.policy.plan import ApplyOutcome, ItemPlan, ItemResult, PlanStatus

Scope = Literal["gpu", "node"]


class Change(Protocol):
    """One write an item plans. `text` is the line `gpu-agent plan` shows for it, in words an
    operator recognises (`set power limit of GPU 0 from 700 W to 600 W (nvidia-smi -i 0 -pl 600)`);
    the item's `apply` performs the change from the same fields the text was written from."""

    @property
    def text(self) -> str: ...


C = TypeVar("C", bound=Change)  # an item's change type
W = TypeVar("W")  # what the config wants of an item, e.g. watts for the power limit
T = TypeVar("T", GpuContext, HostContext)  # where an item applies
# PolicyItem only takes its target and desired value, so its protocol wants them contravariant.
W_contra = TypeVar("W_contra", contravariant=True)
T_contra = TypeVar("T_contra", contravariant=True)


@dataclass(frozen=True)
class Planned(Generic[C]):
    """An item's plan and the changes behind its `changes` lines (none unless it is DRIFT)."""

    plan: ItemPlan
    changes: tuple[C, ...] = ()

    def __post_init__(self) -> None:
        texts = tuple(change.text for change in self.changes)
        if self.plan.changes != texts:
            raise ValueError(f"plan shows {self.plan.changes!r} but would apply {texts!r}")


def planned(plan: ItemPlan, changes: Sequence[C] = ()) -> Planned[C]:
    """`plan` with its `changes` lines written from `changes`: the only way items build a Planned."""
    return Planned(replace(plan, changes=tuple(change.text for change in changes)), tuple(changes))


def compared(
    item: str, gpu: int | None, desired: str, actual: str, changes: Sequence[C], detail: str = ""
) -> Planned[C]:
    """The plan of a read that found `changes` to make: DRIFT with them, IN_SYNC with none."""
    status = PlanStatus.DRIFT if changes else PlanStatus.IN_SYNC
    return planned(ItemPlan(item, gpu, status, desired, actual, detail), changes)


class ChangeFailed(Exception):
    """A change could not be made; `detail` is the whole operator-facing reason, including what
    was already done (`wrote /etc/modprobe.d/...; `dracut -f` failed (exit 1): ...`)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@runtime_checkable
class PolicyItem(Protocol[T_contra, W_contra, C]):
    """What the engine needs of every item, on a GPU (`GpuContext`) or the host (`HostContext`)."""

    @property
    def name(self) -> ItemName: ...

    @property
    def scope(self) -> Scope: ...

    def plan(self, target: T_contra, want: W_contra) -> Planned[C]:
        """Read only; never raises for a device or host that cannot be read (that is an ERROR plan)."""
        ...

    def apply(self, target: T_contra, changes: Sequence[C]) -> str:
        """Make `changes`, in order; read nothing back. Returns what was done, for the operator.
        Raises `ChangeFailed`, `GpuError`, `WriteRefused` (observe mode) or `OSError`."""
        ...


@runtime_checkable
class GpuItem(PolicyItem[GpuContext, W, C], Protocol[W, C]):
    """A setting of one GPU, desired per GPU profile (`policy.gpus`)."""

    @property
    def name(self) -> GpuItemName: ...

    @property
    def scope(self) -> Literal["gpu"]: ...

    def desired(self, profile: GpuProfile) -> W | None:
        """The profile's value; None when the profile leaves this item alone."""
        ...


@runtime_checkable
class RestorableGpuItem(GpuItem[W, C], Protocol[W, C]):
    """A GPU setting `gpu-agent restore` returns to the board's default."""

    def restore(self, ctx: GpuContext) -> ItemResult:
        """Back to the default; reads first, so a board already there is not written."""
        ...


@runtime_checkable
class NodeItem(PolicyItem[HostContext, W, C], Protocol[W, C]):
    """A setting of the host, desired once per node (`policy.node`)."""

    @property
    def name(self) -> NodeItemName: ...

    @property
    def scope(self) -> Literal["node"]: ...

    def desired(self, node: NodePolicy, config: AgentConfig) -> W | None: ...


class HostItem(NodeItem[W, C]):
    """The base of the node items: each says its name, desired value, plan and apply."""

    scope: Final = "node"


# What a plan that needs no write leads to.
_NO_WRITE_OUTCOMES: dict[PlanStatus, ApplyOutcome] = {
    PlanStatus.IN_SYNC: ApplyOutcome.UNCHANGED,
    PlanStatus.NOT_APPLICABLE: ApplyOutcome.UNCHANGED,
    PlanStatus.REBOOT_REQUIRED: ApplyOutcome.REBOOT_REQUIRED,
    PlanStatus.ERROR: ApplyOutcome.SKIPPED,
    PlanStatus.HELD: ApplyOutcome.SKIPPED,  # a job drives it: never written meanwhile
}


def result_without_write(plan: ItemPlan) -> ItemResult | None:
    """The result of a plan that leaves nothing to write (anything but DRIFT), else None."""
    if plan.status is PlanStatus.DRIFT:
        return None
    details = {
        PlanStatus.ERROR: f"not applied: {plan.detail}",
        PlanStatus.REBOOT_REQUIRED: plan.detail,
        PlanStatus.HELD: plan.detail,
    }
    return ItemResult(plan, _NO_WRITE_OUTCOMES[plan.status], details.get(plan.status, ""))


def failed_plan(item: str, gpu: int | None, exc: GpuError | OSError) -> ItemPlan:
    """The ERROR plan for a read that raised past the item (a backstop: items report their own)."""
    if isinstance(exc, GpuError):
        return ItemPlan(item, gpu, PlanStatus.ERROR, "?", "?", str(exc), (), exc.kind.value)
    return ItemPlan(item, gpu, PlanStatus.ERROR, "?", "?", f"{exc.strerror or exc}: {exc.filename or ''}")


def plan_item(item: PolicyItem[T, W, C], target: T, want: W) -> Planned[C]:
    """`item.plan`, with a GpuError or OSError that escaped the item turned into an ERROR plan."""
    try:
        return item.plan(target, want)
    except (GpuError, OSError) as exc:
        return Planned(failed_plan(item.name, target.gpu if isinstance(target, GpuContext) else None, exc))


def write_failure(exc: ChangeFailed | WriteRefused | GpuError | OSError) -> str:
    """The detail of a FAILED result for an exception a write raised."""
    if isinstance(exc, ChangeFailed):
        return exc.detail
    if isinstance(exc, GpuError):
        return describe_error(exc)
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")
    return str(exc)


def enforce(item: PolicyItem[T, W, C], target: T, want: W, done: Planned[C]) -> ItemResult:
    """Write a DRIFT plan's changes, then verify with one fresh plan; any other plan writes nothing.

    Mode and dry-run are the caller's business: this writes whenever the plan says DRIFT.
    """
    no_write = result_without_write(done.plan)
    if no_write is not None:
        return no_write
    try:
        summary = item.apply(target, done.changes)
    except (ChangeFailed, WriteRefused, GpuError, OSError) as exc:
        return ItemResult(done.plan, ApplyOutcome.FAILED, write_failure(exc))
    verified = plan_item(item, target, want).plan
    if verified.status is PlanStatus.IN_SYNC:
        return ItemResult(done.plan, ApplyOutcome.APPLIED, summary)
    if verified.status is PlanStatus.REBOOT_REQUIRED:
        return ItemResult(done.plan, ApplyOutcome.REBOOT_REQUIRED, "; ".join(filter(None, [summary, verified.detail])))
    why = f" ({verified.detail})" if verified.detail else ""
    return ItemResult(
        verified, ApplyOutcome.FAILED, f"applied but still {verified.status.value}: actual {verified.actual}{why}"
    )
