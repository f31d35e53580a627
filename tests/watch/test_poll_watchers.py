"""Poll watchers (throttle, memory, lost GPUs, PCIe, devices) and the per-GPU health aggregate,
driven by the simulated backend through the real collector."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import FakeClock
from snapshots import h200_snapshot

from agent.backend.base import GpuEvent, GpuEventKind, RecoveryAction
from agent.backend.errors import GpuErrorKind
from agent.backend.sim import REASON_HW_POWER_BRAKE, REASON_HW_SLOWDOWN, REASON_HW_THERMAL, SimulatedBackend
from agent.collect import sample_gpu, sample_identified
from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.host.paths import HostPaths
from agent.names.policy_items import GPU_RESET_ITEM
from agent.rules.config import Rule
from agent.rules.engine import evaluate
from agent.rules.model import Decision
from agent.state import GpuSample
from agent.store.database import Store
from agent.watch.devices import DeviceWatcher, UdevWakeup, is_nvidia_pci_event
from agent.watch.gpu_health import ACTION_ORDER, HealthBook, HealthSource, PollWatcher, combine
from agent.watch.gpu_lost import GpuLostWatcher
from agent.watch.memory_errors import MemoryWatcher
from agent.watch.pcie import PcieWatcher
from agent.watch.throttle import ThrottleWatcher
from agent.watch.xid import XidWatcher

HEALTHY = Health.healthy()


class Node:
    """A simulated node on a clock the test moves: sim.advance() and sample timestamps move together."""

    def __init__(self, tmp_path: Path, profile: str | Path = "h200", **kwargs: Any) -> None:
        kwargs.setdefault("writable_items", [GPU_RESET_ITEM, "power_limit"])
        self.sim = SimulatedBackend(profile, tmp_path / "state", **kwargs)
        self.sim.init()
        self.clock = FakeClock(wall_seconds=1_000_000.0)

    @property
    def now(self) -> float:
        return self.clock()

    def tick(self, seconds: float, wall_seconds: float | None = None) -> None:
        """`seconds` of simulated GPU time; the sample clock moves `wall_seconds` (default the same)."""
        self.sim.advance(seconds)
        self.clock.advance(seconds if wall_seconds is None else wall_seconds)

    def samples(self, slow: bool = True) -> list[GpuSample]:
        return [sample_gpu(self.sim, gpu, slow=slow, clock=self.clock) for gpu in range(self.sim.device_count())]

    def observe(self, watcher: PollWatcher, slow: bool = True) -> list[Event]:
        return watcher.observe(self.samples(slow), self.now)


def custom_profile(tmp_path: Path, **model: Any) -> Path:
    """A one-GPU node whose board is an H200 with `model` overrides."""
    path = tmp_path / "custom-node.json"
    path.write_text(json.dumps({"gpus": [{"model": {"base": "h200", **model}}]}))
    return path


def kinds(events: list[Event]) -> list[EventKind]:
    return [e.kind for e in events]


def assert_well_formed(event: Event, node: Node, gpu: int) -> None:
    assert event.gpu == gpu
    assert event.uuid == node.sim.identity(gpu).uuid
    assert event.message.startswith(f"GPU {gpu}")
    assert event.key and event.source == "poll"
    assert event.timestamp_seconds == node.now


def one_event(node: Node, watcher: PollWatcher, kind: EventKind, severity: Severity, action: SuggestedAction) -> Event:
    """The one event GPU 0's next observation makes, well formed and of that kind, severity and action."""
    (event,) = node.observe(watcher)
    assert_well_formed(event, node, 0)
    assert (event.kind, event.severity, event.suggested_action) == (kind, severity, action)
    return event


# -- throttle -----------------------------------------------------------------------------------


def test_thermal_slowdown_started_once_ended_with_duration(tmp_path: Path) -> None:
    node = Node(tmp_path)
    watcher = ThrottleWatcher(clock=node.clock.monotonic)
    assert node.observe(watcher) == []  # idle H200: gpu_idle only, a benign reason
    node.sim.set_clock_event_reasons(0, REASON_HW_THERMAL | REASON_HW_SLOWDOWN)
    node.tick(1)
    events = node.observe(watcher)
    assert sorted((e.kind, e.data["reason"], e.severity) for e in events) == [
        (EventKind.THROTTLE_STARTED, "hw_slowdown", Severity.WARNING),
        (EventKind.THROTTLE_STARTED, "hw_thermal_slowdown", Severity.CRITICAL),
    ]
    for event in events:
        assert_well_formed(event, node, 0)
        assert event.suggested_action is SuggestedAction.CHECK_MECHANICALS
    started_at = node.now
    assert watcher.active_since() == {(0, "hw_slowdown"): started_at, (0, "hw_thermal_slowdown"): started_at}
    for _ in range(3):
        node.tick(10)
        assert node.observe(watcher) == []  # still throttled: nothing new
        assert node.observe(watcher, slow=False) == []
    health = watcher.health(0)
    assert health.state is HealthState.DEGRADED
    assert health.suggested_action is SuggestedAction.CHECK_MECHANICALS
    assert "hw_thermal_slowdown" in health.reason

    node.sim.set_clock_event_reasons(0, None)
    node.tick(5)
    ended = node.observe(watcher)
    assert sorted(kinds(ended)) == [EventKind.THROTTLE_ENDED] * 2
    assert {e.data["duration_seconds"] for e in ended} == {node.now - started_at} == {35.0}
    assert "35 s" in ended[0].message
    assert watcher.health(0) == HEALTHY
    assert watcher.active_since() == {}
    node.tick(5)
    assert node.observe(watcher) == []


