"""Plans and applies the whole node policy: every GPU item on every GPU, then the node items.

One GPU or item failing never stops the others: each becomes an ERROR plan or a FAILED
result, and the rest of the node is still handled. Apply only touches items whose plan was
read completely and says DRIFT, and only in enforce mode; it makes the changes that very plan
listed, then plans the item once more (`agent.policy.item.enforce`), so "applied" means
verified, not merely attempted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from agent.backend.base import GpuBackend, GpuIdentity
from agent.backend.errors import GpuError, WriteRefused
from agent.config import AgentConfig, Mode
from agent.policy.base import GpuContext, HostContext
from agent.policy.holds import PolicyHolds
from agent.policy.item import Change, PolicyItem, enforce, plan_item, result_without_write
from agent.policy.plan import HELD_BY_ENDED_JOB_FACT, ApplyOutcome, ItemPlan, ItemResult, PlanStatus
from agent.policy.profiles import ResolvedProfile, resolve_profile
from agent.policy.registry import GPU_ITEMS, NODE_ITEMS, RESTORABLE_ITEMS, RESTORABLE_NAMES

C = TypeVar("C", bound=Change)
W = TypeVar("W")
T = TypeVar("T", GpuContext, HostContext)
ItemT = TypeVar("ItemT", bound=PolicyItem[Any, Any, Any])

#: Pseudo-item for a GPU that cannot even be identified (lost before the plan started).
GPU_ITEM = "gpu"


@dataclass
class NodeState:
    """The GPUs as enumerated once per plan/apply, and per-GPU item memory kept between loops."""

    identities: dict[int, GpuIdentity] = field(default_factory=dict)
    unreadable: dict[int, GpuError] = field(default_factory=dict)
    contexts: dict[int, GpuContext] = field(default_factory=dict)


@dataclass(frozen=True)
class NodePlan:
    mode: Mode
    items: tuple[ItemPlan, ...]
    item_modes: dict[str, Mode]
    profiles: dict[int, int | None]  # gpu -> index of the matching profile in policy.gpus
    # gpu -> its settings and where each came from (agent.policy.profiles), for the GPUs any profile
    # or override matches
    resolved: dict[int, ResolvedProfile] = field(default_factory=dict)

    @property
    def has_error(self) -> bool:
        return any(p.status is PlanStatus.ERROR for p in self.items)

    @property
    def has_drift(self) -> bool:
        return any(p.status in (PlanStatus.DRIFT, PlanStatus.REBOOT_REQUIRED) for p in self.items)

    @property
    def exit_code(self) -> int:
        """`gpu-agent plan`: 0 in sync, 2 drift (incl. reboot pending), 1 error."""
        if self.has_error:
            return 1
        return 2 if self.has_drift else 0


@dataclass(frozen=True)
class ApplyReport:
    plan: NodePlan
    results: tuple[ItemResult, ...]
    dry_run: bool

    @property
    def exit_code(self) -> int:
        """`gpu-agent apply`: 0 when everything is in sync or applied, 1 otherwise."""
        bad = {ApplyOutcome.FAILED}
        if any(r.outcome in bad for r in self.results) or self.plan.has_error:
            return 1
        unapplied = [r for r in self.results if r.outcome is ApplyOutcome.SKIPPED and r.plan.status is PlanStatus.DRIFT]
        return 1 if unapplied and not self.dry_run else 0


class PolicyEngine:
    """Holds the config, the backend and the host; keeps per-GPU contexts between loops."""

    def __init__(
        self, config: AgentConfig, backend: GpuBackend, host: HostContext, holds: PolicyHolds | None = None
    ) -> None:
        self.config = config
        self.backend = backend
        self.host = replace(host, backend=backend)
        self.state = NodeState()
        self.holds = holds or PolicyHolds()  # items someone else drives for now: planned, never written

    # -- enumeration ---------------------------------------------------------------------------

    def enumerate_gpus(self) -> None:
        """Refresh identities; a GPU whose identity cannot be read is kept as unreadable."""
        count = self.backend.device_count()
        identities: dict[int, GpuIdentity] = {}
        unreadable: dict[int, GpuError] = {}
        for gpu in range(count):
            try:
                identities[gpu] = self.backend.identity(gpu)
            except GpuError as exc:
                unreadable[gpu] = exc
        self.state.identities = identities
        self.state.unreadable = unreadable
        for gpu, identity in identities.items():
            ctx = self.state.contexts.get(gpu)
            if ctx is None or ctx.identity.uuid != identity.uuid:
                self.state.contexts[gpu] = GpuContext(self.backend, gpu, identity)
        for gpu in list(self.state.contexts):
            if gpu not in identities:
                del self.state.contexts[gpu]

    # -- plan ------------------------------------------------------------------------------------

    def _planned(self, only: Collection[str] | None) -> tuple[list[_Planned], dict[int, ResolvedProfile | None]]:
        """Every wanted item planned, GPUs first; and each GPU's profile and overrides."""
        self.enumerate_gpus()
        entries = [_Planned(_unreadable(gpu, error), None) for gpu, error in sorted(self.state.unreadable.items())]
        profiles: dict[int, ResolvedProfile | None] = {}
        for gpu in sorted(self.state.identities):
            resolved = resolve_profile(self.config.policy, self.state.identities[gpu])
            profiles[gpu] = resolved
            if resolved is None:
                continue
            profile = resolved.profile
            ctx = self.state.contexts[gpu]
            for gpu_item in _selected(GPU_ITEMS, only):
                want = gpu_item.desired(profile)
                if want is not None:
                    entries.append(_plan_one(gpu_item, ctx, want))
        for node_item in _selected(NODE_ITEMS, only):
            want = node_item.desired(self.config.policy.node, self.config)
            if want is not None:
                entries.append(_plan_one(node_item, self.host, want))
        return entries, profiles

    def _node_plan(self, entries: list[_Planned], profiles: dict[int, ResolvedProfile | None]) -> NodePlan:
        items = tuple(self._noting_hold(entry.plan) for entry in entries)
        modes = {p.item: self.config.item_mode(p.item) for p in items if p.item != GPU_ITEM}
        numbers = {gpu: None if found is None else found.number for gpu, found in profiles.items()}
        resolved = {gpu: found for gpu, found in profiles.items() if found is not None}
        return NodePlan(self.config.mode, items, modes, numbers, resolved)

    def _noting_hold(self, plan: ItemPlan) -> ItemPlan:
        """A held item off its value is `held` while its job runs, naming the job (not drift: the job
        puts it back); a hold that outlived its job is drift again, naming the owner, since nothing
        will put it back until the agent restarts."""
        hold = self.holds.hold(plan.item, plan.gpu)
        if hold is None or plan.status is not PlanStatus.DRIFT:
            return plan
        if hold.live:
            detail = f"held: {hold.reason}" + (f"; {plan.detail}" if plan.detail else "")
            return replace(plan, status=PlanStatus.HELD, detail=detail)
        ended = f"held for {hold.owner}, whose job has ended ({hold.reason}); the policy loop may not put it back"
        facts = (*plan.facts, (HELD_BY_ENDED_JOB_FACT, hold.owner))
        return replace(plan, detail=ended + (f"; {plan.detail}" if plan.detail else ""), facts=facts)

    def plan(self, only: Collection[str] | None = None) -> NodePlan:
        """Plan every configured item, or only those named (the daemon re-plans the fan curve every loop)."""
        return self._node_plan(*self._planned(only))

    # -- apply -----------------------------------------------------------------------------------

    def apply(self, dry_run: bool = False, only: Collection[str] | None = None) -> ApplyReport:
        entries, profiles = self._planned(only)
        results = tuple(self._apply_one(entry, dry_run) for entry in entries)
        return ApplyReport(self._node_plan(entries, profiles), results, dry_run)

    def _apply_one(self, entry: _Planned, dry_run: bool) -> ItemResult:
        plan = entry.plan
        no_write = result_without_write(plan)
        if no_write is not None:
            return no_write
        assert entry.enforce is not None  # only an unidentified GPU has none, and its plan is an ERROR
        if self.config.item_mode(plan.item) is not Mode.ENFORCE:
            return ItemResult(plan, ApplyOutcome.SKIPPED, "observe mode: drift reported, nothing changed")
        held = self.holds.held(plan.item, plan.gpu)
        if held is not None:
            return ItemResult(plan, ApplyOutcome.SKIPPED, f"held: {held}")
        if dry_run:
            return ItemResult(plan, ApplyOutcome.SKIPPED, "dry run: would " + "; ".join(plan.changes))
        return entry.enforce()

    # -- restore ---------------------------------------------------------------------------------

    def restore(self) -> list[ItemResult]:
        """Fans to automatic, locked clocks reset, default power limit: only for items the agent may change."""
        self.enumerate_gpus()
        writable = self.config.writable_items()
        # A GPU that cannot even be identified was not restored: say so, never report success for it.
        results: list[ItemResult] = [
            ItemResult(
                _unreadable(gpu, error),
                ApplyOutcome.FAILED,
                f"GPU {gpu} could not be identified, so nothing on it was restored: {error}",
            )
            for gpu, error in sorted(self.state.unreadable.items())
            if writable & RESTORABLE_NAMES
        ]
        for gpu in sorted(self.state.contexts):
            ctx = self.state.contexts[gpu]
            for item in RESTORABLE_ITEMS:
                if item.name not in writable:
                    continue
                results.append(_guarded_restore(item.name, gpu, partial(item.restore, ctx)))
        return results


def _unreadable(gpu: int, error: GpuError) -> ItemPlan:
    return ItemPlan(GPU_ITEM, gpu, PlanStatus.ERROR, "readable", "unreadable", str(error), (), error.kind.value)


def _selected(items: Sequence[ItemT], only: Collection[str] | None) -> list[ItemT]:
    return [item for item in items if only is None or item.name in only]


@dataclass(frozen=True)
class _Planned:
    """One item on one GPU or the host: its plan, and the write and verification that plan leads
    to (None for the pseudo-item of a GPU that could not be identified)."""

    plan: ItemPlan
    enforce: Callable[[], ItemResult] | None


def _plan_one(item: PolicyItem[T, W, C], target: T, want: W) -> _Planned:
    """Plan `item`, keeping its typed changes with it for `apply`."""
    done = plan_item(item, target, want)
    return _Planned(done.plan, partial(enforce, item, target, want, done))


def _guarded_restore(item: str, gpu: int, restore: Callable[[], ItemResult]) -> ItemResult:
    try:
        return restore()
    except (GpuError, WriteRefused) as exc:
        return ItemResult(
            ItemPlan(item, gpu, PlanStatus.ERROR, "default", "?", str(exc)), ApplyOutcome.FAILED, str(exc)
        )
