"""webhook and alertmanager: tell people and systems about a fault (both run in observe mode too).

webhook POSTs the decision and its event as JSON to `url` with `headers`; alertmanager posts one
alert to `<url>/api/v2/alerts` and the context's AlertTracker keeps it alive until it clears.
Either request ends within its total deadline (agent/rules/actions/http_client.py).
"""

from __future__ import annotations

from agent.rules.actions.alertmanager import alert_for
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
