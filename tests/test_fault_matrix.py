"""Fault matrix: every GPU backend call the agent makes x every NVML error kind, and a call that hangs.

The agent calls the backend from four places, each with its own scenario:

- loop: the daemon's collect -> watch -> policy loop, in process (`Daemon.loop_once` on a fake clock,
  the simulated RTX PRO 6000 x2 with every GPU policy item in enforce mode, and an operator drifting
  every item of GPU 0 just before the fault, so the daemon wants to write while reads fail);
- exit: `Daemon.shutdown` putting the fans back to automatic;
- restore: `PolicyEngine.restore`, what `gpu-agent restore` runs as the unit's ExecStopPost;
- action: the reset_gpu action's safe sequence.

Every cell checks that nothing raises out of the daemon, that the fault shows (a read error, a stale
or unhealthy GPU, a failed collector, an ERROR or not-applied policy item), that no setter ever
touches an item whose plan in that loop was not a complete DRIFT (a half-read policy is never
applied), and that everything recovers once the fault clears, NVML re-initialised included. Faults
go in through the simulator's own `fail_call`/`hang_call`; the two calls it does not cover
(`shutdown`, `reset_gpu`) through a wrapper. The matrix, with what each cell showed, is printed at
the end of the module and written to `fault-matrix.json` in pytest's base temp directory.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial, wraps
from pathlib import Path
from typing import Any

import pytest
import structlog
from action_kinds import ActionKind, action_spec
from helpers import FakeClock, make_event, wait_until
from hosttree import make_host_tree

from agent.backend import open_backend
from agent.backend.base import ClockDomain
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.sim import PROTOCOL_METHODS, STATE_FILE_NAME, SimulatedBackend
from agent.config import AgentConfig
from agent.daemon import Daemon, LoopTiming
from agent.daemon.alert_book import PushBook
from agent.daemon.sd_notify import SdNotifier
from agent.events import Event, EventKind, HealthState, SuggestedAction
from agent.host.paths import HostPaths
from agent.policy.base import HostContext
from agent.policy.engine import PolicyEngine
from agent.policy.plan import ApplyOutcome, PlanStatus
from agent.rules.actions.context import ActionContext
from agent.rules.actions.dispatch import execute
from agent.rules.model import Decision, Outcome, Target
from agent.state import NodeSnapshot
from agent.watch.fake_kernel_log import append_kmsg, xid_line
from agent.watch.nvml_events import NvmlEventSource

PROFILE = "rtx-pro-6000x2"
HANG = "hang"
KINDS: tuple[str, ...] = (
    GpuErrorKind.NOT_SUPPORTED.value,
    GpuErrorKind.NO_PERMISSION.value,
    GpuErrorKind.GPU_LOST.value,
    GpuErrorKind.RESET_REQUIRED.value,
    GpuErrorKind.TIMEOUT.value,
    GpuErrorKind.UNKNOWN.value,
    GpuErrorKind.DRIVER_NOT_LOADED.value,
    GpuErrorKind.VERSION_MISMATCH.value,
    GpuErrorKind.UNINITIALIZED.value,
    HANG,
)
CALL_TIMEOUT_SECONDS = 0.05
HANG_SECONDS = 0.15  # longer than every bound the loop waits, short enough to keep the matrix fast
INTERVAL_SECONDS = 5.0
FAULT_LOOPS = 3
RECOVERY_DEADLINE_SECONDS = 5.0

LIBRARY_CALLS = frozenset({"init", "shutdown", "driver_version", "cuda_driver_version", "device_count", "wait_events"})
SETTER_ITEMS = {
    "set_power_limit_watts": "power_limit",
    "set_locked_clocks_mhz": "locked_clocks",
    "reset_locked_clocks": "locked_clocks",
    "set_fan_speed_percent": "fan_curve",
    "set_fan_automatic": "fan_curve",
    "set_persistence": "persistence",
    "set_ecc_mode": "ecc",
    "reset_gpu": "gpu_reset",
}
# The simulator's fail_call/hang_call cover every protocol call but these two.
WRAPPED_CALLS = ("shutdown", "reset_gpu")

LOOP_CALLS = (
    # library
    "init",
    "device_count",
    "driver_version",
    "cuda_driver_version",
    "wait_events",
    # per-GPU samples (fast and slow tier)
    "identity",
    "temperature_celsius",
    "power_usage_watts",
    "power_limit_watts",
    "clock_mhz",
    "clock_event_reasons",
    "utilization",
    "memory_info",
    "performance_state",
    "fan_count",
    "fan_speed_percent",
    "persistence_enabled",
    "ecc_mode",
    "ecc_errors",
    "remapped_rows",
    "retired_pages_pending",
    "pcie_link",
    "pcie_replay_counter",
    "temperature_threshold_celsius",
    "violation_time_ns",
    "recovery_action",
    "gpm_activity",
    "fast_fields",
    "slow_fields",
    "nvlink_states",
    "fabric_info",
    "max_clock_mhz",
    "applications_clock_mhz",
    "mig_mode",
    "compute_processes",
    # policy plans
    "power_limit_constraints_watts",
    "locked_clocks_mhz",
    "supported_memory_clocks_mhz",
    "supported_graphics_clocks_mhz",
    "fan_speed_range_percent",
    "fan_manual",
    # policy apply
    "set_power_limit_watts",
    "set_locked_clocks_mhz",
    "set_fan_speed_percent",
    "set_persistence",
    "set_ecc_mode",
)
EXIT_CALLS = ("fan_count", "fan_manual", "set_fan_automatic", "shutdown")
RESTORE_CALLS = (
    "init",
    "device_count",
    "identity",
    "fan_count",
    "fan_manual",
    "set_fan_automatic",
    "locked_clocks_mhz",
    "reset_locked_clocks",
    "default_power_limit_watts",
    "power_limit_watts",
    "set_power_limit_watts",
)
ACTION_CALLS = ("identity", "mig_mode", "compute_processes", "reset_gpu")
#: Protocol calls no part of the agent makes (nothing to inject).
NEVER_CALLED: frozenset[str] = frozenset()

#: Cells whose fault the loop cannot see, and why that is right.
UNSEEN_IN_LOOP = {
    # An event wait that hangs or times out looks like a quiet one; a GPU_LOST from the wait is only
    # logged, the poll of that GPU decides whether it is lost.
    ("wait_events", HANG): "a hung wait looks quiet",
    ("wait_events", GpuErrorKind.TIMEOUT.value): "NVML reports a quiet wait as a timeout",
    ("wait_events", GpuErrorKind.GPU_LOST.value): "the poll decides lost-ness",
    # The RTX PRO 6000 has no GPM, NVLink or NVSwitch fabric: the first NOT_SUPPORTED answer is
    # remembered and the call never made again, so a fault injected later has nothing to fail.
    **{
        (method, kind): "not supported on this board: never called after the first answer"
        for method in ("gpm_activity", "nvlink_states", "fabric_info")
        for kind in KINDS
    },
}

POLICY = {
    "match": {"model": "NVIDIA RTX PRO 6000*"},
    "power_limit_watts": 500,
    "locked_clocks": {"gpu_mhz": [1005, 1995]},
    "fan_curve": [[30, 30], [50, 65], [75, 100]],
    "persistence": "enabled",
    "ecc": "enabled",
}
IN_SYNC = (PlanStatus.IN_SYNC, PlanStatus.NOT_APPLICABLE, PlanStatus.REBOOT_REQUIRED)

# group -> method -> kind -> what the cell showed
RESULTS: dict[str, dict[str, dict[str, str]]] = {}


def record(group: str, method: str, kind: str, shown: str) -> None:
    RESULTS.setdefault(group, {}).setdefault(method, {})[kind] = shown


@pytest.fixture(scope="module", autouse=True)
def matrix_summary(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    yield
    if not RESULTS:
        return
    out = tmp_path_factory.getbasetemp() / "fault-matrix.json"
    out.write_text(json.dumps(RESULTS, indent=1, sort_keys=True))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    total = sum(len(kinds) for methods in RESULTS.values() for kinds in methods.values())
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(f"fault matrix: {total} cells covered, details in {out}")
        for group, methods in RESULTS.items():
            cells = sum(map(len, methods.values()))
            kinds = len({k for by_kind in methods.values() for k in by_kind})
            reporter.write_line(f"  {group}: {len(methods)} calls x {kinds} kinds = {cells} cells")
        reporter.write_line(f"  kinds: {', '.join(KINDS)}")


# -- fault injection and call recording ------------------------------------------------------------


@dataclass
class Calls:
    """The agent's backend calls, (method, gpu) in order from any thread; the operator's are left out."""

    history: list[tuple[str, int | None]] = field(default_factory=list)
    # each with the backend that took it: a step dropped with a lost session still writes on the old one
    unseen_writes: list[tuple[SimulatedBackend, str, int | None]] = field(default_factory=list)
    wrapped_faults: dict[str, str] = field(default_factory=dict)
    ignored: list[SimulatedBackend] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, backend: SimulatedBackend, call: tuple[str, int | None]) -> None:
        if any(backend is other for other in self.ignored):
            return
        with self.lock:
            self.history.append(call)
            if call[0] in SETTER_ITEMS:
                self.unseen_writes.append((backend, *call))

    def writes(self, backend: object) -> list[tuple[str, int | None]]:
        """The writes made through `backend` since the last look.

        Writes through another backend are forgotten: a policy step that was still running when the
        session was lost (its backend closed and re-opened) had read a complete DRIFT plan and wrote
        it, but its result was dropped with the old backend, so no snapshot can show that plan."""
        with self.lock:
            writes, self.unseen_writes = self.unseen_writes, []
        return [(method, gpu) for (taken_by, method, gpu) in writes if taken_by is backend]

    def made(self, method: str) -> int:
        with self.lock:
            return sum(1 for m, _ in self.history if m == method)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    return install_calls(monkeypatch)


def install_calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    recorded = Calls()

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(original)
        def call(self: SimulatedBackend, *args: Any, **kwargs: Any) -> Any:
            gpu = args[0] if args and name not in LIBRARY_CALLS else None
            recorded.add(self, (name, gpu))
            fault = recorded.wrapped_faults.get(name) if name in WRAPPED_CALLS and gpu in (0, None) else None
            if fault == HANG:
                time.sleep(HANG_SECONDS)
            elif fault is not None:
                raise GpuError(GpuErrorKind(fault), f"injected failure of {name}", gpu, name)
            return original(self, *args, **kwargs)

        return call

    for name in PROTOCOL_METHODS:
        monkeypatch.setattr(SimulatedBackend, name, wrap(name, getattr(SimulatedBackend, name)))
    # The simulator makes every change durable; hundreds of cells on a CI disk need not wait for that.
    monkeypatch.setattr("agent.backend.sim.state.os.fsync", lambda _fd: None)
    # Event waits short enough that a stopped source lets go at once and a failed one retries quickly.
    monkeypatch.setattr(
        "agent.daemon.session.NvmlEventSource", partial(NvmlEventSource, timeout_seconds=0.02, backoff_seconds=0.02)
    )
    return recorded


@dataclass
class Node:
    tmp: Path
    config: AgentConfig
    calls: Calls
    operator: SimulatedBackend  # someone else on the node: drifts settings, injects faults

    def inject(self, method: str, kind: str | None) -> None:
        gpu = None if method in LIBRARY_CALLS else 0
        if method in WRAPPED_CALLS:
            if kind is None:
                self.calls.wrapped_faults.pop(method, None)
            else:
                self.calls.wrapped_faults[method] = kind
        elif kind == HANG:
            self.operator.hang_call(gpu, method, HANG_SECONDS)
        elif kind is None:
            self.operator.hang_call(gpu, method, None)
            self.operator.fail_call(gpu, method, None)
        else:
            self.operator.fail_call(gpu, method, GpuErrorKind(kind))

    def drift_gpu0(self) -> None:
        """Every item of GPU 0 moved away from the policy, as an operator with nvidia-smi would."""
        op = self.operator
        op.set_power_limit_watts(0, 550)
        op.reset_locked_clocks(0, ClockDomain.GRAPHICS)
        for fan in range(op.fan_count(0)):
            op.set_fan_automatic(0, fan)
        op.set_persistence(0, False)
        op.set_ecc_mode(0, False)

    def daemon(self) -> tuple[Daemon, FakeClock]:
        clock = FakeClock()
        timing = LoopTiming(call_timeout_seconds=CALL_TIMEOUT_SECONDS, step_wait_seconds=CALL_TIMEOUT_SECONDS)
        return Daemon(self.config, None, notifier=SdNotifier(None, None), timing=timing, clock=clock), clock

    @contextmanager
    def running(self) -> Iterator[tuple[Daemon, FakeClock]]:
        """daemon(), shut down on the way out."""
        daemon, clock = self.daemon()
        try:
            yield daemon, clock
        finally:
            daemon.shutdown()


def make_node(tmp: Path, calls: Calls, state_file: Path | None = None) -> Node:
    """A node; `state_file` (simulated GPUs already set to the policy) saves each cell the first apply."""
    config = AgentConfig.model_validate(
        {
            "mode": "enforce",
            "backend": "simulated",
            "simulated": {"profile": PROFILE},
            "host_root": str(tmp / "host"),
            "state_dir": str(tmp / "state"),
            "interval_seconds": INTERVAL_SECONDS,
            "policy_interval_seconds": INTERVAL_SECONDS,
            "counters_interval_seconds": 0,  # every loop: each cell's slow-tier call is made at once
            "api": {"socket": str(tmp / "agent.sock")},
            "remediation": {"rules_dir": str(tmp / "rules.d")},
            # the report-only driver item reads the driver version and the CUDA version it supports
            "policy": {"gpus": [POLICY], "node": {"driver": {"min_version": "550.54"}}},
        }
    )
    make_host_tree(tmp / "host")
    if state_file is not None:
        (tmp / "state").mkdir()
        shutil.copy(state_file, tmp / "state" / STATE_FILE_NAME)
    operator = SimulatedBackend(PROFILE, tmp / "state", writable_items=config.writable_items())
    calls.ignored.append(operator)
    operator.init()
    return Node(tmp, config, calls, operator)


@pytest.fixture(scope="module")
def enforced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The simulated GPUs' state file once the policy is applied (fans on the curve, limits set)."""
    tmp = tmp_path_factory.mktemp("enforced")
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = install_calls(monkeypatch)
        node = make_node(tmp, calls)
        daemon, clock = node.daemon()
        run_until_recovered(daemon, clock, calls)
        state = tmp / "enforced.json"
        shutil.copy(tmp / "state" / STATE_FILE_NAME, state)
        daemon.shutdown()
    return state


