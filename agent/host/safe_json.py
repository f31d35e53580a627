"""Parsing JSON the agent did not write in this process: a server's answer, a client's request, a
file in the state dir, a row of the store. `loads` refuses a document nested deeper than
`MAX_DEPTH` before the parser sees it (the json module recurses once per level: 60 000 `[` is a
RecursionError, which no caller expects) and raises one error type, `JsonError`, for everything
that is not a JSON document. The size is bounded by whoever read the bytes.
"""

from __future__ import annotations

import json
import re

from agent import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

#: Deeper than any document the agent reads or writes (they nest a handful of levels).
MAX_DEPTH = 64
_SPECIAL = re.compile(r'[\[\]{}"\\]')


class JsonError(ValueError):
    """Not a JSON document, or one nested deeper than `MAX_DEPTH`."""


def too_deep(text: str, max_depth: int = MAX_DEPTH) -> bool:
    """Whether JSON `text` nests more than `max_depth` arrays/objects, brackets inside strings not
    counted."""
    if text.count("[") + text.count("{") <= max_depth:
        return False  # cannot be: no scan needed (the common case, and a fast one)
    depth = 0
    in_string = False
    escaped_at = -1  # the position a backslash in a string escapes
    for match in _SPECIAL.finditer(text):
        position, char = match.start(), match.group()
        if position == escaped_at:
            continue
        if in_string:
            if char == "\\":
                escaped_at = position + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > max_depth:
                return True
        elif char in "]}":
            depth -= 1
    return False


def loads(data: str | bytes | bytearray, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads`, refusing depth over `max_depth`; JsonError for anything that is not JSON."""
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonError(f"not UTF-8: {exc.reason} at byte {exc.start}") from None
    if too_deep(text, max_depth):
        raise JsonError(f"nested more than {max_depth} levels deep")
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and an integer past Python's digit limit
        raise JsonError(str(exc)[:200]) from None
    except RecursionError:  # not reached within the depth bound; kept so no caller ever sees it
        raise JsonError("nested too deep") from None
