"""Realistic `NodeSnapshot`s for tests of everything that reads one (metrics, status, rules).

Numbers follow what the boards answer: the H200 ones tests/fixtures/nvml-h200.json (700 W limit,
1980/1980/3201 MHz, thresholds 89/95 C, no fans), the RTX PRO 6000 ones the simulated profile
(600 W, two fans). `node_snapshot()` is one mixed node with something to see everywhere:

    GPU 0  H200  busy and fine, brief power capping seen earlier
    GPU 1  H200  thermal throttling (sw+hw thermal), Xid 48 and 63, an uncorrected ECC error,
                 a row remap pending, the driver asks for a GPU reset -> unhealthy
    GPU 2  RTX PRO 6000  fans, ECC off (no ECC counters), PCIe trained down to gen4, a failed
                 performance-state read, power limit drifting from policy, stale -> degraded
    GPU 3  H200  fell off the bus (Xid 79): only identity, up=False -> unhealthy

`snapshot_from_backend()` builds one from any backend (the simulated one, typically).
`inference_fields()` adds what the inference servers say and which service holds which GPU memory.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from agent.backend.base import GpuBackend, GpuProcess, NvLinkErrors
from agent.collect import sample_all
from agent.events import EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.policy.plan import ItemPlan, PlanStatus
from agent.state import (
    CollectorStatus,
    CounterHistogram,
    GpuAttribution,
    GpuProcessInfo,
    GpuSample,
    LatencyFigures,
    NodeSnapshot,
    RemediationCount,
    RemediationFailing,
    ServiceCounters,
    ServiceFigures,
    ServiceStatus,
    XidCount,
)

TIMESTAMP_SECONDS = 1_780_000_000.0
STARTED_SECONDS = TIMESTAMP_SECONDS - 3600.0
VERSION = "0.1.0"
REVISION = "0123456789abcdef0123456789abcdef01234567"  # the golden metrics' build_info
DRIVER_VERSION = "580.159.04"
H200_NAME = "NVIDIA H200"
RTX_NAME = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
H200_MEMORY_BYTES = 150_754_820_096
RTX_MEMORY_BYTES = 102_641_958_912
PCI_BUS_IDS = ("00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0")


def gpu_uuid(index: int) -> str:
    return f"GPU-5e1b7a3c-{index:04x}-4d2e-9f10-6a7b8c9d0e{index:02x}"


#: What every board serving at full batch reads alike: busy, at its full PCIe link, no remaps, no recovery.
_SERVING: dict[str, Any] = {
    "clock_event_reasons": 0,
    "gpu_utilization_percent": 100,
    "performance_state": 0,
    "remapped_rows_correctable": 0,
    "remapped_rows_uncorrectable": 0,
    "remap_pending": False,
    "remap_failed": False,
    "pcie_generation": 5,
    "pcie_width": 16,
    "pcie_max_generation": 5,
    "pcie_max_width": 16,
    "pcie_replay_count": 0,
    "shutdown_temperature_celsius": 95,
    "power_violation_ns": 0,
    "thermal_violation_ns": 0,
    "recovery_action": 0,  # RecoveryAction.NONE
}


def _identity(index: int, name: str) -> dict[str, Any]:
    """Which GPU a sample is of (its index, UUID, name and PCI address), and when it was read."""
    pci_bus_id = PCI_BUS_IDS[index % len(PCI_BUS_IDS)]
    return {
        "index": index,
        "uuid": gpu_uuid(index),
        "name": name,
        "pci_bus_id": pci_bus_id,
        "timestamp_seconds": TIMESTAMP_SECONDS,
    }


def _sample(index: int, name: str, readings: dict[str, Any], overrides: dict[str, Any]) -> GpuSample:
    return GpuSample(**_identity(index, name), up=True, **{**_SERVING, **readings, **overrides})


def h200_sample(index: int, **overrides: Any) -> GpuSample:
    """An H200 SXM serving at full batch: the fixture's limits and clocks, load power and temperature."""
    readings: dict[str, Any] = {
        "temperature_celsius": 66,
        "power_usage_watts": 655.0,
        "power_limit_watts": 700.0,
        "graphics_clock_mhz": 1980,
        "sm_clock_mhz": 1980,
        "memory_clock_mhz": 3201,
        "memory_utilization_percent": 62,
        "memory_used_bytes": 135_679_338_086,
        "memory_total_bytes": H200_MEMORY_BYTES,
        "fan_speeds_percent": None,  # SXM: NOT_SUPPORTED, left None by collect
        "persistence_enabled": True,
        "ecc_enabled": True,
        "ecc_pending": True,
        "ecc_corrected_volatile": 0,
        "ecc_uncorrected_volatile": 0,
        "ecc_corrected_aggregate": 3,
        "ecc_uncorrected_aggregate": 0,
        "retired_pages_pending": None,  # Hopper remaps rows; page retirement is NOT_SUPPORTED
        "slowdown_temperature_celsius": 89,
    }
    return _sample(index, H200_NAME, readings, overrides)


