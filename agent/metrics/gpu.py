"""Per-GPU families: identity, health verdicts, readings, clock events and Xids."""

from __future__ import annotations

from agent.backend.base import CLOCK_EVENT_REASONS, RecoveryAction
from agent.events import HealthState
from agent.metrics.families import (
    Families,
    GpuFamily,
    flag,
    gpu_label,
    gpu_uuids,
    mhz_to_hertz,
    percent_to_ratio,
    single,
)
from agent.state import NodeSnapshot, XidCount
from agent.verdict import THROTTLE_PROBLEM_REASONS
from agent.watch import xid_catalog

_GPU_FAMILIES: tuple[GpuFamily, ...] = (
    single("gpu_agent_gpu_temperature_celsius", "GPU core temperature.", lambda s: s.temperature_celsius),
    GpuFamily(
        "gpu_agent_gpu_temperature_threshold_celsius",
        "Temperature at which the GPU slows down (slowdown) or shuts down (shutdown).",
        (
            ((("threshold", "slowdown"),), lambda s: s.slowdown_temperature_celsius),
            ((("threshold", "shutdown"),), lambda s: s.shutdown_temperature_celsius),
        ),
    ),
    single("gpu_agent_gpu_power_usage_watts", "GPU board power draw.", lambda s: s.power_usage_watts),
    single("gpu_agent_gpu_power_limit_watts", "Power management limit in force.", lambda s: s.power_limit_watts),
    GpuFamily(
        "gpu_agent_gpu_clock_hertz",
        "Current clock frequency per clock domain.",
        (
            ((("clock", "graphics"),), lambda s: mhz_to_hertz(s.graphics_clock_mhz)),
            ((("clock", "sm"),), lambda s: mhz_to_hertz(s.sm_clock_mhz)),
            ((("clock", "memory"),), lambda s: mhz_to_hertz(s.memory_clock_mhz)),
        ),
    ),
    single(
        "gpu_agent_gpu_utilization_ratio",
        "Fraction of the last sample period in which a kernel ran on the GPU.",
        lambda s: percent_to_ratio(s.gpu_utilization_percent),
    ),
    single(
        "gpu_agent_gpu_memory_utilization_ratio",
        "Fraction of the last sample period in which device memory was read or written.",
        lambda s: percent_to_ratio(s.memory_utilization_percent),
    ),
    single("gpu_agent_gpu_memory_used_bytes", "Device memory in use.", lambda s: s.memory_used_bytes),
    single("gpu_agent_gpu_memory_total_bytes", "Device memory installed.", lambda s: s.memory_total_bytes),
    single(
        "gpu_agent_gpu_performance_state",
        "Performance state (0 = P0, maximum performance; 15 = P15, minimum).",
        lambda s: s.performance_state,
    ),
    single(
        "gpu_agent_gpu_persistence_mode_enabled",
        "1 when persistence mode is on.",
        lambda s: flag(s.persistence_enabled),
    ),
    single("gpu_agent_gpu_ecc_enabled", "1 when ECC is on now.", lambda s: flag(s.ecc_enabled)),
    single(
        "gpu_agent_gpu_ecc_pending_enabled",
        "1 when ECC will be on after the next reboot or GPU reset.",
        lambda s: flag(s.ecc_pending),
    ),
    # NVML's aggregate counters persist across reboots (a true counter); volatile ones restart at
    # every driver load and are exported as a gauge of "errors since the driver loaded".
    GpuFamily(
        "gpu_agent_gpu_ecc_errors",
        "ECC errors over the GPU's lifetime (NVML aggregate counter).",
        (
            ((("type", "corrected"),), lambda s: s.ecc_corrected_aggregate),
            ((("type", "uncorrected"),), lambda s: s.ecc_uncorrected_aggregate),
        ),
        counter=True,
    ),
    GpuFamily(
        "gpu_agent_gpu_ecc_volatile_errors",
        "ECC errors since the driver was loaded (NVML volatile counter).",
        (
            ((("type", "corrected"),), lambda s: s.ecc_corrected_volatile),
            ((("type", "uncorrected"),), lambda s: s.ecc_uncorrected_volatile),
        ),
    ),
    GpuFamily(
        "gpu_agent_gpu_remapped_rows",
        "Memory rows remapped, by the kind of error that caused the remap.",
        (
            ((("cause", "correctable"),), lambda s: s.remapped_rows_correctable),
            ((("cause", "uncorrectable"),), lambda s: s.remapped_rows_uncorrectable),
        ),
    ),
    single(
        "gpu_agent_gpu_row_remap_pending",
        "1 when a row remap waits for a GPU reset or reboot.",
        lambda s: flag(s.remap_pending),
    ),
    single(
        "gpu_agent_gpu_row_remap_failed",
        "1 when a row remap failed (the GPU needs service).",
        lambda s: flag(s.remap_failed),
    ),
    single(
        "gpu_agent_gpu_retired_pages_pending",
        "1 when a page retirement waits for a reboot (pre-Ampere boards).",
        lambda s: flag(s.retired_pages_pending),
    ),
    single("gpu_agent_gpu_pcie_link_generation", "Current PCIe link generation.", lambda s: s.pcie_generation),
    single(
        "gpu_agent_gpu_pcie_link_max_generation",
        "Highest PCIe generation of GPU and slot.",
        lambda s: s.pcie_max_generation,
    ),
    single("gpu_agent_gpu_pcie_link_width", "Current PCIe link width (lanes).", lambda s: s.pcie_width),
    single("gpu_agent_gpu_pcie_link_max_width", "Widest PCIe link of GPU and slot.", lambda s: s.pcie_max_width),
    single(
        "gpu_agent_gpu_pcie_replays",
        "PCIe replays (link-level retransmissions).",
        lambda s: s.pcie_replay_count,
        counter=True,
    ),
)


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


def clock_event_seconds(out: Families, snap: NodeSnapshot) -> None:
    uuids = gpu_uuids(snap)
    for (gpu, reason), seconds in sorted(snap.clock_event_seconds.items()):
        out.counter(
            "gpu_agent_gpu_clock_event_seconds",
            "Time a clock-event (throttle) reason was active, as observed by the agent.",
            {"gpu": str(gpu), "uuid": uuids.get(gpu, ""), "reason": reason},
            seconds,
        )


def xids(out: Families, snap: NodeSnapshot) -> None:
    for xid in snap.xids:
        labels = {"gpu": gpu_label(xid.gpu), "uuid": xid.uuid, "xid": str(xid.xid)}
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


def last_xid(out: Families, snap: NodeSnapshot) -> None:
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
