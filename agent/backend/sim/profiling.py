"""The profiling-grade answers of the simulated backend: GPM activity, field values, memory v2,
NVLink and fabric state, applications clocks.

Each protocol method here is a thin wrapper over one `GpuTelemetry` snapshot
(`agent.backend.sim.telemetry`), taken under the method's own call name so `fail_call` and
`hang_call` can target it.
"""

from __future__ import annotations

from agent.backend.base import ClockDomain, FabricInfo, FastFields, GpmActivity, MemoryInfo, NvLinkErrors, SlowFields
from agent.backend.errors import GpuErrorKind
from agent.backend.sim.calls import SimCalls, sim_error
from agent.backend.sim.telemetry import GpmSample, GpuTelemetry, gpm_activity, telemetry


class ProfilingReads(SimCalls):
    """The protocol's profiling-grade readings, each a view of one `GpuTelemetry` snapshot."""

    #: The previous GPM sample per GPU, which the next gpm_activity differences against.
    _gpm_previous: dict[int, GpmSample]

    def telemetry(self, gpu: int) -> GpuTelemetry:
        """The profiling-grade readings (GPM sample, field values, memory v2, MIG, clocks, processes)
        behind the protocol's telemetry methods; the same checks as every per-GPU call."""
        return self._telemetry(gpu, "telemetry", counters=True)

    def _telemetry(self, gpu: int, call: str, counters: bool = False) -> GpuTelemetry:
        """telemetry() under the protocol method's own call name, so fault injection can target it;
        `counters`: the caller answers from the time-based counters (energy, durations, GPM)."""
        with self._read(gpu, call, counters) as dev:
            return telemetry(gpu, dev, self.profile.name if self.profile.nvswitch_fabric else None)

    def memory_info(self, gpu: int) -> MemoryInfo:
        """nvmlDeviceGetMemoryInfo_v2: used without the driver's reserved memory, as nvidia-smi shows."""
        memory = self._telemetry(gpu, "memory_info").memory
        return MemoryInfo(
            total_bytes=memory.total_bytes,
            used_bytes=memory.used_bytes,
            free_bytes=memory.free_bytes,
            reserved_bytes=memory.reserved_bytes,
        )

    def applications_clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        return self._telemetry(gpu, "applications_clock_mhz").applications_clocks_mhz[ClockDomain(domain)]

    def gpm_activity(self, gpu: int) -> GpmActivity | None:
        """Differences this call's GPM sample against the previous call's, as nvmlGpmMetricsGet does;
        None on the first call and while no simulated time passed (see `advance`)."""
        sample = self._telemetry(gpu, "gpm_activity", counters=True).gpm
        if sample is None:
            raise sim_error(GpuErrorKind.NOT_SUPPORTED, "GPM is not supported on this GPU", gpu, "gpm_activity")
        with self._cond:
            previous = self._gpm_previous.get(gpu)
            self._gpm_previous[gpu] = sample
        return None if previous is None else gpm_activity(previous, sample)

    def fast_fields(self, gpu: int) -> FastFields:
        fields = self._telemetry(gpu, "fast_fields").fields
        return FastFields(
            power_instant_watts=fields.power_instant_mw / 1000,
            memory_temperature_celsius=fields.memory_temperature_c,
        )

    def slow_fields(self, gpu: int) -> SlowFields:
        fields = self._telemetry(gpu, "slow_fields", counters=True).fields
        nvlinks = None
        if fields.nvlinks is not None:
            nvlinks = tuple(
                NvLinkErrors(
                    link.link,
                    {
                        "crc_flit": link.crc_flit_errors,
                        "crc_data": link.crc_data_errors,
                        "replay": link.replay_errors,
                        "recovery": link.recovery_errors,
                    },
                )
                for link in fields.nvlinks
            )
        return SlowFields(
            energy_joules=fields.total_energy_mj / 1000,
            pcie_correctable_errors=fields.pcie_correctable_errors,
            pcie_fatal_errors=fields.pcie_fatal_errors,
            violation_ns=dict(fields.reason_duration_ns),
            nvlink_errors=nvlinks,
        )

    def nvlink_states(self, gpu: int) -> tuple[bool, ...]:
        links = self._telemetry(gpu, "nvlink_states").fields.nvlinks
        if links is None:
            raise sim_error(GpuErrorKind.NOT_SUPPORTED, "this GPU has no NVLink", gpu, "nvlink_states")
        return tuple(link.up for link in links)

    def fabric_info(self, gpu: int) -> FabricInfo:
        fabric = self._telemetry(gpu, "fabric_info").fabric
        if fabric is None:
            raise sim_error(GpuErrorKind.NOT_SUPPORTED, "no NVSwitch fabric on this node", gpu, "fabric_info")
        return fabric
