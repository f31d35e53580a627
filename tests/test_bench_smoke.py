"""Each benchmark runs in a tiny configuration and writes a valid result document.

Whether a figure meets its target is for the benchmark documents to judge (docs/, bench/results),
not for these tests: a tiny run on a loaded CI machine measures little. What is checked is that
each benchmark measured what it claims to (the hang was in effect while scrapes were timed, the
injected faults were seen, the status command answered from the daemon, ...) and that every figure
it reports against a target is a number in a sane range: wide enough for a loaded machine, narrow
enough that a benchmark measuring the wrong thing, or an agent 300 ms slower per scrape, fails.
"""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from nvml_replay import Replay, install_replay

from agent.backend.nvml import NvmlBackend
from bench import (
    cli_speed,
    collect_cost,
    daemon_footprint,
    detection_latency,
    metrics_series,
    run_all,
    scrape_latency,
    startup,
    status_wall,
)
from bench.common import REPO_ROOT, SCHEMA, make_node, percentile, summarize

pytestmark = pytest.mark.real_daemon


def sane_number(value: Any, low: float, high: float, what: str) -> None:
    assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{what}: {value!r} is not a number"
    assert math.isfinite(value) and low <= value <= high, f"{what}: {value} is outside the sane range [{low}, {high}]"


