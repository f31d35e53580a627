"""What one node's `/metrics` costs a fleet: series and bytes per scrape, by default and with every
family on, and what each family adds.

A daemon runs in enforce mode on a simulated node (default `h200x8`: eight H200 SXM with 18 NVLink
links each) with the bench policy and one service: a stand-in sglang server (`agent.demo.standin`)
with traffic, whose processes hold memory on every GPU. Once the service's histograms and counters
are in the scrape:

1. default: one scrape as Prometheus makes it (`Accept-Encoding: gzip`) and one plain: series,
   bytes on the wire and uncompressed;
2. per family (agent/names/metric_families.py): the config switches that one family from its default
   (`metrics.families`, applied by SIGHUP), and the scrape's series change is what the family adds
   when on (or takes away when off): the table docs/metrics.md shows;
3. everything on: the same figures as 1.

dcgm-exporter's default counters (etc/default-counters.csv of NVIDIA/dcgm-exporter: 21 fields, one
series per GPU each) are the comparison: 21 x GPUs. Target: the default scrape <= 400 series on the
8-GPU node with one service.

Usage: python3 -m bench.metrics_series [--profile h200x8] [--settle-seconds 8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import http.client
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from agent.demo.standin_process import StandinServer
from agent.names.metric_families import FAMILIES
from bench.common import (
    Node,
    Report,
    RunningDaemon,
    add_common_args,
    make_node,
    print_rows,
    running_daemon,
    scratch_dir,
    target,
    wait_until,
)

#: dcgm-exporter's etc/default-counters.csv: the fields it exports by default, one series per GPU each.
DCGM_DEFAULT_FIELDS = 21
#: The budget of a default scrape of an 8-GPU node with one service.
SERIES_BUDGET = 400
SERVICE = "sglang"


def scrape_text(node: Node, gzipped: bool) -> tuple[str, int]:
    """(the text, bytes on the wire) of one scrape, gzip asked for or not."""
    connection = http.client.HTTPConnection(*node.metrics_address, timeout=10)
    try:
        headers = {"Accept-Encoding": "gzip"} if gzipped else {}
        connection.request("GET", "/metrics", headers=headers)
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"/metrics: HTTP {response.status}")
        if gzipped:
            import gzip

            if response.getheader("Content-Encoding") != "gzip":
                raise RuntimeError("gzip asked for, not given")
            return gzip.decompress(body).decode(), len(body)
        return body.decode(), len(body)
    finally:
        connection.close()


def series_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def names(lines: Sequence[str]) -> Counter[str]:
    return Counter(line.split("{")[0].split(" ")[0] for line in lines)


def figures(node: Node) -> dict[str, Any]:
    text, wire = scrape_text(node, gzipped=True)
    plain, plain_bytes = scrape_text(node, gzipped=False)
    lines = series_of(text)
    return {
        "series": len(lines),
        "gzip_bytes": wire,
        "plain_bytes": plain_bytes,
        "series_per_gpu": None,
        "by_metric": dict(sorted(names(lines).items())),
        "_plain_series": len(series_of(plain)),
    }


def write_families(node: Node, listen: str, switched: dict[str, bool]) -> None:
    """The config's metrics line, with `switched` as metrics.families."""
    text = node.config_path.read_text(encoding="utf-8").splitlines()
    families = ", ".join(f"{name}: {'true' if on else 'false'}" for name, on in switched.items())
    line = f'metrics: {{listen: "{listen}", families: {{{families}}}}}'
    node.config_path.write_text(
        "\n".join(line if entry.startswith("metrics:") else entry for entry in text) + "\n", encoding="utf-8"
    )


def reloads_logged(daemon: RunningDaemon) -> int:
    return daemon.node.log_path.read_text(errors="replace").count('"event": "config reloaded"')


def reload(daemon: RunningDaemon, node: Node, listen: str, switched: dict[str, bool]) -> None:
    """Switch families and wait until the daemon took the reload (it logs it once the new families
    are in place)."""
    before = reloads_logged(daemon)
    write_families(node, listen, switched)
    daemon.process.send_signal(signal.SIGHUP)
    if not wait_until(lambda: reloads_logged(daemon) > before, 20.0, 0.1):
        raise RuntimeError(f"the daemon did not take the reload: {daemon.log_tail()}")