def test_power_brake_is_critical(tmp_path: Path) -> None:
    node = Node(tmp_path)
    watcher = ThrottleWatcher(clock=node.clock.monotonic)
    node.sim.set_clock_event_reasons(0, REASON_HW_POWER_BRAKE)
    (event,) = node.observe(watcher)  # a condition present at the first look is reported
    assert (event.kind, event.data["reason"], event.severity) == (
        EventKind.THROTTLE_STARTED,
        "hw_power_brake_slowdown",
        Severity.CRITICAL,
    )
    assert watcher.health(0).state is HealthState.DEGRADED


def test_power_cap_under_a_power_limit_is_healthy(tmp_path: Path) -> None:
    node = Node(tmp_path)
    watcher = ThrottleWatcher(clock=node.clock.monotonic)
    node.sim.set_power_limit_watts(0, 300)
    node.sim.set_processes(0, [4242])  # 655 W of demand against a 300 W limit: the limiter engages
    (event,) = node.observe(watcher)
    assert (event.kind, event.data["reason"]) == (EventKind.THROTTLE_STARTED, "sw_power_cap")
    assert event.severity is Severity.INFO
    assert event.suggested_action is SuggestedAction.NONE
    assert event.data["power_limit_watts"] == 300
    assert watcher.health(0) == HEALTHY


def test_clock_event_seconds_integrates_benign_reasons(tmp_path: Path) -> None:
    node = Node(tmp_path)
    watcher = ThrottleWatcher(clock=node.clock.monotonic)
    node.observe(watcher)
    node.tick(10)
    node.observe(watcher, slow=False)
    node.tick(5)
    node.observe(watcher, slow=False)
    # sw_power_cap is known to be zero from the board's power violation counter.
    assert watcher.clock_event_seconds() == {(0, "gpu_idle"): 15.0, (0, "sw_power_cap"): 0.0}
    # A loop whose reasons could not be read leaves a gap that is not counted.
    node.sim.fail_call(0, "clock_event_reasons", GpuErrorKind.TIMEOUT)
    node.tick(100)
    assert node.observe(watcher) == []
    node.sim.fail_call(0, "clock_event_reasons", None)
    node.tick(100)
    node.observe(watcher)
    node.tick(1)
    node.observe(watcher)
    assert watcher.clock_event_seconds() == {(0, "gpu_idle"): 16.0, (0, "sw_power_cap"): 0.0}


def test_clock_event_seconds_follows_the_power_violation_counter(tmp_path: Path) -> None:
    node = Node(tmp_path)
    watcher = ThrottleWatcher(clock=node.clock.monotonic)
    node.sim.set_power_limit_watts(0, 300)
    node.sim.set_processes(0, [4242])

    def total() -> float:
        return watcher.clock_event_seconds()[(0, "sw_power_cap")]

    node.observe(watcher)  # counter baseline
    assert total() == 0.0
    node.tick(10, wall_seconds=6)
    node.observe(watcher, slow=False)  # no counter this loop: integrated estimate
    assert total() == 6.0
    node.tick(10, wall_seconds=10)
    node.observe(watcher)  # the counter says 20 s; the samples alone would say 16 s
    assert total() == 20.0
    node.tick(2, wall_seconds=10)
    node.observe(watcher, slow=False)  # the estimate runs ahead of the counter ...
    assert total() == 30.0
    node.tick(2, wall_seconds=0)
    node.observe(watcher)  # ... and the counter (24 s) is behind it: the total does not go back
    assert total() == 30.0
    node.tick(10)
    node.observe(watcher)
    assert total() == 34.0  # caught up with the counter
    # Thermal reasons are integrated (the THERMAL counter mixes software and hardware slowdown).
    node.sim.set_clock_event_reasons(0, REASON_HW_THERMAL)
    node.observe(watcher)
    node.tick(7)
    node.observe(watcher)
    assert watcher.clock_event_seconds()[(0, "hw_thermal_slowdown")] == 7.0


def test_temperature_margin_once_with_hysteresis(tmp_path: Path) -> None:
    node = Node(tmp_path)
    watcher = ThrottleWatcher(slowdown_margin_celsius=5, clock=node.clock.monotonic)
    node.observe(watcher)  # slow loop: learns the H200 slowdown threshold (89 C)
    observed: list[list[EventKind]] = []
    for celsius in (83, 84, 85, 86, 83, 82, 81, 84):
        node.sim.set_temperature(0, celsius)
        node.tick(1)
        observed.append(kinds(node.observe(watcher, slow=False)))
        if celsius == 86:
            health = watcher.health(0)
            assert health.state is HealthState.DEGRADED
            assert health.suggested_action is SuggestedAction.CHECK_MECHANICALS
            assert "86 C" in health.reason and "89 C" in health.reason
        if celsius == 81:
            assert watcher.health(0) == HEALTHY
    low = [EventKind.TEMPERATURE_MARGIN_LOW]
    assert observed == [[], low, [], [], [], [], [], low]