def rtx_pro_6000_sample(index: int, **overrides: Any) -> GpuSample:
    """An RTX PRO 6000 Blackwell Workstation Edition under load, ECC off as shipped (no ECC counters)."""
    readings: dict[str, Any] = {
        "temperature_celsius": 81,
        "power_usage_watts": 585.0,
        "power_limit_watts": 600.0,
        "graphics_clock_mhz": 2625,
        "sm_clock_mhz": 2625,
        "memory_clock_mhz": 14001,
        "memory_utilization_percent": 71,
        "memory_used_bytes": 92_377_763_020,
        "memory_total_bytes": RTX_MEMORY_BYTES,
        "fan_speeds_percent": (72, 74),
        "persistence_enabled": False,
        "ecc_enabled": False,
        "ecc_pending": False,
        "slowdown_temperature_celsius": 92,
    }
    return _sample(index, RTX_NAME, readings, overrides)


def lost_sample(index: int, name: str = H200_NAME) -> GpuSample:
    """What collect makes of a GPU whose identity was read but whose first reading said GPU_LOST."""
    return GpuSample(**_identity(index, name), up=False, read_errors={"temperature_celsius": "gpu_lost"})


def h200_snapshot(at: float = TIMESTAMP_SECONDS, gpus: int = 4, **fields: Any) -> NodeSnapshot:
    """A node of `gpus` healthy H200s at `at`, up for an hour; keyword arguments are further fields.
    Slowdowns given as `throttle_active_since` are held since then unless `throttle_held_seconds` says."""
    if "throttle_active_since" in fields and "throttle_held_seconds" not in fields:
        fields["throttle_held_seconds"] = {key: at - since for key, since in fields["throttle_active_since"].items()}
    return NodeSnapshot(
        timestamp_seconds=at,
        started_seconds=at - 3600.0,
        version=VERSION,
        backend="simulated",
        driver_version=DRIVER_VERSION,
        gpus=tuple(h200_sample(i) for i in range(gpus)),
        **fields,
    )


def node_gpus() -> tuple[GpuSample, ...]:
    return (
        h200_sample(0, power_violation_ns=3_000_000_000),
        h200_sample(
            1,
            temperature_celsius=90,
            power_usage_watts=512.5,
            graphics_clock_mhz=990,
            sm_clock_mhz=990,
            clock_event_reasons=0x20 | 0x40,  # sw_thermal_slowdown | hw_thermal_slowdown
            ecc_uncorrected_volatile=1,
            ecc_uncorrected_aggregate=1,
            remap_pending=True,
            thermal_violation_ns=42_500_000_000,
            recovery_action=1,  # RecoveryAction.GPU_RESET
        ),
        rtx_pro_6000_sample(
            2,
            performance_state=None,
            pcie_generation=4,
            read_errors={"performance_state": "unknown"},
        ),
        lost_sample(3),
    )


