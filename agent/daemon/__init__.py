"""`gpu-agent run`: collect -> snapshot -> evaluate -> act -> publish, once per interval.

The parts, one job each, made by the thin `Daemon` (core.py), each handed the live parts (live.py)
it asks, at the time of use, for what it needs:

- live.py: the parts every other part reaches, and what a reload swaps (the config, the prober and
  the inference monitor) or what opens late (the store);
- session.py: the backend session (NVML opened and reopened in the library lane, library faults,
  the NVML event wait, the write guard);
- gpu_collector.py: the GPU collector (enumeration, fast and slow tier, stale GPUs);
- policy_loop.py and drift.py: the policy loop (plan/apply steps, drift events, apply failures);
- agent.snapshot: the snapshot builder and the health watchers (shared with `status --direct`);
- node_memory.py: the node memory (agent/node_memory/), loaded once the store opens, saved each loop;
- remediator.py, action_worker.py and lanes.py: the event store, the rules, the action worker and
  its lanes;
- publisher.py: the published snapshot, the metrics and API servers, systemd's STATUS= line;
- reload.py: a reload, all or nothing; intake.py: events from the source threads; watchdog.py:
  systemd's watchdog.

Threads: one lane per GPU for time-bounded NVML reads (agent.daemon.bounded), the NVML event wait and
the kernel-log reader feeding the Xid watcher, the service prober, the metrics and API servers,
the action worker's lanes (a GPU reset can take a minute; the loop must not wait for it): one
notify lane for alerts, webhooks and reboot recommendations, and a thread for each job that
changes the node (a restart, a reset, a `gpu-agent tune` sweep, agent/tune) while no earlier job
touches its GPUs; and the watchdog pinger. Only the loop builds snapshots; everyone else reads the last published one.

systemd: READY=1 after the first full collection; STATUS= one line per loop; WATCHDOG=1 only
while the loop keeps completing; STOPPING=1 on the way out. SIGTERM/SIGINT stop (fans go back to
automatic on every exit path); SIGHUP reloads config and rules all or nothing: moved listeners are
bound before the old ones close, a change only a restart applies (state_dir, backend, host_root) or
a listener that cannot be bound keeps the running config whole and is shown until a reload
succeeds; an applied reload first ends a job (a sweep) the new config would not let write its
settings or whose service it drops, with the originals put back under the old guard, then swaps the
backend's write guard to the new mode.
"""

from agent.daemon.core import Daemon
from agent.daemon.timing import LoopTiming

__all__ = ["Daemon", "LoopTiming"]
