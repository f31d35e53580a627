"""reset_gpu: the safe sequence, once per GPU in an evaluation.

Refused for Xid 79 / a lost GPU (a reset cannot bring it back: reboot territory), for MIG enabled
or pending (a reset destroys the instances or changes the mode), for a GPU whose index now names
another uuid. Otherwise: drain the services using the GPU that declare `drain`, stop them; wait
(bounded) until NVML lists no compute process on it, else start the services again and refuse,
naming each process left and the configured service it belongs to, if any; reset, inside a hardware
transaction that puts the power limit and clock lock back as they were before (a reset returns
them to defaults; agent.policy.holds); re-apply the node policy; start the services; wait until
healthy. The outcome's detail lists every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final

from agent.backend.base import GpuProcess
from agent.backend.errors import GpuError, GpuErrorKind, WriteRefused
from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.events import EventKind, SuggestedAction
from agent.logs import get_logger
from agent.policy.plan import ApplyOutcome
from agent.policy.transaction import SETTINGS, TransactionClosed, TransactionError
from agent.rules.actions.base import Result, failed, gpu_of, refused, uuid_of, xid_of
from agent.rules.actions.context import ActionContext
from agent.rules.actions.kind import ActionType, ClearsXids, Footprint, Lane, Once, Targets, gpus_of
from agent.rules.actions.service_actions import (
    drain_service,
    drain_timeout,
    managers_for,
    ready_timeout,
    services_for_gpu,
    start_again,
)
from agent.rules.actions.steps import GPU_RESET, POLICY_APPLIED, STOPPED, STOPPING, step
from agent.rules.model import Decision, Outcome
from agent.rules.params import ActionParams
from agent.services.attribution import attribute_gpu_processes, command_of_pid, command_service_pids
from agent.services.managers import ServiceError
from agent.watch.kernel_log import FALLEN_OFF_BUS_XID

log = get_logger()


class ResetGpuParams(ActionParams):
    # Spelled as the remedy it carries out (SuggestedAction), as a rule's `xid: {catalog_action: ...}` names it.
    kind: ClassVar[str] = SuggestedAction.RESET_GPU.value


def _reset_refusal(decision: Decision, gpu: int, ctx: ActionContext) -> str | None:
    """Why the GPU must not be reset, or None. A GPU that fell off the bus (Xid 79) or is lost cannot be
    brought back by a reset, only by a reboot (or a repair)."""
    event = decision.event
    if event.kind is EventKind.GPU_LOST or xid_of(event) == FALLEN_OFF_BUS_XID:
        return f"Xid {FALLEN_OFF_BUS_XID} / GPU lost: a reset cannot recover GPU {gpu}; it needs a reboot"
    try:
        identity = ctx.backend.identity(gpu)
    except GpuError as exc:
        if exc.kind is GpuErrorKind.GPU_LOST:
            return f"GPU {gpu} has fallen off the bus: a reset cannot recover it; it needs a reboot"
        return f"cannot identify GPU {gpu}: {exc}"
    uuid = uuid_of(decision)
    if uuid and uuid.lower() != identity.uuid.lower():
        return f"GPU index {gpu} is now {identity.uuid}, not {uuid}: the GPUs were re-enumerated"
    try:
        mig = ctx.backend.mig_mode(gpu)
    except GpuError as exc:
        if exc.kind is GpuErrorKind.NOT_SUPPORTED:
            return None
        if exc.kind is GpuErrorKind.GPU_LOST:
            return f"GPU {gpu} has fallen off the bus: a reset cannot recover it; it needs a reboot"
        return f"cannot read the MIG mode of GPU {gpu}: {exc}"
    if mig.current:
        return f"MIG is enabled on GPU {gpu}: a reset destroys its MIG instances"
    if mig.pending:
        return f"a MIG mode change is pending on GPU {gpu}: a reset would apply it"
    return None


def _describe_processes(gpu: int, processes: Sequence[GpuProcess], ctx: ActionContext) -> str:
    """Each process with its command and whose it is: a configured service's (one the reset did not
    stop: it runs on another GPU by config) or no configured service's (a notebook, a tool)."""
    services = ctx.config.services
    command_pids = command_service_pids(services) if any(s.manager == "command" for s in services) else {}
    found = attribute_gpu_processes({gpu: processes}, {}, services, ctx.host.paths, command_pids)
    owners = {pid: name for name, pids in found.pids.items() for pid in pids}
    strays = {info.pid: info for info in found.unattributed}
    named = []
    for process in processes:
        comm = command_of_pid(process.pid, ctx.host.paths) or "?"
        if process.pid in owners:
            named.append(f"{process.pid} ({comm}, service {owners[process.pid]})")
        else:
            unit = strays[process.pid].unit
            named.append(f"{process.pid} ({comm}{f', {unit}' if unit else ''}, in no configured service)")
    return ", ".join(named)


