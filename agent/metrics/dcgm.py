"""The dcgm-exporter compatibility rules, written from the reading table: every row with a `Dcgm`
field becomes a recording rule that gives the row's series dcgm-exporter's name, labels and unit.

    python -m agent.metrics.dcgm > packaging/prometheus/gpu-agent-dcgm-compat.yaml

tests/test_dcgm_compat.py fails while the shipped file differs from what this writes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from agent.metrics.gpu import XID_LAST_CODE, XID_LAST_CODE_DCGM
from agent.readings.row import Dcgm, Metric, Row
from agent.readings.table import ROWS

#: (the row's base unit, dcgm-exporter's unit) -> the PromQL that converts; "" where they are the same.
_CONVERSIONS: dict[tuple[str, str], str] = {
    ("celsius", "C"): "",
    ("watts", "W"): "",
    ("joules", "mJ"): " * 1000",
    ("hertz", "MHz"): " / 1e6",
    ("ratio", "%"): " * 100",
    ("ratio", "ratio 0-1"): "",
    ("bytes", "MiB"): " / 1048576",
    ("bytes_per_second", "bytes/s"): "",
    ("seconds", "us"): " * 1e6",
    ("", "count"): "",
    ("", "code"): "",
}

_DCGM_LABELS = "UUID, pci_bus_id, device, modelName, Hostname"

_HEADER = f"""\
# dcgm-exporter compatibility: gpu-agent's metrics recorded under dcgm-exporter's names, labels and units,
# so dashboards and alerts written for NVIDIA's dcgm-exporter (its stock Grafana dashboard 12239, say) keep
# working on nodes that run gpu-agent instead of the DCGM host engine.
#
# Load it next to gpu-agent-alerts.yaml (rule_files in prometheus.yml). Every DCGM_FI_* series carries
# dcgm-exporter's labels: gpu, UUID, pci_bus_id, device, modelName and Hostname (plus the scrape's instance
# and job). `device` is "nvidia<gpu index>": it equals the device node's minor number on most hosts, which
# dcgm-exporter uses. Hostname is the instance label without its port.
#
# Units as dcgm-exporter reports them: memory in MiB, energy in mJ, clocks in MHz, utilization in percent,
# violation time in microseconds, DCGM_FI_PROF_* ratios 0-1 and bytes per second. Differences to know:
# DCGM_FI_PROF_PIPE_TENSOR_ACTIVE is NVML GPM's "any tensor" activity (HMMA, IMMA and DMMA pipes together);
# DCGM_FI_DEV_XID_ERRORS is the code of the last Xid gpu-agent saw, for the GPU it was reported on.
# Unit tests: tests/prometheus/dcgm_compat.yaml (promtool test rules).
#
# Written from the reading table (agent/readings/table.py) by `python -m agent.metrics.dcgm`: a
# reading's dcgm-exporter field is declared in its row, not here.
groups:
  - name: gpu-agent-dcgm-compat
    rules:
      # The labels dcgm-exporter puts on every series, one series per GPU, value 1.
      - record: gpu_agent:dcgm_labels
        expr: >-
          max by (instance, job, gpu, {_DCGM_LABELS}) (
            label_replace(label_replace(label_replace(label_replace(
              gpu_agent_gpu_info,
              "UUID", "$1", "uuid", "(.*)"),
              "modelName", "$1", "name", "(.*)"),
              "device", "nvidia$1", "gpu", "(.*)"),
              "Hostname", "$1", "instance", "(.*?)(:[0-9]+)?")
          )
"""


def _series(row: Row, metric: Metric, field: Dcgm) -> str:
    """The row's series of this dcgm-exporter field, in gpu-agent's units, one per GPU: a row that is
    one series of a labelled family drops its label; a row of many series (per link, per reason) sums them."""
    matchers = [f'{label}="{value}"' for label, value in row.labels] + ([field.select] if field.select else [])
    selector = metric.name + ("{" + ", ".join(matchers) + "}" if matchers else "")
    if row.labels:
        return f"max without ({', '.join(label for label, _ in row.labels)}) ({selector})"
    if row.shape.labels:
        return f"sum without ({', '.join(row.shape.labels)}) ({selector})"
    return selector


def _rule(field: Dcgm, series: str, base_unit: str) -> str:
    conversion = _CONVERSIONS.get((base_unit, field.unit))
    if conversion is None:
        raise ValueError(f"{field.name}: no conversion from {base_unit or 'a count'} to {field.unit}")
    return (
        f"      # {field.unit}{field.note}\n"
        f"      - record: {field.name}\n"
        f"        expr: >-\n"
        f"          max without (uuid) ({series}{conversion})\n"
        f"          * on (instance, job, gpu) group_left ({_DCGM_LABELS}) gpu_agent:dcgm_labels\n"
    )


def _rules() -> Iterator[str]:
    for row in ROWS:
        if row.metric is not None:  # `reading()` refuses a dcgm field without a metric
            for field in row.dcgm:
                yield _rule(field, _series(row, row.metric, field), row.unit.base)
    yield _rule(XID_LAST_CODE_DCGM, XID_LAST_CODE.name, "")


def compat_rules() -> str:
    """The whole rules file."""
    return _HEADER + "".join(_rules())


if __name__ == "__main__":
    sys.stdout.write(compat_rules())
