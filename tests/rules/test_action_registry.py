"""The action kinds are found, not listed: every module of agent/rules/actions/kinds/ declares one,
named for it (agent/rules/actions/registry.py), and README's table of actions is written from them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from agent.rules.actions.base import Result, success
from agent.rules.actions.kind import ActionType, Lane, Targets
from agent.rules.actions.registry import KINDS, markdown_table
from agent.rules.config import ActionStep
from agent.rules.params import ActionParams

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
KINDS_DIR = REPO / "agent" / "rules" / "actions" / "kinds"
BEGIN = "<!-- action kinds: written by `python -m agent.rules.actions.registry`, not by hand -->\n"
END = "<!-- end of action kinds -->\n"


def test_readmes_table_of_actions_is_written_from_the_kinds() -> None:
    text = README.read_text()
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    assert table == markdown_table(), "README.md: paste `python -m agent.rules.actions.registry` between the markers"


def test_the_table_says_what_observe_mode_does_with_each_kind() -> None:
    rows = {line.split(" | ")[0].strip("| `"): line for line in markdown_table().splitlines()[2:]}
    assert set(rows) == set(KINDS)
    for name, kind in KINDS.items():
        expected = "| not run: recorded as `dry_run` |" if kind.changes_node else "| runs |"
        assert rows[name].endswith(expected), rows[name]


def test_every_module_of_the_kinds_package_is_a_kind_named_for_it() -> None:
    modules = sorted(path.stem for path in KINDS_DIR.glob("*.py") if path.stem != "__init__")
    assert list(KINDS) == modules
    assert [kind.name for kind in KINDS.values()] == modules
    assert list(ActionStep.model_fields) == modules  # a rules file's step takes each of them


@pytest.mark.parametrize(
    ("module", "text", "message"),
    [
        ("notes", '"""Not a kind."""\n', "agent.rules.actions.kinds.notes declares no action kind"),
        (
            "send_webhook",
            "from agent.rules.actions.kinds.webhook import ACTION as ACTION\n",
            "agent.rules.actions.kinds.send_webhook declares 'webhook': a kind's module is named for its kind",
        ),
    ],
)
def test_a_module_that_is_not_one_kind_named_for_it_stops_the_import(
    tmp_path: Path, module: str, text: str, message: str
) -> None:
    shutil.copytree(REPO / "agent", tmp_path / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "agent" / "rules" / "actions" / "kinds" / f"{module}.py").write_text(text)
    imported = subprocess.run(
        [sys.executable, "-c", "import agent.rules.actions.registry"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert imported.returncode == 1
    assert f"ImportError: {message}" in imported.stderr


class _Params(ActionParams):
    kind: ClassVar[str] = "noop"


def _noop(*_args: Any) -> Result:
    return success("nothing")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lane": Lane.GPUS}, "noop: a kind on the gpus lane says which GPUs it touches"),
        ({"lane": Lane.NODE, "touches": lambda _d, _c: None}, "noop: a kind on the gpus lane says which GPUs"),
        ({"lane": Lane.NOTIFY, "targets": Targets.SERVICES}, "noop: a kind aimed at services takes ServiceParams"),
    ],
)
def test_a_description_that_does_not_hold_together_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        ActionType(_Params, _noop, does="nothing", changes_node=False, **fields)


def test_parameters_that_name_no_kind_are_refused() -> None:
    class Nameless(ActionParams):
        pass

    with pytest.raises(TypeError, match="Nameless names no kind"):
        ActionType(Nameless, _noop, does="nothing", changes_node=False, lane=Lane.NOTIFY)
