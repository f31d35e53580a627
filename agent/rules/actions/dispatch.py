"""execute(decision, ctx): run one decision through its kind's handler; observe mode decided in one place."""

from __future__ import annotations

from agent.config import Mode
from agent.logs import get_logger
from agent.rules.actions.base import ActionError, Result, failed
from agent.rules.actions.context import ActionContext
from agent.rules.actions.kind import Lane
from agent.rules.actions.registry import KINDS
from agent.rules.model import ActionOutcome, Decision, Outcome

log = get_logger()


def observe_mode(decision: Decision, mode: Mode) -> Result | None:
    """What observe mode makes of a decision: an action whose kind changes the node (`changes_node`)
    is not run but recorded as a dry run, what the agent would have done ("observe mode: would run
    restart_service on service sglang (rule service-unhealthy)"); None: it runs (every other kind, or
    enforce mode). The remediator asks before it queues a decision, `execute` again before it runs
    one (a reload may have switched to observe mode in between): one outcome and one wording."""
    action = decision.action
    if action is None or mode is not Mode.OBSERVE:
        return None
    kind = KINDS[action.kind]
    if not kind.changes_node:
        return None
    target = decision.target
    if kind.lane is Lane.NODE or (target.service is None and target.gpu is None):
        what = "the node"
    else:
        what = f"service {target.service}" if target.service is not None else f"GPU {target.gpu}"
    return Result(Outcome.DRY_RUN, f"observe mode: would run {action.kind} on {what} (rule {decision.rule})")


def execute(decision: Decision, ctx: ActionContext) -> ActionOutcome:
    """Carry out one decision. Never raises: an unexpected error is a FAILED outcome."""
    started = ctx.clock()
    result = _dispatch(decision, ctx)
    finished = ctx.clock()
    # The daemon logs the outcome at info with the target's fields; this is the trace of execute itself.
    log.debug(
        "action carried out",
        action=decision.action.kind if decision.action else "none",
        rule=decision.rule,
        target=decision.target.key,
        outcome=result.outcome.value,
        detail=result.detail,
    )
    return ActionOutcome(decision, result.outcome, result.detail, started, finished)


def _dispatch(decision: Decision, ctx: ActionContext) -> Result:
    action = decision.action
    if action is None:
        return Result(Outcome.SUPPRESSED, decision.reason)
    if decision.dry_run:
        return Result(Outcome.DRY_RUN, f"dry run: would {action.kind} ({decision.target.key})")
    observed = observe_mode(decision, ctx.config.mode)
    if observed is not None:
        return observed
    try:
        return KINDS[action.kind].execute(decision, action.options, ctx)
    except ActionError as exc:
        return failed(str(exc))
    except Exception as exc:  # the backstop: one broken action must not take the daemon down
        log.exception("action failed unexpectedly", action=action.kind, rule=decision.rule)
        return failed(f"internal error: {type(exc).__name__}: {exc}")
