"""SimulatedBackend: the GpuBackend protocol over simulated GPUs, with NVML's semantics.

Calls go through the checks NVML makes (init, index, lost, reset required, injected failures
and hangs), read the machine state from the shared state file, and answer what
`agent.backend.sim.physics` derives; setters ask the write guard, then root, then the device.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from agent.backend.base import (
    ClockDomain,
    EccCounter,
    EccErrorType,
    EnabledPending,
    FabricInfo,
    FastFields,
    GpmActivity,
    GpuEvent,
    GpuIdentity,
    GpuProcess,
    MemoryInfo,
    NvLinkErrors,
    PcieLink,
    RemappedRows,
    SlowFields,
    TemperatureThreshold,
    Utilization,
    ViolationPolicy,
    WriteGuard,
)
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.sim.faults import FaultInjection
from agent.backend.sim.physics import Readings
from agent.backend.sim.profiles import load_profile
from agent.backend.sim.state import MachineState, StateFile
from agent.backend.sim.telemetry import GpmSample, GpuTelemetry, gpm_activity, telemetry

#: How often wait_events looks for injections made by another process.
_POLL_SECONDS = 0.1
_UUID_NAMESPACE = uuid.UUID("6f1d8a52-3c0e-4f57-9a59-2b8f0c1e7d43")


def _error(kind: GpuErrorKind, message: str, gpu: int | None, call: str) -> GpuError:
    return GpuError(kind, message, gpu=gpu, call=call)


class SimulatedBackend(FaultInjection):
    """GpuBackend over simulated GPUs described by a profile; state shared through state_dir."""

    name = "simulated"

    def __init__(
        self,
        profile: str | Path,
        state_dir: str | Path,
        writable_items: Iterable[str] = (),
        privileged: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.profile = load_profile(profile)
        self.state_dir = Path(state_dir)
        self.write_guard = WriteGuard(writable_items)
        self.privileged = privileged
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())
        self._init_count = 0
        self._file = StateFile(self.profile, self.state_dir)
        self._gpm_previous: dict[int, GpmSample] = {}
        with self._cond:
            self._file.refresh()

    @property
    def state_path(self) -> Path:
        return self._file.path

    @property
    def _state(self) -> MachineState:
        return self._file.state

    def _now_seconds(self) -> float:
        return self._clock()

    # -- state file -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _mutation(self) -> Iterator[MachineState]:
        """Lock, pick up other processes' changes, let the caller change the state, write it, wake waiters."""
        with self._cond, self._file.lock():
            self._file.refresh()
            yield self._file.state
            self._file.save()
            self._cond.notify_all()

    def reload(self) -> bool:
        """Re-read the state file if another process changed it; True when it did."""
        with self._cond:
            return self._file.refresh()

    # -- call plumbing --------------------------------------------------------------------

    def _check_index(self, gpu: int, call: str) -> None:
        if not 0 <= gpu < len(self.profile.models):
            raise _error(
                GpuErrorKind.INVALID_ARGUMENT, f"no GPU with index {gpu} ({len(self.profile.models)} GPUs)", gpu, call
            )

    def _hang_seconds(self, gpu: int | None, call: str) -> float:
        with self._cond:
            self._file.refresh()
            if gpu is not None and 0 <= gpu < len(self._state.gpus) and call in self._state.gpus[gpu].hang_calls:
                return self._state.gpus[gpu].hang_calls[call]
            return self._state.hang_calls.get(call, 0.0)

    def _hang(self, gpu: int | None, call: str) -> None:
        seconds = self._hang_seconds(gpu, call)
        if seconds > 0:
            # Outside the lock: a hung call must not freeze the other threads' calls.
            time.sleep(seconds)

    def _require_init(self, call: str) -> None:
        if self._init_count == 0:
            raise _error(GpuErrorKind.UNINITIALIZED, "NVML is not initialised (call init() first)", None, call)

    def _library_checks(self, call: str) -> None:
        self._require_init(call)
        kind = self._state.fail_calls.get(call)
        if kind is not None:
            raise _error(kind, f"injected failure of {call}", None, call)

    def _device(self, gpu: int, call: str) -> Readings:
        """The device for a per-GPU call, after the checks NVML makes (init, index, lost, reset, injected)."""
        self._require_init(call)
        self._check_index(gpu, call)
        state = self._state.gpus[gpu]
        if state.lost:
            raise _error(GpuErrorKind.GPU_LOST, "GPU has fallen off the bus", gpu, call)
        if state.reset_required and call != "identity":
            raise _error(GpuErrorKind.RESET_REQUIRED, "GPU requires reset", gpu, call)
        kind = state.fail_calls.get(call, self._state.fail_calls.get(call))
        if kind is not None:
            raise _error(kind, f"injected failure of {call}", gpu, call)
        return Readings(self.profile.models[gpu], state, self.profile.nvlink_links(gpu))

    @contextlib.contextmanager
    def _read(self, gpu: int, call: str) -> Iterator[Readings]:
        self._hang(gpu, call)
        with self._cond:
            self._file.refresh()
            yield self._device(gpu, call)

    @contextlib.contextmanager
    def _write(self, gpu: int, call: str) -> Iterator[Readings]:
        # NVML order: the agent's own guard, then root, then the device's state.
        self.write_guard.check(call)
        if not self.privileged:
            raise _error(GpuErrorKind.NO_PERMISSION, "insufficient permissions (setters need root)", gpu, call)
        self._hang(gpu, call)
        with self._mutation():
            yield self._device(gpu, call)

    # -- library --------------------------------------------------------------------------

    def init(self) -> None:
        self._hang(None, "init")
        with self._cond:
            self._file.refresh()
            kind = self._state.fail_calls.get("init")
            if kind is not None:
                raise _error(kind, "injected failure of init", None, "init")
            self._init_count += 1

    def shutdown(self) -> None:
        with self._cond:
            self._init_count = max(0, self._init_count - 1)

    def driver_version(self) -> str:
        self._hang(None, "driver_version")
        with self._cond:
            self._file.refresh()
            self._library_checks("driver_version")
            return self.profile.driver_version

    def cuda_driver_version(self) -> int:
        self._hang(None, "cuda_driver_version")
        with self._cond:
            self._file.refresh()
            self._library_checks("cuda_driver_version")
            return self.profile.cuda_driver_version

    def device_count(self) -> int:
        self._hang(None, "device_count")
        with self._cond:
            self._file.refresh()
            self._library_checks("device_count")
            # Lost GPUs still count until the driver reloads, as with NVML.
            return len(self.profile.models)

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

    def memory_info(self, gpu: int) -> MemoryInfo:
        """nvmlDeviceGetMemoryInfo_v2: used without the driver's reserved memory, as nvidia-smi shows."""
        memory = self._telemetry(gpu, "memory_info").memory
        return MemoryInfo(
            total_bytes=memory.total_bytes,
            used_bytes=memory.used_bytes,
            free_bytes=memory.free_bytes,
            reserved_bytes=memory.reserved_bytes,
        )

    def performance_state(self, gpu: int) -> int:
        with self._read(gpu, "performance_state") as dev:
            return 0 if dev.busy else dev.model.performance_state_idle

    # -- slower readings ------------------------------------------------------------------

    def temperature_threshold_celsius(self, gpu: int, threshold: TemperatureThreshold) -> int:
        with self._read(gpu, "temperature_threshold_celsius") as dev:
            value = dev.model.temperature_thresholds_c.celsius(threshold)
            if value is None:
                raise _error(
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
                raise _error(
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
            raise _error(
                GpuErrorKind.INVALID_ARGUMENT, "locked clocks are GRAPHICS or MEMORY", gpu, "locked_clocks_mhz"
            )

    def fan_count(self, gpu: int) -> int:
        with self._read(gpu, "fan_count") as dev:
            return dev.model.fan_count

    def _check_fan(self, dev: Readings, gpu: int, fan: int | None, call: str) -> None:
        if dev.model.fan_count == 0:
            raise _error(GpuErrorKind.NOT_SUPPORTED, f"{dev.model.name} has no fans", gpu, call)
        if fan is not None and not 0 <= fan < dev.model.fan_count:
            raise _error(GpuErrorKind.INVALID_ARGUMENT, f"no fan {fan} (fans 0-{dev.model.fan_count - 1})", gpu, call)

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
                raise _error(GpuErrorKind.NOT_SUPPORTED, f"{dev.model.name} has no ECC", gpu, "ecc_mode")
            return EnabledPending(current=dev.state.ecc_current, pending=dev.state.ecc_pending)

    def ecc_errors(self, gpu: int, error_type: EccErrorType, counter: EccCounter) -> int:
        with self._read(gpu, "ecc_errors") as dev:
            if not (dev.model.ecc_supported and dev.state.ecc_current):
                raise _error(GpuErrorKind.NOT_SUPPORTED, "ECC is not enabled", gpu, "ecc_errors")
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
                raise _error(GpuErrorKind.NOT_SUPPORTED, "no row remapping", gpu, "remapped_rows")
            s = dev.state
            return RemappedRows(s.remapped_correctable, s.remapped_uncorrectable, s.remapped_pending, s.remapped_failed)

    def retired_pages_pending(self, gpu: int) -> bool:
        with self._read(gpu, "retired_pages_pending") as dev:
            if not dev.model.retired_pages_supported:
                raise _error(GpuErrorKind.NOT_SUPPORTED, "no page retirement", gpu, "retired_pages_pending")
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
        with self._read(gpu, "violation_time_ns") as dev:
            return dev.state.violation_ns[ViolationPolicy(policy).name]

    def mig_mode(self, gpu: int) -> EnabledPending:
        with self._read(gpu, "mig_mode") as dev:
            if not dev.model.mig_supported:
                raise _error(GpuErrorKind.NOT_SUPPORTED, f"{dev.model.name} has no MIG", gpu, "mig_mode")
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
        with self._read(gpu, "total_energy_joules") as dev:
            return dev.state.energy_mj / 1000

    def telemetry(self, gpu: int) -> GpuTelemetry:
        """The profiling-grade readings (GPM sample, field values, memory v2, MIG, clocks, processes)
        behind the protocol's telemetry methods; the same checks as every per-GPU call."""
        return self._telemetry(gpu, "telemetry")

    def _telemetry(self, gpu: int, call: str) -> GpuTelemetry:
        """telemetry() under the protocol method's own call name, so fault injection can target it."""
        with self._read(gpu, call) as dev:
            return telemetry(gpu, dev, self.profile.name if self.profile.nvswitch_fabric else None)

    def applications_clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        return self._telemetry(gpu, "applications_clock_mhz").applications_clocks_mhz[ClockDomain(domain)]

    def gpm_activity(self, gpu: int) -> GpmActivity | None:
        """Differences this call's GPM sample against the previous call's, as nvmlGpmMetricsGet does;
        None on the first call and while no simulated time passed (see `advance`)."""
        sample = self._telemetry(gpu, "gpm_activity").gpm
        if sample is None:
            raise _error(GpuErrorKind.NOT_SUPPORTED, "GPM is not supported on this GPU", gpu, "gpm_activity")
        with self._cond:
            previous = self._gpm_previous.get(gpu)
            self._gpm_previous[gpu] = sample
        return None if previous is None else gpm_activity(previous, sample)

    def fast_fields(self, gpu: int) -> FastFields:
        fields = self._telemetry(gpu, "fast_fields").fields
        return FastFields(
            energy_joules=fields.total_energy_mj / 1000,
            power_instant_watts=fields.power_instant_mw / 1000,
            memory_temperature_celsius=fields.memory_temperature_c,
        )

    def slow_fields(self, gpu: int) -> SlowFields:
        fields = self._telemetry(gpu, "slow_fields").fields
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
            pcie_correctable_errors=fields.pcie_correctable_errors,
            pcie_fatal_errors=fields.pcie_fatal_errors,
            violation_ns=dict(fields.reason_duration_ns),
            nvlink_errors=nvlinks,
        )

    def nvlink_states(self, gpu: int) -> tuple[bool, ...]:
        links = self._telemetry(gpu, "nvlink_states").fields.nvlinks
        if links is None:
            raise _error(GpuErrorKind.NOT_SUPPORTED, "this GPU has no NVLink", gpu, "nvlink_states")
        return tuple(link.up for link in links)

    def fabric_info(self, gpu: int) -> FabricInfo:
        fabric = self._telemetry(gpu, "fabric_info").fabric
        if fabric is None:
            raise _error(GpuErrorKind.NOT_SUPPORTED, "no NVSwitch fabric on this node", gpu, "fabric_info")
        return fabric

    # -- events ---------------------------------------------------------------------------

    def wait_events(self, timeout_seconds: float) -> list[GpuEvent]:
        self._hang(None, "wait_events")
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            while True:
                self._file.refresh()
                self._library_checks("wait_events")
                lost = next((i for i, g in enumerate(self._state.gpus) if g.lost and not g.lost_reported), None)
                if lost is not None or self._state.events:
                    return self._take_events(lost)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                # In-process injections notify; another process's only show in the file, so poll it.
                self._cond.wait(min(_POLL_SECONDS, remaining))

    def _take_events(self, lost: int | None) -> list[GpuEvent]:
        if lost is not None:
            with self._mutation() as machine:
                machine.gpus[lost].lost_reported = True
            raise _error(GpuErrorKind.GPU_LOST, "GPU has fallen off the bus", lost, "wait_events")
        with self._mutation() as machine:
            events, machine.events = machine.events, []
        return events

    # -- setters --------------------------------------------------------------------------

    def set_power_limit_watts(self, gpu: int, watts: float) -> None:
        with self._write(gpu, "set_power_limit_watts") as dev:
            milliwatts = round(watts * 1000)
            m = dev.model
            if not m.power_limit_min_mw <= milliwatts <= m.power_limit_max_mw:
                raise _error(
                    GpuErrorKind.INVALID_ARGUMENT,
                    f"power limit {watts:g} W is outside the allowed range "
                    f"{m.power_limit_min_mw / 1000:g}-{m.power_limit_max_mw / 1000:g} W",
                    gpu,
                    "set_power_limit_watts",
                )
            dev.state.power_limit_mw = milliwatts

    def set_locked_clocks_mhz(self, gpu: int, domain: ClockDomain, min_mhz: int, max_mhz: int) -> None:
        call = "set_locked_clocks_mhz"
        with self._write(gpu, call) as dev:
            if domain == ClockDomain.GRAPHICS:
                supported = dev.model.supported_graphics_clocks_mhz
            elif domain == ClockDomain.MEMORY:
                supported = dev.model.supported_memory_clocks_mhz
            else:
                raise _error(GpuErrorKind.INVALID_ARGUMENT, "clocks can be locked for GRAPHICS or MEMORY", gpu, call)
            low, high = min(supported), max(supported)
            if not low <= min_mhz <= max_mhz <= high:
                raise _error(
                    GpuErrorKind.INVALID_ARGUMENT,
                    f"locked {domain.name.lower()} clocks {min_mhz}-{max_mhz} MHz must be an ascending range "
                    f"within the supported {low}-{high} MHz",
                    gpu,
                    call,
                )
            if domain == ClockDomain.GRAPHICS:
                dev.state.locked_graphics_mhz = (min_mhz, max_mhz)
            else:
                dev.state.locked_memory_mhz = (min_mhz, max_mhz)

    def reset_locked_clocks(self, gpu: int, domain: ClockDomain) -> None:
        with self._write(gpu, "reset_locked_clocks") as dev:
            if domain == ClockDomain.GRAPHICS:
                dev.state.locked_graphics_mhz = None
            elif domain == ClockDomain.MEMORY:
                dev.state.locked_memory_mhz = None
            else:
                raise _error(
                    GpuErrorKind.INVALID_ARGUMENT,
                    "clocks are locked for GRAPHICS or MEMORY",
                    gpu,
                    "reset_locked_clocks",
                )

    def set_fan_speed_percent(self, gpu: int, fan: int, percent: int) -> None:
        call = "set_fan_speed_percent"
        with self._write(gpu, call) as dev:
            self._check_fan(dev, gpu, fan, call)
            assert dev.model.fan_speed_range_percent is not None  # boards with fans have one (GpuModel checks)
            low, high = dev.model.fan_speed_range_percent
            if not low <= percent <= high:
                raise _error(
                    GpuErrorKind.INVALID_ARGUMENT, f"fan speed {percent} % is outside {low}-{high} %", gpu, call
                )
            dev.state.fan_manual[fan] = True
            dev.state.fan_speed_percent[fan] = percent

    def set_fan_automatic(self, gpu: int, fan: int) -> None:
        with self._write(gpu, "set_fan_automatic") as dev:
            self._check_fan(dev, gpu, fan, "set_fan_automatic")
            dev.state.fan_manual[fan] = False

    def set_persistence(self, gpu: int, enabled: bool) -> None:
        with self._write(gpu, "set_persistence") as dev:
            dev.state.persistence = enabled

    def set_ecc_mode(self, gpu: int, enabled: bool) -> None:
        with self._write(gpu, "set_ecc_mode") as dev:
            if not dev.model.ecc_supported:
                raise _error(GpuErrorKind.NOT_SUPPORTED, f"{dev.model.name} has no ECC", gpu, "set_ecc_mode")
            # Takes effect at the next reboot or GPU reset, as NVML's SetEccMode.
            dev.state.ecc_pending = enabled

    def reset_gpu(self, gpu: int) -> None:
        """`nvidia-smi --gpu-reset -i GPU`: refused while processes hold the GPU; settings to defaults."""
        call = "reset_gpu"
        self.write_guard.check(call)
        if not self.privileged:
            raise _error(GpuErrorKind.NO_PERMISSION, "GPU reset needs root", gpu, call)
        with self._mutation() as machine:
            self._check_index(gpu, call)
            state = machine.gpus[gpu]
            if state.lost:
                raise _error(GpuErrorKind.GPU_LOST, "cannot reset a GPU that has fallen off the bus", gpu, call)
            if state.processes:
                raise _error(
                    GpuErrorKind.IN_USE, f"processes {state.processes} are using the GPU; stop them first", gpu, call
                )
            state.restore_defaults(self.profile.models[gpu])
