"""What the simulated backend reads of one GPU: identity, the hot readings the daemon samples
every loop, and the slower ones (limits, clocks, fans, modes, error counters, processes).

Each answer is derived from the GPU's model and state by `agent.backend.sim.physics`, after the
checks NVML makes (`SimCalls._read`); a feature the board lacks answers NOT_SUPPORTED.
"""

from __future__ import annotations

import uuid

from agent.backend.base import (
    ClockDomain,
    EccCounter,
    EccErrorType,
    EnabledPending,
    GpuIdentity,
    GpuProcess,
    PcieLink,
    RemappedRows,
    TemperatureThreshold,
    Utilization,
    ViolationPolicy,
)
from agent.backend.errors import GpuErrorKind
from agent.backend.sim.calls import SimCalls, sim_error

_UUID_NAMESPACE = uuid.UUID("6f1d8a52-3c0e-4f57-9a59-2b8f0c1e7d43")


class DeviceReads(SimCalls):
    """The protocol's per-GPU readings, answered from the simulated device."""

    def identity(self, gpu: int) -> GpuIdentity:
        with self._read(gpu, "identity") as dev:
            uid = uuid.uuid5(_UUID_NAMESPACE, f"{self.profile.name}/{gpu}")
            return GpuIdentity(
                index=gpu,
                uuid=f"GPU-{uid}",
                name=dev.model.name,
                pci_bus_id=self.profile.pci_bus_ids[gpu],
                serial=dev.model.serial_prefix + str(uid.int % 10**9).zfill(9),
                vbios_version=dev.model.vbios_version,
                minor_number=gpu,
            )

    # -- hot readings ---------------------------------------------------------------------

    def temperature_celsius(self, gpu: int) -> int:
        with self._read(gpu, "temperature_celsius") as dev:
            return dev.temperature_c()

    def power_usage_watts(self, gpu: int) -> float:
        with self._read(gpu, "power_usage_watts") as dev:
            return dev.power_mw() / 1000

    def clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        with self._read(gpu, "clock_mhz") as dev:
            return dev.memory_mhz() if domain == ClockDomain.MEMORY else dev.graphics_mhz()

    def clock_event_reasons(self, gpu: int) -> int:
        with self._read(gpu, "clock_event_reasons") as dev:
            return dev.reasons()

    def utilization(self, gpu: int) -> Utilization:
        with self._read(gpu, "utilization") as dev:
            if not dev.busy:
                return Utilization(gpu_percent=0, memory_percent=0)
            return Utilization(dev.model.load_utilization_gpu_percent, dev.model.load_utilization_memory_percent)

    def performance_state(self, gpu: int) -> int:
        with self._read(gpu, "performance_state") as dev:
            return 0 if dev.busy else dev.model.performance_state_idle

    # -- slower readings ------------------------------------------------------------------

    def temperature_threshold_celsius(self, gpu: int, threshold: TemperatureThreshold) -> int:
        with self._read(gpu, "temperature_threshold_celsius") as dev:
            value = dev.model.temperature_thresholds_c.celsius(threshold)
            if value is None:
                raise sim_error(
                    GpuErrorKind.NOT_SUPPORTED,
                    f"no {threshold.name} temperature threshold",
                    gpu,
                    "temperature_threshold_celsius",
                )
            return value

    def power_limit_watts(self, gpu: int) -> float:
        with self._read(gpu, "power_limit_watts") as dev:
            return dev.state.power_limit_mw / 1000

    def power_limit_constraints_watts(self, gpu: int) -> tuple[float, float]:
        with self._read(gpu, "power_limit_constraints_watts") as dev:
            return (dev.model.power_limit_min_mw / 1000, dev.model.power_limit_max_mw / 1000)

    def default_power_limit_watts(self, gpu: int) -> float:
        with self._read(gpu, "default_power_limit_watts") as dev:
            return dev.model.power_limit_default_mw / 1000

    def max_clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        with self._read(gpu, "max_clock_mhz") as dev:
            return dev.model.max_clocks_mhz.mhz(domain)

    def supported_memory_clocks_mhz(self, gpu: int) -> list[int]:
        with self._read(gpu, "supported_memory_clocks_mhz") as dev:
            return list(dev.model.supported_memory_clocks_mhz)

    def supported_graphics_clocks_mhz(self, gpu: int, memory_mhz: int) -> list[int]:
        with self._read(gpu, "supported_graphics_clocks_mhz") as dev:
            if memory_mhz not in dev.model.supported_memory_clocks_mhz:
                raise sim_error(
                    GpuErrorKind.INVALID_ARGUMENT,
                    f"{memory_mhz} MHz is not a supported memory clock "
                    f"(supported: {list(dev.model.supported_memory_clocks_mhz)})",
                    gpu,
                    "supported_graphics_clocks_mhz",
                )
            return list(dev.model.supported_graphics_clocks_mhz)

    def locked_clocks_mhz(self, gpu: int, domain: ClockDomain) -> tuple[int, int] | None:
        with self._read(gpu, "locked_clocks_mhz") as dev:
            if domain == ClockDomain.GRAPHICS:
                return dev.state.locked_graphics_mhz
            if domain == ClockDomain.MEMORY:
                return dev.state.locked_memory_mhz
            raise sim_error(
                GpuErrorKind.INVALID_ARGUMENT, "locked clocks are GRAPHICS or MEMORY", gpu, "locked_clocks_mhz"
            )

    def fan_count(self, gpu: int) -> int:
        with self._read(gpu, "fan_count") as dev:
            return dev.model.fan_count

    def fan_speed_percent(self, gpu: int, fan: int) -> int:
        with self._read(gpu, "fan_speed_percent") as dev:
            self._check_fan(dev, gpu, fan, "fan_speed_percent")
            return dev.state.fan_speed_percent[fan] if dev.state.fan_manual[fan] else dev.fan_auto_percent()

    def fan_manual(self, gpu: int, fan: int) -> bool:
        with self._read(gpu, "fan_manual") as dev:
            self._check_fan(dev, gpu, fan, "fan_manual")
            return dev.state.fan_manual[fan]

    def fan_speed_range_percent(self, gpu: int) -> tuple[int, int]:
        with self._read(gpu, "fan_speed_range_percent") as dev:
            self._check_fan(dev, gpu, None, "fan_speed_range_percent")
            assert dev.model.fan_speed_range_percent is not None  # boards with fans have one (GpuModel checks)
            return dev.model.fan_speed_range_percent

    def persistence_enabled(self, gpu: int) -> bool:
        with self._read(gpu, "persistence_enabled") as dev:
            return dev.state.persistence

    def ecc_mode(self, gpu: int) -> EnabledPending:
        with self._read(gpu, "ecc_mode") as dev:
            if not dev.model.ecc_supported:
                raise sim_error(GpuErrorKind.NOT_SUPPORTED, f"{dev.model.name} has no ECC", gpu, "ecc_mode")
            return EnabledPending(current=dev.state.ecc_current, pending=dev.state.ecc_pending)

    def ecc_errors(self, gpu: int, error_type: EccErrorType, counter: EccCounter) -> int:
        with self._read(gpu, "ecc_errors") as dev:
            if not (dev.model.ecc_supported and dev.state.ecc_current):
                raise sim_error(GpuErrorKind.NOT_SUPPORTED, "ECC is not enabled", gpu, "ecc_errors")
            s = dev.state
            counts = {
                (EccErrorType.CORRECTED, EccCounter.VOLATILE): s.ecc_volatile_corrected,
                (EccErrorType.UNCORRECTED, EccCounter.VOLATILE): s.ecc_volatile_uncorrected,
                (EccErrorType.CORRECTED, EccCounter.AGGREGATE): s.ecc_aggregate_corrected,
                (EccErrorType.UNCORRECTED, EccCounter.AGGREGATE): s.ecc_aggregate_uncorrected,
            }
            return counts[(EccErrorType(error_type), EccCounter(counter))]

    def remapped_rows(self, gpu: int) -> RemappedRows:
        with self._read(gpu, "remapped_rows") as dev:
            if not dev.model.remapped_rows_supported:
                raise sim_error(GpuErrorKind.NOT_SUPPORTED, "no row remapping", gpu, "remapped_rows")
            s = dev.state
            return RemappedRows(s.remapped_correctable, s.remapped_uncorrectable, s.remapped_pending, s.remapped_failed)

    def retired_pages_pending(self, gpu: int) -> bool:
        with self._read(gpu, "retired_pages_pending") as dev:
            if not dev.model.retired_pages_supported:
                raise sim_error(GpuErrorKind.NOT_SUPPORTED, "no page retirement", gpu, "retired_pages_pending")
            return dev.state.retired_pages_pending

    def pcie_link(self, gpu: int) -> PcieLink:
        with self._read(gpu, "pcie_link") as dev:
            m, s = dev.model, dev.state
            return PcieLink(
                current_generation=s.pcie_generation if s.pcie_generation is not None else m.pcie_max_generation,
                current_width=s.pcie_width if s.pcie_width is not None else m.pcie_max_width,
                max_generation=m.pcie_max_generation,
                max_width=m.pcie_max_width,
            )

    def pcie_replay_counter(self, gpu: int) -> int:
        with self._read(gpu, "pcie_replay_counter") as dev:
            return dev.state.pcie_replays

    def violation_time_ns(self, gpu: int, policy: ViolationPolicy) -> int:
        with self._read(gpu, "violation_time_ns", counters=True) as dev:
            return dev.state.violation_ns[ViolationPolicy(policy).name]

    def mig_mode(self, gpu: int) -> EnabledPending:
        with self._read(gpu, "mig_mode") as dev:
            if not dev.model.mig_supported:
                raise sim_error(GpuErrorKind.NOT_SUPPORTED, f"{dev.model.name} has no MIG", gpu, "mig_mode")
            return EnabledPending(current=dev.state.mig_current, pending=dev.state.mig_pending)

    def recovery_action(self, gpu: int) -> int:
        with self._read(gpu, "recovery_action") as dev:
            return dev.state.recovery_action

    def compute_processes(self, gpu: int) -> list[GpuProcess]:
        with self._read(gpu, "compute_processes") as dev:
            if not dev.busy:
                return []
            each = dev.process_memory_bytes()
            return [GpuProcess(pid=pid, used_memory_bytes=each) for pid in dev.state.processes]

    def total_energy_joules(self, gpu: int) -> float:
        """nvmlDeviceGetTotalEnergyConsumption (since the driver loaded); grows with advance()."""
        with self._read(gpu, "total_energy_joules", counters=True) as dev:
            return dev.state.energy_mj / 1000
