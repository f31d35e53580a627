"""What one gpu-agent poll of every GPU costs, next to the bare getters and next to nvidia-smi.

Measured side by side in one process, in rounds (each round runs every variant once, in a rotating
order, so a drift in machine speed hits all of them alike):

- agent_fast / agent_full: `agent.collect.sample_identified` for every GPU, fast tier alone
  (every loop) and fast + slow tier (every `counters_interval_seconds`): per-field error handling, unit
  conversion, the GpuSample.
- agent_fast_lanes: agent_fast handed to each GPU's `BoundedRunner` lane, as the daemon does it.
- raw_fast / raw_full: the same getters with no wrapping: pynvml functions on cached handles
  (nvml) or the backend's methods (simulated), in a plain loop.
- nvidia-smi: `nvidia-smi --query-gpu=<the same fields> --format=csv` as a process, which is what
  nvidia-smi-based exporters run per scrape (nvml backend only; skipped when it is absent).

The profiling telemetry is in both: the GPM sample differenced against the previous one, the field-value
batch of each tier, memory info v2, NVLink state, fabric, MIG, max/application clocks and processes.
Calls a GPU answers NOT_SUPPORTED are left out of the raw loop, as the agent remembers them per GPU
and stops asking.

The BoundedRunner hand-off (a queue put, a worker thread, a Future) is also timed on its own: a
no-op through a lane against the same no-op called directly.

Usage: python3 -m bench.collect_cost [--backend nvml] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from agent.backend import open_backend
from agent.backend.base import (
    ClockDomain,
    EccCounter,
    EccErrorType,
    GpuBackend,
    GpuIdentity,
    TemperatureThreshold,
    ViolationPolicy,
)
from agent.backend.errors import GpuError
from agent.collect import sample_identified
from agent.config import AgentConfig, SimulatedConfig
from agent.daemon.bounded import BoundedRunner
from bench.common import (
    Report,
    add_common_args,
    measure_rounds,
    paired_ratio,
    print_rows,
    scratch_dir,
    summarize,
    target,
    timed_run,
)

Call = tuple[Callable[..., Any], tuple[Any, ...]]

# nvidia-smi --query-gpu fields for what the fast tier reads (agent.readings.table.FAST_READERS), and
# what the slow tier adds. Thresholds, violation time and the recovery action have no query field.
SMI_FAST_FIELDS = (
    "temperature.gpu",
    "power.draw",
    "power.limit",
    "clocks.gr",
    "clocks.sm",
    "clocks.mem",
    "clocks_event_reasons.active",
    "utilization.gpu",
    "utilization.memory",
    "memory.used",
    "memory.total",
    "pstate",
    "fan.speed",
    "persistence_mode",
    "ecc.mode.current",
    "ecc.mode.pending",
)
SMI_SLOW_FIELDS = (
    "ecc.errors.corrected.volatile.total",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.aggregate.total",
    "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.pending",
    "pcie.link.gen.current",
    "pcie.link.width.current",
    "pcie.link.gen.max",
    "pcie.link.width.max",
)
# Older drivers name the clock-event field after throttling.
SMI_FIELD_ALIASES = {"clocks_event_reasons.active": "clocks_throttle_reasons.active"}
QUOTED = re.compile(r'"([A-Za-z0-9_.]+)"')
# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, as agent.backend.nvml reads it.
FIELD_RECOVERY_ACTION = 230
# The field-value batches of agent.backend.nvml (tests/test_bench_smoke.py holds them equal): fast
# (instant power, HBM temperature) and slow (energy, PCIe correctable/fatal, clock-event reason
# durations; NVLink counters join it on GPUs with NVLink).
FAST_FIELD_IDS = [186, 82]
SLOW_FIELD_IDS = [83, 173, 180, 74, 76, 269, 270, 271]
# nvmlGpmMetricId_t of the agent's activity readings.
GPM_METRIC_IDS = (2, 3, 5, 10, 20, 21, 61, 60)


# -- the raw getters ----------------------------------------------------------------------------


def sim_raw_calls(backend: GpuBackend, gpu: int) -> tuple[list[Call], list[Call]]:
    """(fast, slow) backend method calls, the same ones the collector makes."""
    fans = _quiet(backend.fan_count, gpu) or 0
    fast: list[Call] = [
        (backend.temperature_celsius, (gpu,)),
        (backend.power_usage_watts, (gpu,)),
        (backend.power_limit_watts, (gpu,)),
        (backend.clock_mhz, (gpu, ClockDomain.GRAPHICS)),
        (backend.clock_mhz, (gpu, ClockDomain.SM)),
        (backend.clock_mhz, (gpu, ClockDomain.MEMORY)),
        (backend.clock_event_reasons, (gpu,)),
        (backend.utilization, (gpu,)),
        (backend.memory_info, (gpu,)),
        (backend.performance_state, (gpu,)),
        (backend.fan_count, (gpu,)),
        *[(backend.fan_speed_percent, (gpu, fan)) for fan in range(fans)],
        (backend.persistence_enabled, (gpu,)),
        (backend.ecc_mode, (gpu,)),
        *_answering([(backend.gpm_activity, (gpu,)), (backend.fast_fields, (gpu,))], (GpuError,)),
    ]
    slow: list[Call] = [
        *[(backend.ecc_errors, (gpu, e, c)) for c in (EccCounter.VOLATILE, EccCounter.AGGREGATE) for e in EccErrorType],
        *_answering(
            [
                (backend.slow_fields, (gpu,)),
                (backend.nvlink_states, (gpu,)),
                (backend.fabric_info, (gpu,)),
                (backend.temperature_threshold_celsius, (gpu, TemperatureThreshold.MEM_MAX)),
                (backend.mig_mode, (gpu,)),
                *[(backend.max_clock_mhz, (gpu, domain)) for domain in ClockDomain],
                (backend.applications_clock_mhz, (gpu, ClockDomain.GRAPHICS)),
                (backend.applications_clock_mhz, (gpu, ClockDomain.MEMORY)),
                (backend.compute_processes, (gpu,)),
            ],
            (GpuError,),
        ),
        (backend.remapped_rows, (gpu,)),
        (backend.retired_pages_pending, (gpu,)),
        (backend.pcie_link, (gpu,)),
        (backend.pcie_replay_counter, (gpu,)),
        (backend.temperature_threshold_celsius, (gpu, TemperatureThreshold.SLOWDOWN)),
        (backend.temperature_threshold_celsius, (gpu, TemperatureThreshold.SHUTDOWN)),
        (backend.violation_time_ns, (gpu, ViolationPolicy.POWER)),
        (backend.violation_time_ns, (gpu, ViolationPolicy.THERMAL)),
        (backend.recovery_action, (gpu,)),
    ]
    return fast, slow


def _answering(calls: list[Call], errors: tuple[type[BaseException], ...]) -> list[Call]:
    """The calls that answer now: the agent stops asking what a GPU answered NOT_SUPPORTED."""
    kept = []
    for function, args in calls:
        try:
            function(*args)
        except errors:
            continue
        kept.append((function, args))
    return kept


class RawGpm:
    """The bare GPM calls of one loop: a sample into the buffer not holding the previous one, and
    nvmlGpmMetricsGet over the two (what the backend does, minus allocating a sample per loop)."""

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self.pynvml = pynvml
        self.handle = handle
        self.samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
        self.turn = 0
        self.taken = 0

    def __call__(self) -> None:
        pynvml = self.pynvml
        current = self.samples[self.turn]
        pynvml.nvmlGpmSampleGet(self.handle, current)
        self.taken += 1
        if self.taken > 1:
            request = pynvml.c_nvmlGpmMetricsGet_t()
            request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(GPM_METRIC_IDS)
            request.sample1 = self.samples[1 - self.turn]
            request.sample2 = current
            for position, metric in enumerate(GPM_METRIC_IDS):
                request.metrics[position].metricId = metric
            pynvml.nvmlGpmMetricsGet(request)
        self.turn = 1 - self.turn


def _quiet(function: Callable[..., Any], *args: Any) -> Any:
    try:
        return function(*args)
    except GpuError:
        return None


def _first_working(pynvml: Any, names: Sequence[str], *args: Any) -> tuple[str, Callable[..., Any]]:
    """The function the backend ends up calling: the newest name this library and driver both have."""
    available = [name for name in names if hasattr(pynvml, name)]
    for name in available[:-1]:
        try:
            getattr(pynvml, name)(*args)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                continue
        return name, getattr(pynvml, name)
    return available[-1], getattr(pynvml, available[-1])


def nvml_raw_calls(gpu: int, chosen: dict[str, str]) -> tuple[list[Call], list[Call]]:
    """(fast, slow) pynvml calls on a cached handle: the getters the NVML backend makes, bare."""
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    temperature_name, temperature = _first_working(
        pynvml, ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), handle, pynvml.NVML_TEMPERATURE_GPU
    )
    reasons_name, reasons = _first_working(
        pynvml, ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), handle
    )
    chosen.update(temperature=temperature_name, clock_event_reasons=reasons_name)
    try:
        fans = int(pynvml.nvmlDeviceGetNumFans(handle))
    except pynvml.NVMLError:
        fans = 0
    fast: list[Call] = [
        (temperature, (handle, pynvml.NVML_TEMPERATURE_GPU)),
        (pynvml.nvmlDeviceGetPowerUsage, (handle,)),
        (pynvml.nvmlDeviceGetPowerManagementLimit, (handle,)),
        (pynvml.nvmlDeviceGetClockInfo, (handle, int(ClockDomain.GRAPHICS))),
        (pynvml.nvmlDeviceGetClockInfo, (handle, int(ClockDomain.SM))),
        (pynvml.nvmlDeviceGetClockInfo, (handle, int(ClockDomain.MEMORY))),
        (reasons, (handle,)),
        (pynvml.nvmlDeviceGetUtilizationRates, (handle,)),
        (pynvml.nvmlDeviceGetMemoryInfo, (handle, pynvml.nvmlMemory_v2)),
        (pynvml.nvmlDeviceGetPerformanceState, (handle,)),
        (pynvml.nvmlDeviceGetNumFans, (handle,)),
        *[(pynvml.nvmlDeviceGetFanSpeed_v2, (handle, fan)) for fan in range(fans)],
        (pynvml.nvmlDeviceGetPersistenceMode, (handle,)),
        (pynvml.nvmlDeviceGetEccMode, (handle,)),
        (pynvml.nvmlDeviceGetFieldValues, (handle, FAST_FIELD_IDS)),
    ]
    try:
        gpm_supported = bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
    except pynvml.NVMLError:
        gpm_supported = False
    if gpm_supported:
        fast.append((RawGpm(pynvml, handle), ()))
    slow: list[Call] = [
        *[
            (pynvml.nvmlDeviceGetTotalEccErrors, (handle, int(e), int(c)))
            for c in (EccCounter.VOLATILE, EccCounter.AGGREGATE)
            for e in EccErrorType
        ],
        (pynvml.nvmlDeviceGetRemappedRows, (handle,)),
        (pynvml.nvmlDeviceGetRetiredPagesPendingStatus, (handle,)),
        (pynvml.nvmlDeviceGetCurrPcieLinkGeneration, (handle,)),
        (pynvml.nvmlDeviceGetCurrPcieLinkWidth, (handle,)),
        (pynvml.nvmlDeviceGetMaxPcieLinkGeneration, (handle,)),
        (pynvml.nvmlDeviceGetMaxPcieLinkWidth, (handle,)),
        (pynvml.nvmlDeviceGetPcieReplayCounter, (handle,)),
        (pynvml.nvmlDeviceGetTemperatureThreshold, (handle, int(TemperatureThreshold.SLOWDOWN))),
        (pynvml.nvmlDeviceGetTemperatureThreshold, (handle, int(TemperatureThreshold.SHUTDOWN))),
        (pynvml.nvmlDeviceGetViolationStatus, (handle, int(ViolationPolicy.POWER))),
        (pynvml.nvmlDeviceGetViolationStatus, (handle, int(ViolationPolicy.THERMAL))),
        (pynvml.nvmlDeviceGetFieldValues, (handle, [FIELD_RECOVERY_ACTION])),
        (pynvml.nvmlDeviceGetFieldValues, (handle, SLOW_FIELD_IDS)),
        *_answering(
            [
                (pynvml.nvmlDeviceGetNvLinkState, (handle, 0)),
                (pynvml.nvmlDeviceGetTemperatureThreshold, (handle, int(TemperatureThreshold.MEM_MAX))),
                (pynvml.nvmlDeviceGetMigMode, (handle,)),
                *[(pynvml.nvmlDeviceGetMaxClockInfo, (handle, int(domain))) for domain in ClockDomain],
                (pynvml.nvmlDeviceGetApplicationsClock, (handle, int(ClockDomain.GRAPHICS))),
                (pynvml.nvmlDeviceGetApplicationsClock, (handle, int(ClockDomain.MEMORY))),
                (pynvml.nvmlDeviceGetComputeRunningProcesses, (handle,)),
            ],
            (pynvml.NVMLError,),
        ),
    ]
    return fast, slow


def run_calls(calls: Sequence[Call], errors: tuple[type[BaseException], ...]) -> None:
    for function, args in calls:
        with contextlib.suppress(*errors):  # NOT_SUPPORTED and friends: the raw loop only pays for the call
            function(*args)


# -- measuring ----------------------------------------------------------------------------------


def lane_handoff(calls: int) -> dict[str, Any]:
    """A no-op through a BoundedRunner lane vs called directly, microseconds per call."""

    def noop() -> None:
        return None

    runner = BoundedRunner(timeout_seconds=2.0)
    try:
        for _ in range(200):
            runner.run("gpu0", noop)
        direct: list[float] = []
        lane: list[float] = []
        for _ in range(calls):
            begin = time.perf_counter()
            noop()
            direct.append(time.perf_counter() - begin)
            begin = time.perf_counter()
            runner.run("gpu0", noop)
            lane.append(time.perf_counter() - begin)
    finally:
        runner.shutdown()
    through = summarize(lane, 1e6, 1)
    bare = summarize(direct, 1e6, 2)
    return {
        "calls": calls,
        "direct_us": bare,
        "through_lane_us": through,
        "overhead_median_us": round(float(through["median"]) - float(bare["median"]), 1),
        "overhead_p90_us": round(float(through["p90"]) - float(bare["p90"]), 1),
    }


def smi_fields(smi: str) -> tuple[list[str], list[str], list[str]]:
    """(fast, full, unknown): the query fields this nvidia-smi accepts, old names where it needs them."""
    help_text = subprocess.run([smi, "--help-query-gpu"], capture_output=True, text=True, timeout=30).stdout
    # Entries read `"name"` or `"name" or "alias"` at the start of a line.
    known = {name for line in help_text.splitlines() if line.startswith('"') for name in QUOTED.findall(line)}

    def accepted(name: str) -> bool:
        if name in known:
            return True
        probe = [smi, f"--query-gpu={name}", "--format=csv,noheader"]
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0

    def pick(fields: Sequence[str]) -> tuple[list[str], list[str]]:
        chosen, unknown = [], []
        for name in fields:
            alias = SMI_FIELD_ALIASES.get(name)
            if accepted(name):
                chosen.append(name)
            elif alias and accepted(alias):
                chosen.append(alias)
            else:
                unknown.append(name)
        return chosen, unknown

    fast, unknown_fast = pick(SMI_FAST_FIELDS)
    slow, unknown_slow = pick(SMI_SLOW_FIELDS)
    return fast, fast + slow, unknown_fast + unknown_slow


def nvidia_smi_comparison(
    smi: str, poll_fast: Callable[[], object], poll_full: Callable[[], object], runs: int, budget_seconds: float
) -> dict[str, Any]:
    fast_fields, full_fields, unknown = smi_fields(smi)
    argv_fast = [smi, f"--query-gpu={','.join(fast_fields)}", "--format=csv,noheader,nounits"]
    argv_full = [smi, f"--query-gpu={','.join(full_fields)}", "--format=csv,noheader,nounits"]
    first = subprocess.run(argv_full, capture_output=True, text=True, timeout=60)
    if first.returncode != 0:
        return {"skipped": f"nvidia-smi exited {first.returncode}: {first.stderr.strip()[:300]}"}

    def smi_run(argv: list[str]) -> Callable[[], object]:
        return partial(timed_run, argv, 60.0)

    times = measure_rounds(
        {
            "agent_fast_lanes": poll_fast,
            "nvidia_smi_fast": smi_run(argv_fast),
            "agent_full_lanes": poll_full,
            "nvidia_smi_full": smi_run(argv_full),
        },
        min_rounds=min(5, runs),
        max_rounds=runs,
        budget_seconds=budget_seconds,
        warmup=1,
    )
    return {
        "command_fast": " ".join(argv_fast),
        "command_full": " ".join(argv_full),
        "fields_without_query_name": unknown,
        "sample_output": first.stdout.strip().splitlines()[:2],
        "per_run_ms": {name: summarize(values, 1e3) for name, values in times.items()},
        "smi_over_poll_fast": paired_ratio(times, "nvidia_smi_fast", "agent_fast_lanes"),
        "smi_over_poll_full": paired_ratio(times, "nvidia_smi_full", "agent_full_lanes"),
    }


# -- the benchmark ------------------------------------------------------------------------------


def open_bench_backend(backend_name: str, profile: str, state_dir: Path) -> GpuBackend:
    """The backend with nothing writable: every setter is refused before it reaches a GPU."""
    config = AgentConfig.model_validate(
        {"backend": backend_name, "simulated": SimulatedConfig(profile=profile), "state_dir": str(state_dir)}
    )
    return open_backend(config, writable_items=())


def run(args: argparse.Namespace, report: Report) -> None:
    with scratch_dir("gab-collect-") as directory:
        backend = open_bench_backend(args.backend, args.profile, directory / "state")
        try:
            measure(args, report, backend)
        finally:
            backend.shutdown()


def measure(args: argparse.Namespace, report: Report, backend: GpuBackend) -> None:
    count = backend.device_count()
    if args.gpus is not None:
        count = min(count, args.gpus)
    identities: list[GpuIdentity] = [backend.identity(gpu) for gpu in range(count)]
    raw_fast: list[Call] = []
    raw_slow: list[Call] = []
    chosen: dict[str, str] = {}
    raw_errors: tuple[type[BaseException], ...]
    if args.backend == "nvml":
        import pynvml

        raw_errors = (pynvml.NVMLError,)
        for gpu in range(count):
            fast, slow = nvml_raw_calls(gpu, chosen)
            raw_fast += fast
            raw_slow += slow
    else:
        raw_errors = (GpuError,)
        for gpu in range(count):
            fast, slow = sim_raw_calls(backend, gpu)
            raw_fast += fast
            raw_slow += slow
    raw_full = raw_fast + raw_slow
    runner = BoundedRunner(timeout_seconds=2.0)

    # What the collector remembers per GPU: readers answered NOT_SUPPORTED are not asked again.
    unsupported: dict[int, set[str]] = {identity.index: set() for identity in identities}

    def agent_poll(slow: bool) -> None:
        for identity in identities:
            sample_identified(backend, identity, slow=slow, unsupported=unsupported[identity.index])

    def agent_poll_lanes(slow: bool) -> None:
        for identity in identities:
            read = partial(sample_identified, backend, identity, slow=slow, unsupported=unsupported[identity.index])
            runner.run(f"gpu{identity.index}", read)

    report.parameters.update(
        gpus=count,
        max_rounds=args.rounds,
        budget_seconds=args.seconds,
        raw_calls_per_poll={"fast": len(raw_fast), "full": len(raw_full)},
        nvml_functions_chosen=chosen or None,
    )
    try:
        times = measure_rounds(
            {
                "agent_fast": partial(agent_poll, False),
                "agent_fast_lanes": partial(agent_poll_lanes, False),
                "raw_fast": partial(run_calls, raw_fast, raw_errors),
                "agent_full": partial(agent_poll, True),
                "raw_full": partial(run_calls, raw_full, raw_errors),
            },
            min_rounds=min(10, args.rounds),
            max_rounds=args.rounds,
            budget_seconds=args.seconds,
            warmup=3,
        )
        smi = shutil.which("nvidia-smi")
        if args.backend != "nvml":
            comparison: dict[str, Any] = {"skipped": "nvidia-smi reads real GPUs: compared on the nvml backend only"}
        elif smi is None:
            comparison = {"skipped": "nvidia-smi not found on PATH"}
        else:
            comparison = nvidia_smi_comparison(
                smi, partial(agent_poll_lanes, False), partial(agent_poll_lanes, True), args.smi_runs, args.seconds
            )
    finally:
        runner.shutdown()
    if "skipped" in comparison:
        report.note(f"nvidia-smi comparison skipped: {comparison['skipped']}")
    per_poll = {name: summarize(values, 1e3, 4) for name, values in times.items()}
    ratios = {
        "fast_poll_over_raw": paired_ratio(times, "agent_fast", "raw_fast"),
        "full_poll_over_raw": paired_ratio(times, "agent_full", "raw_full"),
        "fast_lanes_poll_over_raw": paired_ratio(times, "agent_fast_lanes", "raw_fast"),
    }
    handoff = lane_handoff(args.lane_calls)
    handoff["overhead_per_poll_us"] = round(handoff["overhead_median_us"] * count, 1)
    report.results.update(per_poll_ms=per_poll, ratios=ratios, lane_handoff=handoff, nvidia_smi=comparison)
    rows: list[list[object]] = [["variant", "median ms", "p90 ms", "rounds"]]
    rows += [[name, s["median"], s["p90"], s["n"]] for name, s in per_poll.items()]
    print_rows(f"one poll of {count} GPU(s), {args.backend} backend:", rows)
    print(f"  ratios (paired medians): {ratios}")
    print(
        f"  BoundedRunner hand-off: {handoff['overhead_median_us']} us per call "
        f"(p90 {handoff['overhead_p90_us']} us), {handoff['overhead_per_poll_us']} us per poll of {count} GPU(s)"
    )
    report.targets += [
        target("agent fast poll / raw getters", ratios["fast_poll_over_raw"], "<=", 1.3),
        target("agent fast+slow poll / raw getters", ratios["full_poll_over_raw"], "<=", 1.3),
    ]
    if "skipped" not in comparison:
        print(f"  nvidia-smi / poll: fast {comparison['smi_over_poll_fast']}, full {comparison['smi_over_poll_full']}")
        report.targets.append(target("nvidia-smi query / agent poll (fast)", comparison["smi_over_poll_fast"], ">=", 8))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python3 -m bench.collect_cost", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--gpus", type=int, help="poll only the first N GPUs (default: all)")
    parser.add_argument("--rounds", type=int, default=400, help="at most this many rounds (default 400)")
    parser.add_argument("--seconds", type=float, default=15.0, help="time budget per phase once 10 rounds ran")
    parser.add_argument("--smi-runs", type=int, default=30, help="nvidia-smi rounds at most (default 30)")
    parser.add_argument("--lane-calls", type=int, default=5000, help="hand-offs timed through one lane")
    args = parser.parse_args(argv)
    report = Report("collect_cost", args)
    run(args, report)
    return report.finish()


if __name__ == "__main__":
    main()
