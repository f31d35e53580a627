"""Prometheus metrics over the daemon's last `NodeSnapshot`.

A scrape never touches the GPU backend: `SnapshotCollector.collect()` renders whatever
`get_snapshot()` returns (a reference the loop swaps once per iteration), so a hung NVML call can
stale a GPU but never a scrape. `serve_metrics()` serves `/metrics` and `/healthz` from its own
registry on a daemon thread.

The daemon's verdicts are exported as such (agent/verdict.py), and the alert rules and the dashboard
are built on them, not on raw readings: `gpu_agent_gpu_health{state}` and `_health_info{reason}`,
`gpu_agent_gpu_pcie_degraded`, `gpu_agent_gpu_throttled{reason}`, `gpu_agent_policy_drift`,
`gpu_agent_reboot_recommended`, `gpu_agent_backend_up`, `gpu_agent_node_problem{cause}`. They are
present with zero values on a clean node, and counters start at 0, so a first event is an increase.

Conventions: base units (watts, hertz, bytes, seconds, ratios 0-1); every per-GPU series carries
`gpu` (NVML index) and `uuid`; node-level policy items carry `gpu=""`; a reading that is None
(not supported, or the read failed: see `gpu_agent_gpu_read_error`) is omitted, never exported
as 0. Readings of a stale GPU (a call hung, see `gpu_agent_gpu_stale`) are the last good ones.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

from agent.backend.base import RecoveryAction
from agent.clock_events import CLOCK_EVENT_REASONS
from agent.events import HealthState
from agent.memory import expected_gpu_count
from agent.policy.base import PlanStatus
from agent.rules.model import Outcome
from agent.service_export import service_metric_families
from agent.state import GpuSample, NodeSnapshot, XidCount
from agent.verdict import THROTTLE_PROBLEM_REASONS, NodeProblem, is_drift, node_problem
from agent.version import current as current_build
from agent.watch import xid_catalog

log = structlog.get_logger("gpu-agent")

SnapshotGetter = Callable[[], "NodeSnapshot | None"]

_MHZ_TO_HERTZ = 1e6
_NS_TO_SECONDS = 1e-9
# A client that stalls mid-request must not pin a server thread forever.
_REQUEST_TIMEOUT_SECONDS = 10.0


def _flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


def _ratio(percent: int | None) -> float | None:
    return None if percent is None else percent / 100.0


def _hertz(mhz: int | None) -> float | None:
    return None if mhz is None else mhz * _MHZ_TO_HERTZ


def _seconds(ns: int | None) -> float | None:
    return None if ns is None else ns * _NS_TO_SECONDS


Reader = Callable[[GpuSample], "float | None"]


@dataclass(frozen=True)
class _GpuFamily:
    """Per-GPU series of one family: (extra labels, reader) each, e.g. ({"clock": "sm"}, ...)."""

    name: str
    documentation: str
    series: tuple[tuple[tuple[tuple[str, str], ...], Reader], ...]
    counter: bool = False


def _single(name: str, documentation: str, read: Reader, counter: bool = False) -> _GpuFamily:
    return _GpuFamily(name, documentation, (((), read),), counter)


_GPU_FAMILIES: tuple[_GpuFamily, ...] = (
    _single("gpu_agent_gpu_temperature_celsius", "GPU core temperature.", lambda s: s.temperature_celsius),
    _GpuFamily(
        "gpu_agent_gpu_temperature_threshold_celsius",
        "Temperature at which the GPU slows down (slowdown) or shuts down (shutdown).",
        (
            ((("threshold", "slowdown"),), lambda s: s.slowdown_temperature_celsius),
            ((("threshold", "shutdown"),), lambda s: s.shutdown_temperature_celsius),
        ),
    ),
    _single("gpu_agent_gpu_power_usage_watts", "GPU board power draw.", lambda s: s.power_usage_watts),
    _single("gpu_agent_gpu_power_limit_watts", "Power management limit in force.", lambda s: s.power_limit_watts),
    _GpuFamily(
        "gpu_agent_gpu_clock_hertz",
        "Current clock frequency per clock domain.",
        (
            ((("clock", "graphics"),), lambda s: _hertz(s.graphics_clock_mhz)),
            ((("clock", "sm"),), lambda s: _hertz(s.sm_clock_mhz)),
            ((("clock", "memory"),), lambda s: _hertz(s.memory_clock_mhz)),
        ),
    ),
    _single(
        "gpu_agent_gpu_utilization_ratio",
        "Fraction of the last sample period in which a kernel ran on the GPU.",
        lambda s: _ratio(s.gpu_utilization_percent),
    ),
    _single(
        "gpu_agent_gpu_memory_utilization_ratio",
        "Fraction of the last sample period in which device memory was read or written.",
        lambda s: _ratio(s.memory_utilization_percent),
    ),
    _single("gpu_agent_gpu_memory_used_bytes", "Device memory in use.", lambda s: s.memory_used_bytes),
    _single("gpu_agent_gpu_memory_total_bytes", "Device memory installed.", lambda s: s.memory_total_bytes),
    _single(
        "gpu_agent_gpu_performance_state",
        "Performance state (0 = P0, maximum performance; 15 = P15, minimum).",
        lambda s: s.performance_state,
    ),
    _single(
        "gpu_agent_gpu_persistence_mode_enabled",
        "1 when persistence mode is on.",
        lambda s: _flag(s.persistence_enabled),
    ),
    _single("gpu_agent_gpu_ecc_enabled", "1 when ECC is on now.", lambda s: _flag(s.ecc_enabled)),
    _single(
        "gpu_agent_gpu_ecc_pending_enabled",
        "1 when ECC will be on after the next reboot or GPU reset.",
        lambda s: _flag(s.ecc_pending),
    ),
    # NVML's aggregate counters persist across reboots (a true counter); volatile ones restart at
    # every driver load and are exported as a gauge of "errors since the driver loaded".
    _GpuFamily(
        "gpu_agent_gpu_ecc_errors",
        "ECC errors over the GPU's lifetime (NVML aggregate counter).",
        (
            ((("type", "corrected"),), lambda s: s.ecc_corrected_aggregate),
            ((("type", "uncorrected"),), lambda s: s.ecc_uncorrected_aggregate),
        ),
        counter=True,
    ),
    _GpuFamily(
        "gpu_agent_gpu_ecc_volatile_errors",
        "ECC errors since the driver was loaded (NVML volatile counter).",
        (
            ((("type", "corrected"),), lambda s: s.ecc_corrected_volatile),
            ((("type", "uncorrected"),), lambda s: s.ecc_uncorrected_volatile),
        ),
    ),
    _GpuFamily(
        "gpu_agent_gpu_remapped_rows",
        "Memory rows remapped, by the kind of error that caused the remap.",
        (
            ((("cause", "correctable"),), lambda s: s.remapped_rows_correctable),
            ((("cause", "uncorrectable"),), lambda s: s.remapped_rows_uncorrectable),
        ),
    ),
    _single(
        "gpu_agent_gpu_row_remap_pending",
        "1 when a row remap waits for a GPU reset or reboot.",
        lambda s: _flag(s.remap_pending),
    ),
    _single(
        "gpu_agent_gpu_row_remap_failed",
        "1 when a row remap failed (the GPU needs service).",
        lambda s: _flag(s.remap_failed),
    ),
    _single(
        "gpu_agent_gpu_retired_pages_pending",
        "1 when a page retirement waits for a reboot (pre-Ampere boards).",
        lambda s: _flag(s.retired_pages_pending),
    ),
    _single("gpu_agent_gpu_pcie_link_generation", "Current PCIe link generation.", lambda s: s.pcie_generation),
    _single(
        "gpu_agent_gpu_pcie_link_max_generation",
        "Highest PCIe generation of GPU and slot.",
        lambda s: s.pcie_max_generation,
    ),
    _single("gpu_agent_gpu_pcie_link_width", "Current PCIe link width (lanes).", lambda s: s.pcie_width),
    _single("gpu_agent_gpu_pcie_link_max_width", "Widest PCIe link of GPU and slot.", lambda s: s.pcie_max_width),
    _single(
        "gpu_agent_gpu_pcie_replays",
        "PCIe replays (link-level retransmissions).",
        lambda s: s.pcie_replay_count,
        counter=True,
    ),
)


class _Families:
    """Metric families of one scrape, in first-use order; empty ones are not exposed."""

    def __init__(self) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def gauge(self, name: str, documentation: str, labels: dict[str, str], value: float | None) -> None:
        self.add(name, documentation, labels, value, counter=False)

    def counter(self, name: str, documentation: str, labels: dict[str, str], value: float | None) -> None:
        self.add(name, documentation, labels, value, counter=True)

    def one_hot(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        label: str,
        values: Iterable[str],
        current: str | None,
    ) -> None:
        """One gauge series per value of `label`, 1 for `current` and 0 for the others."""
        for value in values:
            self.gauge(name, documentation, {**labels, label: value}, float(value == current))

    def add(self, name: str, documentation: str, labels: dict[str, str], value: float | None, counter: bool) -> None:
        family = self._families.get(name)
        if family is None:
            # prometheus_client appends "_total" to a counter family's samples.
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            family = self._families[name] = kind(name, documentation, labels=list(labels))
        if value is not None:
            family.add_metric(list(labels.values()), value)

    def __iter__(self) -> Iterator[Metric]:
        return (family for family in self._families.values() if family.samples)


def _recovery_actions(value: int) -> tuple[list[str], str]:
    """The known actions and the current one; a value newer than this code gets its own
    `unknown_N` series."""
    names = [action.name.lower() for action in RecoveryAction]
    try:
        current = RecoveryAction(value).name.lower()
    except ValueError:
        current = f"unknown_{value}"
        names.append(current)
    return names, current


def _gpu_label(index: int | None) -> str:
    return "" if index is None else str(index)


_VIOLATION_HELP = (
    "Time the GPU was held below its target clocks, per reason (NVML clock-event reason durations; "
    "power and thermal from the violation status where the driver has no per-reason fields)."
)
_FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
_TELEMETRY_FAMILIES: tuple[_GpuFamily, ...] = (
    _single(
        "gpu_agent_gpu_sm_active_ratio",
        "Fraction of time at least one warp was resident on an SM, averaged over SMs (GPM, since the last loop).",
        lambda s: s.sm_active_ratio,
    ),
    _single(
        "gpu_agent_gpu_sm_occupancy_ratio",
        "Resident warps as a fraction of the SMs' maximum (GPM, since the last loop).",
        lambda s: s.sm_occupancy_ratio,
    ),
    _single(
        "gpu_agent_gpu_tensor_active_ratio",
        "Fraction of time any tensor pipe was active (GPM, since the last loop).",
        lambda s: s.tensor_active_ratio,
    ),
    _single(
        "gpu_agent_gpu_dram_active_ratio",
        "Device memory bandwidth used as a fraction of the maximum (GPM, since the last loop).",
        lambda s: s.dram_active_ratio,
    ),
    _single(
        "gpu_agent_gpu_pcie_tx_bytes_per_second",
        "PCIe traffic sent by the GPU (GPM, since the last loop).",
        lambda s: s.pcie_tx_bytes_per_second,
    ),
    _single(
        "gpu_agent_gpu_pcie_rx_bytes_per_second",
        "PCIe traffic received by the GPU (GPM, since the last loop).",
        lambda s: s.pcie_rx_bytes_per_second,
    ),
    _single(
        "gpu_agent_gpu_nvlink_tx_bytes_per_second",
        "NVLink traffic sent by the GPU over all links (GPM, since the last loop).",
        lambda s: s.nvlink_tx_bytes_per_second,
    ),
    _single(
        "gpu_agent_gpu_nvlink_rx_bytes_per_second",
        "NVLink traffic received by the GPU over all links (GPM, since the last loop).",
        lambda s: s.nvlink_rx_bytes_per_second,
    ),
    _single(
        "gpu_agent_gpu_energy_joules",
        "Energy the GPU used since the driver loaded.",
        lambda s: s.energy_joules,
        counter=True,
    ),
    _single(
        "gpu_agent_gpu_power_instant_watts",
        "GPU board power draw right now (not averaged).",
        lambda s: s.power_instant_watts,
    ),
    _single(
        "gpu_agent_gpu_memory_temperature_celsius",
        "Device memory (HBM) temperature.",
        lambda s: s.memory_temperature_celsius,
    ),
    _single(
        "gpu_agent_gpu_memory_temperature_max_celsius",
        "Device memory temperature at which the GPU slows down (memory max threshold).",
        lambda s: s.memory_max_temperature_celsius,
    ),
    _single(
        "gpu_agent_gpu_memory_free_bytes",
        "Device memory free for allocations.",
        lambda s: s.memory_free_bytes,
    ),
    _single(
        "gpu_agent_gpu_memory_reserved_bytes",
        "Device memory the driver reserves for itself (not in gpu_agent_gpu_memory_used_bytes).",
        lambda s: s.memory_reserved_bytes,
    ),
    _GpuFamily(
        "gpu_agent_gpu_pcie_errors",
        "PCIe errors the GPU counted since the driver loaded, per type.",
        (
            ((("type", "correctable"),), lambda s: s.pcie_correctable_errors),
            ((("type", "fatal"),), lambda s: s.pcie_fatal_errors),
        ),
        counter=True,
    ),
    _single("gpu_agent_gpu_mig_mode_enabled", "1 when MIG mode is on now.", lambda s: _flag(s.mig_enabled)),
    _single(
        "gpu_agent_gpu_mig_mode_pending_enabled",
        "1 when MIG mode will be on after the next GPU reset.",
        lambda s: _flag(s.mig_pending),
    ),
    _GpuFamily(
        "gpu_agent_gpu_max_clock_hertz",
        "Highest clock frequency the GPU supports per clock domain.",
        (
            ((("clock", "graphics"),), lambda s: _hertz(s.max_graphics_clock_mhz)),
            ((("clock", "sm"),), lambda s: _hertz(s.max_sm_clock_mhz)),
            ((("clock", "memory"),), lambda s: _hertz(s.max_memory_clock_mhz)),
        ),
    ),
    _GpuFamily(
        "gpu_agent_gpu_applications_clock_hertz",
        "Applications clock per clock domain (the target clock when nothing holds it back).",
        (
            ((("clock", "graphics"),), lambda s: _hertz(s.applications_graphics_clock_mhz)),
            ((("clock", "memory"),), lambda s: _hertz(s.applications_memory_clock_mhz)),
        ),
    ),
)


def _telemetry(out: _Families, sample: GpuSample) -> None:
    """Issue 14's families of one GPU: GPM activity, field values, NVLink, fabric, modes, clocks, processes."""
    ids = {"gpu": str(sample.index), "uuid": sample.uuid}
    for family in _TELEMETRY_FAMILIES:
        for extra, read in family.series:
            out.add(family.name, family.documentation, {**ids, **dict(extra)}, read(sample), family.counter)
    violations: list[tuple[str, int | None]] = sorted((sample.violation_reason_ns or {}).items())
    if not violations:
        violations = [("power", sample.power_violation_ns), ("thermal", sample.thermal_violation_ns)]
    for reason, ns in violations:
        out.counter("gpu_agent_gpu_violation_seconds", _VIOLATION_HELP, {**ids, "reason": reason}, _seconds(ns))
    for errors in sample.nvlink_errors or ():
        for counter, count in sorted(errors.counts.items()):
            out.counter(
                "gpu_agent_gpu_nvlink_errors",
                "NVLink errors per link and counter (CRC flit, CRC data, replay, recovery) since the driver loaded.",
                {**ids, "link": str(errors.link), "counter": counter},
                count,
            )
    for link, up in enumerate(sample.nvlink_up or ()):
        out.gauge("gpu_agent_gpu_nvlink_up", "1 while an NVLink link is active.", {**ids, "link": str(link)}, float(up))
    if sample.fabric_state is not None:
        out.one_hot(
            "gpu_agent_gpu_fabric_state",
            "NVSwitch fabric registration state, one series per state, 1 for the current one; CUDA runs "
            "only once it is completed.",
            ids,
            "state",
            _FABRIC_STATES.values(),
            _FABRIC_STATES.get(sample.fabric_state),
        )
        out.gauge(
            "gpu_agent_gpu_fabric_status",
            "NVML return code of the fabric registration (0: success).",
            ids,
            sample.fabric_status,
        )
    for process in sample.processes or ():
        out.gauge(
            "gpu_agent_gpu_process_memory_bytes",
            "Device memory used by each compute process.",
            {**ids, "pid": str(process.pid), "name": process.name or ""},
            process.used_memory_bytes,
        )


