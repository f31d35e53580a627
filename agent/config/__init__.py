"""Configuration: pydantic v2 models (unknown keys are errors) loaded from YAML.

Every validation problem is reported as `FILE:LINE dotted.field: message`, with the line
taken from the YAML node the field came from, so an operator can jump straight to it.

Here: the whole file (`AgentConfig`), its small sections and how it is loaded. The larger sections
have modules of their own: `policy:`'s desired state (agent/config/desired.py), one entry of
`services:` (agent/config/service_entry.py), `remediation:` and `alerts:`
(agent/config/remediation.py); what they all share, the strict model and the checks of several
fields, is agent/config/fields.py.
"""

from __future__ import annotations

import grp
import os
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator

from agent import safe_yaml
from agent.config.desired import GpuProfile, NodePolicy
from agent.config.fields import UNIX_SOCKET_PATH_MAX_BYTES, StrictModel, listen_address, no_line_breaks
from agent.config.remediation import AlertsConfig, RemediationConfig
from agent.config.service_entry import ServiceConfig
from agent.config_errors import ConfigError as ConfigError
from agent.config_errors import ConfigProblem as ConfigProblem
from agent.config_errors import data_path, error_message, known_names, suggestion
from agent.defaults import DEFAULT_METRICS_PORT, DEFAULT_SOCKET_PATH
from agent.names.metric_families import FAMILY_NAMES
from agent.names.policy_items import GPU_RESET_ITEM, ITEM_NAMES, SETTABLE_GPU_ITEM_NAMES
from agent.names.policy_items import ItemName as ItemName
from agent.trust import TooLargeError, UntrustedError, read_trusted


class Mode(str, Enum):
    OBSERVE = "observe"
    ENFORCE = "enforce"


#: The GPU policy items' names (from the one list, agent.names.policy_items): what a backend that may write every GPU
#: setting is built with.
GPU_ITEMS = SETTABLE_GPU_ITEM_NAMES


class SimulatedConfig(StrictModel):
    # A built-in node profile name, or a path to a profile file. Whether it loads is the simulator's to
    # say: agent.policy.dropins.load_checked_config reports a bad one as this key's error.
    profile: str = "h200x8"
    privileged: bool = True  # False: setters fail with NO_PERMISSION, as NVML does for non-root


class MetricsConfig(StrictModel):
    listen: str = f"0.0.0.0:{DEFAULT_METRICS_PORT}"
    #: Families of /metrics switched on (true) or off (false) from their defaults (docs/metrics.md).
    families: dict[str, bool] = Field(default_factory=dict)

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        listen_address(value)
        return value

    @field_validator("families")
    @classmethod
    def _known_families(cls, value: dict[str, bool]) -> dict[str, bool]:
        return known_names(value, FAMILY_NAMES, "family", "families are listed in docs/metrics.md")


class ApiConfig(StrictModel):
    socket: str = DEFAULT_SOCKET_PATH
    group: str | None = None  # a group allowed to read the socket; root-only when unset

    @field_validator("socket")
    @classmethod
    def _socket_path(cls, value: str) -> str:
        no_line_breaks(value)
        if not value.startswith("/"):
            raise ValueError("must be an absolute path")
        if len(value.encode("utf-8", "surrogateescape")) > UNIX_SOCKET_PATH_MAX_BYTES:
            raise ValueError(f"is longer than the {UNIX_SOCKET_PATH_MAX_BYTES} bytes a Unix socket path may have")
        # The socket is bound as DIR/.XXXXXXXX/s first (agent.api), then renamed to its name.
        if len(os.path.dirname(value).encode("utf-8", "surrogateescape")) + 12 > UNIX_SOCKET_PATH_MAX_BYTES:
            limit = UNIX_SOCKET_PATH_MAX_BYTES - 12
            raise ValueError(f"its directory is longer than {limit} bytes (the socket is created in a folder there)")
        if os.path.isdir(value):
            raise ValueError(f"{value} is a directory; name the socket file, e.g. {value.rstrip('/')}/agent.sock")
        return value

    @field_validator("group")
    @classmethod
    def _known_group(cls, value: str | None) -> str | None:
        # Resolved now, as `run` resolves it when it creates the socket.
        if value is not None:
            try:
                grp.getgrnam(value)
            except KeyError:
                raise ValueError(f"unknown group {value!r}: no such group on this host") from None
        return value


