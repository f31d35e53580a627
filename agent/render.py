"""Human text for `plan`, `apply` and `events` (the CLI's; `status` is agent/textview.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from agent.policy.base import ItemPlan, ItemResult, PlanStatus
from agent.policy.engine import NodePlan
from agent.printable import printable
from agent.store.database import StoredEvent, StoredRemediation
from agent.textview import table


def _gpu(gpu: int | None) -> str:
    return "-" if gpu is None else str(gpu)


def _why(plan: ItemPlan) -> str:
    if plan.changes and plan.status is PlanStatus.DRIFT:
        return "; ".join(plan.changes)
    return plan.detail


def plan_text(plan: NodePlan) -> str:
    if not plan.items:
        return "nothing to enforce: the policy sets no item that applies to this node"
    rows = [
        [
            p.item,
            _gpu(p.gpu),
            p.status.value,
            plan.item_modes.get(p.item, plan.mode).value,
            p.desired,
            p.actual,
            _why(p),
        ]
        for p in plan.items
    ]
    summary = {0: "in sync", 1: "errors", 2: "drift"}[plan.exit_code]
    body = table(["ITEM", "GPU", "STATUS", "MODE", "DESIRED", "ACTUAL", "CHANGE / DETAIL"], rows)
    unmatched = [str(g) for g, n in sorted(plan.profiles.items()) if n is None]
    note = f"\nno GPU profile matches GPU {', '.join(unmatched)}" if unmatched else ""
    return f"{body}{note}\n\nplan: {summary}"


def results_text(results: Sequence[ItemResult]) -> str:
    if not results:
        return "nothing to do"
    rows = [[r.plan.item, _gpu(r.plan.gpu), r.outcome.value, r.detail or r.plan.detail] for r in results]
    return table(["ITEM", "GPU", "OUTCOME", "DETAIL"], rows)


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def history_text(events: Sequence[StoredEvent], remediations: Sequence[StoredRemediation]) -> str:
    """`gpu-agent events`: one time-ordered list of what happened and what the agent did about it."""
    lines: list[tuple[float, str]] = []
    for stored in events:
        e = stored.event
        # Watchers already start their messages with the GPU ("GPU 0 (0000:3B:00.0): Xid 79 ..."); say it once.
        where = "" if e.gpu is None or e.message.startswith(f"GPU {e.gpu}") else f"GPU {e.gpu} "
        lines.append(
            (
                e.timestamp_seconds,
                printable(f"{_when(e.timestamp_seconds)}  event  [{e.severity.value}] {where}{e.message}"),
            )
        )
    for r in remediations:
        target = r.service or (f"GPU {r.gpu}" if r.gpu is not None else "node")
        text = f"{r.rule}: {r.action} on {target} -> {r.outcome.value}"
        if r.detail or r.reason:
            text += f" ({r.detail or r.reason})"
        lines.append((r.started_seconds, printable(f"{_when(r.started_seconds)}  action {text}")))
    if not lines:
        return "no events or remediations in that period"
    return "\n".join(text for _, text in sorted(lines))
