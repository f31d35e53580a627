"""How fast the CLI answers, as whole processes, next to the references it is judged against, and
what the daemon costs at a 1 s loop with two services.

Each round runs every command once, in a rotating order, output discarded (what a shell's `time`
shows):

- `python_bare`: `python3 -c pass`, the interpreter's own floor;
- `reference_read`: a python process that reads a dozen values of GPU 0 the plainest way. On
  nvml: `import pynvml`, `nvmlInit`, 12 getters, `nvmlShutdown`. On the simulated backend there is
  no NVML: the same 12 reads through `agent.backend.sim` (its equivalent; the document says so);
- `version`, `help`: `gpu-agent --version`, `gpu-agent --help`;
- `argparse_floor`: a python process that builds an argparse parser of 12 commands and prints its
  help, the floor of any argparse CLI's `--help` (argparse loads re, gettext and textwrap);
- `status_daemon`: `gpu-agent status` while a daemon runs on the node (one socket request);
- `complete_values`: `gpu-agent --complete-values gpus`, what shell completion runs at TAB (the
  store of the daemon running the config);
- `status_direct`: `gpu-agent status --direct` (no daemon asked: a full read, plan and verdict);
- `nvidia_smi` (its screen), `nvidia_smi_query` (`--query-gpu`, 13 fields) and `nvitop_once`
  (`nvitop -1`), when they are installed.

Ratios are taken round by round (each pair ran next to each other), then their median. Targets:
`status` against the daemon <= 4 x a bare start and faster than `nvidia-smi`'s screen; a direct
read <= 1.5 x the reference read; `--version` and `--help` <= 2 x a bare start.

Then the daemon alone: two stand-in inference servers (sglang's pages, 8 requests/s each) as the
node's two services, the daemon at `interval_seconds: 1`, its CPU over `--cpu-seconds` after a
warm-up (utime + stime from /proc, as `daemon_footprint`). Target: < 0.5 % of one core, with the
services as configured by default (their pages read every `scrape_interval_seconds`, 5 s); the
same again with the pages read every second (`scrape_interval_seconds: 1`), for the record.

Needs nothing but the repository and the agent's runtime dependencies (nvidia-ml-py on nvml).
`--agent-tree DIR` times the CLI commands of another checkout of the agent (an earlier commit,
for a before/after) against the same daemon and references. `--before-tree DIR` times that
checkout's `--version`, `--help`, `status` and `--complete-values` in the same rounds as this one's
(`version_before`, `help_before`, `status_daemon_before`, `complete_values_before`): a before/after
paired round by round, which a loaded machine needs. `--quoted-socket` writes the node's
`api.socket` quoted, a config `status` could only read through the YAML parser before the daemon
published its socket.

Usage: python3 -m bench.cli_speed [--backend nvml] [--runs 15] [--cpu-seconds 60] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    CLI_ENTRY,
    REPO_ROOT,
    Node,
    Report,
    RunningDaemon,
    add_common_args,
    agent_command,
    agent_env,
    free_port,
    make_node,
    paired_ratio,
    percentile,
    print_rows,
    require_daemon_status,
    running_daemon,
    scratch_dir,
    summarize,
    target,
    time_processes,
)
from bench.daemon_footprint import CLOCK_TICKS_PER_SECOND, read_stat

#: Twelve values of GPU 0 through pynvml, as a monitoring one-liner reads them.
NVML_REFERENCE = """
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
values = [n.nvmlDeviceGetName(h), n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
    n.nvmlDeviceGetPowerUsage(h), n.nvmlDeviceGetPowerManagementLimit(h), n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
    n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM), n.nvmlDeviceGetUtilizationRates(h), n.nvmlDeviceGetMemoryInfo(h),
    n.nvmlDeviceGetCurrentClocksEventReasons(h), n.nvmlDeviceGetPerformanceState(h), n.nvmlDeviceGetPersistenceMode(h)]
