"""Plans and applies the whole node policy: every GPU item on every GPU, then the node items.

One GPU or item failing never stops the others: each becomes an ERROR plan or a FAILED
result, and the rest of the node is still handled. Apply only touches items whose plan was
read completely and says DRIFT, and only in enforce mode; afterwards each applied item is
planned again, so "applied" means verified, not merely attempted.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

from agent.backend.base import GpuBackend, GpuIdentity
from agent.backend.errors import GpuError, WriteRefused
from agent.config import AgentConfig, GpuProfile, Mode
from agent.policy import ecc, fan_curve, locked_clocks, nouveau, persistence, power_limit, thp, triton_cache
from agent.policy.base import GpuContext, HostContext, ItemPlan, ItemResult, Outcome, PlanStatus

GPU_ITEM_MODULES: tuple[ModuleType, ...] = (power_limit, locked_clocks, fan_curve, persistence, ecc)
NODE_ITEM_MODULES: tuple[ModuleType, ...] = (thp, triton_cache, nouveau)
RESTORABLE_MODULES: tuple[ModuleType, ...] = (fan_curve, locked_clocks, power_limit)

#: Pseudo-item for a GPU that cannot even be identified (lost before the plan started).
GPU_ITEM = "gpu"


def match_profile(profiles: Sequence[GpuProfile], identity: GpuIdentity) -> int | None:
    """Index of the first profile matching the GPU (every given key must match), or None."""
    for number, profile in enumerate(profiles):
        m = profile.match
        if m.model is not None and not fnmatch.fnmatchcase(identity.name, m.model):
            continue
        if m.uuid is not None and m.uuid.lower() != identity.uuid.lower():
            continue
        if m.index is not None and m.index != identity.index:
            continue
        return number
    return None


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
        bad = {Outcome.FAILED}
        if any(r.outcome in bad for r in self.results) or self.plan.has_error:
            return 1
        unapplied = [r for r in self.results if r.outcome is Outcome.SKIPPED and r.plan.status is PlanStatus.DRIFT]
        return 1 if unapplied and not self.dry_run else 0


class PolicyEngine:
    """Holds the config, the backend and the host; keeps per-GPU contexts between loops."""

    def __init__(self, config: AgentConfig, backend: GpuBackend, host: HostContext) -> None:
        self.config = config
        self.backend = backend
        self.host = host
        self.state = NodeState()

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

    def _gpu_desired(
        self, gpu: int, only: Collection[str] | None = None
    ) -> tuple[int | None, list[tuple[ModuleType, Any]]]:
        profiles = self.config.policy.gpus
        number = match_profile(profiles, self.state.identities[gpu])
        if number is None:
            return None, []
        profile = profiles[number]
        wanted = [(m, m.desired(profile)) for m in GPU_ITEM_MODULES if only is None or m.NAME in only]
        return number, [(m, w) for m, w in wanted if w is not None]

    def _node_desired(self, only: Collection[str] | None = None) -> list[tuple[ModuleType, Any]]:
        node = self.config.policy.node
        wanted = [(m, m.desired(node, self.config)) for m in NODE_ITEM_MODULES if only is None or m.NAME in only]
        return [(m, w) for m, w in wanted if w is not None]

    def plan(self, only: Collection[str] | None = None) -> NodePlan:
        """Plan every configured item, or only those named (the daemon re-plans the fan curve every loop)."""
        self.enumerate_gpus()
        items: list[ItemPlan] = []
        profiles: dict[int, int | None] = {}
        for gpu, error in sorted(self.state.unreadable.items()):
            items.append(
                ItemPlan(GPU_ITEM, gpu, PlanStatus.ERROR, "readable", "unreadable", str(error), (), error.kind.value)
            )
        for gpu in sorted(self.state.identities):
            number, wanted = self._gpu_desired(gpu, only)
            profiles[gpu] = number
            ctx = self.state.contexts[gpu]
            items.extend(_guarded_plan(module.NAME, gpu, partial(module.plan, ctx, want)) for module, want in wanted)
        items.extend(
            _guarded_plan(module.NAME, None, partial(module.plan, self.host, want))
            for module, want in self._node_desired(only)
        )
        modes = {p.item: self.config.item_mode(p.item) for p in items if p.item != GPU_ITEM}
        return NodePlan(self.config.mode, tuple(items), modes, profiles)

    # -- apply -----------------------------------------------------------------------------------

    def apply(self, dry_run: bool = False, only: Collection[str] | None = None) -> ApplyReport:
        node_plan = self.plan(only)
        desired = self._desired_by_key()
        results = [self._apply_item(p, desired, dry_run) for p in node_plan.items]
        return ApplyReport(node_plan, tuple(results), dry_run)

    def _desired_by_key(self) -> dict[tuple[str, int | None], tuple[ModuleType, Any]]:
        by_key: dict[tuple[str, int | None], tuple[ModuleType, Any]] = {}
        for gpu in self.state.identities:
            for module, want in self._gpu_desired(gpu)[1]:
                by_key[(module.NAME, gpu)] = (module, want)
        for module, want in self._node_desired():
            by_key[(module.NAME, None)] = (module, want)
        return by_key

    def _apply_item(
        self, plan: ItemPlan, desired: dict[tuple[str, int | None], tuple[ModuleType, Any]], dry_run: bool
    ) -> ItemResult:
        if plan.status in (PlanStatus.IN_SYNC, PlanStatus.NOT_APPLICABLE):
            return ItemResult(plan, Outcome.UNCHANGED)
        if plan.status is PlanStatus.REBOOT_REQUIRED:
            return ItemResult(plan, Outcome.REBOOT_REQUIRED, plan.detail)
        if plan.status is PlanStatus.ERROR:
            return ItemResult(plan, Outcome.SKIPPED, f"not applied: {plan.detail}")
        if self.config.item_mode(plan.item) is not Mode.ENFORCE:
            return ItemResult(plan, Outcome.SKIPPED, "observe mode: drift reported, nothing changed")
        if dry_run:
            return ItemResult(plan, Outcome.SKIPPED, "dry run: would " + "; ".join(plan.changes))
        module, want = desired[(plan.item, plan.gpu)]
        target: GpuContext | HostContext = self.host if plan.gpu is None else self.state.contexts[plan.gpu]
        try:
            result: ItemResult = module.apply(target, want, plan)
        except WriteRefused as exc:
            return ItemResult(plan, Outcome.FAILED, str(exc))
        except GpuError as exc:
            return ItemResult(plan, Outcome.FAILED, str(exc))
        except OSError as exc:
            return ItemResult(plan, Outcome.FAILED, f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        if result.outcome is not Outcome.APPLIED:
            return result
        verified = _guarded_plan(plan.item, plan.gpu, lambda: module.plan(target, want))
        if verified.status in (PlanStatus.IN_SYNC, PlanStatus.REBOOT_REQUIRED):
            return result
        return ItemResult(
            verified, Outcome.FAILED, f"applied but still {verified.status.value}: actual {verified.actual}"
        )

    # -- restore ---------------------------------------------------------------------------------

    def restore(self) -> list[ItemResult]:
        """Fans to automatic, locked clocks reset, default power limit: only for items the agent may change."""
        self.enumerate_gpus()
        writable = self.config.writable_items()
        # A GPU that cannot even be identified was not restored: say so, never report success for it.
        results: list[ItemResult] = [
            ItemResult(
                ItemPlan(GPU_ITEM, gpu, PlanStatus.ERROR, "readable", "unreadable", str(error), (), error.kind.value),
                Outcome.FAILED,
                f"GPU {gpu} could not be identified, so nothing on it was restored: {error}",
            )
            for gpu, error in sorted(self.state.unreadable.items())
            if writable & {m.NAME for m in RESTORABLE_MODULES}
        ]
        for gpu in sorted(self.state.contexts):
            ctx = self.state.contexts[gpu]
            for module in RESTORABLE_MODULES:
                if module.NAME not in writable:
                    continue
                results.append(_guarded_restore(module.NAME, gpu, partial(module.restore, ctx)))
        return results


def _guarded_plan(item: str, gpu: int | None, plan: Callable[[], ItemPlan]) -> ItemPlan:
    """Backstop: an item that raises still yields an ERROR plan instead of taking the rest down."""
    try:
        return plan()
    except GpuError as exc:
        return ItemPlan(item, gpu, PlanStatus.ERROR, "?", "?", str(exc), (), exc.kind.value)
    except OSError as exc:
        return ItemPlan(item, gpu, PlanStatus.ERROR, "?", "?", f"{exc.strerror or exc}: {exc.filename or ''}")


def _guarded_restore(item: str, gpu: int, restore: Callable[[], ItemResult]) -> ItemResult:
    try:
        return restore()
    except (GpuError, WriteRefused) as exc:
        return ItemResult(ItemPlan(item, gpu, PlanStatus.ERROR, "default", "?", str(exc)), Outcome.FAILED, str(exc))
