"""The alert catalogue's cases, written once and run two ways (tests/alerts/test_alert_rules_promtool.py):
as promtool unit tests of the shipped rule file (the real Prometheus rule evaluation, its template
rendering compared with the agent's), and through the agent's own evaluation of the same condition
over the same series at each evaluation (what it pushes). A case is input series in promtool's
notation and, at some evaluation times, the alerts that fire then: their labels beyond the node's.

Every alert has a case where it fires and one where it stays quiet (a check with no alert)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

NODE = {"instance": "gpu-node-1:9481", "job": "gpu-agent"}
OTHER_NODE = {"instance": "gpu-node-2:9481", "job": "gpu-agent"}
#: How far back an instant selector looks for a sample, as Prometheus does.
LOOKBACK_MINUTES = 5


def uuid(gpu: int) -> str:
    return f"GPU-5e1b7a3c-000{gpu}-4d2e-9f10-6a7b8c9d0e0{gpu}"


def gpu(index: int) -> dict[str, str]:
    return {"gpu": str(index), "uuid": uuid(index)}


@dataclass(frozen=True)
class Series:
    name: str
    labels: Mapping[str, str]
    values: str  # promtool's notation: "0 0 1x10", "_x3 1x5", "0+60x20", "stale"

    def selector(self) -> str:
        inner = ",".join(f'{k}="{v}"' for k, v in self.labels.items())
        return f"{self.name}{{{inner}}}"

    def points(self) -> list[float | str | None]:
        """The value at each minute: a number, None (no sample) or "stale"."""
        found: list[float | str | None] = []
        for token in self.values.split():
            if token in ("_", "stale"):
                found.append(None if token == "_" else "stale")
                continue
            repeated = re.fullmatch(r"(_|[-\d.e]+)(?:([+-][\d.e]+))?x(\d+)", token)
            if repeated is None:
                found.append(float(token))
                continue
            start, step, times = repeated.groups()
            if start == "_":
                found += [None] * int(times)
                continue
            delta = float(step or 0)
            # `a+bxN` is a, a+b, ... a+N*b: N+1 points; `axN` (no step) is a N+1 times too
            found += [float(start) + delta * n for n in range(int(times) + 1)]
        return found

    def at(self, minute: int) -> float | None:
        """The value an instant selector reads at `minute` (the last sample within the lookback)."""
        points = self.points()
        for back in range(min(minute, len(points) - 1), max(-1, minute - LOOKBACK_MINUTES - 1), -1):
            value = points[back] if back < len(points) else None
            if value == "stale":
                return None
            if value is not None:
                assert isinstance(value, float)
                return value
        return None


def on(node: Mapping[str, str], name: str, values: str, **labels: str) -> Series:
    return Series(name, {**node, **labels}, values)


def s(name: str, values: str, **labels: str) -> Series:
    """A series of the node under test."""
    return on(NODE, name, values, **labels)


@dataclass(frozen=True)
class Case:
    alert: str
    series: tuple[Series, ...]
    #: minute -> the alerts firing then (each its labels beyond instance, job, alertname, severity)
    fires: Mapping[int, tuple[Mapping[str, str], ...]]
    #: the agent's own evaluation is run only on series of a live agent (no silent-node case)
    agent: bool = True
    why: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)  # labels the alerts of other nodes carry


def case(alert: str, *series: Series, agent: bool = True, why: str = "", **fires: list[Mapping[str, str]]) -> Case:
    """`fires`: `at_4=[gpu(3)]` (minute 4: one alert with GPU 3's labels), `at_2=[]` (none)."""
    return Case(alert, series, {int(k[3:]): tuple(v) for k, v in fires.items()}, agent, why)


_THERMAL = "hw_thermal_slowdown"

CASES: tuple[Case, ...] = (
    # -- the agent itself --------------------------------------------------------------------------
    case(
        "GpuAgentDown",
        s("up", "1 1 0x10"),
        on({"instance": "node-exporter-1:9100", "job": "node"}, "up", "0x12"),
        agent=False,
        at_3=[],
        at_8=[{}],
    ),
    case(
        "GpuAgentNotCollecting",
        s("gpu_agent_up", "1x20"),
        s("gpu_agent_snapshot_timestamp_seconds", "0+60x3 180x17"),
        on(OTHER_NODE, "gpu_agent_up", "1x20"),
        on(OTHER_NODE, "gpu_agent_snapshot_timestamp_seconds", "0+60x20"),
        agent=False,
        at_6=[],
        at_12=[{}],
    ),
    case(
        "GpuAgentCollectorFailing",
        s("gpu_agent_up", "1x17"),
        s("gpu_agent_collector_success", "1 1 0x15", collector="kmsg"),
        s("gpu_agent_collector_success", "1x17", collector="gpu"),
        at_5=[],
        at_13=[{"collector": "kmsg"}],
    ),
    case(
        "GpuAgentRemediationFailing",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_remediation_failing", "_x3 1x4 stale _x4", rule="xid-reset-gpu", cause="failed"),
        why="fires from the agent's state at once, clears when it is no longer listed (the next success, an ack)",
        at_2=[],
        at_4=[{"rule": "xid-reset-gpu", "cause": "failed"}],
        at_9=[],
    ),
    case(
        "GpuAgentWouldRemediate",
        s(
            "gpu_agent_remediations_total",
            "_x3 1x40",
            rule="service-unhealthy",
            action="restart_service",
            outcome="dry_run",
        ),
        agent=False,
        at_2=[],
        at_5=[{"rule": "service-unhealthy", "action": "restart_service", "outcome": "dry_run"}],
        at_40=[],
    ),
    case(
        "GpuAgentConfigNeedsAttention",
        s("gpu_agent_up", "1x22"),
        s("gpu_agent_attention", "0 0 1x20", cause="no_rules"),
        s("gpu_agent_attention", "1x22", cause="service_down"),
        at_8=[],
        at_15=[{"cause": "no_rules"}],
    ),
    # -- the node and its GPUs ---------------------------------------------------------------------
    case(
        "GpuNodeProblem",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_node_problem", "0 0 1x10", cause="backend_unreadable"),
        s("gpu_agent_node_problem", "0x12", cause="no_gpus"),
        s("gpu_agent_node_problem", "1x12", cause="gpus_missing"),
        why="GPUs missing one by one are GpuLost's",
        at_3=[],
        at_5=[{"cause": "backend_unreadable"}],
    ),
    case(
        "GpuLost",
        s("gpu_agent_up", "1x7"),
        s("gpu_agent_gpu_up", "1 1 0x5", **gpu(3)),
        s("gpu_agent_gpu_up", "1x7", **gpu(0)),
        at_2=[],
        at_4=[gpu(3)],
    ),
    case(
        "GpuStale",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_gpu_stale", "0 0 1x10", **gpu(2)),
        s("gpu_agent_gpu_stale", "0x12", **gpu(0)),
        at_4=[],
        at_8=[gpu(2)],
    ),
    case(
        "GpuUnhealthy",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_gpu_health", "0 0 1x10", state="unhealthy", **gpu(1)),
        s("gpu_agent_gpu_health", "1 1 0x10", state="healthy", **gpu(1)),
        s("gpu_agent_gpu_health", "1x12", state="degraded", **gpu(2)),
        at_4=[],
        at_8=[gpu(1)],
    ),
    case(
        "GpuDegraded",
        s("gpu_agent_up", "1x22"),
        s("gpu_agent_gpu_health", "0 0 1x20", state="degraded", **gpu(1)),
        s("gpu_agent_gpu_health", "0x22", state="degraded", **gpu(0)),
        at_10=[],
        at_18=[gpu(1)],
    ),
    case(
        "GpuRebootRecommended",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_reboot_recommended", "_ _ 1x4 stale _x5", cause="gpu_lost"),
        s("gpu_agent_reboot_recommended", "0 0 stale _x4 0x5", cause="none"),
        why="fires while the flag asks for a reboot; `gpu-agent ack reboot` (or the reboot) withdraws it",
        at_1=[],
        at_3=[{"cause": "gpu_lost"}],
        at_9=[],
    ),
    case(
        "GpuRecoveryActionRequired",
        s("gpu_agent_up", "1x7"),
        s("gpu_agent_gpu_recovery_action", "0 0 1x5", action="gpu_reset", **gpu(2)),
        s("gpu_agent_gpu_recovery_action", "1x7", action="none", **gpu(0)),
        at_2=[],
        at_4=[{"action": "gpu_reset", **gpu(2)}],
    ),
    # -- Xids: open until fixed or acknowledged ----------------------------------------------------
    case(
        "GpuXidCritical",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_xid_open", "_x2 1x3 0x6", xid="48", **gpu(0)),
        s("gpu_agent_xid_open", "_x2 1x9", xid="13", **gpu(1)),
        s("gpu_agent_xid_catalog_info", "_x2 1x9", xid="48", severity="critical", action="reset_gpu"),
        s("gpu_agent_xid_catalog_info", "_x2 1x9", xid="13", severity="warning", action="restart_service"),
        why="resolves at the evaluation after the agent's reset fixed it, not 10 minutes later",
        at_1=[],
        at_3=[{"xid": "48", "action": "reset_gpu", **gpu(0)}],
        at_6=[],
    ),
    case(
        "GpuXidCritical",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_xid_open", "_x2 1x9", xid="79", **gpu(1)),
        s("gpu_agent_xid_catalog_info", "_x2 1x9", xid="79", severity="fatal", action="reboot"),
        why="a fatal code pages as critical",
        at_4=[{"xid": "79", "action": "reboot", **gpu(1)}],
    ),
    case(
        "GpuXidError",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_xid_open", "_x2 1x2 0x7", xid="13", **gpu(1)),
        s("gpu_agent_xid_open", "_x2 1x9", xid="31", **gpu(2)),
        s("gpu_agent_xid_catalog_info", "_x2 1x9", xid="13", severity="warning", action="restart_service"),
        s("gpu_agent_xid_catalog_info", "_x2 1x9", xid="31", severity="info", action="none"),
        why="an app-level Xid whose service the agent restarted leaves at once",
        at_1=[],
        at_3=[{"xid": "13", "action": "restart_service", **gpu(1)}],
        at_6=[],
    ),
    # -- clocks ------------------------------------------------------------------------------------
    case(
        "GpuThermalSlowdown",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_gpu_throttled", "0 0 1x10", reason=_THERMAL, **gpu(1)),
        s("gpu_agent_gpu_throttled", "0 0 1x10", reason="sw_thermal_slowdown", **gpu(1)),
        s("gpu_agent_gpu_throttled", "1x12", reason="hw_slowdown", **gpu(0)),
        at_4=[],
        at_8=[gpu(1)],
    ),
    case(
        "GpuHwSlowdown",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_gpu_throttled", "0 0 1x10", reason="hw_slowdown", **gpu(0)),
        s("gpu_agent_gpu_throttled", "1x12", reason=_THERMAL, **gpu(1)),
        at_4=[],
        at_8=[gpu(0)],
    ),
    case(
        "GpuPowerBrake",
        s("gpu_agent_up", "1x7"),
        s("gpu_agent_gpu_throttled", "0 0 1x5", reason="hw_power_brake_slowdown", **gpu(0)),
        at_2=[],
        at_4=[gpu(0)],
    ),
    case(
        "GpuTemperatureHigh",
        s("gpu_agent_up", "1x15"),
        s("gpu_agent_gpu_fault", "_ _ 1x13", cause="temperature_margin", **gpu(1)),
        s("gpu_agent_gpu_fault", "1x15", cause="clocks_slowed", **gpu(0)),
        at_8=[],
        at_13=[gpu(1)],
    ),
    # -- memory ------------------------------------------------------------------------------------
    case(
        "GpuUncorrectableEcc",
        s("gpu_agent_up", "1x30"),
        s("gpu_agent_gpu_fault", "_x3 1x20 stale _x6", cause="ecc_uncorrected", **gpu(1)),
        why="fires until the reset clears the count (20 minutes here), not for a fixed 10",
        at_2=[],
        at_5=[gpu(1)],
        at_20=[gpu(1)],
        at_26=[],
    ),
    case(
        "GpuRowRemapFailed",
        s("gpu_agent_up", "1x5"),
        s("gpu_agent_gpu_fault", "_ _ 1x3", cause="row_remap_failed", **gpu(2)),
        at_1=[],
        at_3=[gpu(2)],
    ),
    case(
        "GpuRowRemapPending",
        s("gpu_agent_up", "1x10"),
        s("gpu_agent_gpu_fault", "_ _ 1x8", cause="row_remap_pending", **gpu(2)),
        at_4=[],
        at_8=[gpu(2)],
    ),
    # -- links -------------------------------------------------------------------------------------
    case(
        "GpuPcieDegraded",
        s("gpu_agent_up", "1x15"),
        s("gpu_agent_gpu_pcie_degraded", "0 0 1x13", **gpu(4)),
        s("gpu_agent_gpu_pcie_degraded", "0x15", **gpu(0)),
        at_8=[],
        at_13=[gpu(4)],
    ),
    case(
        "GpuNvlinkErrors",
        s("gpu_agent_up", "1x15"),
        s("gpu_agent_gpu_fault", "_x3 1x8 stale _x3", cause="nvlink_errors", **gpu(5)),
        at_2=[],
        at_6=[gpu(5)],
        at_14=[],
    ),
    case(
        "GpuNvlinkDown",
        s("gpu_agent_up", "1x10"),
        s("gpu_agent_gpu_nvlink_up", "_ _ 0x8", link="3", **gpu(6)),
        at_4=[],
        at_8=[{"link": "3", **gpu(6)}],
    ),
    case(
        "GpuFabricNotRegistered",
        s("gpu_agent_up", "1x10"),
        s("gpu_agent_gpu_fault", "_ _ 1x8", cause="fabric", **gpu(3)),
        at_4=[],
        at_8=[gpu(3)],
    ),
    # -- policy and readiness ----------------------------------------------------------------------
    case(
        "GpuPolicyDrift",
        s("gpu_agent_up", "1x20"),
        s("gpu_agent_policy_drift", "0 0 1x18", item="power_limit", **gpu(0)),
        s("gpu_agent_policy_drift", "1x20", item="next_boot", gpu="", uuid=""),
        s("gpu_agent_policy_enforced", "1x20", item="power_limit"),
        s("gpu_agent_policy_enforced", "1x20", item="next_boot"),
        at_10=[],
        at_18=[{"item": "power_limit", **gpu(0)}],
    ),
    case(
        "GpuPolicyDriftObserved",
        s("gpu_agent_up", "1x20"),
        s("gpu_agent_policy_drift", "0 0 1x18", item="power_limit", **gpu(0)),
        s("gpu_agent_policy_enforced", "0x20", item="power_limit"),
        at_10=[],
        at_18=[{"item": "power_limit", **gpu(0)}],
    ),
    case(
        "GpuNextBootNotReady",
        s("gpu_agent_up", "1x15"),
        s("gpu_agent_boot_ready", "1 1 stale _x12", cause="none"),
        s("gpu_agent_boot_ready", "_ _ 0x13", cause="module_missing"),
        at_8=[],
        at_13=[{"cause": "module_missing"}],
    ),
    case(
        "GpuNodeNotAsDeclared",
        s("gpu_agent_up", "1x20"),
        s("gpu_agent_policy_drift", "0 0 1x18", item="driver", gpu="", uuid=""),
        s("gpu_agent_policy_drift", "1x20", item="power_limit", **gpu(0)),
        at_10=[],
        at_18=[{"item": "driver"}],
    ),
    # -- services ----------------------------------------------------------------------------------
    case(
        "InferenceServiceDown",
        s("gpu_agent_up", "1x7"),
        s("gpu_agent_service_up", "1 1 0x5", service="sglang", unit=""),
        s("gpu_agent_service_up", "1 1 0x5", service="vllm", unit="vllm.service"),
        s("gpu_agent_service_up", "1x7", service="embeddings", unit="embeddings.service"),
        why="a service run by a command has no unit: the alert names the service alone",
        at_2=[],
        at_4=[{"service": "sglang"}, {"service": "vllm"}],
    ),
    case(
        "InferenceLatencyAboveSlo",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_service_latency_slo_breached", "0 0 1x10", service="sglang", kind="e2e"),
        s("gpu_agent_service_latency_slo_breached", "0x12", service="sglang", kind="ttft"),
        at_5=[],
        at_8=[{"service": "sglang", "kind": "e2e"}],
    ),
    case(
        "InferenceKvCacheNearFull",
        s("gpu_agent_up", "1x12"),
        s("gpu_agent_service_kv_cache_usage_ratio", "0.5 0.5 0.97x10", service="sglang"),
        s("gpu_agent_service_requests_waiting", "0 0 4x10", service="sglang"),
        s("gpu_agent_service_kv_cache_usage_ratio", "0.99x12", service="busy"),
        s("gpu_agent_service_requests_waiting", "0x12", service="busy"),
        at_5=[],
        at_8=[{"service": "sglang"}],
    ),
    case(
        "InferenceMetricsUnreadable",
        s("gpu_agent_up", "1x15"),
        s("gpu_agent_service_metrics_up", "1 0x14", service="sglang"),
        s("gpu_agent_service_metrics_up", "1x15", service="vllm"),
        at_8=[],
        at_12=[{"service": "sglang"}],
    ),
    # -- a silent node keeps its open alerts a while -----------------------------------------------
    case(
        "GpuUncorrectableEcc",
        s("gpu_agent_up", "1x4 stale"),
        s("gpu_agent_gpu_fault", "_ 1x3 stale", cause="ecc_uncorrected", **gpu(1)),
        agent=False,
        why="the agent stopped answering at minute 5: its open fault keeps firing for 10 minutes, then resolves",
        at_3=[gpu(1)],
        at_10=[gpu(1)],
        at_16=[],
    ),
    case(
        "GpuLost",
        s("gpu_agent_up", "1x5 0x10"),
        s("gpu_agent_gpu_up", "0x5 stale _x9", **gpu(2)),
        agent=False,
        why="an agent that restarts (gpu_agent_up 0 before its first loop) keeps them too",
        at_4=[gpu(2)],
        at_9=[gpu(2)],
    ),
)
