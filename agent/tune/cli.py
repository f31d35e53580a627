"""`gpu-agent tune`: ask the running daemon for a sweep, follow it, print its table.

    gpu-agent tune power  --service NAME --from W --to W --step W --dwell SECONDS [--gpus 0,1] [--json]
    gpu-agent tune clocks --service NAME --from MHz --to MHz --step MHz --dwell SECONDS [--gpus ...] [--json]
    gpu-agent tune power  --service NAME --passive [--json]
    gpu-agent tune --abort | --last [--json]
    gpu-agent tune apply | undo

The sweep runs inside the daemon (one journaled job); this command starts it over the status
socket, shows its progress on stderr (step i of n, time left), and prints the table and the
recommendation. Ctrl-C asks the daemon to abort, and waits while it puts the original settings back.
Exit codes: 0 a recommendation, 2 the sweep ended without one, 1 refused, failed or aborted.
`tune apply` puts the last recommendation in force as a drop-in beside agent.yaml and `tune undo`
takes it away (agent.tune.apply): 0 done, 1 refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent.tune.defaults import (
    DEFAULT_MAX_TRAFFIC_CHANGE,
    DEFAULT_MIN_REQUEST_RATE,
    DEFAULT_SETTLE_SECONDS,
    DEFAULT_THROUGHPUT_TOLERANCE,
    KNOB_UNITS,
    TUNE_HELP,
)

if TYPE_CHECKING:  # the sweep's models (dataclasses) only where a document is rendered: --help stays light
    from agent.tune.model import Recommendation, TuneDocument

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_NO_RECOMMENDATION = 2
POLL_SECONDS = 0.5

SocketPath = Callable[[argparse.Namespace], str]
#: The config file a command runs with (None: built-in defaults), as agent.cli.common finds it.
ConfigPath = Callable[[argparse.Namespace], "str | None"]


def _gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices, comma-separated (0,1)") from None
    if not gpus or any(g < 0 for g in gpus):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices, comma-separated (0,1)")
    return gpus


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _tolerance(text: str) -> float:
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a ratio from 0 up to (not including) 1; 0.05 is 5 %")
    return value


def add_parsers(sub: Any, common: argparse.ArgumentParser, socket_path: SocketPath, config_path: ConfigPath) -> None:
    """`tune`, its kinds and `apply`/`undo`, under the main parser's subcommands."""
    description = (
        "Measure what a power limit or a locked clock costs the service: the daemon sets each step,"
        " waits for the clocks to settle, measures tokens/s, tokens per joule, p95 latency, power,"
        " clocks and temperature over the dwell, and puts the original settings back at the end (also"
        " on abort, on SIGTERM, and after a kill -9 at its next start). Needs the item in enforce mode."
        " Exit codes: 0 a recommendation, 2 none, 1 refused, failed or aborted."
    )
    tune = sub.add_parser(
        "tune",
        parents=[common],
        help=TUNE_HELP,
        description=description,
    )
    tune.add_argument("--abort", action="store_true", help="abort the running sweep (its settings are put back)")
    tune.add_argument("--last", action="store_true", help="print the last sweep's table again")
    tune.add_argument("--json", action="store_true", help="machine-readable output")
    tune.set_defaults(func=lambda args: cmd_tune(args, socket_path), kind=None)
    kinds = tune.add_subparsers(dest="kind", metavar="KIND")
    for kind, unit, help_text in (
        ("power", "W", "sweep the power limit (nvidia-smi -pl)"),
        ("clocks", "MHz", "sweep locked graphics clocks (nvidia-smi -lgc N,N)"),
    ):
        p = kinds.add_parser(kind, help=help_text, description=description)
        # Given here or before KIND: a default here would overwrite the one parsed before it.
        p.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help="config file (as for tune)")
        p.add_argument("--service", required=True, metavar="NAME", help="the configured service to measure")
        p.add_argument("--from", dest="start", type=_positive, metavar=unit, help=f"first setting ({unit})")
        p.add_argument("--to", dest="stop", type=_positive, metavar=unit, help=f"last setting ({unit})")
        p.add_argument("--step", type=_positive, metavar=unit, help=f"distance between settings ({unit})")
        p.add_argument("--dwell", type=_positive, metavar="SECONDS", help="how long each setting is measured")
        p.add_argument("--gpus", type=_gpu_list, help="only these of the service's GPUs (default: all of them)")
        p.add_argument(
            "--tolerance",
            type=_tolerance,
            metavar="RATIO",
            default=DEFAULT_THROUGHPUT_TOLERANCE,
            help="tokens/s the recommendation may give up against the best seen"
            f" (default {DEFAULT_THROUGHPUT_TOLERANCE})",
        )
        p.add_argument(
            "--min-request-rate",
            type=_positive,
            metavar="PER_SECOND",
            default=DEFAULT_MIN_REQUEST_RATE,
            help=f"requests/s below which traffic is too thin (default {DEFAULT_MIN_REQUEST_RATE:g})",
        )
        p.add_argument(
            "--max-traffic-change",
            type=_positive,
            metavar="RATIO",
            default=DEFAULT_MAX_TRAFFIC_CHANGE,
            help=f"how far the offered load may move between steps (default {DEFAULT_MAX_TRAFFIC_CHANGE})",
        )
        p.add_argument(
            "--settle",
            type=_positive,
            default=DEFAULT_SETTLE_SECONDS,
            metavar="SECONDS",
            help=f"at most this long for the clocks to settle after a change (default {DEFAULT_SETTLE_SECONDS:g})",
        )
        p.add_argument(
            "--force",
            action="store_true",
            help="sweep even a service whose GPUs are not healthy or whose server is strained (KV cache"
            " near full, queue growing): its figures then measure that too",
        )
        if kind == "power":
            p.add_argument(
                "--passive",
                action="store_true",
                help="no changes: what the node's history says about the limits it has run at, per traffic band",
            )
        p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
        p.set_defaults(func=lambda args: cmd_tune(args, socket_path))
    for name, help_text in (
        ("apply", "put the last recommendation in force: a drop-in beside agent.yaml, then a reload"),
        ("undo", "take the drop-in `tune apply` wrote away, then a reload"),
    ):
        description = f"{help_text[0].upper()}{help_text[1:]}. Exit codes: 0 done, 1 refused."
        p = kinds.add_parser(name, help=help_text, description=description)
        p.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help="config file (as for tune)")
        p.set_defaults(func=lambda args: cmd_tune_dropin(args, socket_path, config_path))