@pytest.fixture
def node(tmp_path: Path, calls: Calls, enforced: Path) -> Node:
    return make_node(tmp_path, calls, enforced)


# -- what a snapshot says --------------------------------------------------------------------------


def signals(snapshot: NodeSnapshot) -> set[str]:
    """Every way the snapshot reports something wrong."""
    found: set[str] = set()
    if snapshot.stale_gpus:
        found.add("stale")
    for sample in snapshot.gpus:
        if not sample.up:
            found.add("gpu down")
        found.update(
            f"read error {kind if field != 'stale' else 'stale'}" for field, kind in sample.read_errors.items()
        )
    found.update(f"health {h.state.value}" for h in snapshot.health.values() if h.state is not HealthState.HEALTHY)
    found.update(f"collector {c.name}" for c in snapshot.collectors if not c.success and c.name != "kmsg")
    for plan in snapshot.policy:
        if plan.status is PlanStatus.ERROR:
            found.add(f"policy error ({plan.error_kind or 'unreadable'})")
        elif "not applied:" in plan.detail:
            found.add("policy not applied")
    if len(snapshot.gpus) != 2:
        found.add(f"{len(snapshot.gpus)} GPUs")
    if snapshot.driver_version is None:
        found.add("driver version unknown")
    return found


def problems_left(snapshot: NodeSnapshot) -> list[str]:
    """Why the snapshot is not the healthy, in-sync node of before the fault (empty: recovered)."""
    left = sorted(signals(snapshot))
    left += [f"{p.item} GPU {p.gpu} {p.status.value}" for p in snapshot.policy if p.status not in IN_SYNC]
    if not snapshot.policy:
        left.append("no policy plans")
    return left


