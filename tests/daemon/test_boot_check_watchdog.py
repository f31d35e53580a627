"""The next-boot check cannot hold up the policy lane: with a FIFO planted in /boot and the module
tree, or with a check that hangs (a dead disk), a running daemon keeps the fans on the curve, puts a
moved power limit back and keeps sending WATCHDOG=1; the check's trouble is the next_boot item's error."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import running_agent, write_agent_config
from helpers import wait_until
from hosttree import make_host_tree

from agent.backend.sim import SimulatedBackend
from agent.config import GPU_ITEMS, load_config
from agent.daemon import Daemon
from agent.daemon.sd_notify import SdNotifier
from agent.policy import next_boot

pytestmark = pytest.mark.real_daemon

KERNEL = "6.8.0-50-generic"
POLICY = """\
  node: {next_boot: ready}
  gpus:
    - match: {model: "NVIDIA RTX PRO 6000*"}
      power_limit_watts: 450
      fan_curve: [[30, 30], [50, 65], [75, 100]]
"""
WAIT_SECONDS = 10.0


def planted_boot(root: Path) -> None:
    """A kernel whose initramfs, module and a BLS entry are FIFOs: opening one for reading waits forever."""
    make_host_tree(root, kernel_sysfs=False)
    (root / f"boot/vmlinuz-{KERNEL}").write_bytes(b"kernel")
    os.symlink(f"vmlinuz-{KERNEL}", root / "boot/vmlinuz")
    os.mkfifo(root / f"boot/initrd.img-{KERNEL}")
    (root / "boot/loader/entries").mkdir(parents=True)
    os.mkfifo(root / "boot/loader/entries/planted.conf")
    modules = root / f"lib/modules/{KERNEL}/updates/dkms"
    modules.mkdir(parents=True)
    os.mkfifo(modules / "nvidia.ko")


def operator(state_dir: Path) -> SimulatedBackend:
    backend = SimulatedBackend("rtx-pro-6000", state_dir, writable_items=GPU_ITEMS)
    backend.init()
    return backend


def keeps_the_node(gpus: SimulatedBackend, pings: Any) -> None:
    """Fans follow the temperature, a moved power limit is put back, the watchdog keeps being fed."""
    wait_until(lambda: gpus.power_limit_watts(0) == 450.0, WAIT_SECONDS, "power limit enforced")
    gpus.set_temperature(0, 88)
    wait_until(lambda: gpus.fan_speed_percent(0, 0) == 100, WAIT_SECONDS, "fans at 100 % at 88 C")
    gpus.set_power_limit_watts(0, 300.0)
    wait_until(lambda: gpus.power_limit_watts(0) == 450.0, WAIT_SECONDS, "power limit drift put back")
    gpus.set_temperature(0, 60)
    wait_until(lambda: gpus.fan_speed_percent(0, 0) == 79, WAIT_SECONDS, "fans back down the curve")
    before = pings()
    time.sleep(1.5)
    assert pings() >= before + 2, "WATCHDOG=1 stopped"


def test_fifos_in_boot_leave_fans_drift_and_watchdog_untouched(tmp_path: Path) -> None:
    planted_boot(tmp_path / "host")
    with running_agent(tmp_path, profile="rtx-pro-6000", policy=POLICY, extra="policy_interval_seconds: 1\n") as agent:
        agent.notifications.wait_for("READY", "1")
        gpus = operator(agent.state_dir)

        def pings() -> int:
            agent.notifications.poll(0.1)
            return len(agent.notifications.times("WATCHDOG"))

        keeps_the_node(gpus, pings)
        items = {item["item"]: item for item in agent.status()["policy"]["items"]}
        assert "nvidia.ko: cannot be read: not a regular file (a FIFO)" in items["next_boot"]["detail"]
        assert items["next_boot"]["status"] == "drift"  # and the FIFO initramfs is no initramfs


def test_a_hung_boot_check_leaves_fans_drift_and_watchdog_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def hung_check(*args: Any) -> Any:
        release.wait(60)  # a read on a disk that stopped answering
        raise OSError("never answered")

    monkeypatch.setattr(next_boot, "check_next_boot", hung_check)
    config_path, _ = write_agent_config(
        tmp_path, profile="rtx-pro-6000", policy=POLICY, extra="policy_interval_seconds: 1\n"
    )
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(tmp_path / "notify.sock"))
    receiver.settimeout(0.05)
    received: list[bytes] = []

    def pings() -> int:
        while True:
            try:
                received.append(receiver.recv(4096))
            except TimeoutError:
                return sum(b"WATCHDOG=1" in data for data in received)

    daemon = Daemon(
        load_config(config_path), config_path, notifier=SdNotifier(str(tmp_path / "notify.sock"), 1_000_000)
    )
    thread = threading.Thread(target=daemon.run)
    thread.start()
    try:
        wait_until(lambda: pings() > 0 and any(b"READY=1" in data for data in received), WAIT_SECONDS, "READY=1")
        keeps_the_node(operator(tmp_path / "state"), pings)
        plans = {plan.item: plan for plan in daemon.policy.plans}
        assert plans["next_boot"].detail.startswith("the next-boot check is still running")
    finally:
        release.set()
        daemon.live.stop_requested.set()
        thread.join(15)
        receiver.close()
    assert not thread.is_alive()
