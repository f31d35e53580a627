"""Run a chosen set of benchmarks, each as its own process, and merge their JSON documents.

    python3 -m bench.run_all --backend simulated --out-dir bench/results/buildhost-DATE
    python3 -m bench.run_all --backend nvml --label "H200 (nvml)" --out-dir OUT

Writes OUT/<benchmark>.json for each benchmark and OUT/all.json: every document under
`benchmarks`, the machine, every target with its verdict, and the key figures in one table
(printed at the end too). A benchmark that fails is recorded under `failures`; the others still
run. With `--backend nvml` the agent only reads (observe mode, no rules, NVML getters and
nvidia-smi queries); detection_latency needs injected faults, so it runs a simulated node on the
same host and says so.

`--quick` shortens every benchmark (about a minute in all): a check that they run, not figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import BACKENDS, DEFAULT_PROFILE, REPO_ROOT, SCHEMA, agent_env

BENCHMARKS = (
    "collect_cost",
    "daemon_footprint",
    "scrape_latency",
    "detection_latency",
    "startup",
    "status_wall",
    "cli_speed",
    "metrics_series",
)

# Arguments for --quick; a full run takes each benchmark's defaults.
QUICK: dict[str, list[str]] = {
    "collect_cost": ["--seconds", "1", "--rounds", "50", "--smi-runs", "5", "--lane-calls", "500"],
    "daemon_footprint": ["--seconds", "5", "--warmup", "1"],
    "scrape_latency": ["--scrapes", "100", "--hang-seconds", "30"],
    "detection_latency": ["--injections", "3", "--service-rounds", "2", "--action-grace", "1.5"],
    "startup": ["--runs", "2"],
    "status_wall": ["--runs", "2"],
    "cli_speed": ["--runs", "2", "--cpu-seconds", "3", "--warmup", "1"],
    "metrics_series": ["--settle-seconds", "1", "--no-families"],
}


def _figure(document: dict[str, Any], *path: str) -> Any:
    value: Any = document.get("results", {})
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def key_figures(name: str, document: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(figure, value, unit) rows for the docs table."""
    rows: list[tuple[str, Any, str]] = []
    if name == "collect_cost":
        gpus = document["parameters"]["gpus"]
        for variant in ("agent_fast", "agent_fast_lanes", "raw_fast", "agent_full", "raw_full"):
            rows.append(
                (f"poll of {gpus} GPU(s), {variant}, median", _figure(document, "per_poll_ms", variant, "median"), "ms")
            )
        rows.append(("poll / raw, fast tier", _figure(document, "ratios", "fast_poll_over_raw"), "x"))
        rows.append(("poll / raw, fast + slow tier", _figure(document, "ratios", "full_poll_over_raw"), "x"))
        rows.append(("BoundedRunner hand-off, median", _figure(document, "lane_handoff", "overhead_median_us"), "us"))
        smi = _figure(document, "nvidia_smi")
        if isinstance(smi, dict) and "skipped" not in smi:
            rows.append(("nvidia-smi --query-gpu, median", smi["per_run_ms"]["nvidia_smi_fast"]["median"], "ms"))
            rows.append(("nvidia-smi / poll, fast tier", smi["smi_over_poll_fast"], "x"))
    elif name == "daemon_footprint":
        for node in _figure(document, "nodes") or []:
            where = f"{node['gpus']} GPU(s)"
            rows.append((f"daemon CPU mean, {where}", node["cpu_percent_mean"], "% of a core"))
            rows.append((f"daemon RSS max, {where}", node["rss_mb_max"], "MB"))
    elif name == "scrape_latency":
        for phase, figures in (_figure(document, "phases") or {}).items():
            where = f"{phase}, {figures['series']} series"
            rows.append((f"/metrics scrape p50, {where}", figures["keepalive_ms"]["median"], "ms"))
            rows.append((f"/metrics scrape p99, {where}", figures["keepalive_ms"]["p99"], "ms"))
    elif name == "detection_latency":
        for fault, summary in (document.get("results") or {}).items():
            rows.append((f"{fault} -> {summary['headline']}, p50", _headline(summary, "median"), "ms"))
            rows.append((f"{fault} -> {summary['headline']}, p99", summary["headline_p99_ms"], "ms"))
    elif name == "metrics_series":
        for case in ("default", "everything_on"):
            scrape = case.replace("_", " ")
            rows.append((f"/metrics series, {scrape}", _figure(document, case, "series"), "series"))
            rows.append((f"/metrics bytes gzipped, {scrape}", _figure(document, case, "gzip_bytes"), "B"))
    elif name == "startup":
        rows.append(("spawn -> READY=1, median", _figure(document, "ready_ms", "median"), "ms"))
        rows.append(("SIGTERM -> exit, median", _figure(document, "stop_ms", "median"), "ms"))
    elif name == "status_wall":
        for command in ("status_daemon", "status_direct", "nvidia_smi_q", "python_bare"):
            median = _figure(document, "wall_ms", command, "median")
            if median is not None:
                rows.append((f"{command} wall, median", median, "ms"))
    elif name == "cli_speed":
        for command in ("status_daemon", "status_direct", "version", "help", "reference_read", "python_bare"):
            median = _figure(document, "wall_ms", command, "median")
            if median is not None:
                rows.append((f"{command} wall, median", median, "ms"))
        for ratio, value in (_figure(document, "ratios") or {}).items():
            rows.append((ratio.replace("_over_", " / "), value, "x"))
        rows.append(
            (
                "daemon CPU, 1 s loop, two services",
                _figure(document, "daemon_two_services", "cpu_percent_of_one_core"),
                "% of a core",
            )
        )
    return rows


