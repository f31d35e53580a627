"""XidWatcher with both real sources: the simulated backend's NVML event set and a fake kernel log file.

Real threads, real files; waits are bounded polls. The dedupe and health windows run on an injectable clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import FakeClock, wait_until

from agent.backend.base import GpuEvent, GpuEventKind, GpuIdentity
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.sim import SimulatedBackend
from agent.events import Event, EventKind, HealthState, Severity, SuggestedAction
from agent.host.paths import HostPaths
from agent.state import XidCount
from agent.watch.fake_kernel_log import append_kmsg, xid_line
from agent.watch.kernel_log import KernelXid, parse_line
from agent.watch.kmsg import KmsgSource
from agent.watch.nvml_events import NvmlEventSource
from agent.watch.xid import XidMark, XidWatcher, recovery_suggested_action

WAIT_SECONDS = 1.5


@dataclass
class Pipeline:
    backend: SimulatedBackend
    paths: HostPaths
    watcher: XidWatcher
    clock: FakeClock
    identities: dict[int, GpuIdentity]
    kernel_log_followed: Callable[[], bool]
    lost: list[GpuError] = field(default_factory=list)
    seen: list[Event] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_nvml(self, event: GpuEvent) -> None:
        produced = self.watcher.ingest_nvml(event)
        with self.lock:
            self.seen.extend(produced)

    def on_kernel(self, record: KernelXid) -> None:
        produced = self.watcher.ingest_kernel(record)
        with self.lock:
            self.seen.extend(produced)

    def release(self, events: list[Event]) -> None:
        with self.lock:
            self.seen.extend(events)

    def xid_events(self) -> list[Event]:
        with self.lock:
            return [e for e in self.seen if e.kind is EventKind.XID]

    def wait_xid_events(self, count: int) -> None:
        wait_until(
            lambda: len(self.xid_events()) == count,
            WAIT_SECONDS,
            lambda: f"{count} Xid events (seen: {[e.message for e in self.xid_events()]})",
        )

    def counted(self, gpu: int | None, xid: int) -> int:
        return sum(c.count for c in self.watcher.counts() if c.gpu == gpu and c.xid == xid)

    def write_kernel_xid(self, gpu: int, xid: int, pid: int | None = None, process: str | None = None) -> None:
        append_kmsg(self.paths, xid_line(self.identities[gpu].pci_bus_id, xid, pid=pid, process=process))


@contextmanager
def running_pipeline(tmp_path: Path, waits_for_kernel_line: bool) -> Iterator[Pipeline]:
    """Both real sources into one watcher; `waits_for_kernel_line`: as the daemon wires it, NVML's
    sighting waits for the line while the kernel log is followed."""
    backend = SimulatedBackend("h200x8", tmp_path / "state")
    backend.init()
    identities = {i: backend.identity(i) for i in range(backend.device_count())}
    paths = HostPaths.at(tmp_path / "host")
    (tmp_path / "host" / "dev").mkdir(parents=True)
    clock = FakeClock()
    kmsg: KmsgSource | None = None
    result: Pipeline | None = None

    def followed() -> bool:
        return kmsg is not None and kmsg.status()[0]

    watcher = XidWatcher(
        lambda: identities,
        clock=clock,
        window_clock=clock.monotonic,
        kernel_log_followed=lambda: waits_for_kernel_line and followed(),
        release=lambda events: result.release(events) if result is not None else None,
    )
    result = Pipeline(backend, paths, watcher, clock, identities, followed)
    nvml = NvmlEventSource(backend, result.on_nvml, result.lost.append, timeout_seconds=0.2, backoff_seconds=0.05)
    kmsg = KmsgSource(paths, result.on_kernel, start_monotonic_seconds=None)
    nvml.start()
    kmsg.start()
    try:
        yield result
    finally:
        nvml.stop()
        kmsg.stop()
        backend.shutdown()


@pytest.fixture
def pipeline(tmp_path: Path) -> Iterator[Pipeline]:
    with running_pipeline(tmp_path, waits_for_kernel_line=False) as result:
        yield result


# -- one event per fault, across both sources -----------------------------------------------------


def test_nvml_and_kernel_sightings_of_one_xid_make_one_event(pipeline: Pipeline) -> None:
    pipeline.backend.inject_xid(3, 79)
    pipeline.write_kernel_xid(3, 79, pid=4242, process="python3")
    wait_until(
        lambda: any(len(e.data["sources"]) == 2 for e in pipeline.xid_events()),
        WAIT_SECONDS,
        "an Xid event seen by both sources",
    )
    time.sleep(0.2)  # nothing else may trickle in
    events = pipeline.xid_events()
    assert len(events) == 1
    event = events[0]
    assert sorted(event.data["sources"]) == ["kmsg", "nvml"]
    assert event.gpu == 3
    assert event.uuid == pipeline.identities[3].uuid
    assert event.data["pci_bus_id"] == "00000000:5D:00.0"
    assert event.severity is Severity.FATAL
    assert event.suggested_action is SuggestedAction.REBOOT
    assert event.message == "Xid 79 on GPU 3 (00000000:5D:00.0): GPU has fallen off the bus — reboot"
    assert event.key == f"xid:{pipeline.identities[3].uuid}:79:{pipeline.clock():.3f}"
    assert event.data["resolution"] == "RESTART_BM"
    assert event.data["name"] == "GPU has fallen off the bus"
    assert pipeline.counted(3, 79) == 1


def test_kernel_first_then_nvml_is_still_one_event(pipeline: Pipeline) -> None:
    pipeline.write_kernel_xid(5, 13, pid=777, process="sglang")
    wait_until(lambda: pipeline.counted(5, 13) == 1, WAIT_SECONDS, "Xid 13 on GPU 5 counted")
    pipeline.backend.inject_xid(5, 13)
    wait_until(
        lambda: any(e.data["sources"] == ["kmsg", "nvml"] for e in pipeline.xid_events()),
        WAIT_SECONDS,
        "the NVML sighting joined to the kernel's",
    )
    time.sleep(0.2)
    events = pipeline.xid_events()
    assert len(events) == 1
    event = events[0]
    # The first sighting made the event: the kernel line's details are in it, the source is the kernel log.
    assert event.source == "kmsg"
    assert (event.data["pid"], event.data["process"]) == (777, "sglang")
    assert event.data["text"] == "Graphics Engine Exception."
    assert event.severity is Severity.WARNING
    assert event.suggested_action is SuggestedAction.RESTART_SERVICE
    assert pipeline.counted(5, 13) == 1


@pytest.mark.parametrize("kernel_first", [False, True])
def test_an_app_xid_both_sources_report_is_one_event_with_its_process(tmp_path: Path, kernel_first: bool) -> None:
    """As the daemon runs it: the kernel log followed, NVML's sighting waits for the line. Whichever
    source comes first, one event, one count, and the event names the faulting process."""
    with running_pipeline(tmp_path, waits_for_kernel_line=True) as pipeline:
        append_kmsg(pipeline.paths, "kernel: starting")  # the log exists: the source follows it
        wait_until(pipeline.kernel_log_followed, WAIT_SECONDS, "the kernel log followed")
        if kernel_first:
            pipeline.write_kernel_xid(2, 13, pid=4242, process="python3")
            pipeline.wait_xid_events(1)
            pipeline.backend.inject_xid(2, 13)
        else:
            pipeline.backend.inject_xid(2, 13)
            wait_until(lambda: pipeline.counted(2, 13) == 1, WAIT_SECONDS, "NVML's sighting counted")
            pipeline.write_kernel_xid(2, 13, pid=4242, process="python3")
        wait_until(
            lambda: any(sorted(e.data["sources"]) == ["kmsg", "nvml"] for e in pipeline.xid_events()),
            WAIT_SECONDS,
            "one event seen by both sources",
        )
        time.sleep(1.2)  # past the wait for a kernel line: nothing else is handed on
        (event,) = pipeline.xid_events()
        assert (event.data["pid"], event.data["process"]) == (4242, "python3")
        assert pipeline.counted(2, 13) == 1


def test_same_xid_after_the_window_is_a_new_event(pipeline: Pipeline) -> None:
    pipeline.backend.inject_xid(1, 31)
    pipeline.wait_xid_events(1)
    pipeline.clock.advance(11)
    pipeline.backend.inject_xid(1, 31)
    pipeline.write_kernel_xid(1, 31)
    pipeline.wait_xid_events(2)
    wait_until(
        lambda: sorted(pipeline.xid_events()[1].data["sources"]) == ["kmsg", "nvml"],
        WAIT_SECONDS,
        "the second event seen by both sources",
    )
    first, second = pipeline.xid_events()
    assert second.timestamp_seconds - first.timestamp_seconds == pytest.approx(11)
    assert first.key != second.key
    assert first.data["sources"] == ["nvml"]
    assert pipeline.counted(1, 31) == 2


def test_different_xids_on_one_gpu_are_different_events(pipeline: Pipeline) -> None:
    pipeline.backend.inject_xid(0, 31)
    pipeline.write_kernel_xid(0, 43)
    pipeline.wait_xid_events(2)
    assert sorted(e.data["xid"] for e in pipeline.xid_events()) == [31, 43]
    assert pipeline.counted(0, 31) == 1
    assert pipeline.counted(0, 43) == 1


def test_unknown_bus_id_still_makes_an_event(pipeline: Pipeline) -> None:
    append_kmsg(pipeline.paths, xid_line("0000:e1:00.0", 48))
    pipeline.wait_xid_events(1)
    event = pipeline.xid_events()[0]
    assert event.gpu is None
    assert event.uuid is None
    assert event.data["pci_bus_id"] == "00000000:E1:00.0"
    assert event.message == "Xid 48 on unknown GPU (00000000:E1:00.0): Double Bit ECC Error — reset_gpu"
    assert event.key.startswith("xid:00000000:E1:00.0:48:")
    assert pipeline.counted(None, 48) == 1


def test_lost_gpu_from_the_event_wait_reaches_on_lost_and_events_keep_flowing(pipeline: Pipeline) -> None:
    pipeline.backend.set_lost(6)
    wait_until(lambda: len(pipeline.lost) == 1, WAIT_SECONDS, "the lost GPU reported")
    assert pipeline.lost[0].kind is GpuErrorKind.GPU_LOST
    assert pipeline.lost[0].gpu == 6
    pipeline.backend.inject_xid(2, 94)
    wait_until(lambda: [e.data["xid"] for e in pipeline.xid_events()] == [94], WAIT_SECONDS, "Xid 94 alone")


# -- the watcher alone: mapping, dedupe, recovery actions ---------------------------------------------


def identity(index: int, bus: str) -> GpuIdentity:
    return GpuIdentity(index, f"GPU-{index:08d}-0000-0000-0000-000000000000", "NVIDIA H200", bus, "1", "v", index)


IDENTITIES = {
    0: identity(0, "00000000:18:00.0"),
    1: identity(1, "00000000:3B:00.0"),
    2: identity(2, "00000001:5D:00.0"),
}


def make_watcher(clock: FakeClock | None = None, **kwargs: float) -> tuple[XidWatcher, FakeClock]:
    clock = clock or FakeClock()
    return XidWatcher(lambda: IDENTITIES, clock=clock, window_clock=clock.monotonic, **kwargs), clock


def kernel(line: str) -> KernelXid:
    parsed = parse_line(line)
    assert parsed is not None
    return parsed


def nvml(gpu: int, xid: int) -> GpuEvent:
    return GpuEvent(gpu=gpu, kind=GpuEventKind.XID, data=xid, timestamp_seconds=0.0)


@pytest.mark.parametrize(
    ("line", "gpu"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception", 1),
        ("NVRM: Xid (0000:3b:00): 13, Graphics Exception", 1),
        ("NVRM: Xid (PCI:3b:00): 13, Graphics Exception", 1),  # no domain: the old driver form
        ("NVRM: Xid (PCI:0000:18:00.0): 13, Graphics Exception", 0),
        ("NVRM: Xid (PCI:0001:5d:00): 13, Graphics Exception", 2),
        ("NVRM: Xid (PCI:5d:00): 13, Graphics Exception", 2),  # domainless, GPU in domain 1, unique
        ("NVRM: Xid (PCI:0000:99:00): 13, Graphics Exception", None),
    ],
)
def test_kernel_bus_ids_map_to_gpus(line: str, gpu: int | None) -> None:
    watcher, _ = make_watcher()
    (event,) = watcher.ingest_kernel(kernel(line))
    assert event.gpu == gpu
    if gpu is not None:
        assert event.uuid == IDENTITIES[gpu].uuid
        assert event.data["pci_bus_id"] == IDENTITIES[gpu].pci_bus_id


def test_domainless_bus_id_matching_two_domains_is_not_guessed() -> None:
    identities = {0: identity(0, "00000001:3B:00.0"), 1: identity(1, "00000002:3B:00.0")}
    watcher = XidWatcher(lambda: identities, clock=FakeClock())
    (event,) = watcher.ingest_kernel(kernel("NVRM: Xid (PCI:3b:00): 13, Graphics Exception"))
    assert event.gpu is None


def test_repeats_from_one_source_within_the_window_are_one_event() -> None:
    watcher, clock = make_watcher()
    assert len(watcher.ingest_nvml(nvml(0, 31))) == 1
    clock.advance(4)
    assert watcher.ingest_nvml(nvml(0, 31)) == []
    clock.advance(6)  # 10 s after the first sighting: still inside the window
    # The same fault, told already (no kernel log was followed to wait for): its line only adds its source.
    assert watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:18:00): 31, pid=9, name=a, MMU Fault")) == []
    assert watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:18:00): 31, pid=9, name=a, MMU Fault")) == []
    clock.advance(0.5)
    assert len(watcher.ingest_nvml(nvml(0, 31))) == 1
    (count,) = watcher.counts()
    assert count == XidCount(gpu=0, uuid=IDENTITIES[0].uuid, xid=31, count=2, last_seen_seconds=clock())


def test_window_length_is_configurable() -> None:
    watcher, clock = make_watcher(dedupe_window_seconds=2.0)
    watcher.ingest_nvml(nvml(1, 13))
    clock.advance(3)
    assert len(watcher.ingest_nvml(nvml(1, 13))) == 1


def test_folded_sighting_changes_only_sources() -> None:
    watcher, clock = make_watcher()
    (event,) = watcher.ingest_nvml(nvml(1, 79))
    before = dict(event.data)
    clock.advance(1)
    assert (
        watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:3b:00): 79, pid=5, name=p, GPU has fallen off the bus."))
        == []
    )
    assert event.data["sources"] == ["nvml", "kmsg"]
    assert {k: v for k, v in event.data.items() if k != "sources"} == {
        k: v for k, v in before.items() if k != "sources"
    }
    assert event.data["pid"] is None
    assert event.timestamp_seconds == clock() - 1


def test_unknown_xid_code_is_a_warning_asking_for_a_look() -> None:
    watcher, _ = make_watcher()
    (event,) = watcher.ingest_nvml(nvml(0, 998))
    assert event.severity is Severity.WARNING
    assert event.suggested_action is SuggestedAction.ALERT
    assert event.data["name"] == "Unknown Xid"
    assert event.data["resolution"] == "UNKNOWN"
    assert event.message == "Xid 998 on GPU 0 (00000000:18:00.0): Unknown Xid — alert"


def test_nvml_event_for_a_gpu_without_identity_keeps_its_index() -> None:
    watcher, _ = make_watcher()
    (event,) = watcher.ingest_nvml(nvml(7, 79))
    assert (event.gpu, event.uuid, event.data["pci_bus_id"]) == (7, None, None)
    assert event.message == "Xid 79 on GPU 7: GPU has fallen off the bus — reboot"


def test_ecc_events_from_nvml_are_not_xids() -> None:
    watcher, _ = make_watcher()
    event = GpuEvent(gpu=0, kind=GpuEventKind.DOUBLE_BIT_ECC, data=0, timestamp_seconds=0.0)
    assert watcher.ingest_nvml(event) == []
    assert watcher.counts() == []


def test_nvlink5_fields_are_carried_in_data() -> None:
    watcher, _ = make_watcher()
    line = "NVRM: Xid (PCI:0000:18:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 02 (0x00000001 0x00000010 0x0 0x0)"
    (event,) = watcher.ingest_kernel(kernel(line))
    assert event.data["nvlink"]["unit"] == "RLW_REMAP"
    assert event.data["nvlink"]["link"] == 2
    assert event.data["nvlink"]["fatal"] is False
    assert event.data["nvlink"]["intr_info"] == 1


@pytest.mark.parametrize(
    ("recovery", "action", "severity"),
    [
        ("GPU Reset Required", SuggestedAction.RESET_GPU, Severity.CRITICAL),
        ("Node Reboot Required", SuggestedAction.REBOOT, Severity.CRITICAL),
        ("Drain P2P", SuggestedAction.ALERT, Severity.WARNING),
        ("Drain and Reset", SuggestedAction.RESET_GPU, Severity.CRITICAL),
        ("None", SuggestedAction.NONE, Severity.INFO),
    ],
)
def test_xid_154_also_yields_a_recovery_action_event(
    recovery: str, action: SuggestedAction, severity: Severity
) -> None:
    watcher, _ = make_watcher()
    line = f"NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 ({recovery})"
    xid_event, recovery_event = watcher.ingest_kernel(kernel(line))
    assert xid_event.kind is EventKind.XID
    assert xid_event.data["recovery_action"] == recovery
    assert recovery_event.kind is EventKind.RECOVERY_ACTION
    assert recovery_event.suggested_action is action
    assert recovery_event.severity is severity
    assert recovery_event.gpu == 1
    assert recovery_event.data["recovery_action"] == recovery
    assert recovery in recovery_event.message
    assert recovery_suggested_action(recovery) is action


def test_unknown_recovery_action_text_asks_for_a_look() -> None:
    assert recovery_suggested_action("Replace The Moon") is SuggestedAction.ALERT


def test_xid_154_seen_by_nvml_first_gets_its_recovery_event_from_the_kernel_line() -> None:
    watcher, clock = make_watcher()
    (xid_event,) = watcher.ingest_nvml(nvml(1, 154))
    clock.advance(0.1)
    line = "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
    (recovery_event,) = watcher.ingest_kernel(kernel(line))
    assert recovery_event.kind is EventKind.RECOVERY_ACTION
    assert recovery_event.suggested_action is SuggestedAction.RESET_GPU
    assert xid_event.data["sources"] == ["nvml", "kmsg"]
    # The same line again (say, the journal re-read) changes nothing; a new action within the window does.
    assert watcher.ingest_kernel(kernel(line)) == []
    escalated = line.replace(
        "0x0 (None) to 0x1 (GPU Reset Required)", "0x1 (GPU Reset Required) to 0x2 (Node Reboot Required)"
    )
    (escalation,) = watcher.ingest_kernel(kernel(escalated))
    assert escalation.suggested_action is SuggestedAction.REBOOT
    assert watcher.health(1).suggested_action is SuggestedAction.REBOOT
    assert watcher.counts()[0].count == 1


def test_nvml_sighting_of_154_keeps_the_recovery_action_the_kernel_named() -> None:
    watcher, clock = make_watcher()
    line = "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
    watcher.ingest_kernel(kernel(line))
    clock.advance(1)
    watcher.ingest_nvml(nvml(1, 154))
    clock.advance(60)
    assert len(watcher.ingest_nvml(nvml(1, 154))) == 1  # a new fault, with no action text of its own
    health = watcher.health(1)
    assert (health.state, health.suggested_action) == (HealthState.UNHEALTHY, SuggestedAction.REBOOT)


# -- health ------------------------------------------------------------------------------------------


def watcher_that_saw(*sightings: tuple[int, int]) -> XidWatcher:
    """A watcher that has seen each (GPU, Xid) through NVML."""
    watcher, _ = make_watcher()
    for gpu, code in sightings:
        watcher.ingest_nvml(nvml(gpu, code))
    return watcher


def test_xid_79_makes_the_gpu_unhealthy_with_reboot() -> None:
    watcher = watcher_that_saw((1, 79))
    health = watcher.health(1)
    assert (health.state, health.suggested_action) == (HealthState.UNHEALTHY, SuggestedAction.REBOOT)
    assert "Xid 79" in health.reason
    assert watcher.health(0).state is HealthState.HEALTHY


def test_xid_13_degrades_with_restart_service() -> None:
    health = watcher_that_saw((0, 13)).health(0)
    assert (health.state, health.suggested_action) == (HealthState.DEGRADED, SuggestedAction.RESTART_SERVICE)


def test_alert_degrades_and_informational_stays_healthy() -> None:
    # GPU 0: a high single-bit ECC rate (alert); GPU 1: a row remapping event (informational)
    watcher = watcher_that_saw((0, 92), (1, 63))
    assert (watcher.health(0).state, watcher.health(0).suggested_action) == (
        HealthState.DEGRADED,
        SuggestedAction.ALERT,
    )
    assert watcher.health(1).state is HealthState.HEALTHY


def test_worst_xid_in_the_window_wins() -> None:
    watcher, clock = make_watcher()
    watcher.ingest_nvml(nvml(0, 13))
    watcher.ingest_nvml(nvml(0, 48))  # double-bit ECC: reset_gpu
    watcher.ingest_nvml(nvml(0, 31))
    assert watcher.health(0).suggested_action is SuggestedAction.RESET_GPU
    clock.advance(30)
    watcher.ingest_nvml(nvml(0, 79))
    assert watcher.health(0).suggested_action is SuggestedAction.REBOOT


def gpu0_health_after(watcher: XidWatcher, clock: FakeClock, *steps_seconds: float) -> list[HealthState]:
    """GPU 0's health state after each step of time."""
    states = []
    for seconds in steps_seconds:
        clock.advance(seconds)
        states.append(watcher.health(0).state)
    return states


