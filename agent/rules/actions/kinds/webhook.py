"""webhook: the decision and its event POSTed as JSON to `url` with `headers`, within a total deadline.

The request ends within `timeout_seconds` in all, however the server paces it; redirects are not
followed and errors name no secret (agent/rules/actions/http_client.py). It tells a system about a
fault and changes nothing: it runs in observe mode too.
"""

from __future__ import annotations

from typing import ClassVar, Final

from pydantic import Field, field_validator

from agent.rules.actions.base import ActionError, Result, event_payload, failed, success
from agent.rules.actions.context import ActionContext
from agent.rules.actions.http_client import post_json, redacted_url
from agent.rules.actions.kind import ActionType, Lane
from agent.rules.model import Decision
from agent.rules.params import DEFAULT_HTTP_DEADLINE_SECONDS, ActionParams, http_url


class WebhookParams(ActionParams):
    kind: ClassVar[str] = "webhook"

    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    #: The whole request (connect, send, answer) must finish within this, however the server paces it.
    timeout_seconds: float = Field(default=DEFAULT_HTTP_DEADLINE_SECONDS, gt=0, le=300)

    _check_url = field_validator("url")(http_url)


def webhook(decision: Decision, params: WebhookParams, ctx: ActionContext) -> Result:
    try:
        status = post_json(params.url, event_payload(decision, ctx.hostname), params.timeout_seconds, params.headers)
    except ActionError as exc:
        return failed(str(exc))
    return success(f"POST {redacted_url(params.url)}: HTTP {status}")


ACTION: Final = ActionType(
    WebhookParams,
    webhook,
    does=(
        "POSTs the decision and its event as JSON to `url` with `headers`, within `timeout_seconds` in all; "
        "redirects are not followed."
    ),
    changes_node=False,
    lane=Lane.NOTIFY,
)
