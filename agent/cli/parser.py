"""The argparse tree of `gpu-agent`: every command, option and help line, and the hidden
`--complete-values` shell completion asks. Building it imports only the standard library: each
command's module is imported when that command runs, and the parsers of `inject` and `tune` (their
own trees) are built only when the command is theirs or the whole tree is asked for (completion)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from agent import TYPE_CHECKING
from agent.cli.completion_values import DYNAMIC_KINDS
from agent.defaults import DEFAULT_CONFIG_PATH
from agent.tune.defaults import TUNE_HELP

if TYPE_CHECKING:
    from typing import Any


#: The most rows of each kind `events --limit` asks for (the store keeps 30 days).
MAX_EVENTS_LIMIT = 1_000_000
#: The furthest back `events --since` looks: ten years, far beyond the store's 30 days.
MAX_SINCE_SECONDS = 3650 * 86400.0


def positive_int(text: str) -> int:
    """A count from 1 to MAX_EVENTS_LIMIT in ASCII digits (SQLite reads a negative LIMIT as no limit
    at all, and refuses an integer beyond 64 bits with an OverflowError)."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_EVENTS_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number from 1 to {MAX_EVENTS_LIMIT}")
    return int(text)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration_seconds(text: str) -> float:
    """'90s', '30m', '1h', '7d' -> seconds (ASCII digits, at most MAX_SINCE_SECONDS)."""
    number, unit = text[:-1], text[-1:]
    digits = number.replace(".", "", 1)
    if unit not in _DURATION_UNITS or not (digits.isascii() and digits.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: give a duration like 90s, 30m, 1h or 7d")
    seconds = float(number) * _DURATION_UNITS[unit]
    if seconds > MAX_SINCE_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r}: at most {MAX_SINCE_SECONDS / 86400:.0f}d")
    return seconds


