"""The node's verdicts, derived from one NodeSnapshot in one place: what `/metrics` exports as the
daemon's judgement, what STATUS= and `/healthz` say, and what `gpu-agent status` shows and exits
with. The alert rules and the dashboard are built on the exported verdicts, so every view of the
node agrees with the daemon.

- A node problem (no driver, no GPU readable, fewer GPUs than expected) is the worst state, not
  health: an empty GPU table reads "all healthy" otherwise.
- Throttling counts only for the reasons the throttle watcher treats as a problem: idle and the
  power cap the agent was told to hold are normal.
- Drift is a policy item off its desired value on a GPU that answers: `reboot_required` (set,
  waiting for the reboot) is no drift, a lost GPU is reported as lost, not as drift, and an item a
  running job drives (a tune sweep's power limit: `held`, naming the job) is no drift either. A
  hold that outlives its job is drift again, and its line names the job.
- Beyond the GPUs, whatever the agent knows is wrong is attention too, in every mode: a service
  down or over its latency objective, a next boot that would not bring the GPUs back, a driver too
  old for a service's CUDA, a daemon with no rules although rules directories are configured, and
  what a config reload left to do. Each line has its cause (`AttentionCause`), exported as
  `gpu_agent_attention{cause}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from agent.config import Mode
from agent.defaults import REBOOT_FLAG_NAME
from agent.events import EventKind, HealthState
from agent.host import file_reads, safe_json
from agent.host.paths import HostPaths

# The report-only items with verdict lines of their own (whatever their mode), never "policy drift".
from agent.names.policy_items import DRIVER, NEXT_BOOT
from agent.policy.plan import CUDA_TOO_OLD_FACT, HELD_BY_ENDED_JOB_FACT, ItemPlan, PlanStatus
from agent.state import NodeSnapshot
from agent.watch.clock_events import SLOWDOWN_REASONS
from agent.watch.throttle import EXPECTED_REASONS

#: Clock-event reasons that make a GPU "throttled" in the daemon's eyes.
THROTTLE_PROBLEM_REASONS: tuple[str, ...] = tuple(sorted(SLOWDOWN_REASONS - EXPECTED_REASONS))
#: The GPU that could not be read at all is planned as item "gpu"; it is a lost GPU, not drift.
_UNREADABLE_GPU_ITEM = "gpu"
# The flag is a few lines of JSON (agent.rules.actions.kinds.recommend_reboot writes it).
_FLAG_LIMIT_BYTES = 64 * 1024


class NodeProblem(str, Enum):
    BACKEND_UNREADABLE = "backend_unreadable"  # no driver, NVML cannot be loaded or initialised
    NO_GPUS = "no_gpus"  # the backend answers but shows no GPU
    GPUS_MISSING = "gpus_missing"  # fewer GPUs answer than the node should have


@dataclass(frozen=True)
class Problem:
    cause: NodeProblem
    detail: str


def expected_gpu_count(snapshot: NodeSnapshot) -> int:
    """GPUs this node should have: every GPU in the snapshot, a remembered missing one included
    (the daemon's node memory keeps those in its samples; an acknowledged one is left out of them)."""
    return len({sample.uuid or f"index:{sample.index}" for sample in snapshot.gpus})


def node_problem(snapshot: NodeSnapshot) -> Problem | None:
    """Why the node's GPUs cannot be trusted as a whole; None when they can be read."""
    if snapshot.backend_error:
        return Problem(NodeProblem.BACKEND_UNREADABLE, f"GPU driver unreadable: {snapshot.backend_error}")
    if not snapshot.gpus:
        return Problem(NodeProblem.NO_GPUS, "no GPUs found: is the NVIDIA driver loaded?")
    answering = sum(1 for sample in snapshot.gpus if sample.up)
    expected = snapshot.expected_gpus
    if expected is not None and answering < expected:
        return Problem(NodeProblem.GPUS_MISSING, f"{answering} of {expected} expected GPUs answer")
    return None


def throttled_reasons(snapshot: NodeSnapshot, gpu: int) -> list[str]:
    """The slowdowns active on `gpu` that the daemon counts against its health."""
    return sorted(
        reason for (index, reason) in snapshot.throttle_active_since if index == gpu and reason not in EXPECTED_REASONS
    )


def is_drift(plan: ItemPlan, answering_gpus: frozenset[int]) -> bool:
    if plan.status is not PlanStatus.DRIFT or plan.item == _UNREADABLE_GPU_ITEM:
        return False
    return plan.gpu is None or plan.gpu in answering_gpus


def drifted(snapshot: NodeSnapshot) -> list[ItemPlan]:
    answering = frozenset(sample.index for sample in snapshot.gpus if sample.up)
    return [plan for plan in snapshot.policy if is_drift(plan, answering)]


class AttentionCause(str, Enum):
    """Why a verdict line is there: the `cause` label of gpu_agent_attention."""

    NODE_PROBLEM = "node_problem"
    GPU_LOST = "gpu_lost"
    GPU_HEALTH = "gpu_health"
    REBOOT_RECOMMENDED = "reboot_recommended"
    POLICY_DRIFT = "policy_drift"
    SERVICE_DOWN = "service_down"
    SERVICE_SLO = "service_slo"
    NEXT_BOOT = "next_boot"
    DRIVER = "driver"
    NO_RULES = "no_rules"
    CONFIG = "config"


@dataclass(frozen=True)
class Attention:
    cause: AttentionCause
    text: str


def attention_items(snapshot: NodeSnapshot, mode: str = "observe") -> list[Attention]:
    """What needs an operator, one line each with its cause; empty when the node is all healthy."""
    found: list[Attention] = []

    def add(cause: AttentionCause, text: str) -> None:
        found.append(Attention(cause, text))

    problem = node_problem(snapshot)
    if problem is not None:
        add(AttentionCause.NODE_PROBLEM, problem.detail)
    for sample in snapshot.gpus:
        health = snapshot.health.get(sample.index)
        if not sample.up:
            reason = f": {health.reason}" if health and health.reason else ""
            add(AttentionCause.GPU_LOST, f"GPU {sample.index} lost{reason}")
        elif health is not None and health.state is not HealthState.HEALTHY:
            add(AttentionCause.GPU_HEALTH, f"GPU {sample.index} {health.state.value}: {health.reason}")
    if snapshot.reboot_recommended is not None:
        add(
            AttentionCause.REBOOT_RECOMMENDED,
            f"reboot recommended: {snapshot.reboot_recommended} (`gpu-agent ack reboot` once dealt with otherwise)",
        )
    for plan in drifted(snapshot):
        if plan.item == NEXT_BOOT or (plan.item == DRIVER and _cuda_too_old(plan)):
            continue  # their own lines below
        if snapshot.item_modes.get(plan.item, mode) == Mode.ENFORCE.value:
            where = "" if plan.gpu is None else f" on GPU {plan.gpu}"
            wanted = f"(want {plan.desired}, have {plan.actual})"
            owner = dict(plan.facts).get(HELD_BY_ENDED_JOB_FACT)
            why = f": held for {owner}, whose job has ended" if owner else ""
            add(AttentionCause.POLICY_DRIFT, f"policy drift: {plan.item}{where} {wanted}{why}")
    for service in snapshot.services:
        if service.up is False:
            why = f": {service.detail}" if service.detail else ""
            add(AttentionCause.SERVICE_DOWN, f"service {service.name} down{why}")
    for breach in snapshot.slo_breaches:
        objective = breach.objective.replace("_", " ")
        add(
            AttentionCause.SERVICE_SLO,
            f"service {breach.service} over its latency objective: {objective} {breach.observed_seconds:.2f} s"
            f" > {breach.limit_seconds:g} s; likely cause: {breach.cause_summary}",
        )
    for plan in snapshot.policy:
        if plan.item == NEXT_BOOT and plan.status is PlanStatus.DRIFT:
            summary = dict(plan.facts).get("summary") or plan.actual
            add(AttentionCause.NEXT_BOOT, f"next boot not ready: {summary}")
        elif plan.item == DRIVER and _cuda_too_old(plan):
            add(AttentionCause.DRIVER, f"driver too old: {_cuda_too_old(plan)}")
    if snapshot.rules_loaded == 0 and snapshot.rules_dirs:
        add(
            AttentionCause.NO_RULES,
            f"no remediation rules loaded from {', '.join(snapshot.rules_dirs)}: faults are reported, never acted on"
            " (remediation.rules_dirs: [] turns remediation off)",
        )
    for line in reload_attention(snapshot):
        add(AttentionCause.CONFIG, line)
    return found


def attention(snapshot: NodeSnapshot, mode: str = "observe") -> list[str]:
    """What needs an operator, one line each; empty when the node is all healthy."""
    return [item.text for item in attention_items(snapshot, mode)]


def _cuda_too_old(plan: ItemPlan) -> str:
    return dict(plan.facts).get(CUDA_TOO_OLD_FACT, "") if plan.status is PlanStatus.DRIFT else ""


def reload_attention(snapshot: NodeSnapshot) -> list[str]:
    """A config on disk the daemon does not run: a reload it refused, or a change only a restart applies.
    The running config stays whole in both cases, so what the operator edited is not in effect."""
    reasons: list[str] = []
    if snapshot.config_pending_restart:
        reasons.append("config change needs a restart: " + ", ".join(snapshot.config_pending_restart))
    if snapshot.reload_error:
        reasons.append(f"config reload failed (running the previous config): {snapshot.reload_error}")
    return reasons


def reboot_recommended(state_dir: str | Path, paths: HostPaths) -> str | None:
    """The reason in `state_dir/reboot-recommended`; None without one, when it was written before
    the last boot (that reboot happened: the flag is spent), or when this user may not read it (a
    direct read by a non-root user: what it cannot read is no finding)."""
    found = reboot_recommendation(state_dir, paths)
    return None if found is None else found[0]


#: The cause of a reboot recommendation whose flag cannot be read, or names no kind of event.
UNREADABLE_FLAG_CAUSE = "unreadable"
UNKNOWN_EVENT_CAUSE = "unknown"
_EVENT_KINDS = frozenset(kind.value for kind in EventKind)


def reboot_recommendation(state_dir: str | Path, paths: HostPaths) -> tuple[str, str] | None:
    """(the reason's text, the kind of event behind it) of `state_dir/reboot-recommended`: the kind is
    a bounded code (an EventKind value, "unknown" or "unreadable"), the text is for people. None as for
    `reboot_recommended`."""
    unreadable = ("reboot-recommended flag present (unreadable)", UNREADABLE_FLAG_CAUSE)
    try:
        flag = safe_json.loads(file_reads.read_text(Path(state_dir) / REBOOT_FLAG_NAME, _FLAG_LIMIT_BYTES))
    except (FileNotFoundError, PermissionError):
        return None
    except (OSError, ValueError):
        return unreadable
    if not isinstance(flag, dict):
        return unreadable
    written_boot = flag.get("boot_id")
    if written_boot:
        current_boot = paths.boot_id()
        if current_boot and current_boot != written_boot:
            return None
    event = flag.get("event")
    cause = event if isinstance(event, str) and event in _EVENT_KINDS else UNKNOWN_EVENT_CAUSE
    return str(flag.get("reason") or "reboot recommended"), cause