def read_document(
    path: Path, returned: dict[str, Any], benchmark: str, sane: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """The document on disk, checked; `sane` names every target it must report, with the range
    its measured value must fall in (a target not named there fails: a new one needs a range)."""
    document: dict[str, Any] = json.loads(path.read_text())
    assert document == json.loads(json.dumps(returned))
    assert document["schema"] == SCHEMA
    assert document["benchmark"] == benchmark
    assert document["machine"]["gpu_count"] >= 1
    assert document["results"]
    assert sorted(goal["name"] for goal in document["targets"]) == sorted(sane)
    for goal in document["targets"]:
        sane_number(goal["value"], *sane[goal["name"]], goal["name"])
    # every figure in a summary is ordered as its name says
    figures = [value for value in _walk(document["results"]) if isinstance(value, dict) and "median" in value]
    for figure in figures:
        assert figure["min"] <= figure["median"] <= figure["p90"] <= figure["p99"] <= figure["max"]
    return document


def run_benchmark(
    tmp_path: Path, benchmark: ModuleType, args: list[str], sane: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """Run `benchmark` with `args`, writing its document under tmp_path; the document, checked by
    read_document against what main() returned."""
    name = benchmark.__name__.rpartition(".")[2]
    out = tmp_path / f"{name}.json"
    returned = benchmark.main([*args, "--out", str(out)])
    return read_document(out, returned, name, sane)


def _walk(value: Any) -> Any:
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from _walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item)


def test_statistics() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert summarize([0.001, 0.002, 0.003], 1e3) == {
        "n": 3,
        "mean": 2.0,
        "median": 2.0,
        "p90": 2.8,
        "p99": 2.98,
        "min": 1.0,
        "max": 3.0,
    }
    assert summarize([]) == {"n": 0}


def test_collect_cost_simulated(tmp_path: Path) -> None:
    args = ["--profile", "h200x2", "--rounds", "20", "--seconds", "0.2", "--lane-calls", "200"]
    ratios = (0.3, 20.0)  # the agent's poll over the same raw getters: overhead, not a different workload
    sane = {"agent fast poll / raw getters": ratios, "agent fast+slow poll / raw getters": ratios}
    document = run_benchmark(tmp_path, collect_cost, args, sane)
    results = document["results"]
    assert set(results["per_poll_ms"]) == {"agent_fast", "agent_fast_lanes", "raw_fast", "agent_full", "raw_full"}
    assert document["parameters"]["gpus"] == 2
    # 13 fast readers on a fan-less H200 (the fan count, no speeds), 13 more slow ones, per GPU;
    # the profiling telemetry adds per GPU: 13 fast getters + GPM + the fast field batch; 13 slow + the slow batch, memory max threshold,
    # MIG, 3 max and 2 application clocks, processes (no NVLink or fabric on this node: left out)
    assert document["parameters"]["raw_calls_per_poll"] == {"fast": 30, "full": 76}
    assert results["ratios"]["fast_poll_over_raw"] > 0
    assert results["lane_handoff"]["through_lane_us"]["n"] == 200
    assert "nvml backend only" in results["nvidia_smi"]["skipped"]
    for name, summary in results["per_poll_ms"].items():
        sane_number(summary["median"], 0.001, 100.0, f"{name} poll of 2 simulated GPUs, ms")


def test_collect_cost_nvml_replay_with_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The nvml path on a replayed H200, and the nvidia-smi pairing against a stand-in that
    knows only some fields (an older driver names the clock-event field after throttling).

    The stand-in's queries take at least 40 ms, as a real nvidia-smi does (27 ms on the H200): a
    bare shell script ends in about the time a replayed poll takes (a ratio near 1 either way on a
    loaded machine), and a timer that did not wait for the process would not see the 40 ms."""
    install_replay(monkeypatch)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --help-query-gpu) printf \'"temperature.gpu"\\nGPU core temperature.\\n'
        '"power.draw"\\n"clocks_throttle_reasons.active" or "clocks_throttle_reasons_active"\\n\';;\n'
        '  --query-gpu=*,*) sleep 0.04; echo "33, 120.5, 0x1";;\n'
        "  --query-gpu=pstate) echo P0;;\n"
        "  *) exit 2;;\n"
        "esac\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    nvml_args = ["--backend", "nvml", "--rounds", "10", "--seconds", "0.1", "--smi-runs", "2", "--lane-calls", "50"]
    sane = {
        "agent fast poll / raw getters": (0.3, 20.0),
        "agent fast+slow poll / raw getters": (0.3, 20.0),
        # a 40 ms process against an in-process poll of about a millisecond
        "nvidia-smi query / agent poll (fast)": (2.0, 1e6),
    }
    document = run_benchmark(tmp_path, collect_cost, nvml_args, sane)
    assert document["machine"]["gpu_names"] == ["NVIDIA H200"]
    assert document["parameters"]["nvml_functions_chosen"] == {
        "temperature": "nvmlDeviceGetTemperatureV",
        "clock_event_reasons": "nvmlDeviceGetCurrentClocksEventReasons",
    }
    smi_result = document["results"]["nvidia_smi"]
    fields = smi_result["command_fast"].split("--query-gpu=")[1].split()[0].split(",")
    assert fields == ["temperature.gpu", "power.draw", "clocks_throttle_reasons.active", "pstate"]
    assert "memory.used" in smi_result["fields_without_query_name"]
    assert smi_result["sample_output"] == ["33, 120.5, 0x1"]
    assert smi_result["per_run_ms"]["nvidia_smi_fast"]["n"] == 2
    assert smi_result["per_run_ms"]["nvidia_smi_fast"]["min"] >= 40
    assert smi_result["smi_over_poll_fast"] > 0
    assert "nvidia-smi query / agent poll (fast)" in [t["name"] for t in document["targets"]]


def test_collect_cost_raw_field_batches_are_the_agents(replay: Replay, backend: NvmlBackend) -> None:
    backend.fast_fields(0)
    backend.slow_fields(0)
    batches = [sorted(call.args[0]) for call in replay.log if call.name == "nvmlDeviceGetFieldValues"]
    assert batches == [sorted(collect_cost.FAST_FIELD_IDS), sorted(collect_cost.SLOW_FIELD_IDS)]


def test_daemon_footprint(tmp_path: Path) -> None:
    args = ["--profiles", "h200", "--seconds", "1.5", "--warmup", "0.2", "--interval", "0.2"]
    sane = {"daemon CPU, mean % of one core, 1 GPU(s)": (0.01, 80.0), "daemon RSS max, 1 GPU(s)": (10.0, 1000.0)}
    document = run_benchmark(tmp_path, daemon_footprint, args, sane)
    (node,) = document["results"]["nodes"]
    assert node["gpus"] == 1
    assert node["window_seconds"] >= 1.0
    assert node["cpu_percent_mean"] > 0
    assert 10 < node["rss_mb_max"] <= node["peak_rss_mb_vmhwm"] + 1  # sampled once a second vs the kernel's peak
    assert node["threads"] > 3  # the loop, a GPU lane, the servers, the watchers
    assert node["last_loop_seconds"] is not None


def test_scrape_latency_with_a_hung_call(tmp_path: Path) -> None:
    args = ["--profile", "h200x2", "--scrapes", "12", "--interval", "0.2", "--hang-seconds", "20"]
    # A local scrape of 2 simulated GPUs takes milliseconds; 250 ms leaves room for a loaded machine
    # and none for an agent that adds 300 ms to every scrape.
    sane = dict.fromkeys(("scrape p99 (kept-alive connection)", "scrape p99 while an NVML call hangs"), (0.01, 250.0))
    document = run_benchmark(tmp_path, scrape_latency, args, sane)
    baseline, hanging = document["results"]["phases"]["baseline"], document["results"]["phases"]["hanging"]
    assert baseline["keepalive_ms"]["n"] == 12 and baseline["fresh_connection_ms"]["n"] == 3
    assert baseline["scrapes_seeing_gpu0_stale"] == 0
    assert hanging["scrapes_seeing_gpu0_stale"] == 12  # the hang held for the whole phase
    assert baseline["series"] > 50
    for phase in (baseline, hanging):
        sane_number(phase["keepalive_ms"]["median"], 0.01, 100.0, "scrape median, ms")
    assert len(document["targets"]) == 2


def test_metrics_series(tmp_path: Path) -> None:
    """Series and bytes of a node's scrape, by default and with every family on (the per-family
    toggles are left out of the smoke run: a reload each)."""
    args = ["--profile", "h200x2", "--settle-seconds", "0.5", "--no-families"]
    document = run_benchmark(tmp_path, metrics_series, args, {"default scrape series, one service": (30.0, 400.0)})
    default, everything = document["results"]["default"], document["results"]["everything_on"]
    assert default["series"] < everything["series"]
    assert default["gzip_bytes"] < default["plain_bytes"] / 3  # the scrape Prometheus makes is gzipped
    assert "gpu_agent_service_request_duration_seconds_bucket" in default["by_metric"]
    assert (
        "gpu_agent_gpu_nvlink_up" not in default["by_metric"] and "gpu_agent_gpu_nvlink_up" in everything["by_metric"]
    )
    assert document["results"]["dcgm_exporter_default_counters"] == {"fields": 21, "series": 42}


def test_detection_latency(tmp_path: Path) -> None:
    tiny = ["--profile", "h200x2", "--injections", "1", "--service-rounds", "1", "--interval", "0.2"]
    args = [*tiny, "--probe-interval", "0.1", "--action-grace", "0.5"]
    # fault -> action started with a 0.2 s loop and events that wake it: well under 5 s
    sane = {f"{fault} -> action_started p99": (0.1, 5000.0) for fault in ("xid_nvml", "xid_kmsg", "service")}
    document = run_benchmark(tmp_path, detection_latency, args, sane)
    results = document["results"]
    assert set(results) == {"xid_nvml", "xid_kmsg", "service"}
    for summary in results.values():
        # the daemon logs the event, then "action started" and "action finished" for the rule
        assert summary["milestones_present"][:3] == ["action_finished", "action_started", "event_visible"]
        assert summary["headline"] == "action_started"
        assert summary["missed"] == 0
        visible = summary["milestones"]["event_visible"]
        assert visible["observed_ms"]["n"] == 1
        assert 0 < visible["logged_ms"]["median"] < 5000
        assert summary["headline_p99_ms"] is not None


def test_startup(tmp_path: Path) -> None:
    document = run_benchmark(tmp_path, startup, ["--profile", "h200", "--runs", "1"], {})
    results = document["results"]
    sane_number(results["ready_ms"]["median"], 50.0, 30_000.0, "start to READY=1, ms")
    assert results["ready_ms"]["n"] == 1
    assert results["first_ready_ms"] == results["ready_ms"]["median"]
    assert results["ready_ms_after_first"] == {"n": 0}
    assert results["python_bare_ms"]["median"] < results["ready_ms"]["median"]


def test_status_wall(tmp_path: Path) -> None:
    sane = {"gpu-agent status against a daemon, median": (10.0, 10_000.0)}
    document = run_benchmark(tmp_path, status_wall, ["--profile", "h200", "--runs", "3"], sane)
    results = document["results"]
    assert {"status_daemon", "status_direct", "python_bare"} <= set(results["wall_ms"])
    assert results["exit_codes"]["status_daemon"] == [0]
    assert results["exit_codes"]["status_direct"] == [0]
    # Paired medians of three rounds, sane rather than tight: with the suite on two workers, one
    # round's bare start took as long as the status call beside it (73 ms each).
    assert 0.5 < results["ratios"]["daemon_over_python_bare"] < 200


def test_cli_speed(tmp_path: Path) -> None:
    sane = {
        # Medians of three paired rounds: one round's bare start can take 180 ms on a busy machine.
        "status against the daemon / python3 -c pass": (0.5, 200.0),
        "status --direct / the reference read": (0.1, 200.0),
        "--version / python3 -c pass": (0.3, 100.0),
        "--help / python3 -c pass": (0.3, 100.0),
        "daemon CPU, 1 s loop, two services (% of one core)": (0.001, 100.0),
    }
    args = ["--profile", "h200", "--runs", "3", "--cpu-seconds", "2", "--warmup", "0.5"]
    document = run_benchmark(tmp_path, cli_speed, args, sane)
    results = document["results"]
    names = {"python_bare", "reference_read", "version", "help", "argparse_floor", "status_daemon", "status_direct"}
    assert names <= set(results["wall_ms"])
    assert results["exit_codes"]["version"] == results["exit_codes"]["help"] == [0]
    assert results["exit_codes"]["argparse_floor"] == [0]
    assert results["exit_codes"]["status_daemon"] in ([0], [2])
    for run in ("daemon_two_services", "daemon_two_services_scraped_every_second"):
        assert results[run]["services"] == {
            "sglang-0": {"up": True, "scraped": True},
            "sglang-1": {"up": True, "scraped": True},
        }
        assert results[run]["cpu_percent_of_one_core"] > 0


def test_daemon_profile_charges_the_daemons_threads(tmp_path: Path) -> None:
    node = make_node(tmp_path / "node", "simulated", "h200", interval_seconds=0.2)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.daemon_profile",
            "--config",
            str(node.config_path),
            "--seconds",
            "2",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "daemon exited 0" in done.stdout
    by_thread = done.stdout.split("by thread")[1].split("inclusive")[0]
    assert "MainThread" in by_thread and "gpu-agent-gpu0" in by_thread, done.stdout


def test_run_all_merges(tmp_path: Path) -> None:
    merged = run_all.main(["--only", "collect_cost", "--quick", "--profile", "h200", "--out-dir", str(tmp_path)])
    assert merged["failures"] == {}
    on_disk = json.loads((tmp_path / "all.json").read_text())
    assert on_disk["benchmarks"]["collect_cost"] == json.loads((tmp_path / "collect_cost.json").read_text())
    assert on_disk["machine"]["backend"] == "simulated"
    assert any(row["figure"] == "poll / raw, fast tier" for row in on_disk["figures"])
    assert {t["benchmark"] for t in on_disk["targets"]} == {"collect_cost"}
    with pytest.raises(SystemExit):
        run_all.main(["--only", "nonsense", "--out-dir", str(tmp_path)])