def test_health_expires_after_the_window() -> None:
    watcher, clock = make_watcher(health_window_seconds=600)
    watcher.ingest_nvml(nvml(0, 48))
    clock.advance(300)
    watcher.ingest_nvml(nvml(0, 13))
    # 301 s on, Xid 48 is 601 s old and Xid 13 301 s; 300 s later Xid 13 has expired too
    assert gpu0_health_after(watcher, clock, 301, 300) == [HealthState.DEGRADED, HealthState.HEALTHY]


def test_default_health_window_is_an_hour() -> None:
    watcher, clock = make_watcher()
    watcher.ingest_nvml(nvml(0, 79))
    assert gpu0_health_after(watcher, clock, 3599, 2) == [HealthState.UNHEALTHY, HealthState.HEALTHY]


@pytest.mark.parametrize("step_seconds", [7200.0, -7200.0])
def test_a_wall_clock_step_neither_clears_a_fresh_verdict_nor_splits_a_fault(step_seconds: float) -> None:
    watcher, clock = make_watcher()
    watcher.ingest_nvml(nvml(0, 48))
    clock.advance(1)
    clock.step_wall(step_seconds)  # NTP or an operator moves the wall clock two hours
    assert watcher.health(0).state is HealthState.UNHEALTHY
    assert watcher.ingest_nvml(nvml(0, 48)) == []  # the same fault, inside the dedupe window
    # The mark was renewed by that sighting: it holds an hour of the boot clock from there.
    assert gpu0_health_after(watcher, clock, 3599, 2) == [HealthState.UNHEALTHY, HealthState.HEALTHY]


