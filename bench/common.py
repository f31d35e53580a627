"""Shared parts of the benchmarks: statistics, the result document, and a daemon on a throw-away node.

Every benchmark writes one JSON document (`--out FILE.json`):

    {"schema": "gpu-agent-bench/1", "benchmark": NAME, "started_utc": ..., "duration_seconds": ...,
     "machine": {...}, "parameters": {...}, "results": {...}, "targets": [...], "notes": [...]}

`targets` lists each figure the issue sets a goal for, with `met` true/false: a record of what
was measured, never an assertion (a benchmark exits 0 whatever its figures are).

The daemon runs as a real process (`python3 -m agent.cli run`) on a node made for the run: a
temporary directory with the config, state, API socket and log. On the simulated backend the
host tree is the demo's fake one; on NVML the host root is `/` and the config is observe mode
with no rules, so the agent can neither change a GPU setting nor decide any action.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "gpu-agent-bench/1"
BACKENDS = ("simulated", "nvml")
DEFAULT_PROFILE = "h200x8"

# The policy every benchmark daemon observes: what an H200 inference node declares (the shape
# bench/h200_readonly.sh ran on real H200s). Observe mode: drift is reported, never repaired.
BENCH_POLICY = """\
policy:
  node:
    transparent_hugepages: {enabled: never, defrag: madvise}
    nouveau: blacklisted
    triton_cache: {path: /var/cache/triton, owner: root, group: root, mode: "0755"}
  gpus:
    - match: {model: "NVIDIA H200*"}
      power_limit_watts: 600
      locked_clocks: {gpu_mhz: [1980, 1980]}
      persistence: enabled
      ecc: enabled
    - match: {model: "NVIDIA RTX PRO 6000*"}
      power_limit_watts: 450
      fan_curve: [[30, 30], [50, 65], [75, 100]]
