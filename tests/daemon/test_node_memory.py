"""Node memory on a real SQLite store: the GPU inventory of this boot, Xid counters and the health
window outliving a restart, acknowledgement, a new boot, the schema migration, pruning while running."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace

from helpers import FakeClock, make_event

from agent.backend.base import GpuIdentity
from agent.backend.errors import GpuErrorKind
from agent.daemon.node_memory import PRUNE_EVERY_SECONDS, NodeMemory
from agent.events import EventKind, HealthState
from agent.host.paths import HostPaths
from agent.node_memory.inventory import MISSING_READ_ERROR, UNKNOWN_BOOT, read_boot_id
from agent.services.prober import HealthProber
from agent.state import GpuSample, NodeSnapshot, XidCount
from agent.store.database import DB_NAME, RETENTION_SECONDS, InventoryGpu, Store
from agent.store.schema import MIGRATIONS
from agent.verdict import expected_gpu_count
from agent.watch.gpu_lost import GpuLostWatcher
from agent.watch.kernel_log import KernelXid
from agent.watch.throttle import ThrottleWatcher
from agent.watch.xid import XidWatcher

BOOT = "boot-a"
UUIDS = ("GPU-aaaaaaaa-0000", "GPU-bbbbbbbb-0001", "GPU-cccccccc-0002")
BUSES = ("00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0")


def sample(index: int, uuid_of: int | None = None, up: bool = True, at: float = 0.0) -> GpuSample:
    which = index if uuid_of is None else uuid_of
    return GpuSample(index, UUIDS[which], "NVIDIA H200", BUSES[which], up=up, timestamp_seconds=at)


def identities(count: int) -> dict[int, GpuIdentity]:
    return {i: GpuIdentity(i, UUIDS[i], "NVIDIA H200", BUSES[i], "", "", i) for i in range(count)}


def xid_watcher(clock: FakeClock, gpus: int = 2) -> XidWatcher:
    known = identities(gpus)
    return XidWatcher(lambda: known, clock=clock, window_clock=clock.monotonic)


def kernel_xid(xid: int, gpu: int) -> KernelXid:
    return KernelXid(
        xid=xid,
        pci_bus_id=BUSES[gpu],
        pid=None,
        process=None,
        text="",
        nvlink=None,
        recovery_action=None,
        fallen_off_bus=False,
        timestamp_seconds=None,
        raw="",
    )


def memory_of(
    store: Store | None,
    xid: XidWatcher,
    boot: str = BOOT,
    throttle: ThrottleWatcher | None = None,
    prober: HealthProber | None = None,
) -> NodeMemory:
    """The daemon's node memory over what it reads of the live parts (agent/daemon/live.py): the
    store, the boot, a fresh collector's identities, the Xid and throttle watchers, the prober."""
    live = SimpleNamespace(
        store=store,
        memory_boot_id=boot,
        collector=SimpleNamespace(identities={}),
        watchers=SimpleNamespace(xid=xid, throttle=throttle or ThrottleWatcher()),
        prober=prober or HealthProber([]),
    )
    return NodeMemory(live=live)


def started(
    store: Store, clock: FakeClock, boot: str = BOOT, gpus: int = 2
) -> tuple[NodeMemory, XidWatcher, dict[int, GpuIdentity]]:
    """A daemon start: its memory loaded into a fresh collector's identities and Xid watcher."""
    watcher = xid_watcher(clock, gpus)
    memory = memory_of(store, watcher, boot)
    memory.load(store)
    return memory, watcher, memory.live.collector.identities


def test_a_gpu_that_leaves_stays_as_lost_until_acknowledged_and_is_expected_again_when_back(tmp_path: Path) -> None:
    clock = FakeClock()
    with Store.open(tmp_path) as store:
        memory, _, _ = started(store, clock, gpus=3)
        assert [s.uuid for s in memory.remember([sample(0), sample(1), sample(2)], clock())] == list(UUIDS)
        clock.advance(30)
        # GPU 1 leaves the bus and NVML renumbers: GPU 2 answers at index 1 now.
        samples = memory.remember([sample(0), sample(1, uuid_of=2)], clock())
        missing = samples[-1]
        assert (missing.uuid, missing.up, missing.index) == (UUIDS[1], False, 2)
        assert missing.read_errors == {MISSING_READ_ERROR: GpuErrorKind.GPU_LOST.value}
        lost_watcher = GpuLostWatcher()  # judged like any lost GPU: an event, unhealthy
        assert [e.kind for e in lost_watcher.observe(samples, clock())] == [EventKind.GPU_LOST]
        assert lost_watcher.health(2).state is HealthState.UNHEALTHY
        snapshot = NodeSnapshot(clock(), clock(), "v", "simulated", None, tuple(samples))
        assert expected_gpu_count(snapshot) == 3
        # "ack all" names every GPU but forgets only the missing one
        assert store.acknowledge_gone("all") == [UUIDS[1]]
        assert store.acknowledge_gone(f"gpu:{UUIDS[1]}") == []  # already acknowledged
        assert store.acknowledge_gone("some-rule") == []
        samples = memory.remember([sample(0), sample(1, uuid_of=2)], clock())
        assert [s.uuid for s in samples] == [UUIDS[0], UUIDS[2]]
        # it answers again: expected again, acknowledgement lifted
        samples = memory.remember([sample(0), sample(1, uuid_of=2), sample(2, uuid_of=1)], clock())
        assert len(samples) == 3
        assert not any(gpu.acked for gpu in store.inventory(BOOT))


