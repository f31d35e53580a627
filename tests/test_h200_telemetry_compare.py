"""bench/h200_telemetry_compare.py: its parsers of nvidia-smi's output, and one phase read through the
NVML backend over the recorded loaded H200 (no nvidia-smi here), calling no setter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nvml_replay import FIXTURE_H200_TELEMETRY, H200_PROBED, h200_telemetry, install_replay

from agent.backend.nvml import NvmlBackend
from bench.h200_telemetry_compare import Row, markdown, parse_dmon, parse_smi_q, read_phase, smi_number

SMI_Q = """
==============NVSMI LOG==============

Timestamp                                 : Tue Dec  1 05:00:00 2026
Driver Version                            : 580.159.04

Attached GPUs                             : 1
GPU 00000000:00:06.0
    Performance State                     : P0
    Clocks Event Reasons
        Idle                              : Not Active
        SW Power Cap                      : Active
    Clocks Event Reasons Counters
        SW Power Capping                  : 6539027 us
    FB Memory Usage
        Total                             : 143771 MiB
        Reserved                          : 615 MiB
        Used                              : 1139 MiB
        Free                              : 142017 MiB
    BAR1 Memory Usage
        Total                             : 262144 MiB
        Used                              : 1 MiB
        Free                              : 262143 MiB
    Temperature
        GPU Current Temp                  : 49 C
        Memory Current Temp               : 49 C
        Memory Max Operating Temp         : 95 C
    GPU Power Readings
        Average Power Draw                : 700.12 W
        Instant Power Draw                : 736.67 W
        Requested Power Limit             : N/A
    Clocks
        Graphics                          : 1755 MHz
        SM                                : 1755 MHz
        Memory                            : 3201 MHz
    Max Clocks
        Graphics                          : 1980 MHz
        SM                                : 1980 MHz
        Memory                            : 3201 MHz
"""

DMON = """# gpu    pwr  gtemp  mtemp     sm    mem    enc    dec    jpg    ofa   mclk   pclk  pviol  tviol     fb   bar1
# Idx      W      C      C      %      %      %      %      %      %    MHz    MHz      %   bool     MB     MB
    0    701     49     49    100     17      0      0      0      0   3201   1755     96      0   1139      1
"""


def test_nvidia_smi_q_is_read_by_section() -> None:
    values = parse_smi_q(SMI_Q)
    assert smi_number(values, "FB Memory Usage / Used") == 1139  # not BAR1's
    assert smi_number(values, "FB Memory Usage / Reserved") == 615
    assert smi_number(values, " / Clocks / SM") == 1755  # not the maximum
    assert smi_number(values, " / Max Clocks / SM") == 1980
    assert smi_number(values, "Instant Power Draw") == 736.67
    assert smi_number(values, "SW Power Capping", "SW Power Cap") == 6539027
    assert smi_number(values, "Requested Power Limit") is None  # N/A
    assert smi_number(values, "No Such Reading") is None


def test_nvidia_smi_dmon_columns() -> None:
    columns = parse_dmon(DMON)
    assert (columns["mtemp"], columns["sm"], columns["fb"], columns["pviol"]) == (49, 100, 1139, 96)
    assert parse_dmon("ERROR: exit 6") == {}


def test_one_loaded_phase_over_the_replay_agrees_with_its_own_gpm_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replay = install_replay(monkeypatch, supplement={**h200_telemetry("loaded"), **H200_PROBED})
    backend = NvmlBackend(writable_items=())
    backend.init()
    try:
        phase = read_phase(backend, 0, 0.01, smi=None)
    finally:
        backend.shutdown()
    rows = {r["reading"]: r for r in phase["rows"]}
    recorded = json.loads(FIXTURE_H200_TELEMETRY.read_text())["loaded"]["gpm_metrics"]["value"]
    assert rows["SM active"]["ok"] is True
    assert rows["SM active"]["reference"] == pytest.approx(recorded["SM_ACTIVITY"][0])
    assert rows["tensor active"]["ok"] is True and rows["DRAM active"]["ok"] is True
    assert rows["memory used"]["reference"] is None and rows["memory used"]["ok"] is None  # no nvidia-smi here
    assert rows["compute process PIDs"]["ok"] is True
    assert replay.calls == []  # no setter reached NVML
    assert replay.gpm_samples_live == 0
    text = markdown({"loaded": phase, "idle": {"skipped": "test"}})
    assert "| SM active | % |" in text and "skipped: test" in text


def test_a_row_says_whether_it_agrees() -> None:
    assert Row("x", "C", 49.0, 50.0, "r", "±2", True).cells()[-1] == "ok"
    assert Row("x", "C", 49.0, None, "r", "±2", None).cells()[-1] == "-"
    assert Path(__file__).exists()


def test_the_script_needs_only_nvidia_ml_py() -> None:
    """The GPU host's image has nvidia-ml-py and PyTorch but not the agent's other dependencies."""
    import subprocess
    import sys

    code = (
        "import sys, bench.h200_telemetry_compare; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'pydantic', 'structlog', 'pyudev', 'yaml', 'prometheus_client', 'psutil'}))"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"
