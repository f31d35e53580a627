"""NvmlBackend against a replay of a real H200's NVML answers (no GPU here), and against the
real pynvml on a machine without the NVIDIA driver."""

from __future__ import annotations

import ctypes.util
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hosttree import make_host_tree
from nvml_replay import FIXTURE_H200, Call, Replay, ReplayMissing, install_replay

from agent.backend.base import (
    SETTER_ITEMS,
    ClockDomain,
    EccCounter,
    EccErrorType,
    EnabledPending,
    GpuBackend,
    GpuEventKind,
    GpuIdentity,
    GpuProcess,
    MemoryInfo,
    PcieLink,
    RecoveryAction,
    RemappedRows,
    TemperatureThreshold,
    Utilization,
    ViolationPolicy,
)
from agent.backend.errors import NO_DRIVER_KINDS, GpuError, GpuErrorKind, WriteRefused
from agent.backend.nvml import NvmlBackend, classify, to_gpu_error
from agent.config import load_config
from agent.daemon import Daemon
from agent.daemon.sd_notify import SdNotifier

ALL_ITEMS = frozenset(SETTER_ITEMS.values())
H200_GRAPHICS_CLOCKS = list(range(1980, 344, -15))


def _two_gpu_fixture(tmp_path: Path) -> Path:
    """The H200 recording with its device twice: a two-GPU node."""
    fixture = json.loads(FIXTURE_H200.read_text())
    fixture["devices"] = fixture["devices"] * 2
    fixture["device_count"] = 2
    path = tmp_path / "nvml-2xh200.json"
    path.write_text(json.dumps(fixture))
    return path


def test_is_a_gpu_backend_named_nvml() -> None:
    nvml = NvmlBackend()
    assert isinstance(nvml, GpuBackend)
    assert nvml.name == "nvml"


# -- getters: the recording's values in the protocol's units ------------------------------------

GETTERS: list[tuple[str, Callable[[NvmlBackend], Any], Any]] = [
    ("driver_version", lambda b: b.driver_version(), "580.159.04"),
    ("device_count", lambda b: b.device_count(), 1),
    (
        "identity",
        lambda b: b.identity(0),
        GpuIdentity(
            index=0,
            uuid="GPU-00000000-0000-0000-0000-000000000000 (redacted)",
            name="NVIDIA H200",
            pci_bus_id="00000000:00:06.0",
            serial="0000000000000 (redacted)",
            vbios_version="96.00.A5.00.1A",
            minor_number=0,
        ),
    ),
    ("temperature", lambda b: b.temperature_celsius(0), 36),
    ("power_usage: 123455 mW", lambda b: b.power_usage_watts(0), 123.455),
    ("clock graphics", lambda b: b.clock_mhz(0, ClockDomain.GRAPHICS), 1980),
    ("clock sm", lambda b: b.clock_mhz(0, ClockDomain.SM), 1980),
    ("clock memory", lambda b: b.clock_mhz(0, ClockDomain.MEMORY), 3201),
    ("clock_event_reasons: GpuIdle", lambda b: b.clock_event_reasons(0), 0x1),
    ("utilization", lambda b: b.utilization(0), Utilization(gpu_percent=0, memory_percent=0)),
    (
        "memory_info: v2, bytes, used without the driver's reserved memory (nvidia-smi: 0 MiB used)",
        lambda b: b.memory_info(0),
        MemoryInfo(total_bytes=150754820096, used_bytes=0, free_bytes=150109880320, reserved_bytes=644939776),
    ),
    ("performance_state: P0", lambda b: b.performance_state(0), 0),
    ("shutdown temp", lambda b: b.temperature_threshold_celsius(0, TemperatureThreshold.SHUTDOWN), 95),
    ("slowdown temp", lambda b: b.temperature_threshold_celsius(0, TemperatureThreshold.SLOWDOWN), 89),
    ("gpu max temp", lambda b: b.temperature_threshold_celsius(0, TemperatureThreshold.GPU_MAX), 87),
    ("power_limit: 700000 mW", lambda b: b.power_limit_watts(0), 700.0),
    ("power_limit_constraints", lambda b: b.power_limit_constraints_watts(0), (200.0, 700.0)),
    ("default_power_limit", lambda b: b.default_power_limit_watts(0), 700.0),
    ("max clock graphics", lambda b: b.max_clock_mhz(0, ClockDomain.GRAPHICS), 1980),
    ("max clock memory", lambda b: b.max_clock_mhz(0, ClockDomain.MEMORY), 3201),
    ("supported memory clocks", lambda b: b.supported_memory_clocks_mhz(0), [3201, 2201]),
    ("max clock sm", lambda b: b.max_clock_mhz(0, ClockDomain.SM), 1980),
    ("supported graphics clocks", lambda b: b.supported_graphics_clocks_mhz(0, 3201), H200_GRAPHICS_CLOCKS),
    ("supported graphics clocks, low memory", lambda b: b.supported_graphics_clocks_mhz(0, 2201), H200_GRAPHICS_CLOCKS),
    ("memory max temp", lambda b: b.temperature_threshold_celsius(0, TemperatureThreshold.MEM_MAX), 95),
    (
        "pcie_link",
        lambda b: b.pcie_link(0),
        PcieLink(current_generation=5, current_width=16, max_generation=5, max_width=16),
    ),
    ("unlocked graphics clocks", lambda b: b.locked_clocks_mhz(0, ClockDomain.GRAPHICS), None),
    ("unlocked memory clocks", lambda b: b.locked_clocks_mhz(0, ClockDomain.MEMORY), None),
    ("fan_count: fan-less SXM", lambda b: b.fan_count(0), 0),
    ("persistence", lambda b: b.persistence_enabled(0), True),
    ("ecc_mode", lambda b: b.ecc_mode(0), EnabledPending(current=True, pending=True)),
    (
        "ecc uncorrected aggregate",
        lambda b: b.ecc_errors(0, EccErrorType.UNCORRECTED, EccCounter.AGGREGATE),
        0,
    ),
    ("ecc corrected aggregate", lambda b: b.ecc_errors(0, EccErrorType.CORRECTED, EccCounter.AGGREGATE), 0),
    (
        "remapped_rows",
        lambda b: b.remapped_rows(0),
        RemappedRows(correctable=0, uncorrectable=0, pending=False, failed=False),
    ),
    ("pcie_replay_counter", lambda b: b.pcie_replay_counter(0), 0),
    ("power violation", lambda b: b.violation_time_ns(0, ViolationPolicy.POWER), 0),
    ("thermal violation", lambda b: b.violation_time_ns(0, ViolationPolicy.THERMAL), 0),
    ("mig_mode", lambda b: b.mig_mode(0), EnabledPending(current=False, pending=False)),
    ("compute_processes", lambda b: b.compute_processes(0), []),
    ("recovery_action", lambda b: b.recovery_action(0), RecoveryAction.NONE),
]


