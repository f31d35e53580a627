"""Alertmanager traffic never delays the loop or systemd's watchdog: a real agent process with six
firing alerts kept from an earlier run (its store), pushing to an Alertmanager that accepts
connections and never answers (tests/slow_endpoint.py). WATCHDOG=1 must keep coming."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from daemon_harness import Notifications, write_agent_config
from helpers import wait_until

from agent.daemon.alert_book import PushBook, alert_key
from agent.daemon.alert_delivery import AlertDelivery
from agent.store.alerts import AlertRow
from agent.store.database import Store

pytestmark = pytest.mark.real_daemon


class Endpoint:
    """tests/slow_endpoint.py silent, answering the first `answer` requests."""

    def __init__(self, answer: int) -> None:
        script = Path(__file__).parents[1] / "slow_endpoint.py"
        self.process = subprocess.Popen(
            [sys.executable, str(script), "silent", "--answer", str(answer)], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.process.stdout.readline())}"
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.strip())

    def requests(self) -> int:
        return sum(1 for line in self.lines if line.startswith("request "))

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def firing(service: str) -> AlertRow:
    labels = {"alertname": "InferenceServiceDown", "severity": "critical", "service": service}
    return AlertRow(alert_key(labels), labels, {}, "", None, 1.0, None, False, {}, ())


def test_a_silent_alertmanager_does_not_stop_the_watchdog_pings(tmp_path: Path) -> None:
    endpoint = Endpoint(answer=0)
    config, _ = write_agent_config(
        tmp_path, mode="observe", policy="  gpus: []\n", interval=0.2, alertmanager_url=endpoint.url
    )
    with Store.open(tmp_path / "state") as store:  # what an earlier run left firing
        store.save_pushed_alerts([firing(f"svc{n}") for n in range(6)], ())
    notify = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    notifications = Notifications(sock)
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "WATCHDOG_PID")}
    env |= {"NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "1000000"}
    log_path = tmp_path / "agent.log"
    try:
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "agent.cli", "run", "--log-format", "json", "--config", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            notifications.wait_for("READY", "1")
            # the six alerts go out in one request, which hangs on the silent endpoint (and its retries)
            wait_until(lambda: endpoint.requests() >= 1, 10, "the alerts sent to the silent Alertmanager")
            began = time.monotonic()
            notifications.poll(8.0)
            pings = [t for t in notifications.times("WATCHDOG") if t >= began]
            gaps = [b - a for a, b in zip([began, *pings], [*pings, time.monotonic()], strict=True)]
            assert len(pings) >= 12, f"{len(pings)} pings in 8 s: {log_path.read_text()[-2000:]}"
            assert max(gaps) < 1.5, f"a watchdog gap of {max(gaps):.1f} s"
            assert process.poll() is None
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0  # the delivery thread stuck in a request does not hold the exit
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    finally:
        sock.close()
        endpoint.close()


def test_pokes_coalesce_into_one_round() -> None:
    """However many alerts fired since the last round, the thread makes one round for them."""
    delivery = AlertDelivery(PushBook())
    for _ in range(10):
        delivery.poke()
    assert delivery._wait() is True  # one round now
    delivery.stop()
    assert delivery._wait() is False
