"""The simulated GPU backend: NVML semantics without a GPU, for tests and `gpu-agent demo`.

`SimulatedBackend` implements `GpuBackend` the way NVML behaves, not only with its values:
milliwatts inside and watts outside, setters checked against the same constraint ranges and
supported-clock lists, `NOT_SUPPORTED` for features a board lacks (fans on an SXM H200, retired
pages on Hopper), `NO_PERMISSION` for setters without root, ECC mode changes that wait for a
reboot, a GPU that falls off the bus, calls that fail or hang, and an event queue for Xid/ECC.

Profiles
--------
A *GPU model* describes one board; a *node profile* lists the boards of one machine. Built-in
ones live in `agent/backend/profiles/models/NAME.json` and `agent/backend/profiles/nodes/NAME.json`;
`list_profiles()` names the built-in node profiles (h200, h200x2, h200x8, rtx-pro-6000,
rtx-pro-6000x2, mixed). A path to a JSON file works wherever a profile name does.

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
      "pci_bus_ids": ["00000000:18:00.0", ...]  # optional, one per GPU; default: HGX slot ids
    }

Other top-level keys (a demo scenario, for example) are left to whoever reads them.

GPU model (every key required unless it comes from "base"; unknown keys are errors). Units are
NVML's: milliwatts, millijoules, MHz, Celsius, bytes.

    name, vbios_version, serial_prefix        nvmlDeviceGetName / GetVbiosVersion; serials are
                                              serial_prefix + digits derived from the UUID
    memory_total_bytes, memory_used_idle_bytes      nvmlDeviceGetMemoryInfo with no process
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
    fan_count, fan_speed_range_percent [min, max] or null, fan_auto_curve [[celsius, percent], ..]
    persistence_default, ecc_supported, ecc_default, mig_supported, mig_default
    retired_pages_supported, remapped_rows_supported, pcie_max_generation, pcie_max_width
    load_power_mw, load_temperature_c, load_utilization_gpu_percent,
    load_utilization_memory_percent, load_memory_fraction      what a GPU running a process does

Where the numbers come from
---------------------------
`h200`: tests/fixtures/nvml-h200.json (a real H200 SXM, driver 580.159.04), except what the
fixture does not show: the graphics clock list below 1920 MHz (continued in 15 MHz steps down to
345 MHz, the Hopper floor), the memory threshold (95 C, what H100/H200 SXM report), and the load
figures (an inference server at full batch: 655 W, 66 C).
`rtx-pro-6000` (NVIDIA RTX PRO 6000 Blackwell Workstation Edition): confirmed from public
material: the name string, 96 GB GDDR7 with ECC (nvidia-smi shows 97887 MiB), 600 W board power,
PCIe 5.0 x16, a double-flow-through cooler (two fans), MIG support (R575+ MIG guide), power limits
down to at least 250 W. Picked as plausible and NOT confirmed: 150 W minimum limit, graphics
clocks 180-2625 MHz in 15 MHz steps (the 2617 MHz boost rounded up to the grid), memory clocks
[14001, 810, 405] MHz (GDDR7 at 28 Gbps, as GeForce GB202 boards list), thresholds 95/92/90 C
with no memory threshold (GDDR boards report none), fan range 30-100 %, the automatic fan curve,
VBIOS and serial prefix, idle and load figures. ECC is off and persistence mode off at boot, as
workstation boards ship.

Readings are deterministic functions of the settings and injected faults: a GPU is busy when it
has processes (`set_processes`), draws `load_power_mw` capped by its power limit (SwPowerCap when
capped, clocks scaled down with it), warms in proportion to its power, runs at the locked or
maximum clocks when busy, halves its clock under hardware slowdown (temperature at or above the
slowdown threshold). `set_temperature`, `set_power_usage` and `set_clock_event_reasons` override
the derived values. Fans on automatic follow `fan_auto_curve`.

Beyond the protocol
-------------------
Fault injection and the simulated world (`inject_xid`, `inject_ecc_event`, `set_lost`,
`set_reset_required`, `set_temperature`, `set_power_usage`, `set_clock_event_reasons`,
`add_ecc_errors`, `set_remapped_rows`, `set_retired_pages_pending`, `set_pcie_link`,
`add_pcie_replays`, `set_processes`, `fail_call`, `hang_call`, `advance`, `reboot`, `reset_gpu`,
`reload`) and one extra reading, `total_energy_joules`. Injection needs neither init() nor a
writable item; a nonsensical injection (a GPU index the profile lacks, retired pages on a board
that remaps rows) is a ValueError.

State file
----------
`<state_dir>/simulated-gpus.json` holds settings, counters and injected faults (not derived
readings). It is replaced atomically and changed under an flock, reloaded by every call when its
(inode, mtime, size) changed, so several processes on one state_dir (the daemon, `gpu-agent
inject`, `gpu-agent plan`) see one machine. A corrupt file is moved aside to `.corrupt` and the
machine starts from the profile's boot defaults; a file written for another profile is ignored.

NVML details reproduced: calls before `init()` (or after the last `shutdown()`) raise
UNINITIALIZED; a lost GPU answers GPU_LOST to every call (identity included) but still counts in
`device_count()`; a GPU that needs a reset answers RESET_REQUIRED to every call but `identity()`;
ECC counters raise NOT_SUPPORTED while ECC is disabled; an unknown memory clock for
`supported_graphics_clocks_mhz` is INVALID_ARGUMENT (NVML says NOT_FOUND, which GpuErrorKind lacks).
Not reproduced: PCIe links training down at idle (the link reads at its maximum unless
`set_pcie_link` says otherwise) and per-memory-clock graphics clock lists.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.backend.base import (
    ClockDomain,
    EccCounter,
    EccErrorType,
    EnabledPending,
    GpuBackend,
    GpuEvent,
    GpuEventKind,
    GpuIdentity,
    GpuProcess,
    MemoryInfo,
    PcieLink,
    RecoveryAction,
    RemappedRows,
    TemperatureThreshold,
    Utilization,
    ViolationPolicy,
    WriteGuard,
)
from agent.backend.errors import GpuError, GpuErrorKind

PROFILES_DIR = Path(__file__).parent / "profiles"
STATE_FILE_NAME = "simulated-gpus.json"
DEFAULT_DRIVER_VERSION = "580.159.04"
#: PCI bus ids of the eight SXM slots of an HGX baseboard, in NVML index order.
HGX_PCI_BUS_IDS = (
    "00000000:18:00.0",
    "00000000:2A:00.0",
    "00000000:3A:00.0",
    "00000000:5D:00.0",
    "00000000:9A:00.0",
    "00000000:AB:00.0",
    "00000000:BA:00.0",
    "00000000:DB:00.0",
)
_STATE_VERSION = 1
#: How often wait_events looks for injections made by another process.
_POLL_SECONDS = 0.1
_UUID_NAMESPACE = uuid.UUID("6f1d8a52-3c0e-4f57-9a59-2b8f0c1e7d43")

# nvmlClocksEventReason* bits
REASON_GPU_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_SYNC_BOOST = 0x10
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80

# nvmlEventType* bits
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
_EVENT_TYPE_BITS = {
    GpuEventKind.XID: EVENT_XID,
    GpuEventKind.SINGLE_BIT_ECC: EVENT_SINGLE_BIT_ECC,
    GpuEventKind.DOUBLE_BIT_ECC: EVENT_DOUBLE_BIT_ECC,
}

#: Which clock-event reasons make each violation counter (nvmlDeviceGetViolationStatus) grow.
_VIOLATION_REASONS = {
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

#: Every callable of the GpuBackend protocol: what fail_call/hang_call may target.
PROTOCOL_METHODS = frozenset(
    name for name, value in vars(GpuBackend).items() if callable(value) and not name.startswith("_")
)
_LIBRARY_METHODS = frozenset({"init", "shutdown", "driver_version", "device_count", "wait_events"})
_THRESHOLD_KEYS = {
    "shutdown": TemperatureThreshold.SHUTDOWN,
    "slowdown": TemperatureThreshold.SLOWDOWN,
    "mem_max": TemperatureThreshold.MEM_MAX,
    "gpu_max": TemperatureThreshold.GPU_MAX,
}
_CLOCK_KEYS = {"graphics": ClockDomain.GRAPHICS, "sm": ClockDomain.SM, "memory": ClockDomain.MEMORY}


# -- profiles ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuModel:
    """One board's fixed properties and boot defaults (see the module docstring for the keys)."""

    name: str
    vbios_version: str
    serial_prefix: str
    memory_total_bytes: int
    memory_used_idle_bytes: int
    power_limit_min_mw: int
    power_limit_max_mw: int
    power_limit_default_mw: int
    power_usage_idle_mw: int
    energy_at_boot_mj: int
    temperature_idle_c: int
    temperature_thresholds_c: Mapping[TemperatureThreshold, int]
    max_clocks_mhz: Mapping[ClockDomain, int]
    idle_clocks_mhz: Mapping[ClockDomain, int]
    supported_memory_clocks_mhz: tuple[int, ...]
    supported_graphics_clocks_mhz: tuple[int, ...]
    performance_state_idle: int
    clock_event_reasons_idle: int
    supported_clock_event_reasons: int
    supported_event_types: int
    fan_count: int
    fan_speed_range_percent: tuple[int, int] | None
    fan_auto_curve: tuple[tuple[int, int], ...]
    persistence_default: bool
    ecc_supported: bool
    ecc_default: bool
    mig_supported: bool
    mig_default: bool
    retired_pages_supported: bool
    remapped_rows_supported: bool
    pcie_max_generation: int
    pcie_max_width: int
    load_power_mw: int
    load_temperature_c: int
    load_utilization_gpu_percent: int
    load_utilization_memory_percent: int
    load_memory_fraction: float