def node_policy() -> tuple[ItemPlan, ...]:
    return (
        ItemPlan("power_limit", 0, PlanStatus.IN_SYNC, "700 W", "700 W"),
        ItemPlan("power_limit", 1, PlanStatus.IN_SYNC, "700 W", "700 W"),
        ItemPlan(
            "power_limit",
            2,
            PlanStatus.DRIFT,
            "450 W",
            "600 W",
            detail="allowed 150-600 W",
            changes=("set power limit of GPU 2 from 600 W to 450 W (nvidia-smi -i 2 -pl 450)",),
        ),
        ItemPlan(
            "power_limit",
            3,
            PlanStatus.ERROR,
            "700 W",
            "unknown",
            detail="GPU lost (fell off the bus) [gpu_lost]",
            error_kind="gpu_lost",
        ),
        ItemPlan("fan_curve", 0, PlanStatus.NOT_APPLICABLE, "curve", "no fans", detail="NVIDIA H200 has no fans"),
        ItemPlan("fan_curve", 2, PlanStatus.IN_SYNC, "curve", "curve"),
        ItemPlan("ecc", 2, PlanStatus.REBOOT_REQUIRED, "enabled", "disabled", detail="ECC enable pending until reboot"),
        ItemPlan("transparent_hugepages", None, PlanStatus.IN_SYNC, "never", "never"),
        ItemPlan("nouveau", None, PlanStatus.IN_SYNC, "blacklisted", "blacklisted"),
        ItemPlan(
            "triton_cache",
            None,
            PlanStatus.DRIFT,
            "/var/cache/triton root:root 0755",
            "missing",
            changes=("create /var/cache/triton",),
        ),
        ItemPlan(
            "driver",
            None,
            PlanStatus.IN_SYNC,
            "580.159.04 datacenter",
            "580.159.04 (datacenter, CUDA 13.0)",
            facts=(("version", "580.159.04"), ("branch", "datacenter"), ("cuda_version", "13.0")),
        ),
        ItemPlan(
            "next_boot",
            None,
            PlanStatus.DRIFT,
            "ready",
            "6.8.0-50-generic: not ready",
            changes=("6.8.0-50-generic: nvidia 580.159.04 module missing (report-only: fix before rebooting)",),
            facts=(
                ("kernel", "6.8.0-50-generic"),
                ("reason", "nvidia 580.159.04 module missing"),
                ("summary", "6.8.0-50-generic — nvidia 580.159.04 module missing"),
            ),
        ),
    )