def test_temperature_margin_event_content(tmp_path: Path) -> None:
    node = Node(tmp_path)
    watcher = ThrottleWatcher(slowdown_margin_celsius=5, clock=node.clock.monotonic)
    node.sim.set_temperature(0, 86)
    (event,) = node.observe(watcher)
    assert_well_formed(event, node, 0)
    assert event.severity is Severity.WARNING
    assert event.data == {"temperature_celsius": 86, "slowdown_temperature_celsius": 89, "margin_celsius": 3}
    assert "within 3 C" in event.message


@pytest.mark.parametrize("step_seconds", [3600.0, -3600.0])
def test_a_wall_clock_step_is_not_time_a_slowdown_was_held(tmp_path: Path, step_seconds: float) -> None:
    """A "held 60 s" rule fires after 60 s of the boot clock, whatever NTP does to the wall clock."""
    node = Node(tmp_path)
    watcher = ThrottleWatcher(clock=node.clock.monotonic)
    rule = Rule.model_validate(
        {
            "name": "hot",
            "match": {"throttle": {"reasons": ["hw_thermal_slowdown"], "held_seconds": 60}},
            "actions": ["alertmanager"],
        }
    )
    node.sim.set_clock_event_reasons(0, REASON_HW_THERMAL)

    def decisions() -> list[Decision]:
        snap = h200_snapshot(
            node.now, 1, throttle_active_since=watcher.active_since(), throttle_held_seconds=watcher.held_seconds()
        )
        with Store.open(tmp_path / "state", now_seconds=node.now) as store:
            return evaluate(snap, [], [rule], store, node.now, {})

    node.tick(1)
    node.observe(watcher)
    node.tick(1.2)
    node.clock.step_wall(step_seconds)  # NTP or an operator steps the wall clock an hour
    node.observe(watcher)
    assert watcher.held_seconds() == {(0, "hw_thermal_slowdown"): pytest.approx(1.2)}
    # nor time counted in gpu_agent_gpu_clock_event_seconds_total
    assert watcher.clock_event_seconds()[(0, "hw_thermal_slowdown")] == pytest.approx(1.2)
    assert decisions() == []
    node.tick(58.8)
    node.observe(watcher)
    (decision,) = decisions()
    assert decision.event.data["held_seconds"] == pytest.approx(60.0)
    node.sim.set_clock_event_reasons(0, None)
    node.tick(5)
    (ended,) = node.observe(watcher)
    assert ended.data["duration_seconds"] == pytest.approx(65.0)


def test_no_threshold_and_no_reasons_mean_no_events(tmp_path: Path) -> None:
    node = Node(tmp_path, custom_profile(tmp_path, temperature_thresholds_c={}))
    watcher = ThrottleWatcher()
    node.sim.set_temperature(0, 120)
    assert node.samples()[0].slowdown_temperature_celsius is None
    for _ in range(3):
        node.tick(1)
        assert node.observe(watcher) == []
    assert watcher.health(0) == HEALTHY

    other = Node(tmp_path / "other")
    watcher = ThrottleWatcher()
    other.sim.fail_call(0, "clock_event_reasons", GpuErrorKind.NOT_SUPPORTED)
    other.sim.set_clock_event_reasons(0, REASON_HW_THERMAL)
    for _ in range(3):
        other.tick(1)
        assert other.samples()[0].clock_event_reasons is None
        assert other.observe(watcher, slow=False) == []
    assert watcher.clock_event_seconds() == {}


# -- memory --------------------------------------------------------------------------------------


def test_uncorrected_ecc_baseline_event_and_reset(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), MemoryWatcher()
    node.sim.add_ecc_errors(0, uncorrected=2)
    assert node.observe(watcher) == []  # errors from before the agent looked: the baseline, no event,
    # but the GPU has had them since its last reset (an agent restart must not make it look clean)
    assert watcher.health(0).state is HealthState.UNHEALTHY
    node.sim.add_ecc_errors(0, uncorrected=1)
    assert node.observe(watcher, slow=False) == []  # counters are slow-tier readings
    event = one_event(node, watcher, EventKind.ECC_UNCORRECTED, Severity.CRITICAL, SuggestedAction.RESET_GPU)
    assert event.data["new_errors"] == 1
    assert event.data["ecc_uncorrected_volatile"] == 3 and event.data["ecc_uncorrected_aggregate"] == 3
    assert node.observe(watcher) == []
    assert watcher.health(0) == Health(
        HealthState.UNHEALTHY,
        "uncorrected ECC errors since the last GPU reset",
        SuggestedAction.RESET_GPU,
        (FaultCause.ECC_UNCORRECTED,),
    )
    node.sim.reset_gpu(0)  # volatile counters restart at zero
    assert node.observe(watcher) == []
    assert watcher.health(0) == HEALTHY
    node.sim.add_ecc_errors(0, uncorrected=2)
    (event,) = node.observe(watcher)
    assert event.data["new_errors"] == 2


