"""The simulated GPU backend: NVML semantics without a GPU, for tests and `gpu-agent demo`.

`SimulatedBackend` implements `GpuBackend` the way NVML behaves, not only with its values:
milliwatts inside and watts outside, setters checked against the same constraint ranges and
supported-clock lists, `NOT_SUPPORTED` for features a board lacks (fans on an SXM H200, retired
pages on Hopper), `NO_PERMISSION` for setters without root, ECC mode changes that wait for a
reboot, a GPU that falls off the bus, calls that fail or hang, and an event queue for Xid/ECC.

Where things are
----------------
- `profiles`   the GPU model and node profile (pydantic), built-in and file profiles,
               `load_profile`, `list_profiles`, `validate_profile` (the check of the config's profile)
- `physics`    readings derived from model and state (power, temperature, clocks, throttle
               reasons, fans, GPM activity) and `advance`: simulated time passing
- `telemetry`  the profiling-grade readings (GPM, field values, NVLink, ...) as data (`GpuTelemetry`)
- `faults`     fault injection and the simulated world (argument checks, state changes)
- `state`      what a GPU remembers (`GpuState`) and the shared state file (`StateFile`)
- `calls`      the checks every call passes, in NVML's order (init, index, lost, reset,
               injected failures and hangs; for setters the write guard and root first)
- `reads`      the per-GPU readings (identity, hot and slower readings, processes)
- `profiling`  GPM activity, field values, memory v2, NVLink and fabric state over `telemetry`
- `setters`    the write side: setters and the GPU reset
- `backend`    `SimulatedBackend`: construction, library calls and events, composed of the parts above

Profiles
--------
A *GPU model* describes one board; a *node profile* lists the boards of one machine. Built-in
ones live in `agent/backend/profiles/models/NAME.json` and `agent/backend/profiles/nodes/NAME.json`;
`list_profiles()` names the built-in node profiles (h200, h200x2, h200x8, rtx-pro-6000,
rtx-pro-6000x2, mixed). A path to a JSON file works wherever a profile name does. A bad
profile is a `ProfileError` (a ValueError) naming the file and the field; `load_checked_config`
(agent.policy.dropins) checks `simulated.profile` with `validate_profile`, so `gpu-agent check-config`
reports it.

Node profile (built-in file or your own)::

    {
      "name": "lab-node",                       # optional; default: the file name without .json
      "description": "free text",               # optional
      "driver_version": "580.159.04",           # optional; this default is the fixture's
      "gpus": [                                 # in NVML index order
        {"model": "h200", "count": 2},          # a built-in model by name; count defaults to 1
        {"model": {"base": "rtx-pro-6000",      # an inline model: a built-in base and overrides,
                   "fan_count": 1}},            #   or every model key without "base"
      ],
      "pci_bus_ids": ["00000000:18:00.0", ...], # optional, one per GPU; default: HGX slot ids
      "nvlink_connected": true,                 # optional; default: two or more GPUs with links
      "nvswitch_fabric": true                   # optional (default false): an NVSwitch fabric that
                                                #   every GPU registers with (HGX); needs NVLink
    }

Other top-level keys (a demo scenario, for example) are left to whoever reads them.

GPU model (every key required unless it comes from "base" or is marked optional; unknown keys
are errors). Units are NVML's: milliwatts, millijoules, MHz, Celsius, bytes.

    name, vbios_version, serial_prefix        nvmlDeviceGetName / GetVbiosVersion; serials are
                                              serial_prefix + digits derived from the UUID
    memory_total_bytes, memory_used_idle_bytes      nvmlDeviceGetMemoryInfo with no process; the
                                              idle "used" is the driver's reserved memory (v2)
    power_limit_constraints_mw [min, max], power_limit_default_mw, power_usage_idle_mw
    energy_at_boot_mj                         nvmlDeviceGetTotalEnergyConsumption after boot
    temperature_idle_c
    temperature_thresholds_c {shutdown, slowdown, mem_max, gpu_max}: absent -> NOT_SUPPORTED
    max_clocks_mhz, idle_clocks_mhz {graphics, sm, memory}
    supported_memory_clocks_mhz [..]          highest first, as NVML lists them
    supported_graphics_clocks_mhz             a list, or {"max", "min", "step"}; one list
                                              serves every memory clock
    performance_state_idle                    P-state with no process (H200: P0, fixture)
    clock_event_reasons_idle, supported_clock_event_reasons, supported_event_types (bit masks)
    fan_count, fan_speed_range_percent [min, max] or null (optional), fan_auto_curve [[celsius, percent], ..]
    persistence_default, ecc_supported, ecc_default, mig_supported, mig_default
    retired_pages_supported, remapped_rows_supported, pcie_max_generation, pcie_max_width
    load_power_mw, load_temperature_c, load_utilization_gpu_percent,
    load_utilization_memory_percent, load_memory_fraction      what a GPU running a process does
    optional, absent = the board lacks it (NOT_SUPPORTED):
    memory_temperature_idle_c, memory_temperature_load_c       HBM temperature field
    gpm {"idle": {..}, "load": {..}}          GPM activity figures: sm_active_ratio,
                                              sm_occupancy_ratio, tensor_active_ratio, dram_active_ratio,
                                              graphics_active_ratio (0..1, optional, 0), pcie_{tx,rx}_bytes_per_second,
                                              nvlink_{tx,rx}_bytes_per_second (optional, 0)
    nvlink_links                              NVLink links of the board (default 0)

Where the numbers come from
---------------------------
`h200`: tests/fixtures/nvml-h200.json (a real H200 SXM, driver 580.159.04), except what the
fixture does not show: the graphics clock list below 1920 MHz (continued in 15 MHz steps down to
345 MHz, the Hopper floor), the memory threshold (95 C, what H100/H200 SXM report, since confirmed
by nvml-h200-gpm-fields.json), and the load figures (an inference server at full batch: 655 W,
66 C). GPM and field values follow /work/shared/fixtures/nvml-h200-gpm-fields.json (the same H200
idle and under a bf16 matmul): idle SM/tensor activity 0, DRAM 0.0004, PCIe 0.38/0.22 MiB/s; loaded
SM active 0.96, occupancy 0.14, tensor active 0.94, DRAM 0.17, graphics 0.9985, PCIe 4.7/13.7 MiB/s; HBM 39 C idle,
49 C loaded; MIG (0, 0); application clocks = max clocks (1980 MHz). Assumed: 18 NVLink links
(H200 SXM), used only where the node connects two or more of them (h200x2, h200x8, mixed): a single
H200 answered NOT_SUPPORTED for every NVLink field and link state and 0 for GPM NVLink; the loaded
NVLink rate (an assumption, ~25 GB/s each way for tensor-parallel decode) is not measured.
`h200x8` has an NVSwitch fabric (HGX H200), registered at boot; the recorded H200 gave no fabric
answer (a single GPU, and the recording script called the function wrongly), so its shape follows
the NVML documentation, not a recording.
`rtx-pro-6000` (NVIDIA RTX PRO 6000 Blackwell Workstation Edition): confirmed from public
material: the name string, 96 GB GDDR7 with ECC (nvidia-smi shows 97887 MiB), 600 W board power,
PCIe 5.0 x16, a double-flow-through cooler (two fans), MIG support (R575+ MIG guide), power limits
down to at least 250 W, no NVLink. Picked as plausible and NOT confirmed: 150 W minimum limit,
graphics clocks 180-2625 MHz in 15 MHz steps (the 2617 MHz boost rounded up to the grid), memory
clocks [14001, 810, 405] MHz (GDDR7 at 28 Gbps, as GeForce GB202 boards list), thresholds
95/92/90 C with no memory threshold and no memory temperature (GDDR boards report none), fan
range 30-100 %, the automatic fan curve, VBIOS and serial prefix, idle and load figures. No
GPM: no recorded answer from this board exists, so the profile says unsupported (and gives the
`mixed` node a GPU on the "activity: not supported" path) until a fixture shows otherwise. ECC
is off and persistence mode off at boot, as workstation boards ship.

Readings and time: see `agent.backend.sim.physics`.

Beyond the protocol
-------------------
Fault injection and the simulated world (`inject_xid`, `inject_ecc_event`, `set_lost`,
`set_reset_required`, `set_recovery_action`, `set_temperature`, `set_power_usage`,
`set_clock_event_reasons`, `add_ecc_errors`, `set_remapped_rows`, `set_retired_pages_pending`,
`set_pcie_link`, `add_pcie_replays`, `add_pcie_errors`, `add_nvlink_errors`, `set_nvlink_up`,
`set_fabric_state`, `set_processes`, `fail_call`, `hang_call`, `advance`, `reboot`, `reset_gpu`, `reload`) and two
extra readings, `total_energy_joules` and `telemetry`. Injection needs neither init() nor a
writable item; a nonsensical injection (a GPU index the profile lacks, retired pages on a board
that remaps rows) is a ValueError.

Profiling-grade telemetry, `telemetry(gpu) -> GpuTelemetry`: the protocol's
`gpm_activity`, `fast_fields`, `slow_fields`, `nvlink_states`, `fabric_info`,
`applications_clock_mhz` and `memory_info` (v2) are thin wrappers over it, each under its own call
name so `fail_call`/`hang_call` can target it; `gpm_activity` differences against the previous
call's sample, so activity appears once simulated time has passed (`advance`, or the counter
clock the daemon and the demo run it with; docs/simulator.md):

    gpm                GpmSample (cumulative counters) or None where GPM is unsupported;
                       `gpm_activity(earlier, later)` differences two samples like
                       nvmlGpmMetricsGet: ratios 0..1 and bytes per second (base units; NVML
                       gives percent and MiB/s). Counters grow with `advance()` and the counter clock.
    fields             FieldValues: total energy (mJ), instant power (mW), HBM temperature
                       (None on GDDR), clock-event reason durations (ns: sw_power_cap,
                       sync_boost, sw_thermal, hw_thermal, hw_power_brake), PCIe replay,
                       correctable and fatal counts, remapped correctable rows, recovery
                       action, NVLink per-link state and CRC flit/data, replay, recovery
                       counters (None: NOT_SUPPORTED, as on a single H200)
    memory             MemoryInfoV2: total, reserved, used (processes only), free =
                       total - reserved - used (v1 `memory_info` keeps counting reserved as used)
    memory_max_temperature_c, mig_mode, max_clocks_mhz, applications_clocks_mhz,
    processes          (PID, used memory; names come from /proc, not NVML)
    fabric             FabricInfo (state, registration status, clique, cluster UUID) on nodes
                       with an NVSwitch fabric (h200x8), None elsewhere (NOT_SUPPORTED);
                       `set_fabric_state` makes a GPU unregistered (fabric manager down)

State file
----------
`<state_dir>/simulated-gpus.json` holds settings, counters and injected faults (not derived
readings); see `agent.backend.sim.state`.

NVML details reproduced: calls before `init()` (or after the last `shutdown()`) raise
UNINITIALIZED; a lost GPU answers GPU_LOST to every call (identity included) but still counts in
`device_count()`; a GPU that needs a reset answers RESET_REQUIRED to every call but `identity()`;
ECC counters raise NOT_SUPPORTED while ECC is disabled; an unknown memory clock for
`supported_graphics_clocks_mhz` is INVALID_ARGUMENT (NVML says NOT_FOUND, which GpuErrorKind lacks).
Not reproduced: PCIe links training down at idle (the link reads at its maximum unless
`set_pcie_link` says otherwise) and per-memory-clock graphics clock lists.
"""