@pytest.mark.parametrize(
    ("read", "expected"), [(read, expected) for _, read, expected in GETTERS], ids=[g[0] for g in GETTERS]
)
def test_getter_returns_the_recorded_value_in_protocol_units(
    backend: NvmlBackend, read: Callable[[NvmlBackend], Any], expected: Any
) -> None:
    assert read(backend) == expected


@pytest.mark.parametrize(
    ("read", "call"),
    [
        (lambda b: b.fan_speed_percent(0, 0), "nvmlDeviceGetFanSpeed_v2"),
        (lambda b: b.fan_manual(0, 0), "nvmlDeviceGetFanControlPolicy_v2"),
        (lambda b: b.fan_speed_range_percent(0), "nvmlDeviceGetMinMaxFanSpeed"),
        (lambda b: b.retired_pages_pending(0), "nvmlDeviceGetRetiredPagesPendingStatus"),
    ],
    ids=["fan_speed", "fan_manual", "fan_speed_range", "retired pages on a row-remapping board"],
)
def test_recorded_not_supported_becomes_gpu_error(
    backend: NvmlBackend, read: Callable[[NvmlBackend], Any], call: str
) -> None:
    with pytest.raises(GpuError) as caught:
        read(backend)
    assert caught.value.kind is GpuErrorKind.NOT_SUPPORTED
    assert caught.value.gpu == 0
    assert caught.value.call == call


def test_the_replay_does_not_invent_answers(backend: NvmlBackend) -> None:
    with pytest.raises(ReplayMissing):
        backend.violation_time_ns(0, ViolationPolicy.LOW_UTILIZATION)


def test_setting_a_fan_on_a_fan_less_board_is_not_supported(replay: Replay) -> None:
    replay.fail("nvmlDeviceSetFanSpeed_v2", pynvml.NVML_ERROR_INVALID_ARGUMENT)
    nvml = NvmlBackend(writable_items=ALL_ITEMS)
    nvml.init()
    with pytest.raises(GpuError) as caught:
        nvml.set_fan_speed_percent(0, 0, 60)
    assert caught.value.kind is GpuErrorKind.NOT_SUPPORTED
    assert str(caught.value) == "GPU 0: this GPU has no fans (nvmlDeviceSetFanSpeed_v2)"


def test_a_fan_the_board_lacks_is_an_invalid_argument(backend: NvmlBackend, replay: Replay) -> None:
    replay.answer("nvmlDeviceGetNumFans", 2)
    replay.answer("nvmlDeviceGetFanSpeed_v2", "ERR:NVML_ERROR_INVALID_ARGUMENT", 5)
    with pytest.raises(GpuError) as caught:
        backend.fan_speed_percent(0, 5)
    assert caught.value.kind is GpuErrorKind.INVALID_ARGUMENT
    assert "no fan 5: this GPU has 2" in str(caught.value)


@pytest.mark.parametrize(("policy", "manual"), [(pynvml.NVML_FAN_POLICY_MANUAL, True), (0, False)])
def test_fan_manual_reads_the_control_policy_of_that_fan(
    backend: NvmlBackend, replay: Replay, policy: int, manual: bool
) -> None:
    replay.answer("nvmlDeviceGetNumFans", 2)
    replay.answer("nvmlDeviceGetFanControlPolicy_v2", policy, 1)
    assert backend.fan_manual(0, 1) is manual


