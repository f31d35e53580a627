"""From a fault to the daemon acting on it: Xid (NVML event or kernel log) and a failed health probe.

A daemon runs on a simulated node (1 s interval, observe mode) with two benchmark rules that
answer every matching fault at once with a no-op hook (`run_hook: /bin/true`, no cooldown), so
what is timed is detection and decision, not the action's own work:

- Xid: the same writes `gpu-agent inject xid CODE --gpu N --source nvml|kmsg` makes, done
  in-process so the CLI's start-up is not counted; the (GPU, code) pairs rotate so the Xid
  watcher's 10 s de-duplication never folds two injections into one.
- service: a health endpoint served by this process turns from 200 to 503; the service is probed
  every 0.25 s and declared unhealthy after one failed probe, so the probe's own debounce
  (`unhealthy_after_probes` x `probe_interval_seconds` in a real config) is left out.

Milestones, read from the daemon's JSON log as they appear (its own timestamps; a 2 ms poll of
the file is the fallback) and from /metrics:

- event_visible: the Xid / service_unhealthy event is logged, in the same loop step that
  publishes it to the status API (`recent_events`);
- action_started: the daemon's `action started` line for the rule (the decision is queued for
  the action worker);
- action_finished: its `action finished` line (for the no-op hook: started + a fork/exec);
- remediations_metric: `gpu_agent_remediations_total{rule=R}` goes up (polled every 20 ms).

The first injection finds out which milestones this build produces; the headline figure is the
earliest action milestone present, else event_visible, and the document says which.

Usage: python3 -m bench.detection_latency [--injections 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from agent import api
from agent.backend.sim import SimulatedBackend
from agent.host.paths import HostPaths
from agent.watch.fake_kernel_log import append_kmsg, xid_line
from agent.watch.xid import DEFAULT_DEDUPE_WINDOW_SECONDS
from bench.common import (
    Node,
    Report,
    RunningDaemon,
    add_common_args,
    free_port,
    make_node,
    print_rows,
    scrape,
    scratch_dir,
    summarize,
    target,
    wait_until,
)

XID_RULE = "bench-xid"
SERVICE_RULE = "bench-service"
SERVICE = "bench-svc"
# App-level Xids: what an inference server's crash logs (none of them marks the GPU lost).
XID_CODES = (13, 31, 43, 45)
ACTION_MILESTONES = ("action_started", "remediations_metric", "action_finished")
LOG_POLL_SECONDS = 0.002
METRIC_POLL_SECONDS = 0.02


def bench_rules(hook: str) -> str:
    common = (
        f"    actions:\n      - run_hook: {{argv: [{hook}], timeout_seconds: 10}}\n"
        "    cooldown_seconds: 0\n    max_attempts: 1000\n    window_seconds: 1\n"
    )
    return (
        "rules:\n"
        f"  - name: {XID_RULE}\n"
        '    description: "benchmark: every injected Xid runs a no-op hook at once"\n'
        f"    match: {{xid: {{codes: [{', '.join(map(str, XID_CODES))}]}}}}\n" + common + f"  - name: {SERVICE_RULE}\n"
        '    description: "benchmark: a failed health probe runs a no-op hook at once"\n'
        "    match: {service_unhealthy: {probes: 1}}\n" + common
    )


def bench_service(hook: str, health_port: int, probe_interval_seconds: float) -> str:
    return (
        "services:\n"
        f"  - {{name: {SERVICE}, manager: command, start_command: [{hook}], stop_command: [{hook}],\n"
        f'     health_url: "http://127.0.0.1:{health_port}/health",\n'
        f"     probe_interval_seconds: {probe_interval_seconds:g},"
        "     probe_timeout_seconds: 1, unhealthy_after_probes: 1}\n"
    )


# -- what this process serves and reads -------------------------------------------------------


class HealthEndpoint:
    """`/health` answering 200 or 503, switched by the benchmark: the inference service stand-in."""

    def __init__(self, port: int) -> None:
        self.healthy = True
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status = 200 if endpoint.healthy else 503
                body = b"ok\n" if status == 200 else b"unavailable\n"
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class LogRecord:
    observed: float  # perf_counter() when this process read the line
    logged_wall: float | None  # the daemon's own timestamp (epoch seconds), when the line has one
    fields: dict[str, Any]

    @property
    def text(self) -> str:
        return str(self.fields.get("event", ""))


def _epoch(stamp: object) -> float | None:
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class LogFollower:
    """Reads the daemon's log as it grows: JSON lines parsed, any other line kept as its text."""

    path: Path
    offset: int = 0
    pending: bytes = b""
    records: list[LogRecord] = field(default_factory=list)

    def skip_to_end(self) -> None:
        self.offset = self.path.stat().st_size
        self.pending = b""

    def poll(self) -> list[LogRecord]:
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        if not chunk:
            return []
        now = time.perf_counter()
        self.offset += len(chunk)
        lines = (self.pending + chunk).split(b"\n")
        self.pending = lines.pop()
        fresh = []
        for line in lines:
            text = line.decode(errors="replace").strip()
            if not text:
                continue
            try:
                fields = json.loads(text)
            except json.JSONDecodeError:
                fields = {"event": text}
            if not isinstance(fields, dict):
                fields = {"event": text}
            fresh.append(LogRecord(now, _epoch(fields.get("timestamp")), fields))
        self.records += fresh
        return fresh


