"""The simulated backend: NVML values from the H200 fixture and NVML semantics (units, ranges,
NOT_SUPPORTED, permissions, pending modes, lost GPUs, events), state shared through a file."""

from __future__ import annotations

import functools
import inspect
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.backend.base import (
    SETTER_ITEMS,
    ClockDomain,
    EccCounter,
    EccErrorType,
    EnabledPending,
    GpuBackend,
    GpuEvent,
    GpuEventKind,
    GpuProcess,
    MemoryInfo,
    PcieLink,
    RemappedRows,
    TemperatureThreshold,
    Utilization,
    ViolationPolicy,
)
from agent.backend.errors import GpuError, GpuErrorKind, WriteRefused
from agent.backend.sim import (
    HGX_PCI_BUS_IDS,
    PROTOCOL_METHODS,
    REASON_GPU_IDLE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
    STATE_FILE_NAME,
    FabricState,
    GpmActivity,
    SimulatedBackend,
    gpm_activity,
    list_profiles,
    load_profile,
)
from agent.backend.sim.state import StateFile

REPO = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((REPO / "tests" / "fixtures" / "nvml-h200.json").read_text())["devices"][0]
#: The same H200 idle and under a bf16 matmul: GPM metrics and field values.
GPM_FIXTURE = json.loads((REPO / "tests" / "fixtures" / "nvml-h200-gpm-fields.json").read_text())
NVML_NOT_SUPPORTED = 3
MIB = 1 << 20
ALL_ITEMS = sorted(set(SETTER_ITEMS.values()))
RTX_NAME = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"


def make(tmp_path: Path, profile: str | Path = "h200", **kwargs: Any) -> SimulatedBackend:
    kwargs.setdefault("writable_items", ALL_ITEMS)
    backend = SimulatedBackend(profile, tmp_path / "state", **kwargs)
    backend.init()
    return backend


def gpu_error(kind: GpuErrorKind, call: Callable[[], object]) -> GpuError:
    with pytest.raises(GpuError) as info:
        call()
    assert info.value.kind == kind, info.value
    return info.value


# -- the H200 model is the fixture -----------------------------------------------------------


def test_h200_readings_match_the_fixture(tmp_path: Path) -> None:
    b = make(tmp_path)
    assert b.device_count() == 1
    assert b.driver_version() == "580.159.04"
    ident = b.identity(0)
    assert ident.name == FIXTURE["nvmlDeviceGetName"]
    assert ident.vbios_version == FIXTURE["nvmlDeviceGetVbiosVersion"]
    assert ident.minor_number == FIXTURE["nvmlDeviceGetMinorNumber"]
    assert b.temperature_celsius(0) == FIXTURE["nvmlDeviceGetTemperature:0"]
    for threshold, key in [
        (TemperatureThreshold.SHUTDOWN, "nvmlDeviceGetTemperatureThreshold:0"),
        (TemperatureThreshold.SLOWDOWN, "nvmlDeviceGetTemperatureThreshold:1"),
        (TemperatureThreshold.GPU_MAX, "nvmlDeviceGetTemperatureThreshold:3"),
    ]:
        assert b.temperature_threshold_celsius(0, threshold) == FIXTURE[key]
    # NVML answers milliwatts; the protocol answers watts.
    assert b.power_usage_watts(0) == pytest.approx(FIXTURE["nvmlDeviceGetPowerUsage"] / 1000) == 123.455
    assert b.power_limit_watts(0) == FIXTURE["nvmlDeviceGetPowerManagementLimit"] / 1000 == 700.0
    assert b.power_limit_constraints_watts(0) == (200.0, 700.0)
    assert b.default_power_limit_watts(0) == FIXTURE["nvmlDeviceGetPowerManagementDefaultLimit"] / 1000
    assert b.total_energy_joules(0) == pytest.approx(FIXTURE["nvmlDeviceGetTotalEnergyConsumption"] / 1000)
    assert b.clock_mhz(0, ClockDomain.GRAPHICS) == FIXTURE["nvmlDeviceGetClockInfo:0"]
    assert b.clock_mhz(0, ClockDomain.SM) == FIXTURE["nvmlDeviceGetClockInfo:1"]
    assert b.clock_mhz(0, ClockDomain.MEMORY) == FIXTURE["nvmlDeviceGetClockInfo:2"]
    assert b.max_clock_mhz(0, ClockDomain.GRAPHICS) == FIXTURE["nvmlDeviceGetMaxClockInfo:0"]
    assert b.max_clock_mhz(0, ClockDomain.MEMORY) == FIXTURE["nvmlDeviceGetMaxClockInfo:2"]
    assert b.supported_memory_clocks_mhz(0) == FIXTURE["nvmlDeviceGetSupportedMemoryClocks"]
    graphics = b.supported_graphics_clocks_mhz(0, 3201)
    assert graphics[:5] == FIXTURE["nvmlDeviceGetSupportedGraphicsClocks:first_mem"]
    assert graphics == list(range(1980, 344, -15))  # down to 345 MHz in 15 MHz steps
    assert b.supported_graphics_clocks_mhz(0, 2201) == graphics
    assert b.clock_event_reasons(0) == FIXTURE["nvmlDeviceGetCurrentClocksEventReasons"] == REASON_GPU_IDLE
    assert b.fan_count(0) == FIXTURE["nvmlDeviceGetNumFans"] == 0
    assert b.persistence_enabled(0) is bool(FIXTURE["nvmlDeviceGetPersistenceMode"])
    assert b.ecc_mode(0) == EnabledPending(current=True, pending=True)
    assert b.ecc_errors(0, EccErrorType.UNCORRECTED, EccCounter.AGGREGATE) == FIXTURE["nvmlDeviceGetTotalEccErrors:1:1"]
    assert b.ecc_errors(0, EccErrorType.CORRECTED, EccCounter.AGGREGATE) == FIXTURE["nvmlDeviceGetTotalEccErrors:0:1"]
    gpu_error(GpuErrorKind.NOT_SUPPORTED, lambda: b.retired_pages_pending(0))
    assert b.remapped_rows(0) == RemappedRows(0, 0, False, False)
    memory = FIXTURE["nvmlDeviceGetMemoryInfo"]
    # v2, as nvidia-smi shows it: the driver's reserved memory (v1's "used" at idle) is not used
    assert b.memory_info(0) == MemoryInfo(memory["total"], 0, memory["free"], reserved_bytes=memory["used"])
    assert b.utilization(0) == Utilization(0, 0)
    assert b.performance_state(0) == FIXTURE["nvmlDeviceGetPerformanceState"]
    assert b.mig_mode(0) == EnabledPending(False, False)
    assert b.compute_processes(0) == []
    assert b.pcie_link(0) == PcieLink(5, 16, 5, 16)
    assert b.pcie_replay_counter(0) == FIXTURE["nvmlDeviceGetPcieReplayCounter"]
    assert b.violation_time_ns(0, ViolationPolicy.POWER) == 0
    assert b.violation_time_ns(0, ViolationPolicy.THERMAL) == 0
    gpu_error(GpuErrorKind.NOT_SUPPORTED, lambda: b.fan_speed_percent(0, 0))