def assert_no_half_read_write(snapshot: NodeSnapshot, writes: list[tuple[str, int | None]]) -> None:
    """A setter only for an item whose plan, this loop, was read completely and says DRIFT."""
    plans = {(p.item, p.gpu): p for p in snapshot.policy}
    for method, gpu in writes:
        plan = plans.get((SETTER_ITEMS[method], gpu))
        assert plan is not None and plan.status is PlanStatus.DRIFT, f"{method}(GPU {gpu}) written with plan {plan}"


def loop(daemon: Daemon, clock: FakeClock, calls: Calls) -> NodeSnapshot:
    clock.advance(INTERVAL_SECONDS)
    snapshot = daemon.loop_once()
    # A step still running (hung) has written part of what it will report: judge it once it is taken.
    if daemon.policy.pending is None:
        assert_no_half_read_write(snapshot, calls.writes(daemon.live.session.backend))
    return snapshot


def run_until_recovered(daemon: Daemon, clock: FakeClock, calls: Calls) -> NodeSnapshot:
    left: list[str] = []

    def recovered() -> NodeSnapshot | None:
        snapshot = loop(daemon, clock, calls)
        left[:] = problems_left(snapshot)
        return None if left else snapshot

    return wait_until(recovered, RECOVERY_DEADLINE_SECONDS, lambda: f"recovery; still: {left}", poll_seconds=0.02)


