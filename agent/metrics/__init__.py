"""Prometheus metrics over the daemon's last `NodeSnapshot`.

A scrape never touches the GPU backend: `SnapshotCollector.collect()` renders whatever
`get_snapshot()` returns (a reference the loop swaps once per iteration), so a hung NVML call can
stale a GPU but never a scrape. `MetricsServer` serves `/metrics` and `/healthz` from its own
registry on a daemon thread.

The daemon's verdicts are exported as such (agent/verdict.py), and the alert rules and the dashboard
are built on them, not on raw readings: `gpu_agent_gpu_health{state}` and `_health_info{cause}`,
`gpu_agent_gpu_fault{cause}`, `gpu_agent_gpu_pcie_degraded`, `gpu_agent_gpu_throttled{reason}`,
`gpu_agent_policy_drift`, `gpu_agent_reboot_recommended`, `gpu_agent_backend_up`,
`gpu_agent_node_problem{cause}`. Labels carry identities and bounded codes, never free text or pids.

Every series belongs to a named family (agent/names/metric_families.py): `metrics.families` switches
them, and a family that is off lists only its notable series (a counter that counted, a fault that
is open). The health one-hot, the node's verdicts and the per-GPU Xid total are present from 0.

Conventions: base units (watts, hertz, bytes, seconds, ratios 0-1); every per-GPU series carries
`gpu` (NVML index) and `uuid`; node-level policy items carry `gpu=""`; a reading that is None
(not supported, or the read failed: see `gpu_agent_gpu_read_error`) is omitted, never exported
as 0. Readings of a stale GPU (a call hung, see `gpu_agent_gpu_stale`) are the last good ones.
"""
