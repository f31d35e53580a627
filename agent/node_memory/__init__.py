"""The node's memory across agent restarts: which GPUs this boot had, what the Xid and throttle
watchers counted, and the service prober's failure streaks (docs/node-memory.md).

A restart of the agent is not a reboot: a GPU that fell off the bus is still gone, its Xids still
happened. So the daemon keeps, per boot (`/proc/sys/kernel/random/boot_id` under host_root), the
GPU inventory, the Xid counters and health window, the time per clock-event reason with the start
of each slowdown active now, and each service's declared state and failure streak in the store
(its tables: agent/store/boot_tables.py), and reads them back when it starts. A reboot starts a new, empty
memory. Each part is written only when it changed since the last write.

- inventory.py: the boot a memory belongs to, and the samples as the memory sees them: a
  remembered GPU that is missing (not enumerated at all) added, `up=False` and read as lost, so it
  stays in `status` and `/metrics` (gpu_agent_gpu_up 0, health unhealthy) until it answers again or
  an operator acknowledges it gone (`gpu-agent ack gpu:UUID`); then it is dropped from the samples.
- remembered.py: the same memory read once, read-only, for `gpu-agent status --direct`: the one-off
  read then judges the node with what the daemon knows (an Xid seen an hour ago, a slowdown held
  for minutes, a GPU gone, a service declared down), and reaches the daemon's verdict.

The daemon's side, which loads the memory into the watchers, the prober and the collector once the
store is open and saves what they counted, is agent/daemon/node_memory.py. The number of GPUs the
node should have, which the memory's missing GPUs count in, is agent.verdict `expected_gpu_count`.
"""
