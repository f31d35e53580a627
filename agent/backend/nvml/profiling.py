"""The profiling-grade answers of the NVML backend: GPM activity, field values (energy, instant
power, memory temperature, PCIe and NVLink counters, clock-event reason durations), NVLink link
state and the NVSwitch fabric registration.
"""

from __future__ import annotations

import contextlib
import ctypes
import uuid
from collections.abc import Sequence
from typing import Any

import pynvml

from agent.backend.base import FabricInfo, FabricState, FastFields, GpmActivity, NvLinkErrors, SlowFields
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.nvml.calls import ENABLED, NvmlCalls, to_gpu_error

# Field ids are fixed in nvml.h (older nvidia-ml-py lack some names).
_FIELD_MEMORY_TEMP = 82  # NVML_FI_DEV_MEMORY_TEMP, Celsius
_FIELD_TOTAL_ENERGY = 83  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, mJ
_FIELD_POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT, mW
_FIELD_PCIE_CORRECTABLE = 173  # NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS
_FIELD_PCIE_FATAL = 180  # NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR
#: NVML_FI_DEV_CLOCKS_EVENT_REASON_* (ns the reason held the clocks), by VIOLATION_REASONS label.
_VIOLATION_FIELDS: dict[str, int] = {
    "sw_power_cap": 74,  # = NVML_FI_DEV_PERF_POLICY_POWER
    "sync_boost": 76,  # = NVML_FI_DEV_PERF_POLICY_SYNC_BOOST
    "sw_thermal": 269,
    "hw_thermal": 270,
    "hw_power_brake": 271,
}
#: NVML_FI_DEV_NVLINK_<COUNTER>_ERROR_COUNT_L<n>: links 0-5 and 6-11 each number consecutively.
#: nvml.h names per-link ids for links 0-11 only; later links (12-17 on an H200 SXM) have state, not counters.
_NVLINK_FIELD_START: dict[str, tuple[int, int]] = {
    "crc_flit": (32, 96),
    "crc_data": (39, 102),
    "replay": (46, 108),
    "recovery": (53, 114),
}
_NVLINK_COUNTED_LINKS = 12
#: An unknown field id answers INVALID_ARGUMENT in its own nvmlReturn on older drivers.
_FIELD_ABSENT = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT})

#: nvmlGpmMetricId_t of each GpmActivity reading; NVML gives percent and MiB/s.
_GPM_METRICS: dict[str, int] = {
    "sm_active_ratio": 2,  # NVML_GPM_METRIC_SM_UTIL
    "sm_occupancy_ratio": 3,  # NVML_GPM_METRIC_SM_OCCUPANCY
    "tensor_active_ratio": 5,  # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    "dram_active_ratio": 10,  # NVML_GPM_METRIC_DRAM_BW_UTIL
    "pcie_tx_bytes_per_second": 20,  # NVML_GPM_METRIC_PCIE_TX_PER_SEC
    "pcie_rx_bytes_per_second": 21,  # NVML_GPM_METRIC_PCIE_RX_PER_SEC
    "nvlink_tx_bytes_per_second": 61,  # NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
    "nvlink_rx_bytes_per_second": 60,  # NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
    "graphics_active_ratio": 1,  # NVML_GPM_METRIC_GRAPHICS_UTIL (DCGM's GR_ENGINE_ACTIVE)
}
_MIB = 1 << 20


def _field_number(field: Any) -> float:
    """The value of one nvmlFieldValue_t, read through the member its valueType names."""
    member = {
        pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
    }.get(int(field.valueType), "uiVal")
    return float(getattr(field.value, member))