# -- milestones ---------------------------------------------------------------------------------

Matcher = Callable[[LogRecord], bool]


def _targets_gpu(record: LogRecord, gpu: int | None) -> bool:
    return gpu is None or record.fields.get("gpu") == gpu


def _names_rule(record: LogRecord, rule: str) -> bool:
    return record.fields.get("rule") == rule


def log_matchers(event_kind: str, rule: str, gpu: int | None, xid: int | None) -> dict[str, Matcher]:
    def event_visible(record: LogRecord) -> bool:
        fields = record.fields
        if fields.get("kind") != event_kind:
            return False
        return xid is None or (fields.get("gpu") == gpu and fields.get("xid") == xid)

    def action_started(record: LogRecord) -> bool:
        return "action started" in record.text.lower() and _names_rule(record, rule) and _targets_gpu(record, gpu)

    def action_finished(record: LogRecord) -> bool:
        return "action finished" in record.text.lower() and _names_rule(record, rule) and _targets_gpu(record, gpu)

    return {"event_visible": event_visible, "action_started": action_started, "action_finished": action_finished}


def remediation_count(node: Node, rule: str) -> float:
    """Sum of gpu_agent_remediations_total over the rule's series (0 before the first one)."""
    pattern = re.compile(
        rb'^gpu_agent_remediations_total\{[^}]*rule="' + re.escape(rule.encode()) + rb'"[^}]*\} (\S+)$'
    )
    with contextlib.closing(http.client.HTTPConnection(*node.metrics_address, timeout=10)) as connection:
        body = scrape(connection)
    return sum(float(m.group(1)) for line in body.splitlines() if (m := pattern.match(line)))


@dataclass
class Sighting:
    observed: float
    logged_wall: float | None


Until = Callable[[dict[str, Sighting]], bool]


def all_of(names: set[str]) -> Until:
    return lambda found: names <= set(found)


def wait_milestones(
    follower: LogFollower,
    matchers: dict[str, Matcher],
    metric: Callable[[], bool] | None,
    timeout_seconds: float,
    until: Until,
    found: dict[str, Sighting] | None = None,
) -> dict[str, Sighting]:
    """Watch the log (and the metric) until `until(found)` or the timeout; first sighting of each."""
    found = {} if found is None else found
    deadline = time.monotonic() + timeout_seconds
    next_metric = 0.0
    while time.monotonic() < deadline and not until(found):
        for record in follower.poll():
            for name, matches in matchers.items():
                if name not in found and matches(record):
                    found[name] = Sighting(record.observed, record.logged_wall)
        if metric is not None and "remediations_metric" not in found and time.monotonic() >= next_metric:
            next_metric = time.monotonic() + METRIC_POLL_SECONDS
            if metric():
                found["remediations_metric"] = Sighting(time.perf_counter(), None)
        time.sleep(LOG_POLL_SECONDS)
    return found


def choose_headline(present: Sequence[str]) -> str:
    for name in ACTION_MILESTONES:
        if name in present:
            return name
    return "event_visible"


@dataclass
class Latencies:
    """Per milestone: seconds from the fault by the daemon's log clock and by this process's reading."""

    logged: dict[str, list[float]] = field(default_factory=dict)
    observed: dict[str, list[float]] = field(default_factory=dict)
    missed: int = 0

    def add(self, found: dict[str, Sighting], fault_wall: float, fault_perf: float) -> None:
        for name, sighting in found.items():
            self.observed.setdefault(name, []).append(sighting.observed - fault_perf)
            if sighting.logged_wall is not None:
                self.logged.setdefault(name, []).append(sighting.logged_wall - fault_wall)

    def summary(self, present: Sequence[str]) -> dict[str, Any]:
        """The figures; the headline by the daemon's clock where its log says when, else by ours."""
        headline = choose_headline(present)
        best = self.logged.get(headline) or self.observed.get(headline, [])
        return {
            "milestones_present": list(present),
            "headline": headline,
            "headline_p99_ms": summarize(best, 1e3, 1).get("p99"),
            "milestones": {
                name: {
                    "logged_ms": summarize(self.logged.get(name, []), 1e3, 1),
                    "observed_ms": summarize(values, 1e3, 1),
                }
                for name, values in self.observed.items()
            },
            "missed": self.missed,
        }


