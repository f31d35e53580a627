"""gpu-agent command line. Read commands take --json; every command takes --config."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from agent.defaults import DEFAULT_CONFIG_PATH, DEFAULT_SOCKET_PATH

if TYPE_CHECKING:  # the heavy modules (pydantic models, the policy engine) load only for commands that use them
    from agent.backend.base import GpuIdentity
    from agent.config import AgentConfig
    from agent.policy.engine import PolicyEngine
    from agent.rules.config import Rule
    from agent.store.database import Store

EXIT_OK = 0
EXIT_ERROR = 1


class CliError(Exception):
    """A failure worth one clear line on stderr and exit 1, never a traceback."""


def _config_path(args: argparse.Namespace) -> tuple[Path | None, bool]:
    """(path, explicit). Without --config or $GPU_AGENT_CONFIG, the default file if it exists."""
    given = args.config or os.environ.get("GPU_AGENT_CONFIG")
    if given:
        return Path(given), True
    default = Path(DEFAULT_CONFIG_PATH)
    return (default, False) if default.exists() else (None, False)


def load(args: argparse.Namespace) -> AgentConfig:
    from agent.backend import load_checked_config
    from agent.config import AgentConfig

    path, _ = _config_path(args)
    if path is None:
        print(f"note: {DEFAULT_CONFIG_PATH} not found; using built-in defaults (observe mode, nvml)", file=sys.stderr)
        return AgentConfig()
    return load_checked_config(path)


def make_engine(config: AgentConfig) -> PolicyEngine:
    from agent.backend import open_backend
    from agent.host.paths import HostPaths
    from agent.policy.base import HostContext
    from agent.policy.engine import PolicyEngine

    backend = open_backend(config)
    return PolicyEngine(config, backend, HostContext(HostPaths.at(config.host_root)))


def _print(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


# -- commands ------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from agent.daemon import Daemon
    from agent.logs import configure_logging

    configure_logging(args.log_level, args.log_format)
    from agent.trust import state_directory_problem

    path, _ = _config_path(args)
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
        return Daemon(config, path).run()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise CliError(
            f"metrics.listen {config.metrics.listen} is already in use (another gpu-agent run? `gpu-agent status` "
            "says): stop that one, or give this one another metrics.listen"
        ) from None


def cmd_check_config(args: argparse.Namespace) -> int:
    from agent.backend import load_checked_config
    from agent.rules.config import load_rules
    from agent.rules.sources import describe, resolve_rules

    path, _ = _config_path(args)
    if path is None:
        raise CliError(f"no config: {DEFAULT_CONFIG_PATH} does not exist (give --config PATH)")
    config = load_checked_config(path)
    resolved = resolve_rules(Path(d) for d in (args.rules or config.remediation.rules_dirs))
    _check_rules_dirs_exist(path, resolved.missing_dirs, from_config=not args.rules)
    rules = load_rules(resolved.paths, allow_reboot=config.remediation.allow_reboot)
    _check_hooks(rules)
    _check_drain_hooks(config, str(path))
    _print(
        f"{path}: ok ({config.mode.value} mode, {config.backend} backend, {len(config.policy.gpus)} GPU profiles, "
        f"{len(config.services)} services); {len(rules)} rules from {len(resolved.files)} files:"
    )
    for line in describe(resolved):
        _print(line)
    warnings = resolved.warnings()
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return EXIT_ERROR if warnings and args.strict else EXIT_OK


def _check_rules_dirs_exist(path: Path, missing: Sequence[Path], *, from_config: bool) -> None:
    """A rules directory named that does not exist is a typo the daemon would run with, without its
    rules: an error. Only the default directory for the admin's overrides may be absent."""
    from agent.config import parse_yaml, read_trusted_text
    from agent.config_errors import ConfigError, ConfigProblem
    from agent.defaults import DEFAULT_RULES_DIR

    wrong = [d for d in missing if str(d) != DEFAULT_RULES_DIR]
    if not wrong:
        return
    lines = parse_yaml(read_trusted_text(path), str(path))[1] if from_config else {}
    problems = []
    for directory in wrong:
        line = lines.get(("remediation", "rules_dirs")) or lines.get(("remediation", "rules_dir"))
        where = "remediation.rules_dirs" if from_config else "--rules"
        message = f"{directory}: no such directory (a typo? the daemon would run without these rules)"
        problems.append(ConfigProblem(str(path), line, where, message))
    raise ConfigError(problems)