def test_fans_of_a_board_with_fans(backend: NvmlBackend, replay: Replay) -> None:
    replay.answer("nvmlDeviceGetNumFans", 2)
    replay.answer("nvmlDeviceGetMinMaxFanSpeed", [30, 100])
    replay.answer("nvmlDeviceGetFanSpeed_v2", 64, 1)
    assert backend.fan_count(0) == 2
    assert backend.fan_speed_range_percent(0) == (30, 100)
    assert backend.fan_speed_percent(0, 1) == 64


def test_compute_processes_keep_unknown_memory_as_none(backend: NvmlBackend, replay: Replay) -> None:
    replay.answer(
        "nvmlDeviceGetComputeRunningProcesses",
        [
            {"pid": 4242, "usedGpuMemory": 80 * 2**30, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF},
            {"pid": 7, "usedGpuMemory": None, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF},
        ],
    )
    assert backend.compute_processes(0) == [
        GpuProcess(pid=4242, used_memory_bytes=80 * 2**30),
        GpuProcess(pid=7, used_memory_bytes=None),
    ]


def test_identity_without_serial(backend: NvmlBackend, replay: Replay) -> None:
    replay.answer("nvmlDeviceGetSerial", "ERR:NVML_ERROR_NOT_SUPPORTED")
    assert backend.identity(0).serial == ""