def test_a_mark_stored_on_another_clock_expires() -> None:
    """A mark an older agent saved as wall-clock time lies in the boot clock's future: not held for good."""
    watcher, _ = make_watcher()
    watcher.restore([], [XidMark(0, 48, "reset_gpu", "Xid 48: DBE", 1_800_000_000.0)])
    assert watcher.health(0).state is HealthState.HEALTHY


def test_clear_forgets_health_and_open_faults_but_not_counts() -> None:
    watcher, clock = make_watcher()
    watcher.ingest_nvml(nvml(0, 48))
    watcher.ingest_nvml(nvml(1, 13))
    watcher.clear(0)
    assert watcher.health(0).state is HealthState.HEALTHY
    assert watcher.health(1).state is HealthState.DEGRADED
    clock.advance(1)
    # After a reset the same Xid is a new fault, even inside the dedupe window.
    assert len(watcher.ingest_nvml(nvml(0, 48))) == 1
    assert [(c.gpu, c.xid, c.count) for c in watcher.counts()] == [(0, 48, 2), (1, 13, 1)]


def test_a_restart_of_the_services_clears_their_gpus_app_level_xids_only() -> None:
    """The restart of a service whose process faulted deals with its app-level Xids (13, 31, 43, 45):
    they leave the health window of its GPUs, and what is open (`open_marks`, gpu_agent_xid_open) is
    what the restart did not deal with: a reset-class Xid, another GPU's app Xid. The counts stay."""
    watcher, clock = make_watcher()
    for gpu, code in ((0, 13), (0, 45), (0, 48), (1, 13), (1, 63)):
        watcher.ingest_nvml(nvml(gpu, code))
    assert watcher.open_marks() == {(0, 13), (0, 45), (0, 48), (1, 13)}  # 63 is informational: never open
    watcher.restarted(frozenset({0}))
    assert watcher.open_marks() == {(0, 48), (1, 13)}
    assert watcher.health(0).suggested_action is SuggestedAction.RESET_GPU
    clock.advance(0.5)
    late = "NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python3, Graphics Exception"
    assert watcher.ingest_kernel(kernel(late)) == []  # the fault the restart dealt with, its line late
    assert (0, 13) not in watcher.open_marks()
    watcher.restarted(None)  # a service on every GPU
    assert watcher.open_marks() == {(0, 48)}
    assert watcher.health(1).state is HealthState.HEALTHY
    assert [(c.gpu, c.xid, c.count) for c in watcher.counts()] == [
        (0, 13, 1),
        (0, 45, 1),
        (0, 48, 1),
        (1, 13, 1),
        (1, 63, 1),
    ]


