"""The socket a config file names (`api.socket`), for when no daemon published its own for that file
(agent/api.py `read_published`): read without importing the YAML parser for the shapes configs are
written in, through the parser for the rest. Loaded only then: its patterns cost the fast start."""

from __future__ import annotations

import re

from agent.defaults import DEFAULT_SOCKET_PATH, MAX_YAML_BYTES
from agent.trust import TooLargeError, UntrustedError, read_trusted


def configured_socket(path: str) -> str:
    """`api.socket` of the config file at `path`, the default socket when it names none."""

    # The same trust check and bounded loader as the daemon's: a config that would be refused
    # (or a parser bomb) must neither point status at another socket nor take the command down.
    try:
        raw = read_trusted(path, limit_bytes=MAX_YAML_BYTES)
    except (OSError, UntrustedError, TooLargeError):
        return DEFAULT_SOCKET_PATH  # the direct read then reports the config problem properly
    socket_path = api_socket_without_yaml(raw)
    if socket_path is not None:
        return socket_path
    from agent import safe_yaml
    from agent.config_errors import ConfigError

    try:
        data = safe_yaml.load_bytes(raw, str(path)).data
    except ConfigError:
        return DEFAULT_SOCKET_PATH
    api = data.get("api") if isinstance(data, dict) else None
    socket = api.get("socket") if isinstance(api, dict) else None
    return str(socket) if isinstance(socket, str) else DEFAULT_SOCKET_PATH


#: What `api_socket_without_yaml` reads: a top-level `api:` key, its block's lines, a plain path.
_API_KEY = re.compile(rb"^api[ \t]*:(?P<rest>.*)$", re.MULTILINE)
_ANY_API_KEY = re.compile(rb"(?:^|[\s{,'\"?])api['\"]?[ \t]*:", re.MULTILINE)
_PLAIN = rb"(?P<value>[A-Za-z0-9_./+-]+)"
_BLOCK_PAIR = re.compile(rb"(?P<indent>[ ]+)(?P<key>[a-z_]+)[ ]*:[ ]+" + _PLAIN + rb"[ ]*(?:[ ]#.*)?")
_FLOW_PAIR = re.compile(rb"[ ]*(?P<key>[a-z_]+)[ ]*:[ ]+" + _PLAIN + rb"[ ]*")
_FLOW = re.compile(rb"[ ]*\{(?P<pairs>[^{}]*)\}[ ]*(?:[ ]#.*)?")
_COMMENT_OR_BLANK = re.compile(rb"[ ]*(?:#.*)?")
_COMMENT = re.compile(rb"(?:^|[ \t])#.*$", re.MULTILINE)
# anchors, aliases, tags, merge keys, directives, document markers, complex keys: the parser's business
_YAML_MACHINERY = re.compile(
    rb"(?:^|[\s,\[{:?-])(?:[&*!][^\s,\]}\"']|<<)|^(?:%|---|\.\.\.|[ ]*\?(?:[ ]|$))", re.MULTILINE
)


def api_socket_without_yaml(raw: bytes) -> str | None:
    """`api.socket` of a config in the shapes configs are written in (the shipped file's block, or
    `api: {socket: PATH}`), read without importing the YAML parser, the largest import `status` had
    left; None for anything else (quotes, escapes, anchors, merge keys, several documents, an `api`
    key in any other place): then the YAML parser reads it. The default socket when there is no `api`."""
    if not raw.isascii():  # a byte-order mark, another encoding, names beyond ASCII: the parser's
        return None
    content = _COMMENT.sub(b"", raw)
    if _YAML_MACHINERY.search(content) or b"\\" in content:
        return None
    keys = list(_API_KEY.finditer(raw))
    if len(_ANY_API_KEY.findall(raw)) != len(keys) or len(keys) > 1:
        return None
    if not keys:
        return DEFAULT_SOCKET_PATH
    match = keys[0]
    rest = match.group("rest")
    pairs: dict[bytes, bytes] = {}
    if _COMMENT_OR_BLANK.fullmatch(rest):
        indent = None
        for line in raw[match.end() + 1 :].split(b"\n"):
            if _COMMENT_OR_BLANK.fullmatch(line):
                continue
            if not line.startswith(b" "):
                break  # the next top-level key
            pair = _BLOCK_PAIR.fullmatch(line)
            if pair is None or indent not in (None, pair.group("indent")) or pair.group("key") in pairs:
                return None
            indent = pair.group("indent")
            pairs[pair.group("key")] = pair.group("value")
    else:
        flow = _FLOW.fullmatch(rest)
        if flow is None:
            return None
        for text in flow.group("pairs").split(b","):
            pair = _FLOW_PAIR.fullmatch(text)
            if pair is None or pair.group("key") in pairs:
                return None
            pairs[pair.group("key")] = pair.group("value")
    value = pairs.get(b"socket")
    if value is None:
        return DEFAULT_SOCKET_PATH
    return value.decode() if value.startswith(b"/") else None
