"""Profiling-grade readings of a simulated GPU (GPM, field values, NVLink, fabric), as data with the real H200's shapes.

Not yet in the backend protocol: `SimulatedBackend.telemetry(gpu)` returns a `GpuTelemetry`
snapshot, and the protocol methods that expose these readings will be thin wrappers over it.
Where a reading is None, the real call answers NOT_SUPPORTED on that board (see the package
docstring for what follows the fixture and what is assumed).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from agent.backend.base import (
    ClockDomain,
    EnabledPending,
    FabricInfo,
    FabricState,
    GpmActivity,
    GpuProcess,
    TemperatureThreshold,
)
from agent.backend.sim.physics import Readings
from agent.backend.sim.state import GpmCounters


@dataclass(frozen=True)
class GpmSample:
    """nvmlGpmSampleGet: cumulative counters at one moment of simulated time."""

    gpu: int
    counters: GpmCounters


def gpm_activity(earlier: GpmSample, later: GpmSample) -> GpmActivity | None:
    """nvmlGpmMetricsGet over two samples: the activity between them (None: no time passed)."""
    if earlier.gpu != later.gpu:
        raise ValueError("GPM samples of different GPUs")
    a, b = earlier.counters, later.counters
    seconds = (b.elapsed_ns - a.elapsed_ns) / 1e9
    if seconds <= 0:
        return None
    return GpmActivity(
        sm_active_ratio=(b.sm_active_seconds - a.sm_active_seconds) / seconds,
        sm_occupancy_ratio=(b.sm_occupancy_seconds - a.sm_occupancy_seconds) / seconds,
        tensor_active_ratio=(b.tensor_active_seconds - a.tensor_active_seconds) / seconds,
        dram_active_ratio=(b.dram_active_seconds - a.dram_active_seconds) / seconds,
        pcie_tx_bytes_per_second=(b.pcie_tx_bytes - a.pcie_tx_bytes) / seconds,
        pcie_rx_bytes_per_second=(b.pcie_rx_bytes - a.pcie_rx_bytes) / seconds,
        nvlink_tx_bytes_per_second=(b.nvlink_tx_bytes - a.nvlink_tx_bytes) / seconds,
        nvlink_rx_bytes_per_second=(b.nvlink_rx_bytes - a.nvlink_rx_bytes) / seconds,
        graphics_active_ratio=(b.graphics_active_seconds - a.graphics_active_seconds) / seconds,
    )


@dataclass(frozen=True)
class NvLinkCounters:
    """One link: nvmlDeviceGetNvLinkState and its NVML_FI_DEV_NVLINK_*_ERROR_COUNT_L<n> fields."""

    link: int
    up: bool
    crc_flit_errors: int
    crc_data_errors: int
    replay_errors: int
    recovery_errors: int


@dataclass(frozen=True)
class FieldValues:
    """One nvmlDeviceGetFieldValues batch, in NVML's units (mJ, mW, ns)."""

    total_energy_mj: int  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
    power_instant_mw: int  # NVML_FI_DEV_POWER_INSTANT
    memory_temperature_c: int | None  # NVML_FI_DEV_MEMORY_TEMP (HBM); None: NOT_SUPPORTED
    reason_duration_ns: Mapping[str, int]  # NVML_FI_DEV_CLOCKS_EVENT_REASON_*: sw_power_cap, ...
    pcie_replay_count: int  # NVML_FI_DEV_PCIE_REPLAY_COUNTER
    pcie_correctable_errors: int  # NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS
    pcie_fatal_errors: int  # NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR
    remapped_correctable_rows: int | None  # NVML_FI_DEV_REMAPPED_COR; None: no row remapping
    recovery_action: int  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    nvlinks: tuple[NvLinkCounters, ...] | None  # None: the NVLink fields answer NOT_SUPPORTED

    def nvlink_total(self, counter: str) -> int | None:
        """NVML_FI_DEV_NVLINK_<COUNTER>_ERROR_COUNT_TOTAL: the sum over the links."""
        if self.nvlinks is None:
            return None
        counts = {
            "crc_flit": [link.crc_flit_errors for link in self.nvlinks],
            "crc_data": [link.crc_data_errors for link in self.nvlinks],
            "replay": [link.replay_errors for link in self.nvlinks],
            "recovery": [link.recovery_errors for link in self.nvlinks],
        }
        return sum(counts[counter])