# -- the loop --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", LOOP_CALLS)
def test_loop(node: Node, calls: Calls, method: str, kind: str) -> None:
    with node.running() as (daemon, clock):
        if method != "init":  # init faults are met at start: the agent comes up on a node without a driver
            run_until_recovered(daemon, clock, calls)
            node.drift_gpu0()
        node.inject(method, kind)
        seen: set[str] = set()
        for _ in range(FAULT_LOOPS):
            seen |= signals(loop(daemon, clock, calls))
        if kind == HANG:
            time.sleep(HANG_SECONDS / 2)  # calls that began early in the hang are still blocked
            seen |= signals(loop(daemon, clock, calls))
        exempt = UNSEEN_IN_LOOP.get((method, kind))
        # A board without a feature is no fault: a NOT_SUPPORTED read leaves the field empty, silently.
        if kind != GpuErrorKind.NOT_SUPPORTED.value or method in SETTER_ITEMS or method in LIBRARY_CALLS:
            assert seen or exempt, f"{method} failing with {kind} left no trace in the snapshot"
        node.inject(method, None)
        run_until_recovered(daemon, clock, calls)
        if method == "wait_events":
            # the event path works again: an Xid both reporters report now is one fault through it
            one_xid_from_both_reporters(node, daemon, clock, calls)
        power = node.operator.power_limit_watts(0)
        assert power == 500.0, f"drift not put back after recovery: {power} W"
        record("loop", method, kind, ", ".join(sorted(seen)) or f"unseen: {exempt or 'not a fault'}")


