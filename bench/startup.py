"""Start-up time: from `gpu-agent run` being spawned to READY=1 on a real sd_notify socket.

READY=1 is sent after the first full collection (fast and slow tier, the policy plan), so this is
what `systemctl start gpu-agent` waits for under `Type=notify`. Each run starts the daemon on the
same node (its state directory kept, as across restarts of a real host), reads READY=1 from an
AF_UNIX datagram socket named by NOTIFY_SOCKET, then stops it with SIGTERM and times the exit.
The first run is also reported alone (a cold page cache and a new event store).

For scale, the same number of runs of a bare `python3 -c pass` and of `python3 -c "import
agent.daemon"` (what the interpreter and the imports alone cost) are timed in between.

Usage: python3 -m bench.startup [--backend nvml] [--runs 10] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from bench.common import (
    Report,
    RunningDaemon,
    add_common_args,
    make_node,
    print_rows,
    scratch_dir,
    summarize,
    timed_run,
)

PYTHON_BARE = [sys.executable, "-c", "pass"]
PYTHON_IMPORTS = [sys.executable, "-c", "import agent.cli, agent.daemon"]


def run(args: argparse.Namespace, report: Report) -> None:
    report.parameters.update(runs=args.runs, interval_seconds=args.interval)
    ready: list[float] = []
    stop: list[float] = []
    bare: list[float] = []
    imports: list[float] = []
    with scratch_dir("gab-start-") as directory:
        node = make_node(directory, args.backend, args.profile, interval_seconds=args.interval)
        for _ in range(args.runs):
            daemon = RunningDaemon(node)
            try:
                ready.append(daemon.wait_for("READY", 120.0) - daemon.spawned)
            finally:
                stop.append(daemon.stop())
            bare.append(timed_run(PYTHON_BARE)[0])
            imports.append(timed_run(PYTHON_IMPORTS)[0])
    results: dict[str, Any] = {
        "ready_ms": summarize(ready, 1e3, 1),
        "ready_ms_after_first": summarize(ready[1:], 1e3, 1),
        "first_ready_ms": round(ready[0] * 1e3, 1),
        "stop_ms": summarize(stop, 1e3, 1),
        "python_bare_ms": summarize(bare, 1e3, 1),
        "python_imports_ms": summarize(imports, 1e3, 1),
    }
    report.results.update(results)
    rows: list[list[object]] = [["what", "median ms", "p90 ms", "max ms", "runs"]]
    for name in ("ready_ms", "stop_ms", "python_bare_ms", "python_imports_ms"):
        s = results[name]
        rows.append([name.removesuffix("_ms"), s["median"], s["p90"], s["max"], s["n"]])
    print_rows(f"spawn -> READY=1 ({args.backend}), first run {results['first_ready_ms']} ms:", rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python3 -m bench.startup", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--runs", type=int, default=10, help="daemon starts (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="the daemon's interval_seconds (default 1)")
    args = parser.parse_args(argv)
    report = Report("startup", args)
    run(args, report)
    return report.finish()


if __name__ == "__main__":
    main()
