"""The host under the agent misbehaving: a full or read-only state dir, a corrupted event store, sysfs
files that vanish, a kernel log that disappears, a wall clock that jumps, an inference service that
flaps. The daemon runs in process on a fake clock (or as a real process where the file handling is
what is tested); the GPUs are simulated. Mounting a tiny tmpfs needs root (and the right to mount):
those tests skip elsewhere."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import free_port, running_agent
from helpers import FakeClock, wait_until
from hosttree import make_host_tree

from agent.backend.sim import REASON_HW_THERMAL, SimulatedBackend
from agent.config import AgentConfig
from agent.daemon import Daemon, LoopTiming
from agent.daemon.sd_notify import SdNotifier
from agent.events import EventKind
from agent.host.paths import HostPaths
from agent.policy.plan import PlanStatus
from agent.rules.config import load_rules
from agent.rules.model import Outcome
from agent.state import NodeSnapshot
from agent.store.database import DB_NAME, Store
from agent.watch.fake_kernel_log import append_kmsg, xid_line
from agent.watch.nvml_events import NvmlEventSource

pytestmark = pytest.mark.real_daemon

INTERVAL_SECONDS = 5.0
XID_RULE = """\
rules:
  - name: xid-note
    match: {xid: {codes: [13, 31, 43]}}
    actions: [{webhook: {url: "http://127.0.0.1:9/never"}}]
    cooldown_seconds: 300
    max_attempts: 10
    window_seconds: 3600
    dry_run: true
