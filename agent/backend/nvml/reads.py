"""What the NVML backend reads of one GPU: identity, the hot readings sampled every loop and the
slower ones (limits, clocks, fans, modes, error counters, processes). Units are converted here,
at the boundary: NVML's milliwatts become watts; MHz, Celsius, percent, bytes and nanoseconds
pass through unchanged.
"""

from __future__ import annotations

import ctypes

import pynvml

from agent.backend.base import (
    ClockDomain,
    EccCounter,
    EccErrorType,
    EnabledPending,
    GpuIdentity,
    GpuProcess,
    MemoryInfo,
    PcieLink,
    RemappedRows,
    TemperatureThreshold,
    Utilization,
    ViolationPolicy,
)
from agent.backend.errors import GpuError, GpuErrorKind
from agent.backend.nvml.calls import ENABLED, NvmlCalls, lock_calls, to_gpu_error

_MIG_ENABLED: int = pynvml.NVML_DEVICE_MIG_ENABLE
_FAN_MANUAL: int = pynvml.NVML_FAN_POLICY_MANUAL

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: field ids are fixed in nvml.h; older nvidia-ml-py lack the name.
_FIELD_RECOVERY_ACTION = 230


class DeviceReads(NvmlCalls):
    """The protocol's per-GPU readings."""

    _unlocked_ranges: dict[tuple[int, ClockDomain], tuple[int, int]]
    _memory_v1_only: set[int]  # GPUs whose driver has no nvmlDeviceGetMemoryInfo_v2

    def identity(self, gpu: int) -> GpuIdentity:
        """nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,serial,vbios_version

        `serial` is "" on boards that do not report one (NOT_SUPPORTED, e.g. GeForce).
        """
        try:
            serial = str(self._device(gpu, "nvmlDeviceGetSerial"))
        except GpuError as exc:
            if exc.kind is not GpuErrorKind.NOT_SUPPORTED:
                raise
            serial = ""
        return GpuIdentity(
            index=gpu,
            uuid=str(self._device(gpu, "nvmlDeviceGetUUID")),
            name=str(self._device(gpu, "nvmlDeviceGetName")),
            pci_bus_id=str(self._device(gpu, "nvmlDeviceGetPciInfo").busId),
            serial=serial,
            vbios_version=str(self._device(gpu, "nvmlDeviceGetVbiosVersion")),
            minor_number=int(self._device(gpu, "nvmlDeviceGetMinorNumber")),
        )

    # -- hot readings --------------------------------------------------------------------------

    def temperature_celsius(self, gpu: int) -> int:
        """nvidia-smi --query-gpu=temperature.gpu"""
        handle = self._handle(gpu)
        names = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
        return int(self._call_first(gpu, names, handle, pynvml.NVML_TEMPERATURE_GPU))

    def power_usage_watts(self, gpu: int) -> float:
        """nvidia-smi --query-gpu=power.draw (NVML: milliwatts)"""
        return int(self._device(gpu, "nvmlDeviceGetPowerUsage")) / 1000.0

    def clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        """nvidia-smi --query-gpu=clocks.gr,clocks.sm,clocks.mem"""
        return int(self._device(gpu, "nvmlDeviceGetClockInfo", int(domain)))

    def clock_event_reasons(self, gpu: int) -> int:
        """Bit mask, nvidia-smi --query-gpu=clocks_event_reasons.active (older: clocks_throttle_reasons.active)"""
        names = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        return int(self._call_first(gpu, names, self._handle(gpu)))

    def utilization(self, gpu: int) -> Utilization:
        """nvidia-smi --query-gpu=utilization.gpu,utilization.memory"""
        rates = self._device(gpu, "nvmlDeviceGetUtilizationRates")
        return Utilization(gpu_percent=int(rates.gpu), memory_percent=int(rates.memory))

    def memory_info(self, gpu: int) -> MemoryInfo:
        """nvidia-smi --query-gpu=memory.total,memory.reserved,memory.used,memory.free (bytes; nvidia-smi: MiB)

        nvmlDeviceGetMemoryInfo_v2, whose `used` leaves out the driver's reserved memory as nvidia-smi
        does (an idle H200: v2 used 0, v1 used 615 MiB); v1 where the driver predates v2.
        """
        if gpu not in self._memory_v1_only:
            try:
                memory = self._device(gpu, "nvmlDeviceGetMemoryInfo", pynvml.nvmlMemory_v2)
            except GpuError as exc:
                if exc.kind is not GpuErrorKind.NOT_SUPPORTED:
                    raise
                self._memory_v1_only.add(gpu)  # an older driver: ask v1 straight away from now on
            else:
                return MemoryInfo(
                    total_bytes=int(memory.total),
                    used_bytes=int(memory.used),
                    free_bytes=int(memory.free),
                    reserved_bytes=int(memory.reserved),
                )
        memory = self._device(gpu, "nvmlDeviceGetMemoryInfo")
        return MemoryInfo(total_bytes=int(memory.total), used_bytes=int(memory.used), free_bytes=int(memory.free))

    def performance_state(self, gpu: int) -> int:
        """nvidia-smi --query-gpu=pstate (0 for P0)"""
        return int(self._device(gpu, "nvmlDeviceGetPerformanceState"))

    # -- slower readings -----------------------------------------------------------------------

    def temperature_threshold_celsius(self, gpu: int, threshold: TemperatureThreshold) -> int:
        """nvidia-smi -q -d TEMPERATURE (shutdown, slowdown, memory max, GPU max operating temperature)"""
        return int(self._device(gpu, "nvmlDeviceGetTemperatureThreshold", int(threshold)))

    def power_limit_watts(self, gpu: int) -> float:
        """nvidia-smi --query-gpu=power.limit"""
        return int(self._device(gpu, "nvmlDeviceGetPowerManagementLimit")) / 1000.0

    def power_limit_constraints_watts(self, gpu: int) -> tuple[float, float]:
        """(min, max): nvidia-smi --query-gpu=power.min_limit,power.max_limit"""
        min_mw, max_mw = self._device(gpu, "nvmlDeviceGetPowerManagementLimitConstraints")
        return int(min_mw) / 1000.0, int(max_mw) / 1000.0

    def default_power_limit_watts(self, gpu: int) -> float:
        """nvidia-smi --query-gpu=power.default_limit"""
        return int(self._device(gpu, "nvmlDeviceGetPowerManagementDefaultLimit")) / 1000.0

    def max_clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        """nvidia-smi --query-gpu=clocks.max.gr,clocks.max.sm,clocks.max.mem"""
        return int(self._device(gpu, "nvmlDeviceGetMaxClockInfo", int(domain)))

    def supported_memory_clocks_mhz(self, gpu: int) -> list[int]:
        """nvidia-smi --query-supported-clocks=mem"""
        return [int(mhz) for mhz in self._device(gpu, "nvmlDeviceGetSupportedMemoryClocks")]

    def supported_graphics_clocks_mhz(self, gpu: int, memory_mhz: int) -> list[int]:
        """nvidia-smi --query-supported-clocks=mem,gr (the graphics clocks listed for one memory clock)"""
        return [int(mhz) for mhz in self._device(gpu, "nvmlDeviceGetSupportedGraphicsClocks", memory_mhz)]

    def locked_clocks_mhz(self, gpu: int, domain: ClockDomain) -> tuple[int, int] | None:
        """The locked (min, max) range of GRAPHICS or MEMORY clocks, None when unlocked.

        NVML has no getter for locked clocks. The closest read-back is the P0 range,
        nvmlDeviceGetMinMaxClockOfPState(domain, P0), the range the driver may pick clocks
        from in P0, which a lock set with nvmlDeviceSetGpuLockedClocks / SetMemoryLockedClocks
        narrows. It is compared with what P0 spans when nothing is locked: for graphics the
        whole supported graphics clock list (at the top memory clock), for memory the top
        memory clock alone (lower memory clocks belong to lower P-states). When P0 spans at
        least that much the clocks are unlocked (None); otherwise the P0 range is the lock.

        Read on an H200 (driver 580.159.04) with nothing locked: P0 graphics (345, 1980) =
        the supported list's range, P0 memory (3201, 3201) while 2201 MHz is P2's.

        Limitations: an inference, not a read of the lock itself. A lock that restricts
        nothing P0 allows reads as None. That a lock narrows the P0 range is NVML's documented
        model but still to be confirmed per architecture (it needs a write to test): where it
        does not, a lock reads as None and the policy sees drift it cannot confirm as fixed.
        SM is not a lockable domain (INVALID_ARGUMENT).
        """
        lock_calls(gpu, domain)
        # Fresh out-parameters: pynvml's default ones are module-level objects shared between threads.
        p0_min, p0_max = self._device(
            gpu, "nvmlDeviceGetMinMaxClockOfPState", int(domain), pynvml.NVML_PSTATE_0, ctypes.c_uint(), ctypes.c_uint()
        )
        unlocked_min, unlocked_max = self._unlocked_p0_range(gpu, domain)
        if int(p0_min) <= unlocked_min and int(p0_max) >= unlocked_max:
            return None
        return int(p0_min), int(p0_max)

    def _unlocked_p0_range(self, gpu: int, domain: ClockDomain) -> tuple[int, int]:
        """What P0 spans with nothing locked, from the supported clock lists; cached per board."""
        cached = self._unlocked_ranges.get((gpu, domain))
        if cached is not None:
            return cached
        top_memory = max(self.supported_memory_clocks_mhz(gpu))
        unlocked = (top_memory, top_memory)
        if domain is ClockDomain.GRAPHICS:
            graphics = self.supported_graphics_clocks_mhz(gpu, top_memory)
            unlocked = (min(graphics), max(graphics))
        self._unlocked_ranges[(gpu, domain)] = unlocked
        return unlocked

    def fan_count(self, gpu: int) -> int:
        """0 on fan-less boards (SXM). nvidia-smi has no field; -q lists one Fan Speed per fan."""
        return int(self._device(gpu, "nvmlDeviceGetNumFans"))

    def fan_speed_percent(self, gpu: int, fan: int) -> int:
        """nvidia-smi --query-gpu=fan.speed; NOT_SUPPORTED on fan-less boards."""
        return int(self._fan_call(gpu, fan, "nvmlDeviceGetFanSpeed_v2", fan))

    def fan_manual(self, gpu: int, fan: int) -> bool:
        """True when the fan runs at a speed set by software (nvmlDeviceGetFanControlPolicy_v2).

        No nvidia-smi equivalent.
        """
        policy = self._fan_call(gpu, fan, "nvmlDeviceGetFanControlPolicy_v2", fan, ctypes.c_uint())
        return int(policy) == _FAN_MANUAL

    def fan_speed_range_percent(self, gpu: int) -> tuple[int, int]:
        """(min, max) settable speed (nvmlDeviceGetMinMaxFanSpeed). No nvidia-smi equivalent."""
        min_percent, max_percent = self._fan_call(
            gpu, None, "nvmlDeviceGetMinMaxFanSpeed", ctypes.c_uint(), ctypes.c_uint()
        )
        return int(min_percent), int(max_percent)

    def persistence_enabled(self, gpu: int) -> bool:
        """nvidia-smi --query-gpu=persistence_mode"""
        return int(self._device(gpu, "nvmlDeviceGetPersistenceMode")) == ENABLED

    def ecc_mode(self, gpu: int) -> EnabledPending:
        """nvidia-smi --query-gpu=ecc.mode.current,ecc.mode.pending"""
        current, pending = self._device(gpu, "nvmlDeviceGetEccMode")
        return EnabledPending(current=int(current) == ENABLED, pending=int(pending) == ENABLED)

    def ecc_errors(self, gpu: int, error_type: EccErrorType, counter: EccCounter) -> int:
        """nvidia-smi --query-gpu=ecc.errors.{corrected,uncorrected}.{volatile,aggregate}.total"""
        return int(self._device(gpu, "nvmlDeviceGetTotalEccErrors", int(error_type), int(counter)))

    def remapped_rows(self, gpu: int) -> RemappedRows:
        """nvidia-smi -q -d ROW_REMAPPER (correctable, uncorrectable, pending, remapping failure)"""
        correctable, uncorrectable, pending, failed = self._device(gpu, "nvmlDeviceGetRemappedRows")
        return RemappedRows(
            correctable=int(correctable), uncorrectable=int(uncorrectable), pending=bool(pending), failed=bool(failed)
        )

    def retired_pages_pending(self, gpu: int) -> bool:
        """nvidia-smi --query-gpu=retired_pages.pending; NOT_SUPPORTED where row remapping replaced it (A100+)."""
        return int(self._device(gpu, "nvmlDeviceGetRetiredPagesPendingStatus")) == ENABLED

    def pcie_link(self, gpu: int) -> PcieLink:
        """nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max"""
        return PcieLink(
            current_generation=int(self._device(gpu, "nvmlDeviceGetCurrPcieLinkGeneration")),
            current_width=int(self._device(gpu, "nvmlDeviceGetCurrPcieLinkWidth")),
            max_generation=int(self._device(gpu, "nvmlDeviceGetMaxPcieLinkGeneration")),
            max_width=int(self._device(gpu, "nvmlDeviceGetMaxPcieLinkWidth")),
        )

    def pcie_replay_counter(self, gpu: int) -> int:
        """nvidia-smi -q -d PCIE (Replays Since Reset)"""
        return int(self._device(gpu, "nvmlDeviceGetPcieReplayCounter"))

    def violation_time_ns(self, gpu: int, policy: ViolationPolicy) -> int:
        """Time clocks were held back by `policy`, in ns since driver load (NVML's violationTime, as given).

        No nvidia-smi query field; DCGM exposes it as DCGM_FI_DEV_POWER_VIOLATION, ..._THERMAL_VIOLATION.
        """
        return int(self._device(gpu, "nvmlDeviceGetViolationStatus", int(policy)).violationTime)

    def mig_mode(self, gpu: int) -> EnabledPending:
        """nvidia-smi --query-gpu=mig.mode.current,mig.mode.pending"""
        current, pending = self._device(gpu, "nvmlDeviceGetMigMode")
        return EnabledPending(current=int(current) == _MIG_ENABLED, pending=int(pending) == _MIG_ENABLED)

    def recovery_action(self, gpu: int) -> int:
        """What the driver says the GPU needs, a `RecoveryAction` value (nvidia-smi -q: GPU Recovery Action).

        Read as field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION of nvmlDeviceGetFieldValues; a driver
        that predates the field (before R550) answers INVALID_ARGUMENT for it: NOT_SUPPORTED here.
        An H200 on driver 580.159.04 answered 0 (NONE) as an unsigned int.
        """
        call = "nvmlDeviceGetFieldValues"
        (field,) = self._device(gpu, call, [_FIELD_RECOVERY_ACTION])
        status = int(field.nvmlReturn)
        if status == pynvml.NVML_ERROR_INVALID_ARGUMENT:
            raise GpuError(
                GpuErrorKind.NOT_SUPPORTED, "this NVIDIA driver reports no recovery action", gpu=gpu, call=call
            )
        if status != pynvml.NVML_SUCCESS:
            raise to_gpu_error(pynvml.NVMLError(status), gpu, call)
        return int(field.value.uiVal)

    def compute_processes(self, gpu: int) -> list[GpuProcess]:
        """nvidia-smi --query-compute-apps=pid,process_name,used_memory (used memory None where NVML cannot
        tell; the name None where the process is gone or hidden from this one)"""
        names = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
        processes = self._call_first(gpu, names, self._handle(gpu))
        return [
            GpuProcess(
                pid=int(process.pid),
                used_memory_bytes=None if process.usedGpuMemory is None else int(process.usedGpuMemory),
                name=self._process_name(int(process.pid)),
            )
            for process in processes
        ]

    def _process_name(self, pid: int) -> str | None:
        try:
            name = self._call(None, "nvmlSystemGetProcessName", pid)
        except GpuError:
            return None
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def applications_clock_mhz(self, gpu: int, domain: ClockDomain) -> int:
        """nvidia-smi --query-gpu=clocks.applications.graphics,clocks.applications.memory"""
        return int(self._device(gpu, "nvmlDeviceGetApplicationsClock", int(domain)))