def one_xid_from_both_reporters(node: Node, daemon: Daemon, clock: FakeClock, calls: Calls) -> None:
    """An app-level Xid through NVML's event path and the kernel log (followed by the daemon's own
    reader): one count, and one event naming the process only the kernel line names."""
    paths = HostPaths.at(node.tmp / "host")
    append_kmsg(paths, "kernel: the log every host has")
    daemon.live.kmsg.start()
    try:
        wait_until(lambda: daemon.live.kmsg.status()[0], RECOVERY_DEADLINE_SECONDS, "the kernel log followed")
        node.operator.inject_xid(1, 13)
        append_kmsg(paths, xid_line(node.operator.identity(1).pci_bus_id, 13, pid=4242, process="python3"))

        def both_reporters() -> bool:
            xids = [e for e in loop(daemon, clock, calls).recent_events if e.kind is EventKind.XID]
            return any(sorted(e.data["sources"]) == ["kmsg", "nvml"] for e in xids)

        wait_until(both_reporters, RECOVERY_DEADLINE_SECONDS, "an Xid through both reporters", poll_seconds=0.02)
    finally:
        daemon.live.kmsg.stop()
    snapshot = loop(daemon, clock, calls)
    (event,) = [e for e in snapshot.recent_events if e.kind is EventKind.XID]
    assert (event.data["xid"], event.data["pid"], event.data["process"]) == (13, 4242, "python3")
    assert [(x.gpu, x.xid, x.count) for x in snapshot.xids] == [(1, 13, 1)]


