"""Per-GPU families: identity, health verdicts, the reading table's rows, clock events and Xids.

Only the GPUs of the snapshot have series: a GPU acknowledged gone (`gpu-agent ack gpu:N`) leaves
the snapshot and, with it, every family here (its Xid counts and clock-event time included), so no
series of it lingers with an empty uuid.
"""

from __future__ import annotations

from agent.events import FaultCause
from agent.metrics.families import Families, gpu_uuids
from agent.readings.row import Dcgm, Section, gauge, nonzero
from agent.readings.table import ROWS
from agent.state import GpuSample, NodeSnapshot, XidCount
from agent.verdict import THROTTLE_PROBLEM_REASONS
from agent.watch import xid_catalog

XID_LAST_CODE = gauge("gpu_agent_gpu_xid_last_code", "The code of the most recent Xid error reported for the GPU.")
#: dcgm-exporter's field of the same meaning, for the compatibility rules (agent/metrics/dcgm.py):
#: 0 on a GPU without an Xid, as dcgm-exporter gives it.
XID_LAST_CODE_DCGM = Dcgm("DCGM_FI_DEV_XID_ERRORS", "code", " of the last Xid (0: none)", zero_fill=True)
#: The health verdict's cause label on a healthy GPU.
NO_CAUSE = "none"


def reading_families(out: Families, sample: GpuSample, section: Section) -> None:
    """The families of the reading table's rows in `section`, for one GPU."""
    ids = (("gpu", str(sample.index)), ("uuid", sample.uuid))
    for row in ROWS:
        if row.metric is not None and row.section is section:
            for labels, value in row.series(sample):
                out.add(
                    row.metric.name,
                    row.metric.help,
                    dict(ids + labels),
                    value,
                    counter=row.metric.counter,
                    family=row.family,
                    notable=row.notable,
                )


def gpus(out: Families, snap: NodeSnapshot) -> None:
    for sample in snap.gpus:
        ids = {"gpu": str(sample.index), "uuid": sample.uuid}
        out.gauge(
            "gpu_agent_gpu_info",
            "GPU identity; always 1.",
            {
                **ids,
                "name": sample.name,
                "pci_bus_id": sample.pci_bus_id,
                "driver_version": snap.driver_version or "",
            },
            1,
            family="gpu",
        )
        out.gauge(
            "gpu_agent_gpu_up",
            "1 when the GPU answers; 0 when it fell off the bus, needs a reset or its identity is unreadable.",
            ids,
            float(sample.up),
            family="gpu",
        )
        out.gauge(
            "gpu_agent_gpu_stale",
            "1 when a call to the GPU hung or timed out and its readings are from an earlier loop.",
            ids,
            float(sample.index in snap.stale_gpus),
            family="faults",
            notable=nonzero,
        )
        health = snap.health.get(sample.index)
        if health is not None:
            out.one_hot(
                "gpu_agent_gpu_health",
                "GPU health as the agent judges it, one series per state, 1 for the current one.",
                ids,
                "state",
                health.state,
                family="gpu",
            )
            out.gauge(
                "gpu_agent_gpu_health_info",
                "The agent's health verdict of the GPU and the code of its first cause (none when healthy; the "
                "reason's text is in gpu-agent status); always 1.",
                {**ids, "state": health.state.value, "cause": health.causes[0].value if health.causes else NO_CAUSE},
                1,
                family="gpu",
            )
            for cause in FaultCause:
                out.gauge(
                    "gpu_agent_gpu_fault",
                    "1 for each fault open on the GPU, by cause (what keeps it from healthy); with the faults "
                    "family off only the open ones are listed.",
                    {**ids, "cause": cause.value},
                    float(cause in health.causes),
                    family="faults",
                    notable=nonzero,
                )
        out.gauge(
            "gpu_agent_gpu_pcie_degraded",
            "1 when the agent judges the PCIe link degraded (narrower than its maximum, or a lower "
            "generation while busy; an idle GPU's downshift is not degradation).",
            ids,
            float(sample.index in snap.pcie_degraded),
            family="faults",
            notable=nonzero,
        )
        slowed = {reason for (gpu, reason) in snap.throttle_active_since if gpu == sample.index}
        for reason in THROTTLE_PROBLEM_REASONS:
            out.gauge(
                "gpu_agent_gpu_throttled",
                "1 while a slowdown the agent counts as a problem holds the clocks down (not idle, not the "
                "configured power cap).",
                {**ids, "reason": reason},
                float(reason in slowed),
                family="faults",
                notable=nonzero,
            )
        out.counter(
            "gpu_agent_gpu_xid_errors",
            "Xid errors reported for the GPU, all codes (starts at 0, so a first Xid is an increase).",
            ids,
            sum(xid.count for xid in snap.xids if xid.gpu == sample.index),
            family="xid",
        )
        reading_families(out, sample, Section.DEVICE)
        for field_name, kind in sorted(sample.read_errors.items()):
            out.gauge(
                "gpu_agent_gpu_read_error",
                "1 for each reading that failed in the last sample, with the NVML error kind.",
                {**ids, "field": field_name, "kind": kind},
                1,
                family="gpu",
                notable=nonzero,
            )