# -- the faults ---------------------------------------------------------------------------------


class XidInjector:
    """Writes Xids as `gpu-agent inject xid` does, choosing (GPU, code) pairs the watcher will not fold."""

    def __init__(self, sim: SimulatedBackend, paths: HostPaths) -> None:
        self.sim = sim
        self.paths = paths
        sim.init()
        try:
            self.bus_ids = {gpu: sim.identity(gpu).pci_bus_id for gpu in range(sim.device_count())}
        finally:
            sim.shutdown()
        self.last_used: dict[tuple[int, int], float] = {}

    def pick(self) -> tuple[int, int]:
        pairs = [(gpu, code) for code in XID_CODES for gpu in sorted(self.bus_ids)]
        pair = min(pairs, key=lambda p: self.last_used.get(p, float("-inf")))
        wait = self.last_used.get(pair, float("-inf")) + DEFAULT_DEDUPE_WINDOW_SECONDS + 1.0 - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.last_used[pair] = time.monotonic()
        return pair

    def inject(self, source: str, gpu: int, code: int) -> tuple[float, float]:
        """Write the Xid; (time.time(), perf_counter()) just before the write."""
        line = xid_line(self.bus_ids[gpu], code)
        fault = time.time(), time.perf_counter()
        if source == "nvml":
            self.sim.inject_xid(gpu, code)
        else:
            append_kmsg(self.paths, line)
        return fault


@dataclass
class Fault:
    """One fault to time: what to look for, how to cause it, and how to end it afterwards."""

    matchers: dict[str, Matcher]
    cause: Callable[[], tuple[float, float]]  # does it; (time.time(), perf_counter()) just before
    end: Callable[[], None]


def measure_faults(
    args: argparse.Namespace, node: Node, follower: LogFollower, rule: str, rounds: int, next_fault: Callable[[], Fault]
) -> dict[str, Any]:
    """A probe fault finds the milestones this build produces; `rounds` more are timed."""
    timeout = 3 * args.interval + 5.0
    latencies = Latencies()
    present: list[str] = []
    for attempt in range(rounds + 1):
        fault = next_fault()
        follower.skip_to_end()
        before = remediation_count(node, rule)

        def metric(before: float = before) -> bool:
            return remediation_count(node, rule) > before

        if attempt == 0:
            fault.cause()
            found = wait_milestones(follower, fault.matchers, metric, timeout, all_of({"event_visible"}))
            if "event_visible" not in found:
                raise RuntimeError(f"the daemon did not report the fault within {timeout:g} s (log: {follower.path})")
            everything = {"event_visible", *ACTION_MILESTONES}
            wait_milestones(follower, fault.matchers, metric, args.action_grace, all_of(everything), found)
            present = sorted(found)
        else:
            wanted = set(present)
            if wanted & {"action_started", "action_finished"}:
                wanted.discard("remediations_metric")  # log lines say it precisely, and cost no scrape
            matchers = {name: m for name, m in fault.matchers.items() if name in wanted}
            polled = metric if "remediations_metric" in wanted else None
            fault_wall, fault_perf = fault.cause()
            found = wait_milestones(follower, matchers, polled, timeout, all_of(wanted))
            latencies.missed += not wanted <= set(found)
            latencies.add(found, fault_wall, fault_perf)
        fault.end()
    return latencies.summary(present)


def measure_xids(
    args: argparse.Namespace, node: Node, injector: XidInjector, follower: LogFollower, source: str, rng: random.Random
) -> dict[str, Any]:
    checked = False

    def next_fault() -> Fault:
        gpu, code = injector.pick()

        def end() -> None:
            nonlocal checked
            if not checked:  # once: the logged event is the one the status API serves
                recent = api.call(node.socket_path, "status")["recent_events"]
                if not any(e["kind"] == "xid" and e["gpu"] == gpu and e["data"].get("xid") == code for e in recent):
                    raise RuntimeError("an Xid was logged but is not in the status API's recent_events")
                checked = True
            time.sleep(rng.uniform(0.0, args.interval))  # land the next fault at another point of the loop

        return Fault(log_matchers("xid", XID_RULE, gpu, code), lambda: injector.inject(source, gpu, code), end)

    return measure_faults(args, node, follower, XID_RULE, args.injections, next_fault)