def test_uncorrected_right_after_a_reset_is_counted(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), MemoryWatcher()
    node.sim.add_ecc_errors(0, uncorrected=5)
    node.observe(watcher)
    node.sim.reset_gpu(0)
    node.sim.add_ecc_errors(0, uncorrected=1)  # volatile went 5 -> 1: one error since the reset
    (event,) = node.observe(watcher)
    assert event.data["new_errors"] == 1
    assert watcher.health(0).state is HealthState.UNHEALTHY


def test_corrected_ecc_at_most_once_per_ten_minutes(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), MemoryWatcher()
    node.observe(watcher)
    node.sim.add_ecc_errors(0, corrected=5)
    node.tick(1)
    (event,) = node.observe(watcher)
    assert_well_formed(event, node, 0)
    assert (event.kind, event.severity, event.data["new_errors"]) == (EventKind.ECC_CORRECTED, Severity.INFO, 5)
    node.sim.add_ecc_errors(0, corrected=3)
    node.tick(60)
    assert node.observe(watcher) == []
    node.sim.add_ecc_errors(0, corrected=1)
    node.tick(300)
    assert node.observe(watcher) == []
    node.tick(239)
    assert node.observe(watcher) == []
    node.tick(1)  # 600 s after the first event: the errors held back since then, in one event
    (event,) = node.observe(watcher)
    assert event.data["new_errors"] == 4
    assert node.observe(watcher) == []
    assert watcher.health(0) == HEALTHY  # corrected errors are ECC doing its job


def test_row_remap_pending_and_failed(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), MemoryWatcher()
    node.observe(watcher)
    node.sim.set_remapped_rows(0, uncorrectable=1, pending=True)
    event = one_event(node, watcher, EventKind.ROW_REMAP_PENDING, Severity.WARNING, SuggestedAction.RESET_GPU)
    assert event.data["remapped_rows_uncorrectable"] == 1
    assert node.observe(watcher) == [] and node.observe(watcher, slow=False) == []
    assert watcher.health(0) == Health(
        HealthState.DEGRADED,
        "row remapping pending a reset",
        SuggestedAction.RESET_GPU,
        (FaultCause.ROW_REMAP_PENDING,),
    )
    node.sim.reset_gpu(0)  # applies the remap
    assert node.observe(watcher) == []
    assert watcher.health(0) == HEALTHY

    node.sim.set_remapped_rows(0, uncorrectable=512, failed=True)
    event = one_event(node, watcher, EventKind.ROW_REMAP_FAILED, Severity.CRITICAL, SuggestedAction.CONTACT_SUPPORT)
    assert node.observe(watcher) == []
    health = watcher.health(0)
    assert (health.state, health.suggested_action) == (HealthState.UNHEALTHY, SuggestedAction.CONTACT_SUPPORT)


def test_flag_present_at_first_look_is_reported(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), MemoryWatcher()
    node.sim.set_remapped_rows(0, uncorrectable=2, pending=True)
    assert kinds(node.observe(watcher)) == [EventKind.ROW_REMAP_PENDING]


def test_h200_has_no_retired_pages_and_emits_nothing_for_them(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), MemoryWatcher()
    with pytest.raises(ValueError, match="page retirement"):
        node.sim.set_retired_pages_pending(0, True)
    for _ in range(3):
        sample = node.samples()[0]
        assert sample.retired_pages_pending is None and "retired_pages_pending" not in sample.read_errors
        assert watcher.observe([sample], node.now) == []
    assert watcher.health(0) == HEALTHY


def test_retired_pages_pending_on_a_board_that_retires_pages(tmp_path: Path) -> None:
    node = Node(tmp_path, custom_profile(tmp_path, retired_pages_supported=True, remapped_rows_supported=False))
    watcher = MemoryWatcher()
    node.observe(watcher)
    node.sim.set_retired_pages_pending(0, True)
    (event,) = node.observe(watcher)
    assert_well_formed(event, node, 0)
    assert (event.kind, event.suggested_action) == (EventKind.RETIRED_PAGES_PENDING, SuggestedAction.RESET_GPU)
    assert node.samples()[0].remap_pending is None  # no remapping on this board: no remap events either
    assert node.observe(watcher) == []
    assert watcher.health(0).state is HealthState.DEGRADED
    node.sim.set_retired_pages_pending(0, False)
    assert node.observe(watcher) == []
    assert watcher.health(0) == HEALTHY


def test_ecc_disabled_board_emits_nothing(tmp_path: Path) -> None:
    # The RTX PRO 6000 ships with ECC off: its counters read NOT_SUPPORTED.
    node, watcher = Node(tmp_path, "rtx-pro-6000"), MemoryWatcher()
    node.observe(watcher)
    node.sim.add_ecc_errors(0, corrected=3, uncorrected=3)
    assert node.samples()[0].ecc_uncorrected_volatile is None
    assert node.observe(watcher) == []
    assert watcher.health(0) == HEALTHY