from agent.backend.base import FabricInfo, FabricState, GpmActivity
from agent.backend.sim.backend import SimulatedBackend
from agent.backend.sim.faults import EVENT_DOUBLE_BIT_ECC, EVENT_SINGLE_BIT_ECC, EVENT_XID
from agent.backend.sim.physics import (
    REASON_GPU_IDLE,
    REASON_HW_POWER_BRAKE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
    REASON_SYNC_BOOST,
)
from agent.backend.sim.profiles import (
    DEFAULT_DRIVER_VERSION,
    HGX_PCI_BUS_IDS,
    PROFILES_DIR,
    GpuModel,
    NodeProfile,
    ProfileError,
    list_profiles,
    load_profile,
    validate_profile,
)
from agent.backend.sim.state import PROTOCOL_METHODS, STATE_FILE_NAME
from agent.backend.sim.telemetry import (
    FieldValues,
    GpmSample,
    GpuTelemetry,
    MemoryInfoV2,
    NvLinkCounters,
    gpm_activity,
)

__all__ = [
    "DEFAULT_DRIVER_VERSION",
    "EVENT_DOUBLE_BIT_ECC",
    "EVENT_SINGLE_BIT_ECC",
    "EVENT_XID",
    "HGX_PCI_BUS_IDS",
    "PROFILES_DIR",
    "PROTOCOL_METHODS",
    "REASON_GPU_IDLE",
    "REASON_HW_POWER_BRAKE",
    "REASON_HW_SLOWDOWN",
    "REASON_HW_THERMAL",
    "REASON_SW_POWER_CAP",
    "REASON_SW_THERMAL",
    "REASON_SYNC_BOOST",
    "STATE_FILE_NAME",
    "FabricInfo",
    "FabricState",
    "FieldValues",
    "GpmActivity",
    "GpmSample",
    "GpuModel",
    "GpuTelemetry",
    "MemoryInfoV2",
    "NodeProfile",
    "NvLinkCounters",
    "ProfileError",
    "SimulatedBackend",
    "gpm_activity",
    "list_profiles",
    "load_profile",
    "validate_profile",
]
