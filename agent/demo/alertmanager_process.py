"""A real Alertmanager for the demo, when one is installed (Debian's prometheus-alertmanager, or an
`alertmanager` on PATH): on loopback, no cluster port, its data in the demo directory, so the demo
shows the shipped rules' alerts arrive where they would on a real node."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from agent.demo.standin_process import free_port

CONFIG = """\
route:
  receiver: demo
  group_wait: 1s
receivers:
  - name: demo
"""
READY_SECONDS = 20.0


def find_alertmanager() -> str | None:
    return shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


class DemoAlertmanager:
    """`start()` runs it under `directory` with `config` (routes and receivers); `alerts()` what it
    holds; `stop()` ends it."""

    def __init__(self, program: str, directory: Path, config: str = CONFIG) -> None:
        self.program = program
        self.directory = directory
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> DemoAlertmanager:
        (self.directory / "data").mkdir(parents=True, exist_ok=True)
        config = self.directory / "alertmanager.yml"
        config.write_text(self.config, encoding="utf-8")
        self._log = (self.directory / "alertmanager.log").open("wb")
        self.proc = subprocess.Popen(
            [
                self.program,
                f"--config.file={config}",
                f"--storage.path={self.directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",  # a single instance: no gossip port
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:  # noqa: S310  # nosec B310 (our loopback URL)
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"Alertmanager did not start; see {self.directory / 'alertmanager.log'}")

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts it holds now (GET /api/v2/alerts); [] when it cannot be asked."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=5) as response:  # noqa: S310  # nosec B310 (our loopback URL)
                found = json.load(response)
        except (OSError, ValueError):
            return []
        return [alert for alert in found if isinstance(alert, dict)] if isinstance(found, list) else []

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