def test_identity_raises_other_serial_errors(backend: NvmlBackend, replay: Replay) -> None:
    replay.fail("nvmlDeviceGetSerial", pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(GpuError) as caught:
        backend.identity(0)
    assert caught.value.kind is GpuErrorKind.GPU_LOST


# -- locked clocks: the P0 range against the board's range --------------------------------------


@pytest.mark.parametrize(
    ("domain", "p0_range", "expected"),
    [
        # Unlocked, P0 spans the supported graphics clocks: 345-1980 MHz on an H200.
        (ClockDomain.GRAPHICS, [345, 1980], None),
        (ClockDomain.GRAPHICS, [210, 1980], None),
        (ClockDomain.GRAPHICS, [1980, 1980], (1980, 1980)),
        (ClockDomain.GRAPHICS, [345, 1500], (345, 1500)),
        (ClockDomain.GRAPHICS, [1200, 1980], (1200, 1980)),
        # Unlocked, P0 memory sits at the top memory clock (2201 MHz is P2's).
        (ClockDomain.MEMORY, [3201, 3201], None),
        (ClockDomain.MEMORY, [2201, 3201], None),
        (ClockDomain.MEMORY, [2201, 2201], (2201, 2201)),
    ],
)
def test_locked_clocks_compare_p0_with_the_board_range(
    backend: NvmlBackend,
    replay: Replay,
    domain: ClockDomain,
    p0_range: list[int],
    expected: tuple[int, int] | None,
) -> None:
    replay.answer("nvmlDeviceGetMinMaxClockOfPState", p0_range, int(domain), pynvml.NVML_PSTATE_0)
    assert backend.locked_clocks_mhz(0, domain) == expected


def test_locked_clocks_read_the_board_range_once(backend: NvmlBackend, replay: Replay) -> None:
    replay.answer("nvmlDeviceGetMinMaxClockOfPState", [1980, 1980], 0, 0)
    for _ in range(3):
        backend.locked_clocks_mhz(0, ClockDomain.GRAPHICS)
    assert replay.count("nvmlDeviceGetMinMaxClockOfPState") == 3
    assert replay.count("nvmlDeviceGetSupportedMemoryClocks") == 1
    assert replay.count("nvmlDeviceGetSupportedGraphicsClocks") == 1


def test_locked_clocks_not_supported(backend: NvmlBackend, replay: Replay) -> None:
    replay.fail("nvmlDeviceGetMinMaxClockOfPState", pynvml.NVML_ERROR_NOT_SUPPORTED)
    with pytest.raises(GpuError) as caught:
        backend.locked_clocks_mhz(0, ClockDomain.GRAPHICS)
    assert caught.value.kind is GpuErrorKind.NOT_SUPPORTED


def test_sm_clocks_are_not_lockable(backend: NvmlBackend, replay: Replay) -> None:
    with pytest.raises(GpuError) as caught:
        backend.locked_clocks_mhz(0, ClockDomain.SM)
    assert caught.value.kind is GpuErrorKind.INVALID_ARGUMENT
    assert replay.count("nvmlDeviceGetMinMaxClockOfPState") == 0


# -- modern names first, older ones as fallback -------------------------------------------------


def test_clock_event_reasons_fall_back_when_nvidia_ml_py_lacks_the_new_name(
    backend: NvmlBackend, replay: Replay, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
    replay.answer("nvmlDeviceGetCurrentClocksThrottleReasons", 0x4)
    assert backend.clock_event_reasons(0) == 0x4


def test_clock_event_reasons_fall_back_when_the_driver_lacks_the_symbol(backend: NvmlBackend, replay: Replay) -> None:
    replay.fail("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    replay.answer("nvmlDeviceGetCurrentClocksThrottleReasons", 0x4)
    assert backend.clock_event_reasons(0) == 0x4


def test_other_errors_of_the_modern_call_do_not_fall_back(backend: NvmlBackend, replay: Replay) -> None:
    replay.fail("nvmlDeviceGetCurrentClocksEventReasons", pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(GpuError) as caught:
        backend.clock_event_reasons(0)
    assert (caught.value.kind, caught.value.call) == (GpuErrorKind.GPU_LOST, "nvmlDeviceGetCurrentClocksEventReasons")
    assert replay.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 0


@pytest.mark.parametrize(
    ("read", "modern", "older"),
    [
        (lambda b: b.temperature_celsius(0), "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
        (
            lambda b: b.compute_processes(0),
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses_v2",
        ),
    ],
    ids=["temperature", "compute_processes"],
)
def test_versioned_calls_fall_back_on_old_drivers(
    backend: NvmlBackend, replay: Replay, read: Callable[[NvmlBackend], Any], modern: str, older: str
) -> None:
    replay.fail(modern, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    assert read(backend) in (36, [])
    assert (replay.count(modern), replay.count(older)) == (1, 1)


def test_no_known_name_in_nvidia_ml_py_is_not_supported(backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
    monkeypatch.delattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons")
    with pytest.raises(GpuError) as caught:
        backend.clock_event_reasons(0)
    assert caught.value.kind is GpuErrorKind.NOT_SUPPORTED
    assert "upgrade nvidia-ml-py" in str(caught.value)


# -- error classification -----------------------------------------------------------------------

CLASSIFIED = [
    (pynvml.NVML_ERROR_NOT_SUPPORTED, GpuErrorKind.NOT_SUPPORTED),
    (pynvml.NVML_ERROR_NO_PERMISSION, GpuErrorKind.NO_PERMISSION),
    (pynvml.NVML_ERROR_GPU_IS_LOST, GpuErrorKind.GPU_LOST),
    (pynvml.NVML_ERROR_RESET_REQUIRED, GpuErrorKind.RESET_REQUIRED),
    (pynvml.NVML_ERROR_IN_USE, GpuErrorKind.IN_USE),
    (pynvml.NVML_ERROR_TIMEOUT, GpuErrorKind.TIMEOUT),
    (pynvml.NVML_ERROR_INVALID_ARGUMENT, GpuErrorKind.INVALID_ARGUMENT),
    (pynvml.NVML_ERROR_UNINITIALIZED, GpuErrorKind.UNINITIALIZED),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, GpuErrorKind.DRIVER_NOT_LOADED),
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, GpuErrorKind.LIBRARY_NOT_FOUND),
    (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, GpuErrorKind.NOT_SUPPORTED),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, GpuErrorKind.VERSION_MISMATCH),
    (pynvml.NVML_ERROR_UNKNOWN, GpuErrorKind.UNKNOWN),
    (pynvml.NVML_ERROR_MEMORY, GpuErrorKind.UNKNOWN),
    (pynvml.NVML_ERROR_CORRUPTED_INFOROM, GpuErrorKind.UNKNOWN),
    (12345, GpuErrorKind.UNKNOWN),
]


@pytest.mark.parametrize(("code", "kind"), CLASSIFIED, ids=[f"{code}-{kind.value}" for code, kind in CLASSIFIED])
def test_classify(code: int, kind: GpuErrorKind) -> None:
    exc = pynvml.NVMLError(code)
    assert classify(exc) is kind
    error = to_gpu_error(exc, 3, "nvmlDeviceGetSomething")
    assert (error.kind, error.gpu, error.call) == (kind, 3, "nvmlDeviceGetSomething")
    message = error.args[0]
    assert message and "\n" not in message and "Traceback" not in message


def test_unknown_codes_keep_the_number_in_the_message() -> None:
    assert "unexpected NVML error 999" in str(to_gpu_error(pynvml.NVMLError(999), None, "nvmlInit"))


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (
            pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
            "NVIDIA driver not loaded (libnvidia-ml.so.1 not found): is the driver installed?",
        ),
        (
            pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
            "NVIDIA driver not loaded (the nvidia kernel module is not running): is the driver installed?",
        ),
    ],
)
def test_no_driver_messages_for_operators(code: int, message: str) -> None:
    assert to_gpu_error(pynvml.NVMLError(code), None, "nvmlInit").args[0] == message


def test_the_wrapper_names_gpu_and_call(backend: NvmlBackend, replay: Replay) -> None:
    replay.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(GpuError) as caught:
        backend.power_usage_watts(0)
    error = caught.value
    assert (error.kind, error.gpu, error.call) == (GpuErrorKind.GPU_LOST, 0, "nvmlDeviceGetPowerUsage")
    assert str(error) == "GPU 0: GPU has fallen off the bus or is otherwise inaccessible (nvmlDeviceGetPowerUsage)"
    assert isinstance(error.__cause__, pynvml.NVMLError_GpuIsLost)


def test_handle_lookup_errors_name_the_gpu(backend: NvmlBackend) -> None:
    with pytest.raises(GpuError) as caught:
        backend.temperature_celsius(5)
    error = caught.value
    assert (error.kind, error.gpu, error.call) == (GpuErrorKind.INVALID_ARGUMENT, 5, "nvmlDeviceGetHandleByIndex")


# -- library lifetime ---------------------------------------------------------------------------


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="an NVIDIA driver is installed here")
def test_real_pynvml_without_a_driver_raises_one_line() -> None:
    with pytest.raises(GpuError) as caught:
        NvmlBackend().init()
    error = caught.value
    assert error.kind in NO_DRIVER_KINDS
    assert error.gpu is None
    assert str(error).count("\n") == 0
    assert "is the driver installed?" in str(error)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, GpuErrorKind.DRIVER_NOT_LOADED),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, GpuErrorKind.VERSION_MISMATCH),
    ],
)
def test_init_maps_no_driver_errors(replay: Replay, code: int, kind: GpuErrorKind) -> None:
    replay.fail("nvmlInit", code)
    nvml = NvmlBackend()
    with pytest.raises(GpuError) as caught:
        nvml.init()
    assert caught.value.kind is kind
    assert caught.value.kind in NO_DRIVER_KINDS
    assert caught.value.call == "nvmlInit"
    nvml.shutdown()  # never initialised: nothing to shut down
    assert replay.count("nvmlShutdown") == 0


