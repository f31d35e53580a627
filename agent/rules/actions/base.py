"""What every action handler shares: its result, its error, and what it reads off a Decision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.events import Event, event_json
from agent.rules.model import Decision, Outcome


class ActionError(Exception):
    """An action could not be carried out (FAILED)."""


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    detail: str


def refused(detail: str) -> Result:
    return Result(Outcome.REFUSED, detail)


def failed(detail: str) -> Result:
    return Result(Outcome.FAILED, detail)


def not_configured(detail: str) -> Result:
    return Result(Outcome.NOT_CONFIGURED, detail)


def success(detail: str) -> Result:
    return Result(Outcome.SUCCESS, detail)


def gpu_of(decision: Decision) -> int | None:
    return decision.target.gpu if decision.target.gpu is not None else decision.event.gpu


def uuid_of(decision: Decision) -> str | None:
    return decision.target.uuid or decision.event.uuid


def service_of(decision: Decision) -> str | None:
    service = decision.target.service or decision.event.data.get("service")
    return None if service is None or service == "" else str(service)


def xid_of(event: Event) -> int | None:
    xid = event.data.get("xid")
    return xid if isinstance(xid, int) and not isinstance(xid, bool) else None


def event_payload(decision: Decision, hostname: str) -> dict[str, Any]:
    """What hooks (stdin) and webhooks (body) receive: the decision and its event, as JSON."""
    return {
        "host": hostname,
        "rule": decision.rule,
        "action": decision.action.kind if decision.action else None,
        "step": decision.step,
        "attempt": decision.attempt,
        "reason": decision.reason,
        "target": {"gpu": decision.target.gpu, "uuid": decision.target.uuid, "service": decision.target.service},
        "event": {**event_json(decision.event), "key": decision.event.key},
    }