def _last_xid(out: _Families, snap: NodeSnapshot) -> None:
    """The code of each GPU's most recent Xid: what dcgm-exporter's DCGM_FI_DEV_XID_ERRORS holds
    (PromQL cannot turn the `xid` label of gpu_agent_xid_errors_total into a value)."""
    latest: dict[int, XidCount] = {}
    for xid in snap.xids:
        if xid.gpu is not None and (xid.gpu not in latest or xid.last_seen_seconds > latest[xid.gpu].last_seen_seconds):
            latest[xid.gpu] = xid
    for gpu, xid in sorted(latest.items()):
        out.gauge(
            "gpu_agent_gpu_xid_last_code",
            "The code of the most recent Xid error reported for the GPU.",
            {"gpu": str(gpu), "uuid": xid.uuid},
            xid.xid,
        )


class SnapshotCollector(Collector):
    """Renders the latest snapshot; before the first one only build info and `gpu_agent_up 0`."""

    def __init__(self, get_snapshot: SnapshotGetter, version: str | None = None, revision: str | None = None) -> None:
        built = current_build()
        self._get_snapshot = get_snapshot
        self._build_labels = {
            "version": built.version if version is None else version,
            "revision": built.revision if revision is None else revision,
        }

    def collect(self) -> Iterator[Metric]:
        snapshot = self._get_snapshot()
        out = _Families()
        built = "gpu-agent version and the commit it was built from; always 1."
        out.gauge("gpu_agent_build_info", built, self._build_labels, 1)
        out.gauge(
            "gpu_agent_up",
            "1 once the agent has completed a collection loop and serves its snapshot, 0 before.",
            {},
            0 if snapshot is None else 1,
        )
        if snapshot is None:
            return iter(out)
        for write in _SNAPSHOT_FAMILIES:
            write(out, snapshot)
        inference = service_metric_families(
            snapshot.service_figures, snapshot.gpu_attribution, _uuids(snapshot), snapshot.service_slo_seconds
        )
        return itertools.chain(out, inference)