@dataclass(frozen=True)
class NodeProfile:
    name: str
    description: str
    driver_version: str
    models: tuple[GpuModel, ...]
    pci_bus_ids: tuple[str, ...]


class _Fields:
    """Typed access to one JSON object; every key must be read once, so typos are errors."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        self.data: dict[str, Any] = data
        self.where = where
        self.seen: set[str] = set()

    def _get(self, key: str) -> Any:
        self.seen.add(key)
        if key not in self.data:
            raise ValueError(f"{self.where}: missing key '{key}'")
        return self.data[key]

    def _fail(self, key: str, expected: str) -> ValueError:
        return ValueError(f"{self.where}.{key}: expected {expected}, got {self.data[key]!r}")

    def integer(self, key: str, minimum: int = 0) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._fail(key, f"an integer >= {minimum}")
        return value

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str) or not value:
            raise self._fail(key, "a non-empty string")
        return value

    def flag(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false")
        return value

    def fraction(self, key: str) -> float:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise self._fail(key, "a number in (0, 1]")
        return float(value)

    def int_list(self, key: str, length: int | None = None) -> list[int]:
        value = self._get(key)
        if (
            not isinstance(value, list)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
            or (length is not None and len(value) != length)
        ):
            size = f"{length} " if length is not None else ""
            raise self._fail(key, f"a list of {size}non-negative integers")
        return list(value)

    def optional(self, key: str, default: Any) -> Any:
        self.seen.add(key)
        return self.data.get(key, default)

    def raw(self, key: str) -> Any:
        return self._get(key)

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise ValueError(f"{self.where}: unknown key(s) {', '.join(unknown)}")


def _clock_map(fields: _Fields, key: str) -> dict[ClockDomain, int]:
    sub = _Fields(fields.raw(key), f"{fields.where}.{key}")
    result = {domain: sub.integer(name, minimum=1) for name, domain in _CLOCK_KEYS.items()}
    sub.finish()
    return result


def _graphics_clocks(fields: _Fields, key: str) -> tuple[int, ...]:
    value = fields.raw(key)
    if isinstance(value, list):
        clocks = fields.int_list(key)
    else:
        spec = _Fields(value, f"{fields.where}.{key}")
        top, bottom, step = spec.integer("max", 1), spec.integer("min", 1), spec.integer("step", 1)
        spec.finish()
        clocks = list(range(top, bottom - 1, -step))
    if not clocks:
        raise ValueError(f"{fields.where}.{key}: no clocks")
    return tuple(sorted(clocks, reverse=True))


def _parse_model(data: object, where: str) -> GpuModel:
    f = _Fields(data, where)
    power_min_mw, power_max_mw = f.int_list("power_limit_constraints_mw", 2)
    thresholds_raw = _Fields(f.raw("temperature_thresholds_c"), f"{where}.temperature_thresholds_c")
    thresholds = {
        threshold: thresholds_raw.integer(name)
        for name, threshold in _THRESHOLD_KEYS.items()
        if name in thresholds_raw.data
    }
    thresholds_raw.finish()
    fan_range_raw = f.optional("fan_speed_range_percent", None)
    fan_range = None if fan_range_raw is None else f.int_list("fan_speed_range_percent", 2)
    curve_raw = f.raw("fan_auto_curve")
    if not isinstance(curve_raw, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) for v in p) for p in curve_raw
    ):
        raise ValueError(f"{where}.fan_auto_curve: expected a list of [celsius, percent] pairs")
    model = GpuModel(
        name=f.text("name"),
        vbios_version=f.text("vbios_version"),
        serial_prefix=f.text("serial_prefix"),
        memory_total_bytes=f.integer("memory_total_bytes", 1),
        memory_used_idle_bytes=f.integer("memory_used_idle_bytes"),
        power_limit_min_mw=power_min_mw,
        power_limit_max_mw=power_max_mw,
        power_limit_default_mw=f.integer("power_limit_default_mw", 1),
        power_usage_idle_mw=f.integer("power_usage_idle_mw"),
        energy_at_boot_mj=f.integer("energy_at_boot_mj"),
        temperature_idle_c=f.integer("temperature_idle_c"),
        temperature_thresholds_c=thresholds,
        max_clocks_mhz=_clock_map(f, "max_clocks_mhz"),
        idle_clocks_mhz=_clock_map(f, "idle_clocks_mhz"),
        supported_memory_clocks_mhz=tuple(sorted(f.int_list("supported_memory_clocks_mhz"), reverse=True)),
        supported_graphics_clocks_mhz=_graphics_clocks(f, "supported_graphics_clocks_mhz"),
        performance_state_idle=f.integer("performance_state_idle"),
        clock_event_reasons_idle=f.integer("clock_event_reasons_idle"),
        supported_clock_event_reasons=f.integer("supported_clock_event_reasons"),
        supported_event_types=f.integer("supported_event_types"),
        fan_count=f.integer("fan_count"),
        fan_speed_range_percent=(fan_range[0], fan_range[1]) if fan_range else None,
        fan_auto_curve=tuple(sorted((p[0], p[1]) for p in curve_raw)),
        persistence_default=f.flag("persistence_default"),
        ecc_supported=f.flag("ecc_supported"),
        ecc_default=f.flag("ecc_default"),
        mig_supported=f.flag("mig_supported"),
        mig_default=f.flag("mig_default"),
        retired_pages_supported=f.flag("retired_pages_supported"),
        remapped_rows_supported=f.flag("remapped_rows_supported"),
        pcie_max_generation=f.integer("pcie_max_generation", 1),
        pcie_max_width=f.integer("pcie_max_width", 1),
        load_power_mw=f.integer("load_power_mw", 1),
        load_temperature_c=f.integer("load_temperature_c"),
        load_utilization_gpu_percent=f.integer("load_utilization_gpu_percent"),
        load_utilization_memory_percent=f.integer("load_utilization_memory_percent"),
        load_memory_fraction=f.fraction("load_memory_fraction"),
    )
    f.finish()
    _check_model(model, where)
    return model


def _check_model(model: GpuModel, where: str) -> None:
    if not model.power_limit_min_mw <= model.power_limit_default_mw <= model.power_limit_max_mw:
        raise ValueError(f"{where}: power_limit_default_mw outside power_limit_constraints_mw")
    if not model.supported_memory_clocks_mhz:
        raise ValueError(f"{where}: supported_memory_clocks_mhz is empty")
    if model.fan_count and (model.fan_speed_range_percent is None or not model.fan_auto_curve):
        raise ValueError(f"{where}: a board with fans needs fan_speed_range_percent and fan_auto_curve")
    if model.ecc_default and not model.ecc_supported:
        raise ValueError(f"{where}: ecc_default without ecc_supported")
    if model.mig_default and not model.mig_supported:
        raise ValueError(f"{where}: mig_default without mig_supported")


def _builtin_names(kind: str) -> list[str]:
    return sorted(p.stem for p in (PROFILES_DIR / kind).glob("*.json"))


def list_profiles() -> list[str]:
    """The built-in node profile names."""
    return _builtin_names("nodes")


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read simulated GPU profile {path}: {exc}") from exc


def _builtin_model_data(name: str, where: str) -> dict[str, Any]:
    if name not in _builtin_names("models"):
        known = ", ".join(_builtin_names("models"))
        raise ValueError(f"{where}: unknown GPU model '{name}' (built-in models: {known})")
    data = _read_json(PROFILES_DIR / "models" / f"{name}.json")
    assert isinstance(data, dict)  # built-in data files are objects
    return data


def _resolve_model(ref: object, where: str) -> GpuModel:
    if isinstance(ref, str):
        return _parse_model(_builtin_model_data(ref, where), f"model {ref}")
    if isinstance(ref, dict) and "base" in ref:
        base = ref["base"]
        if not isinstance(base, str):
            raise ValueError(f"{where}.base: expected a built-in model name")
        merged = {**_builtin_model_data(base, where), **{k: v for k, v in ref.items() if k != "base"}}
        return _parse_model(merged, where)
    return _parse_model(ref, where)


def _parse_node(data: object, default_name: str, where: str) -> NodeProfile:
    f = _Fields(data, where)
    name = f.optional("name", default_name)
    description = f.optional("description", "")
    driver = f.optional("driver_version", DEFAULT_DRIVER_VERSION)
    if not all(isinstance(v, str) for v in (name, description, driver)):
        raise ValueError(f"{where}: name, description and driver_version must be strings")
    entries = f.raw("gpus")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}.gpus: expected a non-empty list")
    models: list[GpuModel] = []
    for i, entry in enumerate(entries):
        e = _Fields(entry, f"{where}.gpus[{i}]")
        model = _resolve_model(e.raw("model"), f"{where}.gpus[{i}].model")
        count = e.integer("count", 1) if "count" in e.data else 1
        e.finish()
        models.extend([model] * count)
    bus_ids = f.optional("pci_bus_ids", None)
    if bus_ids is None:
        bus_ids = [_default_bus_id(i) for i in range(len(models))]
    if (
        not isinstance(bus_ids, list)
        or len(bus_ids) != len(models)
        or not all(isinstance(b, str) for b in bus_ids)
        or len(set(bus_ids)) != len(bus_ids)
    ):
        raise ValueError(f"{where}.pci_bus_ids: expected {len(models)} distinct strings, one per GPU")
    return NodeProfile(name, description, driver, tuple(models), tuple(bus_ids))


def _default_bus_id(index: int) -> str:
    if index < len(HGX_PCI_BUS_IDS):
        return HGX_PCI_BUS_IDS[index]
    # Past one baseboard: a second PCI domain with the same slot layout.
    domain, slot = divmod(index, len(HGX_PCI_BUS_IDS))
    return f"{domain:08X}" + HGX_PCI_BUS_IDS[slot][8:]


def load_profile(profile: str | Path) -> NodeProfile:
    """A built-in node profile by name, or a node profile file; ValueError naming the built-ins."""
    if isinstance(profile, str) and profile in list_profiles():
        return _parse_node(_read_json(PROFILES_DIR / "nodes" / f"{profile}.json"), profile, f"profile {profile}")
    path = Path(profile)
    if path.is_file():
        return _parse_node(_read_json(path), path.stem, str(path))
    raise ValueError(
        f"unknown simulated GPU profile '{profile}': not a built-in profile "
        f"({', '.join(list_profiles())}) nor an existing profile file"
    )


# -- mutable state ---------------------------------------------------------------------------


def _json_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _json_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected a boolean, got {value!r}")
    return value


def _json_opt_int(value: object) -> int | None:
    return None if value is None else _json_int(value)


def _json_range(value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"expected [min, max], got {value!r}")
    return (_json_int(value[0]), _json_int(value[1]))


def _json_calls(value: object, convert: Callable[[object], Any]) -> dict[str, Any]:
    if not isinstance(value, dict) or not set(value) <= PROTOCOL_METHODS:
        raise ValueError(f"expected a map of protocol methods, got {value!r}")
    return {k: convert(v) for k, v in value.items()}


def _json_kind(value: object) -> GpuErrorKind:
    return GpuErrorKind(value)


def _json_seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"expected seconds, got {value!r}")
    return float(value)


@dataclass
class _GpuState:
    """What one GPU remembers: settings, counters and injected faults (readings are derived)."""

    power_limit_mw: int
    locked_graphics_mhz: tuple[int, int] | None
    locked_memory_mhz: tuple[int, int] | None
    fan_manual: list[bool]
    fan_speed_percent: list[int]
    persistence: bool
    ecc_current: bool
    ecc_pending: bool
    mig_current: bool
    mig_pending: bool
    energy_mj: int
    violation_ns: dict[str, int] = field(default_factory=lambda: {p.name: 0 for p in ViolationPolicy})
    ecc_volatile_corrected: int = 0
    ecc_volatile_uncorrected: int = 0
    ecc_aggregate_corrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remapped_pending: bool = False
    remapped_failed: bool = False
    retired_pages_pending: bool = False
    pcie_replays: int = 0
    pcie_generation: int | None = None  # None: trained at the board's maximum
    pcie_width: int | None = None
    processes: list[int] = field(default_factory=list)
    temperature_override_c: int | None = None
    power_override_mw: int | None = None
    reasons_override: int | None = None
    lost: bool = False
    lost_reported: bool = False
    reset_required: bool = False
    recovery_action: int = 0  # RecoveryAction value the driver reports
    fail_calls: dict[str, GpuErrorKind] = field(default_factory=dict)
    hang_calls: dict[str, float] = field(default_factory=dict)

    @classmethod
    def boot(cls, model: GpuModel) -> _GpuState:
        return cls(
            power_limit_mw=model.power_limit_default_mw,
            locked_graphics_mhz=None,
            locked_memory_mhz=None,
            fan_manual=[False] * model.fan_count,
            fan_speed_percent=[0] * model.fan_count,
            persistence=model.persistence_default,
            ecc_current=model.ecc_default,
            ecc_pending=model.ecc_default,
            mig_current=model.mig_default,
            mig_pending=model.mig_default,
            energy_mj=model.energy_at_boot_mj,
        )

    def to_json(self) -> dict[str, Any]:
        data = dict(vars(self))
        data["fail_calls"] = {k: v.value for k, v in self.fail_calls.items()}
        return data

    @classmethod
    def from_json(cls, data: object, model: GpuModel) -> _GpuState:
        """Raises ValueError, TypeError or KeyError for anything that is not a state we wrote."""
        if not isinstance(data, dict) or set(data) != set(vars(cls.boot(model))):
            raise ValueError("GPU state keys differ")
        fans = data["fan_manual"], data["fan_speed_percent"]
        if not all(isinstance(f, list) and len(f) == model.fan_count for f in fans):
            raise ValueError("fan state does not match the model")
        violations = data["violation_ns"]
        if not isinstance(violations, dict) or set(violations) != {p.name for p in ViolationPolicy}:
            raise ValueError("violation counters differ")
        processes = data["processes"]
        if not isinstance(processes, list):
            raise ValueError("processes is not a list")
        return cls(
            power_limit_mw=_json_int(data["power_limit_mw"]),
            locked_graphics_mhz=_json_range(data["locked_graphics_mhz"]),
            locked_memory_mhz=_json_range(data["locked_memory_mhz"]),
            fan_manual=[_json_bool(v) for v in fans[0]],
            fan_speed_percent=[_json_int(v) for v in fans[1]],
            persistence=_json_bool(data["persistence"]),
            ecc_current=_json_bool(data["ecc_current"]),
            ecc_pending=_json_bool(data["ecc_pending"]),
            mig_current=_json_bool(data["mig_current"]),
            mig_pending=_json_bool(data["mig_pending"]),
            energy_mj=_json_int(data["energy_mj"]),
            violation_ns={k: _json_int(v) for k, v in violations.items()},
            ecc_volatile_corrected=_json_int(data["ecc_volatile_corrected"]),
            ecc_volatile_uncorrected=_json_int(data["ecc_volatile_uncorrected"]),
            ecc_aggregate_corrected=_json_int(data["ecc_aggregate_corrected"]),
            ecc_aggregate_uncorrected=_json_int(data["ecc_aggregate_uncorrected"]),
            remapped_correctable=_json_int(data["remapped_correctable"]),
            remapped_uncorrectable=_json_int(data["remapped_uncorrectable"]),
            remapped_pending=_json_bool(data["remapped_pending"]),
            remapped_failed=_json_bool(data["remapped_failed"]),
            retired_pages_pending=_json_bool(data["retired_pages_pending"]),
            pcie_replays=_json_int(data["pcie_replays"]),
            pcie_generation=_json_opt_int(data["pcie_generation"]),
            pcie_width=_json_opt_int(data["pcie_width"]),
            processes=[_json_int(p) for p in processes],
            temperature_override_c=_json_opt_int(data["temperature_override_c"]),
            power_override_mw=_json_opt_int(data["power_override_mw"]),
            reasons_override=_json_opt_int(data["reasons_override"]),
            lost=_json_bool(data["lost"]),
            lost_reported=_json_bool(data["lost_reported"]),
            reset_required=_json_bool(data["reset_required"]),
            recovery_action=_json_int(data["recovery_action"]),
            fail_calls=_json_calls(data["fail_calls"], _json_kind),
            hang_calls=_json_calls(data["hang_calls"], _json_seconds),
        )

    def restore_defaults(self, model: GpuModel) -> None:
        """Settings back to boot defaults, as after a GPU reset (ECC and MIG pending modes apply)."""
        self.power_limit_mw = model.power_limit_default_mw
        self.locked_graphics_mhz = None
        self.locked_memory_mhz = None
        self.fan_manual = [False] * model.fan_count
        self.fan_speed_percent = [0] * model.fan_count
        self.ecc_current = self.ecc_pending
        self.mig_current = self.mig_pending
        self.ecc_volatile_corrected = 0
        self.ecc_volatile_uncorrected = 0
        self.remapped_pending = False
        self.retired_pages_pending = False
        self.reset_required = False
        self.recovery_action = RecoveryAction.NONE


@dataclass
class _MachineState:
    gpus: list[_GpuState]
    events: list[GpuEvent] = field(default_factory=list)
    # fail/hang entries for every GPU and for library-level calls (gpu None)
    fail_calls: dict[str, GpuErrorKind] = field(default_factory=dict)
    hang_calls: dict[str, float] = field(default_factory=dict)


# -- derived readings -------------------------------------------------------------------------


class _Device:
    """One GPU's readings, computed from its model and state: plausible and deterministic."""

    def __init__(self, model: GpuModel, state: _GpuState) -> None:
        self.model = model
        self.state = state

    @property
    def busy(self) -> bool:
        return bool(self.state.processes)

    def demand_mw(self) -> int:
        return self.model.load_power_mw if self.busy else self.model.power_usage_idle_mw

    def power_mw(self) -> int:
        if self.state.power_override_mw is not None:
            return self.state.power_override_mw
        return min(self.demand_mw(), self.state.power_limit_mw)

    def power_capped(self) -> bool:
        if self.state.power_override_mw is not None:
            return self.state.power_override_mw >= self.state.power_limit_mw
        return self.demand_mw() > self.state.power_limit_mw

    def temperature_c(self) -> int:
        if self.state.temperature_override_c is not None:
            return self.state.temperature_override_c
        m = self.model
        span_mw = m.load_power_mw - m.power_usage_idle_mw
        if span_mw <= 0:
            return m.temperature_idle_c
        share = max(0.0, (self.power_mw() - m.power_usage_idle_mw) / span_mw)
        return m.temperature_idle_c + round((m.load_temperature_c - m.temperature_idle_c) * share)

    def reasons(self) -> int:
        if self.state.reasons_override is not None:
            return self.state.reasons_override
        m = self.model
        mask = 0 if self.busy else m.clock_event_reasons_idle
        if self.power_capped():
            mask |= REASON_SW_POWER_CAP
        temperature = self.temperature_c()
        gpu_max = m.temperature_thresholds_c.get(TemperatureThreshold.GPU_MAX)
        slowdown = m.temperature_thresholds_c.get(TemperatureThreshold.SLOWDOWN)
        if gpu_max is not None and temperature >= gpu_max:
            mask |= REASON_SW_THERMAL
        if slowdown is not None and temperature >= slowdown:
            mask |= REASON_HW_SLOWDOWN | REASON_HW_THERMAL
        return mask & m.supported_clock_event_reasons

    def graphics_mhz(self) -> int:
        clocks = self.model.supported_graphics_clocks_mhz
        low, high = self.state.locked_graphics_mhz or (clocks[-1], clocks[0])
        target = high if self.busy else min(max(self.model.idle_clocks_mhz[ClockDomain.GRAPHICS], low), high)
        reasons = self.reasons()
        if reasons & REASON_SW_POWER_CAP:
            # The power controller trades clock for watts roughly in proportion.
            target = int(target * min(1.0, self.state.power_limit_mw / max(self.demand_mw(), self.power_mw(), 1)))
        if reasons & (REASON_HW_SLOWDOWN | REASON_HW_THERMAL):
            target //= 2
        return next((c for c in clocks if c <= target), clocks[-1])

    def memory_mhz(self) -> int:
        idle = self.model.idle_clocks_mhz[ClockDomain.MEMORY]
        if self.state.locked_memory_mhz is not None:
            low, high = self.state.locked_memory_mhz
            return high if self.busy else min(max(idle, low), high)
        return self.model.max_clocks_mhz[ClockDomain.MEMORY] if self.busy else idle

    def process_memory_bytes(self) -> int:
        m = self.model
        budget = int(m.memory_total_bytes * m.load_memory_fraction) - m.memory_used_idle_bytes
        return max(0, budget) // len(self.state.processes)

    def fan_auto_percent(self) -> int:
        assert self.model.fan_speed_range_percent is not None  # boards with fans have one (_check_model)
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


