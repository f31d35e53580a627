"""How a simulated GPU behaves: readings derived from its model and state, and time passing.

Readings are deterministic functions of the settings and injected faults: a GPU is busy when it
has processes, runs at the locked or maximum clock when busy, draws the power that clock costs
(`busy_power_mw`) capped by its power limit (SwPowerCap when capped: the clock drops to the highest
one the limit pays for, `capped_clock_ratio`), warms in proportion to its power, and halves its
clock under hardware slowdown (temperature at or above the slowdown threshold).

Power and clocks (the shape of a DVFS board; references in docs/simulator.md): a busy GPU's power
at clock ratio x = f / f_max is

    P(x) = P_static + (P_load - P_static) * x * v(x)^2,   v(x) = v0 + (1 - v0) * x

a floor that does not follow the core clock (`load_static_power_mw`: leakage, memory, board; the
idle draw where a model does not say) plus the switching power C V^2 f, with the core voltage
rising linearly with the clock from `voltage_offset_ratio` (v0) of its top value. P(1) is
`load_power_mw`, so a GPU at its maximum clock draws what it always did. Work done per second is
proportional to the clock (the stand-in server's tokens follow the clock), so tokens per joule go
as x / P(x): low clocks waste the static floor, high clocks pay the voltage, and the best lies
between, where P_static = 2 (P_load - P_static) x^2 v(x) (1 - v0).
Overrides (`set_temperature`, `set_power_usage`, `set_clock_event_reasons`) replace the derived
values. Fans on automatic follow `fan_auto_curve`. Time passes only through `advance`: energy
grows by power x time, violation and clock-event-reason durations by the active reasons, GPM
counters by the activity rates.
"""

from __future__ import annotations

import itertools

from agent.backend.base import ClockDomain, GpmActivity, TemperatureThreshold, ViolationPolicy
from agent.backend.sim.profiles import GpmLoad, GpuModel
from agent.backend.sim.state import GpuState

# nvmlClocksEventReason* bits
REASON_GPU_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_SYNC_BOOST = 0x10
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80

#: Which clock-event reasons make each violation counter (nvmlDeviceGetViolationStatus) grow.
VIOLATION_POLICY_BITS = {
    ViolationPolicy.POWER: REASON_SW_POWER_CAP,
    ViolationPolicy.THERMAL: REASON_SW_THERMAL | REASON_HW_THERMAL,
    ViolationPolicy.SYNC_BOOST: REASON_SYNC_BOOST,
    ViolationPolicy.BOARD_LIMIT: REASON_HW_POWER_BRAKE,
    ViolationPolicy.LOW_UTILIZATION: REASON_GPU_IDLE,
    ViolationPolicy.RELIABILITY: REASON_HW_SLOWDOWN,
    ViolationPolicy.TOTAL_APP_CLOCKS: REASON_SW_POWER_CAP
    | REASON_SW_THERMAL
    | REASON_HW_THERMAL
    | REASON_SYNC_BOOST
    | REASON_HW_POWER_BRAKE
    | REASON_HW_SLOWDOWN,
    ViolationPolicy.TOTAL_BASE_CLOCKS: REASON_HW_SLOWDOWN | REASON_HW_THERMAL | REASON_HW_POWER_BRAKE,
}
#: The reason bit behind each NVML_FI_DEV_CLOCKS_EVENT_REASON_* duration field.
REASON_FIELD_BITS = {
    "sw_power_cap": REASON_SW_POWER_CAP,
    "sync_boost": REASON_SYNC_BOOST,
    "sw_thermal": REASON_SW_THERMAL,
    "hw_thermal": REASON_HW_THERMAL,
    "hw_power_brake": REASON_HW_POWER_BRAKE,
}


#: v0 where a model does not give `voltage_offset_ratio`: the core voltage at the lowest clocks is about
#: half its top value on recent NVIDIA boards (published V/F curves run ~0.65-0.7 V to ~1.05-1.1 V).
DEFAULT_VOLTAGE_OFFSET_RATIO = 0.55


def busy_power_mw(model: GpuModel, clock_ratio: float) -> float:
    """What a busy GPU draws at `clock_ratio` of its maximum graphics clock (P(x) above)."""
    static_mw = _static_power_mw(model)
    offset = _voltage_offset(model)
    ratio = min(max(clock_ratio, 0.0), 1.0)
    voltage = offset + (1.0 - offset) * ratio
    return static_mw + (model.load_power_mw - static_mw) * ratio * voltage * voltage