def _node(out: _Families, snap: NodeSnapshot) -> None:
    out.gauge(
        "gpu_agent_backend_info",
        "GPU backend in use and the driver it reports; always 1.",
        {"backend": snap.backend, "driver_version": snap.driver_version or ""},
        1,
    )
    out.gauge(
        "gpu_agent_backend_up",
        "1 when the GPU backend (NVML and the driver) can be read, 0 when it cannot.",
        {},
        float(not snap.backend_error),
    )
    problem = node_problem(snap)
    for cause in NodeProblem:
        out.gauge(
            "gpu_agent_node_problem",
            "1 for the cause that keeps the node's GPUs from being judged (no driver, no GPUs, fewer GPUs "
            "than expected), 0 for the others.",
            {"cause": cause.value},
            float(problem is not None and problem.cause is cause),
        )
    out.gauge(
        "gpu_agent_reboot_recommended",
        "1 while state_dir/reboot-recommended asks for a reboot on this boot (reason label), else a 0 series.",
        {"reason": snap.reboot_recommended or ""},
        float(snap.reboot_recommended is not None),
    )
    out.gauge(
        "gpu_agent_start_time_seconds",
        "When the agent started, in seconds since the epoch.",
        {},
        snap.started_seconds,
    )
    out.gauge(
        "gpu_agent_snapshot_timestamp_seconds",
        "When the snapshot served was taken; an old one means the loop is stuck.",
        {},
        snap.timestamp_seconds,
    )
    out.gauge(
        "gpu_agent_gpus_expected",
        "GPUs this node should have: every GPU seen since boot, less those acknowledged gone (gpu-agent ack).",
        {},
        expected_gpu_count(snap),
    )
    out.gauge(
        "gpu_agent_collect_duration_seconds",
        "How long the last collection loop took.",
        {},
        snap.collect_duration_seconds,
    )