def _wait_idle(gpu: int, ctx: ActionContext) -> tuple[list[GpuProcess], float]:
    """Poll NVML's process list until it is empty or the drain timeout passes: (remaining, waited)."""
    began = ctx.monotonic()
    deadline = began + ctx.drain_timeout_seconds
    while True:
        processes = ctx.backend.compute_processes(gpu)
        now = ctx.monotonic()
        if not processes or now >= deadline or ctx.cancel.is_set():  # cancel: the agent is stopping
            return processes, now - began
        ctx.sleep(min(ctx.drain_poll_seconds, deadline - now))


def _reset_in_transaction(gpu: int, ctx: ActionContext, steps: list[str]) -> Outcome | None:
    """Reset the GPU inside a hardware transaction on the settings the agent may write there
    (agent.policy.holds): their originals are read and journaled first and put back after the
    reset however it went, before the policy is re-applied; a setting whose original cannot be read
    is left to the policy. None when the GPU was reset, else the outcome."""
    keys = [(item, gpu) for item in SETTINGS if item in ctx.config.writable_items()]
    try:
        transaction = ctx.policy.holds.begin(
            f"reset of GPU {gpu}", f"GPU {gpu} is being reset", ctx.backend, keys, required=False
        )
    except TransactionError as exc:
        steps.append(f"reset of GPU {gpu} refused: {exc}")
        return Outcome.REFUSED
    outcome: Outcome | None = None
    with transaction:
        try:
            transaction.change(lambda: ctx.backend.reset_gpu(gpu))
        except (GpuError, WriteRefused, TransactionClosed) as exc:
            steps.append(f"reset of GPU {gpu} failed: {exc}")
            # IN_USE: something grabbed the GPU between our check and the reset; a safety refusal.
            in_use = isinstance(exc, GpuError) and exc.kind is GpuErrorKind.IN_USE
            outcome = Outcome.REFUSED if in_use or isinstance(exc, TransactionClosed) else Outcome.FAILED
        else:
            steps.append(step(GPU_RESET, str(gpu)))
            ctx.journal(step(GPU_RESET, str(gpu)))
    restored = ", ".join(transaction.restored or ()) or "none held"
    left = f"; left to the policy: {', '.join(transaction.unread)}" if transaction.unread else ""
    steps.append(f"settings put back: {restored}{left}")
    return outcome


