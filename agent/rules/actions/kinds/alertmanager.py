"""alertmanager: one alert for the decision, posted to Alertmanager's v2 API and kept alive until it clears.

The alert goes to `url`, else `remediation.alertmanager_url`; with neither the outcome is
not_configured (nothing tried, nothing counted). The context's AlertTracker
(agent/rules/actions/alertmanager.py) re-sends it while it is active and resolves it when the
condition clears. It tells people about a fault and changes nothing: it runs in observe mode too.
"""

from __future__ import annotations

from typing import ClassVar, Final

from pydantic import Field, field_validator

from agent.events import Severity
from agent.rules.actions.alertmanager import Alert
from agent.rules.actions.base import (
    ActionError,
    Result,
    failed,
    gpu_of,
    not_configured,
    service_of,
    success,
    uuid_of,
    xid_of,
)
from agent.rules.actions.context import ActionContext
from agent.rules.actions.http_client import redacted_url
from agent.rules.actions.kind import ActionType, Lane
from agent.rules.model import Decision
from agent.rules.params import LABEL_NAME_PATTERN, ActionParams, http_url, label_names


class AlertmanagerParams(ActionParams):
    kind: ClassVar[str] = "alertmanager"

    url: str | None = None  # None: remediation.alertmanager_url from agent.yaml
    severity: Severity | None = None  # None: the event's severity
    alertname: str | None = Field(default=None, pattern=LABEL_NAME_PATTERN)  # None: GpuAgent<EventKind>
    labels: dict[str, str] = Field(default_factory=dict)
    summary: str | None = None  # None: the event's message
    description: str | None = None  # None: the rule and the decision's reason
    annotations: dict[str, str] = Field(default_factory=dict)

    _check_url = field_validator("url")(http_url)
    _label_names = field_validator("labels", "annotations")(label_names)


def _camel(kind: str) -> str:
    return "".join(part.capitalize() for part in kind.split("_"))


def alert_for(decision: Decision, hostname: str, params: AlertmanagerParams) -> Alert:
    """The alert for a decision. Labels: alertname (`params.alertname`, else `GpuAgent<EventKind>`),
    severity, instance, event, rule, and gpu, uuid, service, xid, reason where known, plus
    `params.labels`. Annotations: summary, description, suggested_action, plus `params.annotations`."""
    event = decision.event
    labels: dict[str, str] = {
        "alertname": params.alertname or f"GpuAgent{_camel(event.kind.value)}",
        "severity": (params.severity or event.severity).value,
        "instance": hostname,
        "event": event.kind.value,
        "rule": decision.rule,
    }
    optional = {
        "gpu": gpu_of(decision),
        "uuid": uuid_of(decision),
        "service": service_of(decision),
        "xid": xid_of(event),
        "reason": event.data.get("reason"),
    }
    labels.update({name: str(value) for name, value in optional.items() if value is not None and value != ""})
    labels.update(params.labels)
    annotations = {
        "summary": params.summary or event.message,
        "description": params.description or f"{decision.rule}: {decision.reason}",
        "suggested_action": event.suggested_action.value,
    }
    annotations.update(params.annotations)
    return Alert(labels, annotations, event.timestamp_seconds)


def alertmanager_url(url: str | None, ctx: ActionContext) -> str | None:
    """The step's Alertmanager, else `remediation.alertmanager_url`, else None."""
    return url or ctx.config.remediation.alertmanager_url or None


def alertmanager(decision: Decision, params: AlertmanagerParams, ctx: ActionContext) -> Result:
    url = alertmanager_url(params.url, ctx)
    if url is None:
        # Not a failure of the alert: there is no Alertmanager to send it to (the alerts that page on
        # failed remediations must not fire for every fault of a node that has none).
        return not_configured("no Alertmanager configured: set remediation.alertmanager_url or the step's url")
    alert = alert_for(decision, ctx.hostname, params)
    try:
        ctx.alerts.fire(url, alert)
    except ActionError as exc:
        return failed(str(exc))
    return success(f"alert {alert.labels['alertname']} sent to {redacted_url(url)}")


ACTION: Final = ActionType(
    AlertmanagerParams,
    alertmanager,
    does=(
        "Posts an alert (`alertname`, else `GpuAgent<EventKind>`; the event's severity, labels and message) to "
        "Alertmanager's v2 API at `url`, else `remediation.alertmanager_url`, re-sent while active and resolved "
        "when the condition clears; `not_configured` when no Alertmanager is set."
    ),
    changes_node=False,
    lane=Lane.NOTIFY,
)