def test_a_lost_gpu_nvml_still_counts_keeps_its_identity_across_a_restart_and_ack_drops_it(tmp_path: Path) -> None:
    clock = FakeClock()
    with Store.open(tmp_path) as store:
        memory, _, _ = started(store, clock)
        memory.remember([sample(0), sample(1)], clock())
        lost = GpuSample(1, UUIDS[1], "NVIDIA H200", BUSES[1], False, clock(), read_errors={"identity": "gpu_lost"})
        memory.remember([sample(0), lost], clock())
        first_seen = store.inventory(BOOT)[1].first_seen_seconds
        # restart: the collector starts with the remembered identities, so the lost GPU is sampled
        clock.advance(120)
        memory, _, seeded = started(store, clock)
        assert seeded == {
            0: GpuIdentity(0, UUIDS[0], "NVIDIA H200", BUSES[0], "", "", -1),
            1: GpuIdentity(1, UUIDS[1], "NVIDIA H200", BUSES[1], "", "", -1),
        }
        assert [s.up for s in memory.remember([sample(0), lost], clock())] == [True, False]
        gpu1 = store.inventory(BOOT)[1]
        assert (gpu1.present, gpu1.first_seen_seconds) == (False, first_seen)
        assert store.acknowledge_gone("gpu:1") == [UUIDS[1]]
        assert [s.index for s in memory.remember([sample(0), lost], clock())] == [0]
        memory, _, seeded = started(store, clock)
        assert list(seeded) == [0]


def test_xid_counters_last_seen_and_health_window_outlive_a_restart_not_a_reboot(tmp_path: Path) -> None:
    clock = FakeClock()
    with Store.open(tmp_path) as store:
        memory, watcher, _ = started(store, clock)
        watcher.ingest_kernel(kernel_xid(48, 1))
        clock.advance(60)
        watcher.ingest_kernel(kernel_xid(48, 1))
        watcher.ingest_kernel(kernel_xid(13, 0))
        memory.save(clock())
        counts, health = watcher.counts(), watcher.health(1)
        assert [(c.gpu, c.xid, c.count) for c in counts] == [(0, 13, 1), (1, 48, 2)]
        assert health.state is HealthState.UNHEALTHY

        clock.advance(5)
        memory, restarted, _ = started(store, clock)
        assert restarted.counts() == counts
        assert restarted.health(1) == health
        restarted.ingest_kernel(kernel_xid(48, 1))  # counting goes on from where it was
        memory.save(clock())
        assert [(c.xid, c.count) for c in restarted.counts() if c.gpu == 1] == [(48, 3)]
        restarted.clear(1)  # a GPU reset ends its Xid health; the counters stay
        memory.save(clock())
        assert [m.gpu for m in store.xid_marks(BOOT)] == [0]

        _, rebooted, seeded = started(store, clock, boot="boot-b")
        assert rebooted.counts() == [] and seeded == {}
        assert rebooted.health(1).state is HealthState.HEALTHY
        assert store.inventory(BOOT) == [] and store.xid_counts(BOOT) == []


