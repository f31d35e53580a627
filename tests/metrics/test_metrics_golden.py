"""The whole `/metrics` text of one fixed node, compared with tests/fixtures/metrics-golden.txt (the
default families, what a scrape shows out of the box) and tests/fixtures/metrics-golden-all.txt (every
family on: `metrics.families`, every name the exporter knows).

Every HELP and TYPE line, series, label and value is part of the contract dashboards and alert rules
are written against, so a renamed help text, a changed label or an unintended new series fails here.
When a change to the exporter is meant, regenerate the files and review their diff:

    UPDATE_GOLDEN=1 PYTHONPATH=$PWD .venv/bin/python -m pytest tests/metrics/test_metrics_golden.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from snapshots import REVISION, VERSION, inference_fields, node_snapshot, telemetry_gpus

from agent.metrics.collector import SnapshotCollector
from agent.names.metric_families import DEFAULT_SWITCHES, FamilySwitches
from agent.state import NodeSnapshot

GOLDEN = Path(__file__).parents[1] / "fixtures" / "metrics-golden.txt"
GOLDEN_ALL = Path(__file__).parents[1] / "fixtures" / "metrics-golden-all.txt"
GOLDENS = {GOLDEN: DEFAULT_SWITCHES, GOLDEN_ALL: FamilySwitches.everything()}
PROMTOOL = shutil.which("promtool")


def golden_snapshot() -> NodeSnapshot:
    """tests/snapshots.py's mixed node (a lost GPU, a stale one, every health state, Xids with and
    without a GPU, ECC, remaps, PCIe trained down, throttling, GPU and node policy items, services,
    remediations, collectors) plus the two readings that node does not have, so that every family
    the exporter knows is in the file: a pending page retirement and a recovery action newer than
    this agent; the inference servers' figures, the SLO and the GPU processes per service; and issue
    14's telemetry: GPM activity, field values, memory v2, modes, clocks and a process on GPU 0,
    NVLink and an unfinished fabric registration on GPU 1, no GPM on the RTX."""
    gpu0, gpu1, gpu2, gpu3 = telemetry_gpus()
    return node_snapshot(
        gpus=(replace(gpu0, retired_pages_pending=False), gpu1, replace(gpu2, recovery_action=9), gpu3),
        **inference_fields(),
    )


def render_golden(switches: FamilySwitches = DEFAULT_SWITCHES) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(golden_snapshot, version=VERSION, revision=REVISION, switches=switches))
    return generate_latest(registry).decode()


@pytest.mark.parametrize("path", list(GOLDENS), ids=lambda path: path.name)
def test_metrics_text_matches_the_golden_file(path: Path) -> None:
    rendered = render_golden(GOLDENS[path])
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(rendered)
        pytest.skip(f"rewrote {path}: review its diff")
    assert path.exists(), f"{path} is missing: run with UPDATE_GOLDEN=1 to write it"
    golden = path.read_text()
    # compared line by line first, so a failure names the lines that differ
    assert rendered.splitlines() == golden.splitlines(), "metrics changed: if meant, regenerate (UPDATE_GOLDEN=1)"
    assert rendered == golden


def test_golden_file_holds_every_kind_of_series() -> None:
    golden = GOLDEN_ALL.read_text()
    for expected in (
        'gpu_agent_gpu_up{gpu="3",uuid="GPU-5e1b7a3c-0003-4d2e-9f10-6a7b8c9d0e03"} 0.0',  # lost
        'gpu_agent_gpu_stale{gpu="2",uuid="GPU-5e1b7a3c-0002-4d2e-9f10-6a7b8c9d0e02"} 1.0',
        'state="degraded",uuid="GPU-5e1b7a3c-0002-4d2e-9f10-6a7b8c9d0e02"} 1.0',
        'gpu_agent_xid_errors_total{gpu="",uuid="",xid="13"} 1.0',  # an Xid no GPU claimed
        'gpu_agent_policy_in_sync{gpu="",item="triton_cache",uuid=""} 0.0',  # a node item
        'gpu_agent_gpu_recovery_action{action="unknown_9",',
        'gpu_agent_gpu_retired_pages_pending{gpu="0",',
        'gpu_agent_remediations_total{action="reset_gpu",outcome="failed",rule="xid-reset-gpu"} 1.0',
        'gpu_agent_collector_success{collector="kmsg"} 0.0',
        'gpu_agent_service_up{service="embeddings",unit="embeddings.service"} 0.0',
        'gpu_agent_service_request_latency_seconds{kind="e2e",quantile="0.95",service="sglang"} 0.72',
        'gpu_agent_service_request_duration_seconds_bucket{kind="e2e",le="0.8",service="sglang"} 117.0',
        'gpu_agent_service_generated_tokens_total{service="sglang"} 96160.0',
        'gpu_agent_service_gpu_energy_joules_total{service="sglang"} 184923.0',
        'gpu_agent_service_metrics_up{service="embeddings"} 0.0',
        'gpu_agent_service_gpu_memory_bytes{gpu="0",service="sglang",',
        'gpu_agent_gpu_unattributed_memory_bytes{gpu="1",process="python",',
        'gpu_agent_service_latency_slo_seconds{kind="e2e",service="sglang"} 1.5',
        'gpu_agent_gpu_fault{cause="xid",gpu="1",',
        'gpu_agent_gpu_nvlink_link_errors_total{counter="crc_flit",gpu="1",link="1",',
        'gpu_agent_node_info{hostname="',
    ):
        assert expected in golden, expected


def test_the_default_golden_is_what_a_fleet_pays_for() -> None:
    """With the default families a node lists its verdicts and what happened, not every zero: no pid,
    no free text, no per-link NVLink series of a link without errors, no policy item that is fine."""
    golden = GOLDEN.read_text()
    series = [line for line in golden.splitlines() if line and not line.startswith("#")]
    assert len(series) < len(GOLDEN_ALL.read_text().splitlines()) / 2
    assert "pid=" not in golden
    assert not any('link="0"' in line for line in series)  # link 0 of GPU 1 has no errors and is up
    assert any('gpu_agent_gpu_nvlink_up{gpu="1",link="1"' in line for line in series)  # link 1 is down
    assert not any(line.startswith("gpu_agent_policy_in_sync") for line in series)
    assert any(line.startswith('gpu_agent_gpu_fault{cause="xid",gpu="1"') for line in series)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
@pytest.mark.parametrize("path", list(GOLDENS), ids=lambda path: path.name)
def test_promtool_accepts_the_golden_file(path: Path) -> None:
    assert PROMTOOL is not None
    with path.open() as golden:
        proc = subprocess.run(
            [PROMTOOL, "check", "metrics"], stdin=golden, capture_output=True, text=True, timeout=30, check=False
        )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