def test_driver_reload_reinitialises_nvml(node: Node, calls: Calls) -> None:
    """The whole driver goes away (every call, nvmlInit too), then comes back as a new version."""
    with node.running() as (daemon, clock):
        first = run_until_recovered(daemon, clock, calls)
        old_backend = daemon.live.session.backend
        for method in PROTOCOL_METHODS - LIBRARY_CALLS - set(WRAPPED_CALLS):
            node.operator.fail_call(0, method, GpuErrorKind.DRIVER_NOT_LOADED)
            node.operator.fail_call(1, method, GpuErrorKind.DRIVER_NOT_LOADED)
        for method in ("init", "device_count", "driver_version", "wait_events"):
            node.operator.fail_call(None, method, GpuErrorKind.DRIVER_NOT_LOADED)
        gone = [loop(daemon, clock, calls) for _ in range(3)]
        assert daemon.live.session.backend is None
        for snapshot in gone[1:]:
            assert [(g.index, g.up, g.read_errors) for g in snapshot.gpus] == [
                (0, False, {"backend": "driver_not_loaded"}),
                (1, False, {"backend": "driver_not_loaded"}),
            ], "known GPUs stay in the snapshot, down, rather than vanish from the metrics"
            assert {h.state for h in snapshot.health.values()} == {HealthState.DEGRADED}
            assert any(c.name == "backend" and not c.success for c in snapshot.collectors)
        # the new driver is loaded: only a fresh nvmlInit sees it
        for method in ("init", "device_count", "driver_version", "wait_events"):
            node.operator.fail_call(None, method, None)
        for method in PROTOCOL_METHODS - LIBRARY_CALLS - set(WRAPPED_CALLS):
            node.operator.fail_call(0, method, None)
            node.operator.fail_call(1, method, None)
        back = run_until_recovered(daemon, clock, calls)
        assert daemon.live.session.backend is not None and daemon.live.session.backend is not old_backend
        assert [g.uuid for g in back.gpus] == [g.uuid for g in first.gpus]


def test_version_mismatch_after_an_upgrade_keeps_the_agent_up_until_the_reload(node: Node, calls: Calls) -> None:
    with node.running() as (daemon, clock):
        run_until_recovered(daemon, clock, calls)
        # Upgraded on disk, old module still loaded: every call and every new nvmlInit says mismatch.
        node.operator.fail_call(None, "init", GpuErrorKind.VERSION_MISMATCH)
        node.operator.fail_call(None, "device_count", GpuErrorKind.VERSION_MISMATCH)
        node.operator.fail_call(None, "temperature_celsius", GpuErrorKind.VERSION_MISMATCH)
        for _ in range(5):
            snapshot = loop(daemon, clock, calls)
            assert len(snapshot.gpus) == 2
        assert any(c.name == "backend" and not c.success for c in snapshot.collectors)
        assert daemon.live.session.error is not None and daemon.live.session.error.kind is GpuErrorKind.VERSION_MISMATCH
        for method in ("init", "device_count", "temperature_celsius"):
            node.operator.fail_call(None, method, None)
        run_until_recovered(daemon, clock, calls)


def test_a_hung_nvml_init_does_not_hold_the_loop(node: Node, calls: Calls) -> None:
    node.operator.hang_call(None, "init", 3.0)
    with node.running() as (daemon, clock):
        started = time.monotonic()
        snapshot = loop(daemon, clock, calls)
        assert time.monotonic() - started < 1.5
        backend = next(c for c in snapshot.collectors if c.name == "backend")
        assert "has not returned" in backend.last_error
        node.operator.hang_call(None, "init", None)
        # the init that was hanging finishes and its backend is taken, not thrown away and opened again
        run_until_recovered(daemon, clock, calls)
        assert calls.made("init") == 1


def test_every_gpu_hanging_at_once_costs_one_timeout(tmp_path: Path, calls: Calls) -> None:
    node = make_node(tmp_path, calls)
    with node.running() as (daemon, clock):
        run_until_recovered(daemon, clock, calls)
        node.operator.hang_call(None, "temperature_celsius", 1.0)  # gpu None: every GPU
        started = time.monotonic()
        snapshot = loop(daemon, clock, calls)
        took = time.monotonic() - started
        assert snapshot.stale_gpus == frozenset({0, 1})
        # both GPUs waited on together, and the policy step given up on after its own bound
        assert took < CALL_TIMEOUT_SECONDS * 2 + 0.15, took
        node.operator.hang_call(None, "temperature_celsius", None)
        run_until_recovered(daemon, clock, calls)


