"""Simulated GPU profiles: a GPU model (one board) and a node profile (the boards of one machine).

Both are pydantic models validated from JSON; an invalid file is a `ProfileError` (a ValueError)
naming the file and the field. A profile file is a path the config names, so it is read bounded:
at most `MAX_PROFILE_BYTES`, refused unparsed when nested deeper than `MAX_PROFILE_DEPTH` (a
file of brackets must be an error, not a RecursionError or a MemoryError). Built-in models live in
`agent/backend/profiles/models/NAME.json`, built-in node profiles in
`agent/backend/profiles/nodes/NAME.json`. Units are NVML's:
milliwatts, millijoules, MHz, Celsius, bytes.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from agent.backend.base import ClockDomain, TemperatureThreshold
from agent.host import safe_json
from agent.trust import read_at_most

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
DEFAULT_DRIVER_VERSION = "580.159.04"
DEFAULT_CUDA_DRIVER_VERSION = 13000  # what 580.159.04 answers to nvmlSystemGetCudaDriverVersion
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

#: The limits of agent.safe_yaml, for the same reason: built-in profiles are a few KB, 7 levels deep.
MAX_PROFILE_BYTES = 1024 * 1024
MAX_PROFILE_DEPTH = 64

Count = Annotated[StrictInt, Field(ge=0)]
Positive = Annotated[StrictInt, Field(ge=1)]
Text = Annotated[StrictStr, Field(min_length=1)]
Ratio = Annotated[StrictFloat, Field(ge=0, le=1)]


class ProfileError(ValueError):
    """A simulated GPU profile that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ClockSet(_Strict):
    """MHz per clock domain (nvmlDeviceGetMaxClockInfo and friends)."""

    graphics: Positive
    sm: Positive
    memory: Positive

    def mhz(self, domain: ClockDomain) -> int:
        values = {ClockDomain.GRAPHICS: self.graphics, ClockDomain.SM: self.sm, ClockDomain.MEMORY: self.memory}
        return values[ClockDomain(domain)]


class Thresholds(_Strict):
    """nvmlDeviceGetTemperatureThreshold; a threshold the board lacks is absent (NOT_SUPPORTED)."""

    shutdown: Count | None = None
    slowdown: Count | None = None
    mem_max: Count | None = None
    gpu_max: Count | None = None

    def celsius(self, threshold: TemperatureThreshold) -> int | None:
        values = {
            TemperatureThreshold.SHUTDOWN: self.shutdown,
            TemperatureThreshold.SLOWDOWN: self.slowdown,
            TemperatureThreshold.MEM_MAX: self.mem_max,
            TemperatureThreshold.GPU_MAX: self.gpu_max,
        }
        return values[TemperatureThreshold(threshold)]


class ClockRange(_Strict):
    max: Positive
    min: Positive
    step: Positive


def _graphics_clock_list(value: object) -> object:
    """`{"max", "min", "step"}` expands to the list NVML would give; lists are sorted highest first."""
    if isinstance(value, Mapping):
        try:
            spec = ClockRange.model_validate(value)
        except ValidationError:
            raise ValueError('expected a list of MHz or {"max", "min", "step"} in positive MHz') from None
        return list(range(spec.max, spec.min - 1, -spec.step))
    return value


def _highest_first(value: object) -> object:
    return sorted(value, reverse=True) if isinstance(value, list) and all(isinstance(v, int) for v in value) else value


ClockList = Annotated[tuple[Positive, ...], BeforeValidator(_highest_first), Field(min_length=1)]


class GpmLoad(_Strict):
    """What GPM (nvmlGpmMetricsGet) reports for one board at idle or under a serving load.

    Ratios are 0..1 (NVML reports percent); bandwidths are bytes per second (NVML reports MiB/s).
    """

    sm_active_ratio: Ratio
    sm_occupancy_ratio: Ratio
    tensor_active_ratio: Ratio
    dram_active_ratio: Ratio
    graphics_active_ratio: Ratio = 0
    pcie_tx_bytes_per_second: Count
    pcie_rx_bytes_per_second: Count
    nvlink_tx_bytes_per_second: Count = 0
    nvlink_rx_bytes_per_second: Count = 0