def test_backend_implements_every_protocol_method_with_its_signature(tmp_path: Path) -> None:
    b = make(tmp_path)
    assert isinstance(b, GpuBackend)
    assert b.name == "simulated"
    for name, member in vars(GpuBackend).items():
        if callable(member) and not name.startswith("_"):
            ours = inspect.signature(getattr(SimulatedBackend, name))
            assert list(ours.parameters) == list(inspect.signature(member).parameters), name


def test_identities_are_deterministic_and_hgx_like(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x8")
    idents = [b.identity(i) for i in range(b.device_count())]
    assert [i.pci_bus_id for i in idents] == list(HGX_PCI_BUS_IDS)
    assert [i.minor_number for i in idents] == list(range(8))
    assert all(
        re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", i.uuid) for i in idents
    )
    assert all(re.fullmatch(r"1654\d{9}", i.serial) for i in idents)
    assert len({i.uuid for i in idents}) == len({i.serial for i in idents}) == 8
    again = SimulatedBackend("h200x8", tmp_path / "elsewhere")
    again.init()
    assert again.identity(3) == idents[3]
    other = make(tmp_path / "x", "h200x2")
    assert other.identity(0).uuid != idents[0].uuid  # derived from (profile, index)


def test_rtx_pro_6000_board(tmp_path: Path) -> None:
    b = make(tmp_path, "rtx-pro-6000x2")
    assert b.device_count() == 2
    assert b.identity(0).name == RTX_NAME
    assert b.identity(1).pci_bus_id == "00000000:21:00.0"
    assert b.memory_info(0).total_bytes == 97887 * 1024 * 1024
    assert b.power_limit_constraints_watts(0) == (150.0, 600.0)
    assert b.default_power_limit_watts(0) == b.power_limit_watts(0) == 600.0
    assert b.fan_count(0) == 2
    assert b.fan_speed_range_percent(0) == (30, 100)
    assert b.persistence_enabled(0) is False
    assert b.ecc_mode(0) == EnabledPending(False, False)
    assert b.mig_mode(0) == EnabledPending(False, False)  # MIG exists on RTX PRO 6000 Blackwell (R575+)
    assert b.remapped_rows(0) == RemappedRows(0, 0, False, False)
    gpu_error(GpuErrorKind.NOT_SUPPORTED, lambda: b.retired_pages_pending(0))
    gpu_error(GpuErrorKind.NOT_SUPPORTED, lambda: b.temperature_threshold_celsius(0, TemperatureThreshold.MEM_MAX))
    # ECC counters are not available while ECC is off.
    gpu_error(GpuErrorKind.NOT_SUPPORTED, lambda: b.ecc_errors(0, EccErrorType.CORRECTED, EccCounter.VOLATILE))
    assert b.performance_state(0) == 8
    assert b.clock_mhz(0, ClockDomain.MEMORY) == 405
    assert b.max_clock_mhz(0, ClockDomain.GRAPHICS) == b.supported_graphics_clocks_mhz(0, 14001)[0] == 2625
    assert b.pcie_link(0) == PcieLink(5, 16, 5, 16)


# -- setters ---------------------------------------------------------------------------------

Check = Callable[[SimulatedBackend], bool]
SETTER_CASES: list[tuple[str, str, tuple[Any, ...], Check]] = [
    ("h200", "set_power_limit_watts", (0, 450.5), lambda b: b.power_limit_watts(0) == 450.5),
    (
        "h200",
        "set_locked_clocks_mhz",
        (0, ClockDomain.GRAPHICS, 1500, 1755),
        lambda b: b.locked_clocks_mhz(0, ClockDomain.GRAPHICS) == (1500, 1755),
    ),
    (
        "h200",
        "set_locked_clocks_mhz",
        (0, ClockDomain.MEMORY, 2201, 2201),
        lambda b: b.locked_clocks_mhz(0, ClockDomain.MEMORY) == (2201, 2201),
    ),
    (
        "h200",
        "reset_locked_clocks",
        (0, ClockDomain.GRAPHICS),
        lambda b: b.locked_clocks_mhz(0, ClockDomain.GRAPHICS) is None,
    ),
    ("h200", "set_persistence", (0, False), lambda b: b.persistence_enabled(0) is False),
    ("h200", "set_ecc_mode", (0, False), lambda b: b.ecc_mode(0) == EnabledPending(current=True, pending=False)),
    ("rtx-pro-6000", "set_fan_speed_percent", (0, 1, 64), lambda b: b.fan_speed_percent(0, 1) == 64),
    ("rtx-pro-6000", "set_fan_automatic", (0, 0), lambda b: b.fan_manual(0, 0) is False),
    ("rtx-pro-6000", "set_persistence", (0, True), lambda b: b.persistence_enabled(0) is True),
]
SETTER_IDS = [f"{profile}-{setter}-{i}" for i, (profile, setter, _, _) in enumerate(SETTER_CASES)]


@pytest.mark.parametrize(("profile", "setter", "args", "check"), SETTER_CASES, ids=SETTER_IDS)
def test_setter_works_when_writable(
    tmp_path: Path, profile: str, setter: str, args: tuple[Any, ...], check: Check
) -> None:
    b = make(tmp_path, profile, writable_items=[SETTER_ITEMS[setter]])
    getattr(b, setter)(*args)
    assert check(b)
    # ... and it is in the state file: a fresh backend on the same state_dir sees it.
    fresh = make(tmp_path, profile, writable_items=())
    assert check(fresh)


@pytest.mark.parametrize(("profile", "setter", "args", "check"), SETTER_CASES, ids=SETTER_IDS)
def test_setter_refused_when_item_not_writable(
    tmp_path: Path, profile: str, setter: str, args: tuple[Any, ...], check: Check
) -> None:
    others = [item for item in ALL_ITEMS if item != SETTER_ITEMS[setter]]
    # The guard comes before everything: before root, before the lost GPU, before init.
    b = SimulatedBackend(profile, tmp_path / "state", writable_items=others, privileged=False)
    b.set_lost(0)
    state = tmp_path / "state" / STATE_FILE_NAME
    before = state.read_bytes()
    with pytest.raises(WriteRefused) as info:
        getattr(b, setter)(*args)
    assert info.value.item == SETTER_ITEMS[setter]
    assert info.value.operation == setter
    assert state.read_bytes() == before


@pytest.mark.parametrize(("profile", "setter", "args", "check"), SETTER_CASES, ids=SETTER_IDS)
def test_setter_needs_root(tmp_path: Path, profile: str, setter: str, args: tuple[Any, ...], check: Check) -> None:
    b = make(tmp_path, profile, privileged=False)
    before = (tmp_path / "state").exists()
    err = gpu_error(GpuErrorKind.NO_PERMISSION, lambda: getattr(b, setter)(*args))
    assert err.gpu == 0 and err.call == setter
    assert (tmp_path / "state").exists() == before  # nothing was written


@pytest.mark.parametrize(("profile", "setter", "args", "check"), SETTER_CASES, ids=SETTER_IDS)
def test_setter_on_lost_gpu(tmp_path: Path, profile: str, setter: str, args: tuple[Any, ...], check: Check) -> None:
    b = make(tmp_path, profile)
    b.set_lost(0)
    gpu_error(GpuErrorKind.GPU_LOST, lambda: getattr(b, setter)(*args))


@pytest.mark.parametrize(
    ("profile", "setter", "args", "range_text"),
    [
        ("h200", "set_power_limit_watts", (0, 199.9), "200-700 W"),
        ("h200", "set_power_limit_watts", (0, 701), "200-700 W"),
        ("rtx-pro-6000", "set_power_limit_watts", (0, 100), "150-600 W"),
        ("h200", "set_locked_clocks_mhz", (0, ClockDomain.GRAPHICS, 300, 1500), "345-1980 MHz"),
        ("h200", "set_locked_clocks_mhz", (0, ClockDomain.GRAPHICS, 1500, 2100), "345-1980 MHz"),
        ("h200", "set_locked_clocks_mhz", (0, ClockDomain.GRAPHICS, 1600, 1500), "345-1980 MHz"),
        ("h200", "set_locked_clocks_mhz", (0, ClockDomain.MEMORY, 1000, 3201), "2201-3201 MHz"),
        ("rtx-pro-6000", "set_locked_clocks_mhz", (0, ClockDomain.GRAPHICS, 1500, 2700), "180-2625 MHz"),
        ("rtx-pro-6000", "set_fan_speed_percent", (0, 0, 20), "30-100 %"),
        ("rtx-pro-6000", "set_fan_speed_percent", (0, 0, 101), "30-100 %"),
    ],
)
def test_setter_out_of_range_names_the_range(
    tmp_path: Path, profile: str, setter: str, args: tuple[Any, ...], range_text: str
) -> None:
    b = make(tmp_path, profile)
    err = gpu_error(GpuErrorKind.INVALID_ARGUMENT, lambda: getattr(b, setter)(*args))
    assert range_text in str(err)
    assert b.power_limit_watts(0) == b.default_power_limit_watts(0)
    assert b.locked_clocks_mhz(0, ClockDomain.GRAPHICS) is None
    assert not (tmp_path / "state" / STATE_FILE_NAME).exists()  # a refused call writes nothing


def test_invalid_gpu_index_and_domains(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x2")
    gpu_error(GpuErrorKind.INVALID_ARGUMENT, lambda: b.temperature_celsius(2))
    gpu_error(GpuErrorKind.INVALID_ARGUMENT, lambda: b.set_power_limit_watts(-1, 500))
    gpu_error(GpuErrorKind.INVALID_ARGUMENT, lambda: b.set_locked_clocks_mhz(0, ClockDomain.SM, 1500, 1500))
    gpu_error(GpuErrorKind.INVALID_ARGUMENT, lambda: b.locked_clocks_mhz(0, ClockDomain.SM))
    err = gpu_error(GpuErrorKind.INVALID_ARGUMENT, lambda: b.supported_graphics_clocks_mhz(0, 1000))
    assert "[3201, 2201]" in str(err)
    with pytest.raises(ValueError, match="no GPU 5"):
        b.inject_xid(5, 79)


# -- clocks, power and thermals ----------------------------------------------------------------


def test_locked_clocks_drive_the_sm_clock_under_load(tmp_path: Path) -> None:
    b = make(tmp_path, "h200")
    assert b.locked_clocks_mhz(0, ClockDomain.GRAPHICS) is None
    assert b.locked_clocks_mhz(0, ClockDomain.MEMORY) is None
    b.set_locked_clocks_mhz(0, ClockDomain.GRAPHICS, 1410, 1755)
    assert b.clock_mhz(0, ClockDomain.SM) == 1755  # idle: the idle clock, clamped into the range
    b.set_processes(0, [4242])
    assert b.clock_mhz(0, ClockDomain.SM) == b.clock_mhz(0, ClockDomain.GRAPHICS) == 1755
    assert b.clock_event_reasons(0) == 0
    b.set_locked_clocks_mhz(0, ClockDomain.MEMORY, 2201, 2201)
    assert b.clock_mhz(0, ClockDomain.MEMORY) == 2201
    b.reset_locked_clocks(0, ClockDomain.GRAPHICS)
    b.reset_locked_clocks(0, ClockDomain.GRAPHICS)  # unlocking twice is fine, as with NVML
    assert b.locked_clocks_mhz(0, ClockDomain.GRAPHICS) is None
    assert b.clock_mhz(0, ClockDomain.SM) == 1980


def test_load_power_cap_and_thermal_slowdown(tmp_path: Path) -> None:
    b = make(tmp_path, "h200")
    b.set_processes(0, [100, 101])
    assert b.utilization(0) == Utilization(100, 62)
    assert b.performance_state(0) == 0
    assert b.power_usage_watts(0) == 655.0
    assert b.temperature_celsius(0) == 66
    processes = b.compute_processes(0)
    assert [p.pid for p in processes] == [100, 101]
    assert all(isinstance(p, GpuProcess) and p.used_memory_bytes for p in processes)
    info = b.memory_info(0)
    assert info.used_bytes == sum(p.used_memory_bytes or 0 for p in processes)  # v2: reserved not counted
    assert info.reserved_bytes == 644939776
    assert info.free_bytes == info.total_bytes - info.used_bytes - info.reserved_bytes > 0

    b.set_power_limit_watts(0, 300)
    assert b.power_usage_watts(0) == 300.0
    assert b.clock_event_reasons(0) == REASON_SW_POWER_CAP
    capped = b.clock_mhz(0, ClockDomain.SM)
    assert capped < 1980 and capped in b.supported_graphics_clocks_mhz(0, 3201)
    assert 36 < b.temperature_celsius(0) < 66  # cooler at lower power

    b.set_temperature(0, 90)
    reasons = b.clock_event_reasons(0)
    assert reasons & REASON_SW_THERMAL and reasons & REASON_HW_THERMAL and reasons & REASON_HW_SLOWDOWN
    assert b.clock_mhz(0, ClockDomain.SM) <= capped // 2
    b.set_temperature(0, None)
    b.set_power_usage(0, 123.4)
    b.set_clock_event_reasons(0, REASON_HW_SLOWDOWN)
    assert b.power_usage_watts(0) == 123.4
    assert b.clock_event_reasons(0) == REASON_HW_SLOWDOWN
    with pytest.raises(ValueError, match="outside the supported"):
        b.set_clock_event_reasons(0, 0x1000)


def test_advance_grows_violation_counters_and_energy(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x2")
    b.set_processes(0, [7])
    b.set_power_limit_watts(0, 400)
    energy_before = b.total_energy_joules(0)
    b.advance(2.5)
    assert b.violation_time_ns(0, ViolationPolicy.POWER) == 2_500_000_000
    assert b.violation_time_ns(0, ViolationPolicy.TOTAL_APP_CLOCKS) == 2_500_000_000
    assert b.violation_time_ns(0, ViolationPolicy.THERMAL) == 0
    assert b.total_energy_joules(0) == pytest.approx(energy_before + 400 * 2.5)
    # GPU 1 is idle: only the low-utilisation counter grows.
    assert b.violation_time_ns(1, ViolationPolicy.LOW_UTILIZATION) == 2_500_000_000
    assert b.violation_time_ns(1, ViolationPolicy.POWER) == 0
    b.set_temperature(1, 91)
    b.advance(1)
    assert b.violation_time_ns(1, ViolationPolicy.THERMAL) == 1_000_000_000
    assert b.violation_time_ns(0, ViolationPolicy.POWER) == 3_500_000_000
    with pytest.raises(ValueError):
        b.advance(-1)


def test_a_real_time_node_counts_the_time_that_passes(tmp_path: Path) -> None:
    """The daemon's and the demo's node: counters grow with the clock, each stretch at the readings
    that held during it, and a reader (another process) sees them as of now without writing."""
    now = [1000.0]
    b = make(tmp_path, "h200x2", counter_clock=lambda: now[0])
    energy = b.total_energy_joules(0)  # the first read starts the clock
    assert b.gpm_activity(0) is None  # nothing to difference yet
    idle_watts = b.power_usage_watts(0)
    now[0] += 10
    assert b.total_energy_joules(0) == pytest.approx(energy + idle_watts * 10)
    assert b.violation_time_ns(0, ViolationPolicy.LOW_UTILIZATION) == 10_000_000_000
    idle = b.gpm_activity(0)
    assert idle is not None and idle.sm_active_ratio == 0.0
    b.set_processes(0, [7])  # load from now on: the 10 s before stay idle
    b.set_power_limit_watts(0, 400)
    now[0] += 5
    assert b.total_energy_joules(0) == pytest.approx(energy + idle_watts * 10 + 400 * 5)
    assert b.violation_time_ns(0, ViolationPolicy.POWER) == 5_000_000_000
    busy = b.gpm_activity(0)
    assert busy is not None and busy.sm_active_ratio > 0.5
    # Another process reads the same node: the same counters, and the read writes nothing.
    written = b.state_path.stat().st_mtime_ns
    reader = SimulatedBackend("h200x2", tmp_path / "state", counter_clock=lambda: now[0])
    reader.init()
    assert reader.total_energy_joules(0) == pytest.approx(b.total_energy_joules(0))
    assert b.state_path.stat().st_mtime_ns == written
    # A state from before the clock's epoch (the host rebooted, the state file stayed): the clock
    # starts again from the settled counters, and time passes from there.
    settled = energy + idle_watts * 10
    now[0] = 50.0
    assert b.total_energy_joules(0) == pytest.approx(settled)
    now[0] += 2
    assert b.total_energy_joules(0) == pytest.approx(settled + 400 * 2)


def test_a_reader_that_may_not_write_the_state_still_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first read of a fresh state starts the counter clock by writing it once; a reader
    without write access (another user's `status --direct`) answers from the settled counters."""
    make(tmp_path, "h200x2")  # a state file written without a counter clock: no start recorded
    reader = SimulatedBackend("h200x2", tmp_path / "state", counter_clock=lambda: 1000.0)
    reader.init()

    def refused(self: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(StateFile, "save", refused)
    assert reader.total_energy_joules(0) > 0
    assert reader.gpm_activity(0) is None


def test_a_test_node_moves_only_with_advance(tmp_path: Path) -> None:
    now = [1000.0]
    b = make(tmp_path, "h200x2", clock=lambda: now[0])  # the event clock; no counter clock
    energy = b.total_energy_joules(0)
    b.set_processes(0, [7])
    now[0] += 3600
    assert b.total_energy_joules(0) == energy
    b.gpm_activity(0)
    assert b.gpm_activity(0) is None


# -- fans ------------------------------------------------------------------------------------


def test_fans_not_supported_on_h200(tmp_path: Path) -> None:
    b = make(tmp_path, "h200")
    assert b.fan_count(0) == 0
    for call in (
        lambda: b.fan_speed_percent(0, 0),
        lambda: b.fan_manual(0, 0),
        lambda: b.fan_speed_range_percent(0),
        lambda: b.set_fan_speed_percent(0, 0, 50),
        lambda: b.set_fan_automatic(0, 0),
    ):
        gpu_error(GpuErrorKind.NOT_SUPPORTED, call)


def test_fans_on_rtx_pro_6000(tmp_path: Path) -> None:
    b = make(tmp_path, "rtx-pro-6000")
    assert [b.fan_manual(0, f) for f in (0, 1)] == [False, False]
    idle = b.fan_speed_percent(0, 0)
    assert idle == 30  # the automatic curve at 32 C, floored at the minimum
    b.set_processes(0, [9])
    assert b.temperature_celsius(0) == 81
    loaded = b.fan_speed_percent(0, 0)
    assert loaded == 77 > idle  # automatic control follows temperature
    b.set_fan_speed_percent(0, 1, 100)
    assert (b.fan_manual(0, 1), b.fan_speed_percent(0, 1)) == (True, 100)
    assert (b.fan_manual(0, 0), b.fan_speed_percent(0, 0)) == (False, loaded)
    b.set_fan_automatic(0, 1)
    assert (b.fan_manual(0, 1), b.fan_speed_percent(0, 1)) == (False, loaded)
    gpu_error(GpuErrorKind.INVALID_ARGUMENT, lambda: b.fan_speed_percent(0, 2))
    gpu_error(GpuErrorKind.INVALID_ARGUMENT, lambda: b.set_fan_speed_percent(0, 2, 50))


# -- modes: ECC, persistence, MIG; reboot and reset -------------------------------------------


def test_ecc_pending_until_reboot(tmp_path: Path) -> None:
    b = make(tmp_path, "rtx-pro-6000")
    b.set_ecc_mode(0, True)
    assert b.ecc_mode(0) == EnabledPending(current=False, pending=True)
    gpu_error(GpuErrorKind.NOT_SUPPORTED, lambda: b.ecc_errors(0, EccErrorType.CORRECTED, EccCounter.VOLATILE))
    b.set_persistence(0, True)  # immediate
    assert b.persistence_enabled(0) is True
    b.reboot()
    assert b.ecc_mode(0) == EnabledPending(current=True, pending=True)
    assert b.ecc_errors(0, EccErrorType.CORRECTED, EccCounter.VOLATILE) == 0
    assert b.persistence_enabled(0) is False  # persistence mode does not survive a reboot


def test_reboot_restores_boot_defaults_and_clears_faults(tmp_path: Path) -> None:
    b = make(tmp_path, "rtx-pro-6000x2")
    b.set_power_limit_watts(0, 300)
    b.set_locked_clocks_mhz(0, ClockDomain.GRAPHICS, 1500, 1500)
    b.set_fan_speed_percent(0, 0, 80)
    b.add_ecc_errors(0, corrected=3, uncorrected=1)
    b.set_remapped_rows(0, correctable=2, uncorrectable=1, pending=True)
    b.set_processes(0, [1])
    b.set_lost(1)
    b.set_temperature(0, 99)
    b.fail_call(0, "utilization", GpuErrorKind.UNKNOWN)
    b.inject_xid(0, 31)
    b.advance(5)
    b.reboot()
    assert b.power_limit_watts(0) == 600.0
    assert b.locked_clocks_mhz(0, ClockDomain.GRAPHICS) is None
    assert b.fan_manual(0, 0) is False
    assert b.identity(1).index == 1  # no longer lost
    assert b.temperature_celsius(0) == 32
    assert b.utilization(0) == Utilization(0, 0)
    assert b.compute_processes(0) == []
    assert b.remapped_rows(0) == RemappedRows(2, 1, pending=False, failed=False)
    assert b.violation_time_ns(0, ViolationPolicy.THERMAL) == 0
    assert b.wait_events(0) == []


def test_reset_gpu(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x2")
    b.set_power_limit_watts(0, 500)
    b.set_ecc_mode(0, False)
    b.inject_ecc_event(0, uncorrected=True)
    b.set_reset_required(0)
    gpu_error(GpuErrorKind.RESET_REQUIRED, lambda: b.temperature_celsius(0))
    assert b.identity(0).index == 0  # still identifiable
    b.set_processes(0, [77])
    err = gpu_error(GpuErrorKind.IN_USE, lambda: b.reset_gpu(0))
    assert "77" in str(err)
    unprivileged = make(tmp_path, "h200x2", privileged=False)
    gpu_error(GpuErrorKind.NO_PERMISSION, lambda: unprivileged.reset_gpu(0))
    b.set_processes(0, [])
    b.reset_gpu(0)
    assert b.power_limit_watts(0) == 700.0
    assert b.ecc_mode(0) == EnabledPending(current=False, pending=False)  # the pending mode applied
    b.set_ecc_mode(0, True)
    b.reset_gpu(0)
    assert b.ecc_errors(0, EccErrorType.UNCORRECTED, EccCounter.VOLATILE) == 0
    assert b.ecc_errors(0, EccErrorType.UNCORRECTED, EccCounter.AGGREGATE) == 1
    b.set_lost(1)
    gpu_error(GpuErrorKind.GPU_LOST, lambda: b.reset_gpu(1))


# -- faults ------------------------------------------------------------------------------------


#: The per-GPU readings that take nothing but the GPU index.
GPU_ONLY_READINGS = """
    identity temperature_celsius power_usage_watts clock_event_reasons utilization memory_info performance_state
    power_limit_watts power_limit_constraints_watts default_power_limit_watts supported_memory_clocks_mhz fan_count
    fan_speed_range_percent persistence_enabled ecc_mode remapped_rows retired_pages_pending pcie_link
    pcie_replay_counter mig_mode compute_processes recovery_action gpm_activity fast_fields slow_fields
    nvlink_states fabric_info
"""
#: Every per-GPU reading of the protocol, with what it takes after the GPU index.
PER_GPU_READINGS: dict[str, tuple[object, ...]] = {
    **dict.fromkeys(GPU_ONLY_READINGS.split(), ()),
    "clock_mhz": (ClockDomain.SM,),
    "temperature_threshold_celsius": (TemperatureThreshold.SHUTDOWN,),
    "max_clock_mhz": (ClockDomain.GRAPHICS,),
    "supported_graphics_clocks_mhz": (3201,),
    "locked_clocks_mhz": (ClockDomain.GRAPHICS,),
    "fan_speed_percent": (0,),
    "fan_manual": (0,),
    "ecc_errors": (EccErrorType.CORRECTED, EccCounter.VOLATILE),
    "violation_time_ns": (ViolationPolicy.POWER,),
    "applications_clock_mhz": (ClockDomain.GRAPHICS,),
}


def every_per_gpu_reading(b: SimulatedBackend, gpu: int) -> Iterator[Callable[[], object]]:
    for name, arguments in PER_GPU_READINGS.items():
        yield functools.partial(getattr(b, name), gpu, *arguments)


def test_lost_gpu(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x2")
    b.set_lost(1)
    calls = list(every_per_gpu_reading(b, 1))
    library = {"init", "shutdown", "driver_version", "cuda_driver_version", "device_count", "wait_events"}
    assert set(PER_GPU_READINGS) == PROTOCOL_METHODS - library - set(SETTER_ITEMS)  # every per-GPU reading
    for call in calls:
        err = gpu_error(GpuErrorKind.GPU_LOST, call)
        assert err.gpu == 1
    assert b.device_count() == 2  # NVML keeps counting it until the driver reloads
    assert b.temperature_celsius(0) == 36
    err = gpu_error(GpuErrorKind.GPU_LOST, lambda: b.wait_events(1))
    assert err.gpu == 1
    assert b.wait_events(0.05) == []  # raised once
    b.set_lost(1, False)
    assert b.temperature_celsius(1) == 36


def test_fail_call_and_clear(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x2")
    b.fail_call(1, "power_usage_watts", GpuErrorKind.UNKNOWN)
    assert b.power_usage_watts(0) == 123.455
    gpu_error(GpuErrorKind.UNKNOWN, lambda: b.power_usage_watts(1))
    b.fail_call(None, "temperature_celsius", GpuErrorKind.TIMEOUT)
    for gpu in (0, 1):
        gpu_error(GpuErrorKind.TIMEOUT, functools.partial(b.temperature_celsius, gpu))
    # A second process sees the injected failure too.
    other = make(tmp_path, "h200x2")
    gpu_error(GpuErrorKind.UNKNOWN, lambda: other.power_usage_watts(1))
    b.fail_call(None, "temperature_celsius", None)
    b.fail_call(1, "power_usage_watts", None)
    assert b.temperature_celsius(1) == 36
    assert other.power_usage_watts(1) == 123.455
    b.fail_call(None, "init", GpuErrorKind.DRIVER_NOT_LOADED)
    fresh = SimulatedBackend("h200x2", tmp_path / "state")
    gpu_error(GpuErrorKind.DRIVER_NOT_LOADED, fresh.init)
    gpu_error(GpuErrorKind.UNINITIALIZED, fresh.device_count)
    with pytest.raises(ValueError, match="not a GpuBackend method"):
        b.fail_call(0, "no_such_call", GpuErrorKind.UNKNOWN)
    with pytest.raises(ValueError, match="library call"):
        b.fail_call(0, "device_count", GpuErrorKind.UNKNOWN)


def test_hang_call_sleeps_without_blocking_other_calls(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x2")
    b.hang_call(0, "power_usage_watts", 1.5)
    result: list[float] = []
    started = time.monotonic()
    hung = threading.Thread(target=lambda: result.append(b.power_usage_watts(0)))
    hung.start()
    time.sleep(0.05)
    assert b.power_usage_watts(1) == 123.455  # another GPU answers meanwhile
    assert b.temperature_celsius(0) == 36  # and so does another call on the hung GPU
    assert time.monotonic() - started < 1.0
    hung.join()
    assert result == [123.455]
    assert time.monotonic() - started >= 1.5
    b.hang_call(0, "power_usage_watts", None)
    started = time.monotonic()
    b.power_usage_watts(0)
    assert time.monotonic() - started < 1.0


def test_calls_need_init(tmp_path: Path) -> None:
    b = SimulatedBackend("h200", tmp_path / "state")
    gpu_error(GpuErrorKind.UNINITIALIZED, lambda: b.temperature_celsius(0))
    gpu_error(GpuErrorKind.UNINITIALIZED, lambda: b.wait_events(0))
    b.init()
    assert b.driver_version() == "580.159.04"
    b.shutdown()
    b.shutdown()  # safe twice
    gpu_error(GpuErrorKind.UNINITIALIZED, b.device_count)


# -- events --------------------------------------------------------------------------------------


def test_wait_events_delivers_injections(tmp_path: Path) -> None:
    now = [1000.0]
    b = make(tmp_path, "h200x2", clock=lambda: now[0])
    started = time.monotonic()
    assert b.wait_events(0.2) == []
    assert 0.2 <= time.monotonic() - started < 1.5
    b.inject_xid(1, 79)
    now[0] = 1001.0
    b.inject_ecc_event(0, uncorrected=False)
    b.inject_ecc_event(0, uncorrected=True)
    events = b.wait_events(5)
    assert [(e.gpu, e.kind, e.data) for e in events] == [
        (1, GpuEventKind.XID, 79),
        (0, GpuEventKind.SINGLE_BIT_ECC, 0),
        (0, GpuEventKind.DOUBLE_BIT_ECC, 0),
    ]
    assert [e.timestamp_seconds for e in events] == [1000.0, 1001.0, 1001.0]
    assert b.wait_events(0) == []
    assert b.ecc_errors(0, EccErrorType.CORRECTED, EccCounter.VOLATILE) == 1
    assert b.ecc_errors(0, EccErrorType.UNCORRECTED, EccCounter.AGGREGATE) == 1


def test_wait_events_wakes_for_an_injection_from_another_thread(tmp_path: Path) -> None:
    b = make(tmp_path, "h200")
    timer = threading.Timer(0.1, lambda: b.inject_xid(0, 48))
    started = time.monotonic()
    timer.start()
    events = b.wait_events(5)
    assert [e.data for e in events] == [48]
    assert time.monotonic() - started < 1


def test_wait_events_sees_an_injection_from_another_process(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x8")
    code = (
        "import sys; from agent.backend.sim import SimulatedBackend; "
        "SimulatedBackend('h200x8', sys.argv[1]).inject_xid(3, 79)"
    )
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "state")], cwd=REPO)
    events: list[GpuEvent] = []
    while not events and time.monotonic() - started < 15:
        events = b.wait_events(1)
    assert proc.wait(timeout=15) == 0
    assert [(e.gpu, e.kind, e.data) for e in events] == [(3, GpuEventKind.XID, 79)]


# -- state file ------------------------------------------------------------------------------------


def test_state_is_shared_between_instances(tmp_path: Path) -> None:
    first = make(tmp_path, "h200x2")
    second = make(tmp_path, "h200x2")
    first.set_power_limit_watts(1, 555)
    assert second.power_limit_watts(1) == 555.0  # picked up on the next call
    assert second.reload() is False  # already current
    second.set_persistence(0, False)
    assert first.reload() is True
    assert first.persistence_enabled(0) is False
    assert first.power_limit_watts(1) == 555.0  # the second's write kept the first's change
    leftovers = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert leftovers == [STATE_FILE_NAME, STATE_FILE_NAME + ".lock"]  # no temporary files left


def test_state_of_another_profile_is_ignored(tmp_path: Path) -> None:
    make(tmp_path, "h200").set_power_limit_watts(0, 333)
    b = make(tmp_path, "h200x2")
    assert b.power_limit_watts(0) == 700.0


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "machine": {"profile": "h200"}}', "[]", ""])
def test_corrupt_state_file_is_set_aside(tmp_path: Path, content: str) -> None:
    make(tmp_path, "h200").set_power_limit_watts(0, 333)
    state = tmp_path / "state" / STATE_FILE_NAME
    good = json.loads(state.read_text())
    if content.startswith('{"version"'):
        good["gpus"][0]["power_limit_mw"] = "lots"
        content = json.dumps(good)
    state.write_text(content)
    b = make(tmp_path, "h200")
    assert b.power_limit_watts(0) == 700.0  # boot defaults
    assert (tmp_path / "state" / (STATE_FILE_NAME + ".corrupt")).read_text() == content
    b.set_power_limit_watts(0, 444)
    assert make(tmp_path, "h200").power_limit_watts(0) == 444.0


def test_concurrent_threads(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x8")
    errors: list[BaseException] = []

    def work(gpu: int) -> None:
        try:
            for watts in range(300, 320):
                b.set_power_limit_watts(gpu, watts)
                assert b.power_limit_watts(gpu) == watts
                b.temperature_celsius(gpu)
        except BaseException as exc:  # collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(gpu,)) for gpu in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [make(tmp_path, "h200x8").power_limit_watts(g) for g in range(8)] == [319.0] * 8


# -- profiles ----------------------------------------------------------------------------------------


def test_builtin_profiles() -> None:
    assert list_profiles() == ["h200", "h200x2", "h200x8", "mixed", "rtx-pro-6000", "rtx-pro-6000x2"]
    counts = {name: len(load_profile(name).models) for name in list_profiles()}
    assert counts == {"h200": 1, "h200x2": 2, "h200x8": 8, "mixed": 6, "rtx-pro-6000": 1, "rtx-pro-6000x2": 2}
    mixed = load_profile("mixed")
    assert [m.name for m in mixed.models] == ["NVIDIA H200"] * 4 + [RTX_NAME] * 2


def test_unknown_profile_lists_builtins(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown simulated GPU profile 'h100x8'.*h200x8.*rtx-pro-6000x2"):
        SimulatedBackend("h100x8", tmp_path)


def test_profile_file(tmp_path: Path) -> None:
    path = tmp_path / "lab.json"
    path.write_text(
        json.dumps(
            {
                "description": "one of each",
                "driver_version": "575.57.08",
                "scenario": {"ignored": "by the backend"},
                "gpus": [
                    {"model": "h200"},
                    {"model": {"base": "rtx-pro-6000", "name": "NVIDIA RTX PRO 6000 Blackwell Max-Q", "fan_count": 1}},
                ],
                "pci_bus_ids": ["00000000:01:00.0", "00000000:02:00.0"],
            }
        )
    )
    b = make(tmp_path, path)
    assert b.driver_version() == "575.57.08"
    assert b.device_count() == 2
    assert b.identity(1).name == "NVIDIA RTX PRO 6000 Blackwell Max-Q"
    assert b.identity(1).pci_bus_id == "00000000:02:00.0"
    assert b.fan_count(1) == 1
    assert b.fan_count(0) == 0
    assert b.identity(0).uuid != make(tmp_path / "x", "h200").identity(0).uuid  # profile name "lab"
    assert load_profile(str(path)).name == "lab"


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ({"gpus": [{"model": "h100"}]}, r"unknown GPU model 'h100' \(built-in models: h200, rtx-pro-6000\)"),
        ({"gpus": [{"model": {"base": "h200", "fan_cnt": 2}}]}, "unknown key.*fan_cnt"),
        ({"gpus": [{"model": {"base": "h200", "power_limit_default_mw": 900000}}]}, "outside"),
        ({"gpus": [{"model": {"name": "x"}}]}, "missing key"),
        ({"gpus": []}, "non-empty list"),
        ({"gpus": [{"model": "h200", "count": 2}], "pci_bus_ids": ["a"]}, "2 distinct strings"),
        ({"gpus": [{"model": "rtx-pro-6000", "count": 2}], "nvswitch_fabric": True}, "needs every GPU on NVLink"),
    ],
)
def test_bad_profile_files(tmp_path: Path, profile: dict[str, Any], message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(ValueError, match=message):
        load_profile(path)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"base": "h200", "gpm": {"idle": {"sm_active_ratio": 0.5}}}, r"gpus\[0\]\.model\.gpm\.idle: missing key"),
        (
            {
                "base": "h200",
                "gpm": {
                    "idle": {
                        **dict.fromkeys(
                            ["sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio", "dram_active_ratio"], 1.5
                        ),
                        "pcie_tx_bytes_per_second": 0,
                        "pcie_rx_bytes_per_second": 0,
                    },
                    "load": {},
                },
            },
            r"gpus\[0\]\.model\.gpm\.idle\.sm_active_ratio: Input should be less than or equal to 1",
        ),
        ({"base": "h200", "fan_count": "2"}, r"gpus\[0\]\.model\.fan_count: Input should be a valid integer"),
        ({"base": "h200", "memory_temperature_load_c": None}, "go together"),
    ],
)
def test_bad_profile_errors_name_the_file_and_field(tmp_path: Path, model: dict[str, Any], message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"gpus": [{"model": model}]}))
    with pytest.raises(ValueError, match=message) as info:
        load_profile(path)
    assert str(info.value).startswith(f"{path}: ")


def check_config(tmp_path: Path, profile: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "agent.yaml"
    config.write_text(f"backend: simulated\nsimulated:\n  profile: {profile}\nstate_dir: {tmp_path / 'state'}\n")
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "check-config", "--config", str(config), "--rules", str(REPO / "rules")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def test_check_config_reports_a_bad_simulated_profile(tmp_path: Path) -> None:
    bogus = check_config(tmp_path, "bogus")
    assert bogus.returncode == 1
    assert bogus.stderr.strip() == (
        f"{tmp_path / 'agent.yaml'}:3 simulated.profile: unknown simulated GPU profile 'bogus': not a built-in "
        "profile (h200, h200x2, h200x8, mixed, rtx-pro-6000, rtx-pro-6000x2) nor an existing profile file"
    )
    lab = tmp_path / "lab.json"
    lab.write_text(json.dumps({"gpus": [{"model": {"base": "h200", "power_limit_default_mw": "700 W"}}]}))
    wrong_field = check_config(tmp_path, str(lab))
    assert wrong_field.returncode == 1
    assert wrong_field.stderr.strip() == (
        f"{tmp_path / 'agent.yaml'}:3 simulated.profile: {lab}: gpus[0].model.power_limit_default_mw: "
        "Input should be a valid integer"
    )
    lab.write_text(json.dumps({"gpus": [{"model": {"base": "h200", "power_limit_default_mw": 650000}}]}))
    good = check_config(tmp_path, str(lab))
    assert good.returncode == 0, good.stderr
    assert "simulated backend" in good.stdout


# -- profiling-grade telemetry --------------------------------------------------------------------------


def activity_over(b: SimulatedBackend, gpu: int, seconds: float) -> GpmActivity:
    """Two GPM samples `seconds` of simulated time apart, differenced as nvmlGpmMetricsGet does."""
    before = b.telemetry(gpu).gpm
    b.advance(seconds)
    after = b.telemetry(gpu).gpm
    assert before is not None and after is not None
    activity = gpm_activity(before, after)
    assert activity is not None
    return activity


def assert_ratios(activity: GpmActivity) -> None:
    ratios = (
        activity.sm_active_ratio,
        activity.sm_occupancy_ratio,
        activity.tensor_active_ratio,
        activity.dram_active_ratio,
    )
    assert all(0 <= r <= 1 for r in ratios), activity


def test_gpm_activity_follows_the_load_like_the_recorded_h200(tmp_path: Path) -> None:
    b = make(tmp_path, "h200")
    recorded = {state: GPM_FIXTURE[state]["gpm_metrics"]["value"] for state in ("idle", "loaded")}
    idle = activity_over(b, 0, 2)
    assert_ratios(idle)
    assert idle.sm_active_ratio == idle.tensor_active_ratio == 0 == recorded["idle"]["SM_ACTIVITY"][0]
    assert idle.pcie_tx_bytes_per_second == pytest.approx(recorded["idle"]["PCIE_TX"][0] * MIB, rel=1e-3)
    b.set_processes(0, [4242])
    loaded = activity_over(b, 0, 2)
    assert_ratios(loaded)
    for name, key in [
        ("sm_active_ratio", "SM_ACTIVITY"),
        ("sm_occupancy_ratio", "SM_OCCUPANCY"),
        ("tensor_active_ratio", "TENSOR_ACTIVE"),
        ("dram_active_ratio", "DRAM_BW_UTIL"),
    ]:
        assert getattr(loaded, name) == pytest.approx(recorded["loaded"][key][0] / 100, abs=0.01), name
    assert loaded.pcie_rx_bytes_per_second == pytest.approx(recorded["loaded"]["PCIE_RX"][0] * MIB, rel=1e-3)
    # One GPU alone: GPM's NVLink counters answer 0, as on the recorded single-GPU H200.
    assert loaded.nvlink_tx_bytes_per_second == loaded.nvlink_rx_bytes_per_second == 0
    # A power cap slows the clocks: fewer bytes move, the SMs are as busy, ratios stay in 0..1.
    b.set_power_limit_watts(0, 300)
    capped = activity_over(b, 0, 2)
    assert_ratios(capped)
    assert capped.sm_active_ratio == loaded.sm_active_ratio
    assert capped.dram_active_ratio < loaded.dram_active_ratio
    assert capped.pcie_rx_bytes_per_second < loaded.pcie_rx_bytes_per_second
    b.set_processes(0, [])
    assert activity_over(b, 0, 1).tensor_active_ratio == 0
    sample = b.telemetry(0).gpm
    assert sample is not None and gpm_activity(sample, sample) is None  # no time between the samples


def test_gpm_over_nvlink_and_where_the_board_has_none(tmp_path: Path) -> None:
    pair = make(tmp_path, "h200x2")
    pair.set_processes(1, [7])
    busy = activity_over(pair, 1, 1)
    assert busy.nvlink_tx_bytes_per_second > 0 and busy.nvlink_rx_bytes_per_second > 0
    assert activity_over(pair, 0, 1).nvlink_tx_bytes_per_second == 0  # idle: nothing crosses the link
    rtx = make(tmp_path / "rtx", "rtx-pro-6000")
    assert rtx.telemetry(0).gpm is None  # nvmlGpmQueryDeviceSupport: unsupported (assumed, see the docstring)


def test_energy_grows_with_power_times_time(tmp_path: Path) -> None:
    b = make(tmp_path, "h200")
    start = b.telemetry(0).fields
    assert start.total_energy_mj == FIXTURE["nvmlDeviceGetTotalEnergyConsumption"]
    assert start.power_instant_mw == FIXTURE["nvmlDeviceGetPowerUsage"]
    b.advance(10)
    idle = b.telemetry(0).fields
    assert idle.total_energy_mj - start.total_energy_mj == 123_455 * 10  # mW x s = mJ
    b.set_processes(0, [1])
    b.advance(4)
    loaded = b.telemetry(0).fields
    assert loaded.power_instant_mw == 655_000
    assert loaded.total_energy_mj - idle.total_energy_mj == 655_000 * 4
    b.set_power_limit_watts(0, 300)
    b.advance(4)
    capped = b.telemetry(0).fields
    assert capped.total_energy_mj - loaded.total_energy_mj == 300_000 * 4
    assert b.total_energy_joules(0) == capped.total_energy_mj / 1000


def test_field_values_have_the_recorded_shapes(tmp_path: Path) -> None:
    recorded = {state: GPM_FIXTURE[state]["field_values"]["value"] for state in ("idle", "loaded")}
    b = make(tmp_path, "h200")
    idle = b.telemetry(0)
    assert idle.fields.memory_temperature_c == recorded["idle"]["MEMORY_TEMP"]["ull"] == 39
    assert idle.memory_max_temperature_c == GPM_FIXTURE["idle"]["temp_threshold_mem_max"]["value"] == 95
    assert recorded["idle"]["NVLINK_CRC_FLIT_TOTAL"]["ret"] == NVML_NOT_SUPPORTED
    assert idle.fields.nvlinks is None and idle.fields.nvlink_total("crc_flit") is None
    assert idle.fields.pcie_correctable_errors == idle.fields.pcie_fatal_errors == 0
    assert idle.fields.remapped_correctable_rows == recorded["idle"]["REMAP_COR"]["ull"]
    assert idle.fields.recovery_action == recorded["idle"]["GPU_RECOVERY_ACTION"]["ull"]
    assert idle.mig_mode == EnabledPending(False, False)
    assert idle.max_clocks_mhz[ClockDomain.SM] == GPM_FIXTURE["idle"]["max_clocks_sm"]["value"]
    assert idle.applications_clocks_mhz[ClockDomain.SM] == GPM_FIXTURE["idle"]["app_clocks_sm"]["value"]
    b.set_processes(0, [4242])
    assert b.telemetry(0).fields.memory_temperature_c == recorded["loaded"]["MEMORY_TEMP"]["ull"] == 49
    b.set_power_limit_watts(0, 500)  # the load hits the power cap, as the recorded one did (SW power cap 6.5 s)
    b.advance(6.5)
    capped = b.telemetry(0).fields
    assert recorded["loaded"]["CLOCKS_EVENT_REASON_SW_POWER_CAP"]["ull"] == pytest.approx(6.5e9, rel=0.01)
    assert capped.reason_duration_ns["sw_power_cap"] == 6_500_000_000
    assert capped.reason_duration_ns["hw_thermal"] == 0
    assert 39 < (capped.memory_temperature_c or 0) < 49  # cooler at lower power
    b.add_pcie_errors(0, correctable=3, fatal=1)
    fields = b.telemetry(0).fields
    assert (fields.pcie_correctable_errors, fields.pcie_fatal_errors) == (3, 1)
    with pytest.raises(ValueError, match="has no NVLink"):
        b.add_nvlink_errors(0, 0, "crc_flit", 1)
    rtx = make(tmp_path / "rtx", "rtx-pro-6000")
    assert rtx.telemetry(0).fields.memory_temperature_c is None  # GDDR7: no memory temperature
    assert rtx.telemetry(0).memory_max_temperature_c is None


def test_nvlink_counters_on_a_connected_node(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x2")
    links = b.telemetry(0).fields.nvlinks
    assert links is not None and len(links) == 18 and all(link.up for link in links)
    b.add_nvlink_errors(0, 3, "crc_flit", 5)
    b.add_nvlink_errors(0, 4, "crc_flit", 2)
    b.add_nvlink_errors(0, 4, "replay", 1)
    b.set_nvlink_up(0, 17, False)
    fresh = make(tmp_path, "h200x2")  # the counters are in the state file
    fields = fresh.telemetry(0).fields
    assert fields.nvlink_total("crc_flit") == 7 and fields.nvlink_total("replay") == 1
    assert fields.nvlinks is not None and not fields.nvlinks[17].up
    assert fresh.telemetry(1).fields.nvlink_total("crc_flit") == 0
    with pytest.raises(ValueError, match="no NVLink 18"):
        b.add_nvlink_errors(0, 18, "replay", 1)
    with pytest.raises(ValueError, match="unknown NVLink counter"):
        b.add_nvlink_errors(0, 0, "crc", 1)
    mixed = make(tmp_path / "mixed", "mixed")
    assert mixed.telemetry(0).fields.nvlinks is not None
    assert mixed.telemetry(4).fields.nvlinks is None  # the RTX PRO 6000 has no NVLink


def test_memory_info_v2_excludes_reserved_memory(tmp_path: Path) -> None:
    b = make(tmp_path, "h200")
    recorded = GPM_FIXTURE["idle"]["memory_info_v2"]["value"]
    idle = b.telemetry(0).memory
    assert (idle.total_bytes, idle.reserved_bytes, idle.used_bytes, idle.free_bytes) == (
        recorded["total"],
        recorded["reserved"],
        recorded["used"],
        recorded["free"],
    )
    b.set_processes(0, [100, 101])
    telemetry = b.telemetry(0)
    assert telemetry.memory.used_bytes == sum(p.used_memory_bytes or 0 for p in telemetry.processes) > 0
    assert [p.pid for p in telemetry.processes] == [100, 101]
    info = b.memory_info(0)  # the protocol reads v2, as nvidia-smi shows it
    assert (info.used_bytes, info.reserved_bytes) == (telemetry.memory.used_bytes, telemetry.memory.reserved_bytes)
    assert telemetry.memory.free_bytes == info.free_bytes


def test_telemetry_answers_like_every_per_gpu_call(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x2")
    b.set_lost(1)
    gpu_error(GpuErrorKind.GPU_LOST, lambda: b.telemetry(1))
    b.set_reset_required(0)
    gpu_error(GpuErrorKind.RESET_REQUIRED, lambda: b.telemetry(0))
    b.advance(5)  # a lost GPU's counters stand still
    b.set_lost(1, False)
    gpm = b.telemetry(1).gpm
    assert gpm is not None and gpm.counters.elapsed_ns == 0


def test_fabric_registration_on_an_nvswitch_node(tmp_path: Path) -> None:
    b = make(tmp_path, "h200x8")
    fabrics = [b.telemetry(gpu).fabric for gpu in range(8)]
    assert all(f is not None and (f.state, f.status) == (FabricState.COMPLETED, 0) for f in fabrics)
    assert len({f.cluster_uuid for f in fabrics if f is not None}) == 1  # one baseboard, one fabric
    b.set_fabric_state(5, FabricState.NOT_STARTED)  # the fabric manager never came up
    fabric = make(tmp_path, "h200x8").telemetry(5).fabric  # another process sees it
    assert fabric is not None and fabric.state is FabricState.NOT_STARTED
    b.reboot()
    fabric = b.telemetry(5).fabric
    assert fabric is not None and fabric.state is FabricState.COMPLETED
    single = make(tmp_path / "one", "h200")
    assert single.telemetry(0).fabric is None  # no NVSwitch: NOT_SUPPORTED
    with pytest.raises(ValueError, match="no NVSwitch fabric"):
        single.set_fabric_state(0, FabricState.IN_PROGRESS)