def _check_hooks(rules: Sequence[Rule]) -> None:
    """The hooks the rules would run, checked now rather than refused at 3 a.m. when a fault needs them."""
    from agent.config_errors import ConfigError, ConfigProblem
    from agent.rules.model import ActionKind
    from agent.trust import executable_problem

    problems: list[ConfigProblem] = []
    for rule in rules:
        file, _, line = rule.source.rpartition(":")
        for ladder in ("actions", "on_exhausted"):
            for position, step in enumerate(getattr(rule, ladder)):
                if step.kind is not ActionKind.RUN_HOOK:
                    continue
                problem = executable_problem(str(step.spec().params["argv"][0]))
                if problem is not None:
                    where = f"rule {rule.name}: {ladder}[{position}].run_hook.argv[0]"
                    problems.append(ConfigProblem(file, int(line) if line.isdigit() else None, where, problem))
    if problems:
        raise ConfigError(problems)


def _check_drain_hooks(config: AgentConfig, file: str) -> None:
    """The services' drain hooks, checked as the rules' hooks are: refused now, not mid-restart."""
    from agent.config_errors import ConfigError, ConfigProblem
    from agent.trust import executable_problem

    problems: list[ConfigProblem] = []
    for position, service in enumerate(config.services):
        if service.drain is not None:
            problem = executable_problem(service.drain.hook[0])
            if problem is not None:
                problems.append(ConfigProblem(file, None, f"services[{position}].drain.hook[0]", problem))
    if problems:
        raise ConfigError(problems)


def cmd_plan(args: argparse.Namespace) -> int:
    from agent import documents, render, textview

    engine = make_engine(load(args))
    try:
        plan = engine.plan()
    finally:
        engine.backend.shutdown()
    _print(textview.dumps(documents.plan_json(plan)) if args.json else render.plan_text(plan))
    return plan.exit_code


def cmd_apply(args: argparse.Namespace) -> int:
    from agent import documents, render, textview
    from agent.policy.base import ApplyOutcome, PlanStatus

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
        _print(textview.dumps(documents.apply_json(report)))
    else:
        _print(render.results_text(report.results))
        skipped = [r for r in report.results if r.outcome is ApplyOutcome.SKIPPED and r.plan.status is PlanStatus.DRIFT]
        if skipped and not args.dry_run:
            _print(f"\n{len(skipped)} drifting item(s) left unchanged: observe mode (set `mode: enforce` to apply)")
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
    from agent.policy import fan_curve
    from agent.policy.base import ApplyOutcome
    from agent.policy.names import FAN_CURVE

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
    from agent.policy.base import ApplyOutcome
    from agent.policy.registry import RESTORABLE_NAMES

    try:
        config = load(args)
    except (ConfigError, RecursionError, MemoryError, UnicodeDecodeError) as exc:
        config, source = known_good.fallback_config(_config_path(args)[0])
        reason = "; ".join(str(p) for p in exc.problems) if isinstance(exc, ConfigError) else type(exc).__name__
        print(f"note: the config is not valid ({reason[:300]}); restoring with {source}", file=sys.stderr)
    else:
        # The daemon may have changed items this config no longer lets it change (kill -9, then an edit).
        items = (config.writable_items() & RESTORABLE_NAMES) | known_good.recorded_items(config.state_dir)
        if not items:
            note = "observe mode: gpu-agent changed nothing, so there is nothing to restore"
            _print(textview.dumps({"results": [], "note": note}) if args.json else note)
            return EXIT_OK
        config = known_good.restore_config(config, items)
    engine = make_engine(config)
    try:
        results = engine.restore()
    finally:
        engine.backend.shutdown()
    if args.json:
        _print(textview.dumps({"results": [documents.result_json(r, "enforce") for r in results]}))
    else:
        _print(render.results_text(results))
    return EXIT_ERROR if any(r.outcome is ApplyOutcome.FAILED for r in results) else EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from agent import api, textview

    document = None
    if not args.direct:
        # Against a running daemon only `api.socket` is read from the config (no validation, no
        # pydantic): the daemon already validated it, and the answer comes back in a fraction of the time.
        socket_path = _socket_path(args)
        try:
            document = api.call(socket_path, "status")
        except (OSError, ValueError):
            document = None  # no daemon (or not ours): read directly
        except api.ApiError as exc:
            raise CliError(f"daemon at {socket_path}: {exc}") from None
    if document is None or document.get("starting"):
        from agent.logs import configure_cli_logging

        configure_cli_logging()  # a direct read imports what logs; its lines must not reach stdout
        config = load(args)
        if args.direct:
            note = "direct read (--direct)"
        elif document is None:
            note = f"direct read: no daemon answered on {config.api.socket}"
        else:
            note = f"direct read: the daemon on {config.api.socket} is still starting"
        document = direct_status(config, note)
    if args.json:
        _print(textview.dumps(document))
    else:
        colour = textview.use_colour(sys.stdout)
        _print(textview.status_text(document, width=textview.screen_width(sys.stdout), colour=colour))
    return textview.status_exit_code(document)


