"""The dcgm-exporter compatibility rules, written from the reading table: every row with a `Dcgm`
field becomes a recording rule that gives the row's series dcgm-exporter's name, labels and unit.

    python -m agent.metrics.dcgm > packaging/prometheus/gpu-agent-dcgm-compat.yaml

tests/metrics/test_dcgm_compat.py fails while the shipped file differs from what this writes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from agent.metrics.gpu import XID_LAST_CODE, XID_LAST_CODE_DCGM
from agent.readings.row import Dcgm, Metric, Row, never
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
    ("bytes_per_second", "KB/s"): " / 1024",
    ("seconds", "us"): " * 1e6",
    ("", "count"): "",
    ("", "code"): "",
    ("", "flag"): "",
    ("", "bitmask"): "",
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
# dcgm-exporter uses. Hostname is the node's own host name (gpu_agent_node_info), whatever address Prometheus
# scrapes, so nodes behind one address (a proxy, NAT) stay apart.
#
# Units as dcgm-exporter reports them: memory in MiB, energy in mJ, clocks in MHz, utilization in percent,
# violation time in microseconds, DCGM_FI_PROF_* ratios 0-1 and bytes per second. Differences to know:
# DCGM_FI_PROF_PIPE_TENSOR_ACTIVE is NVML GPM's "any tensor" activity (HMMA, IMMA and DMMA pipes together);
# DCGM_FI_DEV_XID_ERRORS is the code of the last Xid gpu-agent saw, for the GPU it was reported on (0 before
# the first). A field whose gpu-agent family lists only non-zero series by default (remapped rows, PCIe
# replays, clock-event reasons, ...) is 0 on a GPU without one, as dcgm-exporter gives it.
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
            label_replace(label_replace(label_replace(
              gpu_agent_gpu_info,
              "UUID", "$1", "uuid", "(.*)"),
              "modelName", "$1", "name", "(.*)"),
              "device", "nvidia$1", "gpu", "(.*)")
            * on (instance, job) group_left (Hostname)
            max by (instance, job, Hostname) (label_replace(gpu_agent_node_info, "Hostname", "$1", "hostname", "(.*)"))
          )
"""


def _series(row: Row, metric: Metric, field: Dcgm) -> str:
    """The row's series of this dcgm-exporter field, in gpu-agent's units, one per GPU: a row that is
    one series of a labelled family drops its label; a row of many series (per link, per reason) sums
    them; a row of flags with `bits` sums each set flag times its bit, dcgm-exporter's one bit mask."""
    matchers = [f'{label}="{value}"' for label, value in row.labels] + ([field.select] if field.select else [])
    selector = metric.name + ("{" + ", ".join(matchers) + "}" if matchers else "")
    if field.bits:
        (label,) = row.shape.labels
        flags = "\n             or ".join(f'{metric.name}{{{label}="{name}"}} * {bit}' for name, bit in field.bits)
        return f"sum without ({label}) (\n             {flags}\n           )"
    if row.labels:
        return f"max without ({', '.join(label for label, _ in row.labels)}) ({selector})"
    if row.shape.labels:
        return f"sum without ({', '.join(row.shape.labels)}) ({selector})"
    return selector


def _rule(field: Dcgm, series: str, base_unit: str, zero_fill: bool) -> str:
    conversion = _CONVERSIONS.get((base_unit, field.unit))
    if conversion is None:
        raise ValueError(f"{field.name}: no conversion from {base_unit or 'a count'} to {field.unit}")
    value = f"max without (uuid) ({series}{conversion})"
    if zero_fill:  # a GPU without the series reads 0, as dcgm-exporter gives it
        zero = "0 * max by (instance, job, gpu) (gpu_agent:dcgm_labels)"
        value = f"({value}\n           or on (instance, job, gpu) {zero})"
    return (
        f"      # {field.unit}{field.note}\n"
        f"      - record: {field.name}\n"
        f"        expr: >-\n"
        f"          {value}\n"
        f"          * on (instance, job, gpu) group_left ({_DCGM_LABELS}) gpu_agent:dcgm_labels\n"
    )


def _rules() -> Iterator[str]:
    for row in ROWS:
        if row.metric is not None:  # `reading()` refuses a dcgm field without a metric
            for field in row.dcgm:
                zero_fill = field.zero_fill or row.notable is not never
                yield _rule(field, _series(row, row.metric, field), row.unit.base, zero_fill)
    yield _rule(XID_LAST_CODE_DCGM, XID_LAST_CODE.name, "", XID_LAST_CODE_DCGM.zero_fill)


def compat_rules() -> str:
    """The whole rules file."""
    return _HEADER + "".join(_rules())


if __name__ == "__main__":
    sys.stdout.write(compat_rules())
