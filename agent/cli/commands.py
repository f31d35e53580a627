"""The commands other than `status` and `check-config`: the daemon (`run`), the policy once (`plan`,
`apply`, `restore`), the store's history and acknowledgements (`events`, `ack`), the Xid tools
(`xid explain`, `xid parse`) and the simulated node (`inject`, `demo`)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from agent.cli.common import EXIT_ERROR, EXIT_OK, CliError, config_path, load, make_engine, open_store, print_text

if TYPE_CHECKING:
    from agent.backend.base import GpuIdentity
    from agent.config import AgentConfig
    from agent.policy.engine import PolicyEngine
    from agent.store.selector import AckResult, AckSelector


def cmd_run(args: argparse.Namespace) -> int:
    from agent.daemon import Daemon
    from agent.daemon.socket_record import config_file_identity
    from agent.logs.destinations import configure_logging

    configure_logging(args.log_level, args.log_format)
    from agent.trust import state_directory_problem

    path, _ = config_path(args)
    identity = config_file_identity(path)  # before the read: an edit after it shows as one in `status`
    config = load(args)
    # What the daemon reads back from these (its verdicts, journal, flags) and who may talk to it.
    for directory, what in (
        (config.state_dir, "state_dir"),
        (Path(config.api.socket).parent, "api.socket's directory"),
    ):
        problem = state_directory_problem(directory, what)
        if problem is not None:
            raise CliError(f"refusing to start: {problem}")
    try:
        return Daemon(config, None if path is None else Path(path), config_identity=identity).run()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise CliError(
            f"metrics.listen {config.metrics.listen} is already in use (another gpu-agent run? `gpu-agent status` "
            "says): stop that one, or give this one another metrics.listen"
        ) from None


def cmd_plan(args: argparse.Namespace) -> int:
    from agent import documents, render, textview

    engine = make_engine(load(args))
    try:
        plan = engine.plan()
    finally:
        engine.backend.shutdown()
    print_text(textview.dumps(documents.plan_json(plan)) if args.json else render.plan_text(plan))
    return plan.exit_code


def cmd_apply(args: argparse.Namespace) -> int:
    from agent import documents, render, textview
    from agent.policy.plan import ApplyOutcome, PlanStatus

    config = load(args)
    engine = make_engine(config)
    handed_back: list[str] = []
    try:
        report = engine.apply(dry_run=args.dry_run)
        if not args.dry_run:
            handed_back = _hand_back_fans_without_daemon(config, engine)
    finally:
        engine.backend.shutdown()
    if args.json:
        print_text(textview.dumps(documents.apply_json(report)))
    else:
        print_text(render.results_text(report.results))
        skipped = [r for r in report.results if r.outcome is ApplyOutcome.SKIPPED and r.plan.status is PlanStatus.DRIFT]
        if skipped and not args.dry_run:
            print_text(f"\n{len(skipped)} drifting item(s) left unchanged: observe mode (set `mode: enforce` to apply)")
    if handed_back:
        print(
            f"note: no gpu-agent daemon answers on {config.api.socket} to follow the fan curve, so the fans"
            f" went back to automatic control ({'; '.join(handed_back)})",
            file=sys.stderr,
        )
    return report.exit_code


def _hand_back_fans_without_daemon(config: AgentConfig, engine: PolicyEngine) -> list[str]:
    """A one-shot apply sets fans to the curve's speed of this moment; only a daemon re-evaluates the
    curve as the GPU heats up. Without one answering on the socket (it runs this same config), fans
    go back to automatic control instead of staying at a fixed speed. What was done, per GPU."""
    from agent import api
    from agent.names.policy_items import FAN_CURVE
    from agent.policy import fan_curve
    from agent.policy.plan import ApplyOutcome

    if FAN_CURVE not in config.writable_items():
        return []
    try:
        api.call(config.api.socket, "ping", timeout_seconds=2.0)
    except (OSError, ValueError, api.ApiError):
        pass  # nobody answers: nothing follows the curve
    else:
        return []
    done: list[str] = []
    for gpu, ctx in sorted(engine.state.contexts.items()):
        result = fan_curve.restore(ctx)
        if result.outcome in (ApplyOutcome.APPLIED, ApplyOutcome.FAILED):
            done.append(f"GPU {gpu}: {result.detail}")
    return done


def cmd_restore(args: argparse.Namespace) -> int:
    """What ExecStopPost runs after every stop: hands back what the agent may have changed. A config
    that no longer validates does not stop it: it then restores fans and locked clocks on every GPU
    through the backend the daemon last ran with (agent.policy.known_good), or NVML."""
    from agent import documents, render, textview
    from agent.config_errors import ConfigError
    from agent.policy import known_good
    from agent.policy.plan import ApplyOutcome
    from agent.policy.registry import RESTORABLE_NAMES

    try:
        config = load(args)
    except (ConfigError, RecursionError, MemoryError, UnicodeDecodeError) as exc:
        given = config_path(args)[0]
        config, source = known_good.fallback_config(None if given is None else Path(given))
        reason = "; ".join(str(p) for p in exc.problems) if isinstance(exc, ConfigError) else type(exc).__name__
        print(f"note: the config is not valid ({reason[:300]}); restoring with {source}", file=sys.stderr)
    else:
        # The daemon may have changed items this config no longer lets it change (kill -9, then an edit).
        items = (config.writable_items() & RESTORABLE_NAMES) | known_good.recorded_items(config.state_dir)
        if not items:
            note = "observe mode: gpu-agent changed nothing, so there is nothing to restore"
            print_text(textview.dumps({"results": [], "note": note}) if args.json else note)
            return EXIT_OK
        config = known_good.restore_config(config, items)
    engine = make_engine(config)
    try:
        results = engine.restore()
    finally:
        engine.backend.shutdown()
    if args.json:
        print_text(textview.dumps({"results": [documents.result_json(r, "enforce") for r in results]}))
    else:
        print_text(render.results_text(results))
    return EXIT_ERROR if any(r.outcome is ApplyOutcome.FAILED for r in results) else EXIT_OK


def cmd_events(args: argparse.Namespace) -> int:
    import json
    import time

    from agent import documents, render, textview

    config = load(args)
    since = time.time() - args.since
    with open_store(config) as store:
        events = store.events(since_seconds=since, limit=args.limit)
        remediations = store.remediations(since_seconds=since, limit=args.limit)
    if args.json:
        document = {
            "events": [{**documents.event_json(e.event), "key": e.event.key, "handled": e.handled} for e in events],
            "remediations": [documents.remediation_json(r) for r in remediations],
        }
        print_text(json.dumps({"schema": textview.JSON_SCHEMA_VERSION, **document}, indent=2, default=str))
        return EXIT_OK
    print_text(render.history_text(events, remediations))
    return EXIT_OK


def cmd_ack(args: argparse.Namespace) -> int:
    """Through the running daemon (its own store, whatever agent.yaml names now); in the store file
    named by the config only when no daemon answers on the socket."""
    from agent.store.selector import parse_ack_selector

    selector = parse_ack_selector(args.selector)  # checked by the parser already: it cannot raise here
    result = _ack_through_daemon(args)
    if result is None:
        result = _ack_in_store_file(args, selector)
    for gpu in sorted({gpu for gpu, _ in result.cleared}):
        codes = ", ".join(str(xid) for mark_gpu, xid in result.cleared if mark_gpu == gpu)
        print_text(
            f"{args.selector}: Xid {codes} on GPU {gpu} marked dealt with: no longer in the verdict"
            " (the counts stay in status and /metrics)"
        )
    if result.rearmed:
        print_text(
            f"{args.selector}: {result.rearmed} rule/target pair(s) re-armed: their attempts start afresh,"
            " circuits closed"
        )
    for uuid in result.gone:
        print_text(f"{uuid}: missing GPU acknowledged gone; no longer expected (until it answers again)")
    if result.reboot:
        print_text(f"{args.selector}: reboot recommendation withdrawn: no longer in the verdict or the alerts")
    if result.rearmed or result.gone or result.cleared or result.reboot:
        return EXIT_OK
    if selector.every:
        print_text(
            "all: nothing to acknowledge (no Xid in the verdict, no rule's attempts ran out, no GPU missing,"
            " no reboot recommended)"
        )
        return EXIT_OK
    # Most often a typo: exit 1, so a script that acknowledges something learns it did not.
    raise CliError(
        f"{args.selector}: nothing to acknowledge: no Xid in the verdict, no rule whose attempts ran out, no"
        " missing GPU and no reboot recommendation matches (a rule name, gpu:INDEX, gpu:UUID, xid:CODE@GPU,"
        " service:NAME, reboot or all; `gpu-agent events` lists the rules)"
    )


def _ack_through_daemon(args: argparse.Namespace) -> AckResult | None:
    """The daemon's answer; None when no daemon listens (no socket, or nobody behind it) or it is one
    from before the `ack` method."""
    from agent import api
    from agent.cli.status import socket_path_of
    from agent.store.selector import AckResult

    socket_path = socket_path_of(args)
    try:
        answer = api.call(socket_path, "ack", {"selector": args.selector})
    except PermissionError:
        raise CliError(api.denied_reason(socket_path)) from None
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except OSError as exc:  # it listens but does not answer: writing behind its back would not reach it
        raise CliError(f"the daemon on {socket_path} did not answer ({exc}); nothing acknowledged") from None
    except ValueError:
        raise CliError(f"{socket_path} answered, but not as gpu-agent does; nothing acknowledged") from None
    except api.ApiError as exc:
        if str(exc).startswith("unknown method"):
            return None  # a daemon from before `ack` went through it: it reads the store file
        raise CliError(f"daemon at {socket_path}: {exc}") from None
    try:
        return AckResult.from_json(answer)
    except ValueError:
        raise CliError(f"the daemon on {socket_path} answered `ack` in a form this gpu-agent does not know") from None


def _ack_in_store_file(args: argparse.Namespace, selector: AckSelector) -> AckResult:
    from agent.host.paths import HostPaths
    from agent.node_memory.inventory import read_boot_id

    config = load(args)
    with open_store(config) as store:
        return store.acknowledge(selector, read_boot_id(HostPaths.at(config.host_root)))


def cmd_inject(args: argparse.Namespace) -> int:
    from agent.demo.inject import InjectError, inject

    try:
        print_text(inject(load(args), args))
    except (InjectError, ValueError) as exc:
        raise CliError(str(exc)) from None
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from agent.demo.scenario import run_demo

    return run_demo(Path(args.dir) if args.dir else None, keep_running=not args.exit_after_scenario)


def cmd_xid_explain(args: argparse.Namespace) -> int:
    from agent import textview
    from agent.watch import xid_catalog

    if args.json:
        print_text(textview.dumps(xid_catalog.explain(args.code)))
    else:
        print_text(xid_catalog.explain_text(args.code))
    return EXIT_OK if xid_catalog.lookup(args.code) is not None else EXIT_ERROR


#: A kernel log record is under 1 KiB; `xid parse` keeps this much of a line and skips the rest,
#: so one endless line on stdin cannot take the memory.
XID_PARSE_MAX_LINE_BYTES = 64 * 1024


def bounded_lines(stream: BinaryIO, limit_bytes: int = XID_PARSE_MAX_LINE_BYTES) -> Iterator[str]:
    """Text lines of a byte stream, each cut at `limit_bytes`; bytes that are not UTF-8 read as U+FFFD."""
    while line := stream.readline(limit_bytes):
        if len(line) == limit_bytes and not line.endswith(b"\n"):
            while (rest := stream.readline(limit_bytes)) and not rest.endswith(b"\n"):
                pass
        yield line.decode("utf-8", "replace").rstrip("\n")


def cmd_xid_parse(args: argparse.Namespace) -> int:
    import json

    from agent import textview
    from agent.watch.kernel_log import KernelLogParser
    from agent.watch.xid import match_bus_id

    identities = _identities_if_available(args)
    parser = KernelLogParser()
    for line in bounded_lines(sys.stdin.buffer):
        for found in parser.feed(line):
            gpu, identity = match_bus_id(found.pci_bus_id, identities)
            record = {
                "schema": textview.JSON_SCHEMA_VERSION,
                "xid": found.xid,
                "pci_bus_id": found.pci_bus_id,
                "gpu": gpu,
                "uuid": identity.uuid if identity is not None else None,
                "pid": found.pid,
                "process": found.process,
                "text": found.text,
                "fallen_off_bus": found.fallen_off_bus,
                "recovery_action": found.recovery_action,
            }
            print_text(json.dumps(record))
    return EXIT_OK


def _identities_if_available(args: argparse.Namespace) -> dict[int, GpuIdentity]:
    """This host's GPUs, to map bus ids to GPUs, when a config and a backend are at hand; else {}."""
    from agent.backend import open_backend
    from agent.backend.errors import GpuError
    from agent.config_errors import ConfigError
    from agent.policy.dropins import load_checked_config

    path, _ = config_path(args)
    if path is None:
        return {}
    try:
        backend = open_backend(load_checked_config(path), writable_items=())
    except (ConfigError, GpuError):
        return {}
    try:
        found: dict[int, GpuIdentity] = {}
        for gpu in range(backend.device_count()):
            with contextlib.suppress(GpuError):
                found[gpu] = backend.identity(gpu)
        return found
    finally:
        backend.shutdown()
