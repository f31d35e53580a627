"""The profiling telemetry (GPM, field values, NVLink) on a real GPU, compared with independent readers
at the same moment. Read-only.

For each phase (idle, then loaded by a bf16 matmul that this script starts with PyTorch in a
subprocess), the agent reads GPU `--gpu` through its own NVML backend and collector
(`agent.collect.sample_identified`, twice, `--interval` apart, so GPM activity covers that interval)
while, at the same two moments, this script takes its own pynvml GPM samples; right after the
second sample it runs `nvidia-smi -q -d MEMORY,TEMPERATURE,POWER,PERFORMANCE,CLOCK`,
`nvidia-smi dmon -c 1 -s pucvmet` and `nvidia-smi --query-compute-apps=pid,used_memory`, and reads
the energy counter with pynvml. Every reading lands in one table: the agent's value, the
independent ones, the difference and whether it is within the tolerance the row states.

Nothing is written to the GPU: the backend is opened with no writable item, so its write guard
refuses every setter before NVML sees it (the document records the guard), and the script itself
calls NVML getters and GPM sampling only. nvidia-smi runs with query options only.

Usage (on the GPU host, repository root, agent dependencies importable):

    PYTHONUNBUFFERED=1 python3 -m bench.h200_telemetry_compare [--out-dir DIR] [--gpu 0]

Writes telemetry-compare.json and telemetry-compare.md to --out-dir, else $OUT, else the current
directory. Without PyTorch (or CUDA) the loaded phase is skipped and the document says why.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.backend.nvml import NvmlBackend
from agent.collect import sample_identified
from agent.state import GpuSample

MIB = 1 << 20
#: nvmlGpmMetricId_t, as the agent reads them (agent.backend.nvml).
GPM_METRICS = {
    "sm_active": 2,
    "sm_occupancy": 3,
    "tensor_active": 5,
    "dram_active": 10,
    "pcie_tx_mib_s": 20,
    "pcie_rx_mib_s": 21,
    "nvlink_rx_mib_s": 60,
    "nvlink_tx_mib_s": 61,
}
MATMUL = """
import sys, time, torch
gpu, seconds = int(sys.argv[1]), float(sys.argv[2])
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=f"cuda:{gpu}")
b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=f"cuda:{gpu}")
print("load started", flush=True)
end = time.time() + seconds
while time.time() < end:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize(gpu)
"""
SMI_SECTIONS = "MEMORY,TEMPERATURE,POWER,PERFORMANCE,CLOCK"
_KEY_VALUE = re.compile(r"^(\s*)(.+?)\s+:\s*(.*?)\s*$")  # "Key   : value"; "GPU 0000:..." is a heading
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# -- independent readers -------------------------------------------------------------------------


def parse_smi_q(text: str) -> dict[str, str]:
    """nvidia-smi -q as flat "Section / Key" -> value (the section is the nearest less-indented
    heading), e.g. "FB Memory Usage / Used" -> "1139 MiB"."""
    values: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("="):
            continue
        indent = len(line) - len(line.lstrip())
        match = _KEY_VALUE.match(line)
        key = (match.group(2) if match else line).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if match and match.group(3):
            values[" / ".join([*(name for _, name in stack), key])] = match.group(3)
        else:
            stack.append((indent, key))
    return values


def smi_number(values: dict[str, str], *suffixes: str) -> float | None:
    """The first number of the first entry whose key ends with one of `suffixes` (None: absent or N/A).
    Start a suffix with " / " to name a whole section: " / Clocks / SM" is not "Max Clocks / SM"."""
    for suffix in suffixes:
        for key, value in values.items():
            if key.endswith(suffix):
                found = _NUMBER.search(value)
                return float(found.group()) if found else None
    return None


def parse_dmon(text: str) -> dict[str, float | None]:
    """`nvidia-smi dmon -c 1` output: header columns to the first data row's values ("-": None)."""
    header: list[str] = []
    for line in text.splitlines():
        if line.startswith("# gpu") or line.startswith("#gpu"):
            header = line.lstrip("#").split()
        elif line.strip() and not line.startswith("#") and header:
            row = line.split()
            return {name: (float(value) if _NUMBER.fullmatch(value) else None) for name, value in zip(header, row)}
    return {}