def _gpus(out: _Families, snap: NodeSnapshot) -> None:
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
        )
        out.gauge(
            "gpu_agent_gpu_up",
            "1 when the GPU answers; 0 when it fell off the bus, needs a reset or its identity is unreadable.",
            ids,
            float(sample.up),
        )
        out.gauge(
            "gpu_agent_gpu_stale",
            "1 when a call to the GPU hung or timed out and its readings are from an earlier loop.",
            ids,
            float(sample.index in snap.stale_gpus),
        )
        health = snap.health.get(sample.index)
        if health is not None:
            out.one_hot(
                "gpu_agent_gpu_health",
                "GPU health as the agent judges it, one series per state, 1 for the current one.",
                ids,
                "state",
                (state.value for state in HealthState),
                health.state.value,
            )
            out.gauge(
                "gpu_agent_gpu_health_info",
                "The agent's health verdict of the GPU with its reason; always 1.",
                {**ids, "state": health.state.value, "reason": health.reason},
                1,
            )
        out.gauge(
            "gpu_agent_gpu_pcie_degraded",
            "1 when the agent judges the PCIe link degraded (narrower than its maximum, or a lower "
            "generation while busy; an idle GPU's downshift is not degradation).",
            ids,
            float(sample.index in snap.pcie_degraded),
        )
        slowed = {reason for (gpu, reason) in snap.throttle_active_since if gpu == sample.index}
        for reason in THROTTLE_PROBLEM_REASONS:
            out.gauge(
                "gpu_agent_gpu_throttled",
                "1 while a slowdown the agent counts as a problem holds the clocks down (not idle, not the "
                "configured power cap).",
                {**ids, "reason": reason},
                float(reason in slowed),
            )
        out.counter(
            "gpu_agent_gpu_xid_errors",
            "Xid errors reported for the GPU, all codes (starts at 0, so a first Xid is an increase).",
            ids,
            sum(xid.count for xid in snap.xids if xid.gpu == sample.index),
        )
        for family in _GPU_FAMILIES:
            for extra, read in family.series:
                out.add(family.name, family.documentation, {**ids, **dict(extra)}, read(sample), family.counter)
        if sample.fan_speeds_percent is not None:
            for fan, percent in enumerate(sample.fan_speeds_percent):
                out.gauge(
                    "gpu_agent_gpu_fan_speed_ratio",
                    "Fan speed as a fraction of its maximum.",
                    {**ids, "fan": str(fan)},
                    percent / 100.0,
                )
        if sample.clock_event_reasons is not None:
            for bit, reason in CLOCK_EVENT_REASONS.items():
                out.gauge(
                    "gpu_agent_gpu_clock_event_active",
                    "1 while a clock-event (throttle) reason holds the clocks down.",
                    {**ids, "reason": reason},
                    float(bool(sample.clock_event_reasons & bit)),
                )
        if sample.recovery_action is not None:
            actions, current = _recovery_actions(sample.recovery_action)
            out.one_hot(
                "gpu_agent_gpu_recovery_action",
                "What the driver says the GPU needs (NVML GPU recovery action), one series per action, "
                "1 for the current one.",
                ids,
                "action",
                actions,
                current,
            )
        for field_name, kind in sorted(sample.read_errors.items()):
            out.gauge(
                "gpu_agent_gpu_read_error",
                "1 for each reading that failed in the last sample, with the NVML error kind.",
                {**ids, "field": field_name, "kind": kind},
                1,
            )


