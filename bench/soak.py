"""Soak: hours of simulated time with random faults on 8 simulated GPUs, in a few minutes of wall time.

The daemon runs in process (`Daemon.loop_once`) on a fake wall clock that moves one interval (5 s) per
loop, with its event store, the shipped rules, the action worker and the kernel-log reader running for
real, in enforce mode, so every remediation path (service restarts of a `manager: command` service,
GPU resets, hooks, reboot recommendations, alerts that find no Alertmanager) runs again and again, and
the daemon itself is stopped and started again every `restart_every_loops` (its memory is the store).
Each loop draws faults from a seeded random stream: Xids through NVML and the kernel log, ECC events,
GPUs that fall off the bus and come back, resets required, thermal slowdowns, PCIe links that train
down, an operator's policy drift, NVML calls that fail or hang, and short driver outages.

Reported (and, for the short CI version in tests/test_soak_short.py, asserted):
- exceptions: anything raised out of the loop or in any thread (must be none);
- memory: Python heap (tracemalloc) and RSS sampled along the run; the slope over the second half
  (after warm-up) in KiB per simulated hour, which a leak makes grow with the run;
- events lost: every event the watchers produced (as keyed for the store) that is not in the store;
- remediation limits, judged from what really ran, not from the store the agent writes: the soak's
  hook rule (`soak-hook`, cooldown 300 s, max 3 per hour) logs every run with the simulated time and
  the GPU; the most runs on one GPU within one window against max_attempts, and the shortest gap
  between two runs against the cooldown. The service's start/stop commands log every restart.

Usage: python3 -m bench.soak [--hours 2] [--seed 1] [--profile h200x8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import random
import shutil
import tempfile
import threading
import time
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import psutil

from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.sim import REASON_HW_SLOWDOWN, REASON_HW_THERMAL, SimulatedBackend
from agent.config import AgentConfig
from agent.daemon import Daemon, LoopTiming
from agent.daemon.sd_notify import SdNotifier
from agent.demo.scenario import build_demo_host, default_rules_dir
from agent.events import Event
from agent.host.paths import HostPaths
from agent.rules.config import Rule, load_rules
from agent.store.database import Store
from agent.watch.fake_kernel_log import append_kmsg, xid_line
from agent.watch.nvml_events import NvmlEventSource

INTERVAL_SECONDS = 5.0
HOOK_RULE = "soak-hook"
HOOK_COOLDOWN_SECONDS = 300.0
HOOK_MAX_ATTEMPTS = 3
HOOK_WINDOW_SECONDS = 3600.0
#: A hook runs on the worker a loop or two after its decision; gaps are measured between runs.
HOOK_LATENESS_SECONDS = 3 * INTERVAL_SECONDS
XIDS = (13, 31, 43, 45, 48, 63, 64, 74, 79, 92, 94, 95, 119, 154)
FAULT_CALLS = ("temperature_celsius", "power_usage_watts", "memory_info", "ecc_errors", "pcie_link", "identity")
FAULT_KINDS = (
    GpuErrorKind.UNKNOWN,
    GpuErrorKind.TIMEOUT,
    GpuErrorKind.NOT_SUPPORTED,
    GpuErrorKind.NO_PERMISSION,
    GpuErrorKind.GPU_LOST,
)
POLICY = {
    "gpus": [
        {
            "match": {"model": "NVIDIA H200*"},
            "power_limit_watts": 600,
            "persistence": "enabled",
            "locked_clocks": {"gpu_mhz": [1500, 1980]},
        },
        {"match": {"model": "NVIDIA RTX PRO 6000*"}, "power_limit_watts": 450, "fan_curve": [[30, 30], [75, 100]]},
    ]
}


@dataclass
class SoakResult:
    simulated_seconds: float = 0.0
    wall_seconds: float = 0.0
    loops: int = 0
    gpus: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    exceptions: list[str] = field(default_factory=list)
    events_produced: int = 0
    events_stored: int = 0
    events_lost: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    attempts_over_limit: list[str] = field(default_factory=list)
    max_attempts_in_window: dict[str, tuple[int, int]] = field(default_factory=dict)  # rule -> (seen, limit)
    cooldown_violations: list[str] = field(default_factory=list)
    hook_runs: int = 0
    service_restarts: int = 0
    daemon_restarts: int = 0
    heap_kib: list[tuple[float, float]] = field(default_factory=list)  # (simulated hours, KiB)
    rss_kib: list[tuple[float, float]] = field(default_factory=list)
    loop_seconds: list[float] = field(default_factory=list)

    @staticmethod
    def slope_kib_per_hour(samples: Sequence[tuple[float, float]]) -> float | None:
        """Least-squares slope over the second half (the first half is warm-up: caches filling)."""
        half = list(samples[len(samples) // 2 :])
        if len(half) < 3:
            return None
        mean_x = sum(x for x, _ in half) / len(half)
        mean_y = sum(y for _, y in half) / len(half)
        spread = sum((x - mean_x) ** 2 for x, _ in half)
        if spread == 0:
            return None
        return sum((x - mean_x) * (y - mean_y) for x, y in half) / spread

    def summary(self) -> dict[str, Any]:
        loop_ms = sorted(self.loop_seconds)
        return {
            "simulated_hours": round(self.simulated_seconds / 3600, 2),
            "wall_seconds": round(self.wall_seconds, 1),
            "loops": self.loops,
            "gpus": self.gpus,
            "faults_injected": dict(self.faults),
            "exceptions": self.exceptions,
            "events_produced": self.events_produced,
            "events_stored": self.events_stored,
            "events_lost": len(self.events_lost),
            "remediation_outcomes": dict(self.outcomes),
            "max_attempts_in_window": {
                k: {"seen": s, "limit": lim} for k, (s, lim) in self.max_attempts_in_window.items()
            },
            "attempts_over_limit": self.attempts_over_limit,
            "hook_runs": self.hook_runs,
            "service_restarts": self.service_restarts,
            "daemon_restarts": self.daemon_restarts,
            "cooldown_violations": self.cooldown_violations,
            "heap_kib_start": self.heap_kib[0][1] if self.heap_kib else None,
            "heap_kib_end": self.heap_kib[-1][1] if self.heap_kib else None,
            "heap_slope_kib_per_hour": _round(self.slope_kib_per_hour(self.heap_kib)),
            "rss_kib_start": self.rss_kib[0][1] if self.rss_kib else None,
            "rss_kib_end": self.rss_kib[-1][1] if self.rss_kib else None,
            "rss_slope_kib_per_hour": _round(self.slope_kib_per_hour(self.rss_kib)),
            "loop_ms_median": round(loop_ms[len(loop_ms) // 2] * 1000, 2) if loop_ms else None,
            "loop_ms_max": round(loop_ms[-1] * 1000, 2) if loop_ms else None,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def _thread_exceptions(into: list[str]) -> Iterator[None]:
    """Exceptions that end any thread (a watcher, the action worker) are failures too."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        into.append(f"thread {args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


@dataclass(frozen=True)
class _Node:
    config: AgentConfig
    rules_dir: Path
    clock_file: Path  # the simulated time, for the hook and the service commands to log
    hook_log: Path
    service_log: Path


def _write_clock(path: Path, now: float) -> None:
    """Atomically: a hook reading it mid-write must not see an empty file."""
    temporary = path.with_name(path.name + ".new")
    temporary.write_text(f"{now}")
    temporary.replace(path)


def _script(path: Path, text: str) -> Path:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return path


def _node(directory: Path, profile: str) -> _Node:
    host = directory / "host"
    build_demo_host(host)
    rules_dir = directory / "rules.d"
    rules_dir.mkdir(mode=0o755)
    for source in sorted(default_rules_dir().glob("*.yaml")):
        shutil.copy(source, rules_dir / source.name)
        (rules_dir / source.name).chmod(0o644)
    bin_dir = directory / "bin"
    bin_dir.mkdir(mode=0o755)
    clock_file, hook_log, service_log = directory / "clock", directory / "hook.log", directory / "service.log"
    hook = _script(bin_dir / "hook.sh", f'echo "$(cat {clock_file}) $GPU_AGENT_GPU_UUID" >> {hook_log}\n')
    service = _script(bin_dir / "service.sh", f'echo "$1 $(cat {clock_file})" >> {service_log}\n')
    codes = ", ".join(str(code) for code in XIDS if code != 79)
    (rules_dir / "00-soak.yaml").write_text(
        f"""rules:
  - name: {HOOK_RULE}
    match: {{xid: {{codes: [{codes}]}}}}
    actions: [{{run_hook: {{argv: [{hook}], timeout_seconds: 10}}}}]
    cooldown_seconds: {HOOK_COOLDOWN_SECONDS:g}
    max_attempts: {HOOK_MAX_ATTEMPTS}
    window_seconds: {HOOK_WINDOW_SECONDS:g}
"""
    )
    (rules_dir / "00-soak.yaml").chmod(0o644)
    config = AgentConfig.model_validate(
        {
            "mode": "enforce",
            "backend": "simulated",
            "simulated": {"profile": profile},
            "host_root": str(host),
            "state_dir": str(directory / "state"),
            "interval_seconds": INTERVAL_SECONDS,
            "policy_interval_seconds": 60,
            "api": {"socket": str(directory / "agent.sock")},
            "remediation": {"rules_dir": str(rules_dir)},
            "policy": POLICY,
            "services": [
                {
                    "name": "inference",
                    "manager": "command",
                    "gpus": [0, 1],
                    "start_command": [str(service), "start"],
                    "stop_command": [str(service), "stop"],
                    "command_timeout_seconds": 10,
                }
            ],
        }
    )
    return _Node(config, rules_dir, clock_file, hook_log, service_log)


class Faults:
    """The random fault stream: each loop, each fault kind fires with its probability; conditions that
    hold (a lost GPU, a failing call, a slowdown) clear again after a random number of loops."""

    def __init__(self, gpus: SimulatedBackend, host: HostPaths, rng: random.Random, result: SoakResult) -> None:
        self.gpus = gpus
        self.host = host
        self.rng = rng
        self.result = result
        self.count = len(gpus.profile.models)
        self.bus_ids = [gpus.identity(gpu).pci_bus_id for gpu in range(self.count)]
        self.clear_at: list[tuple[int, Callable[[], None]]] = []

    def _later(self, loop: int, undo: Callable[[], None], low: int = 2, high: int = 30) -> None:
        self.clear_at.append((loop + self.rng.randint(low, high), undo))

    def step(self, loop: int) -> None:
        rng, gpus = self.rng, self.gpus
        due = [undo for at, undo in self.clear_at if at <= loop]
        self.clear_at = [(at, undo) for at, undo in self.clear_at if at > loop]
        for undo in due:
            undo()
        gpu = rng.randrange(self.count)
        if rng.random() < 0.05:
            gpus.inject_xid(gpu, rng.choice(XIDS))
            self.result.faults["xid_nvml"] += 1
        if rng.random() < 0.03:
            append_kmsg(self.host, xid_line(self.bus_ids[gpu], rng.choice(XIDS)))
            self.result.faults["xid_kernel_log"] += 1
        if rng.random() < 0.02:
            gpus.inject_ecc_event(gpu, uncorrected=rng.random() < 0.3)
            self.result.faults["ecc_event"] += 1
        if rng.random() < 0.005:
            gpus.set_lost(gpu, True)
            self._later(loop, partial(gpus.set_lost, gpu, False))
            self.result.faults["gpu_lost"] += 1
        if rng.random() < 0.005:
            gpus.set_reset_required(gpu, True)
            self._later(loop, partial(gpus.set_reset_required, gpu, False))
            self.result.faults["reset_required"] += 1
        if rng.random() < 0.02:
            gpus.set_clock_event_reasons(gpu, rng.choice((REASON_HW_THERMAL, REASON_HW_SLOWDOWN)))
            self._later(loop, partial(gpus.set_clock_event_reasons, gpu, None), 5, 40)
            self.result.faults["slowdown"] += 1
        if rng.random() < 0.01:
            gpus.set_pcie_link(gpu, 4, 8)
            self._later(loop, partial(gpus.set_pcie_link, gpu, 5, 16))
            self.result.faults["pcie_degraded"] += 1
        if rng.random() < 0.02:
            with contextlib.suppress(GpuError):  # a lost GPU cannot be drifted either
                gpus.set_power_limit_watts(gpu, rng.choice((550, 650, 700)))
                self.result.faults["policy_drift"] += 1
        if rng.random() < 0.02:
            call, kind = rng.choice(FAULT_CALLS), rng.choice(FAULT_KINDS)
            gpus.fail_call(gpu, call, kind)
            self._later(loop, partial(gpus.fail_call, gpu, call, None))
            self.result.faults["failing_call"] += 1
        if rng.random() < 0.003:
            gpus.hang_call(gpu, "temperature_celsius", 0.3)
            self._later(loop, partial(gpus.hang_call, gpu, "temperature_celsius", None), 1, 3)
            self.result.faults["hanging_call"] += 1
        if rng.random() < 0.002:
            for call in ("device_count", "init"):
                gpus.fail_call(None, call, GpuErrorKind.DRIVER_NOT_LOADED)
                self._later(loop, partial(gpus.fail_call, None, call, None), 3, 3)
            self.result.faults["driver_outage"] += 1

    def clear_all(self) -> None:
        for _, undo in self.clear_at:
            undo()
        self.clear_at = []


def _check_hook_log(hook_log: Path, result: SoakResult) -> None:
    """The caps, from the hook's own log of its runs (simulated time, GPU uuid): never from the store."""
    runs: dict[str, list[float]] = defaultdict(list)
    lines = hook_log.read_text().splitlines() if hook_log.exists() else []
    for line in lines:
        at, _, uuid = line.partition(" ")
        runs[uuid].append(float(at))
    result.hook_runs = len(lines)
    for uuid, times in runs.items():
        times.sort()
        most = max(sum(1 for t in times if start <= t < start + HOOK_WINDOW_SECONDS) for start in times)
        seen, _ = result.max_attempts_in_window.get(f"{HOOK_RULE} (hook log)", (0, HOOK_MAX_ATTEMPTS))
        result.max_attempts_in_window[f"{HOOK_RULE} (hook log)"] = (max(seen, most), HOOK_MAX_ATTEMPTS)
        if most > HOOK_MAX_ATTEMPTS:
            result.attempts_over_limit.append(f"{HOOK_RULE} hook ran {most} times on {uuid} in one window")
        gaps = [b - a for a, b in itertools.pairwise(times)]
        if gaps and min(gaps) < HOOK_COOLDOWN_SECONDS - HOOK_LATENESS_SECONDS:
            result.cooldown_violations.append(
                f"{HOOK_RULE} hook on {uuid}: runs {min(gaps):.0f} s apart < {HOOK_COOLDOWN_SECONDS:g} s"
            )


def _check_limits(store: Store, rules: Sequence[Rule], result: SoakResult) -> None:
    by_name = {rule.name: rule for rule in rules}
    attempts: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in store.remediations(limit=1_000_000):
        result.outcomes[row.outcome.value] += 1
        if row.counted and not row.acked:
            attempts[(row.rule, row.target_key)].append(row.started_seconds)
    for (name, target), times in attempts.items():
        rule = by_name[name]
        times.sort()
        most = max(sum(1 for t in times if start <= t < start + rule.window_seconds) for start in times)
        seen, _ = result.max_attempts_in_window.get(name, (0, rule.max_attempts))
        result.max_attempts_in_window[name] = (max(seen, most), rule.max_attempts)
        if most > rule.max_attempts:
            result.attempts_over_limit.append(f"{name} on {target}: {most} attempts in one window")
        gaps = [b - a for a, b in itertools.pairwise(times)]
        if gaps and min(gaps) < rule.cooldown_seconds:
            result.cooldown_violations.append(f"{name} on {target}: {min(gaps):.0f} s < {rule.cooldown_seconds:g} s")


def run_soak(
    directory: Path,
    simulated_seconds: float,
    profile: str = "h200x8",
    seed: int = 1,
    samples: int = 20,
    progress: Callable[[str], None] | None = None,
    restart_every_loops: int = 240,
) -> SoakResult:
    """The soak in `directory` (scratch: config, state, host tree); see the module docstring."""
    result = SoakResult()
    rng = random.Random(seed)
    node = _node(directory, profile)
    config = node.config
    clock = FakeClock()
    _write_clock(node.clock_file, clock.now)
    produced: dict[str, Event] = {}
    # Faster event-wait retries, so a driver outage of a few simulated seconds is also a short real one.
    event_source = partial(NvmlEventSource, timeout_seconds=0.05, backoff_seconds=0.05)
    loops = int(simulated_seconds / INTERVAL_SECONDS)
    sample_every = max(1, loops // samples)
    process = psutil.Process()
    timing = LoopTiming(call_timeout_seconds=0.2)

    def start_daemon() -> Daemon:
        # boottime follows the simulated clock: elapsed time for cooldowns is simulated time
        daemon = Daemon(config, None, notifier=SdNotifier(None, None), timing=timing, clock=clock, boottime=clock)
        keyed = daemon.remediator.episodes.keyed

        def record(event: Event) -> Event:
            out = keyed(event)
            produced[out.key] = out
            return out

        daemon.remediator.episodes.keyed = record  # type: ignore[method-assign]
        daemon.remediator.rules = load_rules([node.rules_dir])
        store = Store.open(config.state_dir, now_seconds=clock.now)
        daemon.live.store_opened(store)
        daemon.live.kmsg.start()
        daemon.remediator.worker.recover(store)  # what the previous daemon left running
        daemon.remediator.worker.start()
        daemon.remediator.alert_delivery.start()
        return daemon

    def stop_daemon(daemon: Daemon) -> None:
        daemon.remediator.worker.stop(timeout_seconds=60)
        daemon.remediator.alert_delivery.stop()
        daemon.live.kmsg.stop()
        daemon.shutdown()
        if daemon.live.store is not None:
            daemon.live.store.close()
            daemon.live.store = None

    tracemalloc.start()
    started = time.monotonic()
    with _thread_exceptions(result.exceptions), mock.patch("agent.daemon.session.NvmlEventSource", event_source):
        daemon = start_daemon()
        try:
            daemon.loop_once()
            gpus = SimulatedBackend(profile, config.state_dir, writable_items=config.writable_items())
            gpus.init()
            result.gpus = len(gpus.profile.models)
            faults = Faults(gpus, HostPaths.at(config.host_root), rng, result)
            for loop in range(loops):
                if loop and loop % restart_every_loops == 0:
                    stop_daemon(daemon)
                    daemon = start_daemon()
                    result.daemon_restarts += 1
                faults.step(loop)
                clock.now += INTERVAL_SECONDS
                _write_clock(node.clock_file, clock.now)
                loop_started = time.monotonic()
                try:
                    daemon.loop_once()
                except Exception as exc:  # the point of the soak: count it, keep going
                    result.exceptions.append(f"loop {loop}: {type(exc).__name__}: {exc}")
                result.loop_seconds.append(time.monotonic() - loop_started)
                result.loops += 1
                if loop % sample_every == 0 or loop == loops - 1:
                    hours = (loop + 1) * INTERVAL_SECONDS / 3600
                    # What is still referenced, not garbage the cycle collector has not reached yet: a
                    # stopped daemon's cycles (threads, lanes, callbacks) wait for a full collection.
                    gc.collect()
                    result.heap_kib.append((hours, tracemalloc.get_traced_memory()[0] / 1024))
                    result.rss_kib.append((hours, process.memory_info().rss / 1024))
                    if progress is not None:
                        progress(
                            f"{hours:5.2f} h simulated, {len(produced)} events, heap {result.heap_kib[-1][1]:.0f} KiB"
                        )
            # Let the last faults clear and the in-flight events and actions land.
            faults.clear_all()
            for _ in range(3):
                time.sleep(0.3)
                clock.now += INTERVAL_SECONDS
                _write_clock(node.clock_file, clock.now)
                daemon.loop_once()
            daemon.remediator.worker.stop(timeout_seconds=60)
            store = daemon.live.store
            assert store is not None
            stored = {stored.event.key for stored in store.events(limit=1_000_000)}
            result.events_produced = len(produced)
            result.events_stored = len(stored)
            result.events_lost = sorted(set(produced) - stored)
            _check_limits(store, daemon.remediator.rules, result)
            _check_hook_log(node.hook_log, result)
            service_calls = node.service_log.read_text().split() if node.service_log.exists() else []
            result.service_restarts = service_calls.count("stop")
        finally:
            stop_daemon(daemon)
            tracemalloc.stop()
    result.simulated_seconds = result.loops * INTERVAL_SECONDS
    result.wall_seconds = time.monotonic() - started
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from bench.common import Report, add_common_args, target

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=2.0, help="simulated hours (default 2)")
    parser.add_argument("--seed", type=int, default=1)
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.backend != "simulated":
        parser.error("the soak injects faults: simulated backend only")
    report = Report("soak", args, parameters={"hours": args.hours, "seed": args.seed, "profile": args.profile})
    directory = Path(tempfile.mkdtemp(prefix="gpu-agent-soak-", dir="/tmp"))
    try:
        result = run_soak(directory, args.hours * 3600, args.profile, args.seed, progress=print)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    summary = result.summary()
    report.results = summary
    for key, value in summary.items():
        print(f"  {key}: {value}")
    report.targets += [
        target("unhandled exceptions", len(result.exceptions), "<=", 0),
        target("events lost", len(result.events_lost), "<=", 0),
        target("attempts over max_attempts", len(result.attempts_over_limit), "<=", 0),
        target("attempts inside a cooldown", len(result.cooldown_violations), "<=", 0),
        target("heap growth after warm-up", summary["heap_slope_kib_per_hour"], "<", 1024, " KiB/h"),
    ]
    report.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