def test_init_twice_initialises_once(backend: NvmlBackend, replay: Replay) -> None:
    backend.init()
    assert replay.count("nvmlInit") == 1


def test_shutdown_is_idempotent(replay: Replay) -> None:
    nvml = NvmlBackend()
    nvml.shutdown()
    nvml.init()
    nvml.shutdown()
    nvml.shutdown()
    assert replay.count("nvmlShutdown") == 1


def test_handles_are_cached_per_index(backend: NvmlBackend, replay: Replay) -> None:
    backend.temperature_celsius(0)
    backend.power_usage_watts(0)
    backend.memory_info(0)
    assert replay.count("nvmlDeviceGetHandleByIndex") == 1


def test_handle_cache_is_dropped_on_shutdown_and_init(backend: NvmlBackend, replay: Replay) -> None:
    backend.temperature_celsius(0)
    backend.shutdown()
    with pytest.raises(GpuError) as caught:
        backend.temperature_celsius(0)
    assert caught.value.kind is GpuErrorKind.UNINITIALIZED
    backend.init()
    assert backend.temperature_celsius(0) == 36
    # One lookup before shutdown, one refused while shut down, one after init.
    assert replay.count("nvmlDeviceGetHandleByIndex") == 3


# -- setters ------------------------------------------------------------------------------------

SETTERS: list[tuple[str, Callable[[NvmlBackend], None], Call]] = [
    (
        "set_power_limit_watts",
        lambda b: b.set_power_limit_watts(0, 600),
        Call("nvmlDeviceSetPowerManagementLimit", 0, (600000,)),
    ),
    (
        "set_power_limit_watts",
        lambda b: b.set_power_limit_watts(0, 612.5),
        Call("nvmlDeviceSetPowerManagementLimit", 0, (612500,)),
    ),
    (
        "set_locked_clocks_mhz",
        lambda b: b.set_locked_clocks_mhz(0, ClockDomain.GRAPHICS, 1500, 1980),
        Call("nvmlDeviceSetGpuLockedClocks", 0, (1500, 1980)),
    ),
    (
        "set_locked_clocks_mhz",
        lambda b: b.set_locked_clocks_mhz(0, ClockDomain.MEMORY, 3201, 3201),
        Call("nvmlDeviceSetMemoryLockedClocks", 0, (3201, 3201)),
    ),
    (
        "reset_locked_clocks",
        lambda b: b.reset_locked_clocks(0, ClockDomain.GRAPHICS),
        Call("nvmlDeviceResetGpuLockedClocks", 0, ()),
    ),
    (
        "reset_locked_clocks",
        lambda b: b.reset_locked_clocks(0, ClockDomain.MEMORY),
        Call("nvmlDeviceResetMemoryLockedClocks", 0, ()),
    ),
    (
        "set_fan_speed_percent",
        lambda b: b.set_fan_speed_percent(0, 1, 70),
        Call("nvmlDeviceSetFanSpeed_v2", 0, (1, 70)),
    ),
    ("set_fan_automatic", lambda b: b.set_fan_automatic(0, 1), Call("nvmlDeviceSetDefaultFanSpeed_v2", 0, (1,))),
    ("set_persistence", lambda b: b.set_persistence(0, True), Call("nvmlDeviceSetPersistenceMode", 0, (1,))),
    ("set_persistence", lambda b: b.set_persistence(0, False), Call("nvmlDeviceSetPersistenceMode", 0, (0,))),
    ("set_ecc_mode", lambda b: b.set_ecc_mode(0, True), Call("nvmlDeviceSetEccMode", 0, (1,))),
    ("set_ecc_mode", lambda b: b.set_ecc_mode(0, False), Call("nvmlDeviceSetEccMode", 0, (0,))),
]
SETTER_IDS = [expected.name + repr(expected.args) for _, _, expected in SETTERS]
# Every guarded method: the NVML setters and the reset (which runs nvidia-smi).
GUARDED = [(s, w) for s, w, _ in SETTERS] + [("reset_gpu", lambda b: b.reset_gpu(0))]


def test_every_setter_is_covered() -> None:
    assert {setter for setter, _ in GUARDED} == set(SETTER_ITEMS)