class OwnGpm:
    """This script's own GPM samples: two buffers, metrics over the last two samples."""

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self.pynvml = pynvml
        self.handle = handle
        self.previous: Any = None

    def sample(self) -> dict[str, float] | None:
        pynvml = self.pynvml
        current = pynvml.nvmlGpmSampleAlloc()
        pynvml.nvmlGpmSampleGet(self.handle, current)
        previous, self.previous = self.previous, current
        if previous is None:
            return None
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = previous
        request.sample2 = current
        for position, metric in enumerate(GPM_METRICS.values()):
            request.metrics[position].metricId = metric
        pynvml.nvmlGpmMetricsGet(request)
        pynvml.nvmlGpmSampleFree(previous)
        return {
            name: float(request.metrics[position].value)
            for position, name in enumerate(GPM_METRICS)
            if request.metrics[position].nvmlReturn == pynvml.NVML_SUCCESS
        }

    def close(self) -> None:
        if self.previous is not None:
            self.pynvml.nvmlGpmSampleFree(self.previous)
            self.previous = None


def run_text(argv: list[str], timeout: float = 60) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ERROR: {exc}"
    return done.stdout if done.returncode == 0 else f"ERROR: exit {done.returncode}: {done.stderr.strip()[:300]}"


# -- the comparison --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    reading: str
    unit: str
    agent: float | str | None
    reference: float | str | None
    reader: str
    tolerance: str
    ok: bool | None  # None: nothing to compare

    def cells(self) -> list[str]:
        verdict = "-" if self.ok is None else ("ok" if self.ok else "DIFFERS")
        return [self.reading, self.unit, _cell(self.agent), _cell(self.reference), self.reader, self.tolerance, verdict]


def _cell(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".")
    return str(value)


def within(absolute: float, relative: float = 0.0) -> Callable[[float, float], bool]:
    return lambda agent, reference: abs(agent - reference) <= max(absolute, relative * abs(reference))


def row(
    reading: str,
    unit: str,
    agent: float | None,
    reference: float | None,
    reader: str,
    tolerance: str,
    close: Callable[[float, float], bool],
) -> Row:
    ok = None if agent is None or reference is None else close(agent, reference)
    return Row(reading, unit, agent, reference, reader, tolerance, ok)


def _mib(value: int | None) -> float | None:
    return None if value is None else value / MIB


def _pct(value: float | None) -> float | None:
    return None if value is None else value * 100