@pytest.mark.parametrize(
    ("action", "severity", "state", "suggested"),
    [
        (RecoveryAction.GPU_RESET, Severity.CRITICAL, HealthState.UNHEALTHY, SuggestedAction.RESET_GPU),
        (RecoveryAction.NODE_REBOOT, Severity.FATAL, HealthState.UNHEALTHY, SuggestedAction.REBOOT),
        (RecoveryAction.DRAIN_P2P, Severity.WARNING, HealthState.DEGRADED, SuggestedAction.ALERT),
        (RecoveryAction.DRAIN_AND_RESET, Severity.CRITICAL, HealthState.UNHEALTHY, SuggestedAction.RESET_GPU),
    ],
)
def test_recovery_action(
    tmp_path: Path, action: RecoveryAction, severity: Severity, state: HealthState, suggested: SuggestedAction
) -> None:
    node, watcher = Node(tmp_path), MemoryWatcher()
    node.observe(watcher)
    node.sim.set_recovery_action(0, action)
    event = one_event(node, watcher, EventKind.RECOVERY_ACTION, severity, suggested)
    assert event.data["recovery_action"] == action
    assert node.observe(watcher) == []
    health = watcher.health(0)
    assert (health.state, health.suggested_action) == (state, suggested)
    node.sim.set_recovery_action(0, RecoveryAction.NONE)
    assert node.observe(watcher) == []
    assert watcher.health(0) == HEALTHY


def test_recovery_action_change_is_a_new_event_and_unsupported_is_silent(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), MemoryWatcher()
    node.sim.set_recovery_action(0, RecoveryAction.GPU_RESET)
    assert [e.suggested_action for e in node.observe(watcher)] == [SuggestedAction.RESET_GPU]
    node.sim.set_recovery_action(0, RecoveryAction.NODE_REBOOT)
    assert [e.suggested_action for e in node.observe(watcher)] == [SuggestedAction.REBOOT]
    # A driver before R550 cannot say: the last answer stands, nothing new is made up.
    node.sim.fail_call(0, "recovery_action", GpuErrorKind.NOT_SUPPORTED)
    node.sim.set_recovery_action(0, RecoveryAction.NONE)
    assert node.samples()[0].recovery_action is None
    assert node.observe(watcher) == []
    assert watcher.health(0).suggested_action is SuggestedAction.REBOOT


# -- lost GPUs -----------------------------------------------------------------------------------


def test_gpu_lost_and_recovered(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path, "h200x2"), GpuLostWatcher()
    uuid = node.sim.identity(1).uuid
    assert node.observe(watcher) == []
    node.sim.set_lost(1)
    samples = node.samples()
    assert samples[1].uuid == "" and not samples[1].up  # a lost GPU cannot even name itself
    (event,) = watcher.observe(samples, node.now)
    assert (event.kind, event.severity, event.suggested_action) == (
        EventKind.GPU_LOST,
        Severity.FATAL,
        SuggestedAction.REBOOT,
    )
    assert (event.gpu, event.uuid) == (1, uuid)  # remembered from the earlier loop
    assert "00000000:2A:00.0" in event.message
    assert node.observe(watcher) == [] and node.observe(watcher, slow=False) == []
    assert watcher.health(1) == Health(
        HealthState.UNHEALTHY, "GPU has fallen off the bus", SuggestedAction.REBOOT, (FaultCause.GPU_LOST,)
    )
    assert watcher.health(0) == HEALTHY
    node.sim.set_lost(1, False)
    (event,) = node.observe(watcher)
    assert (event.kind, event.gpu, event.uuid, event.severity) == (EventKind.GPU_RECOVERED, 1, uuid, Severity.INFO)
    assert node.observe(watcher) == []
    assert watcher.health(1) == HEALTHY


def test_gpu_reset_required(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), GpuLostWatcher()
    node.observe(watcher)
    node.sim.set_reset_required(0)
    one_event(node, watcher, EventKind.GPU_RESET_REQUIRED, Severity.CRITICAL, SuggestedAction.RESET_GPU)
    assert node.observe(watcher) == []
    assert watcher.health(0) == Health(
        HealthState.UNHEALTHY, "GPU requires a reset", SuggestedAction.RESET_GPU, (FaultCause.RESET_REQUIRED,)
    )
    node.sim.reset_gpu(0)
    assert kinds(node.observe(watcher)) == [EventKind.GPU_RECOVERED]
    assert watcher.health(0) == HEALTHY


def test_gpu_lost_at_first_look_and_timeouts_are_not_losses(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path, "h200x2"), GpuLostWatcher()
    node.sim.set_lost(0)
    node.sim.fail_call(1, "identity", GpuErrorKind.TIMEOUT)
    events = node.observe(watcher)
    assert [(e.kind, e.gpu, e.uuid) for e in events] == [(EventKind.GPU_LOST, 0, None)]
    assert watcher.health(1) == HEALTHY  # down, but not known to be lost
    node.sim.set_lost(0, False)
    (event,) = node.observe(watcher)
    assert (event.kind, event.uuid) == (EventKind.GPU_RECOVERED, node.sim.identity(0).uuid)