def _headline(summary: dict[str, Any], statistic: str) -> Any:
    figures = summary["milestones"].get(summary["headline"], {})
    chosen = figures.get("logged_ms") if figures.get("logged_ms", {}).get("n") else figures.get("observed_ms", {})
    return (chosen or {}).get(statistic)


def benchmark_argv(name: str, args: argparse.Namespace, out: Path) -> list[str]:
    extra = QUICK[name] if args.quick else []
    argv = [sys.executable, "-m", f"bench.{name}", "--backend", args.backend, "--out", str(out), *extra]
    if args.label:
        argv += ["--label", args.label]
    if name != "daemon_footprint":  # it runs its own set of simulated nodes (--profiles)
        argv += ["--profile", args.profile]
    return argv


def run_one(
    name: str, args: argparse.Namespace, print_line: Callable[[str], None]
) -> tuple[dict[str, Any] | None, str]:
    out: Path = args.out_dir / f"{name}.json"
    argv = benchmark_argv(name, args, out)
    print_line(f"== {name}: {' '.join(argv[1:])}")
    started = time.monotonic()
    try:
        completed = subprocess.run(argv, env=agent_env(), cwd=REPO_ROOT, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {args.timeout:g} s"
    print_line(f"== {name}: exit {completed.returncode} after {time.monotonic() - started:.0f} s")
    if completed.returncode != 0:
        return None, f"exit {completed.returncode}"
    return json.loads(out.read_text()), ""


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python3 -m bench.run_all", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default="simulated")
    parser.add_argument(
        "--profile", default=DEFAULT_PROFILE, help=f"simulated node profile (default {DEFAULT_PROFILE})"
    )
    parser.add_argument("--label", help="where the figures come from, e.g. 'H200 (nvml)'")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the JSON documents go")
    parser.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true", help="tiny runs: checks that they work, not figures")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark before it is stopped")
    args = parser.parse_args(argv)
    chosen = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(line, flush=True)

    started = time.monotonic()
    documents: dict[str, Any] = {}
    failures: dict[str, str] = {}
    for name in chosen:
        document, error = run_one(name, args, say)
        if document is None:
            failures[name] = error
        else:
            documents[name] = document
    figures = [
        {"benchmark": name, "figure": figure, "value": value, "unit": unit}
        for name, document in documents.items()
        for figure, value, unit in key_figures(name, document)
    ]
    targets = [dict(goal, benchmark=name) for name, document in documents.items() for goal in document["targets"]]
    merged = {
        "schema": SCHEMA,
        "benchmark": "run_all",
        "label": args.label,
        "backend": args.backend,
        "quick": args.quick,
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "duration_seconds": round(time.monotonic() - started, 1),
        "machine": next((d["machine"] for d in documents.values() if d["machine"]["backend"] == args.backend), None),
        "figures": figures,
        "targets": targets,
        "failures": failures,
        "benchmarks": documents,
    }
    (args.out_dir / "all.json").write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    say(f"\n== key figures ({args.label or args.backend}):")
    for row in figures:
        say(f"  {row['benchmark']:<18} {row['figure']:<48} {row['value']} {row['unit']}")
    say("== targets:")
    for goal in targets:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[goal["met"]]
        say(f"  {goal['benchmark']:<18} {goal['name']:<48} {goal['value']}{goal['unit']} ({goal['target']}): {verdict}")
    for name, error in failures.items():
        say(f"== FAILED {name}: {error}")
    say(f"wrote {args.out_dir / 'all.json'} in {merged['duration_seconds']:.0f} s")
    return merged


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