class ProfilingReads(NvmlCalls):
    """The protocol's profiling-grade readings."""

    _gpm_supported: dict[int, bool]
    _gpm_samples: dict[int, Any]  # the previous loop's GPM sample per GPU
    _gpm_spare: dict[int, Any]  # the other buffer, sampled into next
    _unsupported_fields: dict[int, set[int]]  # field ids a GPU answered NOT_SUPPORTED
    _nvlink_counts: dict[int, int]

    def gpm_activity(self, gpu: int) -> GpmActivity | None:
        """nvmlGpmSampleGet now, nvmlGpmMetricsGet against the previous call's sample (None on the
        first call). Two sample buffers per GPU take turns, so a loop allocates nothing. NOT_SUPPORTED
        where nvmlGpmQueryDeviceSupport says so.

        No nvidia-smi equivalent (dcgmi dmon -e 1001,1002,1003,1004,1005,1009,1010).
        """
        handle = self._handle(gpu)
        if not self._gpm_device_supported(gpu, handle):
            raise GpuError(GpuErrorKind.NOT_SUPPORTED, "GPM is not supported on this GPU", gpu=gpu, call="gpm")
        sample = self._gpm_spare.pop(gpu, None) or self._call(gpu, "nvmlGpmSampleAlloc")
        try:
            self._call(gpu, "nvmlGpmSampleGet", handle, sample)
        except GpuError:
            self._free_gpm_sample(sample)
            raise
        previous = self._gpm_samples.pop(gpu, None)
        self._gpm_samples[gpu] = sample
        if previous is None:
            return None
        self._gpm_spare[gpu] = previous  # the buffer the next call samples into
        return self._gpm_metrics(gpu, previous, sample)

    def _gpm_device_supported(self, gpu: int, handle: Any) -> bool:
        supported = self._gpm_supported.get(gpu)
        if supported is None:
            supported = bool(self._call(gpu, "nvmlGpmQueryDeviceSupport", handle).isSupportedDevice)
            self._gpm_supported[gpu] = supported
        return supported

    def _gpm_metrics(self, gpu: int, earlier: Any, later: Any) -> GpmActivity:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_METRICS)
        request.sample1 = earlier
        request.sample2 = later
        for position, metric_id in enumerate(_GPM_METRICS.values()):
            request.metrics[position].metricId = metric_id
        answer = self._call(gpu, "nvmlGpmMetricsGet", request)
        values: dict[str, float] = {}
        for position, name in enumerate(_GPM_METRICS):
            metric = answer.metrics[position]
            if int(metric.nvmlReturn) != pynvml.NVML_SUCCESS:
                raise to_gpu_error(pynvml.NVMLError(int(metric.nvmlReturn)), gpu, "nvmlGpmMetricsGet")
            value = float(metric.value)
            values[name] = value / 100.0 if name.endswith("_ratio") else value * _MIB
        return GpmActivity(**values)

    def _free_gpm_sample(self, sample: Any) -> None:
        # A sample that cannot be freed (the GPU is lost) is released with the library at shutdown.
        with contextlib.suppress(GpuError):
            self._call(None, "nvmlGpmSampleFree", sample)

    def _free_gpm_samples(self) -> None:
        samples = [*self._gpm_samples.values(), *self._gpm_spare.values()]
        self._gpm_samples, self._gpm_spare = {}, {}
        for sample in samples:
            self._free_gpm_sample(sample)

    def _field_values(self, gpu: int, field_ids: Sequence[int]) -> dict[int, float]:
        """One nvmlDeviceGetFieldValues call for `field_ids`; fields the GPU answers NOT_SUPPORTED are
        left out of the result, and out of later calls for this GPU."""
        unsupported = self._unsupported_fields.setdefault(gpu, set())
        asked = [field_id for field_id in field_ids if field_id not in unsupported]
        if not asked:
            return {}
        call = "nvmlDeviceGetFieldValues"
        values: dict[int, float] = {}
        for field in self._device(gpu, call, asked):
            status = int(field.nvmlReturn)
            field_id = int(field.fieldId)
            if status in _FIELD_ABSENT:
                unsupported.add(field_id)
            elif status != pynvml.NVML_SUCCESS:
                raise to_gpu_error(pynvml.NVMLError(status), gpu, call)
            else:
                values[field_id] = _field_number(field)
        return values

    def fast_fields(self, gpu: int) -> FastFields:
        """nvidia-smi --query-gpu=power.draw.instant,temperature.memory"""
        values = self._field_values(gpu, (_FIELD_POWER_INSTANT, _FIELD_MEMORY_TEMP))
        power = values.get(_FIELD_POWER_INSTANT)
        temperature = values.get(_FIELD_MEMORY_TEMP)
        return FastFields(
            power_instant_watts=None if power is None else power / 1000.0,
            memory_temperature_celsius=None if temperature is None else int(temperature),
        )

    def slow_fields(self, gpu: int) -> SlowFields:
        """nvidia-smi -q -d PCIE,PERFORMANCE,POWER ("Total Energy Consumption") and nvidia-smi nvlink -e,
        in one field-value call."""
        links = min(self._nvlink_count(gpu), _NVLINK_COUNTED_LINKS)
        link_fields = {
            (counter, link): (first if link < 6 else second) + link % 6
            for counter, (first, second) in _NVLINK_FIELD_START.items()
            for link in range(links)
        }
        asked = [
            _FIELD_TOTAL_ENERGY,
            _FIELD_PCIE_CORRECTABLE,
            _FIELD_PCIE_FATAL,
            *_VIOLATION_FIELDS.values(),
            *link_fields.values(),
        ]
        values = self._field_values(gpu, asked)
        energy = values.get(_FIELD_TOTAL_ENERGY)
        correctable = values.get(_FIELD_PCIE_CORRECTABLE)
        fatal = values.get(_FIELD_PCIE_FATAL)
        nvlinks = None
        if links:
            nvlinks = tuple(
                NvLinkErrors(
                    link,
                    {
                        counter: int(values[link_fields[(counter, link)]])
                        for counter in _NVLINK_FIELD_START
                        if link_fields[(counter, link)] in values
                    },
                )
                for link in range(links)
            )
        return SlowFields(
            energy_joules=None if energy is None else energy / 1000.0,
            pcie_correctable_errors=None if correctable is None else int(correctable),
            pcie_fatal_errors=None if fatal is None else int(fatal),
            violation_ns={
                reason: int(values[field_id]) for reason, field_id in _VIOLATION_FIELDS.items() if field_id in values
            },
            nvlink_errors=nvlinks,
        )

    def _nvlink_count(self, gpu: int) -> int:
        """How many NVLink links the GPU has: those nvmlDeviceGetNvLinkState answers for (counted once)."""
        count = self._nvlink_counts.get(gpu)
        if count is None:
            count = 0
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    self._device(gpu, "nvmlDeviceGetNvLinkState", link)
                except GpuError as exc:
                    if exc.kind not in (GpuErrorKind.NOT_SUPPORTED, GpuErrorKind.INVALID_ARGUMENT):
                        raise
                    break
                count += 1
            self._nvlink_counts[gpu] = count
        return count

    def nvlink_states(self, gpu: int) -> tuple[bool, ...]:
        """nvidia-smi nvlink -s (a speed per active link, <inactive> for one that is down)"""
        count = self._nvlink_count(gpu)
        if count == 0:
            message = "this GPU has no NVLink"
            raise GpuError(GpuErrorKind.NOT_SUPPORTED, message, gpu=gpu, call="nvmlDeviceGetNvLinkState")
        return tuple(int(self._device(gpu, "nvmlDeviceGetNvLinkState", link)) == ENABLED for link in range(count))

    def fabric_info(self, gpu: int) -> FabricInfo:
        """nvidia-smi -q (Fabric: State, Status, CliqueId, ClusterUUID); NOT_SUPPORTED off NVSwitch systems."""
        handle = self._handle(gpu)
        # Both calls fill the struct they are given (by reference) and return NVML_SUCCESS.
        info: Any = pynvml.c_nvmlGpuFabricInfo_v2_t()
        try:
            self._call(gpu, "nvmlDeviceGetGpuFabricInfoV", handle, ctypes.byref(info))
        except GpuError as exc:
            if exc.kind is not GpuErrorKind.NOT_SUPPORTED:
                raise
            info = pynvml.c_nvmlGpuFabricInfo_t()
            self._call(gpu, "nvmlDeviceGetGpuFabricInfo", handle, ctypes.byref(info))
        state = FabricState(int(info.state))
        if state is FabricState.NOT_SUPPORTED:
            message = "no NVSwitch fabric"
            raise GpuError(GpuErrorKind.NOT_SUPPORTED, message, gpu=gpu, call="nvmlDeviceGetGpuFabricInfoV")
        return FabricInfo(
            state=state,
            status=int(info.status),
            clique_id=int(info.cliqueId),
            cluster_uuid=str(uuid.UUID(bytes=bytes(info.clusterUuid))),
        )