# -- PCIe ----------------------------------------------------------------------------------------


def test_pcie_width_degraded_after_sustained_loops_then_restored(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), PcieWatcher(sustain_loops=3)
    assert node.observe(watcher) == []
    node.sim.add_pcie_replays(0, 7)
    node.sim.set_pcie_link(0, 5, 8)
    assert node.observe(watcher) == []
    assert node.observe(watcher, slow=False) == []  # no link reading: neither counts nor resets
    assert node.observe(watcher) == []
    event = one_event(node, watcher, EventKind.PCIE_DEGRADED, Severity.WARNING, SuggestedAction.CHECK_MECHANICALS)
    assert event.data == {
        "generation": 5,
        "width": 8,
        "max_generation": 5,
        "max_width": 16,
        "replay_count": 7,
        "replays_since_start": 7,
    }
    assert "gen5 x8 (max gen5 x16)" in event.message
    assert node.observe(watcher) == []
    assert watcher.health(0).state is HealthState.DEGRADED
    assert watcher.health(0).suggested_action is SuggestedAction.CHECK_MECHANICALS
    node.sim.set_pcie_link(0, 5, 16)
    (event,) = node.observe(watcher)
    assert (event.kind, event.data["width"]) == (EventKind.PCIE_RESTORED, 16)
    assert node.observe(watcher) == []
    assert watcher.health(0) == HEALTHY


def test_pcie_blip_shorter_than_sustain_is_ignored(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), PcieWatcher(sustain_loops=3)
    node.sim.set_pcie_link(0, 5, 4)
    events = node.observe(watcher) + node.observe(watcher)
    node.sim.set_pcie_link(0, 5, 16)
    events += node.observe(watcher)
    node.sim.set_pcie_link(0, 5, 4)
    events += node.observe(watcher) + node.observe(watcher)
    assert events == []
    assert watcher.health(0) == HEALTHY


def test_idle_generation_downshift_is_not_degradation(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path, "rtx-pro-6000"), PcieWatcher(sustain_loops=3)
    node.sim.set_pcie_link(0, 1, 16)  # idle in P8 with no utilization: the link saves power at gen1
    sample = node.samples()[0]
    assert (sample.performance_state, sample.gpu_utilization_percent) == (8, 0)
    for _ in range(5):
        assert node.observe(watcher) == []
    assert watcher.health(0) == HEALTHY

    node.sim.set_processes(0, [4242])  # busy at gen1: that is a degraded link
    events = [node.observe(watcher) for _ in range(3)]
    assert events[:2] == [[], []]
    (event,) = events[2]
    assert (event.kind, event.data["generation"], event.data["max_generation"]) == (EventKind.PCIE_DEGRADED, 1, 5)

    node.sim.set_processes(0, [])  # idle again, still gen1: proves nothing either way
    assert node.observe(watcher) == []
    assert watcher.health(0).state is HealthState.DEGRADED
    node.sim.set_pcie_link(0, 5, 16)
    assert kinds(node.observe(watcher)) == [EventKind.PCIE_RESTORED]


def test_h200_at_p0_is_judged_busy(tmp_path: Path) -> None:
    # The H200 idles in P0 with its link at gen5 (fixture): a lower generation there is not a power saving.
    node, watcher = Node(tmp_path), PcieWatcher(sustain_loops=2)
    node.sim.set_pcie_link(0, 4, 16)
    assert node.observe(watcher) == []
    assert kinds(node.observe(watcher)) == [EventKind.PCIE_DEGRADED]


# -- devices -------------------------------------------------------------------------------------


def test_devices_baseline_removed_added(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path, "h200x2"), DeviceWatcher()
    samples = node.samples()
    uuid1 = samples[1].uuid
    assert watcher.observe(samples, node.now) == []  # baseline
    assert watcher.observe(samples, node.now) == []
    (event,) = watcher.observe(samples[:1], node.now)  # GPU 1 no longer enumerated
    assert (event.kind, event.gpu, event.uuid, event.severity) == (
        EventKind.GPU_REMOVED,
        1,
        uuid1,
        Severity.CRITICAL,
    )
    assert event.data["pci_bus_id"] == "00000000:2A:00.0"
    assert watcher.health(1).state is HealthState.UNHEALTHY
    assert watcher.observe(samples[:1], node.now) == []
    (event,) = watcher.observe(samples, node.now)
    assert (event.kind, event.gpu, event.uuid, event.severity) == (EventKind.GPU_ADDED, 1, uuid1, Severity.INFO)
    assert watcher.health(1) == HEALTHY
    assert watcher.present() == sorted((s.uuid, s.pci_bus_id) for s in samples)


def test_devices_renumbered_survivor_is_not_reported_removed(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path, "h200x8"), DeviceWatcher()
    samples = node.samples()
    watcher.observe(samples, node.now)
    # GPU 1 leaves; after the driver re-enumerates, the others move down one index.
    survivors = [dataclasses.replace(s, index=i) for i, s in enumerate([samples[0], *samples[2:]])]
    (event,) = watcher.observe(survivors, node.now)
    assert (event.kind, event.uuid, event.gpu) == (EventKind.GPU_REMOVED, samples[1].uuid, 1)
    assert [watcher.health(i) for i in range(7)] == [HEALTHY] * 7  # index 1 is another, healthy board now