class PolicyConfig(StrictModel):
    node: NodePolicy = NodePolicy()
    gpus: list[GpuProfile] = Field(default_factory=list)  # first matching profile wins
    # Then every matching override, in order, replaces the keys it sets (agent.policy.profiles):
    # agent.yaml's, then those of the drop-ins in agent.d/ beside it (`gpu-agent tune apply`).
    gpu_overrides: list[GpuProfile] = Field(default_factory=list)
    modes: dict[ItemName, Mode] = Field(default_factory=dict)  # per-item override of the top-level mode


class AgentConfig(StrictModel):
    mode: Mode = Mode.OBSERVE
    backend: Literal["nvml", "simulated"] = "nvml"
    simulated: SimulatedConfig = SimulatedConfig()
    host_root: str = "/"
    state_dir: str = "/var/lib/gpu-agent"
    # At least 0.1 s: the loop samples every GPU each time (1e-300 s would burn a core).
    interval_seconds: float = Field(default=5.0, ge=0.1, le=3600)
    # every item is re-planned (and drift put back in enforce mode) this often; the fan curve every loop
    policy_interval_seconds: float = Field(default=60.0, ge=1, le=86400)
    # The GPUs' slow tier (ECC and remapping counters, the PCIe link, NVLink, thresholds) is read
    # this often, in a loop's read; 0: every loop. These change over minutes, not seconds.
    counters_interval_seconds: float = Field(default=30.0, ge=0, le=3600)
    metrics: MetricsConfig = MetricsConfig()
    api: ApiConfig = ApiConfig()
    policy: PolicyConfig = PolicyConfig()
    services: list[ServiceConfig] = Field(default_factory=list)
    remediation: RemediationConfig = RemediationConfig()
    alerts: AlertsConfig = AlertsConfig()

    @field_validator("services")
    @classmethod
    def _unique_services(cls, services: list[ServiceConfig]) -> list[ServiceConfig]:
        names = [s.name for s in services]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate service names: {', '.join(duplicates)}")
        return services

    def item_mode(self, item: str) -> Mode:
        for name, mode in self.policy.modes.items():
            if name == item:
                return mode
        return self.mode

    def writable_items(self) -> frozenset[str]:
        """Policy items the backend and host may change: those in enforce mode; GPU resets
        (remediation) only when the agent as a whole is in enforce mode."""
        items: set[str] = {i for i in ITEM_NAMES if self.item_mode(i) is Mode.ENFORCE}
        if self.mode is Mode.ENFORCE:
            items.add(GPU_RESET_ITEM)
        return frozenset(items)

    def service_unit(self, name: str) -> str:
        """A service name from `services:` to its unit; an unknown name is taken as a unit name."""
        for service in self.services:
            if service.name == name:
                return service.unit_name
        return name if "." in name else f"{name}.service"


# -- loading with file:line errors ---------------------------------------------------------


PathKey = safe_yaml.PathKey
format_path = safe_yaml.format_path
ModelT = TypeVar("ModelT", bound=BaseModel)


def _known_keys(model: type[BaseModel], path: PathKey) -> list[str]:
    """Field names valid at the parent of `path`, for 'did you mean' hints."""
    current: Any = model
    for part in path[:-1]:
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part) if isinstance(current, type) and issubclass(current, BaseModel) else None
        if field is None:
            return []
        current = _inner_model(field.annotation)
        if current is None:
            return []
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def parse_yaml(text: str, file: str) -> tuple[Any, dict[PathKey, int]]:
    """YAML text -> (data, line of every key and item), through the bounded loader (agent.safe_yaml):
    duplicate keys, aliases, deep nesting and oversized text are ConfigErrors with file and line."""
    loaded = safe_yaml.load_text(text, file)
    return loaded.data, loaded.lines


