"""Adding a plain GPU reading is the backend's read and one row of the reading table, and nothing else.

The test does what a contributor does, on a copy of the agent: it adds the simulated backend's read
(an encoder utilization, the way NVML's nvmlDeviceGetEncoderUtilization answers it) and one row
to `GpuSample` (agent/readings/table.py), then runs the copy as a daemon on a simulated node and
finds the new value in `/metrics`, in `gpu-agent status --json` and in the dcgm compatibility
rules the copy writes, which promtool accepts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import RunningAgent, running_agent

pytestmark = pytest.mark.real_daemon

REPO = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")

#: The simulated backend's read: a per-GPU call through the checks NVML makes, in percent as NVML gives it.
SIMULATED_READ = """
    def encoder_utilization_percent(self, gpu: int) -> int:
        with self._read(gpu, "encoder_utilization_percent"):
            return 7
"""

#: The row: where the value comes from, its metric, its family, its dcgm-exporter field.
ROW = """\
    encoder_utilization_percent: int | None = reading(
        fast(lambda b, gpu: b.encoder_utilization_percent(gpu)),
        family="utilization",
        metric=gauge(
            "gpu_agent_gpu_encoder_utilization_ratio",
            "Fraction of the last sample period in which the video encoder was busy.",
        ),
        unit=PERCENT,
        dcgm=Dcgm("DCGM_FI_DEV_ENC_UTIL", "%"),
    )
"""

ROWS_END = "    read_errors: dict[str, str] = field(default_factory=dict)\n"


def agent_with_a_new_reading(root: Path) -> Path:
    """A copy of the agent package under `root` with the new reading added, as a contributor would."""
    shutil.copytree(REPO / "agent", root / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    table = root / "agent" / "readings" / "table.py"
    text = table.read_text()
    assert text.count(ROWS_END) == 1, "the table's last field moved: put the new row before it"
    table.write_text(text.replace(ROWS_END, ROW + "\n" + ROWS_END))
    reads = root / "agent" / "backend" / "sim" / "reads.py"
    text = reads.read_text()
    assert text.rfind("\nclass ") == text.find("\nclass DeviceReads("), "the simulated reads' class is no longer last"
    reads.write_text(text + SIMULATED_READ)
    return root


def scraped_until(agent: RunningAgent, line: str, timeout_seconds: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_seconds
    while True:
        text = agent.metrics()
        if line in text or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def test_a_new_row_and_its_simulated_read_reach_metrics_status_and_the_dcgm_rules(tmp_path: Path) -> None:
    source = agent_with_a_new_reading(tmp_path / "src")
    node = tmp_path / "node"
    node.mkdir()
    with running_agent(node, source=source, profile="h200x2") as agent:
        agent.notifications.wait_for("READY", "1")
        status = agent.status()
        uuid = status["gpus"][0]["uuid"]
        series = f'gpu_agent_gpu_encoder_utilization_ratio{{gpu="0",uuid="{uuid}"}} 0.07'
        metrics = scraped_until(agent, series)
    assert series in metrics
    assert (
        "# HELP gpu_agent_gpu_encoder_utilization_ratio "
        "Fraction of the last sample period in which the video encoder was busy."
    ) in metrics
    assert [gpu["encoder_utilization_percent"] for gpu in status["gpus"]] == [7, 7]

    rules = subprocess.run(
        [sys.executable, "-m", "agent.metrics.dcgm"], capture_output=True, text=True, timeout=60, cwd=source, check=True
    ).stdout
    assert (
        "      # %\n"
        "      - record: DCGM_FI_DEV_ENC_UTIL\n"
        "        expr: >-\n"
        "          max without (uuid) (gpu_agent_gpu_encoder_utilization_ratio * 100)\n"
    ) in rules
    shipped = (REPO / "packaging" / "prometheus" / "gpu-agent-dcgm-compat.yaml").read_text()
    assert "DCGM_FI_DEV_ENC_UTIL" not in shipped  # the copy's rules, not the shipped file's
    if PROMTOOL is None:
        pytest.skip("promtool not installed (apt-get install prometheus): the rules were not checked")
    written = tmp_path / "dcgm-compat.yaml"
    written.write_text(rules)
    check = subprocess.run([PROMTOOL, "check", "rules", str(written)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