def test_devices_lost_gpu_is_not_removed_and_moved_gpu_is_both(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path, "h200x2"), DeviceWatcher()
    watcher.observe(node.samples(), node.now)
    node.sim.set_lost(0)
    assert watcher.observe(node.samples(), node.now) == []  # lost (GpuLostWatcher's business), still there
    node.sim.set_lost(0, False)
    assert watcher.observe(node.samples(), node.now) == []
    samples = node.samples()
    moved = dataclasses.replace(samples[1], pci_bus_id="00000000:CC:00.0")
    events = watcher.observe([samples[0], moved], node.now)
    assert [(e.kind, e.data["pci_bus_id"]) for e in events] == [
        (EventKind.GPU_REMOVED, "00000000:2A:00.0"),
        (EventKind.GPU_ADDED, "00000000:CC:00.0"),
    ]


def test_devices_new_board_in_a_slot(tmp_path: Path) -> None:
    first, second = Node(tmp_path / "a", "h200"), Node(tmp_path / "b", "rtx-pro-6000")
    watcher = DeviceWatcher()
    watcher.observe(first.samples(), first.now)
    identity = second.sim.identity(0)
    swapped = sample_identified(second.sim, identity)
    events = watcher.observe([swapped], second.now)
    assert [(e.kind, e.uuid) for e in events] == [
        (EventKind.GPU_REMOVED, first.sim.identity(0).uuid),
        (EventKind.GPU_ADDED, identity.uuid),
    ]
    assert "RTX PRO 6000" in events[1].message


def test_udev_unavailable_without_udev_daemon(tmp_path: Path) -> None:
    calls: list[int] = []
    wakeup = UdevWakeup(lambda: calls.append(1), HostPaths.at(tmp_path))
    assert not wakeup.available
    assert "/run/udev/control" in wakeup.reason
    assert wakeup.start() is False
    assert not wakeup.running
    wakeup.stop()  # harmless


def test_udev_unavailable_without_pyudev(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "run" / "udev").mkdir(parents=True)
    (tmp_path / "run" / "udev" / "control").touch()
    monkeypatch.setitem(sys.modules, "pyudev", None)  # import pyudev raises ImportError
    wakeup = UdevWakeup(lambda: None, HostPaths.at(tmp_path))
    assert not wakeup.available
    assert "pyudev" in wakeup.reason
    assert wakeup.start() is False


def test_udev_monitor_starts_and_stops_where_netlink_works(tmp_path: Path) -> None:
    (tmp_path / "run" / "udev").mkdir(parents=True)
    (tmp_path / "run" / "udev" / "control").touch()
    wakeup = UdevWakeup(lambda: None, HostPaths.at(tmp_path))
    assert wakeup.available
    if wakeup.start():
        assert wakeup.running
        wakeup.stop()
        assert not wakeup.running
    else:  # a sandbox without netlink sockets: reported, not raised
        assert "udev monitor unavailable" in wakeup.reason
        assert not wakeup.available


def test_udev_events_filtered_to_nvidia_and_callback_failures_contained(tmp_path: Path) -> None:
    calls: list[int] = []
    wakeup = UdevWakeup(lambda: calls.append(1), HostPaths.at(tmp_path))
    assert wakeup.handle("remove", {"PCI_ID": "10DE:2335", "SUBSYSTEM": "pci"})
    assert wakeup.handle("bind", {"PCI_ID": "10de:2bb1"})
    assert not wakeup.handle("add", {"PCI_ID": "8086:1572"})  # an Intel NIC
    assert not wakeup.handle("add", {})
    assert not wakeup.handle(None, {"PCI_ID": "10DE:2335"})
    assert calls == [1, 1]
    assert is_nvidia_pci_event("change", {"PCI_ID": "10DE:22A3"})  # an NVSwitch: re-enumerating is cheap

    def broken() -> None:
        raise RuntimeError("callback bug")

    assert UdevWakeup(broken, HostPaths.at(tmp_path)).handle("add", {"PCI_ID": "10DE:2335"})


# -- health --------------------------------------------------------------------------------------


def test_combine_worst_state_wins_and_joins_its_reasons() -> None:
    assert combine([]) == HEALTHY
    assert combine([HEALTHY, HEALTHY]) == HEALTHY
    degraded_reboot = Health(HealthState.DEGRADED, "odd", SuggestedAction.REBOOT)
    unhealthy_alert = Health(HealthState.UNHEALTHY, "removed", SuggestedAction.ALERT)
    unhealthy_reset = Health(HealthState.UNHEALTHY, "remap pending", SuggestedAction.RESET_GPU)
    # The most drastic action among the worst state only: a degraded source's reboot does not win.
    assert combine([degraded_reboot, unhealthy_alert]) == unhealthy_alert
    assert combine([HEALTHY, unhealthy_alert, degraded_reboot, unhealthy_reset, unhealthy_alert]) == Health(
        HealthState.UNHEALTHY, "removed; remap pending", SuggestedAction.RESET_GPU
    )
    assert combine([HEALTHY, degraded_reboot]) == degraded_reboot