def _socket_path(args: argparse.Namespace) -> str:
    from agent.defaults import MAX_YAML_BYTES
    from agent.trust import TooLargeError, UntrustedError, read_trusted

    path, _ = _config_path(args)
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
    from agent.backend.errors import GpuError
    from agent.collect import sample_all
    from agent.host.paths import HostPaths
    from agent.services.watch import read_once
    from agent.snapshot import DaemonParts, NodeWatchers, build_snapshot
    from agent.store.db import StoreError
    from agent.store.node_memory import read_boot_id, read_remembered

    now = time.time()
    try:
        engine = make_engine(config)
    except GpuError as exc:
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
    try:
        remembered = read_remembered(config.state_dir, read_boot_id(HostPaths.at(config.host_root)))
    except StoreError as exc:
        remembered = None
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


def cmd_xid_explain(args: argparse.Namespace) -> int:
    from agent import textview
    from agent.watch import xid_catalog

    if args.json:
        _print(textview.dumps(xid_catalog.explain(args.code)))
    else:
        _print(xid_catalog.explain_text(args.code))
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
            _print(json.dumps(record))
    return EXIT_OK


def _identities_if_available(args: argparse.Namespace) -> dict[int, GpuIdentity]:
    """This host's GPUs, to map bus ids to GPUs, when a config and a backend are at hand; else {}."""
    from agent.backend import load_checked_config, open_backend
    from agent.backend.errors import GpuError
    from agent.config_errors import ConfigError

    path, _ = _config_path(args)
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


def positive_int(text: str) -> int:
    """A count of 1 or more (SQLite reads a negative LIMIT as no limit at all)."""
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, 1 or more")
    return int(text)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration_seconds(text: str) -> float:
    """'90s', '30m', '1h', '7d' -> seconds."""
    number, unit = text[:-1], text[-1:]
    if unit not in _DURATION_UNITS or not number.replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a duration like 90s, 30m, 1h or 7d")
    return float(number) * _DURATION_UNITS[unit]


def _open_store(config: AgentConfig) -> Store:
    from agent.store.database import Store, StoreError

    try:
        return Store.open(config.state_dir)
    except StoreError as exc:
        raise CliError(str(exc)) from None


def cmd_events(args: argparse.Namespace) -> int:
    import json
    import time

    from agent import documents, render, textview

    config = load(args)
    since = time.time() - args.since
    with _open_store(config) as store:
        events = store.events(since_seconds=since, limit=args.limit)
        remediations = store.remediations(since_seconds=since, limit=args.limit)
    if args.json:
        document = {
            "events": [{**documents.event_json(e.event), "key": e.event.key, "handled": e.handled} for e in events],
            "remediations": [documents.remediation_json(r) for r in remediations],
        }
        _print(json.dumps({"schema": textview.JSON_SCHEMA_VERSION, **document}, indent=2, default=str))
        return EXIT_OK
    _print(render.history_text(events, remediations))
    return EXIT_OK


