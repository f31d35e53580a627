"""/metrics scrape latency of a running daemon, and again while one of its NVML calls hangs.

A scrape renders the last published snapshot and never calls the backend, so a hung GPU call
must not show in scrape latency. Phases, on one daemon (1 s interval):

1. baseline: K scrapes on one kept-alive connection (as Prometheus scrapes), then K/4 on a fresh
   connection each (as curl does);
2. hanging: `gpu-agent inject hang --gpu 0 --call temperature_celsius --seconds 60`, wait until
   the daemon exports GPU 0 as stale, then the same scrapes again, counting how many saw
   `gpu_agent_gpu_stale{gpu="0"} 1`.

Only the simulated backend takes injected faults: with `--backend nvml` the baseline runs on the
real GPUs, then both phases again on a simulated `--profile` node on the same host
(`simulated_baseline`, `simulated_hanging`).

Usage: python3 -m bench.scrape_latency [--backend nvml] [--scrapes 1000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import re
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from bench.common import (
    REPO_ROOT,
    Node,
    Report,
    add_common_args,
    agent_env,
    make_node,
    print_rows,
    ratio,
    running_daemon,
    scrape,
    scratch_dir,
    summarize,
    target,
    wait_until,
)

HUNG_GPU = 0
HUNG_CALL = "temperature_celsius"
# A reply held back until the client's delayed ACK (about 40 ms on Linux) shows as scrapes this slow.
DELAYED_ACK_MS = 30.0
STALE_GPU0 = re.compile(rb'^gpu_agent_gpu_stale\{[^}]*gpu="0"[^}]*\} 1(\.0)?$', re.MULTILINE)


def scrape_phase(node: Node, scrapes: int, gap_seconds: float) -> dict[str, Any]:
    kept: list[float] = []
    fresh: list[float] = []
    bodies: list[bytes] = []
    with contextlib.closing(http.client.HTTPConnection(*node.metrics_address, timeout=10)) as connection:
        scrape(connection)  # connect outside the timings
        for _ in range(scrapes):
            begin = time.perf_counter()
            body = scrape(connection)
            kept.append(time.perf_counter() - begin)
            bodies.append(body)
            time.sleep(gap_seconds)
    for _ in range(max(1, scrapes // 4)):
        begin = time.perf_counter()
        with contextlib.closing(http.client.HTTPConnection(*node.metrics_address, timeout=10)) as connection:
            scrape(connection)
        fresh.append(time.perf_counter() - begin)
        time.sleep(gap_seconds)
    last = bodies[-1]
    return {
        "keepalive_ms": summarize(kept, 1e3),
        "fresh_connection_ms": summarize(fresh, 1e3),
        "body_bytes": len(last),
        "series": sum(1 for line in last.splitlines() if line and not line.startswith(b"#")),
        "scrapes_seeing_gpu0_stale": sum(1 for body in bodies if STALE_GPU0.search(body)),
    }


def inject(node: Node, *args: str) -> None:
    subprocess.run(
        node.cli("inject", *args), check=True, capture_output=True, env=agent_env(), cwd=REPO_ROOT, timeout=60
    )


def gpu0_stale(node: Node) -> bool:
    with contextlib.closing(http.client.HTTPConnection(*node.metrics_address, timeout=10)) as connection:
        return STALE_GPU0.search(scrape(connection)) is not None


def measure_node(args: argparse.Namespace, report: Report, backend: str, prefix: str) -> dict[str, dict[str, Any]]:
    """The baseline phase on a daemon of `backend`, and on a simulated one the hanging phase too."""
    gap = args.gap_ms / 1e3
    phases: dict[str, dict[str, Any]] = {}
    with scratch_dir("gab-scrape-") as directory:
        node = make_node(directory, backend, args.profile, interval_seconds=args.interval)
        with running_daemon(node):
            phases[f"{prefix}baseline"] = scrape_phase(node, args.scrapes, gap)
            if backend != "simulated":
                return phases
            inject(node, "hang", "--gpu", str(HUNG_GPU), "--call", HUNG_CALL, "--seconds", f"{args.hang_seconds:g}")
            hung_at = time.monotonic()
            if not wait_until(lambda: gpu0_stale(node), 30.0, 0.1):
                raise RuntimeError("the daemon never exported GPU 0 as stale after the injected hang")
            hanging = phases[f"{prefix}hanging"] = scrape_phase(node, args.scrapes, gap)
            hanging["stale_after_seconds"] = round(time.monotonic() - hung_at, 2)
            if time.monotonic() - hung_at > args.hang_seconds:
                report.note("the hang ended before the hanging phase did: raise --hang-seconds")
            inject(node, "hang", "--gpu", str(HUNG_GPU), "--call", HUNG_CALL, "--clear")
    return phases


def run(args: argparse.Namespace, report: Report) -> None:
    report.parameters.update(
        scrapes=args.scrapes, gap_ms=args.gap_ms, interval_seconds=args.interval, hang_seconds=args.hang_seconds
    )
    phases = measure_node(args, report, args.backend, "")
    if args.backend != "simulated":
        # A hang can only be injected into the simulated backend: the hang phase runs on a simulated
        # node on this same host, with its own baseline to compare against.
        report.note(f"hang phases ran on a simulated {args.profile} node on this host (simulated_* phases)")
        phases |= measure_node(args, report, "simulated", "simulated_")
    report.results["phases"] = phases
    for name, phase in phases.items():
        kept, fresh = phase["keepalive_ms"]["median"], phase["fresh_connection_ms"]["median"]
        if kept > DELAYED_ACK_MS and kept > 5 * fresh:
            report.note(
                f"{name}: a kept-alive scrape ({kept} ms) is far slower than a fresh connection ({fresh} ms): "
                "the signature of Nagle's algorithm meeting delayed ACKs (the server sends headers and body in "
                "separate writes without TCP_NODELAY)"
            )
    rows: list[list[object]] = [["phase", "connection", "series", "p50 ms", "p99 ms", "max ms", "scrapes"]]
    for name, phase in phases.items():
        for kind in ("keepalive_ms", "fresh_connection_ms"):
            s = phase[kind]
            rows.append([name, kind.removesuffix("_ms"), phase["series"], s["median"], s["p99"], s["max"], s["n"]])
    print_rows("/metrics scrape latency:", rows)
    base = phases["baseline"]["keepalive_ms"]
    report.targets.append(target("scrape p99 (kept-alive connection)", base["p99"], "<", 10.0, " ms"))
    prefix = "" if "hanging" in phases else "simulated_"
    hung, calm = phases[f"{prefix}hanging"]["keepalive_ms"], phases[f"{prefix}baseline"]["keepalive_ms"]
    report.results["hanging_over_baseline_p99"] = ratio(hung["p99"], calm["p99"])
    report.results["hanging_over_baseline_p50"] = ratio(hung["median"], calm["median"])
    report.targets.append(target("scrape p99 while an NVML call hangs", hung["p99"], "<", 10.0, " ms"))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python3 -m bench.scrape_latency", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--scrapes", type=int, default=1000, help="kept-alive scrapes per phase (default 1000)")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="pause between scrapes (default 2 ms)")
    parser.add_argument("--interval", type=float, default=1.0, help="the daemon's interval_seconds (default 1)")
    parser.add_argument("--hang-seconds", type=float, default=60.0, help="how long the injected call hangs")
    args = parser.parse_args(argv)
    report = Report("scrape_latency", args)
    run(args, report)
    return report.finish()


if __name__ == "__main__":
    main()
