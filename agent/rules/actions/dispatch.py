"""execute(decision, ctx): run one decision through the handler of its action kind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from agent.config import Mode
from agent.logger import get_logger
from agent.rules.actions import hooks, notify, reboot, reset, service_actions
from agent.rules.actions.base import ActionError, Result, failed, refused
from agent.rules.actions.context import ActionContext
from agent.rules.model import ActionOutcome, Decision, Outcome
from agent.rules.params import (
    NODE_CHANGING_ACTIONS,
    ActionKind,
    ActionParams,
    AlertmanagerParams,
    RebootParams,
    RecommendRebootParams,
    ResetGpuParams,
    RestartServiceParams,
    RunHookParams,
    WebhookParams,
)

log = get_logger()

P = TypeVar("P", bound=ActionParams)


@dataclass(frozen=True)
class Handler(Generic[P]):
    """An action kind's handler, typed on the kind's parameter model."""

    params_type: type[P]
    run: Callable[[Decision, P, ActionContext], Result]

    def __call__(self, decision: Decision, params: ActionParams, ctx: ActionContext) -> Result:
        if not isinstance(params, self.params_type):
            raise TypeError(f"{self.params_type.kind.value} got {type(params).__name__}")
        return self.run(decision, params, ctx)


HANDLERS: dict[ActionKind, Handler[Any]] = {
    handler.params_type.kind: handler
    for handler in (
        Handler(RestartServiceParams, service_actions.restart_service),
        Handler(ResetGpuParams, reset.reset_gpu),
        Handler(RunHookParams, hooks.run_hook),
        Handler(WebhookParams, notify.webhook),
        Handler(AlertmanagerParams, notify.alertmanager),
        Handler(RecommendRebootParams, reboot.recommend_reboot),
        Handler(RebootParams, reboot.reboot),
    )
}
if set(HANDLERS) != set(ActionKind):
    raise ImportError(f"action kinds without a handler: {sorted(set(ActionKind) - set(HANDLERS))}")


def execute(decision: Decision, ctx: ActionContext) -> ActionOutcome:
    """Carry out one decision. Never raises: an unexpected error is a FAILED outcome."""
    started = ctx.clock()
    result = _dispatch(decision, ctx)
    finished = ctx.clock()
    # The daemon logs the outcome at info with the target's fields; this is the trace of execute itself.
    log.debug(
        "action carried out",
        action=decision.action.kind.value if decision.action else "none",
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
        return Result(Outcome.DRY_RUN, f"dry run: would {action.kind.value} ({decision.target.key})")
    if action.kind in NODE_CHANGING_ACTIONS and ctx.config.mode is Mode.OBSERVE:
        return refused(f"observe mode: {action.kind.value} changes the node (set mode: enforce to allow it)")
    try:
        return HANDLERS[action.kind](decision, action.options, ctx)
    except ActionError as exc:
        return failed(str(exc))
    except Exception as exc:  # the backstop: one broken action must not take the daemon down
        log.exception("action failed unexpectedly", action=action.kind.value, rule=decision.rule)
        return failed(f"internal error: {type(exc).__name__}: {exc}")
