"""The write side of the simulated backend: NVML's setters and the GPU reset.

Every setter passes the write guard, then root, then the device's checks (`SimCalls._write`),
and checks its value the way NVML does (the board's power range, its supported clocks, its fan
speed range) before it changes the shared state.
"""

from __future__ import annotations

import math

from agent.backend.base import ClockDomain
from agent.backend.errors import GpuErrorKind
from agent.backend.sim.calls import SimCalls, sim_error


class DeviceSetters(SimCalls):
    """The protocol's setters: guard, root, device checks, then one change of the shared state."""

    def set_power_limit_watts(self, gpu: int, watts: float) -> None:
        with self._write(gpu, "set_power_limit_watts") as dev:
            m = dev.model
            # NVML takes unsigned milliwatts: NaN or infinity cannot even be passed
            milliwatts = round(watts * 1000) if math.isfinite(watts) else -1
            if not m.power_limit_min_mw <= milliwatts <= m.power_limit_max_mw:
                raise sim_error(
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
                raise sim_error(GpuErrorKind.INVALID_ARGUMENT, "clocks can be locked for GRAPHICS or MEMORY", gpu, call)
            low, high = min(supported), max(supported)
            if not low <= min_mhz <= max_mhz <= high:
                raise sim_error(
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
                raise sim_error(
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
                raise sim_error(
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
                raise sim_error(GpuErrorKind.NOT_SUPPORTED, f"{dev.model.name} has no ECC", gpu, "set_ecc_mode")
            # Takes effect at the next reboot or GPU reset, as NVML's SetEccMode.
            dev.state.ecc_pending = enabled

    def reset_gpu(self, gpu: int) -> None:
        """`nvidia-smi --gpu-reset -i GPU`: refused while processes hold the GPU; settings to defaults."""
        call = "reset_gpu"
        # Not a per-GPU call in NVML's sense: a reset reaches a GPU that needs one.
        self._check_writable(gpu, call, "GPU reset needs root")
        with self._mutation() as machine:
            self._check_index(gpu, call)
            state = machine.gpus[gpu]
            if state.lost:
                raise sim_error(GpuErrorKind.GPU_LOST, "cannot reset a GPU that has fallen off the bus", gpu, call)
            if state.processes:
                raise sim_error(
                    GpuErrorKind.IN_USE, f"processes {state.processes} are using the GPU; stop them first", gpu, call
                )
            state.restore_defaults(self.profile.models[gpu])