def capped_clock_ratio(model: GpuModel, limit_mw: float) -> float:
    """The highest clock ratio a busy GPU can hold within `limit_mw` (0 when even the floor costs more)."""
    if busy_power_mw(model, 1.0) <= limit_mw:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(40):  # P(x) rises monotonically: bisection to well below one clock step
        middle = (low + high) / 2
        if busy_power_mw(model, middle) <= limit_mw:
            low = middle
        else:
            high = middle
    return low


def _static_power_mw(model: GpuModel) -> float:
    static = model.load_static_power_mw
    return float(model.power_usage_idle_mw if static is None else static)


def _voltage_offset(model: GpuModel) -> float:
    offset = model.voltage_offset_ratio
    return DEFAULT_VOLTAGE_OFFSET_RATIO if offset is None else offset


class Readings:
    """One GPU's readings, computed from its model and state: plausible and deterministic."""

    def __init__(self, model: GpuModel, state: GpuState, nvlink_links: int = 0) -> None:
        self.model = model
        self.state = state
        self.nvlink_links = nvlink_links

    @property
    def busy(self) -> bool:
        return bool(self.state.processes)

    def _busy_target_mhz(self) -> int:
        """The clock a busy GPU asks for: the top of its lock, or its maximum."""
        clocks = self.model.supported_graphics_clocks_mhz
        return (self.state.locked_graphics_mhz or (clocks[-1], clocks[0]))[1]

    def demand_mw(self) -> int:
        """What the GPU would draw without a power limit: its clock's power when busy, else idle."""
        if not self.busy:
            return self.model.power_usage_idle_mw
        return round(busy_power_mw(self.model, self._busy_target_mhz() / self.model.max_clocks_mhz.graphics))

    def power_mw(self) -> int:
        if self.state.power_override_mw is not None:
            return self.state.power_override_mw
        return min(self.demand_mw(), self.state.power_limit_mw)

    def power_capped(self) -> bool:
        if self.state.power_override_mw is not None:
            return self.state.power_override_mw >= self.state.power_limit_mw
        return self.demand_mw() > self.state.power_limit_mw

    def _load_share(self) -> float:
        """How far between idle and full load the power draw is: 0 idle, 1 at load_power_mw."""
        m = self.model
        span_mw = m.load_power_mw - m.power_usage_idle_mw
        if span_mw <= 0:
            return 0.0
        return max(0.0, (self.power_mw() - m.power_usage_idle_mw) / span_mw)

    def temperature_c(self) -> int:
        if self.state.temperature_override_c is not None:
            return self.state.temperature_override_c
        m = self.model
        return m.temperature_idle_c + round((m.load_temperature_c - m.temperature_idle_c) * self._load_share())

    def memory_temperature_c(self) -> int | None:
        """HBM temperature (NVML_FI_DEV_MEMORY_TEMP), warming with power like the GPU; None: not supported."""
        idle, load = self.model.memory_temperature_idle_c, self.model.memory_temperature_load_c
        if idle is None or load is None:
            return None
        return idle + round((load - idle) * self._load_share())

    def reasons(self) -> int:
        if self.state.reasons_override is not None:
            return self.state.reasons_override
        m = self.model
        mask = 0 if self.busy else m.clock_event_reasons_idle
        if self.power_capped():
            mask |= REASON_SW_POWER_CAP
        temperature = self.temperature_c()
        gpu_max = m.temperature_thresholds_c.celsius(TemperatureThreshold.GPU_MAX)
        slowdown = m.temperature_thresholds_c.celsius(TemperatureThreshold.SLOWDOWN)
        if gpu_max is not None and temperature >= gpu_max:
            mask |= REASON_SW_THERMAL
        if slowdown is not None and temperature >= slowdown:
            mask |= REASON_HW_SLOWDOWN | REASON_HW_THERMAL
        return mask & m.supported_clock_event_reasons

    def graphics_mhz(self) -> int:
        clocks = self.model.supported_graphics_clocks_mhz
        low, high = self.state.locked_graphics_mhz or (clocks[-1], clocks[0])
        target = high if self.busy else min(max(self.model.idle_clocks_mhz.graphics, low), high)
        reasons = self.reasons()
        if reasons & REASON_SW_POWER_CAP and self.busy:
            # The power controller lowers the clock until the busy draw fits under the limit.
            reachable = capped_clock_ratio(self.model, self.state.power_limit_mw) * self.model.max_clocks_mhz.graphics
            target = min(target, int(reachable))
        if reasons & (REASON_HW_SLOWDOWN | REASON_HW_THERMAL):
            target //= 2
        return next((c for c in clocks if c <= target), clocks[-1])

    def memory_mhz(self) -> int:
        idle = self.model.idle_clocks_mhz.memory
        if self.state.locked_memory_mhz is not None:
            low, high = self.state.locked_memory_mhz
            return high if self.busy else min(max(idle, low), high)
        return self.model.max_clocks_mhz.memory if self.busy else idle

    def clock_mhz(self, domain: ClockDomain) -> int:
        return self.memory_mhz() if domain == ClockDomain.MEMORY else self.graphics_mhz()

    def process_memory_bytes(self) -> int:
        """Memory of each process (an equal share of the load's memory beyond the reserved)."""
        m = self.model
        budget = int(m.memory_total_bytes * m.load_memory_fraction) - m.memory_used_idle_bytes
        return max(0, budget) // len(self.state.processes)

    def used_by_processes_bytes(self) -> int:
        return self.process_memory_bytes() * len(self.state.processes) if self.busy else 0

    def fan_auto_percent(self) -> int:
        assert self.model.fan_speed_range_percent is not None  # boards with fans have one (GpuModel checks)
        low, high = self.model.fan_speed_range_percent
        curve = self.model.fan_auto_curve
        temperature = self.temperature_c()
        percent = curve[-1][1]
        if temperature <= curve[0][0]:
            percent = curve[0][1]
        for (t0, p0), (t1, p1) in itertools.pairwise(curve):
            if t0 <= temperature <= t1:
                percent = round(p0 + (p1 - p0) * (temperature - t0) / (t1 - t0)) if t1 > t0 else p1
                break
        return min(max(percent, low), high)

    def gpm_rates(self) -> GpmActivity | None:
        """GPM activity following the load; None where the board has no GPM.

        Time shares (SM active, occupancy, tensor active) are the profile's busy or idle figures;
        throughput (DRAM, PCIe, NVLink) scales with the graphics clock against its maximum, so a
        power-capped or thermally slowed GPU moves fewer bytes. NVLink moves nothing where the
        node has no NVLink (GPM answers 0 there, as on the single-GPU H200).
        """
        gpm = self.model.gpm
        if gpm is None:
            return None
        figures: GpmLoad = gpm.load if self.busy else gpm.idle
        throughput = min(1.0, self.graphics_mhz() / self.model.max_clocks_mhz.graphics) if self.busy else 1.0
        nvlink = throughput if len(self.state.nvlinks_down) < self.nvlink_links else 0.0
        return GpmActivity(
            sm_active_ratio=figures.sm_active_ratio,
            sm_occupancy_ratio=figures.sm_occupancy_ratio,
            tensor_active_ratio=figures.tensor_active_ratio,
            graphics_active_ratio=figures.graphics_active_ratio,
            dram_active_ratio=figures.dram_active_ratio * throughput,
            pcie_tx_bytes_per_second=figures.pcie_tx_bytes_per_second * throughput,
            pcie_rx_bytes_per_second=figures.pcie_rx_bytes_per_second * throughput,
            nvlink_tx_bytes_per_second=figures.nvlink_tx_bytes_per_second * nvlink,
            nvlink_rx_bytes_per_second=figures.nvlink_rx_bytes_per_second * nvlink,
        )


