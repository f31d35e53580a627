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
