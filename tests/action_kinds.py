"""The action kinds, as tests name them: `ActionKind.RESET_GPU` is "reset_gpu", one member per kind
the registry found (agent/rules/actions/registry.py), and `action_spec` a step of one."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

from agent.rules.actions.registry import KINDS
from agent.rules.config import ActionStep
from agent.rules.model import ActionSpec


class _KindName(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


#: The names of the declared action kinds, for a test to name one: `ActionKind.RESET_GPU == "reset_gpu"`.
ActionKind = _KindName("ActionKind", {name.upper(): name for name in KINDS})


def action_spec(kind: str, params: Mapping[str, Any] | None = None) -> ActionSpec:
    """A step of `kind` with `params` (its defaults when None), validated as a rules file's step is."""
    return ActionStep.model_validate({str(kind): dict(params or {})}).spec()