@pytest.mark.parametrize(("setter", "write"), GUARDED, ids=[*SETTER_IDS, "reset_gpu"])
def test_observe_mode_never_reaches_nvml(replay: Replay, setter: str, write: Callable[[NvmlBackend], None]) -> None:
    nvml = NvmlBackend(writable_items=ALL_ITEMS - {SETTER_ITEMS[setter]})
    nvml.init()
    calls_before = len(replay.log)
    with pytest.raises(WriteRefused) as caught:
        write(nvml)
    assert caught.value.item == SETTER_ITEMS[setter]
    assert replay.calls == []
    assert len(replay.log) == calls_before  # not even a handle lookup


@pytest.mark.parametrize(("write", "expected"), [(w, e) for _, w, e in SETTERS], ids=SETTER_IDS)
def test_writable_setter_calls_nvml_in_its_units(
    replay: Replay, write: Callable[[NvmlBackend], None], expected: Call
) -> None:
    nvml = NvmlBackend(writable_items=ALL_ITEMS)
    nvml.init()
    write(nvml)
    assert replay.calls == [expected]


def test_only_the_writable_item_is_writable(replay: Replay) -> None:
    nvml = NvmlBackend(writable_items={"power_limit"})
    nvml.init()
    nvml.set_power_limit_watts(0, 650)
    with pytest.raises(WriteRefused):
        nvml.set_ecc_mode(0, True)
    assert replay.calls == [Call("nvmlDeviceSetPowerManagementLimit", 0, (650000,))]


def test_locking_sm_clocks_is_refused_before_nvml(replay: Replay) -> None:
    nvml = NvmlBackend(writable_items=ALL_ITEMS)
    nvml.init()
    with pytest.raises(GpuError) as caught:
        nvml.set_locked_clocks_mhz(0, ClockDomain.SM, 1500, 1500)
    assert caught.value.kind is GpuErrorKind.INVALID_ARGUMENT
    assert replay.calls == []


def test_setter_without_root(replay: Replay) -> None:
    replay.fail("nvmlDeviceSetPowerManagementLimit", pynvml.NVML_ERROR_NO_PERMISSION)
    nvml = NvmlBackend(writable_items=ALL_ITEMS)
    nvml.init()
    with pytest.raises(GpuError) as caught:
        nvml.set_power_limit_watts(0, 600)
    assert caught.value.kind is GpuErrorKind.NO_PERMISSION
    assert "needs root" in str(caught.value)


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        ("ERR:NVML_ERROR_INVALID_ARGUMENT", GpuErrorKind.NOT_SUPPORTED),  # a driver that predates the field
        ("ERR:NVML_ERROR_GPU_IS_LOST", GpuErrorKind.GPU_LOST),
    ],
)
def test_recovery_action_field_errors(backend: NvmlBackend, replay: Replay, answer: str, kind: GpuErrorKind) -> None:
    replay.answer("nvmlDeviceGetFieldValues", answer, 230)
    with pytest.raises(GpuError) as caught:
        backend.recovery_action(0)
    assert (caught.value.kind, caught.value.gpu, caught.value.call) == (kind, 0, "nvmlDeviceGetFieldValues")


def test_recovery_action_reports_what_the_driver_asks(backend: NvmlBackend, replay: Replay) -> None:
    replay.answer("nvmlDeviceGetFieldValues", RecoveryAction.NODE_REBOOT, 230)
    assert backend.recovery_action(0) == RecoveryAction.NODE_REBOOT


# -- GPU reset through a stand-in nvidia-smi ----------------------------------------------------


@pytest.fixture
def nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in nvidia-smi first on PATH: logs its argv to `argv`, prints `output`, exits with `rc`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        'here="$(dirname "$0")"\n'
        'echo "$@" >> "$here/argv"\n'
        'cat "$here/output" 2>/dev/null\n'
        'exit "$(cat "$here/rc" 2>/dev/null || echo 0)"\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return bin_dir


def _resettable(replay: Replay) -> NvmlBackend:
    nvml = NvmlBackend(writable_items={"gpu_reset"})
    nvml.init()
    return nvml


def test_reset_releases_nvml_runs_nvidia_smi_and_comes_back(replay: Replay, nvidia_smi: Path) -> None:
    nvml = _resettable(replay)
    nvml.temperature_celsius(0)
    (nvidia_smi / "output").write_text("GPU 00000000:00:06.0 was successfully reset.\n")
    nvml.reset_gpu(0)
    assert (nvidia_smi / "argv").read_text() == "--gpu-reset -i 00000000:00:06.0\n"
    assert (replay.count("nvmlShutdown"), replay.count("nvmlInit")) == (1, 2)
    assert nvml.temperature_celsius(0) == 36  # usable again, with a fresh handle
    assert replay.count("nvmlDeviceGetHandleByIndex") == 2


def test_reset_is_refused_while_processes_use_the_gpu(replay: Replay, nvidia_smi: Path) -> None:
    replay.answer("nvmlDeviceGetComputeRunningProcesses", [{"pid": 4242, "usedGpuMemory": 2**30}])
    nvml = _resettable(replay)
    with pytest.raises(GpuError) as caught:
        nvml.reset_gpu(0)
    assert caught.value.kind is GpuErrorKind.IN_USE
    assert "4242" in str(caught.value)
    assert not (nvidia_smi / "argv").exists()
    assert replay.count("nvmlShutdown") == 0