def cmd_tune_dropin(args: argparse.Namespace, socket_path: SocketPath, config_path: ConfigPath) -> int:
    from agent.tune.apply import cmd_apply_or_undo

    return cmd_apply_or_undo(socket_path(args), config_path(args), undoing=args.kind == "undo")


def _call(socket: str, method: str, params: dict[str, Any] | None = None) -> Any:
    from agent import api

    return api.call(socket, method, params or {}, timeout_seconds=10.0)


def cmd_tune(args: argparse.Namespace, socket_path: SocketPath) -> int:
    from agent.api import ApiError

    socket = socket_path(args)
    try:
        if args.abort:
            answer = _call(socket, "tune_abort")
            print(f"tune {answer['id']}: aborting; the daemon puts the original settings back", file=sys.stderr)
            return EXIT_OK
        if args.kind is None:
            return _print_last(socket, args.json)
        if getattr(args, "passive", False):
            return _passive(socket, args)
        missing = [
            flag
            for flag, value in (
                ("--from", args.start),
                ("--to", args.stop),
                ("--step", args.step),
                ("--dwell", args.dwell),
            )
            if value is None
        ]
        if missing:
            print(f"gpu-agent tune {args.kind}: needs {', '.join(missing)} (or --passive)", file=sys.stderr)
            return EXIT_ERROR
        params = {
            "kind": args.kind,
            "service": args.service,
            "start": args.start,
            "stop": args.stop,
            "step": args.step,
            "dwell_seconds": args.dwell,
            "gpus": args.gpus,
            "throughput_tolerance": args.tolerance,
            "min_request_rate": args.min_request_rate,
            "max_traffic_change": args.max_traffic_change,
            "settle_seconds": args.settle,
            "force": args.force,
        }
        started = _call(socket, "tune_start", params)
        document = _follow(socket, int(started["id"]))
    except ApiError as exc:
        print(f"gpu-agent tune: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except PermissionError:
        from agent.api import denied_reason

        print(f"gpu-agent tune: {denied_reason(socket)}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(
            f"gpu-agent tune: no daemon answers on {socket} ({exc}); the sweep runs inside the daemon", file=sys.stderr
        )
        return EXIT_ERROR
    return _report(document, args.json)


def _follow(socket: str, tune_id: int) -> dict[str, Any]:
    """Poll the sweep until it ends, showing progress; Ctrl-C aborts it and waits for the restore."""
    aborting = False
    shown = ""
    while True:
        try:
            document: dict[str, Any] = _call(socket, "tune_status", {"id": tune_id})
            if document.get("state") != "running":
                if shown and sys.stderr.isatty():
                    print(file=sys.stderr)
                return document
            line = _progress_line(document)
            if line != shown:
                if sys.stderr.isatty():
                    print("\r" + line.ljust(len(shown)), end="", file=sys.stderr, flush=True)
                else:
                    print(line, file=sys.stderr, flush=True)
                shown = line
            time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            if aborting:
                raise
            aborting = True
            print(
                "\naborting: the daemon puts the original settings back (Ctrl-C again leaves it to finish)",
                file=sys.stderr,
            )
            _call(socket, "tune_abort", {"reason": "aborted with Ctrl-C on the CLI"})


def _progress_line(document: dict[str, Any]) -> str:
    progress = document.get("progress") or {}
    if not progress:
        return f"tune {document['id']}: starting"
    unit = KNOB_UNITS[document["request"]["kind"]]
    return (
        f"tune {document['id']}: step {progress['step']} of {progress['steps']}:"
        f" {progress['setting']:g} {unit}, {progress['doing']}, about {progress['seconds_left']:.0f} s left"
    )


def _print_last(socket: str, as_json: bool) -> int:
    document = _call(socket, "tune_status")
    if document is None:
        print("gpu-agent tune: no sweep has run on this node", file=sys.stderr)
        return EXIT_ERROR
    return _report(document, as_json)


def _report(document: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        from agent.tune.model import TuneDocument

        print(render(TuneDocument.from_json(document)))
    if document.get("state") in ("failed", "aborted", "interrupted", "running"):
        return EXIT_ERROR
    return EXIT_OK if document.get("recommendation") else EXIT_NO_RECOMMENDATION


def _passive(socket: str, args: argparse.Namespace) -> int:
    from agent.tune.passive import render_passive

    report = _call(socket, "tune_passive", {"service": args.service})
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else render_passive(report))
    return EXIT_OK if report.get("comparable") else EXIT_NO_RECOMMENDATION


# -- text ------------------------------------------------------------------------------------------


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def _change(ratio: float | None) -> str:
    return "?" if ratio is None else f"{ratio * 100:+.1f} %"


def _objective(document: TuneDocument, name: str, label: str) -> str:
    limit = document.slo.get(name)
    return f"{label} (SLO {limit:g} s)" if limit else f"{label} (no SLO)"


def _against(value: float | None, limit: float | None) -> str:
    """A p95 beside its objective: `0.912 s ok`, `1.920 s OVER`."""
    if value is None:
        return "-"
    return f"{value:.3f} s" + ("" if limit is None else " ok" if value <= limit else " OVER")


def render(document: TuneDocument) -> str:
    """The table of the issue, then the recommendation and how the sweep ended."""
    request = document.request
    unit = KNOB_UNITS[request.kind]
    knob = "limit" if request.kind == "power" else "locked clock"
    gpus = ",".join(map(str, document.gpus))
    measured = ",".join(map(str, document.measured_gpus))
    lines = [
        f"tune {document.id}: {request.kind} sweep of service {request.service} on GPU {gpus}"
        + (f" (measured on its GPUs {measured})" if measured != gpus else "")
        + ","
        f" {request.start:g} -> {request.stop:g} {unit} by {request.step:g}, {request.dwell_seconds:g} s per step"
    ]
    header = (
        knob,
        "W per swept GPU",
        f"W total ({len(document.measured_gpus)} GPU{'s' if len(document.measured_gpus) != 1 else ''})",
        "SM MHz",
        "tokens/s",
        "tokens/J",
        _objective(document, "e2e_p95", "p95 e2e"),
        _objective(document, "ttft_p95", "p95 TTFT"),
        "max temp",
        "throttle reasons",
    )
    rows = [header]
    for step in document.steps:
        setting = f"{step.setting:g} {unit}" + (" (current)" if step.baseline else "")
        rows.append(
            (
                setting,
                _fmt(document.swept_power_watts(step), ".0f"),
                f"{step.mean_power_watts:.0f}",
                f"{step.mean_sm_mhz:.0f}",
                _fmt(step.tokens_per_second, ".1f"),
                _fmt(step.tokens_per_joule, ".3f"),
                _against(step.e2e_p95_seconds, document.slo.get("e2e_p95")),
                _against(step.ttft_p95_seconds, document.slo.get("ttft_p95")),
                "-" if step.max_temperature_celsius is None else f"{step.max_temperature_celsius} C",
                ", ".join(step.throttle_reasons) or "none",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for number, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    if not document.steps:
        lines.append("(no step measured)")
    recommendation = document.recommendation
    if recommendation is not None:
        lines += ["", *_recommendation_lines(recommendation)]
    lines += ["", f"{document.state}: {document.detail}" if document.detail else document.state]
    return "\n".join(lines)


def _recommendation_lines(recommendation: Recommendation) -> list[str]:
    e2e = recommendation.e2e_p95_change_seconds
    clock = recommendation.sm_clock_change_ratio
    lines = [
        f"recommended: {recommendation.reason}",
        f"expected against the current setting: tokens/J {_change(recommendation.tokens_per_joule_change_ratio)},"
        f" tokens/s {_change(recommendation.tokens_per_second_change_ratio)},"
        f" p95 e2e {'?' if e2e is None else f'{e2e:+.3f} s'}"
        + ("" if clock is None else f", SM clock {_change(clock)}")
        + (" (the headroom for a load peak given up)" if clock is not None and clock < -0.05 else ""),
    ]
    lines += [f"note: {text}" for text in (recommendation.edge, recommendation.tradeoff) if text]
    if recommendation.targets:
        lines.append(
            f"gpu-agent tune apply puts it in force for {recommendation.targets} (gpu-agent tune undo takes it back)"
        )
    lines.append("or make it agent.yaml's own, written against the profile in force:")
    return lines + ["  " + line for line in recommendation.snippet.splitlines()]
