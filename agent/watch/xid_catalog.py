"""NVIDIA's Xid catalog as data, with gpu-agent's default severity and action per code.

The data lives in ``xid_catalog.json`` next to this module (shipped as package data). NVIDIA's fields
(name, mnemonic, resolution bucket, investigatory bucket, applicability) are kept exactly as NVIDIA's
"Xid catalog" names them; ``severity`` and ``action`` are our defaults, which rules may override.
The file is validated when first loaded: malformed data raises :class:`CatalogError` instead of
silently mis-classifying a fault.

``action`` is a :class:`~agent.events.SuggestedAction`, the one vocabulary of remedies that watchers'
health, rule conditions (``xid: {catalog_action: reset_gpu}``) and the metrics share. A code the
shipped catalog lacks gets :data:`UNKNOWN_SEVERITY` and :data:`UNKNOWN_ACTION` (see :func:`verdict`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from agent.events import SuggestedAction
from agent.host import safe_json

SEVERITIES = ("info", "warning", "critical", "fatal")
ACTIONS = tuple(action.value for action in SuggestedAction)
# What a code the shipped catalog does not know gets: a human look, never an automatic repair.
UNKNOWN_NAME = "Unknown Xid"
UNKNOWN_SEVERITY = "warning"
UNKNOWN_ACTION = SuggestedAction.ALERT
GPU_MODELS = ("A100", "H100", "B100", "GB200")
# Where NVIDIA's catalog row has no resolution bucket yet (the newest codes).
UNKNOWN_RESOLUTION = "UNKNOWN"
# Codes come from the kernel as small positive integers; anything outside is a parse error upstream.
MAX_CODE = 999

_BUCKET_RE = re.compile(r"[A-Z][A-Z0-9_]*")
_ENTRY_KEYS = frozenset(
    {
        "code",
        "name",
        "mnemonic",
        "description",
        "applies_to",
        "resolution",
        "investigatory",
        "xid154_linkage",
        "severity",
        "action",
        "note",
    }
)
_TOP_KEYS = frozenset({"source", "buckets", "recovery_actions", "xids"})


class CatalogError(ValueError):
    """The Xid catalog data does not have the expected shape."""


@dataclass(frozen=True)
class XidInfo:
    """One catalog row.

    ``name`` is NVIDIA's short description (e.g. "GPU has fallen off the bus"), ``resolution`` NVIDIA's
    immediate-action bucket (e.g. ``RESTART_BM``), ``investigatory`` NVIDIA's investigatory bucket (free
    text for some rows, empty where NVIDIA gives none). ``severity`` and ``action`` are gpu-agent defaults.
    """

    code: int
    name: str
    description: str
    resolution: str
    severity: str
    action: SuggestedAction
    mnemonic: str
    investigatory: str
    applies_to: tuple[str, ...]
    xid154_linkage: str
    note: str


@dataclass(frozen=True)
class Catalog:
    """The whole catalog: rows by code, resolution bucket explanations, Xid 154 recovery-action mapping."""

    source: dict[str, str]
    buckets: dict[str, str]
    recovery_actions: dict[str, SuggestedAction]
    entries: dict[int, XidInfo]


@dataclass(frozen=True)
class Verdict:
    """gpu-agent's classification of a code: the catalog row's, or the unknown-code defaults."""

    name: str
    resolution: str
    severity: str
    action: SuggestedAction
    known: bool


def _error(where: str, message: str) -> CatalogError:
    return CatalogError(f"{where}: {message}")


def _str_field(entry: dict[str, Any], key: str, where: str, *, allow_empty: bool) -> str:
    value = entry[key]
    if not isinstance(value, str):
        raise _error(where, f"{key} must be a string, got {type(value).__name__}")
    if not allow_empty and value.strip() == "":
        raise _error(where, f"{key} must not be empty")
    return value


def _str_map(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _error(where, "must be an object")
    result: dict[str, str] = {}
    for key, text in value.items():
        if not isinstance(key, str) or not isinstance(text, str) or text.strip() == "":
            raise _error(where, f"entry {key!r} must map a name to non-empty text")
        result[key] = text
    return result


def _parse_entry(raw: object, index: int, buckets: dict[str, str]) -> XidInfo:
    where = f"xids[{index}]"
    if not isinstance(raw, dict):
        raise _error(where, "must be an object")
    keys = set(raw)
    if keys != _ENTRY_KEYS:
        raise _error(where, f"missing keys {sorted(_ENTRY_KEYS - keys)}, unexpected keys {sorted(keys - _ENTRY_KEYS)}")
    code = raw["code"]
    # bool is an int subclass; true/false in the JSON is a typo, not a code.
    if not isinstance(code, int) or isinstance(code, bool):
        raise _error(where, f"code must be an integer, got {code!r}")
    if not 1 <= code <= MAX_CODE:
        raise _error(where, f"code {code} out of range 1..{MAX_CODE}")
    where = f"xids[{index}] (Xid {code})"
    resolution = _str_field(raw, "resolution", where, allow_empty=False)
    if resolution != UNKNOWN_RESOLUTION and resolution not in buckets:
        raise _error(where, f"resolution {resolution!r} is neither {UNKNOWN_RESOLUTION} nor a described bucket")
    severity = _str_field(raw, "severity", where, allow_empty=False)
    if severity not in SEVERITIES:
        raise _error(where, f"severity {severity!r} not in {SEVERITIES}")
    action = _str_field(raw, "action", where, allow_empty=False)
    if action not in ACTIONS:
        raise _error(where, f"action {action!r} not in {ACTIONS}")
    applies = raw["applies_to"]
    if not isinstance(applies, list) or not all(model in GPU_MODELS for model in applies):
        raise _error(where, f"applies_to must be a list drawn from {GPU_MODELS}")
    return XidInfo(
        code=code,
        name=_str_field(raw, "name", where, allow_empty=False),
        description=_str_field(raw, "description", where, allow_empty=False),
        resolution=resolution,
        severity=severity,
        action=SuggestedAction(action),
        mnemonic=_str_field(raw, "mnemonic", where, allow_empty=False),
        investigatory=_str_field(raw, "investigatory", where, allow_empty=True),
        applies_to=tuple(applies),
        xid154_linkage=_str_field(raw, "xid154_linkage", where, allow_empty=True),
        note=_str_field(raw, "note", where, allow_empty=True),
    )


def parse_catalog(data: object) -> Catalog:
    """Validate decoded catalog JSON and build the catalog; raises CatalogError naming the bad entry."""
    if not isinstance(data, dict):
        raise _error("catalog", "top level must be an object")
    keys = set(data)
    if keys != _TOP_KEYS:
        raise _error("catalog", f"top-level keys must be {sorted(_TOP_KEYS)}, got {sorted(keys)}")
    source = _str_map(data["source"], "source")
    if "url" not in source or "transcribed" not in source:
        raise _error("source", "must name url and transcribed date")
    buckets = _str_map(data["buckets"], "buckets")
    for bucket in buckets:
        if _BUCKET_RE.fullmatch(bucket) is None:
            raise _error("buckets", f"bad bucket name {bucket!r}")
    recovery_actions: dict[str, SuggestedAction] = {}
    for label, mapped in _str_map(data["recovery_actions"], "recovery_actions").items():
        if mapped not in ACTIONS:
            raise _error("recovery_actions", f"{label!r} maps to unknown action {mapped!r}")
        recovery_actions[label] = SuggestedAction(mapped)
    rows = data["xids"]
    if not isinstance(rows, list) or not rows:
        raise _error("xids", "must be a non-empty list")
    entries: dict[int, XidInfo] = {}
    previous = 0
    for index, raw in enumerate(rows):
        info = _parse_entry(raw, index, buckets)
        # Sorted and unique keeps the file reviewable and diffs against NVIDIA's sheet readable.
        if info.code <= previous:
            raise _error(f"xids[{index}]", f"code {info.code} is duplicated or out of order")
        previous = info.code
        entries[info.code] = info
    return Catalog(source=source, buckets=buckets, recovery_actions=recovery_actions, entries=entries)


@functools.cache
def catalog() -> Catalog:
    """The shipped catalog, loaded and validated once per process."""
    text = resources.files("agent.watch").joinpath("xid_catalog.json").read_text(encoding="utf-8")
    try:
        data = safe_json.loads(text)
    except safe_json.JsonError as exc:
        raise CatalogError(f"xid_catalog.json is not valid JSON: {exc}") from exc
    return parse_catalog(data)


def lookup(code: int) -> XidInfo | None:
    """The catalog row for ``code``, or None when NVIDIA's catalog (as shipped) does not list it."""
    return catalog().entries.get(code)


