"""The `policy:` section's desired state: each GPU's (the profiles `policy.gpus` matches, their
locked clocks and fan curve) and the node's (`policy.node`: driver, transparent hugepages, the
Triton cache, nouveau, the next boot). How the items read and enforce it: agent/policy/."""

from __future__ import annotations

import itertools
import re
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from agent.config.fields import StrictModel, one_of_set

EnabledState = Literal["enabled", "disabled"]
PositiveMhz = Annotated[int, Field(gt=0)]
#: A driver version as NVML and nvidia-smi print it: `580.159.04`, `535.104.05`, `580.95`.
DriverVersion = Annotated[str, Field(pattern=r"^\d+\.\d+(\.\d+)?$")]
#: A VBIOS version as NVML prints it, dotted hex: `96.00.AF.00.01`.
VbiosVersion = Annotated[str, Field(pattern=r"^[0-9A-Fa-f]{2}(\.[0-9A-Fa-f]{2}){4}$")]


class GpuMatch(StrictModel):
    model: str | None = None  # glob on the NVML name, e.g. "NVIDIA H200*"
    uuid: str | None = None
    index: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _not_empty(self) -> GpuMatch:
        return one_of_set(self, "model", "uuid", "index")


def _mhz_range(value: tuple[int, int] | None) -> tuple[int, int] | None:
    if value is not None and value[0] > value[1]:
        raise ValueError(f"min {value[0]} MHz is above max {value[1]} MHz")
    return value


class LockedClocks(StrictModel):
    gpu_mhz: tuple[PositiveMhz, PositiveMhz] | None = None
    memory_mhz: tuple[PositiveMhz, PositiveMhz] | None = None

    _check_gpu = field_validator("gpu_mhz")(_mhz_range)
    _check_memory = field_validator("memory_mhz")(_mhz_range)

    @model_validator(mode="after")
    def _not_empty(self) -> LockedClocks:
        return one_of_set(self, "gpu_mhz", "memory_mhz")


class FanCurve(StrictModel):
    """Temperature -> fan speed points; linear between points, flat outside them."""

    points: list[tuple[Annotated[int, Field(ge=0, le=120)], Annotated[int, Field(ge=0, le=100)]]] = Field(min_length=1)
    hysteresis_celsius: int = Field(default=3, ge=0, le=20)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # `fan_curve: [[30, 30], [50, 65]]` is the common spelling.
        return {"points": value} if isinstance(value, list) else value

    @field_validator("points")
    @classmethod
    def _increasing(cls, points: list[tuple[int, int]]) -> list[tuple[int, int]]:
        temps = [t for t, _ in points]
        if any(b <= a for a, b in itertools.pairwise(temps)):
            raise ValueError("temperatures must be strictly increasing")
        speeds = [s for _, s in points]
        if any(b < a for a, b in itertools.pairwise(speeds)):
            raise ValueError("fan speeds must not decrease as temperature rises")
        return points


class GpuProfile(StrictModel):
    match: GpuMatch
    power_limit_watts: float | None = Field(default=None, gt=0, le=10000)
    locked_clocks: LockedClocks | None = None
    fan_curve: FanCurve | None = None
    persistence: EnabledState | None = None
    ecc: EnabledState | None = None
    vbios_min: VbiosVersion | None = None  # report-only: older VBIOS is drift the operator updates
    # Where a drop-in's override was read ("FILE:LINE"; agent.policy.dropins sets it): not a key of
    # the file, so no YAML can claim another origin.
    _origin: str = PrivateAttr(default="")

    @property
    def origin(self) -> str:
        return self._origin

    def with_origin(self, origin: str) -> GpuProfile:
        copy = self.model_copy()
        copy._origin = origin
        return copy


class DriverPolicy(StrictModel):
    """The driver this node should run (report-only: the agent never installs or removes drivers)."""

    version: DriverVersion | None = None  # exactly this one
    min_version: DriverVersion | None = None  # this one or newer
    branch: Literal["datacenter", "desktop"] | None = None  # told from the installed package

    @model_validator(mode="after")
    def _one_version_rule(self) -> DriverPolicy:
        if self.version is not None and self.min_version is not None:
            raise ValueError("give either version or min_version, not both")
        return self


class TransparentHugepages(StrictModel):
    enabled: Literal["always", "madvise", "never"] | None = None
    defrag: Literal["always", "defer", "defer+madvise", "madvise", "never"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # `transparent_hugepages: never` sets `enabled` only.
        return {"enabled": value} if isinstance(value, str) else value


class TritonCache(StrictModel):
    path: str
    owner: str = "root"
    group: str = "root"
    mode: str = "0755"
    services: list[str] = Field(default_factory=list)  # names from `services:` or systemd unit names

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path")
        return value

    @field_validator("mode", mode="before")
    @classmethod
    def _octal(cls, value: Any) -> Any:
        if not isinstance(value, str) or not re.fullmatch(r"0?[0-7]{3,4}", value):
            raise ValueError('must be a quoted octal string such as "0755"')
        return value

    @property
    def mode_bits(self) -> int:
        return int(self.mode, 8)


class NodePolicy(StrictModel):
    transparent_hugepages: TransparentHugepages | None = None
    nouveau: Literal["blacklisted"] | None = None
    triton_cache: TritonCache | None = None
    driver: DriverPolicy | None = None
    # Whether the kernel that boots next has the NVIDIA module, a signature Secure Boot accepts and
    # an initramfs that keeps nouveau out. Unset: checked when the backend is nvml.
    next_boot: Literal["ready", "ignore"] | None = None