"""


# -- statistics ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float | None:
    """Median over rounds of numerator/denominator, each pair measured next to each other; None
    when either was not timed."""
    if numerator not in times or denominator not in times:
        return None
    pairs = [a / b for a, b in zip(times[numerator], times[denominator]) if b > 0]
    return round(percentile(pairs, 50), 2) if pairs else None


def summarize(values: Sequence[float], scale: float = 1.0, digits: int = 3) -> dict[str, float | int]:
    """n, mean, median, p90, p99, min, max of `values` times `scale` (e.g. 1e3 for seconds -> ms)."""
    if not values:
        return {"n": 0}
    scaled = [v * scale for v in values]
    return {
        "n": len(scaled),
        "mean": round(sum(scaled) / len(scaled), digits),
        "median": round(percentile(scaled, 50), digits),
        "p90": round(percentile(scaled, 90), digits),
        "p99": round(percentile(scaled, 99), digits),
        "min": round(min(scaled), digits),
        "max": round(max(scaled), digits),
    }


def ratio(numerator: float, denominator: float, digits: int = 2) -> float | None:
    if denominator <= 0 or math.isnan(numerator) or math.isnan(denominator):
        return None
    return round(numerator / denominator, digits)


def target(name: str, value: float | None, op: str, limit: float, unit: str = "") -> dict[str, Any]:
    """A goal and whether the measured value meets it; value None (not measured) meets nothing."""
    checks: dict[str, Callable[[float, float], bool]] = {
        "<": lambda v, lim: v < lim,
        "<=": lambda v, lim: v <= lim,
        ">": lambda v, lim: v > lim,
        ">=": lambda v, lim: v >= lim,
    }
    met = None if value is None else checks[op](value, limit)
    return {"name": name, "value": value, "target": f"{op} {limit:g}{unit}", "unit": unit, "met": met}


# -- the result document ------------------------------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser, profile: str = DEFAULT_PROFILE) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="simulated", help="GPU backend (default simulated)")
    parser.add_argument(
        "--profile", default=profile, help=f"simulated node profile (default {profile}); ignored for nvml"
    )
    parser.add_argument("--label", help="where the figures come from, for the docs table (default: backend name)")
    parser.add_argument("--out", type=Path, help="write the JSON result here")


def _read_first(path: str, prefix: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    return None


def gpu_inventory(backend: str, profile: str) -> dict[str, Any]:
    """GPU count, names and driver: read-only (NVML getters only), or from the simulated profile."""
    if backend == "simulated":
        from agent.backend.sim import DEFAULT_DRIVER_VERSION, load_profile

        node = load_profile(profile)
        return {
            "gpu_count": len(node.models),
            "gpu_names": [m.name for m in node.models],
            "driver_version": DEFAULT_DRIVER_VERSION + " (simulated)",
        }
    from agent.backend.nvml import NvmlBackend

    nvml = NvmlBackend(writable_items=())
    nvml.init()
    try:
        count = nvml.device_count()
        return {
            "gpu_count": count,
            "gpu_names": [nvml.identity(gpu).name for gpu in range(count)],
            "driver_version": nvml.driver_version(),
        }
    finally:
        nvml.shutdown()


def machine_info(backend: str, profile: str, label: str | None) -> dict[str, Any]:
    memory_kb = _read_first("/proc/meminfo", "MemTotal")
    info: dict[str, Any] = {
        "label": label or ("simulated" if backend == "simulated" else "nvml"),
        "backend": backend,
        "profile": profile if backend == "simulated" else None,
        "cpu_model": _read_first("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cpus": os.cpu_count(),
        "memory_gib": round(int(memory_kb.split()[0]) / 2**20, 1) if memory_kb else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nvidia_smi": shutil.which("nvidia-smi"),
    }
    info.update(gpu_inventory(backend, profile))
    return info


@dataclass
class Report:
    """One benchmark's result document, built up while it runs."""

    benchmark: str
    args: argparse.Namespace
    parameters: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started_utc: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat())
    started_monotonic: float = field(default_factory=time.monotonic)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"note: {text}", file=sys.stderr)

    def document(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "benchmark": self.benchmark,
            "started_utc": self.started_utc,
            "duration_seconds": round(time.monotonic() - self.started_monotonic, 1),
            "machine": machine_info(self.args.backend, self.args.profile, self.args.label),
            "parameters": self.parameters,
            "results": self.results,
            "targets": self.targets,
            "notes": self.notes,
        }

    def finish(self) -> dict[str, Any]:
        """Print the targets, write the document to --out; returns it."""
        document = self.document()
        for goal in self.targets:
            verdict = {True: "met", False: "MISSED", None: "not measured"}[goal["met"]]
            print(f"  {goal['name']}: {goal['value']} {goal['unit']} (target {goal['target']}): {verdict}")
        out: Path | None = self.args.out
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n", encoding="utf-8")
            print(f"wrote {out}")
        return document


def print_rows(title: str, rows: Sequence[Sequence[object]]) -> None:
    """An aligned table on stdout: the figures a reader looks at first."""
    print(title)
    text = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in text) for i in range(len(text[0]))]
    for row in text:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


# -- a daemon on a throw-away node --------------------------------------------------------------


def agent_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for agent processes: the repository importable, no systemd variables of ours."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM", "GPU_AGENT_CONFIG")
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


#: How /usr/bin/gpu-agent (packaging/gpu-agent) starts the CLI: main() called directly, not `-m`.
CLI_ENTRY = "import sys; from agent.cli import main; sys.exit(main())"