def cmd_ack(args: argparse.Namespace) -> int:
    from agent.host.paths import HostPaths
    from agent.store.node_memory import read_boot_id

    config = load(args)
    xid_marks = _xid_selector(args.selector)
    with _open_store(config) as store:
        count = store.ack(args.selector)
        gone = store.acknowledge_gone(args.selector)
        cleared = (
            store.clear_xid_marks(read_boot_id(HostPaths.at(config.host_root)), *xid_marks)
            if xid_marks is not None
            else []
        )
    for gpu in sorted({mark.gpu for mark in cleared}):
        codes = ", ".join(str(mark.xid) for mark in cleared if mark.gpu == gpu)
        _print(
            f"{args.selector}: Xid {codes} on GPU {gpu} marked dealt with: no longer in the verdict"
            " (the counts stay in status and /metrics)"
        )
    if count:
        _print(f"{args.selector}: {count} rule/target pair(s) re-armed: their attempts start afresh, circuits closed")
    for uuid in gone:
        _print(f"{uuid}: missing GPU acknowledged gone; no longer expected (until it answers again)")
    if count or gone or cleared:
        return EXIT_OK
    if args.selector == "all":
        _print("all: nothing to acknowledge (no Xid in the verdict, no rule's attempts ran out, no GPU missing)")
        return EXIT_OK
    # Most often a typo: exit 1, so a script that acknowledges something learns it did not.
    raise CliError(
        f"{args.selector}: nothing to acknowledge: no Xid in the verdict, no rule whose attempts ran out and no"
        " missing GPU matches (a rule name, gpu:INDEX, gpu:UUID, xid:CODE@GPU, service:NAME or all;"
        " `gpu-agent events` lists the rules)"
    )


def _xid_selector(selector: str) -> tuple[int | str | None, int | None] | None:
    """(GPU, Xid) of the Xid marks an ack selector clears: `all` every one, `gpu:N`/`gpu:UUID`/`GPU-...`
    a GPU's, `xid:CODE@GPU` one Xid on one GPU (GPU: index or UUID); None for rule and service selectors."""
    if selector == "all":
        return None, None
    if selector.startswith("GPU-"):
        return selector, None
    kind, sep, value = selector.partition(":")
    if sep and kind == "gpu" and value:
        return (int(value), None) if value.isdecimal() else (value, None)
    code, at, gpu = value.partition("@")
    if sep and kind == "xid" and at and code.isdecimal() and gpu:
        return (int(gpu) if gpu.isdecimal() else gpu), int(code)
    return None


def cmd_inject(args: argparse.Namespace) -> int:
    from agent.demo.inject import InjectError, inject

    try:
        _print(inject(load(args), args))
    except (InjectError, ValueError) as exc:
        raise CliError(str(exc)) from None
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from agent.demo.scenario import run_demo

    return run_demo(Path(args.dir) if args.dir else None, keep_running=not args.exit_after_scenario)


# -- parser --------------------------------------------------------------------------------------


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


def _print_version() -> None:
    from agent.version import current

    info = current()
    sys.stdout.write(f"gpu-agent {info.version}\nrevision {info.revision}\n")


