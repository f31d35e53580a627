"""The NVML backend's setters: each asks the write guard first, so a setter for an item in observe
mode raises WriteRefused before any NVML call is made.
"""

from __future__ import annotations

from agent.backend.base import ClockDomain
from agent.backend.nvml.calls import DISABLED, ENABLED, NvmlCalls, lock_calls


class DeviceSetters(NvmlCalls):
    """The protocol's setters (the GPU reset, which restarts the NVML session, is the backend's)."""

    def set_power_limit_watts(self, gpu: int, watts: float) -> None:
        """nvidia-smi -pl WATTS (NVML takes milliwatts)."""
        self.write_guard.check("set_power_limit_watts")
        self._device(gpu, "nvmlDeviceSetPowerManagementLimit", round(watts * 1000))

    def set_locked_clocks_mhz(self, gpu: int, domain: ClockDomain, min_mhz: int, max_mhz: int) -> None:
        """nvidia-smi -lgc MIN,MAX (GRAPHICS: nvmlDeviceSetGpuLockedClocks) / -lmc MIN,MAX (MEMORY)."""
        self.write_guard.check("set_locked_clocks_mhz")
        set_call, _ = lock_calls(gpu, domain)
        self._device(gpu, set_call, min_mhz, max_mhz)

    def reset_locked_clocks(self, gpu: int, domain: ClockDomain) -> None:
        """nvidia-smi -rgc (GRAPHICS: nvmlDeviceResetGpuLockedClocks) / -rmc (MEMORY)."""
        self.write_guard.check("reset_locked_clocks")
        _, reset_call = lock_calls(gpu, domain)
        self._device(gpu, reset_call)

    def set_fan_speed_percent(self, gpu: int, fan: int, percent: int) -> None:
        """nvmlDeviceSetFanSpeed_v2: switches the fan to manual control at `percent`."""
        self.write_guard.check("set_fan_speed_percent")
        self._fan_call(gpu, fan, "nvmlDeviceSetFanSpeed_v2", fan, percent)

    def set_fan_automatic(self, gpu: int, fan: int) -> None:
        """nvmlDeviceSetDefaultFanSpeed_v2: gives the fan back to the driver's curve."""
        self.write_guard.check("set_fan_automatic")
        self._fan_call(gpu, fan, "nvmlDeviceSetDefaultFanSpeed_v2", fan)

    def set_persistence(self, gpu: int, enabled: bool) -> None:
        """nvidia-smi -pm 1|0."""
        self.write_guard.check("set_persistence")
        mode = ENABLED if enabled else DISABLED
        self._device(gpu, "nvmlDeviceSetPersistenceMode", mode)

    def set_ecc_mode(self, gpu: int, enabled: bool) -> None:
        """nvidia-smi -e 1|0 (takes effect after a reboot: ecc_mode().pending shows it)."""
        self.write_guard.check("set_ecc_mode")
        mode = ENABLED if enabled else DISABLED
        self._device(gpu, "nvmlDeviceSetEccMode", mode)