def test_the_second_report_of_a_fault_a_reset_dealt_with_is_not_a_new_fault() -> None:
    """The reset for an Xid NVML reported can end before the kernel-log line of that same Xid is read:
    the line folds into the fault the reset dealt with (no event, no count, no health mark)."""
    watcher, clock = make_watcher()
    (event,) = watcher.ingest_nvml(nvml(1, 48))
    watcher.clear(1)
    clock.advance(0.5)
    assert watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:3b:00): 48, pid='<unknown>', name=<unknown>, DBE")) == []
    assert event.data["sources"] == ["nvml", "kmsg"]
    assert watcher.health(1).state is HealthState.HEALTHY
    assert [(c.gpu, c.xid, c.count) for c in watcher.counts()] == [(1, 48, 1)]
    # Kernel log first: NVML's late event of the fault is the same fault too.
    watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus."))
    watcher.clear(0)
    assert watcher.ingest_nvml(nvml(0, 79)) == []
    assert [(c.gpu, c.xid, c.count) for c in watcher.counts()] == [(0, 79, 1), (1, 48, 1)]


def test_recovery_action_none_supersedes_an_earlier_one() -> None:
    watcher, clock = make_watcher()
    base = "NVRM: Xid (PCI:0000:18:00): 154, GPU recovery action changed from "
    watcher.ingest_kernel(kernel(base + "0x0 (None) to 0x1 (GPU Reset Required)"))
    assert watcher.health(0).state is HealthState.UNHEALTHY
    clock.advance(60)
    watcher.ingest_kernel(kernel(base + "0x1 (GPU Reset Required) to 0x0 (None)"))
    assert watcher.health(0).state is HealthState.HEALTHY


