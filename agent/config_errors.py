"""Config problems as the operator sees them (`FILE:LINE field: message`); no pydantic needed to catch
them. The words of a problem are made here too: a validation error's place and message, a name that
is close to an unknown one."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

#: A place in the YAML data: mapping keys and list indices.
PathKey = tuple[str | int, ...]


@dataclass(frozen=True)
class ConfigProblem:
    file: str
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where} {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class ConfigError(Exception):
    def __init__(self, problems: list[ConfigProblem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


def data_path(data: Any, loc: tuple[str | int, ...]) -> PathKey:
    """A validation error's location minus its union/validator tags, following the actual data."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, Mapping) and isinstance(part, str) and "[" not in part:
            path.append(part)
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int):
            path.append(part)
            node = node[part] if 0 <= part < len(node) else None
    return tuple(path)


def error_message(error: Mapping[str, Any]) -> str:
    """A validation error (pydantic's `errors()` item) in the operator's words."""
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "greater_than":
        return f"must be > {ctx['gt']:g}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']:g}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']:g}"
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown key"
    msg = str(error["msg"])
    msg = msg.removeprefix("Value error, ")
    return re.sub(r"^Input should be", "must be", msg)


def suggestion(path: PathKey, known: list[str]) -> str:
    """` (did you mean 'x'?)` for the last key of `path`, when one of `known` is close."""
    name = path[-1] if path else ""
    close = difflib.get_close_matches(str(name), known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


N = TypeVar("N", bound=Mapping[str, object])


def known_names(given: N, names: Sequence[str], what: str, where: str) -> N:
    """`given` when each of its keys is one of `names`; else ValueError naming the closest."""
    for name in given:
        if name not in names:
            raise ValueError(f"unknown {what} '{name}'{suggestion((name,), list(names))}; the {where}")
    return given