def _uuids(snap: NodeSnapshot) -> dict[int, str]:
    return {sample.index: sample.uuid for sample in snap.gpus}


def _clock_event_seconds(out: _Families, snap: NodeSnapshot) -> None:
    uuids = _uuids(snap)
    for (gpu, reason), seconds in sorted(snap.clock_event_seconds.items()):
        out.counter(
            "gpu_agent_gpu_clock_event_seconds",
            "Time a clock-event (throttle) reason was active, as observed by the agent.",
            {"gpu": str(gpu), "uuid": uuids.get(gpu, ""), "reason": reason},
            seconds,
        )


def _xids(out: _Families, snap: NodeSnapshot) -> None:
    for xid in snap.xids:
        labels = {"gpu": _gpu_label(xid.gpu), "uuid": xid.uuid, "xid": str(xid.xid)}
        out.counter("gpu_agent_xid_errors", "Xid errors reported by the driver, per code.", labels, xid.count)
        out.gauge(
            "gpu_agent_xid_last_seen_timestamp_seconds",
            "When each Xid code was last reported, in seconds since the epoch.",
            labels,
            xid.last_seen_seconds,
        )
    # The catalog's classification, so alert rules can select on it without copying code lists.
    for code in sorted({xid.xid for xid in snap.xids}):
        verdict = xid_catalog.verdict(code)
        out.gauge(
            "gpu_agent_xid_catalog_info",
            "gpu-agent's Xid catalog classification of each Xid code seen: default severity and action.",
            {"xid": str(code), "severity": verdict.severity, "action": verdict.action.value},
            1,
        )


