"""An alert's text for the agent's own pushes: the catalogue's Prometheus templates filled in the
way Prometheus fills them, for the one form they use (`{{ $labels.NAME }}`), so a pushed alert reads
as the rule's does. `check` refuses any other template action: the catalogue stays in that form."""

from __future__ import annotations

import re
from collections.abc import Mapping

_ACTION = re.compile(r"\{\{(.*?)\}\}")
_LABEL = re.compile(r"\s*\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)\s*")


def check(template: str) -> None:
    """ValueError for a template action other than `{{ $labels.NAME }}`, or an unclosed one."""
    for action in _ACTION.findall(template):
        if not _LABEL.fullmatch(action):
            raise ValueError(f"template action {{{{{action}}}}} is not {{{{ $labels.NAME }}}}")
    if "{{" in _ACTION.sub("", template) or "}}" in _ACTION.sub("", template):
        raise ValueError(f"unclosed template action in {template!r}")


def render(template: str, labels: Mapping[str, str]) -> str:
    """`template` with each `{{ $labels.NAME }}` replaced by that label's value ("" when absent)."""

    def value(found: re.Match[str]) -> str:
        name = _LABEL.fullmatch(found.group(1))
        return labels.get(name.group(1), "") if name is not None else found.group(0)

    return _ACTION.sub(value, template)