def all_codes() -> list[int]:
    """Every code in the catalog, ascending."""
    return sorted(catalog().entries)


def verdict(code: int) -> Verdict:
    """The classification of ``code``; a code the catalog lacks gets the unknown-code defaults."""
    info = lookup(code)
    if info is None:
        return Verdict(UNKNOWN_NAME, UNKNOWN_RESOLUTION, UNKNOWN_SEVERITY, UNKNOWN_ACTION, known=False)
    return Verdict(info.name, info.resolution, info.severity, info.action, known=True)


def action_for_recovery(recovery_action: str) -> SuggestedAction | None:
    """Map the recovery action named by an Xid 154 line ("GPU Reset Required", ...) to our action."""
    return catalog().recovery_actions.get(recovery_action.strip())


def explain(code: int) -> dict[str, object]:
    """Catalog entry as a JSON-ready dict (``gpu-agent xid explain N --json``); unknown codes do not raise."""
    cat = catalog()
    info = cat.entries.get(code)
    if info is None:
        return {
            "code": code,
            "known": False,
            "name": UNKNOWN_NAME,
            "description": (
                f"Xid {code} is not in NVIDIA's Xid catalog as shipped with gpu-agent "
                f"(transcribed {cat.source['transcribed']}); check {cat.source['url']} for a newer catalog."
            ),
            "resolution": UNKNOWN_RESOLUTION,
            "resolution_text": "",
            "severity": UNKNOWN_SEVERITY,
            "action": UNKNOWN_ACTION.value,
            "source": cat.source["url"],
        }
    return {
        "code": info.code,
        "known": True,
        "name": info.name,
        "mnemonic": info.mnemonic,
        "description": info.description,
        "resolution": info.resolution,
        "resolution_text": cat.buckets.get(info.resolution, ""),
        "investigatory": info.investigatory,
        "applies_to": list(info.applies_to),
        "xid154_linkage": info.xid154_linkage,
        "severity": info.severity,
        "action": info.action.value,
        "note": info.note,
        "source": cat.source["url"],
    }


def explain_text(code: int) -> str:
    """Human-readable explanation, a few lines."""
    info = lookup(code)
    if info is None:
        unknown = explain(code)
        return (
            f"Xid {code}: unknown\n{unknown['description']}\n"
            f"gpu-agent default: severity {unknown['severity']}, action {unknown['action']}\n"
        )
    lines = [f"Xid {code}: {info.name} ({info.mnemonic})", info.description]
    bucket_text = catalog().buckets.get(info.resolution)
    lines.append(f"NVIDIA resolution: {info.resolution}" + (f": {bucket_text}" if bucket_text else ""))
    if info.investigatory:
        lines.append(f"NVIDIA investigatory action: {info.investigatory}")
    lines.append(f"Applies to: {', '.join(info.applies_to) or 'none of ' + ', '.join(GPU_MODELS)}")
    lines.append(f"gpu-agent default: severity {info.severity}, action {info.action.value}")
    if info.note:
        lines.append(f"Note: {info.note}")
    return "\n".join(lines) + "\n"
