"""What a rule's `alertmanager` step pushes: the catalogue's alert of the decision's fault
(agent/alerts/catalog.py), raised at once in the agent's push book (agent/daemon/alert_book.py) instead
of after the alert's `for`. Like every push it fires while the agent's verdict holds the fault and
resolves when the fault is fixed, acknowledged or gone, with the same name and labels as the
shipped Prometheus rule's alert. A step of `on_exhausted` raises GpuAgentRemediationFailing for its
rule (its attempts ran out), which holds until `gpu-agent ack RULE`.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.alerts.catalog import raised_by
from agent.printable import printable
from agent.rules.actions.base import gpu_of, service_of, uuid_of, xid_of
from agent.rules.actions.context import ActionContext
from agent.rules.model import Decision

REMEDIATION_FAILING = "GpuAgentRemediationFailing"
#: The step of a rule's `on_exhausted` (agent.rules.engine.EXHAUSTED_STEP).
_EXHAUSTED_STEP = -1


def alerts_of(decision: Decision) -> tuple[list[str], dict[str, str]]:
    """The alerts a step raises for `decision`, and the labels they must have: the fault's GPU,
    service, Xid or policy item, as the decision and its event name them."""
    if decision.step == _EXHAUSTED_STEP:
        return [REMEDIATION_FAILING], {"rule": decision.rule}
    event = decision.event
    known = {
        "gpu": gpu_of(decision),
        "uuid": uuid_of(decision),
        "service": service_of(decision),
        "xid": xid_of(event),
        "item": event.data.get("item"),
    }
    match = {name: str(value) for name, value in known.items() if value is not None and value != ""}
    return raised_by(event.kind), match


def alertmanager_urls(url: str | None, ctx: ActionContext) -> tuple[str, ...]:
    """Where the step's alert goes: `remediation.alertmanager_url`, and the step's own `url`."""
    return tuple(dict.fromkeys((*ctx.config.remediation.alertmanager_urls, *((url,) if url else ()))))


def raise_alerts(
    decision: Decision,
    names: list[str],
    match: Mapping[str, str],
    url: str | None,
    overrides: Mapping[str, str],
    ctx: ActionContext,
) -> str:
    """Raise them in the push book (to the step's `url` too, with `overrides` over their annotations
    and the decision's event in `event`: what the agent saw, with its cause); what was raised, for the
    outcome's detail."""
    ctx.alerts.raise_alerts(names, match, url, {"event": printable(decision.event.message), **overrides})
    where = ", ".join(f"{name}={value}" for name, value in sorted(match.items()))
    return f"alert {' or '.join(names)}{f' ({where})' if where else ''} raised: pushed while the verdict holds it"
