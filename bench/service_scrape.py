"""What reading one inference server's /metrics costs the agent per loop.

A stand-in sglang server (`agent.demo.standin --flavor sglang`) runs as its own process with simulated
traffic and `--dp-ranks` data-parallel ranks (each rank exports the scheduler families and the
per-stage latency histograms once: an 8-GPU node with DP attention gives a page of real size).
Timed in rounds, each on the same page:

- fetch: the HTTP GET over loopback (`agent.services.scrape.fetch_text`);
- parse: `parse_reading` on the fetched text (the wanted families' lines, then prometheus-client's
  parser);
- scrape: both, as the daemon does each loop (`scrape`);
- parse_whole_page: prometheus-client's parser over the whole page, for comparison: what the
  line filter saves;
- window: one `LatencyWindow.add` + `figures()` with a full 5-minute window of 1 s scrapes.

Each call is timed in wall time and in the CPU time of the calling thread: the CPU time is what
the agent pays (the wall time of a fetch also waits for the server to render its page). The CPU
share is the median CPU cost of a scrape and a window step over a 1 s loop, for two services.

Usage: python3 -m bench.service_scrape [--dp-ranks 8] [--rounds 500] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from agent.demo.standin_process import free_port, wait_listening
from agent.services.scrape import fetch_text, parse_reading, scrape
from agent.services.window import LatencyWindow
from bench.common import Report, add_common_args, agent_env, print_rows, summarize, target

WINDOW_POINTS = 300  # a 5-minute window at a 1 s loop
# A busy server: 40 requests/s, up to 256 at once.
STANDIN = (
    sys.executable,
    "-m",
    "agent.demo.standin",
    "--flavor",
    "sglang",
    "--request-rate",
    "40",
    "--max-running",
    "256",
)


def timed(call: Callable[[], Any], rounds: int) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds of this thread) per call: the CPU time is the agent's own cost,
    without the server rendering its page or other processes taking the core."""
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(rounds):
        started, started_cpu = time.perf_counter(), time.thread_time()
        call()
        cpu.append(time.thread_time() - started_cpu)
        wall.append(time.perf_counter() - started)
    return wall, cpu


def run(args: argparse.Namespace, report: Report) -> None:
    port = free_port()
    report.parameters = {"dp_ranks": args.dp_ranks, "rounds": args.rounds, "window_points": WINDOW_POINTS}
    server = subprocess.Popen(
        [*STANDIN, "--port", str(port), "--dp-ranks", str(args.dp_ranks)],
        env=agent_env(),
        stdin=subprocess.DEVNULL,
    )
    try:
        if not wait_listening(port, 20.0):
            report.note("the stand-in did not listen; nothing measured")
            return
        time.sleep(args.warmup_seconds)  # some traffic, so the histograms are filled
        url = f"http://127.0.0.1:{port}/metrics"
        text = fetch_text(url)
        page = {"bytes": len(text.encode()), "lines": text.count("\n")}
        window = LatencyWindow("sglang")
        reading = parse_reading(text, "sglang", timestamp_seconds=0.0)
        for point in range(WINDOW_POINTS):
            window.add(parse_reading(text, "sglang", timestamp_seconds=float(point)))
        clock = [float(WINDOW_POINTS)]

        def window_step() -> None:
            clock[0] += 1.0
            window.add(replace(reading, timestamp_seconds=clock[0]))
            window.figures()

        phases = {
            "fetch": timed(lambda: fetch_text(url), args.rounds),
            "parse": timed(lambda: parse_reading(text, "sglang"), args.rounds),
            "scrape": timed(lambda: scrape(url, "sglang"), args.rounds),
            "parse_whole_page": timed(lambda: list(text_string_to_metric_families(text)), max(args.rounds // 5, 1)),
            "window": timed(window_step, args.rounds),
        }
    finally:
        server.terminate()
        server.wait(10)
    report.results = {"page": page}
    for name, (wall, cpu) in phases.items():
        report.results[name] = {"wall_ms": summarize(wall, 1e3), "cpu_ms": summarize(cpu, 1e3)}
    scrape_ms = report.results["scrape"]["cpu_ms"]["median"]
    per_loop_ms = scrape_ms + report.results["window"]["cpu_ms"]["median"]
    two_services_percent = round(2 * per_loop_ms / 1000 * 100, 3)
    report.results["cpu_percent_two_services_1s_loop"] = two_services_percent
    report.targets = [
        target("scrape and parse one real-sized sglang page (median CPU)", scrape_ms, "<", 5.0, " ms"),
        target("two services scraped every 1 s loop (share of one core)", two_services_percent, "<", 1.0, " %"),
    ]
    rows: list[Sequence[object]] = [("phase", "CPU median ms", "CPU p90 ms", "wall median ms", "wall p90 ms")]
    for name in phases:
        cpu_figures, wall_figures = report.results[name]["cpu_ms"], report.results[name]["wall_ms"]
        rows.append((name, cpu_figures["median"], cpu_figures["p90"], wall_figures["median"], wall_figures["p90"]))
    print_rows(f"sglang page: {page['bytes']} bytes, {page['lines']} lines, {args.dp_ranks} DP ranks", rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python3 -m bench.service_scrape", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--dp-ranks", type=int, default=8, help="sglang data-parallel ranks on the page (default 8)")
    parser.add_argument("--rounds", type=int, default=500, help="timed repetitions per phase (default 500)")
    parser.add_argument("--warmup-seconds", type=float, default=2.0, help="traffic before measuring (default 2)")
    args = parser.parse_args(argv)
    report = Report("service_scrape", args)
    run(args, report)
    return report.finish()


if __name__ == "__main__":
    main()