def test_the_loop_reads_the_inventory_and_xid_marks_again_only_after_another_process_wrote(tmp_path: Path) -> None:
    """Every loop used to SELECT both; now only after a change: `gpu-agent ack` (its own connection)
    is still followed on the next loop."""
    clock = FakeClock()
    with Store.open(tmp_path) as store, Store.open(tmp_path) as cli:
        memory, watcher, _ = started(store, clock, gpus=3)
        watcher.ingest_kernel(kernel_xid(48, 1))
        memory.save(clock())
        memory.follow_acks()
        memory.remember([sample(0), sample(1), sample(2)], clock())
        memory.remember([sample(0), sample(1)], clock())  # GPU 2 leaves the bus
        memory.remember([sample(0), sample(1)], clock())  # read back once after its own write
        statements: list[str] = []
        store._db.set_trace_callback(statements.append)
        for _ in range(5):
            clock.advance(1)
            memory.follow_acks()
            assert [s.up for s in memory.remember([sample(0), sample(1)], clock())] == [True, True, False]
            memory.save(clock())
        assert [s for s in statements if "FROM gpu_inventory" in s or "FROM xid_marks" in s] == []

        assert cli.acknowledge_gone("all") == [UUIDS[2]]
        assert [m.xid for m in cli.clear_xid_marks(BOOT, 1)] == [48]
        memory.follow_acks()
        assert watcher.health(1).state is HealthState.HEALTHY
        assert [s.index for s in memory.remember([sample(0), sample(1)], clock())] == [0, 1]


def test_an_xid_of_an_unknown_gpu_is_remembered_too(tmp_path: Path) -> None:
    clock = FakeClock()
    with Store.open(tmp_path) as store:
        store.save_xid_counts(BOOT, [XidCount(None, "", 79, 2, clock())])
        assert store.xid_counts(BOOT) == [XidCount(None, "", 79, 2, clock())]


def test_the_store_is_pruned_while_the_daemon_runs(tmp_path: Path) -> None:
    clock = FakeClock()
    with Store.open(tmp_path, now_seconds=clock()) as store:
        memory, _, _ = started(store, clock)
        memory.save(clock())  # the first save prunes: nothing old yet
        store.record_event(make_event(EventKind.XID, 0, key="old", timestamp_seconds=clock()))
        clock.advance(RETENTION_SECONDS + 60)
        memory.save(clock())
        assert store.events() == []
        store.record_event(make_event(EventKind.XID, 0, key="new", timestamp_seconds=clock() - RETENTION_SECONDS - 1))
        clock.advance(PRUNE_EVERY_SECONDS - 1)
        memory.save(clock())
        assert [e.event.key for e in store.events()] == ["new"]  # not yet: pruned hourly
        clock.advance(1)
        memory.save(clock())
        assert store.events() == []


def test_a_database_of_the_first_schema_opens_with_its_history(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / DB_NAME) as old:
        for statement in MIGRATIONS[0]:
            old.execute(statement)
        old.execute("INSERT INTO acks (ts, selector, reset) VALUES (1.0, 'all', 0)")
        old.execute("PRAGMA user_version = 1")
    with Store.open(tmp_path, now_seconds=2.0) as store:
        store.remember_gpus(BOOT, [InventoryGpu(UUIDS[0], BUSES[0], "NVIDIA H200", 0, 1.0, 2.0)])
        assert [gpu.uuid for gpu in store.inventory(BOOT)] == [UUIDS[0]]
    with sqlite3.connect(tmp_path / DB_NAME) as reopened:
        assert reopened.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        assert reopened.execute("SELECT selector FROM acks").fetchall() == [("all",)]


def test_boot_id_read_under_host_root(tmp_path: Path) -> None:
    paths = HostPaths.at(tmp_path)
    assert read_boot_id(paths) == UNKNOWN_BOOT
    target = paths.path("/proc/sys/kernel/random/boot_id")
    target.parent.mkdir(parents=True)
    target.write_text("5a7e0c1d-1111-4222-8333-944455556666\n")
    assert read_boot_id(paths) == "5a7e0c1d-1111-4222-8333-944455556666"


def test_without_a_store_samples_pass_through(tmp_path: Path) -> None:
    memory = memory_of(None, xid_watcher(FakeClock()))
    samples = [sample(0)]
    assert memory.remember(samples, 0.0) == samples and memory.live.collector.identities == {}


def test_faults_counted_before_the_store_opened_add_to_the_stored_counts(tmp_path: Path) -> None:
    clock = FakeClock()
    with Store.open(tmp_path) as store:
        memory, watcher, _ = started(store, clock)
        watcher.ingest_kernel(kernel_xid(48, 1))
        memory.save(clock())
        clock.advance(30)
        restarted = xid_watcher(clock)
        late = memory_of(store, restarted)
        restarted.ingest_kernel(kernel_xid(48, 1))  # seen while the store could not be opened yet
        late.load(store)
        [count] = restarted.counts()
        assert (count.count, count.last_seen_seconds) == (2, clock())