def advance(readings: Readings, seconds: float) -> None:
    """`seconds` of simulated time pass for one GPU at its current readings (the caller checked lost)."""
    state = readings.state
    nanoseconds = round(seconds * 1e9)
    reasons = readings.reasons()
    for policy, bits in VIOLATION_POLICY_BITS.items():
        if reasons & bits:
            state.violation_ns[policy.name] += nanoseconds
    for name, bit in REASON_FIELD_BITS.items():
        if reasons & bit:
            state.reason_ns[name] += nanoseconds
    state.energy_mj += round(readings.power_mw() * seconds)
    rates = readings.gpm_rates()
    if rates is None:
        return
    gpm = state.gpm
    gpm.elapsed_ns += nanoseconds
    gpm.sm_active_seconds += rates.sm_active_ratio * seconds
    gpm.sm_occupancy_seconds += rates.sm_occupancy_ratio * seconds
    gpm.tensor_active_seconds += rates.tensor_active_ratio * seconds
    gpm.dram_active_seconds += rates.dram_active_ratio * seconds
    gpm.graphics_active_seconds += (rates.graphics_active_ratio or 0.0) * seconds
    gpm.pcie_tx_bytes += round(rates.pcie_tx_bytes_per_second * seconds)
    gpm.pcie_rx_bytes += round(rates.pcie_rx_bytes_per_second * seconds)
    gpm.nvlink_tx_bytes += round(rates.nvlink_tx_bytes_per_second * seconds)
    gpm.nvlink_rx_bytes += round(rates.nvlink_rx_bytes_per_second * seconds)
