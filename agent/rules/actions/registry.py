"""The action kinds: every module of agent/rules/actions/kinds/, each declaring one as `ACTION`.

This is the one list of action kinds, and it is found, not written: a new module there is a new
kind everywhere that asks `KINDS`: the steps a rules file may write (agent/rules/config.py), the
engine's aim and once-per-evaluation (agent/rules/engine.py), dispatch and observe mode
(dispatch.py), the action worker's lanes and footprints (footprint.py), check-config's checks, and
README's table of actions, which `python -m agent.rules.actions.registry` writes
(`tests/rules/test_action_registry.py` fails while README's differs).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from pydantic.fields import FieldInfo

from agent.rules.actions import kinds
from agent.rules.actions.kind import ActionType, Lane, Once, Targets


def _declared() -> dict[str, ActionType[Any]]:
    """Each module of the kinds package and the kind it declares, by name; ImportError for a module
    that declares none, or one not named for its kind."""
    found: dict[str, ActionType[Any]] = {}
    for module_info in sorted(pkgutil.iter_modules(kinds.__path__), key=lambda info: info.name):
        module = importlib.import_module(f"{kinds.__name__}.{module_info.name}")
        action = getattr(module, "ACTION", None)
        if not isinstance(action, ActionType):
            raise ImportError(f"{module.__name__} declares no action kind (ACTION: Final = ActionType(...))")
        if action.name != module_info.name:
            raise ImportError(f"{module.__name__} declares {action.name!r}: a kind's module is named for its kind")
        found[action.name] = action
    return found


#: Every action kind by name, in name order.
KINDS: Final[Mapping[str, ActionType[Any]]] = MappingProxyType(_declared())


# -- README's table of actions ---------------------------------------------------------------------

_AIMED_AT = {
    Targets.FAULT: "the fault's GPU, service or node",
    Targets.GPU: "the fault's GPU",
    Targets.SERVICES: "each service on the fault's GPU, or the step's `service`",
}
_WAITS_FOR = {
    Lane.NOTIFY: "nothing (notify lane)",
    Lane.GPUS: "jobs on the GPUs it touches",
    Lane.NODE: "every job on the node",
}
_AT_MOST_ONE_PER = {Once.PER_TARGET: "— (its rule's cooldown)", Once.PER_GPU: "GPU", Once.PER_NODE: "node"}
_IN_OBSERVE_MODE = {True: "not run: recorded as `dry_run`", False: "runs"}

_HEADER = (
    "| action | parameters | does | aimed at | waits for | at most one in an evaluation per | in observe mode |\n"
    "|---|---|---|---|---|---|---|\n"
)


def _parameter(name: str, field: FieldInfo) -> str:
    """`name` (required), `name=10` (a default worth showing) or `name?` (optional, nothing by default)."""
    if field.is_required():
        return name
    default = field.get_default(call_default_factory=True)
    return f"{name}={default:g}" if isinstance(default, int | float) and not isinstance(default, bool) else f"{name}?"


def _parameters(action: ActionType[Any]) -> str:
    """`{name, other=10, optional?}`: the parameters a step takes (not those kept only so that older rules
    load, which do nothing); `{}` for none."""
    return (
        "`{"
        + ", ".join(
            _parameter(name, field) for name, field in action.params.model_fields.items() if not field.deprecated
        )
        + "}`"
    )


def _row(action: ActionType[Any]) -> str:
    does = action.does + (" Only with `remediation.allow_reboot: true`." if action.needs_allow_reboot else "")
    cells = (
        f"`{action.name}`",
        _parameters(action),
        does,
        _AIMED_AT[action.targets],
        _WAITS_FOR[action.lane],
        _AT_MOST_ONE_PER[action.once],
        _IN_OBSERVE_MODE[action.changes_node],
    )
    return "| " + " | ".join(cells) + " |\n"


def markdown_table() -> str:
    """README's table of actions, one row per kind."""
    return _HEADER + "".join(_row(action) for action in KINDS.values())


if __name__ == "__main__":
    print(markdown_table(), end="")
