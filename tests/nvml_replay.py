"""A replay of recorded NVML answers standing in for the NVIDIA driver under the real `pynvml`.

`install_replay(monkeypatch)` replaces every NVML function on the real `pynvml` module object
with one that answers from tests/fixtures/nvml-h200.json (what a real H200 answered). The
real `NVMLError` classes, constants and ctypes types stay: recorded "ERR:NVML_ERROR_X"
answers raise `pynvml.NVMLError(pynvml.NVML_ERROR_X)`, device handles are genuine
`c_nvmlDevice_t` pointers, structs are the real pynvml structs. So code under test meets
NVML as it is, minus the hardware.

Answers come from, in order: `replay.answer(...)`, the supplement (`H200_PROBED` by default:
static answers the recording lacks, read on a real H200), the recording.

- Setters (nvmlDeviceSet*/Reset*/Clear*) are recorded in `replay.calls`, never carried out,
  and do not change later answers.
- A call the recording has no answer for raises `ReplayMissing` (not an NVMLError, so no
  backend mistakes it for a GPU answer); give one with `replay.answer(...)`.
- `replay.fail(name, code)` makes a call raise that NVML error from then on.
- `replay.push_event(gpu, event_type, data)` queues an event for nvmlEventSetWait_v2, which
  raises NVML_ERROR_TIMEOUT at once (without sleeping) when the queue is empty, or, with
  `replay.waits_block = True`, after the wait's timeout as the driver does (for a daemon whose
  event thread would otherwise spin).
- Calls before nvmlInit (or after the matching nvmlShutdown) raise NVML_ERROR_UNINITIALIZED.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest

FIXTURE_H200 = Path(__file__).parent / "fixtures" / "nvml-h200.json"
#: The profiling telemetry answers of the same H200, idle and under a bf16 matmul load.
FIXTURE_H200_TELEMETRY = Path(__file__).parent / "fixtures" / "nvml-h200-gpm-fields.json"

# Helpers in pynvml that are not NVML calls (NVMLError.__str__ needs nvmlErrorString).
_KEEP_REAL = frozenset(
    {"nvmlErrorString", "nvmlExceptionClass", "nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct"}
)

#: Static answers the recording lacks, read-only on a real H200 SXM (driver 580.159.04,
#: nvidia-ml-py 13.610.43) on 2026-11-29 with nothing locked. Time-varying readings are left
#: out so they cannot disagree with the recording. Worth merging into the fixture.
H200_PROBED: dict[str, Any] = {
    "nvmlDeviceGetMinMaxClockOfPState:0:0": [345, 1980],
    "nvmlDeviceGetMinMaxClockOfPState:0:2": [345, 1980],
    "nvmlDeviceGetMinMaxClockOfPState:1:0": [345, 1980],
    "nvmlDeviceGetMinMaxClockOfPState:1:2": [345, 1980],
    "nvmlDeviceGetMinMaxClockOfPState:2:0": [3201, 3201],
    "nvmlDeviceGetMinMaxClockOfPState:2:2": [2201, 2201],
    "nvmlDeviceGetMaxClockInfo:1": 1980,
    # 110 clocks, 1980 down to 345 MHz in 15 MHz steps, for both memory clocks (the recording
    # kept the first five of the 3201 MHz list).
    "nvmlDeviceGetSupportedGraphicsClocks:3201": list(range(1980, 344, -15)),
    "nvmlDeviceGetSupportedGraphicsClocks:2201": list(range(1980, 344, -15)),
    "nvmlDeviceGetSupportedPerformanceStates": [2, 0],
    "nvmlDeviceGetTemperatureThreshold:2": 95,
    "nvmlDeviceGetMaxPcieLinkWidth": 16,
    "nvmlDeviceGetTotalEccErrors:0:0": 0,
    "nvmlDeviceGetTotalEccErrors:1:0": 0,
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: NONE, as an unsigned int; an unknown field id
    # answers NVML_ERROR_INVALID_ARGUMENT in its own nvmlReturn.
    "nvmlDeviceGetFieldValues:230": 0,
    # A fan index the board lacks is an invalid argument; the SXM H200 has none.
    "nvmlDeviceGetFanSpeed_v2:0": "ERR:NVML_ERROR_INVALID_ARGUMENT",
    "nvmlDeviceGetFanControlPolicy_v2:0": "ERR:NVML_ERROR_INVALID_ARGUMENT",
    "nvmlDeviceGetMinMaxFanSpeed": "ERR:NVML_ERROR_INVALID_ARGUMENT",
}

#: The recording's names for the GPM metrics and field values, by NVML id.
_GPM_METRIC_IDS = {
    "GRAPHICS_UTIL": 1,
    "SM_ACTIVITY": 2,
    "SM_OCCUPANCY": 3,
    "TENSOR_ACTIVE": 5,
    "DRAM_BW_UTIL": 10,
    "PCIE_TX": 20,
    "PCIE_RX": 21,
    "NVLINK_RX": 60,
    "NVLINK_TX": 61,
}
_FIELD_IDS = {
    "TOTAL_ENERGY": 83,
    "MEMORY_TEMP": 82,
    "POWER_INSTANT": 186,
    "PCIE_COUNT_CORRECTABLE": 173,
    "PCIE_COUNT_FATAL": 180,
    "CLOCKS_EVENT_REASON_SW_POWER_CAP": 74,
    "PCIE_REPLAY": 94,
    "REMAP_COR": 142,
}
#: Telemetry answers the recording lacks, NOT read on the H200: the reason durations other than the
#: SW power cap (0: nothing held the clocks), the memory applications clock (its maximum, as the
#: graphics one answered) and the fabric query of a GPU without NVSwitches (the probe passed the wrong
#: arguments). The lead's device run (bench/h200_telemetry_compare.py) replaces them with answers.
H200_TELEMETRY_ASSUMED: dict[str, Any] = {
    "nvmlDeviceGetFieldValues:76": 0,
    "nvmlDeviceGetFieldValues:269": 0,
    "nvmlDeviceGetFieldValues:270": 0,
    "nvmlDeviceGetFieldValues:271": 0,
    "nvmlDeviceGetApplicationsClock:2": 3201,
    "nvmlDeviceGetGpuFabricInfoV": "ERR:NVML_ERROR_NOT_SUPPORTED",
}


def h200_telemetry(moment: str = "idle") -> dict[str, Any]:
    """The recorded telemetry answers ("idle" or "loaded") as replay answers, with the assumed rest."""
    recorded = json.loads(FIXTURE_H200_TELEMETRY.read_text())[moment]
    answers: dict[str, Any] = dict(H200_TELEMETRY_ASSUMED)
    answers["nvmlGpmQueryDeviceSupport"] = {"isSupportedDevice": recorded["gpm_supported"]["value"]}
    for name, (value, status) in recorded["gpm_metrics"]["value"].items():
        if name in _GPM_METRIC_IDS:
            answers[f"nvmlGpmMetricsGet:{_GPM_METRIC_IDS[name]}"] = value if status == 0 else f"ERR:{status}"
    for name, field in recorded["field_values"]["value"].items():
        if name in _FIELD_IDS:
            answers[f"nvmlDeviceGetFieldValues:{_FIELD_IDS[name]}"] = (
                field["ull"] if field["ret"] == 0 else "ERR:NVML_ERROR_NOT_SUPPORTED"
            )
    answers[f"nvmlDeviceGetMemoryInfo:{pynvml.nvmlMemory_v2}"] = recorded["memory_info_v2"]["value"]
    answers["nvmlDeviceGetMigMode"] = recorded["mig_mode"]["value"]
    answers["nvmlDeviceGetMaxClockInfo:1"] = recorded["max_clocks_sm"]["value"]
    answers["nvmlDeviceGetApplicationsClock:1"] = recorded["app_clocks_sm"]["value"]
    answers["nvmlDeviceGetTemperatureThreshold:2"] = recorded["temp_threshold_mem_max"]["value"]
    return answers


# Versioned or renamed calls, answered from the name the recording used.
_RECORDED_AS = {
    "nvmlDeviceGetTemperatureV": "nvmlDeviceGetTemperature",
    "nvmlDeviceGetComputeRunningProcesses_v3": "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2": "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetPciInfo_v3": "nvmlDeviceGetPciInfo",
}

# Calls that return a ctypes struct in pynvml: the recording holds the struct's fields.
_STRUCTS: dict[str, type[ctypes.Structure]] = {
    "nvmlDeviceGetPciInfo": pynvml.nvmlPciInfo_t,
    "nvmlDeviceGetMemoryInfo": pynvml.c_nvmlMemory_t,
    "nvmlDeviceGetUtilizationRates": pynvml.c_nvmlUtilization_t,
    "nvmlDeviceGetViolationStatus": pynvml.c_nvmlViolationTime_t,
}
_STRUCTS["nvmlGpmQueryDeviceSupport"] = pynvml.c_nvmlGpmSupport_t
_TUPLES = frozenset({"nvmlDeviceGetRemappedRows", "nvmlDeviceGetMinMaxClockOfPState"})
_PROCESS_LISTS = frozenset({"nvmlDeviceGetComputeRunningProcesses"})
_SETTER = re.compile(r"^nvmlDevice(Set|Reset|Clear)")
_INIT = frozenset({"nvmlInit", "nvmlInitWithFlags"})


class ReplayMissing(LookupError):
    """The recording has no answer for this call."""


@dataclass(frozen=True)
class Call:
    """One NVML call as the replay saw it: the device as its index, out-parameters left out."""

    name: str
    gpu: int | None
    args: tuple[Any, ...]


class Replay:
    def __init__(self, fixture: dict[str, Any], supplement: Mapping[str, Any]) -> None:
        self.fixture = fixture
        self.supplement = dict(supplement)
        self.devices: list[dict[str, Any]] = fixture["devices"]
        #: Setter calls that reached NVML (including ones that then failed), in order.
        self.calls: list[Call] = []
        #: Every NVML call, in order.
        self.log: list[Call] = []
        #: Event mask registered per GPU index (nvmlDeviceRegisterEvents).
        self.registered_events: dict[int, int] = {}
        self._init_count = 0
        # Real memory behind each handle, so every device has its own address.
        self._buffers = [ctypes.create_string_buffer(8) for _ in self.devices]
        self.handles = [ctypes.cast(buffer, pynvml.c_nvmlDevice_t) for buffer in self._buffers]
        self._gpu_by_address = {ctypes.addressof(buffer): gpu for gpu, buffer in enumerate(self._buffers)}
        self._event_set_buffers: list[ctypes.Array[ctypes.c_char]] = []
        self._events: deque[tuple[int, int, int]] = deque()
        self._failures: dict[tuple[str, int | None], int] = {}
        self._answers: dict[tuple[int, str], Any] = {}
        self._gpm_buffers: list[ctypes.Array[ctypes.c_char]] = []
        self._gpm_gpu_by_address: dict[int, int | None] = {}  # sample -> the GPU it was taken on
        #: GPM samples allocated and not yet freed.
        self.gpm_samples_live = 0
        #: A quiet event wait sleeps its timeout (the driver's behaviour) instead of answering at once.
        self.waits_block = False

    # -- the test's controls -------------------------------------------------------------------

    def fail(self, name: str, code: int, *, gpu: int | None = None) -> None:
        """From now on `name` (on `gpu`, or on every GPU) raises pynvml.NVMLError(code)."""
        self._failures[(name, gpu)] = code

    def clear_failures(self) -> None:
        self._failures.clear()

    def answer(self, name: str, value: Any, *args: int, gpu: int = 0) -> None:
        """Answer `name(handle, *args)` on `gpu` with `value` (recording format: "ERR:NVML_ERROR_X" raises)."""
        self._answers[(gpu, _key(name, args))] = value

    def push_event(self, gpu: int, event_type: int, data: int = 0) -> None:
        """Queue an event (e.g. pynvml.nvmlEventTypeXidCriticalError, Xid 79) for nvmlEventSetWait_v2."""
        self._events.append((gpu, event_type, data))

    def count(self, name: str) -> int:
        return sum(1 for call in self.log if call.name == name)

    # -- dispatch ------------------------------------------------------------------------------

    def fake(self, name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            return self._dispatch(name, args)

        call.__name__ = name
        return call

    def _dispatch(self, name: str, args: tuple[Any, ...]) -> Any:
        gpu = self._gpu_of(args[0]) if args and isinstance(args[0], pynvml.c_nvmlDevice_t) else None
        rest = args[1:] if gpu is not None else args
        call = Call(name, gpu, tuple(arg for arg in rest if not isinstance(arg, ctypes._SimpleCData)))
        self.log.append(call)
        if _SETTER.match(name):
            self.calls.append(call)
        if name not in _INIT and self._init_count == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        for failing in (name, _RECORDED_AS.get(name)):
            for where in (gpu, None):
                code = self._failures.get((str(failing), where))
                if code is not None:
                    raise pynvml.NVMLError(code)
        if name in _INIT:
            self._init_count += 1
            return None
        if name == "nvmlShutdown":
            self._init_count -= 1
            return None
        if _SETTER.match(name):
            return None
        handler = _LIBRARY_CALLS.get(name)
        if handler is not None:
            return handler(self, call)
        if gpu is None:
            raise ReplayMissing(f"{name}{args} has no answer in the replay")
        if name == "nvmlDeviceGetFieldValues":
            return self._field_values(gpu, call.args[0])
        if name == "nvmlGpmSampleGet":
            self._gpm_gpu_by_address[ctypes.cast(args[1], ctypes.c_void_p).value or 0] = gpu
            return args[1]
        if name.startswith("nvmlDeviceGetGpuFabricInfo"):
            return self._fabric_info(gpu, args[1])
        recorded = _RECORDED_AS.get(name, name)
        return _convert(recorded, self._device_answer(name, gpu, call.args))

    def _gpu_of(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        if address not in self._gpu_by_address:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._gpu_by_address[address]

    def _device_answer(self, name: str, gpu: int, args: tuple[Any, ...], *, bare: bool = True) -> Any:
        """The answer as recorded; `bare`: an answer recorded without arguments serves any."""
        recorded = _RECORDED_AS.get(name, name)
        names = list(dict.fromkeys([name, recorded]))
        keys = [_key(each, args) for each in names]
        # The recording lists graphics clocks for the first (highest) memory clock only.
        first_mem = self.devices[gpu].get("nvmlDeviceGetSupportedMemoryClocks", [None])[0]
        if recorded == "nvmlDeviceGetSupportedGraphicsClocks" and args == (first_mem,):
            keys.append(f"{recorded}:first_mem")
        if bare:
            keys.extend(names)
        for key in keys:
            if (gpu, key) in self._answers:
                return self._answers[(gpu, key)]
        for source in (self.supplement, self.devices[gpu]):
            for key in keys:
                if key in source:
                    return source[key]
        raise ReplayMissing(
            f"{name}(gpu {gpu}, {', '.join(map(str, args))}) has no answer in the recording; "
            f"give one with replay.answer({recorded!r}, VALUE, ...)"
        )

    def _field_values(self, gpu: int, field_ids: list[int]) -> Any:
        """nvmlDeviceGetFieldValues: one answer per field ("nvmlDeviceGetFieldValues:ID"), errors per field."""
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for value, field_id in zip(values, field_ids):
            answer = self._device_answer("nvmlDeviceGetFieldValues", gpu, (field_id,), bare=False)
            value.fieldId = field_id
            if isinstance(answer, str) and answer.startswith("ERR:"):
                value.nvmlReturn = getattr(pynvml, answer.removeprefix("ERR:"))
            elif answer > 0xFFFFFFFF:  # a counter past 32 bits (reason durations in ns)
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                value.value.ullVal = answer
            else:
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = answer
        return values

    def _fabric_info(self, gpu: int, reference: Any) -> int:
        """nvmlDeviceGetGpuFabricInfo(V): fills the struct passed by reference (recorded as its fields)."""
        answer = self._device_answer("nvmlDeviceGetGpuFabricInfoV", gpu, ())
        if isinstance(answer, str):
            _convert("nvmlDeviceGetGpuFabricInfoV", answer)  # raises the recorded error
        struct = reference._obj
        for field, value in answer.items():
            if field == "clusterUuid":
                value = (ctypes.c_uint8 * 16)(*bytes.fromhex(value))
            setattr(struct, field, value)
        return int(pynvml.NVML_SUCCESS)

    # -- library-level calls -------------------------------------------------------------------

    def _process_name(self, call: Call) -> Any:
        """nvmlSystemGetProcessName: as answered ("nvmlSystemGetProcessName:PID"), else NOT_FOUND (gone)."""
        (pid,) = call.args
        answer = self._answers.get((0, _key("nvmlSystemGetProcessName", (pid,))), "ERR:NVML_ERROR_NOT_FOUND")
        return _convert("nvmlSystemGetProcessName", answer)

    def _gpm_sample_alloc(self, call: Call) -> Any:
        buffer = ctypes.create_string_buffer(8)
        self._gpm_buffers.append(buffer)
        self.gpm_samples_live += 1
        return ctypes.cast(buffer, pynvml.c_nvmlGpmSample_t)

    def _gpm_sample_free(self, call: Call) -> None:
        self.gpm_samples_live -= 1

    def _gpm_metrics_get(self, call: Call) -> Any:
        """nvmlGpmMetricsGet: each metric as recorded ("nvmlGpmMetricsGet:ID", per-metric errors)."""
        (request,) = call.args
        gpu = self._gpm_gpu_by_address.get(ctypes.cast(request.sample2, ctypes.c_void_p).value or 0)
        if gpu is None or self._gpm_gpu_by_address.get(ctypes.cast(request.sample1, ctypes.c_void_p).value or 0) != gpu:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for position in range(request.numMetrics):
            metric = request.metrics[position]
            answer = self._device_answer("nvmlGpmMetricsGet", gpu, (metric.metricId,), bare=False)
            if isinstance(answer, str) and answer.startswith("ERR:"):
                metric.nvmlReturn = int(answer.removeprefix("ERR:"))
            else:
                metric.nvmlReturn = pynvml.NVML_SUCCESS
                metric.value = float(answer)
        return request

    def _device_count(self, call: Call) -> int:
        return int(self.fixture["device_count"])

    def _handle_by_index(self, call: Call) -> Any:
        (index,) = call.args
        if not 0 <= index < len(self.handles):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.handles[index]

    def _event_set_create(self, call: Call) -> Any:
        buffer = ctypes.create_string_buffer(8)
        self._event_set_buffers.append(buffer)
        return ctypes.cast(buffer, pynvml.c_nvmlEventSet_t)

    def _register_events(self, call: Call) -> None:
        assert call.gpu is not None
        mask = call.args[0]
        self.registered_events[call.gpu] = self.registered_events.get(call.gpu, 0) | mask

    def _event_set_wait(self, call: Call) -> Any:
        if not self._events:
            if self.waits_block:
                time.sleep(call.args[-1] / 1000)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, event_type, event_data = self._events.popleft()
        data = pynvml.c_nvmlEventData_t()
        data.device = self.handles[gpu]
        data.eventType = event_type
        data.eventData = event_data
        return data


_LIBRARY_CALLS: dict[str, Callable[[Replay, Call], Any]] = {
    "nvmlSystemGetDriverVersion": lambda replay, call: replay.fixture["driver_version"],
    "nvmlSystemGetNVMLVersion": lambda replay, call: replay.fixture["nvml_version"],
    "nvmlSystemGetCudaDriverVersion": lambda replay, call: replay.fixture["cuda_driver_version"],
    "nvmlSystemGetCudaDriverVersion_v2": lambda replay, call: replay.fixture["cuda_driver_version"],
    "nvmlDeviceGetCount": Replay._device_count,
    "nvmlDeviceGetHandleByIndex": Replay._handle_by_index,
    "nvmlEventSetCreate": Replay._event_set_create,
    "nvmlDeviceRegisterEvents": Replay._register_events,
    "nvmlEventSetWait_v2": Replay._event_set_wait,
    "nvmlEventSetWait": Replay._event_set_wait,
    "nvmlEventSetFree": lambda replay, call: None,
    "nvmlSystemGetProcessName": Replay._process_name,
    "nvmlGpmSampleAlloc": Replay._gpm_sample_alloc,
    "nvmlGpmSampleFree": Replay._gpm_sample_free,
    "nvmlGpmMetricsGet": Replay._gpm_metrics_get,
}


def _key(name: str, args: tuple[Any, ...]) -> str:
    return ":".join([name, *(str(int(arg)) for arg in args)])


def _convert(name: str, value: Any) -> Any:
    """A recorded answer as pynvml returns it."""
    if isinstance(value, str) and value.startswith("ERR:"):
        raise pynvml.NVMLError(getattr(pynvml, value.removeprefix("ERR:")))
    if name in _STRUCTS:
        # nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2) answers the v2 struct (with "reserved").
        struct = pynvml.c_nvmlMemory_v2_t() if "reserved" in value else _STRUCTS[name]()
        for field, field_value in value.items():
            setattr(struct, field, field_value.encode() if isinstance(field_value, str) else field_value)
        return struct
    if name in _PROCESS_LISTS:
        return [pynvml.nvmlFriendlyObject(dict(process)) for process in value]
    if name in _TUPLES:
        return tuple(value)
    if isinstance(value, list):
        return list(value)
    return value


def install_replay(
    monkeypatch: pytest.MonkeyPatch,
    fixture_path: Path = FIXTURE_H200,
    supplement: Mapping[str, Any] | None = None,
) -> Replay:
    """Replace every NVML call on the real pynvml module with the replay of `fixture_path`.

    `supplement` answers (on every device) what the recording lacks; pass {} for another board. By
    default: H200_PROBED and the idle telemetry answers (`h200_telemetry`).
    """
    if supplement is None:
        supplement = {**h200_telemetry("idle"), **H200_PROBED}
    replay = Replay(json.loads(fixture_path.read_text()), supplement)
    for name, value in vars(pynvml).items():
        if name.startswith("nvml") and name not in _KEEP_REAL and inspect.isfunction(value):
            monkeypatch.setattr(pynvml, name, replay.fake(name))
    return replay