# -- counters ------------------------------------------------------------------------------------------


def test_counts_after_dedupe() -> None:
    watcher, clock = make_watcher()
    for _ in range(3):
        watcher.ingest_nvml(nvml(1, 79))
        watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."))
        clock.advance(1)
    watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:99:00): 13, Graphics Exception"))
    clock.advance(20)
    watcher.ingest_nvml(nvml(0, 13))
    assert watcher.counts() == [
        XidCount(gpu=0, uuid=IDENTITIES[0].uuid, xid=13, count=1, last_seen_seconds=clock()),
        XidCount(gpu=1, uuid=IDENTITIES[1].uuid, xid=79, count=1, last_seen_seconds=clock() - 21),
        XidCount(gpu=None, uuid="", xid=13, count=1, last_seen_seconds=clock() - 20),
    ]


def test_concurrent_sightings_from_two_threads_make_one_event_per_fault() -> None:
    watcher, _ = make_watcher()
    barrier = threading.Barrier(2)
    produced: list[Event] = []
    lock = threading.Lock()

    def feed(sightings: list[Callable[[], list[Event]]]) -> None:
        barrier.wait()
        for sighting in sightings:
            events = sighting()
            with lock:
                produced.extend(events)

    lines = {xid: kernel(f"NVRM: Xid (PCI:0000:18:00): {xid}, something") for xid in range(1, 60)}
    nvml_side = [lambda xid=xid: watcher.ingest_nvml(nvml(0, xid)) for xid in range(1, 60)]
    kernel_side = [lambda xid=xid: watcher.ingest_kernel(lines[xid]) for xid in range(1, 60)]
    threads = [threading.Thread(target=feed, args=(side,)) for side in (nvml_side, kernel_side)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert sorted(e.data["xid"] for e in produced if e.kind is EventKind.XID) == list(range(1, 60))
    assert all(c.count == 1 for c in watcher.counts())
    assert all(sorted(e.data["sources"]) == ["kmsg", "nvml"] for e in produced if e.kind is EventKind.XID)


# -- the NVML event thread ----------------------------------------------------------------------------


def test_nvml_source_survives_other_errors_and_reports_them(tmp_path: Path) -> None:
    backend = SimulatedBackend("h200x2", tmp_path / "state")
    backend.init()
    received: list[GpuEvent] = []
    source = NvmlEventSource(backend, received.append, lambda error: None, timeout_seconds=0.1, backoff_seconds=0.05)
    backend.fail_call(None, "wait_events", GpuErrorKind.UNKNOWN)
    source.start()
    try:
        wait_until(
            lambda: "injected failure of wait_events" in source.status()[1], WAIT_SECONDS, "the failure in the status"
        )
        assert source.status()[0] is False
        backend.fail_call(None, "wait_events", None)
        wait_until(lambda: source.status()[0] is True, WAIT_SECONDS, "the source working again")
        backend.inject_xid(1, 13)
        wait_until(lambda: [(e.gpu, e.data) for e in received] == [(1, 13)], WAIT_SECONDS, "Xid 13 on GPU 1")
    finally:
        source.stop()


def test_nvml_source_survives_a_failing_consumer(tmp_path: Path) -> None:
    backend = SimulatedBackend("h200x2", tmp_path / "state")
    backend.init()
    received: list[GpuEvent] = []

    def sink(event: GpuEvent) -> None:
        if event.data == 13:
            raise RuntimeError("consumer bug")
        received.append(event)

    source = NvmlEventSource(backend, sink, lambda error: None, timeout_seconds=0.1)
    source.start()
    try:
        backend.inject_xid(0, 13)
        time.sleep(0.05)
        backend.inject_xid(0, 31)
        wait_until(lambda: [e.data for e in received] == [31], WAIT_SECONDS, "Xid 31 delivered")
    finally:
        source.stop()


def test_nvml_source_stop_is_prompt(tmp_path: Path) -> None:
    backend = SimulatedBackend("h200", tmp_path / "state")
    backend.init()
    source = NvmlEventSource(backend, lambda event: None, lambda error: None, timeout_seconds=0.5)
    source.start()
    time.sleep(0.1)  # the thread is inside a wait now
    started = time.monotonic()
    source.stop()
    assert time.monotonic() - started < 0.7
    assert not any(t.name == "xid-nvml" and t.is_alive() for t in threading.enumerate())


def test_the_kernel_log_names_whose_process_faulted() -> None:
    owners = {4242: "sglang"}
    clock = FakeClock()
    watcher = XidWatcher(lambda: IDENTITIES, clock=clock, window_clock=clock.monotonic, process_owner=owners.get)
    (mine,) = watcher.ingest_kernel(
        kernel("NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python3, Graphics Exception")
    )
    assert (mine.data["pid"], mine.data["process_service"]) == (4242, "sglang")
    assert "(pid 4242 python3, service sglang)" in mine.message
    (theirs,) = watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:3b:00): 13, pid=5151, name=x, Graphics Exception"))
    assert theirs.data["process_service"] is None and "(pid 5151 x, no configured service)" in theirs.message