def ack_selector(text: str) -> str:
    """An `ack` selector whose numbers are in range (agent/store/selector.py), as given."""
    from agent.store.selector import parse_ack_selector

    try:
        parse_ack_selector(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def xid_code(text: str) -> int:
    """An Xid code the driver reports (1-999)."""
    from agent.backend.base import MAX_XID

    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_XID:
        raise argparse.ArgumentTypeError(f"{text!r}: an Xid code is a whole number from 1 to {MAX_XID}")
    return int(text)


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's, sized without importing shutil (argparse imports it to size even an unused formatter)."""

    def __init__(self, prog: str) -> None:
        columns = os.environ.get("COLUMNS", "")
        if columns.isdecimal() and int(columns) > 0:
            width = int(columns)
        else:
            try:
                width = os.get_terminal_size(sys.__stdout__.fileno() if sys.__stdout__ else 1).columns
            except (OSError, ValueError):
                width = 80
        super().__init__(prog, width=max(width, 20) - 2)


class _Parser(argparse.ArgumentParser):
    """Every parser of the tree (subparsers take their parent's class) with the formatter above:
    argparse builds a formatter for each argument it adds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


#: `inject`'s line in `gpu-agent --help`; its fault parsers (which import the backend types) are
#: built only when the command is `inject` (or for the whole tree: completion).
INJECT_HELP = "inject a fault into a simulated node (and a running daemon on it)"


class _VersionAction(argparse.Action):
    """--version, reading the version only when asked (in a git checkout it runs git)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
        from agent.version import version_text

        sys.stdout.write(version_text())
        parser.exit()


def _command(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The function `name` of `agent.cli.<module>` running the command, imported when it runs."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        handler: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(f"agent.cli.{module}"), name)
        return handler(args)

    return run


def _socket_path_of(args: argparse.Namespace) -> str:
    from agent.cli.status import socket_path_of

    return socket_path_of(args)


def _config_path_of(args: argparse.Namespace) -> str | None:
    from agent.cli.common import config_path

    return config_path(args)[0]


class _CompleteValuesAction(argparse.Action):
    """--complete-values KIND (hidden): the values shell completion offers, one a line
    (agent/cli/completion_values.py)."""

    def __call__(self, parser: argparse.ArgumentParser, _namespace: object, values: object, *_args: object) -> None:
        from agent.cli.completion_values import dynamic_values

        for value in dynamic_values(str(values)):
            sys.stdout.write(value + "\n")
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The tree for running `command` (the first word given), or the whole tree when None."""
    common = _Parser(add_help=False)
    common.add_argument(
        "--config", metavar="PATH", help=f"config file (default {DEFAULT_CONFIG_PATH}, or $GPU_AGENT_CONFIG)"
    )
    as_json = _Parser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="machine-readable output (stable, versioned by `schema`)")

    parser = _Parser(
        prog="gpu-agent",
        description="Keep a GPU inference node in its declared state, watch it, and repair what is safe to repair.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and the commit it was built from")
    parser.add_argument(
        "--complete-values", action=_CompleteValuesAction, choices=DYNAMIC_KINDS, help=argparse.SUPPRESS
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", parents=[common], help="the daemon, in the foreground (systemd Type=notify)")
    p.add_argument(
        "--log-format",
        choices=["auto", "journal", "json", "console"],
        default="auto",
        help="auto: journal under systemd, console in a terminal, JSON lines otherwise",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.set_defaults(func=_command("commands", "cmd_run"))
    p = sub.add_parser(
        "plan",
        parents=[common, as_json],
        help="desired vs actual per item and GPU; changes nothing",
        description="Exit codes: 0 in sync, 2 drift (or reboot pending), 1 error.",
    )
    p.set_defaults(func=_command("commands", "cmd_plan"))
    p = sub.add_parser(
        "apply",
        parents=[common, as_json],
        help="enforce the policy once (enforce-mode items only)",
        description="Exit codes: 0 ok, 1 error or drift left unapplied.",
    )
    p.add_argument("--dry-run", action="store_true", help="show what would change, change nothing")
    p.set_defaults(func=_command("commands", "cmd_apply"))
    p = sub.add_parser(
        "restore", parents=[common, as_json], help="fans to automatic, locked clocks reset, default power limit"
    )
    p.set_defaults(func=_command("commands", "cmd_restore"))
    p = sub.add_parser(
        "status", parents=[common, as_json], help="live view from the daemon; a direct read when none runs"
    )
    p.add_argument("--direct", action="store_true", help="read the GPUs directly even if a daemon runs")
    p.set_defaults(func=_command("status", "cmd_status"))
    p = sub.add_parser("events", parents=[common, as_json], help="event and remediation history from the store")
    p.add_argument(
        "--since",
        type=parse_duration_seconds,
        default=parse_duration_seconds("1h"),
        metavar="DURATION",
        help="how far back: 90s, 30m, 1h (default), 7d (at most 3650d)",
    )
    p.add_argument(
        "--limit", type=positive_int, default=200, help=f"at most this many of each (default 200, 1-{MAX_EVENTS_LIMIT})"
    )
    p.set_defaults(func=_command("commands", "cmd_events"))
    p = sub.add_parser(
        "ack",
        parents=[common],
        help="mark Xids dealt with, re-arm rules whose attempts ran out, forget a missing GPU, withdraw a reboot",
        description="SELECTOR: a rule name, gpu:INDEX, gpu:UUID, xid:CODE@GPU (GPU: index or UUID), "
        "service:NAME, reboot, or all. A GPU or Xid selector (or all) marks the GPU's Xids (or that one) dealt with: "
        "they leave the verdict, their counts stay. A GPU selector (or all) also re-arms the rules acting on it "
        "and acknowledges a missing GPU as gone: it leaves status and /metrics until it answers again. "
        "reboot (or all) withdraws the reboot recommendation (dealt with another way): it leaves status, /metrics "
        "and the alerts. Their alerts resolve. "
        "Through the running daemon (its own store); in the store file the config names only when no daemon "
        "answers on the socket. "
        "Exit codes: 0 something acknowledged (or `all` with nothing to do), 1 nothing matched (a typo?) or "
        "refused, 2 a number out of range (an index beyond NVML's, an Xid code outside 1-999).",
    )
    p.add_argument("selector", type=ack_selector)
    p.set_defaults(func=_command("commands", "cmd_ack"))
    p = sub.add_parser(
        "check-config",
        parents=[common],
        help="validate the config; errors name file, line, field",
        description="Validates agent.yaml and every rules file, and lists which rules files count. "
        "Exit codes: 0 valid, 1 invalid (or, with --strict, warnings).",
    )
    p.add_argument(
        "--rules",
        metavar="DIR",
        action="append",
        help="rules directory, repeatable, lowest priority first (default: remediation.rules_dirs from the config)",
    )
    p.add_argument(
        "--strict", action="store_true", help="exit 1 on warnings too: a missing rules dir, no rules, unread files"
    )
    p.set_defaults(func=_command("check_config", "cmd_check_config"))

    xid = sub.add_parser("xid", help="the Xid catalog and the kernel-log parser")
    xid_sub = xid.add_subparsers(dest="xid_command", required=True, metavar="SUBCOMMAND")
    p = xid_sub.add_parser(
        "explain",
        parents=[as_json],
        help="what an Xid means and what to do",
        description="Exit codes: 0 a code in the catalog, 1 a code it lacks, 2 not a code (1-999).",
    )
    p.add_argument("code", type=xid_code)
    p.set_defaults(func=_command("commands", "cmd_xid_explain"))
    p = xid_sub.add_parser(
        "parse",
        parents=[common],
        help="kernel-log lines on stdin -> one JSON object per Xid (gpu/uuid filled in when --config names this node)",
    )
    p.set_defaults(func=_command("commands", "cmd_xid_parse"))

    if command in (None, "inject"):
        from typing import cast

        from agent.demo.inject import add_parsers

        add_parsers(cast("argparse._SubParsersAction[argparse.ArgumentParser]", sub), common)
    else:
        sub.add_parser("inject", help=INJECT_HELP)
    sub.choices["inject"].set_defaults(func=_command("commands", "cmd_inject"))
    if command in (None, "tune"):
        from agent.tune.cli import add_parsers as add_tune_parsers

        add_tune_parsers(sub, common, _socket_path_of, _config_path_of)
    else:
        sub.add_parser("tune", help=TUNE_HELP)
    p = sub.add_parser(
        "demo", help="the daemon on a simulated node with a fault scenario (changes nothing on this machine)"
    )
    p.add_argument("--dir", metavar="DIR", help="scratch directory for the simulated node (default: a new temp dir)")
    p.add_argument("--exit-after-scenario", action="store_true", help="stop the agent when the scenario is done")
    p.set_defaults(func=_command("commands", "cmd_demo"))
    return parser