def telemetry(out: Families, snap: NodeSnapshot) -> None:
    """The telemetry section of every GPU: GPM activity, field values, NVLink, fabric, modes, clocks."""
    for sample in snap.gpus:
        reading_families(out, sample, Section.TELEMETRY)


def clock_event_seconds(out: Families, snap: NodeSnapshot) -> None:
    uuids = gpu_uuids(snap)
    for (gpu, reason), seconds in sorted(snap.clock_event_seconds.items()):
        if gpu in uuids:
            out.counter(
                "gpu_agent_gpu_clock_event_seconds",
                "Time a clock-event (throttle) reason was active, as observed by the agent.",
                {"gpu": str(gpu), "uuid": uuids[gpu], "reason": reason},
                seconds,
                family="clock_events",
                notable=nonzero,
            )


def _node_xids(snap: NodeSnapshot) -> list[XidCount]:
    """The Xids of the snapshot's GPUs, and those the kernel reported for no GPU the agent knows."""
    known = gpu_uuids(snap)
    return [xid for xid in snap.xids if xid.gpu is None or xid.gpu in known]


def xids(out: Families, snap: NodeSnapshot) -> None:
    counted = _node_xids(snap)
    for xid in counted:
        labels = {"gpu": "" if xid.gpu is None else str(xid.gpu), "uuid": xid.uuid, "xid": str(xid.xid)}
        out.counter(
            "gpu_agent_xid_errors", "Xid errors reported by the driver, per code.", labels, xid.count, family="xid"
        )
        out.gauge(
            "gpu_agent_xid_last_seen_timestamp_seconds",
            "When each Xid code was last reported, in seconds since the epoch.",
            labels,
            xid.last_seen_seconds,
            family="xid",
        )
        if xid.gpu is not None:
            out.gauge(
                "gpu_agent_xid_open",
                "1 while the Xid holds the GPU's health: not fixed by the agent (a reset, the restart of the "
                "service whose process faulted), not acknowledged (gpu-agent ack), within its health window.",
                labels,
                float((xid.gpu, xid.xid) in snap.open_xids),
                family="xid",
                notable=nonzero,
            )
    # The catalog's classification, so alert rules can select on it without copying code lists.
    for code in sorted({xid.xid for xid in counted}):
        verdict = xid_catalog.verdict(code)
        out.gauge(
            "gpu_agent_xid_catalog_info",
            "gpu-agent's Xid catalog classification of each Xid code seen: default severity and action.",
            {"xid": str(code), "severity": verdict.severity, "action": verdict.action.value},
            1,
            family="xid",
        )


def last_xid(out: Families, snap: NodeSnapshot) -> None:
    """The code of each GPU's most recent Xid: what dcgm-exporter's DCGM_FI_DEV_XID_ERRORS holds
    (PromQL cannot turn the `xid` label of gpu_agent_xid_errors_total into a value)."""
    latest: dict[int, XidCount] = {}
    for xid in _node_xids(snap):
        if xid.gpu is not None and (xid.gpu not in latest or xid.last_seen_seconds > latest[xid.gpu].last_seen_seconds):
            latest[xid.gpu] = xid
    for gpu, xid in sorted(latest.items()):
        out.gauge(XID_LAST_CODE.name, XID_LAST_CODE.help, {"gpu": str(gpu), "uuid": xid.uuid}, xid.xid, family="xid")
