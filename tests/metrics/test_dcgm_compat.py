"""dcgm-exporter compatibility rules (packaging/prometheus/gpu-agent-dcgm-compat.yaml): the shipped file is
what the reading table writes, they load, every DCGM name has a promtool unit test
(tests/prometheus/dcgm_compat.yaml), and every gpu-agent metric they read is one the exporter serves."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from snapshots import node_snapshot, telemetry_gpus

from agent.metrics.collector import SnapshotCollector
from agent.metrics.dcgm import compat_rules
from agent.names.metric_families import FamilySwitches

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "packaging/prometheus/gpu-agent-dcgm-compat.yaml"
UNIT_TESTS = ROOT / "tests/prometheus/dcgm_compat.yaml"
PROMTOOL = shutil.which("promtool")
METRIC_NAME = re.compile(r"\bgpu_agent_[a-z_]+")


def recorded() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"]: rule["expr"] for group in groups for rule in group["rules"]}


def test_the_shipped_rules_are_the_ones_the_reading_table_writes() -> None:
    assert RULES.read_text() == compat_rules(), "regenerate: python -m agent.metrics.dcgm > " + str(
        RULES.relative_to(ROOT)
    )


def test_the_common_dcgm_exporter_fields_are_recorded() -> None:
    names = set(recorded())
    for field in (
        "GPU_TEMP",
        "MEMORY_TEMP",
        "POWER_USAGE",
        "SM_CLOCK",
        "MEM_CLOCK",
        "GPU_UTIL",
        "MEM_COPY_UTIL",
        "FB_USED",
        "FB_FREE",
        "TOTAL_ENERGY_CONSUMPTION",
        "XID_ERRORS",
        "PCIE_REPLAY_COUNTER",
        "PCIE_TX_THROUGHPUT",
        "PCIE_RX_THROUGHPUT",
        "POWER_MGMT_LIMIT",
        "CLOCKS_EVENT_REASONS",
        "ECC_SBE_AGG_TOTAL",
        "ECC_DBE_AGG_TOTAL",
        "ECC_SBE_VOL_TOTAL",
        "ECC_DBE_VOL_TOTAL",
        "CORRECTABLE_REMAPPED_ROWS",
        "UNCORRECTABLE_REMAPPED_ROWS",
        "ROW_REMAP_FAILURE",
    ):
        assert f"DCGM_FI_DEV_{field}" in names
    for field in (
        "GR_ENGINE_ACTIVE",
        "SM_ACTIVE",
        "SM_OCCUPANCY",
        "PIPE_TENSOR_ACTIVE",
        "DRAM_ACTIVE",
        "PCIE_TX_BYTES",
        "PCIE_RX_BYTES",
    ):
        assert f"DCGM_FI_PROF_{field}" in names
    assert {"DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES"} <= names


def test_every_dcgm_name_has_a_unit_test() -> None:
    document = yaml.safe_load(UNIT_TESTS.read_text())
    tested = {case["expr"] for test in document["tests"] for case in test.get("promql_expr_test", [])}
    assert {name for name in recorded() if name.startswith("DCGM_")} - tested == set()


def test_the_rules_read_only_exported_metrics() -> None:
    registry = CollectorRegistry(auto_describe=False)
    gpu0, *others = telemetry_gpus()
    snapshot = node_snapshot(gpus=(replace(gpu0, retired_pages_pending=False), *others))
    registry.register(SnapshotCollector(lambda: snapshot, switches=FamilySwitches.everything()))
    text = generate_latest(registry).decode()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    used = set(METRIC_NAME.findall(" ".join(recorded().values())))
    assert used - exported == set()


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    assert PROMTOOL is not None
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "WARNING" not in check.stdout + check.stderr, check.stdout + check.stderr
    run = subprocess.run(
        [PROMTOOL, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert run.returncode == 0, run.stdout + run.stderr