def measure_service(
    args: argparse.Namespace,
    node: Node,
    endpoint: HealthEndpoint,
    follower: LogFollower,
    report: Report,
    rng: random.Random,
) -> dict[str, Any] | None:
    def probed_healthy() -> bool:
        services = api.call(node.socket_path, "status").get("services", [])
        return any(s.get("name") == SERVICE and s.get("up") for s in services)

    if not wait_until(probed_healthy, 3 * args.interval + 3.0, 0.1):
        report.note(f"service phase skipped: the daemon reports no healthy {SERVICE} (it does not probe services yet)")
        return None

    def fail() -> tuple[float, float]:
        fault = time.time(), time.perf_counter()
        endpoint.healthy = False
        return fault

    def recover() -> None:
        endpoint.healthy = True
        if not wait_until(probed_healthy, 3 * args.interval + args.probe_interval + 5.0, 0.05):
            raise RuntimeError(f"{SERVICE} was not reported healthy again after its endpoint recovered")
        # Seen healthy right after a loop published: pause so the next failure is not phase-locked to it.
        time.sleep(rng.uniform(0.0, args.interval))

    def next_fault() -> Fault:
        return Fault(log_matchers("service_unhealthy", SERVICE_RULE, None, None), fail, recover)

    return measure_faults(args, node, follower, SERVICE_RULE, args.service_rounds, next_fault)


@contextlib.contextmanager
def health_endpoint(port: int) -> Iterator[HealthEndpoint]:
    endpoint = HealthEndpoint(port)
    try:
        yield endpoint
    finally:
        endpoint.close()


def run(args: argparse.Namespace, report: Report) -> None:
    if args.backend != "simulated":
        report.note("faults can only be injected on the simulated backend: a simulated node ran on this host")
        args.backend = "simulated"
    hook = os.path.realpath(shutil.which("true") or "/bin/true")
    health_port = free_port()
    report.parameters.update(
        interval_seconds=args.interval,
        injections_per_source=args.injections,
        service_rounds=args.service_rounds,
        probe_interval_seconds=args.probe_interval,
        action_grace_seconds=args.action_grace,
        xid_codes=list(XID_CODES),
        action=f"run_hook {hook}, no cooldown",
        seed=args.seed,
    )
    rng = random.Random(args.seed)
    results: dict[str, Any] = {}
    with scratch_dir("gab-detect-") as directory, health_endpoint(health_port) as endpoint:
        node = make_node(
            directory,
            "simulated",
            args.profile,
            interval_seconds=args.interval,
            rules_yaml=bench_rules(hook),
            extra_yaml=bench_service(hook, health_port, args.probe_interval),
        )
        injector = XidInjector(SimulatedBackend(args.profile, node.state_dir), HostPaths.at(str(node.host_root)))
        daemon = RunningDaemon(node)
        try:
            daemon.wait_for("READY", 90.0)
            follower = LogFollower(node.log_path)
            for source in ("nvml", "kmsg"):
                print(f"detection: Xid via {source}, 1 + {args.injections} injections ...", flush=True)
                results[f"xid_{source}"] = measure_xids(args, node, injector, follower, source, rng)
            print(f"detection: service health, 1 + {args.service_rounds} failures ...", flush=True)
            service = measure_service(args, node, endpoint, follower, report, rng)
            if service is not None:
                results["service"] = service
        finally:
            daemon.stop()
    report.results.update(results)
    rows: list[list[object]] = [["fault", "milestone", "p50 ms", "p99 ms", "max ms", "n", "missed"]]
    for fault, summary in results.items():
        for name, figures in summary["milestones"].items():
            s = figures["logged_ms"] if figures["logged_ms"]["n"] else figures["observed_ms"]
            rows.append([fault, name, s.get("median"), s.get("p99"), s.get("max"), s["n"], summary["missed"]])
    print_rows(f"fault -> daemon, {args.interval:g} s interval:", rows)
    for fault, summary in results.items():
        if summary["headline"] == "event_visible":
            report.note(f"{fault}: no remediation milestone in this build; measured fault -> event visible")
        name = f"{fault} -> {summary['headline']} p99"
        report.targets.append(target(name, summary["headline_p99_ms"], "<", 1000.0, " ms"))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python3 -m bench.detection_latency", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--injections", type=int, default=30, help="timed Xids per source (default 30)")
    parser.add_argument("--service-rounds", type=int, default=10, help="timed health failures (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="the daemon's interval_seconds (default 1)")
    parser.add_argument("--probe-interval", type=float, default=0.25, help="service probe_interval_seconds")
    parser.add_argument(
        "--action-grace", type=float, default=4.0, help="how long the probe fault waits for action milestones"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the random pauses between faults")
    args = parser.parse_args(argv)
    report = Report("detection_latency", args)
    run(args, report)
    return report.finish()


if __name__ == "__main__":
    main()
