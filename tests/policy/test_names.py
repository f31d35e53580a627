"""The policy items' names are spelled twice in agent/policy/names.py: as Literal types for mypy
(under TYPE_CHECKING) and as plain tuples for run time, so that `gpu-agent status` needs no
`typing`. Each type and its tuple must hold the same names, in the same order."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from agent.policy import names

NAMES_PY = Path(names.__file__)


def _literal_types() -> dict[str, tuple[str, ...]]:
    """Each Literal alias of the TYPE_CHECKING block, with the aliases it names expanded."""
    tree = ast.parse(NAMES_PY.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    types: dict[str, tuple[str, ...]] = {}
    for node in block.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript):
            parts = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
            members: list[str] = []
            for part in parts:
                if isinstance(part, ast.Constant):
                    members.append(part.value)
                else:
                    assert isinstance(part, ast.Name)
                    members.extend(types[part.id])
            types[node.targets[0].id] = tuple(members)  # type: ignore[attr-defined]
    return types


@pytest.mark.parametrize(
    "alias", ["SettableGpuItemName", "ReportOnlyItemName", "GpuItemName", "NodeItemName", "ItemName", "GpuResetName"]
)
def test_each_literal_type_and_its_run_time_tuple_hold_the_same_names(alias: str) -> None:
    spelled = _literal_types()[alias]
    assert get_args(getattr(names, alias)) == spelled


def test_the_names_load_without_typing() -> None:
    probe = "import sys; import agent.policy.names as n; n.DRIVER; n.ITEM_NAMES; print('typing' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=NAMES_PY.parents[2]
    )
    assert done.stdout.strip() == "False", done.stderr