def test_a_slow_policy_step_finishes_in_the_background_and_is_taken_later(node: Node, calls: Calls) -> None:
    """A long apply (update-initramfs, a hung setter) must not stop the loop, nor lose its result."""
    with node.running() as (daemon, clock):
        run_until_recovered(daemon, clock, calls)
        since = clock()
        node.operator.hang_call(0, "set_power_limit_watts", 0.4)
        node.operator.set_power_limit_watts(0, 550)
        snapshot = loop(daemon, clock, calls)
        policy = next(c for c in snapshot.collectors if c.name == "policy")
        assert not policy.success and "still running" in policy.last_error
        assert snapshot.stale_gpus == frozenset()  # the GPUs are still read every loop
        node.operator.hang_call(0, "set_power_limit_watts", None)

        def drift_events() -> list[Event]:
            snapshot = loop(daemon, clock, calls)
            return [
                e for e in snapshot.recent_events if e.kind is EventKind.POLICY_DRIFT and e.timestamp_seconds > since
            ]

        (first, *_) = wait_until(
            drift_events, RECOVERY_DEADLINE_SECONDS, "the background policy step's drift event", poll_seconds=0.05
        )
        assert first.data["item"] == "power_limit"
        assert node.operator.power_limit_watts(0) == 500.0


# -- exit: fans back to automatic -------------------------------------------------------------------