n.nvmlShutdown()
"""

#: The same twelve through the simulated backend (no NVML on this machine).
SIM_REFERENCE = """
import sys
from pathlib import Path
from agent.backend.base import ClockDomain
from agent.backend.sim import SimulatedBackend
b = SimulatedBackend(sys.argv[1], Path(sys.argv[2]))
b.init()
i = b.identity(0)
values = [i.name, i.uuid, b.temperature_celsius(0), b.power_usage_watts(0), b.power_limit_watts(0),
    b.clock_mhz(0, ClockDomain.SM), b.clock_mhz(0, ClockDomain.MEMORY), b.utilization(0), b.memory_info(0),
    b.clock_event_reasons(0), b.performance_state(0), b.persistence_enabled(0)]
b.shutdown()
"""

NVIDIA_SMI_FIELDS = (
    "name,uuid,temperature.gpu,power.draw,power.limit,clocks.sm,clocks.mem,utilization.gpu,"
    "utilization.memory,memory.used,memory.total,pstate,persistence_mode"
)

SERVICES_YAML = """\
services:
{entries}"""
SERVICE_ENTRY = """\
  - name: {name}
    manager: command
    start_command: [/bin/true]
    stop_command: [/bin/true]
    status_command: [/bin/true]
    health_url: "http://127.0.0.1:{port}/health"
    metrics_url: "http://127.0.0.1:{port}/metrics"
    kind: sglang
    gpus: [0]
{scrape}"""

#: The floor of an argparse CLI's --help: 12 commands, each with a help line, the help printed.
ARGPARSE_FLOOR = """
import argparse
parser = argparse.ArgumentParser(prog="cli", description="A command line of twelve commands.")
commands = parser.add_subparsers(dest="command", metavar="COMMAND")
for n in range(12):
    commands.add_parser(f"command{n}", help=f"what command {n} does, in a line")