class Gpm(_Strict):
    """GPM support of a board (nvmlGpmQueryDeviceSupport): its readings idle and loaded."""

    idle: GpmLoad
    load: GpmLoad


class GpuModel(_Strict):
    """One board's fixed properties and boot defaults (keys documented in agent.backend.sim)."""

    name: Text
    vbios_version: Text
    serial_prefix: Text
    memory_total_bytes: Positive
    memory_used_idle_bytes: Count  # the driver's reserved memory: v1 "used" with no process, v2 "reserved"
    power_limit_constraints_mw: tuple[Count, Count]
    power_limit_default_mw: Positive
    power_usage_idle_mw: Count
    energy_at_boot_mj: Count
    temperature_idle_c: Count
    temperature_thresholds_c: Thresholds
    max_clocks_mhz: ClockSet
    idle_clocks_mhz: ClockSet
    supported_memory_clocks_mhz: ClockList
    supported_graphics_clocks_mhz: Annotated[ClockList, BeforeValidator(_graphics_clock_list)]
    performance_state_idle: Count
    clock_event_reasons_idle: Count
    supported_clock_event_reasons: Count
    supported_event_types: Count
    fan_count: Count
    fan_speed_range_percent: tuple[Count, Count] | None = None
    fan_auto_curve: tuple[tuple[StrictInt, StrictInt], ...]
    persistence_default: StrictBool
    ecc_supported: StrictBool
    ecc_default: StrictBool
    mig_supported: StrictBool
    mig_default: StrictBool
    retired_pages_supported: StrictBool
    remapped_rows_supported: StrictBool
    pcie_max_generation: Positive
    pcie_max_width: Positive
    load_power_mw: Positive
    load_temperature_c: Count
    load_utilization_gpu_percent: Count
    load_utilization_memory_percent: Count
    load_memory_fraction: Annotated[StrictFloat, Field(gt=0, le=1)]
    # Profiling-grade telemetry; absent keys describe a board without the feature.
    memory_temperature_idle_c: Count | None = None  # HBM temperature field; None: NOT_SUPPORTED (GDDR)
    memory_temperature_load_c: Count | None = None
    gpm: Gpm | None = None  # None: nvmlGpmQueryDeviceSupport says unsupported
    nvlink_links: Count = 0  # NVLink links of the board; used only where the node connects them
    # The power curve (agent.backend.sim.physics.busy_power_mw): the busy floor that does not follow
    # the core clock (default: the idle draw) and the core voltage at the lowest clock as a share of
    # its top value (default 0.55).
    load_static_power_mw: Count | None = None
    voltage_offset_ratio: Annotated[StrictFloat, Field(ge=0, le=1)] | None = None

    @field_validator("fan_auto_curve")
    @classmethod
    def _sorted_curve(cls, curve: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(curve))

    @model_validator(mode="after")
    def _consistent(self) -> GpuModel:
        low, high = self.power_limit_constraints_mw
        if not low <= self.power_limit_default_mw <= high:
            raise ValueError("power_limit_default_mw outside power_limit_constraints_mw")
        if self.fan_count and (self.fan_speed_range_percent is None or not self.fan_auto_curve):
            raise ValueError("a board with fans needs fan_speed_range_percent and fan_auto_curve")
        if self.ecc_default and not self.ecc_supported:
            raise ValueError("ecc_default without ecc_supported")
        if self.mig_default and not self.mig_supported:
            raise ValueError("mig_default without mig_supported")
        if self.load_static_power_mw is not None and self.load_static_power_mw >= self.load_power_mw:
            raise ValueError("load_static_power_mw must be below load_power_mw")
        if (self.memory_temperature_idle_c is None) != (self.memory_temperature_load_c is None):
            raise ValueError("memory_temperature_idle_c and memory_temperature_load_c go together")
        return self

    @property
    def power_limit_min_mw(self) -> int:
        return self.power_limit_constraints_mw[0]

    @property
    def power_limit_max_mw(self) -> int:
        return self.power_limit_constraints_mw[1]


class _GpuEntry(_Strict):
    model: StrictStr | dict[str, Any]
    count: Positive = 1


