"""What flows between the pure rule engine and the one place that acts.

engine.evaluate(...) -> list[Decision]; a Decision whose `action` is set is handed to
actions.dispatch.execute(...), which returns an ActionOutcome; both are recorded in the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from agent.events import Event
from agent.rules.params import ActionParams


class Outcome(str, Enum):
    """How a Decision went. (How a policy item's apply went is agent.policy.plan.ApplyOutcome.)"""

    SUCCESS = "success"
    FAILED = "failed"
    REFUSED = "refused"  # a safety check said no (Xid 79, MIG on, processes remain, reboot not allowed, ...)
    DRY_RUN = "dry_run"  # not run: what the agent would have done (a dry-run rule; observe mode, see dispatch)
    SUPPRESSED = "suppressed"  # cooldown, attempts exhausted, circuit open
    RUNNING = "running"  # journaled before the action starts; replaced by how it went once it ends
    INTERRUPTED = "interrupted"  # the agent stopped or died mid-action; what was rolled back is in the detail
    NOT_CONFIGURED = "not_configured"  # the action has nowhere to go (no Alertmanager set): nothing was tried


@dataclass(frozen=True)
class Target:
    """What an action is aimed at: a GPU (index + uuid), a service, or the node (both None)."""

    gpu: int | None = None
    uuid: str | None = None
    service: str | None = None

    @property
    def key(self) -> str:
        """Stable identity for attempt counters: survives restarts and GPU re-enumeration (uuid, not index)."""
        if self.service is not None:
            return f"service:{self.service}"
        if self.uuid:
            return f"gpu:{self.uuid}"
        return "node" if self.gpu is None else f"gpu-index:{self.gpu}"


@dataclass(frozen=True, init=False)
class ActionSpec:
    """One step of a rule's escalation ladder: its parameters, validated by its kind's pydantic model
    (the rules file is validated against the same models), and the kind they belong to."""

    kind: str
    options: ActionParams = field(hash=False, compare=False)

    def __init__(self, options: ActionParams) -> None:
        object.__setattr__(self, "kind", options.kind)
        object.__setattr__(self, "options", options)

    @property
    def params(self) -> dict[str, Any]:
        """The parameters as JSON, as the store records them (the store redacts secrets)."""
        return self.options.model_dump(mode="json", exclude_none=True)


@dataclass(frozen=True)
class Decision:
    """The engine's verdict for one (rule, event, target): an action to run, or why none runs."""

    rule: str
    event: Event
    target: Target
    action: ActionSpec | None  # None when suppressed
    step: int  # index in the rule's ladder (0-based)
    attempt: int  # 1-based attempt number within the rule's window for this target
    reason: str  # why this action (or why suppressed), for the log and the store
    dry_run: bool = False


@dataclass(frozen=True)
class ActionOutcome:
    decision: Decision
    outcome: Outcome
    detail: str
    started_seconds: float
    finished_seconds: float