class _VersionAction(argparse.Action):
    """--version, reading the version only when asked (in a git checkout it runs git)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
        _print_version()
        parser.exit()


class _CompleteValuesAction(argparse.Action):
    """--complete-values KIND (hidden): the values shell completion offers, one a line
    (agent/completion.py, dynamic_values)."""

    def __call__(self, parser: argparse.ArgumentParser, _namespace: object, values: object, *_args: object) -> None:
        from agent.completion import dynamic_values

        for value in dynamic_values(str(values)):
            sys.stdout.write(value + "\n")
        parser.exit()


COMPLETION_KINDS = ("ack-targets", "gpus")  # agent/completion.py, DYNAMIC_KINDS


def build_parser(*, fault_parsers: bool = True) -> argparse.ArgumentParser:
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
        "--complete-values", action=_CompleteValuesAction, choices=COMPLETION_KINDS, help=argparse.SUPPRESS
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
    p.set_defaults(func=cmd_run)
    p = sub.add_parser(
        "plan",
        parents=[common, as_json],
        help="desired vs actual per item and GPU; changes nothing",
        description="Exit codes: 0 in sync, 2 drift (or reboot pending), 1 error.",
    )
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser(
        "apply",
        parents=[common, as_json],
        help="enforce the policy once (enforce-mode items only)",
        description="Exit codes: 0 ok, 1 error or drift left unapplied.",
    )
    p.add_argument("--dry-run", action="store_true", help="show what would change, change nothing")
    p.set_defaults(func=cmd_apply)
    p = sub.add_parser(
        "restore", parents=[common, as_json], help="fans to automatic, locked clocks reset, default power limit"
    )
    p.set_defaults(func=cmd_restore)
    p = sub.add_parser(
        "status", parents=[common, as_json], help="live view from the daemon; a direct read when none runs"
    )
    p.add_argument("--direct", action="store_true", help="read the GPUs directly even if a daemon runs")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("events", parents=[common, as_json], help="event and remediation history from the store")
    p.add_argument(
        "--since",
        type=parse_duration_seconds,
        default=parse_duration_seconds("1h"),
        metavar="DURATION",
        help="how far back: 90s, 30m, 1h (default), 7d",
    )
    p.add_argument("--limit", type=positive_int, default=200, help="at most this many of each (default 200)")
    p.set_defaults(func=cmd_events)
    p = sub.add_parser(
        "ack",
        parents=[common],
        help="mark Xids dealt with, re-arm rules whose attempts ran out, forget a missing GPU",
        description="SELECTOR: a rule name, gpu:INDEX, gpu:UUID, xid:CODE@GPU (GPU: index or UUID), "
        "service:NAME, or all. A GPU or Xid selector (or all) marks the GPU's Xids (or that one) dealt with: "
        "they leave the verdict, their counts stay. A GPU selector (or all) also re-arms the rules acting on it "
        "and acknowledges a missing GPU as gone: it leaves status and /metrics until it answers again. "
        "Exit codes: 0 something acknowledged (or `all` with nothing to do), 1 nothing matched (a typo?).",
    )
    p.add_argument("selector")
    p.set_defaults(func=cmd_ack)
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
    p.set_defaults(func=cmd_check_config)

    xid = sub.add_parser("xid", help="the Xid catalog and the kernel-log parser")
    xid_sub = xid.add_subparsers(dest="xid_command", required=True, metavar="SUBCOMMAND")
    p = xid_sub.add_parser("explain", parents=[as_json], help="what an Xid means and what to do")
    p.add_argument("code", type=int)
    p.set_defaults(func=cmd_xid_explain)
    p = xid_sub.add_parser(
        "parse",
        parents=[common],
        help="kernel-log lines on stdin -> one JSON object per Xid (gpu/uuid filled in when --config names this node)",
    )
    p.set_defaults(func=cmd_xid_parse)

    from agent.tune.cli import add_parsers as add_tune_parsers

    if fault_parsers:
        from agent.demo.inject import add_parsers

        add_parsers(cast("argparse._SubParsersAction[argparse.ArgumentParser]", sub), common)
    else:
        sub.add_parser("inject", help=INJECT_HELP)
    sub.choices["inject"].set_defaults(func=cmd_inject)
    add_tune_parsers(sub, common, _socket_path)
    p = sub.add_parser(
        "demo", help="the daemon on a simulated node with a fault scenario (changes nothing on this machine)"
    )
    p.add_argument("--dir", metavar="DIR", help="scratch directory for the simulated node (default: a new temp dir)")
    p.add_argument("--exit-after-scenario", action="store_true", help="stop the agent when the scenario is done")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments == ["--version"]:  # the answer needs no parser
        _print_version()
        return EXIT_OK
    # Options before the command are only --help and --version: the first word is the command.
    command = next((word for word in arguments if not word.startswith("-")), None)
    args = build_parser(fault_parsers=command == "inject").parse_args(arguments)
    if args.command not in ("run", "status"):  # run configures its own; status stays lean (no store)
        from agent.logs import configure_cli_logging

        configure_cli_logging()
    try:
        code: int = args.func(args)
    except CliError as exc:
        print(f"gpu-agent: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:
        return _failure(exc)
    return code


def _failure(exc: Exception) -> int:
    """A config or GPU error as its lines on stderr and exit 1; anything else is a bug, raised again.
    (The error types are imported here: `status` and `--version` start without them.)"""
    from agent.backend.errors import NO_DRIVER_KINDS, GpuError
    from agent.config_errors import ConfigError

    if isinstance(exc, ConfigError):
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_ERROR
    if isinstance(exc, GpuError):
        print(f"gpu-agent: {exc.args[0] if exc.kind in NO_DRIVER_KINDS else exc}", file=sys.stderr)
        return EXIT_ERROR
    raise exc


if __name__ == "__main__":
    sys.exit(main())
