"""`gpu-agent status`: the daemon's view over its socket, read with nothing heavy imported (not
even the YAML parser for the configs people write); without a daemon, one direct read of the node."""

from __future__ import annotations

import argparse
import re
import sys

from agent import TYPE_CHECKING
from agent.cli.common import CliError, config_path, load, make_engine, print_text
from agent.defaults import DEFAULT_SOCKET_PATH

if TYPE_CHECKING:
    from agent.config import AgentConfig


def cmd_status(args: argparse.Namespace) -> int:
    from agent import api, textview

    document = None
    if not args.direct:
        # Against a running daemon only `api.socket` is read from the config (no validation, no
        # pydantic): the daemon already validated it, and the answer comes back in a fraction of the time.
        socket_path = socket_path_of(args)
        try:
            document = api.call(socket_path, "status")
        except PermissionError:
            # A daemon runs, and this user may not ask it: a direct read would miss what only it knows
            # (its Xid history, services) and could call a node healthy that is not.
            raise CliError(
                f"{api.denied_reason(socket_path)}; `gpu-agent status --direct` reads what this user may"
            ) from None
        except (OSError, ValueError):
            document = None  # no daemon (or not ours): read directly
        except api.ApiError as exc:
            raise CliError(f"daemon at {socket_path}: {exc}") from None
    if document is None or document.get("starting"):
        from agent.logger import log_to_stderr_when_used

        log_to_stderr_when_used()  # a direct read imports what logs; its lines must not reach stdout
        config = load(args)
        if args.direct:
            note = "direct read (--direct)"
        elif document is None:
            note = f"direct read: no daemon answered on {config.api.socket}"
        else:
            note = f"direct read: the daemon on {config.api.socket} is still starting"
        document = direct_status(config, note)
    if args.json:
        print_text(textview.dumps(document))
    else:
        colour = textview.use_colour(sys.stdout)
        print_text(textview.status_text(document, width=textview.screen_width(sys.stdout), colour=colour))
    return textview.status_exit_code(document)


def socket_path_of(args: argparse.Namespace) -> str:
    from agent.defaults import MAX_YAML_BYTES
    from agent.trust import TooLargeError, UntrustedError, read_trusted

    path, _ = config_path(args)
    if path is None:
        return DEFAULT_SOCKET_PATH
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


def direct_status(config: AgentConfig, note: str) -> dict[str, object]:
    """What `status` shows without a daemon: one collection and one plan, read-only, judged by the
    same watchers, with the node memory the daemon keeps in the store (Xids, held slowdowns, GPUs
    gone, services declared down), made into a snapshot by the same builder as the daemon's."""
    import time

    from agent import documents
    from agent.backend.errors import GpuError, GpuErrorKind
    from agent.collect import sample_all
    from agent.host.paths import HostPaths
    from agent.services.watch import read_once
    from agent.snapshot import DaemonParts, NodeWatchers, build_snapshot
    from agent.store.db import StoreError
    from agent.store.node_memory import read_boot_id, read_remembered

    now = time.time()
    memory_closed = _closed_to_this_user(config.state_dir)
    if memory_closed:
        # Left out, never shown as a finding: the verdict reads no reboot recommendation it cannot read.
        note += (
            f"; this user may not read {config.state_dir}: the daemon's node memory (Xid history, held"
            " slowdowns) and its reboot recommendation are not included"
        )
    try:
        engine = make_engine(config)
    except GpuError as exc:
        if exc.kind is GpuErrorKind.NO_PERMISSION:  # this user's limit, not the node's problem
            raise CliError(f"this user may not read the GPUs: {exc}; run it as root (sudo)") from None
        # No driver (or NVML unusable): that is the node's state, shown as its problem, not an error of `status`.
        snapshot = build_snapshot(
            config, now, [], NodeWatchers(), driver_version=None, policy=(), daemon=DaemonParts(backend_error=exc)
        )
        return documents.snapshot_document(snapshot, source="direct", note=note, mode=config.mode.value)
    try:
        samples = sample_all(engine.backend)
        driver = engine.backend.driver_version()
        plan = engine.plan()
        figures, attribution = read_once(config, engine.backend)
    finally:
        engine.backend.shutdown()
    watchers = NodeWatchers()
    parts = DaemonParts()
    remembered = None
    if not memory_closed:
        try:
            remembered = read_remembered(config.state_dir, read_boot_id(HostPaths.at(config.host_root)))
        except StoreError as exc:
            note += f"; the daemon's node memory is unreadable ({exc}): Xid history and held slowdowns not included"
    if remembered is not None:
        samples = remembered.samples(samples, now)
        remembered.restore(watchers.xid, watchers.throttle)
        parts = DaemonParts(services=remembered.services([(s.name, s.shown_unit) for s in config.services]))
    watchers.observe(samples, now)
    snapshot = build_snapshot(
        config,
        now,
        samples,
        watchers,
        driver_version=driver,
        policy=plan.items,
        daemon=parts,
        service_figures=figures,
        gpu_attribution=attribution,
    )
    return documents.snapshot_document(snapshot, source="direct", note=note, mode=config.mode.value)


def _closed_to_this_user(directory: str) -> bool:
    """The directory exists (or its parent hides it) and this user may not read it."""
    import os

    try:
        os.stat(directory)
    except PermissionError:
        return True
    except OSError:
        return False
    return not os.access(directory, os.R_OK | os.X_OK)
