"""Text from outside made safe to show: control and invisible format characters as visible escapes.
Standard library only: the thin `status` client imports it."""

from __future__ import annotations

from agent import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any


# C0 and C1 controls, DEL, and the format characters that reorder or hide text on a terminal
# (bidi overrides and isolates, zero-width joiners, BOM): what a process name or kernel text must
# never carry to a human reader raw.
_UNPRINTABLE = frozenset(
    [
        *range(0x00, 0x20),
        *range(0x7F, 0xA0),
        0xAD,
        *range(0x200B, 0x2010),
        *range(0x202A, 0x202F),
        *range(0x2060, 0x2070),
        0xFEFF,
    ]
)


def printable(text: str, keep_newlines: bool = False) -> str:
    """`text` with every control and invisible format character as a visible escape (`\\x1b`,
    `\\u202e`): a terminal escape in a process name or kernel line is shown, never acted on. The one
    helper for text that enters from outside (kernel log, /proc) and for what is rendered for humans
    (status, events, plan, logs, metric labels). `keep_newlines`: a rendered multi-line text keeps its
    own line breaks."""
    if text.isascii() and text.isprintable():  # in C: the common case never walks the text in Python
        return text
    if not any(ord(c) in _UNPRINTABLE for c in text):
        return text
    out = []
    for c in text:
        code = ord(c)
        if code not in _UNPRINTABLE or (keep_newlines and c == "\n"):
            out.append(c)
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        else:
            out.append(f"\\u{code:04x}")
    return "".join(out)


def printable_document(value: Any) -> Any:
    """`printable` applied to every string of a JSON document (dict keys included)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(k)): printable_document(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable_document(v) for v in value]
    return value