def service_config(server: StandinServer) -> str:
    return f"""services:
  - name: {SERVICE}
    manager: command
    start_command: [/bin/true]
    stop_command: [/bin/true]
    health_url: "{server.health_url}"
    gpus: all
    probe_interval_seconds: 1
    scrape_interval_seconds: 1
    slo: {{e2e_p95_seconds: 1.5, ttft_p95_seconds: 0.5}}
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--settle-seconds", type=float, default=8.0, help="after READY, before the first scrape")
    parser.add_argument("--no-families", action="store_true", help="skip the per-family toggles (a quick run)")
    args = parser.parse_args(argv)
    report = Report("metrics_series", args)
    if args.backend != "simulated":
        report.note("runs on a simulated node only (the stand-in service drives its GPUs): --backend ignored")
    report.parameters = {"profile": args.profile, "settle_seconds": args.settle_seconds, "service": SERVICE}
    with scratch_dir("gpu-agent-series-") as directory:
        node_dir = directory / "node"
        state_dir = node_dir / "state"
        gpus = _gpu_count(args.profile)
        standin_args = ("--flavor", "sglang", "--sim-state-dir", str(state_dir), "--sim-profile", args.profile)
        standin_args += ("--gpus", ",".join(str(gpu) for gpu in range(gpus)))
        with StandinServer(directory, extra_args=standin_args) as server:
            node = make_node(
                node_dir,
                "simulated",
                args.profile,
                interval_seconds=0.5,
                extra_yaml=service_config(server),
                mode="enforce",
            )
            listen = f"127.0.0.1:{node.port}"
            with running_daemon(node) as daemon:
                ready = wait_until(
                    lambda: all(
                        name in scrape_text(node, False)[0]
                        for name in (
                            "gpu_agent_service_request_duration_seconds_bucket",
                            "gpu_agent_service_gpu_energy_joules_total",
                            "gpu_agent_service_gpu_memory_bytes",
                        )
                    ),
                    60.0,
                    0.5,
                )
                if not ready:
                    raise RuntimeError(f"the service's figures never reached the scrape: {daemon.log_tail()}")
                time.sleep(args.settle_seconds)
                default = figures(node)
                per_family: dict[str, Any] = {}
                if not args.no_families:
                    for name, info in FAMILIES.items():
                        reload(daemon, node, listen, {name: not info.default_on})
                        switched = len(series_of(scrape_text(node, gzipped=False)[0]))
                        per_family[name] = {
                            "default_on": info.default_on,
                            "series_change": switched - default["series"],
                        }
                reload(daemon, node, listen, {name: True for name in FAMILIES})
                everything = figures(node)
    for found in (default, everything):
        found["series_per_gpu"] = round(found["series"] / gpus, 1)
        if found.pop("_plain_series") != found["series"]:
            report.note("the gzipped and the plain scrape differ in series (a loop between them)")
    report.results = {
        "gpus": gpus,
        "default": default,
        "everything_on": everything,
        "families": per_family,
        "dcgm_exporter_default_counters": {"fields": DCGM_DEFAULT_FIELDS, "series": DCGM_DEFAULT_FIELDS * gpus},
    }
    report.targets.append(target("default scrape series, one service", default["series"], "<=", SERIES_BUDGET))
    print_rows(
        f"/metrics of a simulated {args.profile} node with one service",
        [
            ("", "series", "per GPU", "bytes gzip", "bytes plain"),
            ("default", default["series"], default["series_per_gpu"], default["gzip_bytes"], default["plain_bytes"]),
            (
                "every family on",
                everything["series"],
                everything["series_per_gpu"],
                everything["gzip_bytes"],
                everything["plain_bytes"],
            ),
            ("dcgm-exporter default counters", DCGM_DEFAULT_FIELDS * gpus, DCGM_DEFAULT_FIELDS, "", ""),
        ],
    )
    if per_family:
        print_rows(
            "series each family adds (on by default: what switching it off takes away)",
            [("family", "default", "series")]
            + [
                (name, "on" if found["default_on"] else "off", abs(found["series_change"]))
                for name, found in per_family.items()
            ],
        )
    return report.finish()


def _gpu_count(profile: str) -> int:
    from agent.backend.sim import load_profile

    return len(load_profile(profile).models)


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
