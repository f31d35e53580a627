"""POST JSON to webhooks and Alertmanager, with a total deadline per request.

The request goes through `agent.host.http_read.exchange`: connect, sending the request and the
answer's status and headers share one deadline (a server that drips one byte every few seconds is
cut off); the answer's body is not read. Redirects are not followed (they would carry our headers, tokens included,
elsewhere); the URL's path and query (tokens live there too) and header values never appear in
errors. Proxies from the environment (`https_proxy`, ...) are used as urllib uses them.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping
from typing import Any

from agent.host.http_read import HttpReadError, HttpTimedOut, exchange
from agent.rules.actions.base import ActionError

#: The status is the answer: the body is not read, so a receiver that answers 200 and then keeps
#: the connection open does not fail the delivery.
_ANSWER_BYTES = 0


class RequestTimedOut(ActionError):
    """No complete answer within the request's total deadline."""


def redacted_url(url: str) -> str:
    """scheme://host[:port]/… : enough to tell where it went, without the path's tokens."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # not a URL (an unclosed `[`): nothing of it but its scheme is shown
        return f"{url.partition(':')[0][:16]}://…"
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}" + ("/…" if parts.path.strip("/") else "")


def post_json(url: str, payload: Any, deadline_seconds: float, headers: Mapping[str, str] | None = None) -> int:
    """POST payload as JSON and return the 2xx status within `deadline_seconds` in all; raises
    RequestTimedOut past the deadline, ActionError for any other failure (no secrets in either)."""
    where = redacted_url(url)
    body = json.dumps(payload, default=str).encode()
    sent = {"Content-Type": "application/json", "User-Agent": "gpu-agent", **(headers or {})}
    try:
        answer = exchange(url, deadline_seconds, _ANSWER_BYTES, data=body, headers=sent, proxies=True, truncate=True)
    except HttpTimedOut:
        raise RequestTimedOut(f"POST {where}: timed out: no complete answer within {deadline_seconds:g} s") from None
    except HttpReadError as exc:
        raise ActionError(f"POST {where}: {exc.detail}") from None
    if not 200 <= answer.status < 300:
        raise ActionError(f"POST {where}: HTTP {answer.status}")
    return answer.status
