"""restart_service: the services restarted through their managers, then healthy or FAILED.

The step's service, else the decision's, else every service using the decision's GPU
(agent/rules/actions/service_actions.py `named_services`); each is drained first when it declares
`drain`, restarted by its manager (systemd, or the `command` adapter), and must answer its health
probe within `ready_timeout_seconds` (the service's own by default).
"""

from __future__ import annotations

from typing import ClassVar, Final

from pydantic import Field

from agent.config import AgentConfig
from agent.events import SuggestedAction
from agent.rules.actions.base import ActionError, Result, failed, refused
from agent.rules.actions.context import ActionContext
from agent.rules.actions.kind import ActionType, ClearsXids, Footprint, Lane, Targets, gpus_of
from agent.rules.actions.service_actions import (
    drain_service,
    drain_timeout,
    managed,
    managers_for,
    named_services,
    ready_timeout,
    verify_healthy,
)
from agent.rules.actions.steps import RESTARTED, RESTARTING, step
from agent.rules.model import Decision, Outcome
from agent.rules.params import ServiceParams


class RestartServiceParams(ServiceParams):
    # Spelled as the remedy it carries out (SuggestedAction), as a rule's `xid: {catalog_action: ...}` names it.
    kind: ClassVar[str] = SuggestedAction.RESTART_SERVICE.value

    ready_timeout_seconds: float | None = Field(default=None, gt=0, le=7200)  # None: the service's own


def restart_service(decision: Decision, params: RestartServiceParams, ctx: ActionContext) -> Result:
    """Restart the services through their managers, then healthy within the ready timeout or FAILED."""
    services = named_services(decision, params, ctx.config)
    if not services:
        return failed("no service to restart: the decision names none and no service uses its GPU")
    managers = managers_for(services, ctx)
    if isinstance(managers, str):
        return refused(managers)
    steps: list[str] = []
    ok = True
    for service in services:
        if ctx.prober is not None:
            budget = service.command_timeout_seconds + ready_timeout(service, params.ready_timeout_seconds)
            ctx.prober.expect_down(service.name, drain_timeout(service) + budget)
        drain_service(service, decision, ctx, steps)
        ctx.journal(step(RESTARTING, service.name))  # before: a restart cut short may leave it stopped
        if not managed(managers[service.name].restart, "restart", service, ctx, steps):
            ok = False
            continue
        ctx.journal(step(RESTARTED, service.name))
        healthy, what = verify_healthy(service, params.ready_timeout_seconds, ctx)
        ok = ok and healthy
        steps.append(f"restarted {service.name}; {what}")
    return Result(Outcome.SUCCESS if ok else Outcome.FAILED, "; ".join(steps))


def _touches(decision: Decision, config: AgentConfig) -> Footprint:
    """The GPUs of the services it restarts."""
    params = decision.action.options if decision.action is not None else None
    if not isinstance(params, RestartServiceParams):
        return None
    try:
        return gpus_of(named_services(decision, params, config))
    except ActionError:  # an unknown service: the action fails at once, touching nothing
        return frozenset()


ACTION: Final = ActionType(
    RestartServiceParams,
    restart_service,
    does=(
        "Restarts the service through its manager (systemd, or the `command` adapter), drained first when it "
        "declares `drain`; FAILED unless it answers its health probe within `ready_timeout_seconds` "
        "(the service's own by default)."
    ),
    changes_node=True,
    lane=Lane.GPUS,
    touches=_touches,
    targets=Targets.SERVICES,
    clears_xids=ClearsXids.APP_LEVEL,
)