class _NodeFile(BaseModel):
    """A node profile file; keys other than these (a demo scenario) belong to whoever reads them."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: StrictStr | None = None
    description: StrictStr = ""
    driver_version: StrictStr = DEFAULT_DRIVER_VERSION
    cuda_driver_version: StrictInt = DEFAULT_CUDA_DRIVER_VERSION
    gpus: list[_GpuEntry] = Field(min_length=1)
    pci_bus_ids: list[StrictStr] | None = None
    nvlink_connected: StrictBool | None = None
    nvswitch_fabric: StrictBool = False


class NodeProfile(_Strict):
    """The GPUs of one machine, in NVML index order."""

    name: str
    description: str
    driver_version: str
    cuda_driver_version: int  # NVML's integer form: 13000 is CUDA 13.0
    models: tuple[GpuModel, ...]
    pci_bus_ids: tuple[str, ...]
    #: NVLink wired between the GPUs (HGX baseboard). A GPU alone in its node (a single-GPU VM, as
    #: the recorded H200) answers NOT_SUPPORTED to NVLink queries even though the board has links.
    nvlink_connected: bool
    #: NVSwitch fabric (HGX baseboard): each GPU registers with the fabric manager before it can run
    #: CUDA (nvmlDeviceGetGpuFabricInfo); elsewhere that query has nothing to say (NOT_SUPPORTED).
    nvswitch_fabric: bool

    def nvlink_links(self, gpu: int) -> int:
        """The NVLink links GPU `gpu` has in this node (0: NVLink queries are NOT_SUPPORTED)."""
        return self.models[gpu].nvlink_links if self.nvlink_connected else 0


# -- loading ---------------------------------------------------------------------------------


_KEY_PROBLEMS = {"missing": "missing key", "extra_forbidden": "unknown key"}


def _field_path(prefix: str, loc: tuple[str | int, ...]) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part != "str":  # pydantic's union and validator tags are not fields
            out += f".{part}" if out else part
    return out


def _invalid(where: str, exc: ValidationError, prefix: str = "") -> ProfileError:
    problems: dict[str, list[str]] = {}  # "path: problem" -> keys, in the order pydantic found them
    for error in exc.errors():
        loc = tuple(error["loc"])
        if error["type"] in _KEY_PROBLEMS and loc:
            # Name the object that lacks (or should not have) the keys, then the keys.
            path, text, key = _field_path(prefix, loc[:-1]), _KEY_PROBLEMS[error["type"]], f"'{loc[-1]}'"
        else:
            path, text, key = _field_path(prefix, loc), str(error["msg"]).removeprefix("Value error, "), ""
        keys = problems.setdefault(f"{path}: {text}" if path else text, [])
        if key:
            keys.append(key)
    return ProfileError(f"{where}: " + "; ".join(f"{p} {', '.join(k)}" if k else p for p, k in problems.items()))


def _builtin_names(kind: str) -> list[str]:
    return sorted(p.stem for p in (PROFILES_DIR / kind).glob("*.json"))


def list_profiles() -> list[str]:
    """The built-in node profile names."""
    return _builtin_names("nodes")


def _read_bounded(path: Path) -> bytes:
    # O_NONBLOCK: a FIFO in the file's place must not hang the read; it is refused below.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > MAX_PROFILE_BYTES:
            raise ProfileError(
                f"cannot read simulated GPU profile {path}: file is {info.st_size} bytes, "
                f"more than the {MAX_PROFILE_BYTES} bytes gpu-agent reads"
            )
        data = read_at_most(fd, MAX_PROFILE_BYTES)
        if len(data) > MAX_PROFILE_BYTES:  # grew after the fstat
            raise ProfileError(f"cannot read simulated GPU profile {path}: grew past {MAX_PROFILE_BYTES} bytes")
        return data
    finally:
        os.close(fd)


def _read_json(path: Path) -> object:
    try:
        text = _read_bounded(path).decode("utf-8")
        if safe_json.too_deep(text, MAX_PROFILE_DEPTH):
            raise ProfileError(
                f"cannot read simulated GPU profile {path}: nested more than {MAX_PROFILE_DEPTH} levels deep"
            )
        return json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read simulated GPU profile {path}: {exc}") from exc


@functools.cache
def _builtin_model_data(name: str) -> dict[str, Any]:
    data = _read_json(PROFILES_DIR / "models" / f"{name}.json")
    assert isinstance(data, dict)  # built-in data files are objects
    return data


@functools.cache
def _builtin_model(name: str) -> GpuModel:
    return GpuModel.model_validate(_builtin_model_data(name))


def _model_base(name: str, where: str) -> None:
    if name not in _builtin_names("models"):
        known = ", ".join(_builtin_names("models"))
        raise ProfileError(f"{where}: unknown GPU model '{name}' (built-in models: {known})")


def _resolve_model(ref: str | dict[str, Any], file: str, field: str) -> GpuModel:
    """A built-in model by name, a built-in base with overrides (`{"base": NAME, ...}`), or a full model."""
    if isinstance(ref, str):
        _model_base(ref, f"{file}: {field}")
        return _builtin_model(ref)
    data = dict(ref)
    if "base" in data:
        base = data.pop("base")
        if not isinstance(base, str):
            raise ProfileError(f"{file}: {field}.base: expected a built-in model name")
        _model_base(base, f"{file}: {field}")
        data = {**_builtin_model_data(base), **data}
    try:
        return GpuModel.model_validate(data)
    except ValidationError as exc:
        raise _invalid(file, exc, field) from None


def _default_bus_id(index: int) -> str:
    if index < len(HGX_PCI_BUS_IDS):
        return HGX_PCI_BUS_IDS[index]
    # Past one baseboard: a second PCI domain with the same slot layout.
    domain, slot = divmod(index, len(HGX_PCI_BUS_IDS))
    return f"{domain:08X}" + HGX_PCI_BUS_IDS[slot][8:]


def _parse_node(data: object, default_name: str, file: str) -> NodeProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{file}: expected a JSON object, got {type(data).__name__}")
    try:
        node = _NodeFile.model_validate(data)
    except ValidationError as exc:
        if any(e["loc"] == ("gpus",) and e["type"] == "too_short" for e in exc.errors()):
            raise ProfileError(f"{file}: gpus: expected a non-empty list") from None
        raise _invalid(file, exc) from None
    models: list[GpuModel] = []
    for i, entry in enumerate(node.gpus):
        models.extend([_resolve_model(entry.model, file, f"gpus[{i}].model")] * entry.count)
    bus_ids = node.pci_bus_ids if node.pci_bus_ids is not None else [_default_bus_id(i) for i in range(len(models))]
    if len(bus_ids) != len(models) or len(set(bus_ids)) != len(bus_ids):
        raise ProfileError(f"{file}: pci_bus_ids: expected {len(models)} distinct strings, one per GPU")
    linked = sum(1 for m in models if m.nvlink_links)
    nvlink_connected = node.nvlink_connected if node.nvlink_connected is not None else linked >= 2
    if node.nvswitch_fabric and not (nvlink_connected and linked == len(models)):
        raise ProfileError(f"{file}: nvswitch_fabric: needs every GPU on NVLink (nvlink_connected, nvlink_links)")
    return NodeProfile(
        name=node.name if node.name is not None else default_name,
        description=node.description,
        driver_version=node.driver_version,
        cuda_driver_version=node.cuda_driver_version,
        models=tuple(models),
        pci_bus_ids=tuple(bus_ids),
        nvlink_connected=nvlink_connected,
        nvswitch_fabric=node.nvswitch_fabric,
    )


@functools.cache
def _builtin_profile(name: str) -> NodeProfile:
    return _parse_node(_read_json(PROFILES_DIR / "nodes" / f"{name}.json"), name, f"profile {name}")


def load_profile(profile: str | Path) -> NodeProfile:
    """A built-in node profile by name, or a node profile file; ProfileError naming the built-ins,
    or the file and field that is wrong."""
    if isinstance(profile, str) and profile in list_profiles():
        return _builtin_profile(profile)
    path = Path(profile)
    if path.is_file():
        return _parse_node(_read_json(path), path.stem, str(path))
    raise ProfileError(
        f"unknown simulated GPU profile '{profile}': not a built-in profile "
        f"({', '.join(list_profiles())}) nor an existing profile file"
    )


def validate_profile(profile: str) -> str:
    """`profile` unchanged when it names a usable profile (built-in or file); ProfileError otherwise.

    For the config's `simulated.profile` (agent.policy.dropins.load_checked_config), so a bad profile is a
    config error at load time.
    """
    load_profile(profile)
    return profile
