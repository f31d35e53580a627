"""Human text for `plan`, `apply` and `events` (the CLI's; `status` is agent/textview.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from agent.policy.engine import NodePlan
from agent.policy.plan import ItemResult, PlanStatus
from agent.policy.profiles import profile_name
from agent.printable import printable
from agent.store.database import StoredEvent, StoredRemediation
from agent.textview import fit, table_blocks


def _gpu(gpu: int | None) -> str:
    return "-" if gpu is None else str(gpu)


#: `plan` fits this many columns (more on a wider terminal): DESIRED and ACTUAL wrap, and each
#: change or detail gets its own line under its item.
PLAN_WIDTH_COLUMNS = 100
_PLAN_HEADERS = ["ITEM", "GPU", "STATUS", "MODE", "DESIRED", "ACTUAL"]


def plan_text(plan: NodePlan, width: int = PLAN_WIDTH_COLUMNS) -> str:
    if not plan.items:
        return "nothing to enforce: the policy sets no item that applies to this node"
    rows = [
        [p.item, _gpu(p.gpu), p.status.value, plan.item_modes.get(p.item, plan.mode).value, p.desired, p.actual]
        for p in plan.items
    ]
    header, *blocks = table_blocks(_PLAN_HEADERS, rows, width, wrap=(4, 5))
    lines = list(header)
    for p, block in zip(plan.items, blocks):
        lines += block
        why = list(p.changes) if p.changes and p.status is PlanStatus.DRIFT else [p.detail] if p.detail else []
        for text in why:
            lines += fit(printable(f"    -> {text}"), width)
    summary = {0: "in sync", 1: "errors", 2: "drift"}[plan.exit_code]
    described = [wrapped for line in profile_lines(plan) for wrapped in fit(printable(line), width)]
    lines += ["", *described] if described else []
    return "\n".join(lines) + f"\n\nplan: {summary}"


def profile_lines(plan: NodePlan) -> list[str]:
    """Where each GPU's settings come from: its profile, and each setting an override changed, with
    the file and line it came from (a drop-in's); GPUs told alike share a line."""
    told: dict[str, list[str]] = {}
    for gpu in sorted(plan.profiles):
        resolved = plan.resolved.get(gpu)
        if resolved is None:
            continue
        base = "no profile" if resolved.number is None else profile_name(resolved.number)
        changed = [f"{key} from {source}" for key, source in resolved.from_overrides().items()]
        told.setdefault("; ".join([base, *changed]), []).append(str(gpu))
    lines = ["profiles (the first of policy.gpus that matches, then every matching override):"] if told else []
    lines += [f"  GPU {', '.join(gpus)}: {text}" for text, gpus in told.items()]
    unmatched = [str(g) for g in sorted(plan.profiles) if g not in plan.resolved]
    if unmatched:
        lines.append(f"no GPU profile matches GPU {', '.join(unmatched)}")
    return lines


def results_text(results: Sequence[ItemResult]) -> str:
    if not results:
        return "nothing to do"
    rows = [[r.plan.item, _gpu(r.plan.gpu), r.outcome.value, r.detail or r.plan.detail] for r in results]
    blocks = table_blocks(["ITEM", "GPU", "OUTCOME", "DETAIL"], rows, PLAN_WIDTH_COLUMNS, wrap=(3,))
    return "\n".join(line for block in blocks for line in block)


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
