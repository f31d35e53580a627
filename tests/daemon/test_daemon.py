"""`gpu-agent run` as systemd runs it: a real process, a real notify socket, signals, the socket API."""

from __future__ import annotations

import itertools
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from daemon_harness import running_agent, write_agent_config
from helpers import wait_until

from agent import api
from agent.backend.base import ClockDomain
from agent.backend.sim import SimulatedBackend
from agent.config import load_config
from agent.daemon import Daemon, LoopTiming
from agent.daemon.node_memory import NodeMemory
from agent.daemon.sd_notify import SdNotifier
from agent.events import EventKind, Severity
from agent.watch.fake_kernel_log import append_kmsg, xid_line

pytestmark = pytest.mark.real_daemon

#: How long a test waits for the agent to do what it is asked.
WAIT_SECONDS = 10.0


def sim(state_dir: Path, profile: str = "h200x2") -> SimulatedBackend:
    backend = SimulatedBackend(profile, state_dir)
    backend.init()
    return backend


def test_ready_status_watchdog_and_stopping(tmp_path: Path) -> None:
    with running_agent(tmp_path, watchdog_usec=1_000_000) as agent:
        ready = agent.notifications.wait_for("READY", "1")
        assert "2 GPUs" in ready["STATUS"]
        agent.notifications.poll(2.5)
        pings = agent.notifications.times("WATCHDOG")
        # WATCHDOG_USEC=1 s: a ping every 0.5 s while the loop is healthy
        assert len(pings) >= 4, agent.notifications.received
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert max(gaps) < 0.9
        assert any("STATUS" in f and "policy" in f["STATUS"] for _, f in agent.notifications.received[1:])
        agent.signal(signal.SIGTERM)
        assert agent.process.wait(timeout=15) == 0
        agent.notifications.poll(0.5)
        assert agent.notifications.times("STOPPING")


