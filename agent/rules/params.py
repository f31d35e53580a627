"""The parameters of each action kind, as pydantic models.

The rules file is validated against these models once, at load time; the validated model is what
the engine puts in a Decision and what the action handler receives, so nothing downstream checks
a parameter again. Each model names the action kind it belongs to (`kind`).
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from agent.config import StrictModel
from agent.events import SuggestedAction

LABEL_NAME_PATTERN = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
DEFAULT_HTTP_DEADLINE_SECONDS = 10.0
DEFAULT_HOOK_TIMEOUT_SECONDS = 60.0


class ActionKind(str, Enum):
    """What a rule can do. The three that carry out a remedy are spelled as that remedy in the one
    vocabulary of remedies (SuggestedAction): `xid: {catalog_action: reset_gpu}` then `reset_gpu`."""

    RESTART_SERVICE = SuggestedAction.RESTART_SERVICE.value
    RESET_GPU = SuggestedAction.RESET_GPU.value
    RUN_HOOK = "run_hook"
    WEBHOOK = "webhook"
    ALERTMANAGER = "alertmanager"
    RECOMMEND_REBOOT = "recommend_reboot"
    REBOOT = SuggestedAction.REBOOT.value


#: Actions that change the node; observe mode refuses them.
NODE_CHANGING_ACTIONS = frozenset({ActionKind.RESTART_SERVICE, ActionKind.RESET_GPU, ActionKind.REBOOT})


class Lane(str, Enum):
    """Where the action worker runs an action kind (agent.daemon.lanes), by what it touches."""

    NOTIFY = "notify"  # tells someone and changes nothing: never waits for a job on the node
    GPUS = "gpus"  # changes its GPU and the services on it: waits only for a job on those GPUs
    NODE = "node"  # may change anything on the node: waits for every job, and ends a sweep


#: Each action kind's lane.
ACTION_LANES: dict[ActionKind, Lane] = {
    ActionKind.RESTART_SERVICE: Lane.GPUS,
    ActionKind.RESET_GPU: Lane.GPUS,
    ActionKind.RUN_HOOK: Lane.NODE,  # a hook may do anything
    ActionKind.WEBHOOK: Lane.NOTIFY,
    ActionKind.ALERTMANAGER: Lane.NOTIFY,
    ActionKind.RECOMMEND_REBOOT: Lane.NOTIFY,  # a flag file and an alert: nothing on the node changes
    ActionKind.REBOOT: Lane.NODE,
}
if set(ACTION_LANES) != set(ActionKind):
    raise ImportError(f"action kinds without a lane: {sorted(set(ActionKind) - set(ACTION_LANES))}")


def _http_url(value: str | None) -> str | None:
    if value is not None and not value.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")
    return value


class ActionParams(StrictModel):
    """Base of the per-kind parameter models."""

    kind: ClassVar[ActionKind]


class RestartServiceParams(ActionParams):
    kind: ClassVar[ActionKind] = ActionKind.RESTART_SERVICE

    service: str | None = Field(default=None, min_length=1)  # None: the services using the GPU
    ready_timeout_seconds: float | None = Field(default=None, gt=0, le=7200)  # None: the service's own


class ResetGpuParams(ActionParams):
    kind: ClassVar[ActionKind] = ActionKind.RESET_GPU


class RunHookParams(ActionParams):
    kind: ClassVar[ActionKind] = ActionKind.RUN_HOOK

    argv: list[str] = Field(min_length=1)
    timeout_seconds: float = Field(default=DEFAULT_HOOK_TIMEOUT_SECONDS, gt=0, le=3600)

    @field_validator("argv")
    @classmethod
    def _absolute_program(cls, argv: list[str]) -> list[str]:
        # No PATH lookup and no shell: what runs as root must not depend on the environment.
        if not argv[0].startswith("/"):
            raise ValueError(f"the program must be an absolute path, not {argv[0]!r}")
        return argv


class WebhookParams(ActionParams):
    kind: ClassVar[ActionKind] = ActionKind.WEBHOOK

    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    #: The whole request (connect, send, answer) must finish within this, however the server paces it.
    timeout_seconds: float = Field(default=DEFAULT_HTTP_DEADLINE_SECONDS, gt=0, le=300)

    _check_url = field_validator("url")(_http_url)


#: What an alert's identity is made of, which the catalogue decides (docs/alerts.md), not a rule step.
_CATALOGUE_FIELDS = ("severity", "alertname", "labels")


class AlertmanagerParams(ActionParams):
    """The step raises the catalogue's alert of its fault at once (agent/rules/actions/alertmanager.py)."""

    kind: ClassVar[ActionKind] = ActionKind.ALERTMANAGER

    url: str | None = None  # an Alertmanager besides remediation.alertmanager_url's
    summary: str | None = None  # None: the catalogue's text
    description: str | None = None
    annotations: dict[str, str] = Field(default_factory=dict)

    _check_url = field_validator("url")(_http_url)

    @model_validator(mode="before")
    @classmethod
    def _no_identity(cls, data: Any) -> Any:
        given = [name for name in _CATALOGUE_FIELDS if isinstance(data, dict) and name in data]
        if given:
            raise ValueError(
                f"{', '.join(given)}: an alert's name, severity and labels are the catalogue's, the same as the"
                " Prometheus rules' (docs/alerts.md); remove them"
            )
        return data

    @field_validator("annotations")
    @classmethod
    def _label_names(cls, labels: dict[str, str]) -> dict[str, str]:
        bad = [name for name in labels if not re.fullmatch(LABEL_NAME_PATTERN, name)]
        if bad:
            raise ValueError(f"not a Prometheus label name: {', '.join(bad)} (letters, digits, underscores)")
        return labels


class RecommendRebootParams(ActionParams):
    kind: ClassVar[ActionKind] = ActionKind.RECOMMEND_REBOOT

    reason: str | None = None  # None: the event's message
    url: str | None = None  # an Alertmanager for GpuRebootRecommended besides remediation.alertmanager_url's

    _check_url = field_validator("url")(_http_url)


class RebootParams(ActionParams):
    kind: ClassVar[ActionKind] = ActionKind.REBOOT


PARAMS_BY_KIND: dict[ActionKind, type[ActionParams]] = {
    model.kind: model
    for model in (
        RestartServiceParams,
        ResetGpuParams,
        RunHookParams,
        WebhookParams,
        AlertmanagerParams,
        RecommendRebootParams,
        RebootParams,
    )
}
# ActionKind is the one list of kinds: a kind without a parameter model fails here, at import.
if set(PARAMS_BY_KIND) != set(ActionKind):
    raise ImportError(f"action kinds without a parameter model: {sorted(set(ActionKind) - set(PARAMS_BY_KIND))}")
