"""Node-level families: the backend, node problems, policy items, readiness, services, remediations, collectors."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from agent.config import Mode
from agent.metrics.families import Families, flag, gpu_label, gpu_uuids
from agent.names.policy_items import DRIVER, NEXT_BOOT
from agent.policy.plan import PlanStatus
from agent.readings.row import nonzero
from agent.rules.model import Outcome
from agent.state import NodeSnapshot
from agent.verdict import AttentionCause, NodeProblem, attention_items, expected_gpu_count, is_drift, node_problem

#: Plan statuses listed with the policy_detail family off: an item that could not be read, or waits
#: for a reboot (drift is gpu_agent_policy_drift's; in sync and not applicable need nobody).
_UNSETTLED = frozenset({PlanStatus.ERROR.value, PlanStatus.REBOOT_REQUIRED.value})


def _unsettled(labels: Mapping[str, str], value: float) -> bool:
    return value == 1 and labels.get("status") in _UNSETTLED


def backend(out: Families, snap: NodeSnapshot) -> None:
    out.gauge(
        "gpu_agent_node_info",
        "The node's own host name (what dcgm-exporter calls Hostname), whatever address Prometheus scrapes; always 1.",
        {"hostname": snap.hostname},
        1,
        family="node",
    )
    out.gauge(
        "gpu_agent_backend_info",
        "GPU backend in use and the driver it reports; always 1.",
        {"backend": snap.backend, "driver_version": snap.driver_version or ""},
        1,
        family="node",
    )
    out.gauge(
        "gpu_agent_backend_up",
        "1 when the GPU backend (NVML and the driver) can be read, 0 when it cannot.",
        {},
        float(not snap.backend_error),
        family="node",
    )
    problem = node_problem(snap)
    for cause in NodeProblem:
        out.gauge(
            "gpu_agent_node_problem",
            "1 for the cause that keeps the node's GPUs from being judged (no driver, no GPUs, fewer GPUs "
            "than expected), 0 for the others.",
            {"cause": cause.value},
            float(problem is not None and problem.cause is cause),
            family="node",
        )
    needs = attention_items(snap)
    for attention_cause in AttentionCause:
        out.gauge(
            "gpu_agent_attention",
            "Lines of the agent's verdict that need an operator (gpu-agent status: ATTENTION NEEDED), by cause; "
            "0 for every cause: all healthy.",
            {"cause": attention_cause.value},
            sum(1 for item in needs if item.cause is attention_cause),
            family="node",
        )
    out.gauge(
        "gpu_agent_reboot_recommended",
        "1 while state_dir/reboot-recommended asks for a reboot on this boot, with the kind of event that "
        "led to it (none without one; the reason's text is in gpu-agent status).",
        {"cause": snap.reboot_recommended_cause or "none"},
        float(snap.reboot_recommended is not None),
        family="node",
    )
    out.gauge(
        "gpu_agent_start_time_seconds",
        "When the agent started, in seconds since the epoch.",
        {},
        snap.started_seconds,
        family="node",
    )
    out.gauge(
        "gpu_agent_snapshot_timestamp_seconds",
        "When the snapshot served was taken; an old one means the loop is stuck.",
        {},
        snap.timestamp_seconds,
        family="node",
    )
    out.gauge(
        "gpu_agent_gpus_expected",
        "GPUs this node should have: every GPU seen since boot, less those acknowledged gone (gpu-agent ack).",
        {},
        expected_gpu_count(snap),
        family="node",
    )
    out.gauge(
        "gpu_agent_collect_duration_seconds",
        "How long the last collection loop took.",
        {},
        snap.collect_duration_seconds,
        family="node",
    )


def policy(out: Families, snap: NodeSnapshot) -> None:
    uuids = gpu_uuids(snap)
    answering = frozenset(sample.index for sample in snap.gpus if sample.up)
    # A GPU acknowledged gone has left the snapshot: its items go with it.
    plans = [plan for plan in snap.policy if plan.gpu is None or plan.gpu in uuids]
    for (item, status), targets in sorted(Counter((plan.item, plan.status.value) for plan in plans).items()):
        out.gauge(
            "gpu_agent_policy_targets",
            "Targets of a policy item (its GPUs, or the node for a node item) per plan status.",
            {"item": item, "status": status},
            targets,
            family="policy",
        )
    for plan in plans:
        labels = {
            "item": plan.item,
            "gpu": gpu_label(plan.gpu),
            "uuid": "" if plan.gpu is None else uuids[plan.gpu],
        }
        out.gauge(
            "gpu_agent_policy_in_sync",
            "1 when a policy item matches its desired state (or does not apply to this device), else 0.",
            labels,
            float(plan.in_sync),
            family="policy_detail",
        )
        if plan.item != "gpu":  # an unreadable GPU is reported as lost, not as a policy item
            out.gauge(
                "gpu_agent_policy_drift",
                "1 when a policy item is off its desired value on a device that answers (not a pending "
                "reboot, not a lost GPU), else 0.",
                labels,
                float(is_drift(plan, answering)),
                family="policy_detail",
                notable=nonzero,
            )
        out.one_hot(
            "gpu_agent_policy_status",
            "Policy item plan status, one series per status, 1 for the current one.",
            labels,
            "status",
            plan.status,
            family="policy_detail",
            notable=_unsettled,
        )
    for item, mode in sorted(snap.item_modes.items()):
        out.gauge(
            "gpu_agent_policy_enforced",
            "1 when the agent repairs drift of this item (enforce mode), 0 when it only reports it (observe).",
            {"item": item},
            float(mode == Mode.ENFORCE.value),
            family="policy",
        )


def readiness(out: Families, snap: NodeSnapshot) -> None:
    """What the report-only items found: the driver, and whether the next boot brings the GPUs back."""
    for plan in snap.policy:
        facts = dict(plan.facts)
        if plan.item == NEXT_BOOT and plan.status in (PlanStatus.IN_SYNC, PlanStatus.DRIFT):
            out.gauge(
                "gpu_agent_boot_ready",
                "1 when the kernel that boots next has the NVIDIA module (signed under Secure Boot) and an "
                "initramfs that keeps nouveau out; the cause names what is missing first (none when ready; the "
                "kernel and the whole reason are in gpu-agent status).",
                {"cause": facts.get("cause") or "none"},
                float(plan.status is PlanStatus.IN_SYNC),
                family="node",
            )
        if plan.item == DRIVER and "version" in facts:
            out.gauge(
                "gpu_agent_driver_info",
                "The loaded NVIDIA driver, its branch where the installed package tells it, and the newest "
                "CUDA version it supports; always 1.",
                {k: facts.get(k, "") for k in ("version", "branch", "cuda_version")},
                1,
                family="node",
            )


def services(out: Families, snap: NodeSnapshot) -> None:
    for service in snap.services:
        labels = {"service": service.name, "unit": service.unit}
        out.gauge(
            "gpu_agent_service_up",
            "1 when the inference service's health probe succeeds (absent until first probed).",
            labels,
            flag(service.up),
            family="services",
        )
        out.gauge(
            "gpu_agent_service_consecutive_failures",
            "Health probes failed in a row.",
            labels,
            service.consecutive_failures,
            family="services",
        )
        out.gauge(
            "gpu_agent_service_probe_latency_seconds",
            "How long the last health probe took.",
            labels,
            service.last_latency_seconds,
            family="services",
        )
    breached = {(b.service, b.objective.removesuffix("_p95")) for b in snap.slo_breaches}
    for name, objectives in sorted(snap.service_slo_seconds.items()):
        for kind in sorted(objectives):
            out.gauge(
                "gpu_agent_service_latency_slo_breached",
                "1 while the service's p95 over the agent's window is above its objective (services[].slo), "
                "as gpu-agent status says; the likely cause is in its service_latency_regression event.",
                {"service": name, "kind": kind},
                float((name, kind) in breached),
                family="services",
            )


def remediations(out: Families, snap: NodeSnapshot) -> None:
    # Every outcome of a (rule, action) the agent has decided on starts at 0, so the first
    # failure after a success is an increase; the node total exists from the start.
    counts = {(c.rule, c.action, c.outcome): c.count for c in snap.remediations}
    outcomes = [o.value for o in Outcome]
    outcomes += sorted({c.outcome for c in snap.remediations} - set(outcomes))
    for rule, action in sorted({(c.rule, c.action) for c in snap.remediations}):
        for outcome in outcomes:
            out.counter(
                "gpu_agent_remediations",
                "Remediation decisions of rules, by outcome (dry_run: observe mode or a dry-run rule, what the "
                "agent would have done; refused: a safety check said no).",
                {"rule": rule, "action": action, "outcome": outcome},
                counts.get((rule, action, outcome), 0),
                family="remediation",
            )
    for failing in snap.remediation_failing:
        out.gauge(
            "gpu_agent_remediation_failing",
            "1 while a rule cannot fix its fault, by cause: failed or refused (its last attempt on a target), "
            "exhausted (its attempts ran out); listed while it holds, until a later success or gpu-agent ack RULE.",
            {"rule": failing.rule, "cause": failing.cause},
            1,
            family="remediation",
        )
    for outcome in outcomes:
        out.counter(
            "gpu_agent_remediation_outcomes",
            "Remediation decisions of all rules, by outcome.",
            {"outcome": outcome},
            sum(c.count for c in snap.remediations if c.outcome == outcome),
            family="remediation",
        )


def collectors(out: Families, snap: NodeSnapshot) -> None:
    for status in snap.collectors:
        labels = {"collector": status.name}
        out.gauge(
            "gpu_agent_collector_success",
            "1 when the collector's last run succeeded.",
            labels,
            float(status.success),
            family="collectors",
        )
        out.gauge(
            "gpu_agent_collector_duration_seconds",
            "How long the collector's last run took.",
            labels,
            status.duration_seconds,
            family="collectors",
        )