def node_snapshot(**overrides: Any) -> NodeSnapshot:
    """The mixed node described in the module docstring; keyword arguments replace fields."""
    from helpers import make_event  # helpers imports this module: imported here, once both are loaded

    events = (
        make_event(
            EventKind.XID,
            1,
            message="Xid 48: Double Bit ECC Error",
            timestamp_seconds=TIMESTAMP_SECONDS - 120.0,
            source="nvml",
            key=f"xid:{gpu_uuid(1)}:48",
            suggested_action=SuggestedAction.RESET_GPU,
            xid=48,
        ),
        make_event(
            EventKind.GPU_LOST,
            3,
            severity=Severity.FATAL,
            message="GPU has fallen off the bus",
            timestamp_seconds=TIMESTAMP_SECONDS - 60.0,
            source="kmsg",
            key=f"gpu_lost:{gpu_uuid(3)}",
            suggested_action=SuggestedAction.REBOOT,
        ),
    )
    snapshot = NodeSnapshot(
        timestamp_seconds=TIMESTAMP_SECONDS,
        started_seconds=STARTED_SECONDS,
        version=VERSION,
        backend="simulated",
        driver_version=DRIVER_VERSION,
        gpus=node_gpus(),
        hostname="gpu-node-1",
        stale_gpus=frozenset({2}),
        health={
            0: Health.healthy(),
            1: Health(
                HealthState.UNHEALTHY,
                "Xid 48 (double-bit ECC), row remap pending",
                SuggestedAction.RESET_GPU,
                (FaultCause.XID, FaultCause.ROW_REMAP_PENDING),
            ),
            2: Health(
                HealthState.DEGRADED,
                "PCIe link gen4 x16, expected gen5 x16",
                SuggestedAction.CHECK_MECHANICALS,
                (FaultCause.PCIE_DEGRADED, FaultCause.STALE),
            ),
            3: Health(
                HealthState.UNHEALTHY, "GPU has fallen off the bus", SuggestedAction.REBOOT, (FaultCause.GPU_LOST,)
            ),
        },
        policy=node_policy(),
        item_modes={
            "power_limit": "enforce",
            "fan_curve": "observe",
            "ecc": "observe",
            "transparent_hugepages": "enforce",
            "nouveau": "observe",
            "triton_cache": "observe",
        },
        clock_event_seconds={
            (0, "sw_power_cap"): 3.0,
            (1, "sw_thermal_slowdown"): 40.0,
            (1, "hw_thermal_slowdown"): 42.5,
        },
        xids=(
            XidCount(1, gpu_uuid(1), 48, 1, TIMESTAMP_SECONDS - 120.0),
            XidCount(1, gpu_uuid(1), 63, 2, TIMESTAMP_SECONDS - 110.0),
            XidCount(3, gpu_uuid(3), 79, 1, TIMESTAMP_SECONDS - 60.0),
            # a kernel-log line whose PCI address matched no GPU the agent knows
            XidCount(None, "", 13, 1, TIMESTAMP_SECONDS - 300.0),
        ),
        open_xids=frozenset({(1, 48), (3, 79)}),  # Xid 63 on GPU 1 was acknowledged
        services=(
            ServiceStatus("sglang", "sglang.service", up=True, last_latency_seconds=0.0123),
            ServiceStatus(
                "embeddings",
                "embeddings.service",
                up=False,
                consecutive_failures=3,
                detail="HTTP 503",
                last_latency_seconds=0.5,
            ),
            ServiceStatus("vllm", "vllm.service", up=None),
        ),
        remediations=(
            RemediationCount("service-unhealthy", "restart_service", "succeeded", 2),
            RemediationCount("xid-reset-gpu", "reset_gpu", "failed", 1),
        ),
        remediation_failing=(RemediationFailing("xid-reset-gpu", "failed"),),
        collectors=(
            CollectorStatus("gpu", True, 0.0042),
            CollectorStatus("policy", True, 0.0170),
            CollectorStatus("xid_nvml", True, 0.0001),
            CollectorStatus("kmsg", False, 0.0002, last_error="open /dev/kmsg: permission denied"),
            CollectorStatus("services", True, 0.0130),
        ),
        recent_events=events,
        collect_duration_seconds=0.0345,
    )
    return replace(snapshot, **overrides)


def snapshot_from_backend(backend: GpuBackend, *, version: str = VERSION, **fields: Any) -> NodeSnapshot:
    """Sample every GPU of an initialised backend; keyword arguments fill the other snapshot fields."""
    now = time.time()
    values: dict[str, Any] = {
        "timestamp_seconds": now,
        "started_seconds": now,
        "version": version,
        "backend": backend.name,
        "driver_version": backend.driver_version(),
        "gpus": tuple(sample_all(backend)),
    }
    values.update(fields)
    return NodeSnapshot(**values)


def inference_fields(timestamp_seconds: float = TIMESTAMP_SECONDS) -> dict[str, Any]:
    """Snapshot fields for the inference servers of `node_snapshot()`'s services: sglang's server
    exports its figures (within its 1.5 s SLO; a quantile it could not give is absent), the
    embeddings server's last scrape failed; GPU 0 and 1 hold sglang's processes, GPU 1 also one
    process of no configured service."""
    sglang = ServiceFigures(
        "sglang",
        "sglang",
        timestamp_seconds,
        300.0,
        latency={
            "e2e": LatencyFigures(120, 0.6, {0.5: 0.55, 0.95: 0.72, 0.99: 0.79}),
            "ttft": LatencyFigures(120, 0.11, {0.5: 0.1, 0.95: 0.15, 0.99: None}),
            "queue": LatencyFigures(120, 0.01, {0.5: 0.005, 0.95: 0.02, 0.99: 0.04}),
        },
        running=9,
        waiting=2,
        kv_cache_usage_ratio=0.41,
        generation_tokens_per_second=320.5,
        tokens_per_joule=0.52,
        # the server's histograms and token counter as counters (sglang's bounds, trimmed), and the
        # energy of its GPUs: 96,160 tokens over 184,923 J is the 0.52 tokens/J of the window
        counters=ServiceCounters(
            histograms={
                "e2e": CounterHistogram((0.4, 0.6, 0.8, 1.0, math.inf), (0, 61, 117, 120, 120), 120, 72.0),
                "ttft": CounterHistogram((0.1, 0.2, 0.4, math.inf), (60, 119, 120, 120), 120, 13.2),
                "queue": CounterHistogram((0.0, 0.1, math.inf), (24, 120, 120), 120, 1.2),
            },
            generated_tokens=96_160.0,
            gpu_energy_joules=184_923.0,
        ),
    )
    embeddings = ServiceFigures("embeddings", "", 0.0, 0.0, error="timed out after 2 s")
    attribution = GpuAttribution(
        memory_bytes={"sglang": {0: 70 * 2**30, 1: 70 * 2**30}},
        pids={"sglang": (4100, 4101)},
        unattributed=(GpuProcessInfo(4242, 1, gpu_uuid(1), 2**30, "jupyter.service", "python"),),
    )
    return {
        "service_figures": {"sglang": sglang, "embeddings": embeddings},
        "gpu_attribution": attribution,
        "service_slo_seconds": {"sglang": {"e2e": 1.5, "ttft": 0.5}},
    }


