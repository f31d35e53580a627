"""The names of the alerts gpu-agent's catalogue holds (agent/alerts/catalog.py, docs/alerts.md) and
what the config needs to know of them: which labels it may not set, the job and the runbook URL
the shipped rules assume. Here, below every package, so the config validates `alerts.for_seconds`
and `alerts.labels` without importing the catalogue (which reads the config's types);
tests/alerts/test_alert_names.py holds this list and the catalogue's the same, in order."""

from __future__ import annotations

from typing import Final

ALERT_NAMES: Final = (
    "GpuAgentDown",
    "GpuAgentNotCollecting",
    "GpuAgentCollectorFailing",
    "GpuAgentRemediationFailing",
    "GpuAgentWouldRemediate",
    "GpuAgentConfigNeedsAttention",
    "GpuNodeProblem",
    "GpuLost",
    "GpuStale",
    "GpuUnhealthy",
    "GpuDegraded",
    "GpuRebootRecommended",
    "GpuRecoveryActionRequired",
    "GpuXidCritical",
    "GpuXidError",
    "GpuThermalSlowdown",
    "GpuHwSlowdown",
    "GpuPowerBrake",
    "GpuTemperatureHigh",
    "GpuUncorrectableEcc",
    "GpuRowRemapFailed",
    "GpuRowRemapPending",
    "GpuPcieDegraded",
    "GpuNvlinkErrors",
    "GpuNvlinkDown",
    "GpuFabricNotRegistered",
    "GpuPolicyDrift",
    "GpuPolicyDriftObserved",
    "GpuNextBootNotReady",
    "GpuNodeNotAsDeclared",
    "InferenceServiceDown",
    "InferenceLatencyAboveSlo",
    "InferenceKvCacheNearFull",
    "InferenceMetricsUnreadable",
)
#: Where each alert's runbook section is: the docs the package installs (docs/alerts.md).
DEFAULT_RUNBOOK_URL: Final = "file:///usr/share/doc/gpu-agent/docs/alerts.md"
#: Labels the agent sets on every push itself, which `alerts.labels` may not.
RESERVED_LABELS: Final = frozenset({"alertname", "severity", "instance", "job"})
#: The job the shipped rules expect gpu-agent's targets under (GpuAgentDown; `alerts.job` for pushes).
DEFAULT_JOB: Final = "gpu-agent"