def compare(
    sample: GpuSample,
    smi: dict[str, str],
    dmon: dict[str, float | None],
    gpm: dict[str, float] | None,
    energy_j: float | None,
) -> list[Row]:
    gpm = gpm or {}
    smi_q = "nvidia-smi -q"
    rows = [
        row(
            "memory used",
            "MiB",
            _mib(sample.memory_used_bytes),
            smi_number(smi, "FB Memory Usage / Used"),
            smi_q,
            "±2 MiB",
            within(2),
        ),
        row(
            "memory reserved",
            "MiB",
            _mib(sample.memory_reserved_bytes),
            smi_number(smi, "FB Memory Usage / Reserved"),
            smi_q,
            "±2 MiB",
            within(2),
        ),
        row(
            "memory free",
            "MiB",
            _mib(sample.memory_free_bytes),
            smi_number(smi, "FB Memory Usage / Free"),
            smi_q,
            "±2 MiB",
            within(2),
        ),
        row(
            "memory total",
            "MiB",
            _mib(sample.memory_total_bytes),
            smi_number(smi, "FB Memory Usage / Total"),
            smi_q,
            "±1 MiB",
            within(1),
        ),
        row(
            "memory used (dmon fb)",
            "MiB",
            _mib(sample.memory_used_bytes),
            dmon.get("fb"),
            "dmon fb",
            "±2 MiB",
            within(2),
        ),
        row(
            "GPU temperature",
            "C",
            sample.temperature_celsius,
            smi_number(smi, "GPU Current Temp"),
            smi_q,
            "±2 C",
            within(2),
        ),
        row(
            "HBM temperature",
            "C",
            sample.memory_temperature_celsius,
            smi_number(smi, "Memory Current Temp"),
            smi_q,
            "±2 C",
            within(2),
        ),
        row(
            "HBM temperature (dmon)",
            "C",
            sample.memory_temperature_celsius,
            dmon.get("mtemp"),
            "dmon mtemp",
            "±2 C",
            within(2),
        ),
        row(
            "memory max temperature",
            "C",
            sample.memory_max_temperature_celsius,
            smi_number(smi, "Memory Max Operating Temp", "Max Memory Temp"),
            smi_q,
            "exact",
            within(0),
        ),
        row(
            "power draw",
            "W",
            sample.power_usage_watts,
            smi_number(smi, "Average Power Draw", "GPU Power Readings / Power Draw"),
            smi_q,
            "±10 %",
            within(5, 0.10),
        ),
        row(
            "instant power",
            "W",
            sample.power_instant_watts,
            smi_number(smi, "Instant Power Draw"),
            smi_q,
            "±15 %",
            within(10, 0.15),
        ),
        row(
            "energy",
            "J",
            sample.energy_joules,
            energy_j,
            "pynvml TotalEnergyConsumption",
            "±1 % or 5 J",
            within(5, 0.01),
        ),
        row("SM active", "%", _pct(sample.sm_active_ratio), gpm.get("sm_active"), "own GPM sample", "±5 pp", within(5)),
        row(
            "SM occupancy",
            "%",
            _pct(sample.sm_occupancy_ratio),
            gpm.get("sm_occupancy"),
            "own GPM sample",
            "±5 pp",
            within(5),
        ),
        row(
            "tensor active",
            "%",
            _pct(sample.tensor_active_ratio),
            gpm.get("tensor_active"),
            "own GPM sample",
            "±5 pp",
            within(5),
        ),
        row(
            "DRAM active",
            "%",
            _pct(sample.dram_active_ratio),
            gpm.get("dram_active"),
            "own GPM sample",
            "±5 pp",
            within(5),
        ),
        row(
            "SM active vs dmon sm",
            "%",
            _pct(sample.sm_active_ratio),
            dmon.get("sm"),
            "dmon sm (utilization, not GPM)",
            "info",
            lambda a, b: True,
        ),
        row(
            "PCIe TX",
            "MiB/s",
            _mib_s(sample.pcie_tx_bytes_per_second),
            gpm.get("pcie_tx_mib_s"),
            "own GPM sample",
            "±25 % or 5",
            within(5, 0.25),
        ),
        row(
            "PCIe RX",
            "MiB/s",
            _mib_s(sample.pcie_rx_bytes_per_second),
            gpm.get("pcie_rx_mib_s"),
            "own GPM sample",
            "±25 % or 5",
            within(5, 0.25),
        ),
        row(
            "PCIe RX (dmon)",
            "MB/s",
            _mib_s(sample.pcie_rx_bytes_per_second),
            dmon.get("rxpci"),
            "dmon rxpci (1 s later)",
            "info",
            lambda a, b: True,
        ),
        row(
            "NVLink TX",
            "MiB/s",
            _mib_s(sample.nvlink_tx_bytes_per_second),
            gpm.get("nvlink_tx_mib_s"),
            "own GPM sample",
            "±25 % or 5",
            within(5, 0.25),
        ),
        row(
            "NVLink RX",
            "MiB/s",
            _mib_s(sample.nvlink_rx_bytes_per_second),
            gpm.get("nvlink_rx_mib_s"),
            "own GPM sample",
            "±25 % or 5",
            within(5, 0.25),
        ),
        row(
            "max SM clock",
            "MHz",
            sample.max_sm_clock_mhz,
            smi_number(smi, " / Max Clocks / SM"),
            smi_q,
            "exact",
            within(0),
        ),
        row(
            "max memory clock",
            "MHz",
            sample.max_memory_clock_mhz,
            smi_number(smi, " / Max Clocks / Memory"),
            smi_q,
            "exact",
            within(0),
        ),
        row(
            "applications graphics clock",
            "MHz",
            sample.applications_graphics_clock_mhz,
            smi_number(smi, " / Applications Clocks / Graphics"),
            smi_q,
            "exact",
            within(0),
        ),
        row(
            "applications memory clock",
            "MHz",
            sample.applications_memory_clock_mhz,
            smi_number(smi, " / Applications Clocks / Memory"),
            smi_q,
            "exact",
            within(0),
        ),
        row(
            "SM clock",
            "MHz",
            sample.sm_clock_mhz,
            smi_number(smi, " / Clocks / SM"),
            smi_q,
            "±15 % (moving)",
            within(30, 0.15),
        ),
    ]
    violation = (sample.violation_reason_ns or {}).get("sw_power_cap")
    smi_cap_us = smi_number(smi, "SW Power Capping", "SW Power Cap")
    rows.append(
        row(
            "SW power cap time",
            "s",
            None if violation is None else violation / 1e9,
            None if smi_cap_us is None or smi_cap_us < 1000 else smi_cap_us / 1e6,
            "nvidia-smi -q clocks event reasons counters",
            "±5 % or 0.5 s (if shown)",
            within(0.5, 0.05),
        )
    )
    return rows


