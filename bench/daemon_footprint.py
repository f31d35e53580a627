"""CPU and memory of a running `gpu-agent run`, per GPU count.

For each node (simulated: 1, 2 and 8 H200s; nvml: the host's GPUs) the daemon runs at a 1 s
interval, observe mode, for `--seconds` after a warm-up; once a second this reads its CPU time
(utime + stime from /proc/PID/stat, its children's included) and its RSS (/proc/PID/status).
Reported: mean CPU as a percentage of one core over the window, the per-second spread, max RSS,
the kernel's own peak (VmHWM), PSS at the end, RSS growth over the window (a leak shows here),
and the daemon's threads.

Usage: python3 -m bench.daemon_footprint [--backend nvml] [--seconds 60] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    Report,
    RunningDaemon,
    add_common_args,
    gpu_inventory,
    make_node,
    print_rows,
    scrape,
    scratch_dir,
    summarize,
    target,
)

CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
DEFAULT_SIM_PROFILES = "h200,h200x2,h200x8"
COLLECT_DURATION = re.compile(rb"^gpu_agent_collect_duration_seconds ([0-9.e+-]+)$", re.MULTILINE)


@dataclass(frozen=True)
class ProcStat:
    ppid: int
    cpu_ticks: int  # utime + stime + reaped children's cutime + cstime
    threads: int


def read_stat(pid: int) -> ProcStat:
    text = Path(f"/proc/{pid}/stat").read_text()
    # comm may hold spaces and parentheses: the fields start after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
    return ProcStat(ppid=int(fields[1]), cpu_ticks=utime + stime + cutime + cstime, threads=int(fields[17]))


def status_kb(pid: int, key: str) -> int | None:
    """A `kB` line of /proc/PID/status (VmRSS, VmHWM); None when absent (a zombie, a sandboxed /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def pss_kb(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return None


def rss_by_mapping_mb(pid: int, most: int = 12) -> dict[str, float]:
    """Where the RSS lives: /proc/PID/smaps summed per mapped file ("[anon]" for the heap, arenas
    and stacks), largest first; empty where smaps cannot be read."""
    by_path: dict[str, int] = {}
    path = "[anon]"
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:  # a mapping's header line
                path = fields[5] if len(fields) > 5 else "[anon]"
            elif fields and fields[0] == "Rss:":
                by_path[path] = by_path.get(path, 0) + int(fields[1])
    largest = sorted(by_path.items(), key=lambda item: -item[1])[:most]
    return {name: round(kb / 1024, 1) for name, kb in largest}


def descendants(pid: int) -> list[int]:
    """Live processes below `pid` (a journalctl the kernel-log reader started, a hook)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(read_stat(int(entry)).ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


@dataclass(frozen=True)
class Reading:
    wall_seconds: float
    cpu_seconds: float
    rss_kb: int
    threads: int
    children: int


def read_tree(pid: int) -> Reading:
    wall = time.monotonic()
    own = read_stat(pid)
    ticks, rss = own.cpu_ticks, status_kb(pid, "VmRSS") or 0
    kids = descendants(pid)
    for child in kids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            ticks += read_stat(child).cpu_ticks
            rss += status_kb(child, "VmRSS") or 0
    return Reading(wall, ticks / CLOCK_TICKS_PER_SECOND, rss, own.threads, len(kids))


def measure_node(args: argparse.Namespace, profile: str, directory: Path) -> dict[str, Any]:
    node = make_node(directory, args.backend, profile, interval_seconds=args.interval)
    daemon = RunningDaemon(node)
    try:
        ready = daemon.wait_for("READY", 90.0) - daemon.spawned
        at_ready = read_tree(daemon.pid)
        time.sleep(args.warmup)
        readings = [read_tree(daemon.pid)]
        deadline = readings[0].wall_seconds + args.seconds
        while (now := time.monotonic()) < deadline:
            time.sleep(min(1.0, deadline - now))
            readings.append(read_tree(daemon.pid))
        peak_kb = status_kb(daemon.pid, "VmHWM")
        pss = pss_kb(daemon.pid)
        by_mapping = rss_by_mapping_mb(daemon.pid)
        with contextlib.closing(http.client.HTTPConnection(*node.metrics_address, timeout=10)) as connection:
            match = COLLECT_DURATION.search(scrape(connection))
        loop_seconds = float(match.group(1)) if match else None
    finally:
        daemon.stop()
    per_second = [
        100.0 * (b.cpu_seconds - a.cpu_seconds) / (b.wall_seconds - a.wall_seconds)
        for a, b in itertools.pairwise(readings)
    ]
    first, last = readings[0], readings[-1]
    window = last.wall_seconds - first.wall_seconds
    return {
        "profile": profile if args.backend == "simulated" else None,
        "gpus": int(gpu_inventory(args.backend, profile)["gpu_count"]),
        "ready_seconds": round(ready, 3),
        "cpu_seconds_at_ready": round(at_ready.cpu_seconds, 3),
        "window_seconds": round(window, 1),
        "cpu_percent_mean": round(100.0 * (last.cpu_seconds - first.cpu_seconds) / window, 3),
        "cpu_percent_per_second": summarize(per_second, digits=2),
        "rss_mb_max": round(max(r.rss_kb for r in readings) / 1024, 1),
        "rss_mb_start": round(first.rss_kb / 1024, 1),
        "rss_mb_end": round(last.rss_kb / 1024, 1),
        "rss_growth_mb": round((last.rss_kb - first.rss_kb) / 1024, 2),
        "peak_rss_mb_vmhwm": round(peak_kb / 1024, 1) if peak_kb is not None else None,
        "pss_mb_end": round(pss / 1024, 1) if pss is not None else None,
        "rss_mb_by_mapping": by_mapping,
        "threads": last.threads,
        "child_processes_max": max(r.children for r in readings),
        "last_loop_seconds": loop_seconds,
    }


def run(args: argparse.Namespace, report: Report) -> None:
    profiles = args.profiles.split(",") if args.backend == "simulated" else ["host"]
    report.parameters.update(
        interval_seconds=args.interval, warmup_seconds=args.warmup, seconds=args.seconds, profiles=profiles
    )
    nodes = []
    for profile in profiles:
        with scratch_dir("gab-foot-") as directory:
            print(f"footprint: {profile}: {args.warmup:g} s warm-up, then {args.seconds:g} s ...", flush=True)
            nodes.append(measure_node(args, profile, directory))
    report.results["nodes"] = nodes
    rows: list[list[object]] = [["node", "GPUs", "CPU % mean", "CPU % p90", "RSS max MB", "peak MB", "growth MB"]]
    rows += [
        [
            n["profile"] or args.backend,
            n["gpus"],
            n["cpu_percent_mean"],
            n["cpu_percent_per_second"]["p90"],
            n["rss_mb_max"],
            n["peak_rss_mb_vmhwm"],
            n["rss_growth_mb"],
        ]
        for n in nodes
    ]
    print_rows(f"daemon footprint, {args.interval:g} s interval:", rows)
    # The targets are for one H200; on a host with more GPUs they apply to its whole count.
    smallest = min(nodes, key=lambda n: int(n["gpus"]))
    name = f"{smallest['gpus']} GPU(s)"
    report.targets += [
        target(f"daemon CPU, mean % of one core, {name}", smallest["cpu_percent_mean"], "<", 1.0, "%"),
        target(f"daemon RSS max, {name}", smallest["rss_mb_max"], "<", 80.0, " MB"),
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python3 -m bench.daemon_footprint", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument(
        "--profiles", default=DEFAULT_SIM_PROFILES, help=f"simulated nodes, comma-separated ({DEFAULT_SIM_PROFILES})"
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window per node (default 60)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds after READY=1 left out (default 5)")
    parser.add_argument("--interval", type=float, default=1.0, help="the daemon's interval_seconds (default 1)")
    args = parser.parse_args(argv)
    report = Report("daemon_footprint", args)
    run(args, report)
    return report.finish()


if __name__ == "__main__":
    main()