@dataclass(frozen=True)
class MemoryInfoV2:
    """nvmlDeviceGetMemoryInfo_v2: `used` excludes the driver's reserved memory (nvidia-smi's "Used")."""

    total_bytes: int
    reserved_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class GpuTelemetry:
    gpm: GpmSample | None  # None: nvmlGpmQueryDeviceSupport says unsupported
    fields: FieldValues
    memory: MemoryInfoV2
    memory_max_temperature_c: int | None  # nvmlDeviceGetTemperatureThreshold(MEM_MAX)
    mig_mode: EnabledPending | None  # None: no MIG on the board
    max_clocks_mhz: Mapping[ClockDomain, int]  # nvmlDeviceGetMaxClockInfo
    applications_clocks_mhz: Mapping[ClockDomain, int]  # nvmlDeviceGetApplicationsClock
    processes: tuple[GpuProcess, ...]  # nvmlDeviceGetComputeRunningProcesses (PID, used memory)
    fabric: FabricInfo | None  # None: no NVSwitch fabric (NOT_SUPPORTED)


_CLUSTER_NAMESPACE = uuid.UUID("0b6f3c1e-8a3d-4c59-b1f2-6d0e4f7a9c21")


def telemetry(gpu: int, readings: Readings, fabric_node: str | None) -> GpuTelemetry:
    """Every profiling-grade reading of one GPU at this moment; `fabric_node` names the node's
    NVSwitch fabric (None: the node has none)."""
    model, state = readings.model, readings.state
    reserved = model.memory_used_idle_bytes
    used = readings.used_by_processes_bytes()
    nvlinks = None
    if readings.nvlink_links:
        errors = state.nvlink_errors
        nvlinks = tuple(
            NvLinkCounters(
                link=link,
                up=link not in state.nvlinks_down,
                crc_flit_errors=errors["crc_flit"][link],
                crc_data_errors=errors["crc_data"][link],
                replay_errors=errors["replay"][link],
                recovery_errors=errors["recovery"][link],
            )
            for link in range(readings.nvlink_links)
        )
    fields = FieldValues(
        total_energy_mj=state.energy_mj,
        power_instant_mw=readings.power_mw(),
        memory_temperature_c=readings.memory_temperature_c(),
        reason_duration_ns=dict(state.reason_ns),
        pcie_replay_count=state.pcie_replays,
        pcie_correctable_errors=state.pcie_correctable_errors,
        pcie_fatal_errors=state.pcie_fatal_errors,
        remapped_correctable_rows=state.remapped_correctable if model.remapped_rows_supported else None,
        recovery_action=state.recovery_action,
        nvlinks=nvlinks,
    )
    # Application clocks have no setter here (deprecated for Volta and later): they stay at the default,
    # the maximum, as the H200 answered (nvmlDeviceGetApplicationsClock = 1980 MHz).
    clocks = {domain: model.max_clocks_mhz.mhz(domain) for domain in ClockDomain}
    pids = state.processes if readings.busy else []
    each = readings.process_memory_bytes() if pids else 0
    return GpuTelemetry(
        gpm=GpmSample(gpu, state.gpm.model_copy()) if model.gpm is not None else None,
        fields=fields,
        memory=MemoryInfoV2(
            total_bytes=model.memory_total_bytes,
            reserved_bytes=reserved,
            used_bytes=used,
            free_bytes=model.memory_total_bytes - reserved - used,
        ),
        memory_max_temperature_c=model.temperature_thresholds_c.celsius(TemperatureThreshold.MEM_MAX),
        mig_mode=EnabledPending(state.mig_current, state.mig_pending) if model.mig_supported else None,
        max_clocks_mhz=clocks,
        applications_clocks_mhz=dict(clocks),
        processes=tuple(GpuProcess(pid=pid, used_memory_bytes=each) for pid in pids),
        fabric=None
        if fabric_node is None
        else FabricInfo(
            state=FabricState(state.fabric_state),
            status=state.fabric_status,
            clique_id=1,  # one baseboard: one NVLink clique
            cluster_uuid=str(uuid.uuid5(_CLUSTER_NAMESPACE, fabric_node)),
        ),
    )