def agent_command(*args: str) -> list[str]:
    return [sys.executable, "-c", CLI_ENTRY, *args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Node:
    """A config and everything it points at, in one directory."""

    directory: Path
    config_path: Path
    backend: str
    profile: str
    host_root: Path
    state_dir: Path
    socket_path: Path
    port: int
    log_path: Path

    @property
    def metrics_address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def cli(self, *args: str) -> list[str]:
        """`gpu-agent ARGS --config <this node>` as an argv."""
        return agent_command(*args, "--config", str(self.config_path))

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a command run against this node: `status` finds the socket its daemon
        published in the runtime directory under its host_root (on nvml, the host's own)."""
        from agent.api import RUNTIME_DIR_VARIABLE
        from agent.defaults import DEFAULT_RUNTIME_DIR

        runtime_dir = self.host_root / DEFAULT_RUNTIME_DIR.lstrip("/")
        return agent_env({RUNTIME_DIR_VARIABLE: str(runtime_dir), **(extra or {})})


def make_node(
    directory: Path,
    backend: str,
    profile: str,
    *,
    interval_seconds: float = 1.0,
    rules_yaml: str | None = None,
    extra_yaml: str = "",
    mode: str = "observe",
    quoted_socket: bool = False,
) -> Node:
    """Write a config for `backend` under `directory` (observe mode unless told; rules only when given;
    `quoted_socket`: `api.socket` in quotes, as some write it)."""
    directory.mkdir(parents=True, exist_ok=True)
    state_dir = directory / "state"
    rules_dir = directory / "rules.d"
    rules_dir.mkdir(exist_ok=True)
    if rules_yaml is not None:
        (rules_dir / "50-bench.yaml").write_text(rules_yaml, encoding="utf-8")
    if backend == "simulated":
        from agent.demo.scenario import build_demo_host

        host_root = directory / "host"
        build_demo_host(host_root)
        # An empty kernel log from the start: the daemon follows it rather than looking for it.
        (host_root / "dev").mkdir(exist_ok=True)
        (host_root / "dev" / "kmsg").touch()
        backend_yaml = f"backend: simulated\nsimulated: {{profile: {profile}}}\nhost_root: {host_root}\n"
    else:
        host_root = Path("/")
        backend_yaml = "backend: nvml\nhost_root: /\n"
    port = free_port()
    socket_path = directory / "agent.sock"
    config_path = directory / "agent.yaml"
    config_path.write_text(
        f"mode: {mode}\n"
        + backend_yaml
        + f"state_dir: {state_dir}\n"
        + f"interval_seconds: {interval_seconds:g}\n"
        + f'metrics: {{listen: "127.0.0.1:{port}"}}\n'
        + (f'api: {{socket: "{socket_path}"}}\n' if quoted_socket else f"api: {{socket: {socket_path}}}\n")
        # no rules given: remediation off, said so (an empty rules directory is a verdict line)
        + (
            f"remediation: {{rules_dirs: [{rules_dir}]}}\n"
            if rules_yaml is not None
            else "remediation: {rules_dirs: []}\n"
        )
        + BENCH_POLICY
        + extra_yaml,
        encoding="utf-8",
    )
    return Node(directory, config_path, backend, profile, host_root, state_dir, socket_path, port, directory / "log")


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A short temporary directory (a Unix socket path must stay under 108 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp" if Path("/tmp").is_dir() else None))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class RunningDaemon:
    """`gpu-agent run` as a child process, with the sd_notify datagram socket it reports to.

    A thread reads every datagram as it comes, as systemd does: a notify socket nobody reads
    fills up after a few datagrams (net.unix.max_dgram_qlen) and the daemon's next send blocks.
    """

    def __init__(self, node: Node, *, log_level: str = "info") -> None:
        self.node = node
        self.notify_path = node.directory / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.received: list[tuple[float, dict[str, str]]] = []
        self._arrived = threading.Condition()
        self._reader = threading.Thread(target=self._read_notifications, name="notify-reader", daemon=True)
        self._reader.start()
        env = agent_env({"NOTIFY_SOCKET": str(self.notify_path)})
        argv = node.cli("run", "--log-format", "json", "--log-level", log_level)
        with open(node.log_path, "ab") as log:
            self.spawned = time.perf_counter()
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read_notifications(self) -> None:
        while True:
            try:
                data = self.notify.recv(65536)
            except OSError:  # closed by stop()
                return
            arrived = time.perf_counter()
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._arrived:
                self.received.append((arrived, fields))
                self._arrived.notify_all()

    def wait_for(self, key: str, timeout_seconds: float = 60.0) -> float:
        """perf_counter() when a datagram carrying `key` (e.g. READY) arrived; raises on timeout or exit."""
        deadline = time.monotonic() + timeout_seconds
        with self._arrived:
            while True:
                for arrived, fields in self.received:
                    if key in fields:
                        return arrived
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"daemon exited ({self.process.returncode}) before {key}=; log: {self.log_tail()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {key}= within {timeout_seconds:g} s; log: {self.log_tail()}")
                self._arrived.wait(min(remaining, 0.2))

    def stop(self, timeout_seconds: float = 20.0) -> float:
        """SIGTERM; seconds until the process exited (killed after `timeout_seconds`)."""
        started = time.perf_counter()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        stopped = time.perf_counter() - started
        with contextlib.suppress(OSError):
            self.notify.shutdown(socket.SHUT_RDWR)
        self.notify.close()
        self._reader.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self.notify_path.unlink()
        return stopped

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.node.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


@contextlib.contextmanager
def running_daemon(node: Node, ready_timeout_seconds: float = 90.0) -> Iterator[RunningDaemon]:
    """A daemon on `node`, READY=1 received; stopped on the way out."""
    daemon = RunningDaemon(node)
    try:
        daemon.wait_for("READY", ready_timeout_seconds)
        yield daemon
    finally:
        daemon.stop()


def scrape(connection: http.client.HTTPConnection, path: str = "/metrics") -> bytes:
    """One GET on a kept-alive connection (what Prometheus does), the whole body read."""
    connection.request("GET", path)
    response = connection.getresponse()
    body = response.read()
    if response.status != 200:
        raise RuntimeError(f"GET {path}: HTTP {response.status}")
    return body


def wait_until(check: Callable[[], bool], timeout_seconds: float, poll_seconds: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(poll_seconds)
    return check()


def timed_run(
    argv: Sequence[str],
    timeout_seconds: float = 120.0,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[float, int]:
    """(wall seconds, exit code) of one process, output discarded: what a shell's `time` shows.

    The wait blocks in waitpid and a timer kills the process past the deadline: subprocess's own
    wait with a timeout polls with sleeps growing to 50 ms, which rounded a 70 ms process up to
    ~114 ms and made every whole-process figure a multiple of that step."""
    started = time.perf_counter()
    process = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=agent_env() if env is None else env,
        cwd=REPO_ROOT if cwd is None else cwd,
    )
    killer = threading.Timer(timeout_seconds, process.kill)
    killer.start()
    try:
        code = process.wait()
    finally:
        killer.cancel()
    return time.perf_counter() - started, code


def measure_rounds(
    variants: dict[str, Callable[[], object]],
    min_rounds: int,
    max_rounds: int,
    budget_seconds: float = 0.0,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Seconds per call of each variant. Each round runs every variant once, starting at a
    different one each round (what runs first pays for a cold cache, and a machine's slow spell
    falls on all of them); rounds stop at `max_rounds`, or past `budget_seconds` once `min_rounds`
    are done. `warmup` rounds first, not timed: the first start of anything is an outlier."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    started = time.monotonic()
    for done in range(max_rounds):
        if done >= min_rounds and time.monotonic() - started >= budget_seconds:
            break
        shift = done % len(names)
        for name in names[shift:] + names[:shift]:
            begin = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - begin)
    return times


def time_processes(
    commands: dict[str, list[str]], runs: int, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """(wall seconds per run, the exit codes seen) of each command: `runs` rotating rounds of
    `timed_run`, after one untimed round."""
    exits: dict[str, set[int]] = {name: set() for name in commands}

    def process(name: str) -> Callable[[], None]:
        def run() -> None:
            exits[name].add(timed_run(commands[name], env=env, cwd=cwd)[1])

        return run

    times = measure_rounds({name: process(name) for name in commands}, runs, runs)
    return times, {name: sorted(codes) for name, codes in exits.items()}


def require_daemon_status(node: Node) -> None:
    """Raise unless `gpu-agent status` on `node` answers from its daemon (not a direct read): what
    a benchmark of `status` against the daemon must time."""
    answered = subprocess.run(
        node.cli("status", "--json"), capture_output=True, text=True, env=node.env(), cwd=REPO_ROOT, timeout=60
    )
    try:
        source = json.loads(answered.stdout).get("source")
    except ValueError:
        source = None
    if source != "daemon":
        raise RuntimeError(f"`status` did not answer from the daemon (source {source}): {answered.stderr[-500:]}")