parser.print_help()
"""


def reference_command(node: Node) -> list[str]:
    if node.backend == "nvml":
        return [sys.executable, "-c", NVML_REFERENCE]
    return [sys.executable, "-c", SIM_REFERENCE, node.profile, str(node.state_dir)]


def commands_for(node: Node, report: Report) -> dict[str, list[str]]:
    commands = {
        "python_bare": [sys.executable, "-c", "pass"],
        "reference_read": reference_command(node),
        "version": agent_command("--version"),
        "help": agent_command("--help"),
        "argparse_floor": [sys.executable, "-c", ARGPARSE_FLOOR],
        "status_daemon": node.cli("status"),
        "status_direct": node.cli("status", "--direct"),
        "complete_values": agent_command("--complete-values", "gpus"),  # the config from $GPU_AGENT_CONFIG
    }
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        commands["nvidia_smi"] = [smi]
        commands["nvidia_smi_query"] = [smi, f"--query-gpu={NVIDIA_SMI_FIELDS}", "--format=csv,noheader"]
    else:
        report.note("nvidia-smi not found: no nvidia-smi figures")
    nvitop = shutil.which("nvitop")
    if nvitop is not None:
        commands["nvitop_once"] = [nvitop, "-1"]
    else:
        report.note("nvitop not found: no nvitop -1 figure")
    if node.backend != "nvml":
        report.note(
            "simulated backend: reference_read is the simulated backend's twelve reads in a fresh python, "
            "the equivalent of the pynvml one-liner; status_direct reads the simulated node"
        )
    return commands


def before_commands(node: Node, tree: Path) -> dict[str, list[str]]:
    """`--version`, `--help` and `status` of the agent in `tree`, put first on sys.path."""
    entry = f"import sys; sys.path.insert(0, {str(tree.resolve())!r}); {CLI_ENTRY}"
    return {
        "version_before": [sys.executable, "-c", entry, "--version"],
        "help_before": [sys.executable, "-c", entry, "--help"],
        "status_daemon_before": [sys.executable, "-c", entry, "status", "--config", str(node.config_path)],
        "complete_values_before": [sys.executable, "-c", entry, "--complete-values", "gpus"],
    }


def time_commands(
    node: Node, commands: dict[str, list[str]], runs: int, agent_tree: Path | None
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    require_daemon_status(node)
    # `python -m` puts the working directory first on sys.path: the tree to time is where it runs.
    tree = (agent_tree or REPO_ROOT).resolve()
    # $GPU_AGENT_CONFIG: the config shell completion hands `--complete-values`.
    env = node.env({"PYTHONPATH": str(tree), "GPU_AGENT_CONFIG": str(node.config_path)})
    return time_processes(commands, runs, env=env, cwd=tree)


def start_standins(count: int, directory: Path) -> tuple[list[subprocess.Popen[bytes]], list[int]]:
    from agent.demo.standin_process import wait_listening

    servers: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    for n in range(count):
        port = free_port()
        log = (directory / f"standin-{n}.log").open("wb")
        servers.append(
            subprocess.Popen(
                [sys.executable, "-m", "agent.demo.standin", "--flavor", "sglang", "--port", str(port)],
                env=agent_env(),
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        ports.append(port)
    for port in ports:
        if not wait_listening(port, 30.0):
            raise RuntimeError(f"the stand-in on port {port} did not listen")
    return servers, ports


def daemon_cpu(args: argparse.Namespace, directory: Path, scrape_interval_seconds: float | None) -> dict[str, Any]:
    """Mean CPU of the daemon, % of one core, with two scraped and probed services at a 1 s loop;
    their pages read every `scrape_interval_seconds` (None: the default)."""
    scrape = "" if scrape_interval_seconds is None else f"    scrape_interval_seconds: {scrape_interval_seconds:g}\n"
    servers, ports = start_standins(2, directory)
    try:
        entries = "".join(
            SERVICE_ENTRY.format(name=f"sglang-{n}", port=port, scrape=scrape) for n, port in enumerate(ports)
        )
        node = make_node(
            directory / f"services-node-{scrape_interval_seconds or 'default'}",
            args.backend,
            args.profile,
            interval_seconds=1.0,
            extra_yaml=SERVICES_YAML.format(entries=entries),
        )
        daemon = RunningDaemon(node)
        try:
            daemon.wait_for("READY", 90.0)
            time.sleep(args.warmup)
            first, started = read_stat(daemon.pid), time.monotonic()
            time.sleep(args.cpu_seconds)
            last, elapsed = read_stat(daemon.pid), time.monotonic() - started
            status = json.loads(
                subprocess.run(
                    node.cli("status", "--json"), capture_output=True, text=True, env=node.env(), timeout=60
                ).stdout
            )
        finally:
            daemon.stop()
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=10)
    cpu_seconds = (last.cpu_ticks - first.cpu_ticks) / CLOCK_TICKS_PER_SECOND
    services = {s["name"]: {"up": s["up"], "scraped": "metrics" in s} for s in status.get("services", [])}
    return {
        "cpu_percent_of_one_core": round(100 * cpu_seconds / elapsed, 3),
        "cpu_seconds": round(cpu_seconds, 3),
        "window_seconds": round(elapsed, 1),
        "threads": last.threads,
        "services": services,
    }


def run(args: argparse.Namespace, report: Report) -> None:
    with scratch_dir("gab-cli-") as directory:
        node = make_node(
            directory / "node", args.backend, args.profile, interval_seconds=1.0, quoted_socket=args.quoted_socket
        )
        commands = commands_for(node, report)
        if args.before_tree is not None:
            commands.update(before_commands(node, args.before_tree))
        report.parameters.update(
            runs=args.runs,
            cpu_seconds=args.cpu_seconds,
            commands={name: " ".join(argv) for name, argv in commands.items()},
            python=sys.version.split()[0],
            agent_tree=str(args.agent_tree or REPO_ROOT),
            before_tree=None if args.before_tree is None else str(args.before_tree),
            quoted_socket=args.quoted_socket,
        )
        with running_daemon(node):
            times, exits = time_commands(node, commands, args.runs, args.agent_tree)
        footprint = daemon_cpu(args, directory, None) if args.cpu_seconds > 0 else None
        scraped_every_second = daemon_cpu(args, directory, 1.0) if args.cpu_seconds > 0 else None
    ratios = {
        "status_daemon_over_python_bare": paired_ratio(times, "status_daemon", "python_bare"),
        "status_direct_over_reference_read": paired_ratio(times, "status_direct", "reference_read"),
        "version_over_python_bare": paired_ratio(times, "version", "python_bare"),
        "help_over_python_bare": paired_ratio(times, "help", "python_bare"),
        "argparse_floor_over_python_bare": paired_ratio(times, "argparse_floor", "python_bare"),
        "help_over_argparse_floor": paired_ratio(times, "help", "argparse_floor"),
        "reference_read_over_python_bare": paired_ratio(times, "reference_read", "python_bare"),
        "status_daemon_over_nvidia_smi": paired_ratio(times, "status_daemon", "nvidia_smi"),
        "status_daemon_over_nvitop_once": paired_ratio(times, "status_daemon", "nvitop_once"),
        "status_direct_over_nvidia_smi": paired_ratio(times, "status_direct", "nvidia_smi"),
        "status_daemon_before_over_python_bare": paired_ratio(times, "status_daemon_before", "python_bare"),
        "status_daemon_over_status_daemon_before": paired_ratio(times, "status_daemon", "status_daemon_before"),
        "version_before_over_python_bare": paired_ratio(times, "version_before", "python_bare"),
        "help_before_over_python_bare": paired_ratio(times, "help_before", "python_bare"),
        "complete_values_over_python_bare": paired_ratio(times, "complete_values", "python_bare"),
        "complete_values_before_over_python_bare": paired_ratio(times, "complete_values_before", "python_bare"),
    }
    report.results.update(
        wall_ms={name: summarize(values, 1e3, 1) for name, values in times.items()},
        exit_codes=exits,
        ratios={k: v for k, v in ratios.items() if v is not None},
        daemon_two_services=footprint,
        daemon_two_services_scraped_every_second=scraped_every_second,
    )
    rows: list[list[object]] = [["command", "median ms", "p10 ms", "p90 ms", "runs"]]
    rows += [
        [
            name,
            round(percentile(v, 50) * 1e3, 1),
            round(percentile(v, 10) * 1e3, 1),
            round(percentile(v, 90) * 1e3, 1),
            len(v),
        ]
        for name, v in times.items()
    ]
    print_rows(f"whole-process wall time ({args.backend}):", rows)
    print_rows("ratios (paired, median):", [[k, v] for k, v in report.results["ratios"].items()])
    if footprint is not None and scraped_every_second is not None:
        print(
            f"  daemon, 1 s loop, two services: {footprint['cpu_percent_of_one_core']} % of one core "
            f"over {footprint['window_seconds']} s; services {footprint['services']}"
        )
        print(
            f"  the same, their pages read every second: {scraped_every_second['cpu_percent_of_one_core']} %"
            f" of one core over {scraped_every_second['window_seconds']} s"
        )
    report.targets += [
        target("status against the daemon / python3 -c pass", ratios["status_daemon_over_python_bare"], "<=", 4.0),
        target("status --direct / the reference read", ratios["status_direct_over_reference_read"], "<=", 1.5),
        target("--version / python3 -c pass", ratios["version_over_python_bare"], "<=", 2.0),
        target("--help / python3 -c pass", ratios["help_over_python_bare"], "<=", 2.0),
    ]
    if ratios["status_daemon_over_nvidia_smi"] is not None:
        report.targets.append(
            target("status against the daemon / nvidia-smi's screen", ratios["status_daemon_over_nvidia_smi"], "<", 1.0)
        )
    if footprint is not None:
        report.targets.append(
            target(
                "daemon CPU, 1 s loop, two services (% of one core)",
                footprint["cpu_percent_of_one_core"],
                "<",
                0.5,
                " %",
            )
        )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python3 -m bench.cli_speed", description=__doc__.splitlines()[0])
    add_common_args(parser, profile="h200x2")
    parser.add_argument("--runs", type=int, default=15, help="rounds (default 15)")
    parser.add_argument("--cpu-seconds", type=float, default=60.0, help="daemon CPU window; 0 skips it (default 60)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds after READY=1 left out (default 5)")
    parser.add_argument("--agent-tree", type=Path, help="time the CLI of this checkout instead (a before/after)")
    parser.add_argument(
        "--before-tree", type=Path, help="also time this checkout's CLI fast paths, paired round by round"
    )
    parser.add_argument(
        "--quoted-socket", action="store_true", help="api.socket quoted in the config (the YAML parser read it before)"
    )
    args = parser.parse_args(argv)
    report = Report("cli_speed", args)
    run(args, report)
    return report.finish()


if __name__ == "__main__":
    main()