def test_combine_action_order() -> None:
    assert ACTION_ORDER == (
        SuggestedAction.NONE,
        SuggestedAction.ALERT,
        SuggestedAction.RESTART_SERVICE,
        SuggestedAction.CHECK_MECHANICALS,
        SuggestedAction.CONTACT_SUPPORT,
        SuggestedAction.RESET_GPU,
        SuggestedAction.REBOOT,
    )
    assert set(ACTION_ORDER) == set(SuggestedAction)
    for milder, harsher in itertools.combinations(ACTION_ORDER, 2):
        pair = [Health(HealthState.DEGRADED, "a", milder), Health(HealthState.DEGRADED, "b", harsher)]
        assert combine(pair).suggested_action is harsher
        assert combine(reversed(pair)).suggested_action is harsher


class _FixedSource:
    def __init__(self, health: Health) -> None:
        self._health = health

    def health(self, gpu: int) -> Health:
        return self._health if gpu == 0 else HEALTHY


def test_health_book_across_watchers_and_other_sources(tmp_path: Path) -> None:
    node = Node(tmp_path, "h200x2")
    throttle, memory, lost, pcie, devices = (
        ThrottleWatcher(clock=node.clock.monotonic),
        MemoryWatcher(),
        GpuLostWatcher(),
        PcieWatcher(),
        DeviceWatcher(),
    )
    watchers: list[PollWatcher] = [throttle, memory, lost, pcie, devices]
    identities = {gpu: node.sim.identity(gpu) for gpu in range(2)}  # cached, as the daemon keeps them
    xid = XidWatcher(lambda: identities, clock=lambda: node.now, window_clock=node.clock.monotonic)
    book = HealthBook([*watchers, xid])
    service = _FixedSource(Health(HealthState.DEGRADED, "service slow", SuggestedAction.RESTART_SERVICE))
    book.add(service)

    def loop() -> None:
        samples = node.samples()
        for watcher in watchers:
            watcher.observe(samples, node.now)

    loop()
    assert book.gpu_health(1) == HEALTHY
    assert book.gpu_health(0) == service.health(0)
    node.sim.set_clock_event_reasons(0, REASON_HW_THERMAL)
    node.sim.set_remapped_rows(0, uncorrectable=1, pending=True)
    node.sim.set_lost(1)
    loop()
    assert book.gpu_health(0) == Health(
        HealthState.DEGRADED,
        "clocks slowed by hw_thermal_slowdown; row remapping pending a reset; service slow",
        SuggestedAction.RESET_GPU,  # the remap pending beats checking the cooling and restarting the service
        (FaultCause.CLOCKS_SLOWED, FaultCause.ROW_REMAP_PENDING),  # the codes of the faults that have one
    )
    assert book.by_gpu([0, 1]) == {
        0: book.gpu_health(0),
        1: Health(HealthState.UNHEALTHY, "GPU has fallen off the bus", SuggestedAction.REBOOT, (FaultCause.GPU_LOST,)),
    }
    # The Xid watcher's view joins in like any other source.
    xid.ingest_nvml(GpuEvent(gpu=0, kind=GpuEventKind.XID, data=48, timestamp_seconds=node.now))
    assert xid.health(0) != HEALTHY
    sources: list[HealthSource] = [*watchers, xid, service]
    assert book.gpu_health(0) == combine(source.health(0) for source in sources)
    assert xid.health(0).reason in book.gpu_health(0).reason


# -- per-board state ------------------------------------------------------------------------------


def test_another_board_in_a_slot_starts_from_nothing(tmp_path: Path) -> None:
    """A swapped card's ECC counters are its own history: a baseline, never new errors of the slot."""
    node, watcher = Node(tmp_path), MemoryWatcher()
    node.observe(watcher)
    node.sim.add_ecc_errors(0, uncorrected=4)
    (sample,) = node.samples()
    swapped = dataclasses.replace(sample, uuid="GPU-another-board")
    assert watcher.observe([swapped], node.now) == []
    # no event, but its own volatile count (errors since its last reset) judges its health
    assert watcher.health(0).state is HealthState.UNHEALTHY
    node.sim.add_ecc_errors(0, uncorrected=1)
    (event,) = watcher.observe([dataclasses.replace(node.samples()[0], uuid="GPU-another-board")], node.now)
    assert event.data["new_errors"] == 1


def test_a_gpu_that_does_not_answer_keeps_its_state(tmp_path: Path) -> None:
    node, watcher = Node(tmp_path), MemoryWatcher()
    node.observe(watcher)
    node.sim.add_ecc_errors(0, uncorrected=1)
    (sample,) = node.samples()
    assert watcher.observe([dataclasses.replace(sample, up=False)], node.now) == []
    (event,) = watcher.observe([sample], node.now)
    assert event.data["new_errors"] == 1