@dataclass
class Released:
    """What a waiting watcher hands on from its timer, and a switch for "a kernel log is followed"."""

    followed: bool = True
    events: list[Event] = field(default_factory=list)

    def watcher(self, owners: dict[int, str] | None = None, wait_seconds: float = 30.0) -> tuple[XidWatcher, FakeClock]:
        clock = FakeClock()
        watcher = XidWatcher(
            lambda: IDENTITIES,
            clock=clock,
            window_clock=clock.monotonic,
            process_owner=(owners or {}).get,
            kernel_log_followed=lambda: self.followed,
            release=self.events.extend,
            kernel_line_wait_seconds=wait_seconds,
        )
        return watcher, clock


def test_an_app_xid_nvml_saw_first_waits_for_its_kernel_line_and_is_told_once() -> None:
    """NVML names no process; the kernel line does, and decides whose service restarts. One fault:
    one event, with the process, timed when NVML saw it."""
    released = Released()
    watcher, clock = released.watcher(owners={5151: "sglang"})
    assert watcher.ingest_nvml(nvml(0, 13)) == []  # waiting for the line
    assert watcher.health(0).state is HealthState.DEGRADED  # counted and judged at once
    assert [(c.xid, c.count) for c in watcher.counts()] == [(13, 1)]
    seen_seconds = clock()
    clock.advance(0.01)
    (event,) = watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:18:00): 13, pid=5151, name=x, Graphics"))
    assert (event.data["pid"], event.data["process"], event.data["process_service"]) == (5151, "x", "sglang")
    assert event.data["sources"] == ["nvml", "kmsg"]
    assert event.source == "kmsg" and event.data["text"] == "Graphics"
    assert event.timestamp_seconds == seen_seconds
    assert "(pid 5151 x, service sglang)" in event.message
    assert watcher.ingest_nvml(nvml(0, 13)) == []  # a repeat folds
    (count,) = watcher.counts()
    assert count.count == 1
    assert released.events == []