def _policy(out: _Families, snap: NodeSnapshot) -> None:
    uuids = _uuids(snap)
    answering = frozenset(sample.index for sample in snap.gpus if sample.up)
    for plan in snap.policy:
        labels = {
            "item": plan.item,
            "gpu": _gpu_label(plan.gpu),
            "uuid": "" if plan.gpu is None else uuids.get(plan.gpu, ""),
        }
        out.gauge(
            "gpu_agent_policy_in_sync",
            "1 when a policy item matches its desired state (or does not apply to this device), else 0.",
            labels,
            float(plan.in_sync),
        )
        if plan.item != "gpu":  # an unreadable GPU is reported as lost, not as a policy item
            out.gauge(
                "gpu_agent_policy_drift",
                "1 when a policy item is off its desired value on a device that answers (not a pending "
                "reboot, not a lost GPU), else 0.",
                labels,
                float(is_drift(plan, answering)),
            )
        out.one_hot(
            "gpu_agent_policy_status",
            "Policy item plan status, one series per status, 1 for the current one.",
            labels,
            "status",
            (status.value for status in PlanStatus),
            plan.status.value,
        )
    for item, mode in sorted(snap.item_modes.items()):
        out.gauge(
            "gpu_agent_policy_enforced",
            "1 when the agent repairs drift of this item (enforce mode), 0 when it only reports it (observe).",
            {"item": item},
            float(mode == "enforce"),
        )