@pytest.mark.parametrize(
    ("output", "kind"),
    [
        (
            "The following GPUs could not be reset:\n  GPU 00000000:00:06.0: In use by another client\n",
            GpuErrorKind.IN_USE,
        ),
        ("Unable to reset this GPU: Insufficient Permissions\n", GpuErrorKind.NO_PERMISSION),
        ("GPU Reset is not supported on this GPU\n", GpuErrorKind.NOT_SUPPORTED),
        ("Unable to reset GPU 00000000:00:06.0: Unknown Error\n", GpuErrorKind.UNKNOWN),
    ],
    ids=["held by another client", "not root", "not supported", "other"],
)
def test_failed_reset_is_classified_and_nvml_comes_back(
    replay: Replay, nvidia_smi: Path, output: str, kind: GpuErrorKind
) -> None:
    (nvidia_smi / "output").write_text(output)
    (nvidia_smi / "rc").write_text("255")
    nvml = _resettable(replay)
    with pytest.raises(GpuError) as caught:
        nvml.reset_gpu(0)
    assert (caught.value.kind, caught.value.gpu, caught.value.call) == (kind, 0, "nvidia-smi --gpu-reset")
    assert "\n" not in str(caught.value)
    assert nvml.power_usage_watts(0) == 123.455


def test_a_reset_past_its_deadline_is_a_timeout_and_nvml_comes_back(
    replay: Replay, nvidia_smi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (nvidia_smi / "nvidia-smi").write_text("#!/bin/sh\necho resetting\nsleep 60\n")
    monkeypatch.setattr("agent.backend.nvml.backend._RESET_TIMEOUT_SECONDS", 0.5)
    nvml = _resettable(replay)
    began = time.monotonic()
    with pytest.raises(GpuError) as caught:
        nvml.reset_gpu(0)
    assert time.monotonic() - began < 5
    assert (caught.value.kind, caught.value.call) == (GpuErrorKind.TIMEOUT, "nvidia-smi --gpu-reset")
    assert "nvidia-smi --gpu-reset did not finish in 0.5 s" in str(caught.value)
    assert nvml.power_usage_watts(0) == 123.455


def test_reset_without_nvidia_smi(replay: Replay, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    nvml = _resettable(replay)
    with pytest.raises(GpuError) as caught:
        nvml.reset_gpu(0)
    assert caught.value.kind is GpuErrorKind.NOT_SUPPORTED
    assert replay.count("nvmlShutdown") == 0


# -- events -------------------------------------------------------------------------------------

XID_AND_ECC = (
    pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
)


def test_quiet_wait_returns_nothing(backend: NvmlBackend, replay: Replay) -> None:
    assert backend.wait_events(0.5) == []
    assert replay.registered_events == {0: XID_AND_ECC}
    waits = [call for call in replay.log if call.name == "nvmlEventSetWait_v2"]
    assert [call.args[-1] for call in waits] == [500]


def test_xid_event(backend: NvmlBackend, replay: Replay) -> None:
    replay.push_event(0, pynvml.nvmlEventTypeXidCriticalError, 79)
    before = time.time()
    (event,) = backend.wait_events(1.0)
    assert (event.gpu, event.kind, event.data) == (0, GpuEventKind.XID, 79)
    assert before <= event.timestamp_seconds <= time.time()


def test_queued_events_come_back_together(backend: NvmlBackend, replay: Replay) -> None:
    replay.push_event(0, pynvml.nvmlEventTypeXidCriticalError, 48)
    replay.push_event(0, pynvml.nvmlEventTypeDoubleBitEccError, 0)
    replay.push_event(0, pynvml.nvmlEventTypeSingleBitEccError, 0)
    events = backend.wait_events(1.0)
    assert [(e.kind, e.data) for e in events] == [
        (GpuEventKind.XID, 48),
        (GpuEventKind.DOUBLE_BIT_ECC, 0),
        (GpuEventKind.SINGLE_BIT_ECC, 0),
    ]
    assert backend.wait_events(0.1) == []
    assert replay.count("nvmlEventSetCreate") == 1


def test_gpu_lost_while_waiting(backend: NvmlBackend, replay: Replay) -> None:
    replay.fail("nvmlEventSetWait_v2", pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(GpuError) as caught:
        backend.wait_events(1.0)
    assert caught.value.kind is GpuErrorKind.GPU_LOST
    assert caught.value.call == "nvmlEventSetWait_v2"


@pytest.mark.parametrize(
    ("failing_call", "error", "failing_gpu", "xid"),
    [
        ("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_NOT_SUPPORTED, 0, 79),
        ("nvmlDeviceGetSupportedEventTypes", pynvml.NVML_ERROR_GPU_IS_LOST, 1, 13),
    ],
    ids=["an unsupported device is skipped", "a lost GPU does not blind the others"],
)
def test_events_map_handles_back_to_indexes_past_a_device_that_cannot_register(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failing_call: str, error: int, failing_gpu: int, xid: int
) -> None:
    replay = install_replay(monkeypatch, _two_gpu_fixture(tmp_path))
    replay.fail(failing_call, error, gpu=failing_gpu)
    nvml = NvmlBackend()
    nvml.init()
    other = 1 - failing_gpu
    replay.push_event(other, pynvml.nvmlEventTypeXidCriticalError, xid)
    assert [(e.gpu, e.kind, e.data) for e in nvml.wait_events(1.0)] == [(other, GpuEventKind.XID, xid)]
    assert replay.registered_events == {other: XID_AND_ECC}


def test_no_device_with_events(backend: NvmlBackend, replay: Replay) -> None:
    replay.fail("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_NOT_SUPPORTED)
    with pytest.raises(GpuError) as caught:
        backend.wait_events(1.0)
    assert caught.value.kind is GpuErrorKind.NOT_SUPPORTED
    assert replay.count("nvmlEventSetFree") == 1  # the empty set is not leaked


def test_registration_errors_free_the_set(backend: NvmlBackend, replay: Replay) -> None:
    replay.fail("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(GpuError) as caught:
        backend.wait_events(1.0)
    assert caught.value.kind is GpuErrorKind.UNKNOWN
    assert replay.count("nvmlEventSetFree") == 1


def test_shutdown_frees_the_event_set(backend: NvmlBackend, replay: Replay) -> None:
    backend.wait_events(0.0)
    replay.fail("nvmlEventSetFree", pynvml.NVML_ERROR_GPU_IS_LOST)
    backend.shutdown()
    assert (replay.count("nvmlEventSetFree"), replay.count("nvmlShutdown")) == (1, 1)


def test_shutdown_waits_for_a_wait_in_progress(
    backend: NvmlBackend, replay: Replay, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend.wait_events(0.0)  # the event set exists
    waiting = threading.Event()
    frees_seen_while_waiting: list[int] = []

    def slow_wait(event_set: object, timeout_ms: int) -> object:
        waiting.set()
        time.sleep(0.2)
        frees_seen_while_waiting.append(replay.count("nvmlEventSetFree"))
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    monkeypatch.setattr(pynvml, "nvmlEventSetWait_v2", slow_wait)
    watcher = threading.Thread(target=backend.wait_events, args=(1.0,))
    watcher.start()
    assert waiting.wait(5)
    backend.shutdown()
    watcher.join(5)
    assert frees_seen_while_waiting == [0]  # the set was not freed under the waiting thread
    assert replay.count("nvmlEventSetFree") == 1


# -- a daemon on NVML, reloaded between observe and enforce ------------------------------------------

POWER_LIMIT_SETTER = "nvmlDeviceSetPowerManagementLimit"
# The recording's H200 runs at 700 W: a 600 W policy is drift, written every pass in enforce mode.
NVML_AGENT_CONFIG = """\
mode: {mode}
backend: nvml
host_root: {root}
state_dir: {root}/state
interval_seconds: 0.2
policy_interval_seconds: 60
api: {{socket: {root}/agent.sock}}
remediation: {{rules_dir: {root}/rules.d}}
policy:
  node: {{next_boot: ignore}}  # the test tree has no /boot; the driver item is reported, in sync
  gpus:
    - match: {{model: "NVIDIA H200*"}}
      power_limit_watts: 600
"""


@pytest.fixture
def nvml_daemon(replay: Replay, tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    """A daemon in process on the recorded H200, its config in observe mode until a test says otherwise."""
    make_host_tree(tmp_path)
    replay.waits_block = True  # the daemon's event thread waits as it would on the driver
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(NVML_AGENT_CONFIG.format(mode="observe", root=tmp_path))
    daemon = Daemon(load_config(config_path), config_path, notifier=SdNotifier(None, None))
    yield daemon, config_path
    daemon.shutdown()


def _reload_into(daemon: Daemon, config_path: Path, mode: str) -> None:
    config_path.write_text(NVML_AGENT_CONFIG.format(mode=mode, root=config_path.parent))
    assert daemon.reloader.reload()
    assert daemon.live.config.mode.value == mode


def test_a_daemon_reloaded_from_enforce_to_observe_writes_nothing_through_nvml(
    replay: Replay, nvml_daemon: tuple[Daemon, Path]
) -> None:
    daemon, config_path = nvml_daemon
    _reload_into(daemon, config_path, "enforce")
    daemon.loop_once()
    assert [call.name for call in replay.calls] == [POWER_LIMIT_SETTER]  # enforce mode: the drift is written
    _reload_into(daemon, config_path, "observe")
    replay.calls.clear()
    snapshot = daemon.loop_once()  # a full policy pass: the limit still reads 700 W
    assert [(p.item, p.status.value) for p in snapshot.policy if not p.in_sync] == [("power_limit", "drift")]
    backend = daemon.live.session.backend
    assert backend is not None
    for setter, write in GUARDED:  # whatever else in the daemon would write (an action, a restore)
        with pytest.raises(WriteRefused) as refused:
            write(backend)  # type: ignore[arg-type]
        assert refused.value.item == SETTER_ITEMS[setter]
    assert replay.calls == [], "a setter reached NVML after the reload to observe mode"


def test_a_daemon_reloaded_from_observe_to_enforce_writes_through_nvml(
    replay: Replay, nvml_daemon: tuple[Daemon, Path]
) -> None:
    daemon, config_path = nvml_daemon
    daemon.loop_once()
    assert replay.calls == []
    _reload_into(daemon, config_path, "enforce")
    daemon.loop_once()
    assert replay.calls == [Call(POWER_LIMIT_SETTER, 0, (600_000,))]
