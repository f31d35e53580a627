"""Alertmanager traffic never delays the loop or systemd's watchdog: a real agent process with six
active alerts, an Alertmanager that accepts connections and never answers (tests/slow_endpoint.py),
six clearing events to resolve and refreshes due every half second. WATCHDOG=1 must keep coming."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from daemon_harness import Notifications, write_agent_config
from helpers import wait_until

from agent.daemon.alert_delivery import AlertDelivery
from agent.events import Event, EventKind, Severity
from agent.rules.actions.alertmanager import AlertTracker

# The agent as `gpu-agent run`, with six alerts already fired (the endpoint answered those) and six
# clearing events queued once it serves, and refreshes due every 0.5 s instead of every minute.
AGENT_WITH_ALERTS = """\
import sys

from agent import cli
from agent.daemon import core, remediator
from agent.events import Event, EventKind, Severity
from agent.rules.actions.alertmanager import Alert

remediator.ALERT_REFRESH_SECONDS = 0.5
url = sys.argv[2]
start_services = core.Daemon.start_services


def with_alerts(self):
    start_services(self)
    for n in range(6):
        labels = {"alertname": "GpuAgentServiceUnhealthy", "event": "service_unhealthy", "service": f"svc{n}"}
        self.live.alerts.fire(url, Alert(labels, {}, 0.0))
    self.live.intake.put([
        Event(EventKind.SERVICE_HEALTHY, Severity.INFO, None, None, "healthy", 0.0, "probe", f"ok{n}", {"service": f"svc{n}"})
        for n in range(6)
    ])


core.Daemon.start_services = with_alerts
sys.exit(cli.main(["run", "--log-format", "json", "--config", sys.argv[1]]))
"""


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


def test_a_silent_alertmanager_does_not_stop_the_watchdog_pings(tmp_path: Path) -> None:
    endpoint = Endpoint(answer=6)
    config, _ = write_agent_config(tmp_path, mode="observe", policy="  gpus: []\n", interval=0.2)
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
                [sys.executable, "-c", AGENT_WITH_ALERTS, str(config), endpoint.url],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        try:
            notifications.wait_for("READY", "1")
            # the six fires were answered; the resolves and refreshes now hang on the silent endpoint
            wait_until(lambda: endpoint.requests() >= 7, 10, "a resolve sent to the silent Alertmanager")
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


def test_the_delivery_queue_is_bounded_and_refreshes_coalesce() -> None:
    """A stuck delivery thread: clearing events beyond the bound are dropped, oldest first, and any
    number of refresh requests is one refresh."""
    tracker = AlertTracker()
    delivery = AlertDelivery(tracker, max_pending=3)
    events = [
        Event(EventKind.SERVICE_HEALTHY, Severity.INFO, None, None, "ok", 0.0, "probe", f"k{n}", {"service": f"s{n}"})
        for n in range(5)
    ]
    delivery.resolve_cleared(events)
    delivery.resolve_cleared([Event(EventKind.XID, Severity.INFO, 0, None, "x", 0.0, "nvml", "x", {})])  # not clearing
    for _ in range(10):
        delivery.refresh()
    work = delivery._next()  # what the thread would take now
    assert work is not None
    clearing, refresh = work
    assert [e.key for e in clearing] == ["k2", "k3", "k4"] and refresh is True