def reset_gpu(decision: Decision, params: ResetGpuParams, ctx: ActionContext) -> Result:
    gpu = gpu_of(decision)
    if gpu is None:
        return failed("reset_gpu needs a GPU target")
    refusal = _reset_refusal(decision, gpu, ctx)
    if refusal is not None:
        return refused(refusal)
    services = services_for_gpu(ctx.config, gpu)
    managers = managers_for(services, ctx)
    if isinstance(managers, str):
        return refused(f"cannot stop the services on GPU {gpu}: {managers}")
    steps: list[str] = []
    stopped: list[ServiceConfig] = []
    for service in services:
        if ctx.prober is not None:
            budget = ctx.drain_timeout_seconds + 2 * service.command_timeout_seconds + ready_timeout(service, None)
            ctx.prober.expect_down(service.name, drain_timeout(service) + budget)
        drain_service(service, decision, ctx, steps)
        ctx.journal(step(STOPPING, service.name))
        try:
            managers[service.name].stop(service)
        except ServiceError as exc:
            steps.append(f"stop {service.name} failed: {exc}")
            if ctx.prober is not None:
                ctx.prober.expect_down(service.name, 0)
            start_again(stopped, managers, ctx, steps)
            return failed("; ".join(steps))
        stopped.append(service)
        steps.append(step(STOPPED, service.name))
        ctx.journal(step(STOPPED, service.name))

    try:
        outcome = _reset_idle_gpu(gpu, ctx, steps)
    except Exception as exc:  # whatever went wrong, the stopped services must come back
        log.exception("GPU reset sequence failed unexpectedly", gpu=gpu)
        steps.append(f"unexpected error: {type(exc).__name__}: {exc}")
        outcome = Outcome.FAILED
    back = start_again(stopped, managers, ctx, steps)
    if outcome is Outcome.SUCCESS and not back:
        outcome = Outcome.FAILED
    return Result(outcome, "; ".join(steps))


def _reset_idle_gpu(gpu: int, ctx: ActionContext, steps: list[str]) -> Outcome:
    """With the services stopped: wait until the GPU is idle, reset it, re-apply the policy."""
    try:
        remaining, waited = _wait_idle(gpu, ctx)
    except GpuError as exc:
        steps.append(f"cannot list the processes on GPU {gpu}: {exc}")
        return Outcome.FAILED
    if remaining and ctx.cancel.is_set():
        steps.append(f"agent stopping: reset of GPU {gpu} abandoned while it drained ({waited:.1f} s)")
        return Outcome.INTERRUPTED
    if remaining:
        steps.append(f"processes {_describe_processes(gpu, remaining, ctx)} still on GPU {gpu} after {waited:.1f} s")
        return Outcome.REFUSED
    steps.append(f"GPU {gpu} idle after {waited:.1f} s")

    failed = _reset_in_transaction(gpu, ctx, steps)
    if failed is not None:
        return failed

    try:
        report = ctx.policy.apply()
    except GpuError as exc:
        steps.append(f"policy re-apply failed: {exc}")
        return Outcome.FAILED
    failures = [r for r in report.results if r.outcome is ApplyOutcome.FAILED]
    if failures:
        listed = "; ".join(
            f"{r.plan.item}{'' if r.plan.gpu is None else f' GPU {r.plan.gpu}'}: {r.detail}" for r in failures
        )
        steps.append(f"policy re-applied with {len(failures)} failure(s): {listed}")
        return Outcome.FAILED
    applied = sum(1 for r in report.results if r.outcome is ApplyOutcome.APPLIED)
    steps.append(f"{POLICY_APPLIED} ({applied} item(s) set)")
    ctx.journal(POLICY_APPLIED)
    return Outcome.SUCCESS


def _touches(decision: Decision, config: AgentConfig) -> Footprint:
    """Its GPU and every GPU of the services it stops first."""
    gpu = gpu_of(decision)
    return None if gpu is None else gpus_of(services_for_gpu(config, gpu), (gpu,))


ACTION: Final = ActionType(
    ResetGpuParams,
    reset_gpu,
    does=(
        "Stops the services on the GPU, waits until NVML shows no process on it, `nvidia-smi --gpu-reset`, puts "
        "its power limit and clock lock back, re-applies the policy, starts the services and checks them; "
        "refused for Xid 79, a lost GPU, MIG, a re-enumerated index, or processes that remain."
    ),
    changes_node=True,
    lane=Lane.GPUS,
    touches=_touches,
    targets=Targets.GPU,
    once=Once.PER_GPU,
    clears_xids=ClearsXids.GPU,
)