def test_an_xid_whose_kernel_line_never_comes_is_told_as_nvml_saw_it() -> None:
    released = Released()
    watcher, clock = released.watcher(wait_seconds=0.05)
    assert watcher.ingest_nvml(nvml(1, 79)) == []
    wait_until(lambda: len(released.events) == 1, WAIT_SECONDS, "the Xid handed on after the wait")
    (event,) = released.events
    assert (event.data["xid"], event.data["sources"], event.data["pid"]) == (79, ["nvml"], None)
    # A line later than the wait only adds its source: the fault was told.
    clock.advance(1)
    assert watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")) == []
    assert event.data["sources"] == ["nvml", "kmsg"]
    time.sleep(0.1)
    assert len(released.events) == 1
    assert [(c.xid, c.count) for c in watcher.counts()] == [(79, 1)]


def test_nothing_waits_for_a_kernel_log_that_is_not_followed() -> None:
    """A container without a kernel log: NVML's sighting is told at once, and never again."""
    released = Released(followed=False)
    watcher, _ = released.watcher(wait_seconds=0.05)
    (event,) = watcher.ingest_nvml(nvml(0, 13))
    assert event.data["pid"] is None
    time.sleep(0.1)
    assert released.events == []
    # The kernel log first: told at once, whether or not a log is followed.
    released.followed = True
    (first,) = watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:3b:00): 48, DBE"))
    assert watcher.ingest_nvml(nvml(1, 48)) == []
    assert first.data["sources"] == ["kmsg", "nvml"]


def test_two_processes_app_xids_are_two_faults() -> None:
    """Another process's Xid 13 a second earlier must not swallow the service's own."""
    watcher, clock = make_watcher()
    (theirs,) = watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:18:00): 13, pid=5151, name=x, Graphics"))
    clock.advance(1)
    assert watcher.ingest_nvml(nvml(0, 13)) == []  # NVML names no process: the open fault
    (mine,) = watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python3, Graphics"))
    assert (theirs.data["pid"], mine.data["pid"]) == (5151, 4242)
    assert watcher.ingest_kernel(kernel("NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python3, Graphics")) == []
    (count,) = watcher.counts()
    assert count.count == 2
