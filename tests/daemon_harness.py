"""Runs `gpu-agent run` as a real process on a simulated node, with a real sd_notify socket (or, with
`serving_daemon`, a `Daemon` in the test's own process, its listeners up)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosttree import make_host_tree

from agent.host.paths import BOOT_ID_PATH

if TYPE_CHECKING:
    from agent.daemon import Daemon

#: The slow tier (PCIe, ECC, remapping) every second: a slow-tier fault shows within a second or two.
COUNTERS_INTERVAL_SECONDS = 1.0

AGENT_CONFIG = """\
mode: {mode}
backend: {backend}
simulated: {{profile: {profile}}}
host_root: {root}
state_dir: {state}
interval_seconds: {interval}
counters_interval_seconds: {counters_interval}
metrics: {{listen: "127.0.0.1:{port}"}}
api: {{socket: {socket}}}
remediation: {remediation}
policy:
{policy}
"""

DEFAULT_POLICY = """\
  node: {transparent_hugepages: never}
  gpus:
    - match: {model: "NVIDIA H200*"}
      power_limit_watts: 600
    - match: {model: "NVIDIA RTX PRO 6000*"}
      fan_curve: [[30, 30], [50, 65], [75, 100]]
"""


def command_service(port: int, *, interval_seconds: float = 0.5, slo: str = "{e2e_p95_seconds: 1.5}") -> str:
    """agent.yaml's `services:` with one sglang server on `port` (a stand-in, agent.demo.standin) on
    every GPU, managed by commands that do nothing, probed and scraped every `interval_seconds`."""
    return f"""\
services:
  - name: sglang
    manager: command
    start_command: [/bin/true]
    stop_command: [/bin/true]
    health_url: "http://127.0.0.1:{port}/health"
    gpus: all
    probe_interval_seconds: {interval_seconds:g}
    scrape_interval_seconds: {interval_seconds:g}
    slo: {slo}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Notifications:
    """The datagrams the daemon sent to NOTIFY_SOCKET, with arrival times."""

    sock: socket.socket
    received: list[tuple[float, dict[str, str]]] = field(default_factory=list)

    def poll(self, timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.received.append((time.monotonic(), fields))

    def wait_for(self, key: str, value: str | None = None, timeout_seconds: float = 20.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout_seconds
        seen = 0
        while time.monotonic() < deadline:
            for _, fields in self.received[seen:]:
                if key in fields and (value is None or fields[key] == value):
                    return fields
            seen = len(self.received)
            self.poll(0.2)
        raise AssertionError(f"no {key}={value} within {timeout_seconds}s; got {self.received[-5:]}")

    def times(self, key: str) -> list[float]:
        return [t for t, fields in self.received if key in fields]


@dataclass
class RunningAgent:
    process: subprocess.Popen[str]
    notifications: Notifications
    config_path: Path
    state_dir: Path
    host_root: Path
    socket_path: Path
    port: int
    log_path: Path
    source: Path | None = None  # the directory whose `agent` package runs; None: the installed one

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
            return str(response.read().decode())

    def status(self) -> dict[str, Any]:
        result = subprocess.run(
            [sys.executable, "-m", "agent.cli", "status", "--json", "--config", str(self.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=self.source,
        )
        # 0: all healthy, 2: attention needed (like `plan`); 1 would be "could not tell"
        assert result.returncode in (0, 2), result.stderr
        return dict(json.loads(result.stdout))

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def log(self) -> str:
        return self.log_path.read_text()


def write_agent_config(
    tmp_path: Path,
    *,
    mode: str = "enforce",
    profile: str = "h200x2",
    interval: float = 0.2,
    policy: str = DEFAULT_POLICY,
    rules_dir: Path | None = None,
    backend: str = "simulated",  # "nvml" on a test machine: a host without the NVIDIA driver
    extra: str = "",  # more top-level YAML, e.g. "policy_interval_seconds: 1\n"
    alertmanager_url: str | list[str] | None = None,  # remediation.alertmanager_url
) -> tuple[Path, int]:
    root = tmp_path / "host"
    if not root.exists():
        make_host_tree(root, kernel_sysfs=False)
        # Every Linux host has one; the journal rolls back only what an earlier run on this boot left.
        boot_id = root / BOOT_ID_PATH.lstrip("/")
        boot_id.parent.mkdir(parents=True, exist_ok=True)
        boot_id.write_text(f"{uuid.uuid4()}\n")
    port = free_port()
    # No rules directory given: remediation off on purpose (a daemon with rules dirs but no rules in
    # them needs attention, and would say so in every verdict).
    remediation = f"{{rules_dir: {rules_dir}" if rules_dir is not None else "{rules_dirs: []"
    remediation += "" if alertmanager_url is None else f", alertmanager_url: {json.dumps(alertmanager_url)}"
    remediation += "}"
    config = tmp_path / "agent.yaml"
    config.write_text(
        AGENT_CONFIG.format(
            mode=mode,
            backend=backend,
            profile=profile,
            root=root,
            state=tmp_path / "state",
            interval=interval,
            counters_interval=COUNTERS_INTERVAL_SECONDS,
            port=port,
            socket=tmp_path / "agent.sock",
            remediation=remediation,
            policy=policy,
        )
        + extra.replace("$PORT", str(port))  # the metrics port, for what the extra keys must name it by
    )
    return config, port


@contextlib.contextmanager
def running_agent(
    tmp_path: Path,
    watchdog_usec: int | None = 1_000_000,
    source: Path | None = None,
    again: RunningAgent | None = None,
    **config: Any,
) -> Iterator[RunningAgent]:
    """`source`: a directory holding another `agent` package to run (`python -m` puts it first on the path);
    `again`: an agent that ran in `tmp_path` before (stopped or killed), started again on its config and port."""
    config_path, port = (again.config_path, again.port) if again is not None else write_agent_config(tmp_path, **config)
    notify_path = tmp_path / "notify.sock"
    notify_path.unlink(missing_ok=True)  # left by an earlier agent in the same directory
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "WATCHDOG_PID")}
    env["NOTIFY_SOCKET"] = str(notify_path)
    if watchdog_usec is not None:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    log_path = tmp_path / "agent.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--log-format", "json", "--config", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=source,
        )
    agent = RunningAgent(
        process,
        Notifications(sock),
        config_path,
        tmp_path / "state",
        tmp_path / "host",
        tmp_path / "agent.sock",
        port,
        log_path,
        source,
    )
    try:
        yield agent
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        sock.close()


@contextlib.contextmanager
def serving_daemon(tmp_path: Path, **config: Any) -> Iterator[tuple[Daemon, Path, int]]:
    """A daemon in this process with its listeners up and one snapshot published: (it, its config, its metrics port)."""
    from agent.config import load_config
    from agent.daemon import Daemon
    from agent.daemon.sd_notify import SdNotifier

    config_path, port = write_agent_config(tmp_path, **config)
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    try:
        daemon.start_services()
        daemon.loop_once()
        yield daemon, config_path, port
    finally:
        daemon.shutdown()


def edit(config_path: Path, old: str, new: str) -> None:
    """Replace `old` (which must be there) with `new` in the config file."""
    text = config_path.read_text()
    assert old in text
    config_path.write_text(text.replace(old, new))