# -- the backend -----------------------------------------------------------------------------


def _error(kind: GpuErrorKind, message: str, gpu: int | None, call: str) -> GpuError:
    return GpuError(kind, message, gpu=gpu, call=call)


class SimulatedBackend:
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
        self.state_path = self.state_dir / STATE_FILE_NAME
        self.write_guard = WriteGuard(writable_items)
        self.privileged = privileged
        self._clock = clock
        self._cond = threading.Condition(threading.RLock())
        self._init_count = 0
        self._holding_file_lock = False
        self._loaded_signature: tuple[int, int, int] | None = None
        self._state = self._boot_state()
        with self._cond:
            self._refresh()

    # -- state file -----------------------------------------------------------------------

    def _boot_state(self) -> _MachineState:
        return _MachineState(gpus=[_GpuState.boot(m) for m in self.profile.models])

    def _fingerprint(self) -> dict[str, Any]:
        return {"profile": self.profile.name, "models": [m.name for m in self.profile.models]}

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = self.state_path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _parse_state(self, data: object) -> _MachineState | None:
        """The state in a file, None when it was written for another profile; raises when corrupt."""
        if not isinstance(data, dict) or data.get("version") != _STATE_VERSION:
            raise ValueError("not a simulated GPU state file of this version")
        if data.get("machine") != self._fingerprint():
            return None
        gpus = data["gpus"]
        events = data["events"]
        if not isinstance(gpus, list) or len(gpus) != len(self.profile.models) or not isinstance(events, list):
            raise ValueError("GPU list does not match")
        return _MachineState(
            gpus=[_GpuState.from_json(g, m) for g, m in zip(gpus, self.profile.models)],
            events=[
                GpuEvent(
                    gpu=_json_int(e["gpu"]),
                    kind=GpuEventKind(e["kind"]),
                    data=_json_int(e["data"]),
                    timestamp_seconds=float(e["timestamp_seconds"]),
                )
                for e in events
            ],
            fail_calls=_json_calls(data["fail_calls"], _json_kind),
            hang_calls=_json_calls(data["hang_calls"], _json_seconds),
        )

    def _refresh(self) -> bool:
        """Re-read the state file if another process replaced it since we last read or wrote it."""
        signature = self._signature()
        if signature is None or signature == self._loaded_signature:
            return False
        try:
            parsed = self._parse_state(json.loads(self.state_path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            return False
        except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError):
            self._set_aside_corrupt(signature)
            self._state = self._boot_state()
            return True
        self._loaded_signature = signature
        self._state = parsed if parsed is not None else self._boot_state()
        return True

    def _set_aside_corrupt(self, signature: tuple[int, int, int]) -> None:
        with self._file_lock():
            # Another process may have replaced the bad file with a good one meanwhile.
            if self._signature() == signature:
                os.replace(self.state_path, self.state_path.with_name(STATE_FILE_NAME + ".corrupt"))
        self._loaded_signature = None

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """Serialise read-modify-write of the state file between processes (flock on a side file)."""
        if self._holding_file_lock:
            yield
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / (STATE_FILE_NAME + ".lock"), "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            self._holding_file_lock = True
            try:
                yield
            finally:
                self._holding_file_lock = False
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _save(self) -> None:
        payload = {
            "version": _STATE_VERSION,
            "machine": self._fingerprint(),
            "gpus": [g.to_json() for g in self._state.gpus],
            "events": [
                {"gpu": e.gpu, "kind": e.kind.value, "data": e.data, "timestamp_seconds": e.timestamp_seconds}
                for e in self._state.events
            ],
            "fail_calls": {k: v.value for k, v in self._state.fail_calls.items()},
            "hang_calls": self._state.hang_calls,
        }
        tmp = self.state_dir / f".{STATE_FILE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.state_path)
        self._loaded_signature = self._signature()

    @contextlib.contextmanager
    def _mutation(self) -> Iterator[_MachineState]:
        """Lock, pick up other processes' changes, let the caller change the state, write it, wake waiters."""
        with self._cond, self._file_lock():
            self._refresh()
            yield self._state
            self._save()
            self._cond.notify_all()

    def reload(self) -> bool:
        """Re-read the state file if another process changed it; True when it did."""
        with self._cond:
            return self._refresh()

    # -- call plumbing --------------------------------------------------------------------

    def _check_index(self, gpu: int, call: str) -> None:
        if not 0 <= gpu < len(self.profile.models):
            raise _error(
                GpuErrorKind.INVALID_ARGUMENT, f"no GPU with index {gpu} ({len(self.profile.models)} GPUs)", gpu, call
            )

    def _hang_seconds(self, gpu: int | None, call: str) -> float:
        with self._cond:
            self._refresh()
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

    def _device(self, gpu: int, call: str) -> _Device:
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
        return _Device(self.profile.models[gpu], state)

    @contextlib.contextmanager
    def _read(self, gpu: int, call: str) -> Iterator[_Device]:
        self._hang(gpu, call)
        with self._cond:
            self._refresh()
            yield self._device(gpu, call)

    @contextlib.contextmanager
    def _write(self, gpu: int, call: str) -> Iterator[_Device]:
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
            self._refresh()
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
            self._refresh()
            self._library_checks("driver_version")
            return self.profile.driver_version

    def device_count(self) -> int:
        self._hang(None, "device_count")
        with self._cond:
            self._refresh()
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
        with self._read(gpu, "memory_info") as dev:
            total = dev.model.memory_total_bytes
            used = dev.model.memory_used_idle_bytes
            if dev.busy:
                used += dev.process_memory_bytes() * len(dev.state.processes)
            return MemoryInfo(total_bytes=total, used_bytes=used, free_bytes=total - used)

    def performance_state(self, gpu: int) -> int:
        with self._read(gpu, "performance_state") as dev:
            return 0 if dev.busy else dev.model.performance_state_idle

    # -- slower readings ------------------------------------------------------------------

    def temperature_threshold_celsius(self, gpu: int, threshold: TemperatureThreshold) -> int:
        with self._read(gpu, "temperature_threshold_celsius") as dev:
            value = dev.model.temperature_thresholds_c.get(threshold)
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
            return dev.model.max_clocks_mhz[domain]

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

    def _check_fan(self, dev: _Device, gpu: int, fan: int | None, call: str) -> None:
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
            assert dev.model.fan_speed_range_percent is not None  # boards with fans have one (_check_model)
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

    # -- events ---------------------------------------------------------------------------

    def wait_events(self, timeout_seconds: float) -> list[GpuEvent]:
        self._hang(None, "wait_events")
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            while True:
                self._refresh()
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
            assert dev.model.fan_speed_range_percent is not None  # boards with fans have one (_check_model)
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

    # -- fault injection and simulated world ----------------------------------------------

    def _gpu_state(self, machine: _MachineState, gpu: int) -> _GpuState:
        if not 0 <= gpu < len(machine.gpus):
            raise ValueError(f"no GPU {gpu} in profile {self.profile.name} ({len(machine.gpus)} GPUs)")
        return machine.gpus[gpu]

    def _queue_event(self, machine: _MachineState, gpu: int, kind: GpuEventKind, data: int) -> None:
        model = self.profile.models[gpu]
        if not model.supported_event_types & _EVENT_TYPE_BITS[kind]:
            raise ValueError(f"{model.name} does not report {kind.value} events")
        machine.events.append(GpuEvent(gpu=gpu, kind=kind, data=data, timestamp_seconds=self._clock()))

    def inject_xid(self, gpu: int, xid: int) -> None:
        """Queue an Xid; wait_events delivers it as GpuEvent(kind=XID, data=xid)."""
        with self._mutation() as machine:
            self._gpu_state(machine, gpu)
            self._queue_event(machine, gpu, GpuEventKind.XID, xid)

    def inject_ecc_event(self, gpu: int, uncorrected: bool) -> None:
        """Queue a single-bit (corrected) or double-bit (uncorrected) ECC event and count the error."""
        with self._mutation() as machine:
            state = self._gpu_state(machine, gpu)
            kind = GpuEventKind.DOUBLE_BIT_ECC if uncorrected else GpuEventKind.SINGLE_BIT_ECC
            self._queue_event(machine, gpu, kind, 0)
            self._count_ecc(state, corrected=0 if uncorrected else 1, uncorrected=1 if uncorrected else 0)

    @staticmethod
    def _count_ecc(state: _GpuState, corrected: int, uncorrected: int) -> None:
        state.ecc_volatile_corrected += corrected
        state.ecc_aggregate_corrected += corrected
        state.ecc_volatile_uncorrected += uncorrected
        state.ecc_aggregate_uncorrected += uncorrected

    def add_ecc_errors(self, gpu: int, corrected: int = 0, uncorrected: int = 0) -> None:
        """Count ECC errors (volatile and aggregate) without an event."""
        if corrected < 0 or uncorrected < 0:
            raise ValueError("ECC error counts only grow")
        with self._mutation() as machine:
            self._count_ecc(self._gpu_state(machine, gpu), corrected, uncorrected)

    def set_lost(self, gpu: int, lost: bool = True) -> None:
        """The GPU falls off the bus: every call on it raises GPU_LOST, wait_events raises it once."""
        with self._mutation() as machine:
            state = self._gpu_state(machine, gpu)
            state.lost = lost
            state.lost_reported = False

    def set_reset_required(self, gpu: int, required: bool = True) -> None:
        with self._mutation() as machine:
            self._gpu_state(machine, gpu).reset_required = required

    def set_recovery_action(self, gpu: int, action: RecoveryAction) -> None:
        """What the driver reports the GPU needs (Xid 154 carries the same); a reset clears it."""
        with self._mutation() as machine:
            self._gpu_state(machine, gpu).recovery_action = int(action)

    def set_temperature(self, gpu: int, celsius: int | None) -> None:
        """Override the GPU temperature (None: back to the derived value)."""
        with self._mutation() as machine:
            self._gpu_state(machine, gpu).temperature_override_c = celsius

    def set_power_usage(self, gpu: int, watts: float | None) -> None:
        """Override the power draw (None: back to the derived value)."""
        with self._mutation() as machine:
            self._gpu_state(machine, gpu).power_override_mw = None if watts is None else round(watts * 1000)

    def set_clock_event_reasons(self, gpu: int, mask: int | None) -> None:
        """Override the active clock-event reasons (None: back to the derived mask)."""
        with self._mutation() as machine:
            state = self._gpu_state(machine, gpu)
            supported = self.profile.models[gpu].supported_clock_event_reasons
            if mask is not None and mask & ~supported:
                raise ValueError(f"clock event reasons {mask:#x} outside the supported {supported:#x}")
            state.reasons_override = mask

    def set_remapped_rows(
        self, gpu: int, correctable: int = 0, uncorrectable: int = 0, pending: bool = False, failed: bool = False
    ) -> None:
        with self._mutation() as machine:
            state = self._gpu_state(machine, gpu)
            if not self.profile.models[gpu].remapped_rows_supported:
                raise ValueError(f"{self.profile.models[gpu].name} has no row remapping")
            state.remapped_correctable = correctable
            state.remapped_uncorrectable = uncorrectable
            state.remapped_pending = pending
            state.remapped_failed = failed

    def set_retired_pages_pending(self, gpu: int, pending: bool) -> None:
        with self._mutation() as machine:
            state = self._gpu_state(machine, gpu)
            if not self.profile.models[gpu].retired_pages_supported:
                raise ValueError(f"{self.profile.models[gpu].name} has no page retirement (it remaps rows)")
            state.retired_pages_pending = pending

    def set_pcie_link(self, gpu: int, generation: int, width: int) -> None:
        """The link trained down (or back): current generation and width."""
        with self._mutation() as machine:
            state = self._gpu_state(machine, gpu)
            model = self.profile.models[gpu]
            if not 1 <= generation <= model.pcie_max_generation or width not in (1, 2, 4, 8, 16, 32):
                raise ValueError(f"PCIe gen{generation} x{width} is not a link this GPU can train to")
            if width > model.pcie_max_width:
                raise ValueError(f"PCIe width x{width} exceeds the board's x{model.pcie_max_width}")
            state.pcie_generation = generation
            state.pcie_width = width

    def add_pcie_replays(self, gpu: int, count: int) -> None:
        if count < 0:
            raise ValueError("the PCIe replay counter only grows")
        with self._mutation() as machine:
            self._gpu_state(machine, gpu).pcie_replays += count

    def set_processes(self, gpu: int, pids: list[int]) -> None:
        """The compute processes on the GPU; a GPU with processes is busy (draws load power, clocks up)."""
        with self._mutation() as machine:
            self._gpu_state(machine, gpu).processes = list(pids)

    def fail_call(self, gpu: int | None, method: str, kind: GpuErrorKind | None) -> None:
        """Make a protocol method raise GpuError(kind) on one GPU or (gpu None) on all; None clears."""
        self._check_method(gpu, method)
        with self._mutation() as machine:
            calls = machine.fail_calls if gpu is None else self._gpu_state(machine, gpu).fail_calls
            if kind is None:
                calls.pop(method, None)
            else:
                calls[method] = GpuErrorKind(kind)

    def hang_call(self, gpu: int | None, method: str, seconds: float | None) -> None:
        """Make a protocol method sleep `seconds` before answering, on one GPU or all; None clears."""
        self._check_method(gpu, method)
        if seconds is not None and seconds < 0:
            raise ValueError("a hang lasts zero seconds or more")
        with self._mutation() as machine:
            calls = machine.hang_calls if gpu is None else self._gpu_state(machine, gpu).hang_calls
            if seconds is None:
                calls.pop(method, None)
            else:
                calls[method] = float(seconds)

    @staticmethod
    def _check_method(gpu: int | None, method: str) -> None:
        if method not in PROTOCOL_METHODS:
            raise ValueError(f"'{method}' is not a GpuBackend method (one of: {', '.join(sorted(PROTOCOL_METHODS))})")
        if gpu is not None and method in _LIBRARY_METHODS:
            raise ValueError(f"{method} is a library call, not a per-GPU one: pass gpu=None")

    def advance(self, seconds: float) -> None:
        """Simulated time passes: violation counters grow for the active reasons, energy with power."""
        if seconds < 0:
            raise ValueError("time only moves forward")
        with self._mutation() as machine:
            for model, state in zip(self.profile.models, machine.gpus):
                if state.lost:
                    continue
                dev = _Device(model, state)
                reasons = dev.reasons()
                for policy, bits in _VIOLATION_REASONS.items():
                    if reasons & bits:
                        state.violation_ns[policy.name] += round(seconds * 1e9)
                state.energy_mj += round(dev.power_mw() * seconds)

    def reboot(self) -> None:
        """The machine reboots: pending modes apply, settings and counters return to boot, faults clear."""
        with self._mutation() as machine:
            fresh = self._boot_state()
            for model, old, new in zip(self.profile.models, machine.gpus, fresh.gpus):
                new.ecc_current = new.ecc_pending = old.ecc_pending
                new.mig_current = new.mig_pending = old.mig_pending
                # Memory damage survives a reboot; a pending remap is applied by it.
                new.ecc_aggregate_corrected = old.ecc_aggregate_corrected
                new.ecc_aggregate_uncorrected = old.ecc_aggregate_uncorrected
                new.remapped_correctable = old.remapped_correctable
                new.remapped_uncorrectable = old.remapped_uncorrectable
                new.remapped_failed = old.remapped_failed
                new.energy_mj = model.energy_at_boot_mj
            machine.gpus = fresh.gpus
            machine.events = []
            machine.fail_calls = {}
            machine.hang_calls = {}

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
