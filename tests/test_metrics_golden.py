"""The whole `/metrics` text of one fixed node, compared with tests/fixtures/metrics-golden.txt.

Every HELP and TYPE line, series, label and value is part of the contract dashboards and alert rules
are written against, so a renamed help text, a changed label or an unintended new series fails here.
When a change to the exporter is meant, regenerate the file and review its diff:

    UPDATE_GOLDEN=1 PYTHONPATH=$PWD .venv/bin/python -m pytest tests/test_metrics_golden.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from snapshots import TIMESTAMP_SECONDS, VERSION, node_gpus, node_snapshot

from agent.gpu_attribution import GpuAttribution, GpuProcessInfo
from agent.metrics import SnapshotCollector
from agent.service_metrics import LatencyFigures, ServiceFigures
from agent.state import NodeSnapshot

GOLDEN = Path(__file__).parent / "fixtures" / "metrics-golden.txt"
PROMTOOL = shutil.which("promtool")


def golden_snapshot() -> NodeSnapshot:
    """tests/snapshots.py's mixed node (a lost GPU, a stale one, every health state, Xids with and
    without a GPU, ECC, remaps, PCIe trained down, throttling, GPU and node policy items, services,
    remediations, collectors) plus the two readings that node does not have, so that every family
    the exporter knows is in the file: a pending page retirement and a recovery action newer than
    this agent. The sglang server exports its figures (a quantile it could not give is absent), the
    embeddings server's last scrape failed; GPU processes map to sglang, one to no service."""
    gpu0, gpu1, gpu2, gpu3 = node_gpus()
    sglang = ServiceFigures(
        "sglang",
        "sglang",
        TIMESTAMP_SECONDS,
        300.0,
        latency={
            "e2e": LatencyFigures(120, 0.6, {0.5: 0.55, 0.95: 0.72, 0.99: 0.79}),
            "ttft": LatencyFigures(120, 0.11, {0.5: 0.1, 0.95: 0.15, 0.99: None}),
        },
        running=9,
        waiting=2,
        kv_cache_usage_ratio=0.41,
        generation_tokens_per_second=320.5,
    )
    embeddings = ServiceFigures("embeddings", "", 0.0, 0.0, error="timed out after 2 s")
    attribution = GpuAttribution(
        memory_bytes={"sglang": {0: 70 * 2**30, 1: 70 * 2**30}},
        pids={"sglang": (4100, 4101)},
        unattributed=(GpuProcessInfo(4242, 1, gpu1.uuid, 2**30, "jupyter.service", "python"),),
    )
    return node_snapshot(
        gpus=(replace(gpu0, retired_pages_pending=False), gpu1, replace(gpu2, recovery_action=9), gpu3),
        service_figures={"sglang": sglang, "embeddings": embeddings},
        gpu_attribution=attribution,
    )


def render_golden() -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(golden_snapshot, version=VERSION))
    return generate_latest(registry).decode()


def test_metrics_text_matches_the_golden_file() -> None:
    rendered = render_golden()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(rendered)
        pytest.skip(f"rewrote {GOLDEN}: review its diff")
    assert GOLDEN.exists(), f"{GOLDEN} is missing: run with UPDATE_GOLDEN=1 to write it"
    golden = GOLDEN.read_text()
    # compared line by line first, so a failure names the lines that differ
    assert rendered.splitlines() == golden.splitlines(), "metrics changed: if meant, regenerate (UPDATE_GOLDEN=1)"
    assert rendered == golden


def test_golden_file_holds_every_kind_of_series() -> None:
    golden = GOLDEN.read_text()
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
        'gpu_agent_service_metrics_up{service="embeddings"} 0.0',
        'gpu_agent_service_gpu_memory_bytes{gpu="0",service="sglang",',
        'gpu_agent_gpu_unattributed_memory_bytes{gpu="1",',
    ):
        assert expected in golden, expected


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_accepts_the_golden_file() -> None:
    assert PROMTOOL is not None
    with GOLDEN.open() as golden:
        proc = subprocess.run(
            [PROMTOOL, "check", "metrics"], stdin=golden, capture_output=True, text=True, timeout=30, check=False
        )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