"""


@dataclass
class Node:
    daemon: Daemon
    clock: FakeClock
    gpus: SimulatedBackend  # the simulated machine, as another process on the node sees it
    host: HostPaths
    state_dir: Path

    def loop(self, seconds: float = INTERVAL_SECONDS) -> NodeSnapshot:
        self.clock.advance(seconds)
        return self.daemon.loop_once()

    def events(self) -> list[Any]:
        assert self.daemon.live.store is not None
        return [e.event for e in self.daemon.live.store.events()]

    def outcomes(self, rule: str) -> list[Outcome]:
        assert self.daemon.live.store is not None
        return [r.outcome for r in reversed(self.daemon.live.store.remediations()) if r.rule == rule]


@contextlib.contextmanager
def node_at(
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    state_dir: Path | None = None,
    rules: str | None = None,
    services: list[dict[str, Any]] | None = None,
    node_policy: dict[str, Any] | None = None,
    open_store: bool = True,
) -> Iterator[Node]:
    """An in-process daemon with its event store and rules; the simulated GPUs keep their state
    outside `state_dir`, so a full or read-only state dir hits the agent, not the GPUs."""
    state_dir = state_dir or tmp / "state"
    gpu_dir = tmp / "gpus"
    rules_dir = tmp / "rules.d"
    rules_dir.mkdir(mode=0o755)
    if rules:
        (rules_dir / "10-test.yaml").write_text(rules)
        os.chmod(rules_dir / "10-test.yaml", 0o644)
    config = AgentConfig.model_validate(
        {
            "mode": "enforce",
            "backend": "simulated",
            "simulated": {"profile": "h200x2"},
            "host_root": str(tmp / "host"),
            "state_dir": str(state_dir),
            "interval_seconds": INTERVAL_SECONDS,
            "policy_interval_seconds": 60,
            "api": {"socket": str(tmp / "agent.sock")},
            "metrics": {"listen": f"127.0.0.1:{free_port()}"},
            "services": services or [],
            "remediation": {"rules_dir": str(rules_dir)},
            "policy": {
                "node": node_policy or {},
                "gpus": [{"match": {"model": "NVIDIA H200*"}, "power_limit_watts": 600}],
            },
        }
    )
    host = make_host_tree(tmp / "host")
    boot_id = host.path("/proc/sys/kernel/random/boot_id")
    boot_id.parent.mkdir(parents=True, exist_ok=True)
    boot_id.write_text("5b1e6a2c-0000-4000-8000-000000000001\n")

    def open_sim(config: AgentConfig) -> SimulatedBackend:
        backend = SimulatedBackend("h200x2", gpu_dir, writable_items=config.writable_items())
        backend.init()
        return backend

    monkeypatch.setattr("agent.daemon.session.open_backend", open_sim)
    monkeypatch.setattr(
        "agent.daemon.session.NvmlEventSource", partial(NvmlEventSource, timeout_seconds=0.02, backoff_seconds=0.02)
    )
    clock = FakeClock()
    daemon = Daemon(
        config,
        None,
        notifier=SdNotifier(None, None),
        timing=LoopTiming(call_timeout_seconds=1.0),
        clock=clock,
        boottime=clock.monotonic,
    )
    daemon.remediator.rules = load_rules([rules_dir])
    if open_store:
        daemon.live.store_opened(Store.open(state_dir))
    gpus = SimulatedBackend("h200x2", gpu_dir, writable_items=config.writable_items())
    gpus.init()
    try:
        yield Node(daemon, clock, gpus, host, state_dir)
    finally:
        daemon.shutdown()
        if daemon.live.store is not None:
            daemon.live.store.close()


def wait_for(node: Node, predicate: Any, what: str, timeout_seconds: float = 5.0) -> NodeSnapshot:
    """Loop until `predicate(snapshot)`: events from the NVML thread arrive between loops."""

    def looped() -> NodeSnapshot | None:
        snapshot = node.loop()
        return snapshot if predicate(snapshot) else None

    return wait_until(looped, timeout_seconds, what, poll_seconds=0.02)


def xid_keys(node: Node) -> list[str]:
    return [e.key for e in node.events() if e.kind is EventKind.XID]


# -- a full or read-only state dir ------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(directory: Path, size: str) -> Iterator[Path]:
    directory.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (no CAP_SYS_ADMIN?)")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    with contextlib.suppress(OSError), open(filler, "wb") as handle:
        while True:
            handle.write(b"\0" * 4096)
            handle.flush()
    return filler


def test_state_dir_full_keeps_the_loop_and_loses_no_event(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        tmpfs(tmp_path / "state", "1m") as state,
        node_at(tmp_path, monkeypatch, state_dir=state, rules=XID_RULE) as node,
    ):
        wait_for(node, lambda s: len(s.gpus) == 2, "first collection")
        filler = fill(state)
        for xid in (13, 31, 43):  # each its own event: Xids are keyed by their time
            node.gpus.inject_xid(0, xid)
            wait_for(node, lambda s, xid=xid: any(e.data.get("xid") == xid for e in s.recent_events), f"Xid {xid}")
        for _ in range(3):
            snapshot = node.loop()
        remediation = next(c for c in snapshot.collectors if c.name == "remediation")
        stored_while_full = len(xid_keys(node))
        assert remediation.success or stored_while_full < 3, "a full disk either fails the store or is not hit"
        if not remediation.success:
            assert "full" in remediation.last_error or "disk" in remediation.last_error, remediation.last_error
        filler.unlink()
        wait_for(node, lambda s: len(xid_keys(node)) == 3, "the Xids stored once there is room")
        snapshot = node.loop()  # a snapshot shows the remediation step of the loop before it
        assert next(c for c in snapshot.collectors if c.name == "remediation").success
        assert len(set(xid_keys(node))) == 3  # each once
        # the rule saw every one: the first decided on, the others within its cooldown
        assert sorted(node.outcomes("xid-note")) == sorted([Outcome.DRY_RUN, Outcome.SUPPRESSED, Outcome.SUPPRESSED])


def test_read_only_state_dir_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.daemon.remediator.STORE_RETRY_SECONDS", 0.05)
    with tmpfs(tmp_path / "state", "4m") as state:
        subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True)
        with node_at(tmp_path, monkeypatch, state_dir=state, rules=XID_RULE, open_store=False) as node:
            daemon = node.daemon
            # The real start: the store cannot be opened on a read-only file system. (Going read-only while
            # the database is open cannot be staged: a remount fails while files are open for writing; a
            # write failing mid-run is the full-disk test above.)
            daemon.start_services()
            assert daemon.live.store is None
            node.gpus.inject_xid(1, 13)
            snapshot = wait_for(node, lambda s: any(e.data.get("xid") == 13 for e in s.recent_events), "Xid 13")
            assert not next(c for c in snapshot.collectors if c.name == "remediation").success
            subprocess.run(["mount", "-o", "remount,rw", str(state)], check=True)
            time.sleep(0.06)
            wait_for(node, lambda s: daemon.live.store is not None and len(xid_keys(node)) == 1, "store opened later")
            assert node.outcomes("xid-note") == [Outcome.DRY_RUN]  # the event from the read-only time, kept


# -- a corrupted event store ------------------------------------------------------------------------


def test_corrupted_database_is_kept_aside_and_recreated(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    garbage = b"this is not an SQLite database\n" * 100
    (state / DB_NAME).write_bytes(garbage)
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        kept = list(state.glob(f"{DB_NAME}.corrupt-*"))
        assert len(kept) == 1 and kept[0].read_bytes() == garbage, "the bad file is kept for a post-mortem"
        records = [json.loads(line) for line in agent.log().splitlines() if line.startswith("{")]
        assert any("kept aside" in r["event"] and r["level"] == "error" for r in records), agent.log()
        gpus = SimulatedBackend("h200x2", agent.state_dir)
        gpus.inject_xid(0, 13)

        def xid_listed() -> bool:
            listed = subprocess.run(
                [sys.executable, "-m", "agent.cli", "events", "--json", "--config", str(agent.config_path)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert listed.returncode == 0, listed.stderr
            return any(e["kind"] == "xid" for e in json.loads(listed.stdout)["events"])

        wait_until(xid_listed, 15, "an event in the new database", poll_seconds=0.2)


# -- sysfs files that go missing --------------------------------------------------------------------


def test_a_missing_sysfs_file_is_reported_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = {"transparent_hugepages": {"enabled": "never", "defrag": "never"}, "nouveau": "blacklisted"}
    with node_at(tmp_path, monkeypatch, node_policy=policy) as node:
        node.loop()  # plans drift and applies it; the snapshot shows the plan
        snapshot = node.loop(60)
        items = {p.item: p for p in snapshot.policy if p.gpu is None}
        assert items["transparent_hugepages"].status is PlanStatus.IN_SYNC
        enabled = node.host.path("/sys/kernel/mm/transparent_hugepage/enabled")
        enabled.unlink()
        node.host.path("/proc/modules").unlink()
        snapshot = node.loop(60)
        items = {p.item: p for p in snapshot.policy if p.gpu is None}
        thp = items["transparent_hugepages"]
        assert thp.status is PlanStatus.NOT_APPLICABLE and "is missing" in thp.detail
        assert items["nouveau"].status in (PlanStatus.IN_SYNC, PlanStatus.ERROR, PlanStatus.DRIFT)
        assert all(p.status is PlanStatus.IN_SYNC for p in snapshot.policy if p.gpu is not None)
        assert len(snapshot.gpus) == 2 and not snapshot.stale_gpus
        # the file is back (a module reloaded): the next policy pass enforces it again
        enabled.write_text("[always] madvise never\n")
        node.loop(60)
        snapshot = node.loop(60)
        thp = next(p for p in snapshot.policy if p.item == "transparent_hugepages")
        assert thp.status is PlanStatus.IN_SYNC
        assert enabled.read_text().strip() == "never"  # written (a plain file here, not the kernel's)


# -- a kernel log that disappears -----------------------------------------------------------------


def test_a_kernel_log_that_disappears_and_comes_back(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        host = HostPaths.at(agent.host_root)
        gpus = SimulatedBackend("h200x2", agent.state_dir)
        gpus.init()
        bus = [gpus.identity(gpu).pci_bus_id for gpu in (0, 1)]

        def xids() -> set[tuple[int, int]]:
            return {(x["gpu"], x["xid"]) for x in agent.status()["xids"]}

        append_kmsg(host, xid_line(bus[0], 13))
        wait_until(lambda: (0, 13) in xids(), 15, "the first Xid", poll_seconds=0.1)
        host.path("/dev/kmsg").unlink()  # log rotated away, a container's /dev/kmsg unmounted
        time.sleep(0.5)
        assert agent.process.poll() is None
        append_kmsg(host, xid_line(bus[1], 31))  # a new log at the same path
        wait_until(lambda: (1, 31) in xids(), 15, "an Xid from the new log", poll_seconds=0.1)
        kmsg = next(c for c in agent.status()["collectors"] if c["name"] == "kmsg")
        assert kmsg["success"], kmsg
        host.path("/dev/kmsg").unlink()  # and gone for good: the agent keeps running
        time.sleep(0.5)
        assert agent.process.poll() is None
        assert xids() == {(0, 13), (1, 31)}


# -- the wall clock jumps ---------------------------------------------------------------------------


def test_wall_clock_jumps_break_neither_the_loop_nor_cooldowns_nor_throttle_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with node_at(tmp_path, monkeypatch, rules=XID_RULE) as node:
        node.gpus.set_clock_event_reasons(1, REASON_HW_THERMAL)
        before = node.loop()
        node.gpus.inject_xid(0, 13)
        wait_for(node, lambda s: node.outcomes("xid-note") == [Outcome.DRY_RUN], "the first decision")
        thermal_before = node.loop().clock_event_seconds[(1, "hw_thermal_slowdown")]
        assert before.throttle_active_since

        node.clock.step_wall(-3600)  # NTP steps the clock back an hour
        node.gpus.set_power_limit_watts(0, 650)  # drift right after the step
        node.gpus.add_ecc_errors(1, corrected=5)
        snapshot = node.loop(0)
        assert node.gpus.power_limit_watts(0) == 600.0, "policy pass skipped after a backwards step"
        assert snapshot.gpus[1].ecc_corrected_volatile == 5, "slow tier not read after a backwards step"
        assert snapshot.clock_event_seconds[(1, "hw_thermal_slowdown")] >= thermal_before
        node.gpus.inject_xid(0, 31)
        # A step back by more than the cooldown does not skip it: only time really elapsed counts.
        wait_for(node, lambda s: len(node.outcomes("xid-note")) == 2, "a decision after the step")
        assert sorted(node.outcomes("xid-note")) == [Outcome.DRY_RUN, Outcome.SUPPRESSED]
        assert node.daemon.live.store is not None
        suppressed = [r for r in node.daemon.live.store.remediations() if r.outcome is Outcome.SUPPRESSED]
        assert suppressed[0].reason.startswith("cooldown: ")

        node.clock.advance(300)  # the cooldown really elapses
        node.clock.step_wall(86400)  # and the clock jumps a day forward
        for _ in range(3):
            snapshot = node.loop()
        assert snapshot.clock_event_seconds[(1, "hw_thermal_slowdown")] >= thermal_before
        assert (1, "hw_thermal_slowdown") in snapshot.throttle_active_since
        node.gpus.inject_xid(0, 43)
        wait_for(node, lambda s: len(node.outcomes("xid-note")) == 3, "a decision after the forward jump")
        assert node.outcomes("xid-note")[0] is Outcome.DRY_RUN  # the newest: the cooldown has really elapsed
        assert node.outcomes("xid-note").count(Outcome.DRY_RUN) == 2


# -- an inference service that flaps ----------------------------------------------------------------


class Health:
    def __init__(self) -> None:
        self.up = True
        server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}/health"
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if health.up else 503)
                self.end_headers()
                self.wfile.write(b"ok" if health.up else b"loading")

            def log_message(self, *args: object) -> None:
                pass

        return Handler


FLAP_RULE = """\
rules:
  - name: restart-on-flap
    match: {service_unhealthy: {probes: 3}}
    actions: [restart_service]
    cooldown_seconds: 60
    max_attempts: 3
    window_seconds: 3600
    dry_run: true
"""


def test_a_flapping_service_is_neither_a_storm_nor_a_lost_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    health = Health()
    service = {"name": "sglang", "health_url": health.url, "unhealthy_after_probes": 3, "probe_timeout_seconds": 2}
    cycles = 12
    try:
        with node_at(tmp_path, monkeypatch, rules=FLAP_RULE, services=[service]) as node:
            prober = node.daemon.live.prober
            for _ in range(cycles):
                for up in (False, False, False, True):  # down long enough to count, then up for a probe
                    health.up = up
                    prober.probe_once("sglang")
                    node.loop()
            kinds = [e.kind for e in node.events() if e.source == "probe"]  # not the faults rules synthesize
            assert kinds.count(EventKind.SERVICE_UNHEALTHY) == cycles
            assert kinds.count(EventKind.SERVICE_HEALTHY) == cycles
            outcomes = node.outcomes("restart-on-flap")
            assert outcomes.count(Outcome.DRY_RUN) <= 3, outcomes  # max_attempts holds across the flapping
            assert Outcome.DRY_RUN in outcomes
            status = node.loop().services[0]
            assert status.up is True and status.consecutive_failures == 0
    finally:
        health.server.shutdown()