def test_policy_enforced_by_the_loop_and_status_over_the_socket(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        backend = sim(agent.state_dir)
        wait_until(lambda: backend.power_limit_watts(0) == 600.0, WAIT_SECONDS, "power limit enforced")
        status = agent.status()
        assert status["source"] == "daemon"
        assert status["uptime_seconds"] >= 0
        assert [g["index"] for g in status["gpus"]] == [0, 1]
        assert status["gpus"][0]["health"]["state"] == "healthy"
        # drift behind the agent's back is corrected on the next policy pass and reported
        assert "gpu_agent_policy_targets" in agent.metrics()


def test_xid_from_nvml_and_kernel_log_is_one_event(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        backend = sim(agent.state_dir)
        bus_id = backend.identity(1).pci_bus_id
        from agent.host.paths import HostPaths

        backend.inject_xid(1, 79)
        append_kmsg(HostPaths.at(agent.host_root), xid_line(bus_id, 79))

        def both_sources_seen() -> bool:
            events = [e for e in agent.status()["recent_events"] if e["kind"] == "xid"]
            return bool(events) and len(events[0]["data"]["sources"]) == 2

        wait_until(both_sources_seen, WAIT_SECONDS, "the Xid seen by NVML and the kernel log")
        status = agent.status()
        assert len(status["xids"]) == 1 and status["xids"][0]["count"] == 1
        assert status["xids"][0]["gpu"] == 1 and status["xids"][0]["xid"] == 79
        gpu1 = status["gpus"][1]["health"]
        assert gpu1["state"] == "unhealthy" and gpu1["suggested_action"] == "reboot"
        xid_events = [e for e in status["recent_events"] if e["kind"] == "xid"]
        assert len(xid_events) == 1
        assert sorted(xid_events[0]["data"]["sources"]) == ["kmsg", "nvml"]
        assert 'gpu_agent_xid_errors_total{gpu="1"' in agent.metrics()


def test_sighup_with_a_broken_config_keeps_the_old_one(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        agent.notifications.wait_for("READY", "1")
        good = agent.config_path.read_text()
        agent.config_path.write_text(good + "bogus_key: 1\n")
        agent.signal(signal.SIGHUP)
        wait_until(lambda: "config reload failed" in agent.log(), WAIT_SECONDS, "reload failure logged")
        assert "bogus_key: unknown key" in agent.log()
        agent.notifications.poll(0.5)
        statuses = [f["STATUS"] for _, f in agent.notifications.received if "STATUS" in f]
        assert any(s.startswith("config reload failed") and "bogus_key" in s for s in statuses)
        assert agent.process.poll() is None
        assert api.call(agent.socket_path, "status")["source"] == "daemon"
        # a valid change is taken: observe mode from now on (and the power limit is left alone)
        agent.config_path.write_text(good.replace("mode: enforce", "mode: observe"))
        agent.signal(signal.SIGHUP)
        wait_until(lambda: "config reloaded" in agent.log(), WAIT_SECONDS, "reload")
        wait_until(lambda: sim(agent.state_dir).power_limit_watts(0) == 600.0, WAIT_SECONDS, "enforced before")
        operator = SimulatedBackend("h200x2", agent.state_dir, writable_items=["power_limit"])
        operator.init()
        operator.set_power_limit_watts(0, 650)
        time.sleep(1.0)  # five loops: in enforce mode this would have been put back to 600 W
        assert sim(agent.state_dir).power_limit_watts(0) == 650.0
        drift = [i for i in agent.status()["policy"]["items"] if i["item"] == "power_limit" and i["gpu"] == 0]
        assert drift and drift[0]["mode"] == "observe"


def test_a_hung_nvml_call_marks_the_gpu_stale_without_blocking(tmp_path: Path) -> None:
    with running_agent(tmp_path, watchdog_usec=1_000_000) as agent:
        agent.notifications.wait_for("READY", "1")
        backend = sim(agent.state_dir)
        backend.hang_call(0, "temperature_celsius", 20.0)
        wait_until(lambda: 0 in [g["index"] for g in agent.status()["gpus"] if g["stale"]], WAIT_SECONDS, "GPU 0 stale")
        started = time.monotonic()
        text = agent.metrics()
        assert time.monotonic() - started < 1.0
        assert 'gpu_agent_gpu_stale{gpu="0"' in text
        before = len(agent.notifications.times("WATCHDOG"))
        agent.notifications.poll(1.5)
        assert len(agent.notifications.times("WATCHDOG")) >= before + 2  # the loop is still healthy
        status = agent.status()
        assert status["gpus"][1]["stale"] is False
        backend.hang_call(0, "temperature_celsius", None)


def test_fans_return_to_automatic_on_sigterm(tmp_path: Path) -> None:
    with running_agent(tmp_path, profile="rtx-pro-6000") as agent:
        agent.notifications.wait_for("READY", "1")
        backend = sim(agent.state_dir, "rtx-pro-6000")
        wait_until(lambda: backend.fan_manual(0, 0), WAIT_SECONDS, "fan curve applied")
        agent.signal(signal.SIGTERM)
        assert agent.process.wait(timeout=15) == 0
        backend.reload()
        assert not backend.fan_manual(0, 0) and not backend.fan_manual(0, 1)
        assert backend.locked_clocks_mhz(0, ClockDomain.GRAPHICS) is None


def test_a_stuck_loop_stops_the_watchdog_pings(tmp_path: Path) -> None:
    config_path, _ = write_agent_config(tmp_path)
    config = load_config(config_path)
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(tmp_path / "notify.sock"))
    receiver.settimeout(0.2)
    notifier = SdNotifier(str(tmp_path / "notify.sock"), watchdog_usec=400_000)
    daemon = Daemon(config, config_path, notifier=notifier, timing=LoopTiming(call_timeout_seconds=0.5, stall_loops=2))
    release = threading.Event()
    loops = 0

    def hook() -> None:
        nonlocal loops
        loops += 1
        if loops == 5:
            release.wait(30)  # the loop wedges here, as a deadlock would

    daemon.loop_hook = hook
    thread = threading.Thread(target=daemon.run)
    thread.start()
    try:
        pings: list[float] = []
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            try:
                data = receiver.recv(4096)
            except TimeoutError:
                continue
            if b"WATCHDOG=1" in data:
                pings.append(time.monotonic())
        assert loops == 5
        assert pings, "no pings at all"
        # stall limit = 2 loops x 0.2 s + 0.5 s: pings stop soon after the loop wedged, well before the end
        assert deadline - pings[-1] > 3.0
    finally:
        release.set()
        daemon.live.stop_requested.set()
        thread.join(15)
        receiver.close()
    assert not thread.is_alive()


def test_the_node_memory_is_loaded_once_when_the_store_opens_not_every_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store opens at start and the node memory goes into the watchers then, before the first
    loop; the loops that follow only follow acks and save what changed."""
    loaded = []
    load = NodeMemory.load

    def counted(memory: NodeMemory, store: object) -> None:
        loaded.append(store)
        load(memory, store)  # type: ignore[arg-type]

    monkeypatch.setattr(NodeMemory, "load", counted)
    config_path, _ = write_agent_config(tmp_path)
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    try:
        daemon.start_services()
        assert daemon.live.store is not None and loaded == [daemon.live.store]
        for _loop in range(3):
            daemon.loop_once()
        assert loaded == [daemon.live.store]
    finally:
        daemon.shutdown()


def test_the_fan_curve_following_the_temperature_is_not_drift(tmp_path: Path) -> None:
    """The agent's own curve steps raise no drift; someone putting the fans back on automatic does."""
    policy = '  gpus:\n    - match: {model: "NVIDIA RTX PRO 6000*"}\n      fan_curve: [[30, 30], [50, 65], [75, 100]]\n'
    config_path, _ = write_agent_config(tmp_path, profile="rtx-pro-6000", policy=policy)
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    gpus = sim(tmp_path / "state", "rtx-pro-6000")
    try:
        gpus.set_temperature(0, 40)
        drift = [e for e in daemon.loop_once().recent_events if e.kind is EventKind.POLICY_DRIFT]
        # taking the fans from the vBIOS is the one drift at start
        assert [(e.data["item"], e.severity) for e in drift] == [("fan_curve", Severity.INFO)]
        speeds = []
        for celsius in (60, 70, 45, 35):
            gpus.set_temperature(0, celsius)
            snapshot = daemon.loop_once()
            speeds.append(gpus.fan_speed_percent(0, 0))
        assert speeds == [79, 93, 56, 39]  # the agent moved the fans along the curve, four times
        assert [e for e in snapshot.recent_events if e.kind is EventKind.POLICY_DRIFT] == drift
        operator = SimulatedBackend("rtx-pro-6000", tmp_path / "state", writable_items=["fan_curve"])
        operator.init()
        operator.set_fan_automatic(0, 0)
        events = [e for e in daemon.loop_once().recent_events if e.kind is EventKind.POLICY_DRIFT]
        assert [(e.severity, e.data["reappeared"]) for e in events[1:]] == [(Severity.WARNING, 1)]
        assert "came back 1 time" in events[-1].message
    finally:
        daemon.shutdown()


def test_a_simulated_node_shows_activity_and_growing_counters(tmp_path: Path) -> None:
    """The node's counters run with time, as a GPU's do: GPM activity from the second loop on,
    following a load injected by another process, and the energy counter growing."""
    with running_agent(tmp_path, mode="observe") as agent:
        agent.notifications.wait_for("READY", "1")
        load = ["inject", "processes", "--gpu", "0", "4242", "--config", str(agent.config_path)]
        injected = subprocess.run(
            [sys.executable, "-m", "agent.cli", *load],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert injected.returncode == 0, injected.stderr

        def activity() -> tuple[float | None, float | None]:
            gpus = agent.status()["gpus"]
            return gpus[0].get("sm_active_ratio"), gpus[1].get("sm_active_ratio")

        wait_until(lambda: (a := activity())[0] is not None and a[0] > 0.5 and a[1] == 0.0, WAIT_SECONDS, activity)
        backend = SimulatedBackend("h200x2", agent.state_dir, counter_clock=time.monotonic)
        backend.init()
        energy = backend.total_energy_joules(0)
        time.sleep(0.5)
        # half a second at the load's power, read by a third process: the counter is the node's
        assert backend.total_energy_joules(0) - energy >= backend.power_usage_watts(0) * 0.5


def test_a_setting_changed_behind_the_agents_back_is_planned_in_the_loop_that_reads_it(tmp_path: Path) -> None:
    """The policy is planned every policy interval, the readings every loop: a power limit someone
    changes is planned again in the loop whose sample reads it, so no screen shows the new reading
    beside the old verdict (in sync, or the old drift) for the rest of the interval."""
    config_path, _ = write_agent_config(tmp_path, mode="observe")
    config_path.write_text(config_path.read_text() + "policy_interval_seconds: 3600\n")
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    try:
        first = daemon.loop_once()
        assert [(p.gpu, p.actual) for p in first.policy if p.item == "power_limit"] == [(0, "700 W"), (1, "700 W")]
        operator = SimulatedBackend("h200x2", tmp_path / "state", writable_items=["power_limit"])
        operator.init()
        operator.set_power_limit_watts(1, 650)
        operator.shutdown()
        snapshot = daemon.loop_once()
        assert snapshot.gpus[1].power_limit_watts == 650.0
        assert [(p.gpu, p.actual) for p in snapshot.policy if p.item == "power_limit"] == [(0, "700 W"), (1, "650 W")]
        # nothing changed since: the interval holds again
        assert daemon.loop_once().policy == snapshot.policy
    finally:
        daemon.shutdown()