def _readiness(out: _Families, snap: NodeSnapshot) -> None:
    """What the report-only items found: the driver, and whether the next boot brings the GPUs back."""
    for plan in snap.policy:
        facts = dict(plan.facts)
        if plan.item == "next_boot" and plan.status in (PlanStatus.IN_SYNC, PlanStatus.DRIFT):
            out.gauge(
                "gpu_agent_boot_ready",
                "1 when the kernel that boots next has the NVIDIA module (signed under Secure Boot) and an "
                "initramfs that keeps nouveau out; the reason names what is missing.",
                {"kernel": facts.get("kernel", ""), "reason": facts.get("reason", "")},
                float(plan.status is PlanStatus.IN_SYNC),
            )
        if plan.item == "driver" and "version" in facts:
            out.gauge(
                "gpu_agent_driver_info",
                "The loaded NVIDIA driver, its branch where the installed package tells it, and the newest "
                "CUDA version it supports; always 1.",
                {k: facts.get(k, "") for k in ("version", "branch", "cuda_version")},
                1,
            )


def _services(out: _Families, snap: NodeSnapshot) -> None:
    for service in snap.services:
        labels = {"service": service.name, "unit": service.unit}
        out.gauge(
            "gpu_agent_service_up",
            "1 when the inference service's health probe succeeds (absent until first probed).",
            labels,
            _flag(service.up),
        )
        out.gauge(
            "gpu_agent_service_consecutive_failures",
            "Health probes failed in a row.",
            labels,
            service.consecutive_failures,
        )
        out.gauge(
            "gpu_agent_service_probe_latency_seconds",
            "How long the last health probe took.",
            labels,
            service.last_latency_seconds,
        )


def _remediations(out: _Families, snap: NodeSnapshot) -> None:
    # Every outcome of a (rule, action) the agent has decided on starts at 0, so the first
    # failure after a success is an increase; the node total exists from the start.
    counts = {(c.rule, c.action, c.outcome): c.count for c in snap.remediations}
    outcomes = [o.value for o in Outcome]
    outcomes += sorted({c.outcome for c in snap.remediations} - set(outcomes))
    for rule, action in sorted({(c.rule, c.action) for c in snap.remediations}):
        for outcome in outcomes:
            out.counter(
                "gpu_agent_remediations",
                "Remediation decisions of rules, by outcome (dry_run: observe mode or a dry-run rule, what the "
                "agent would have done; refused: a safety check said no).",
                {"rule": rule, "action": action, "outcome": outcome},
                counts.get((rule, action, outcome), 0),
            )
    for outcome in outcomes:
        out.counter(
            "gpu_agent_remediation_outcomes",
            "Remediation decisions of all rules, by outcome.",
            {"outcome": outcome},
            sum(c.count for c in snap.remediations if c.outcome == outcome),
        )


def _collectors(out: _Families, snap: NodeSnapshot) -> None:
    for status in snap.collectors:
        labels = {"collector": status.name}
        out.gauge(
            "gpu_agent_collector_success",
            "1 when the collector's last run succeeded.",
            labels,
            float(status.success),
        )
        out.gauge(
            "gpu_agent_collector_duration_seconds",
            "How long the collector's last run took.",
            labels,
            status.duration_seconds,
        )


def _telemetry_of_every_gpu(out: _Families, snap: NodeSnapshot) -> None:
    for sample in snap.gpus:
        _telemetry(out, sample)


#: The snapshot's families, in the order /metrics lists them.
_SNAPSHOT_FAMILIES: tuple[Callable[[_Families, NodeSnapshot], None], ...] = (
    _node,
    _gpus,
    _telemetry_of_every_gpu,
    _last_xid,
    _clock_event_seconds,
    _xids,
    _policy,
    _readiness,
    _services,
    _remediations,
    _collectors,
)


