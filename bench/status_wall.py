"""Wall time of `gpu-agent status` as a fresh process: from the daemon, read directly, and nvidia-smi.

With a daemon running on the node, each round runs, in a rotating order, each of:

- `gpu-agent status` (it asks the daemon over the Unix socket: imports + one request);
- `gpu-agent status --direct` (no daemon: NVML init, one full collection and a policy plan);
- `nvidia-smi -q` on the same host, when it is there (the operator's habit this replaces);
- a bare `python3 -c pass`, the interpreter's own floor.

Ratios are taken round by round (each pair ran next to each other), then their median.

Usage: python3 -m bench.status_wall [--backend nvml] [--runs 10] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from bench.common import (
    Report,
    add_common_args,
    make_node,
    paired_ratio,
    print_rows,
    require_daemon_status,
    running_daemon,
    scratch_dir,
    summarize,
    target,
    time_processes,
)


def run(args: argparse.Namespace, report: Report) -> None:
    smi = shutil.which("nvidia-smi")
    with scratch_dir("gab-status-") as directory:
        node = make_node(directory, args.backend, args.profile, interval_seconds=args.interval)
        commands: dict[str, list[str]] = {
            "status_daemon": node.cli("status"),
            "status_direct": node.cli("status", "--direct"),
            "python_bare": [sys.executable, "-c", "pass"],
        }
        if smi is not None:
            commands["nvidia_smi_q"] = [smi, "-q"]
        else:
            report.note("nvidia-smi not found: no nvidia-smi -q pairing")
        report.parameters.update(
            runs=args.runs, commands={name: " ".join(argv) for name, argv in commands.items()}, backend=args.backend
        )
        with running_daemon(node):
            require_daemon_status(node)
            times, exits = time_processes(commands, args.runs, env=node.env())
    results: dict[str, Any] = {
        "wall_ms": {name: summarize(values, 1e3, 1) for name, values in times.items()},
        "exit_codes": exits,
        "ratios": {
            "daemon_over_python_bare": paired_ratio(times, "status_daemon", "python_bare"),
            "direct_over_daemon": paired_ratio(times, "status_direct", "status_daemon"),
        },
    }
    if "nvidia_smi_q" in times:
        results["ratios"]["daemon_over_nvidia_smi_q"] = paired_ratio(times, "status_daemon", "nvidia_smi_q")
        results["ratios"]["direct_over_nvidia_smi_q"] = paired_ratio(times, "status_direct", "nvidia_smi_q")
    report.results.update(results)
    rows: list[list[object]] = [["command", "median ms", "p90 ms", "max ms", "runs"]]
    rows += [[name, s["median"], s["p90"], s["max"], s["n"]] for name, s in results["wall_ms"].items()]
    print_rows(f"cold-process wall time ({args.backend}):", rows)
    print(f"  ratios (paired medians): {results['ratios']}")
    report.targets.append(
        target(
            "gpu-agent status against a daemon, median",
            results["wall_ms"]["status_daemon"]["median"],
            "<",
            300.0,
            " ms",
        )
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python3 -m bench.status_wall", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--runs", type=int, default=10, help="rounds (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="the daemon's interval_seconds (default 1)")
    args = parser.parse_args(argv)
    report = Report("status_wall", args)
    run(args, report)
    return report.finish()


if __name__ == "__main__":
    main()