def fans_manual(backend: SimulatedBackend, gpu: int) -> list[bool]:
    backend.reload()
    return [backend.fan_manual(gpu, fan) for fan in range(backend.fan_count(gpu))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", EXIT_CALLS)
def test_exit(node: Node, calls: Calls, method: str, kind: str) -> None:
    daemon, clock = node.daemon()
    run_until_recovered(daemon, clock, calls)
    assert fans_manual(node.operator, 0) == [True, True]
    node.inject(method, kind)
    finished = threading.Event()
    with structlog.testing.capture_logs() as logs:
        worker = threading.Thread(target=lambda: (daemon.shutdown(), finished.set()))
        worker.start()
        worker.join(10)
    assert finished.is_set(), "shutdown did not return"
    node.inject(method, None)
    assert fans_manual(node.operator, 1) == [False, False], "the GPU without the fault is always restored"
    gpu0 = fans_manual(node.operator, 0)
    if gpu0 != [False, False]:
        # Only a fault in the calls that find or set the fans can leave them manual, and it is logged
        # (a fan count of "not supported" means a fan-less board: nothing to say).
        assert method in ("fan_count", "set_fan_automatic") or kind == GpuErrorKind.GPU_LOST.value, (method, kind)
        if (method, kind) != ("fan_count", GpuErrorKind.NOT_SUPPORTED.value):
            assert any(e["event"] == "could not restore automatic fan control" and e["gpu"] == 0 for e in logs), logs
        # ExecStopPost's `gpu-agent restore` is the second line
        engine = PolicyEngine(node.config, open_backend(node.config), HostContext(HostPaths.at(node.config.host_root)))
        assert all(r.outcome is not ApplyOutcome.FAILED for r in engine.restore())
        engine.backend.shutdown()
        assert fans_manual(node.operator, 0) == [False, False]
        shown = "left manual by the daemon; restored by gpu-agent restore"
    else:
        shown = "restored by the daemon"
    record("exit", method, kind, shown)


# -- restore: what ExecStopPost runs ----------------------------------------------------------------


def enforced_state(operator: SimulatedBackend) -> None:
    for gpu in (0, 1):
        operator.set_power_limit_watts(gpu, 500)
        operator.set_locked_clocks_mhz(gpu, ClockDomain.GRAPHICS, 1005, 1995)
        for fan in range(operator.fan_count(gpu)):
            operator.set_fan_speed_percent(gpu, fan, 60)


def restored(operator: SimulatedBackend, gpu: int) -> bool:
    operator.reload()
    return (
        operator.power_limit_watts(gpu) == operator.default_power_limit_watts(gpu)
        and operator.locked_clocks_mhz(gpu, ClockDomain.GRAPHICS) is None
        and not any(fans_manual(operator, gpu))
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", RESTORE_CALLS)
def test_restore(node: Node, method: str, kind: str) -> None:
    enforced_state(node.operator)
    node.inject(method, kind)
    host = HostContext(HostPaths.at(node.config.host_root))
    try:
        engine = PolicyEngine(node.config, open_backend(node.config), host)
        results = engine.restore()
    except GpuError as exc:
        # library-wide: `gpu-agent restore` prints one line and exits 1; nothing was changed
        assert method in LIBRARY_CALLS or method == "identity", (method, exc)
        shown = f"refused: {exc.kind.value}"
    else:
        failed = [r for r in results if r.outcome is ApplyOutcome.FAILED]
        assert all(r.plan.gpu == 0 for r in failed), "only the faulty GPU may fail"
        assert restored(node.operator, 1)
        shown = f"{len(failed)} item(s) failed on GPU 0" if failed else "restored"
        engine.backend.shutdown()
    node.inject(method, None)
    engine = PolicyEngine(node.config, open_backend(node.config), host)
    assert all(r.outcome is not ApplyOutcome.FAILED for r in engine.restore())
    assert restored(node.operator, 0) and restored(node.operator, 1)
    record("restore", method, kind, shown)


# -- action: the reset_gpu sequence ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ACTION_CALLS)
def test_action(node: Node, calls: Calls, method: str, kind: str) -> None:
    backend = open_backend(node.config)
    host = HostContext(HostPaths.at(node.config.host_root))
    ctx = ActionContext(
        config=node.config,
        backend=backend,
        policy=PolicyEngine(node.config, backend, host),
        host=host,
        managers={},
        alerts=PushBook(),
        drain_timeout_seconds=0.2,
        drain_poll_seconds=0.05,
    )
    uuid = backend.identity(0).uuid
    event = make_event(
        EventKind.XID,
        0,
        uuid=uuid,
        message="Xid 48 on GPU 0",
        timestamp_seconds=1_800_000_000.0,
        source="nvml",
        key=f"xid:{uuid}:48",
        suggested_action=SuggestedAction.RESET_GPU,
        xid=48,
    )
    decision = Decision("xid-reset", event, Target(gpu=0, uuid=uuid), action_spec(ActionKind.RESET_GPU), 0, 1, "Xid 48")
    node.inject(method, kind)
    outcome = execute(decision, ctx)
    resets = calls.made("reset_gpu")
    tolerated = kind == HANG or (method == "mig_mode" and kind == GpuErrorKind.NOT_SUPPORTED.value)
    if tolerated:
        assert outcome.outcome is Outcome.SUCCESS, outcome  # slower, or a board without MIG
    else:
        assert outcome.outcome in (Outcome.FAILED, Outcome.REFUSED), outcome
        if method != "reset_gpu":
            assert resets == 0, "a GPU is never reset on a check that could not be read"
    node.inject(method, None)
    assert execute(decision, ctx).outcome is Outcome.SUCCESS
    backend.shutdown()
    record("action", method, kind, f"{outcome.outcome.value}: {outcome.detail[:80]}")


# -- the matrix covers every call the agent makes -----------------------------------------------------


def test_the_matrix_covers_every_call_the_agent_makes(node: Node, calls: Calls) -> None:
    covered = set(LOOP_CALLS) | set(EXIT_CALLS) | set(RESTORE_CALLS) | set(ACTION_CALLS)
    assert covered | NEVER_CALLED == PROTOCOL_METHODS
    assert not covered & NEVER_CALLED
    daemon, clock = node.daemon()
    run_until_recovered(daemon, clock, calls)
    node.drift_gpu0()
    run_until_recovered(daemon, clock, calls)
    daemon.shutdown()
    engine = PolicyEngine(node.config, open_backend(node.config), HostContext(HostPaths.at(node.config.host_root)))
    engine.restore()
    made = {m for m, _ in calls.history}
    assert made - covered == set(), "calls the matrix does not inject faults into"