def _mib_s(value: float | None) -> float | None:
    return None if value is None else value / MIB


def markdown(phases: dict[str, Any]) -> str:
    lines = ["# gpu-agent telemetry vs independent readers", ""]
    for phase, result in phases.items():
        lines += [f"## {phase}", ""]
        if "skipped" in result:
            lines += [f"skipped: {result['skipped']}", ""]
            continue
        lines.append("| reading | unit | gpu-agent | reference | reader | tolerance | verdict |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- |")
        lines += ["| " + " | ".join(Row(**r).cells()) + " |" for r in result["rows"]]
        lines.append("")
    return "\n".join(lines) + "\n"


# -- one phase -------------------------------------------------------------------------------------


def read_phase(backend: NvmlBackend, gpu: int, interval: float, smi: str | None) -> dict[str, Any]:
    import pynvml

    identity = backend.identity(gpu)
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    try:
        own = OwnGpm(pynvml, handle) if pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice else None
    except pynvml.NVMLError:  # a driver before GPM
        own = None
    unsupported: set[str] = set()
    try:
        # the same two moments for the agent and the own GPM sample
        sample_identified(backend, identity, slow=True, unsupported=unsupported)
        if own is not None:
            own.sample()
        time.sleep(interval)
        started = time.time()
        sample = sample_identified(backend, identity, slow=True, unsupported=unsupported)
        gpm = own.sample() if own is not None else None
        energy_j = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000
        smi_q = run_text([smi, "-q", "-i", str(gpu), "-d", SMI_SECTIONS]) if smi else "ERROR: no nvidia-smi"
        dmon = run_text([smi, "dmon", "-i", str(gpu), "-c", "1", "-s", "pucvmet"]) if smi else ""
        apps = (
            run_text([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits", "-i", str(gpu)])
            if smi
            else ""
        )
    finally:
        if own is not None:
            own.close()
    rows = compare(sample, parse_smi_q(smi_q), parse_dmon(dmon), gpm, energy_j)
    agent_pids = sorted(p.pid for p in sample.processes or ())
    smi_pids = sorted(int(line.split(",")[0]) for line in apps.splitlines() if line.strip() and line[0].isdigit())
    rows.append(
        Row(
            "compute process PIDs",
            "",
            str(agent_pids),
            str(smi_pids),
            "nvidia-smi --query-compute-apps",
            "equal",
            agent_pids == smi_pids,
        )
    )
    return {
        "read_at": started,
        "interval_seconds": interval,
        "rows": [asdict(r) for r in rows],
        "agent_sample": json.loads(json.dumps(asdict(sample), default=str)),
        "own_gpm": gpm,
        "agent_unsupported_readers": sorted(unsupported),
        "nvidia_smi_q": smi_q,
        "nvidia_smi_dmon": dmon,
        "nvidia_smi_compute_apps": apps,
    }


def start_load(gpu: int, seconds: float) -> subprocess.Popen[str] | str:
    """The bf16 matmul in a subprocess; a reason string when it cannot start."""
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    process = subprocess.Popen(
        [sys.executable, "-c", MATMUL, str(gpu), str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if "load started" not in line:
        rest = line + process.stdout.read()[:2000] if process.poll() is not None else line
        process.kill()
        return f"the matmul load did not start: {rest.strip()[:500]}"
    return process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between the two samples")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds of load before reading")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or Path(os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    smi = shutil.which("nvidia-smi")
    backend = NvmlBackend(writable_items=())  # observe mode: every setter refused before NVML
    backend.init()
    document: dict[str, Any] = {
        "what": "gpu-agent telemetry vs nvidia-smi -q, nvidia-smi dmon and an own pynvml GPM sample, same moment",
        "driver_version": backend.driver_version(),
        "gpu": asdict(backend.identity(args.gpu)),
        "write_guard_writable_items": sorted(backend.write_guard.writable_items),
        "phases": {},
    }
    try:
        document["phases"]["idle"] = read_phase(backend, args.gpu, args.interval, smi)
        load = start_load(args.gpu, args.warmup + args.interval + 30)
        if isinstance(load, str):
            document["phases"]["loaded"] = {"skipped": load}
        else:
            try:
                time.sleep(args.warmup)
                document["phases"]["loaded"] = read_phase(backend, args.gpu, args.interval, smi)
            finally:
                load.kill()
                load.wait(timeout=30)
    finally:
        backend.shutdown()
    (out_dir / "telemetry-compare.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    table = markdown(document["phases"])
    (out_dir / "telemetry-compare.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
