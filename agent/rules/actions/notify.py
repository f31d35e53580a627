"""webhook and alertmanager: tell people and systems about a fault (both run in observe mode too).

webhook POSTs the decision and its event as JSON to `url` with `headers` (the request ends within its
total deadline, agent/rules/actions/http_client.py); alertmanager raises the catalogue's alert of the
fault in the agent's push book at once (agent/rules/actions/alertmanager.py), which delivers it.
"""

from __future__ import annotations

from agent.rules.actions.alertmanager import alertmanager_urls, alerts_of, raise_alerts
from agent.rules.actions.base import ActionError, Result, event_payload, failed, not_configured, success
from agent.rules.actions.context import ActionContext
from agent.rules.actions.http_client import post_json, redacted_url
from agent.rules.model import Decision
from agent.rules.params import AlertmanagerParams, WebhookParams


def webhook(decision: Decision, params: WebhookParams, ctx: ActionContext) -> Result:
    try:
        status = post_json(params.url, event_payload(decision, ctx.hostname), params.timeout_seconds, params.headers)
    except ActionError as exc:
        return failed(str(exc))
    return success(f"POST {redacted_url(params.url)}: HTTP {status}")


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
