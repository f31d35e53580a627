"""The reading table's rows hold together: names carry their units, a family of several rows is one
family, the family names stay what configs and dashboards will know them by, and the table loads
without the exporter or the config models."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections import defaultdict

import pytest

from agent.names.metric_families import FAMILIES as CATALOG
from agent.readings.row import Dcgm, Metric, Row, fast, reading
from agent.readings.table import FAST_READERS, ROWS, SLOW_READERS, GpuSample
from agent.state import GpuSample as StateGpuSample

#: The families rows are grouped in: names a config switches on and off (`metrics.families`), so a
#: rename is a change of contract. `processes` has no metric (a pid label would churn): its rows are
#: in the sample and `status --json` only.
FAMILIES = {
    "temperature",
    "temperature_thresholds",
    "power",
    "power_instant",
    "clocks",
    "clock_details",
    "utilization",
    "memory",
    "modes",
    "ecc",
    "row_remap",
    "pcie_link",
    "pcie_errors",
    "fans",
    "clock_events",
    "recovery",
    "activity",
    "throughput",
    "nvlink",
    "nvlink_links",
    "fabric",
    "processes",
}


def exported(rows: tuple[Row, ...] = ROWS) -> list[tuple[Row, Metric]]:
    return [(row, row.metric) for row in rows if row.metric is not None]


def test_the_families_are_the_known_ones() -> None:
    assert {row.family for row in ROWS} == FAMILIES
    assert all(re.fullmatch(r"[a-z][a-z_]*", family) for family in FAMILIES)
    # every exported row's family is one `metrics.families` knows (agent/names/metric_families.py)
    assert {row.family for row in ROWS if row.metric is not None} <= set(CATALOG)
    assert {row.family for row in ROWS if row.metric is None} == {"processes", "clock_events"}


def test_every_metric_name_ends_in_its_unit_and_a_counter_in_total() -> None:
    for row, metric in exported():
        name = metric.name.removesuffix("_total") if metric.counter else metric.name
        assert metric.name.startswith("gpu_agent_gpu_"), metric.name
        assert metric.counter == metric.name.endswith("_total"), metric.name
        assert not row.unit.base or name.endswith("_" + row.unit.base), (metric.name, row.unit)


def test_rows_of_one_family_agree_and_each_series_is_named_once() -> None:
    by_metric: dict[str, list[Row]] = defaultdict(list)
    for row, metric in exported():
        by_metric[metric.name].append(row)
    for name, rows in by_metric.items():
        first = rows[0]
        assert len({(r.metric, r.unit, r.section, r.shape.labels, tuple(k for k, _ in r.labels)) for r in rows}) == 1
        assert len({r.labels for r in rows}) == len(rows), f"{name}: two rows give the same series"
        assert first.labels or len(rows) == 1, f"{name}: rows of one family differ by a label"


def test_every_field_of_the_sample_is_a_row_but_identity_and_bookkeeping() -> None:
    rows = {row.field for row in ROWS}
    others = {f.name for f in dataclasses.fields(GpuSample)} - rows
    assert others == {
        "index",
        "uuid",
        "name",
        "pci_bus_id",
        "up",
        "timestamp_seconds",
        "activity_supported",
        "read_errors",
    }
    assert StateGpuSample is GpuSample


def test_each_call_is_made_once_per_tier_in_the_order_of_its_first_row() -> None:
    calls = [reader.call.name for reader in FAST_READERS + SLOW_READERS]
    assert len(calls) == len(set(calls))
    filled = [name for reader in FAST_READERS + SLOW_READERS for name, _ in reader.fields]
    assert sorted(filled) == sorted(row.field for row in ROWS)
    assert FAST_READERS[0].call.name == "temperature_celsius"  # a lost GPU's read error names it


def test_a_dcgm_field_needs_a_metric_to_record() -> None:
    with pytest.raises(ValueError, match="dcgm-exporter field records a metric"):
        reading(fast(lambda b, gpu: b.temperature_celsius(gpu)), family="temperature", dcgm=Dcgm("DCGM_FI_X", "C"))


def test_the_table_loads_without_the_exporter_or_the_config_models() -> None:
    probe = "import json, sys, agent.readings.table; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(json.loads(done.stdout))
    assert {"prometheus_client", "pydantic", "yaml", "agent.config", "agent.metrics"} & loaded == set()
