"""The throttle watcher's time per clock-event reason with its active slowdowns, and the service
prober's failure streaks, outliving an agent restart (not a reboot) through the node memory on a
real SQLite store."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from helpers import FakeClock
from test_node_memory import BOOT, UUIDS, memory_of, sample, xid_watcher

from agent.config.service_entry import ServiceConfig
from agent.daemon.node_memory import NodeMemory
from agent.events import EventKind
from agent.services.prober import HealthProber
from agent.state import GpuSample
from agent.store.database import DB_NAME, Store
from agent.watch.throttle import ThrottleWatcher

SW_THERMAL = 0x20
REASON = "sw_thermal_slowdown"


def thermal(index: int, at: float, uuid_of: int | None = None, mask: int = SW_THERMAL) -> GpuSample:
    base = sample(index, uuid_of, at=at)
    return GpuSample(
        base.index, base.uuid, base.name, base.pci_bus_id, up=True, timestamp_seconds=at, clock_event_reasons=mask
    )


def refused_url() -> str:
    """A health URL nothing listens on: every probe fails at once (connection refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/health"


def agent_run(
    store: Store, clock: FakeClock, url: str, boot: str = BOOT, after: int = 5
) -> tuple[NodeMemory, ThrottleWatcher, HealthProber]:
    """One run of the agent: a fresh memory, throttle watcher and prober, loaded from the store."""
    throttle = ThrottleWatcher(clock=clock.monotonic)
    prober = HealthProber(
        [ServiceConfig(name="sglang", health_url=url, unhealthy_after_probes=after, probe_timeout_seconds=1.0)],
        clock=clock,
    )
    memory = memory_of(store, xid_watcher(clock), boot, throttle, prober)
    memory.load(store)
    return memory, throttle, prober


def save(memory: NodeMemory, throttle: ThrottleWatcher, prober: HealthProber, clock: FakeClock) -> None:
    """What the run's memory saves: its own throttle watcher's and prober's (the ones `agent_run` gave it)."""
    assert memory.live.watchers.throttle is throttle and memory.live.prober is prober
    memory.save(clock())


def test_clock_event_time_and_an_active_slowdown_outlive_a_restart_not_a_reboot(tmp_path: Path) -> None:
    clock = FakeClock()
    url = refused_url()
    with Store.open(tmp_path) as store:
        memory, throttle, prober = agent_run(store, clock, url)
        throttle.observe([thermal(0, 100.0), thermal(1, 100.0, mask=0)], 100.0)
        clock.advance(30)
        throttle.observe([thermal(0, 130.0), thermal(1, 130.0, mask=0)], 130.0)
        assert throttle.clock_event_seconds()[(0, REASON)] == 30.0
        save(memory, throttle, prober, clock)

        # The agent restarts 20 s later; the slowdown still holds, and so does its hold on the boot clock.
        clock.advance(20)
        memory, throttle, prober = agent_run(store, clock, url)
        assert throttle.clock_event_seconds() == {(0, REASON): 30.0}
        assert throttle.active_since() == {(0, REASON): 100.0}
        assert throttle.held_seconds() == {(0, REASON): 50.0}
        events = throttle.observe([thermal(0, 150.0), thermal(1, 150.0, mask=0)], 150.0)
        assert [e.kind for e in events] == []  # the same slowdown, not a new one
        assert throttle.clock_event_seconds()[(0, REASON)] == 30.0  # the gap between runs is not counted
        clock.advance(10)
        events = throttle.observe([thermal(0, 160.0, mask=0), thermal(1, 160.0, mask=0)], 160.0)
        assert [(e.kind, e.data["duration_seconds"]) for e in events] == [(EventKind.THROTTLE_ENDED, 60.0)]
        assert throttle.clock_event_seconds()[(0, REASON)] == 40.0
        save(memory, throttle, prober, clock)

        memory, throttle, prober = agent_run(store, clock, url)
        assert throttle.clock_event_seconds()[(0, REASON)] == 40.0
        assert throttle.active_since() == {}

        # A reboot: a new boot id starts from nothing.
        _, throttle, _ = agent_run(store, clock, url, boot="boot-b")
        assert throttle.clock_event_seconds() == {}
        assert throttle.active_since() == {}


def observe(throttle: ThrottleWatcher, clock: FakeClock, sample: GpuSample) -> None:
    """The watcher sees `sample` when the boot clock has moved to its time (sample time t is the
    fake clock's monotonic 1000 + t): held and counted time run on that clock."""
    clock.advance(1000.0 + sample.timestamp_seconds - clock.monotonic())
    throttle.observe([sample], sample.timestamp_seconds)


def ten_seconds_of_slowdown_saved(store: Store, clock: FakeClock) -> None:
    """A first run that saw GPU 0 slowed for 10 s, saved to the store."""
    memory, throttle, prober = agent_run(store, clock, refused_url())
    observe(throttle, clock, thermal(0, 0.0))
    observe(throttle, clock, thermal(0, 10.0))
    save(memory, throttle, prober, clock)


def loaded_late(store: Store, clock: FakeClock, *seen: GpuSample) -> ThrottleWatcher:
    """A new run whose throttle watcher observed `seen` (one sample a loop) before the store opened
    and the memory loaded."""
    throttle = ThrottleWatcher(clock=clock.monotonic)
    for sample_seen in seen:
        observe(throttle, clock, sample_seen)
    memory_of(store, xid_watcher(clock), BOOT, throttle).load(store)
    return throttle


def test_another_board_at_the_index_does_not_inherit_the_stored_time(tmp_path: Path) -> None:
    clock = FakeClock()
    with Store.open(tmp_path) as store:
        ten_seconds_of_slowdown_saved(store, clock)
        # The store opens late: this run already watches another board (GPU 2's) at index 0.
        throttle = loaded_late(store, clock, thermal(0, 20.0, uuid_of=2, mask=0))
        assert throttle.clock_event_seconds() == {}
        assert throttle.active_since() == {}


def test_time_counted_before_the_store_opened_adds_to_the_stored_time(tmp_path: Path) -> None:
    clock = FakeClock()
    with Store.open(tmp_path) as store:
        ten_seconds_of_slowdown_saved(store, clock)
        throttle = loaded_late(store, clock, thermal(0, 50.0), thermal(0, 55.0))
        assert throttle.clock_event_seconds()[(0, REASON)] == 15.0
        assert throttle.active_since() == {(0, REASON): 50.0}  # this run saw it start: its own start


def test_a_failing_probe_streak_outlives_a_restart_and_a_declared_outage_is_not_reported_twice(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    url = refused_url()
    with Store.open(tmp_path) as store:
        memory, throttle, prober = agent_run(store, clock, url, after=5)
        for _ in range(3):
            assert not prober.probe_once("sglang").ok
        save(memory, throttle, prober, clock)

        # Restarted mid-outage: two more failures make five, not two.
        memory, throttle, prober = agent_run(store, clock, url, after=5)
        assert [(s.up, s.consecutive_failures) for s in prober.statuses()] == [(None, 3)]
        prober.probe_once("sglang")
        assert prober.take_events() == []
        prober.probe_once("sglang")
        assert [e.kind for e in prober.take_events()] == [EventKind.SERVICE_UNHEALTHY]
        save(memory, throttle, prober, clock)

        # Restarted again: still declared down, and the outage is not a new one.
        memory, throttle, prober = agent_run(store, clock, url, after=5)
        assert [(s.up, s.consecutive_failures) for s in prober.statuses()] == [(False, 5)]
        prober.probe_once("sglang")
        assert prober.take_events() == []
        assert [s.consecutive_failures for s in prober.statuses()] == [6]

        # A reboot: the count starts again.
        _, _, prober = agent_run(store, clock, url, boot="boot-b", after=5)
        assert [(s.up, s.consecutive_failures) for s in prober.statuses()] == [(None, 0)]


def test_written_only_when_changed(tmp_path: Path) -> None:
    clock = FakeClock()
    url = refused_url()
    with Store.open(tmp_path) as store:
        memory, throttle, prober = agent_run(store, clock, url)
        observe(throttle, clock, thermal(0, 0.0))
        observe(throttle, clock, thermal(0, 10.0))
        prober.probe_once("sglang")
        save(memory, throttle, prober, clock)
        db = tmp_path / DB_NAME
        with sqlite3.connect(db) as other:  # rows gone behind the memory's back...
            other.execute("DELETE FROM clock_event_totals")
            other.execute("DELETE FROM probe_streaks")
        other.close()
        save(memory, throttle, prober, clock)  # ...stay gone: nothing changed, nothing written
        assert store.clock_event_totals(BOOT) == [] and store.probe_streaks(BOOT) == []

        observe(throttle, clock, thermal(0, 20.0))
        save(memory, throttle, prober, clock)
        assert [(t.gpu, t.uuid, t.reason, t.seconds) for t in store.clock_event_totals(BOOT)] == [
            (0, UUIDS[0], REASON, 20.0)
        ]
        assert store.probe_streaks(BOOT) == []
        prober.probe_once("sglang")
        save(memory, throttle, prober, clock)
        assert [(s.service, s.up, s.consecutive_failures) for s in store.probe_streaks(BOOT)] == [("sglang", None, 2)]
