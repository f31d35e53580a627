"""`gpu-agent status`: the daemon's view over its socket, found with nothing heavy imported (not even
the YAML parser for the configs people write); without a daemon, one direct read of the node."""

from __future__ import annotations

import argparse
import sys

from agent import TYPE_CHECKING
from agent.cli.common import CliError, config_path, load, make_engine, print_text
from agent.defaults import DEFAULT_SOCKET_PATH

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    from agent.api import Published
    from agent.config import AgentConfig


def cmd_status(args: argparse.Namespace) -> int:
    from agent import textview
    from agent.version import package_notice

    document = None if args.direct else daemon_document(args)
    if document is None or document.get("starting"):
        from agent.logs import log_to_stderr_when_used

        log_to_stderr_when_used()  # a direct read imports what logs; its lines must not reach stdout
        config = load(args)
        if args.direct:
            note = "direct read (--direct)"
        elif document is None:
            note = f"direct read: no daemon answered on {config.api.socket}"
        else:
            note = f"direct read: the daemon on {config.api.socket} is still starting"
        document = direct_status(config, note)
    daemon_version = document.get("version") if document.get("source") != "direct" else None
    notice = package_notice(daemon_version if isinstance(daemon_version, str) else None)
    if notice is not None:
        print(f"warning: {notice}", file=sys.stderr)
    if args.json:
        print_text(textview.dumps(document))
    else:
        colour = textview.use_colour(sys.stdout)
        print_text(textview.status_text(document, width=textview.screen_width(sys.stdout), colour=colour))
    return textview.status_exit_code(document)


def daemon_document(args: argparse.Namespace) -> dict[str, Any] | None:
    """The running daemon's status document; None when no daemon answers. Its socket is the one the
    daemon published for this config file (agent/api.py `read_published`: the config is not read),
    else the config's `api.socket`. A config file changed since the daemon read it is noted."""
    from agent import api

    path, _ = config_path(args)
    published = None if path is None else api.read_published(path)
    for socket_path in _sockets(path, published):
        try:
            document: dict[str, Any] = api.call(socket_path, "status")
        except PermissionError:
            # A daemon runs, and this user may not ask it: a direct read would miss what only it knows
            # (its Xid history, services) and could call a node healthy that is not.
            raise CliError(
                f"{api.denied_reason(socket_path)}; `gpu-agent status --direct` reads what this user may"
            ) from None
        except (OSError, ValueError):
            continue  # no daemon there (or not ours)
        except api.ApiError as exc:
            raise CliError(f"daemon at {socket_path}: {exc}") from None
        if published is not None and socket_path == published.socket and published.config_changed():
            note = (
                f"{published.config} has changed since the daemon read it (it runs what it read then):"
                " check it with `gpu-agent check-config`, apply it with `systemctl reload gpu-agent`"
            )
            document["note"] = "; ".join(text for text in (document.get("note"), note) if text)
        return document
    return None


def _sockets(path: str | None, published: Published | None) -> Iterator[str]:
    """Where a daemon may answer, in order: the socket published for the config, then (only when that
    one does not answer: its daemon was killed) the config's own, read from the file."""
    if published is not None:
        yield published.socket
    from agent.cli.config_socket import configured_socket

    configured = DEFAULT_SOCKET_PATH if path is None else configured_socket(path)
    if published is None or configured != published.socket:
        yield configured


def socket_path_of(args: argparse.Namespace) -> str:
    """The socket of the daemon running the config `args` name (`ack` and `tune` ask it): the one it
    published for that config file, else the config's `api.socket`."""
    from agent import api

    path, _ = config_path(args)
    if path is None:
        return DEFAULT_SOCKET_PATH
    published = api.read_published(path)
    if published is not None:
        return published.socket
    from agent.cli.config_socket import configured_socket

    return configured_socket(path)


def direct_status(config: AgentConfig, note: str) -> dict[str, object]:
    """What `status` shows without a daemon: one collection and one plan, read-only, judged by the
    same watchers, with the node memory the daemon keeps in the store (Xids, held slowdowns, GPUs
    gone, services declared down), made into a snapshot by the same builder as the daemon's."""
    import time

    from agent import documents
    from agent.backend.errors import GpuError, GpuErrorKind
    from agent.collect import sample_all
    from agent.host.paths import HostPaths
    from agent.node_memory.inventory import read_boot_id
    from agent.node_memory.remembered import read_remembered
    from agent.services.monitor import read_once
    from agent.snapshot import DaemonParts, NodeWatchers, build_snapshot
    from agent.store.db import StoreError

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
