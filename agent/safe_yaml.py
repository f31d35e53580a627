"""The one YAML loader for every file gpu-agent reads (agent.yaml, rules.d, profiles).

YAML read as root must not be a way to take the agent down: PyYAML's own loaders expand aliases
without limit (a 391-byte "billion laughs" file grows to gigabytes), recurse once per nesting
level (1.2 KB of `[[[[` ends in RecursionError) and read files of any size. Here:

- a file larger than `MAX_YAML_BYTES` is refused before it is parsed, naming its size;
- anchors and aliases (`&name`, `*name`) are refused with the line they are on: none of our
  files needs them, and refusing them is simpler to reason about than an expansion budget;
- nesting deeper than `MAX_DEPTH` collections is refused at the line where it goes too deep,
  before anything recurses that far;
- a key given twice is an error (not last-wins), and every key and list item keeps its line,
  so validation errors read `FILE:LINE field: message`.

Every problem is a `ConfigError`; nothing here raises anything else for any input text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from yaml.events import AliasEvent, CollectionEndEvent, CollectionStartEvent, NodeEvent

from agent import defaults
from agent.config_errors import ConfigError, ConfigProblem
from agent.config_errors import PathKey as PathKey

MAX_YAML_BYTES = defaults.MAX_YAML_BYTES
MAX_DEPTH = 64


@dataclass(frozen=True)
class LoadedYaml:
    data: Any
    lines: dict[PathKey, int]  # line (1-based) of every key and list item, by its path


class _Refused(Exception):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and anchors and stops at MAX_DEPTH nested collections.

    The check sits in compose_node, which sees every node's event before composing it, so the
    recursion below it never goes deeper than MAX_DEPTH.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        refused = _refusal(event, self.depth)
        if refused is not None:
            raise refused
        if isinstance(event, CollectionStartEvent):
            self.depth += 1
            try:
                node: yaml.Node | None = super().compose_node(parent, index)
            finally:
                self.depth -= 1
            return node
        scalar: yaml.Node | None = super().compose_node(parent, index)
        return scalar


_CLoader: type[Any] | None = getattr(yaml, "CSafeLoader", None)


def _refusal(event: yaml.Event, depth: int) -> _Refused | None:
    line = event.start_mark.line + 1 if event.start_mark is not None else 0
    if isinstance(event, AliasEvent):
        return _Refused(line, f"alias *{event.anchor} not allowed: gpu-agent files use no anchors or aliases")
    if isinstance(event, NodeEvent) and event.anchor is not None:
        return _Refused(line, f"anchor &{event.anchor} not allowed: gpu-agent files use no anchors or aliases")
    if isinstance(event, CollectionStartEvent) and depth >= MAX_DEPTH:
        return _Refused(line, f"nested more than {MAX_DEPTH} levels deep")
    return None


def _prescan(text: str) -> None:
    """The same limits on libyaml's event stream, when PyYAML has it: C scans a deep flow
    collection in milliseconds where PyYAML's scanner takes most of a second. Anything else
    libyaml objects to is left to the Python loader, whose messages the tests and users know."""
    if _CLoader is None:
        return
    loader = _CLoader(text)
    depth = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            refused = _refusal(event, depth)
            if refused is not None:
                raise refused
            if isinstance(event, CollectionStartEvent):
                depth += 1
            elif isinstance(event, CollectionEndEvent):
                depth -= 1
    except yaml.MarkedYAMLError as exc:
        if exc.problem and "nesting depth" in exc.problem and exc.problem_mark is not None:
            raise _Refused(exc.problem_mark.line + 1, f"nested more than {MAX_DEPTH} levels deep") from None
    except yaml.YAMLError:
        return
    finally:
        loader.dispose()


def format_path(path: PathKey) -> str:
    """("policy", "gpus", 0, "match") -> "policy.gpus[0].match"."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _node_lines(
    node: yaml.Node, path: PathKey, lines: dict[PathKey, int], duplicates: list[tuple[PathKey, int]]
) -> None:
    # Recursion is bounded by MAX_DEPTH: the loader refused anything deeper.
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child: PathKey = (*path, key)
            if key in seen:
                duplicates.append((child, key_node.start_mark.line + 1))
            seen.add(key)
            lines[child] = key_node.start_mark.line + 1
            _node_lines(value_node, child, lines, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            element: PathKey = (*path, index)
            lines[element] = item.start_mark.line + 1
            _node_lines(item, element, lines, duplicates)


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def load_text(text: str, file: str) -> LoadedYaml:
    """YAML text -> data and the line of every key and item; ConfigError naming `file` otherwise."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_YAML_BYTES:
        raise ConfigError([ConfigProblem(file, None, "", too_large(size))])
    loader: _BoundedLoader | None = None
    try:
        _prescan(text)
        loader = _BoundedLoader(text)  # the reader refuses control characters right here
        root = loader.get_single_node()
        data = None if root is None else loader.construct_document(root)
    except _Refused as exc:
        raise ConfigError([ConfigProblem(file, exc.line, "", f"invalid YAML: {exc.message}")]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        raise ConfigError([ConfigProblem(file, line, "", f"invalid YAML: {exc.problem or exc}")]) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (NUL, most control characters)
        character = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        line = _line_of(text, exc.position)
        raise ConfigError([ConfigProblem(file, line, "", f"invalid YAML: character {character} not allowed")]) from None
    except (yaml.YAMLError, ValueError, OverflowError) as exc:
        # ValueError: an integer past Python's digit limit; OverflowError: a date out of range.
        raise ConfigError([ConfigProblem(file, None, "", f"invalid YAML: {exc}")]) from None
    finally:
        if loader is not None:
            loader.dispose()
    lines: dict[PathKey, int] = {}
    duplicates: list[tuple[PathKey, int]] = []
    if root is not None:
        _node_lines(root, (), lines, duplicates)
    if duplicates:
        raise ConfigError([ConfigProblem(file, line, format_path(p), "duplicate key") for p, line in duplicates])
    return LoadedYaml(data, lines)


def too_large(size_bytes: int) -> str:
    return f"file is {size_bytes} bytes, more than the {MAX_YAML_BYTES} bytes gpu-agent reads"


def decode(raw: bytes, file: str) -> str:
    """Bytes read from `file` as UTF-8 text; ConfigError naming the line of a byte that is not UTF-8."""
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError([ConfigProblem(file, None, "", too_large(len(raw)))])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        message = f"not UTF-8 text: byte {raw[exc.start]:#04x} at offset {exc.start}"
        raise ConfigError([ConfigProblem(file, line, "", message)]) from None


def load_bytes(raw: bytes, file: str) -> LoadedYaml:
    return load_text(decode(raw, file), file)
