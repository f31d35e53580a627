"""What every action kind's parameters share: the base model and the checks several kinds use.

Each kind declares its own parameter model in its module (agent/rules/actions/kinds/), as a
subclass of `ActionParams` naming the kind (`kind`). The rules file is validated against these
models once, at load time; the validated model is what the engine puts in a Decision and what the
kind's handler receives, so nothing downstream checks a parameter again.
"""

from __future__ import annotations

import re
from typing import ClassVar

from pydantic import Field

from agent.config.fields import StrictModel

LABEL_NAME_PATTERN = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
DEFAULT_HTTP_DEADLINE_SECONDS = 10.0


def http_url(value: str | None) -> str | None:
    """A URL the agent posts to: http or https, nothing else (a field validator of several kinds)."""
    if value is not None and not value.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")
    return value


def label_names(labels: dict[str, str]) -> dict[str, str]:
    """Keys that are Prometheus label names (a field validator of the kinds that raise alerts)."""
    bad = [name for name in labels if not re.fullmatch(LABEL_NAME_PATTERN, name)]
    if bad:
        raise ValueError(f"not a Prometheus label name: {', '.join(bad)} (letters, digits, underscores)")
    return labels


class ActionParams(StrictModel):
    """Base of the per-kind parameter models: `kind` is the kind's name, as rules files spell it."""

    kind: ClassVar[str]


class ServiceParams(ActionParams):
    """The parameters of a kind aimed at services (`Targets.SERVICES`): a step may name its service."""

    service: str | None = Field(default=None, min_length=1)  # None: the services using the GPU
