"""alertmanager: the catalogue's alert of the decision's fault, raised at once in the agent's push book.

The step does not build an alert of its own: it raises the alert the catalogue (agent/alerts/catalog.py,
docs/alerts.md) has for the fault, with the same name, severity and labels as the shipped Prometheus
rule's, without waiting for the rule's `for` (agent/rules/actions/raise_alert.py). The agent pushes it
to `remediation.alertmanager_url`, and to the step's `url`, while its verdict holds the fault, and
resolves it when the fault is fixed, acknowledged or gone. With no Alertmanager anywhere the outcome is
not_configured (nothing tried, nothing counted). It tells people and changes nothing: it runs in
observe mode too.
"""

from __future__ import annotations

from typing import ClassVar, Final

from pydantic import Field, field_validator

from agent.rules.actions.base import Result, not_configured, success
from agent.rules.actions.context import ActionContext
from agent.rules.actions.kind import ActionType, Lane
from agent.rules.actions.raise_alert import alertmanager_urls, alerts_of, raise_alerts
from agent.rules.model import Decision
from agent.rules.params import ActionParams, http_url, label_names

#: Why the parameters of the steps written for 0.1, when a step made its own alert, do nothing now:
#: they load (marked `deprecated`) and the loader warns of each (ActionType.ignored_fields).
_IGNORED_WHY = "ignored: an alert's name, severity and labels are the catalogue's (docs/alerts.md); remove it"


class AlertmanagerParams(ActionParams):
    """The step raises the catalogue's alert of its fault at once."""

    kind: ClassVar[str] = "alertmanager"

    url: str | None = None  # an Alertmanager besides remediation.alertmanager_url's
    summary: str | None = None  # None: the catalogue's text
    description: str | None = None
    annotations: dict[str, str] = Field(default_factory=dict)
    # Ignored: accepted so that the rules an admin kept from 0.1 still load.
    severity: str | None = Field(default=None, deprecated=_IGNORED_WHY)
    alertname: str | None = Field(default=None, deprecated=_IGNORED_WHY)
    labels: dict[str, str] = Field(default_factory=dict, deprecated=_IGNORED_WHY)

    _check_url = field_validator("url")(http_url)
    _annotation_names = field_validator("annotations")(label_names)


def alertmanager(decision: Decision, params: AlertmanagerParams, ctx: ActionContext) -> Result:
    if not alertmanager_urls(params.url, ctx):
        # Not a failure of the alert: there is no Alertmanager to send it to (the alerts that page on
        # failed remediations must not fire for every fault of a node that has none).
        return not_configured("no Alertmanager configured: set remediation.alertmanager_url or the step's url")
    names, match = alerts_of(decision)
    if not names:
        return not_configured(f"no alert in the catalogue for a {decision.event.kind.value} event (docs/alerts.md)")
    overrides = {
        **params.annotations,
        **{k: v for k, v in (("summary", params.summary), ("description", params.description)) if v},
    }
    return success(raise_alerts(decision, names, match, params.url, overrides, ctx))


ACTION: Final = ActionType(
    AlertmanagerParams,
    alertmanager,
    does=(
        "Raises the catalogue's alert of the fault (docs/alerts.md: the same name, severity and labels as the "
        "shipped Prometheus rule's) at once, without waiting for its `for`; the agent pushes it to "
        "`remediation.alertmanager_url` and the step's `url` while its verdict holds the fault. In `on_exhausted` "
        "it raises GpuAgentRemediationFailing for the rule, held until `gpu-agent ack RULE`; `not_configured` "
        "when no Alertmanager is set."
    ),
    changes_node=False,
    lane=Lane.NOTIFY,
)