def validate_model(model: type[ModelT], data: Any, lines: dict[PathKey, int], file: str) -> ModelT:
    try:
        return model.model_validate({} if data is None else data)
    except ValidationError as exc:
        found: list[tuple[PathKey, bool, ConfigProblem]] = []
        for error in exc.errors():
            loc = tuple(error["loc"])
            path = data_path(data, loc)
            line = next((lines[path[:n]] for n in range(len(path), -1, -1) if path[:n] in lines), None)
            message = error_message(error)
            if error["type"] == "extra_forbidden":
                key = loc[-1] if loc else None
                if isinstance(key, str) and path[-1:] != (key,):
                    # a shorthand (`- restart_servce` for `- restart_servce: {}`): the value is the key
                    message = f"unknown key '{key}'" + suggestion((*path, key), _known_keys(model, (*path, key)))
                else:
                    message += suggestion(path, _known_keys(model, path))
            from_union = any(isinstance(part, str) and "[" in part for part in loc)
            found.append((path, from_union, ConfigProblem(file, line, format_path(path), message)))
        problems: list[ConfigProblem] = []
        for path, from_union, problem in found:
            # A union reports every branch; keep the branch that got deepest into the data.
            shadowed = from_union and any(
                len(other) > len(path) and other[: len(path)] == path for other, _, _ in found
            )
            if not shadowed and problem not in problems:
                problems.append(problem)
        problems.sort(key=lambda p: p.line or 0)
        raise ConfigError(problems) from None


def read_trusted_text(path: str | Path) -> str:
    """The text of a file that steers the agent (agent.yaml, a rules file): refused (ConfigError naming
    the file) when someone other than root could change it or put another in its place. The trust
    check runs on the descriptor that is then read (agent.trust.read_trusted), never on the path."""
    file = str(path)
    try:
        raw = read_trusted(path, limit_bytes=safe_yaml.MAX_YAML_BYTES)
    except UntrustedError as exc:
        raise ConfigError([ConfigProblem(file, None, "", f"refused: {exc}")]) from None
    except TooLargeError as exc:
        raise ConfigError([ConfigProblem(file, None, "", safe_yaml.too_large(exc.size_bytes))]) from None
    except OSError as exc:
        raise ConfigError([ConfigProblem(file, None, "", f"cannot read: {exc.strerror or exc}")]) from None
    return safe_yaml.decode(raw, file)


#: A check a caller adds on one key of the file (a check the config cannot make itself, such as whether
#: a simulated profile loads): the key's path and a function raising ValueError for a bad value.
KeyCheck = tuple[PathKey, Callable[[Any], object]]


def load_config(path: str | Path, checks: Sequence[KeyCheck] = ()) -> AgentConfig:
    """The config in `path`, read through `read_trusted_text` and the bounded YAML loader; then each of
    `checks` on its key where the file sets it, a failure reported like the model's own (file:line)."""
    file = str(path)
    data, lines = parse_yaml(read_trusted_text(path), file)
    if data is not None and not isinstance(data, dict):
        raise ConfigError([ConfigProblem(file, 1, "", "must be a YAML mapping")])
    config = validate_model(AgentConfig, data, lines, file)
    check_keys(data, lines, file, checks)
    return config


def check_keys(data: Any, lines: dict[PathKey, int], file: str, checks: Sequence[KeyCheck]) -> None:
    problems: list[ConfigProblem] = []
    for path, check in checks:
        value = data
        for part in path:
            if not isinstance(value, Mapping) or part not in value:
                break
            value = value[part]
        else:
            try:
                check(value)
            except ValueError as exc:
                problems.append(ConfigProblem(file, lines.get(path), format_path(path), str(exc)))
    if problems:
        raise ConfigError(problems)


def config_from_text(text: str, file: str = "<config>") -> AgentConfig:
    data, lines = parse_yaml(text, file)
    if data is not None and not isinstance(data, dict):
        raise ConfigError([ConfigProblem(file, 1, "", "must be a YAML mapping")])
    return validate_model(AgentConfig, data, lines, file)