#: The profiling telemetry readings of the H200 under a bf16 matmul (tests/fixtures/nvml-h200-gpm-fields.json, "loaded").
H200_LOADED_TELEMETRY = {
    "activity_supported": True,
    "graphics_active_ratio": 0.9985,
    "sm_active_ratio": 0.9646,
    "sm_occupancy_ratio": 0.1426,
    "tensor_active_ratio": 0.9364,
    "dram_active_ratio": 0.1747,
    "pcie_tx_bytes_per_second": 4.6875 * 2**20,
    "pcie_rx_bytes_per_second": 13.6875 * 2**20,
    "nvlink_tx_bytes_per_second": 0.0,
    "nvlink_rx_bytes_per_second": 0.0,
    "energy_joules": 7529.155,
    "power_instant_watts": 736.671,
    "memory_temperature_celsius": 49,
    "memory_max_temperature_celsius": 95,
    "memory_used_bytes": 1_194_131_456,
    "memory_free_bytes": 148_915_748_864,
    "memory_reserved_bytes": 644_939_776,
    "pcie_correctable_errors": 0,
    "pcie_fatal_errors": 0,
    "violation_reason_ns": {
        "sw_power_cap": 6_539_027_136,
        "sync_boost": 0,
        "sw_thermal": 0,
        "hw_thermal": 0,
        "hw_power_brake": 0,
    },
    "mig_enabled": False,
    "mig_pending": False,
    "max_graphics_clock_mhz": 1980,
    "max_sm_clock_mhz": 1980,
    "max_memory_clock_mhz": 3201,
    "applications_graphics_clock_mhz": 1980,
    "applications_memory_clock_mhz": 3201,
    "processes": (GpuProcess(pid=4242, used_memory_bytes=1_194_131_456, name="python3"),),
}
#: An HGX GPU with two NVLink links, one down with errors, whose fabric registration has not finished.
HGX_NVLINK_TELEMETRY = {
    "nvlink_errors": (
        NvLinkErrors(0, {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0}),
        NvLinkErrors(1, {"crc_flit": 12, "crc_data": 3, "replay": 1, "recovery": 0}),
    ),
    "nvlink_error_totals": {"crc_flit": 12, "crc_data": 3, "replay": 1, "recovery": 0},
    "nvlink_up": (True, False),
    "fabric_state": 2,  # IN_PROGRESS
    "fabric_status": 0,
}


def telemetry_gpus() -> tuple[GpuSample, ...]:
    """`node_gpus()` with the profiling telemetry: GPU 0 under a bf16 matmul as the H200 answered, GPU 1
    with NVLink (a link down, errors) and an unfinished fabric registration, no GPM on the RTX."""
    gpu0, gpu1, gpu2, gpu3 = node_gpus()
    return (
        replace(gpu0, **H200_LOADED_TELEMETRY),
        replace(gpu1, **HGX_NVLINK_TELEMETRY),
        replace(gpu2, activity_supported=False),
        gpu3,
    )