def parse_listen(listen: str) -> tuple[str, int]:
    """Split "HOST:PORT" or "[V6]:PORT" into (host, port); an empty host means every IPv4 address."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen address {listen!r} must be HOST:PORT")
    # An exporter listens on every interface unless told otherwise (metrics.listen narrows it).
    return host.removeprefix("[").removesuffix("]") or "0.0.0.0", int(port)  # noqa: S104  # nosec B104


class _Handler(BaseHTTPRequestHandler):
    server: _MetricsHTTPServer
    timeout = _REQUEST_TIMEOUT_SECONDS
    protocol_version = "HTTP/1.1"
    # headers and body go out in two writes; with Nagle the body waits for the delayed ACK (~40 ms)
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            try:
                body = self.server.render(encoder, content_type)
            except Exception as exc:
                # A bad snapshot must cost one scrape (Prometheus marks the target down), not the server.
                log.exception("rendering metrics failed")
                self._reply(500, "text/plain; charset=utf-8", f"rendering metrics failed: {exc}\n".encode())
                return
            self._reply(200, content_type, body)
        elif path == "/healthz":
            status, health = self.server.health()
            self._reply(status, "application/json", json.dumps(health).encode() + b"\n")
        elif path == "/":
            page = b'<html><body><a href="/metrics">/metrics</a> <a href="/healthz">/healthz</a></body></html>\n'
            self._reply(200, "text/html; charset=utf-8", page)
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found\n")

    def _reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics http request", client=self.address_string(), detail=format % args)


class _MetricsHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        health: Callable[[], tuple[int, dict[str, object]]],
        get_snapshot: SnapshotGetter,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.registry = registry
        self.health = health
        self.get_snapshot = get_snapshot
        # One rendering per snapshot and format: the loop publishes a snapshot every interval,
        # Prometheus (and dashboards, and people with curl) may scrape more often than that.
        self._rendered: dict[str, tuple[NodeSnapshot, bytes]] = {}
        self._render_lock = threading.Lock()
        super().__init__(address, _Handler)

    def render(self, encoder: Callable[[CollectorRegistry], bytes], content_type: str) -> bytes:
        snapshot = self.get_snapshot()
        with self._render_lock:
            cached = self._rendered.get(content_type)
            # the cache holds the snapshot itself, so `is` cannot be fooled by a reused id()
            if snapshot is not None and cached is not None and cached[0] is snapshot:
                return cached[1]
            body = encoder(self.registry)
            if snapshot is not None:
                self._rendered[content_type] = (snapshot, body)
            return body


class MetricsServer:
    """`/metrics` and `/healthz` on a daemon thread; `close()` stops it and frees the port."""

    def __init__(
        self,
        listen: str,
        get_snapshot: SnapshotGetter,
        *,
        stale_after_seconds: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._get_snapshot = get_snapshot
        self._stale_after_seconds = stale_after_seconds
        self._clock = clock
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(get_snapshot))
        self._server = _MetricsHTTPServer(parse_listen(listen), self.registry, self._health, get_snapshot)
        bound = self._server.server_address
        self.host: str = str(bound[0])
        self.port: int = int(bound[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="metrics-http", daemon=True
        )
        self._thread.start()

    def _health(self) -> tuple[int, dict[str, object]]:
        """200 while snapshots keep coming; 503 before the first one, once the last is too old, or while
        the node has a problem (no driver, no or missing GPUs)."""
        snapshot = self._get_snapshot()
        if snapshot is None:
            return 503, {"status": "starting", "detail": "no snapshot yet"}
        age_seconds = max(0.0, self._clock() - snapshot.timestamp_seconds)
        body: dict[str, object] = {"status": "ok", "snapshot_age_seconds": round(age_seconds, 3)}
        if self._stale_after_seconds is not None and age_seconds > self._stale_after_seconds:
            body["status"] = "stale"
            body["detail"] = f"last snapshot is {age_seconds:.0f} s old (limit {self._stale_after_seconds:g} s)"
            return 503, body
        problem = node_problem(snapshot)
        if problem is not None:
            # No driver or missing GPUs: the agent runs, but the node is not one to send work to.
            body.update(status="problem", cause=problem.cause.value, detail=problem.detail)
            return 503, body
        return 200, body

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(
    listen: str,
    get_snapshot: SnapshotGetter,
    *,
    stale_after_seconds: float | None = None,
    clock: Callable[[], float] = time.time,
) -> MetricsServer:
    """Serve metrics of `get_snapshot()` on "HOST:PORT" (port 0: any free port, see `.port`).

    `get_snapshot` must only return a reference (the loop publishes a new frozen snapshot by
    swapping it), so a scrape never waits on the loop or the GPU backend.
    `stale_after_seconds`: `/healthz` answers 503 once the last snapshot is older than this.
    """
    return MetricsServer(listen, get_snapshot, stale_after_seconds=stale_after_seconds, clock=clock)
