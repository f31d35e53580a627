"""Configuration: pydantic v2 models (unknown keys are errors) loaded from YAML.

Every validation problem is reported as `FILE:LINE dotted.field: message`, with the line
taken from the YAML node the field came from, so an operator can jump straight to it.
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.backend.base import GPU_RESET_ITEM
from agent.config_errors import ConfigError as ConfigError
from agent.config_errors import ConfigProblem as ConfigProblem
from agent.defaults import DEFAULT_METRICS_PORT, DEFAULT_RULES_DIR, DEFAULT_SOCKET_PATH
from agent.policy.names import GPU_ITEM_NAMES, ITEM_NAMES
from agent.policy.names import ItemName as ItemName
from agent.trust import file_problem


class Mode(str, Enum):
    OBSERVE = "observe"
    ENFORCE = "enforce"


#: The GPU policy items' names (from the one list, agent.policy.names): what a backend that may write every GPU
#: setting is built with.
GPU_ITEMS = GPU_ITEM_NAMES
EnabledState = Literal["enabled", "disabled"]
PositiveMhz = Annotated[int, Field(gt=0)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimulatedConfig(StrictModel):
    profile: str = "h200x8"  # a built-in node profile name, or a path to a profile file
    privileged: bool = True  # False: setters fail with NO_PERMISSION, as NVML does for non-root

    @field_validator("profile")
    @classmethod
    def _usable_profile(cls, profile: str) -> str:
        # A bad profile is a config error now (check-config says so), not a traceback at `run`.
        from agent.backend.sim.profiles import validate_profile

        return validate_profile(profile)


class MetricsConfig(StrictModel):
    listen: str = f"0.0.0.0:{DEFAULT_METRICS_PORT}"

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        __host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be HOST:PORT with a port in 1-65535")
        return value


class ApiConfig(StrictModel):
    socket: str = DEFAULT_SOCKET_PATH
    group: str | None = None  # a group allowed to read the socket; root-only when unset


class GpuMatch(StrictModel):
    model: str | None = None  # glob on the NVML name, e.g. "NVIDIA H200*"
    uuid: str | None = None
    index: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _not_empty(self) -> GpuMatch:
        if self.model is None and self.uuid is None and self.index is None:
            raise ValueError("needs at least one of model, uuid, index")
        return self


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
        if self.gpu_mhz is None and self.memory_mhz is None:
            raise ValueError("needs gpu_mhz and/or memory_mhz")
        return self


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
    power_limit_watts: float | None = Field(default=None, gt=0)
    locked_clocks: LockedClocks | None = None
    fan_curve: FanCurve | None = None
    persistence: EnabledState | None = None
    ecc: EnabledState | None = None


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


class PolicyConfig(StrictModel):
    node: NodePolicy = NodePolicy()
    gpus: list[GpuProfile] = Field(default_factory=list)  # first matching profile wins
    modes: dict[ItemName, Mode] = Field(default_factory=dict)  # per-item override of the top-level mode


class ServiceSlo(StrictModel):
    """Latency objectives on the server's own histograms (p95 over the sliding window)."""

    e2e_p95_seconds: float | None = Field(default=None, gt=0)
    ttft_p95_seconds: float | None = Field(default=None, gt=0)
    # Fewer requests than this in the window: no verdict (a p95 of three requests is noise).
    min_requests: int = Field(default=20, ge=1)

    @model_validator(mode="after")
    def _not_empty(self) -> ServiceSlo:
        if self.e2e_p95_seconds is None and self.ttft_p95_seconds is None:
            raise ValueError("needs e2e_p95_seconds and/or ttft_p95_seconds")
        return self


class ServiceConfig(StrictModel):
    name: str = Field(min_length=1)
    unit: str | None = None  # systemd unit, e.g. sglang.service
    health_url: str | None = None
    gpus: Literal["all"] | list[Annotated[int, Field(ge=0)]] = "all"
    # How the agent starts and stops it: a systemd unit, or commands (argv lists, never a shell)
    # for services run some other way (a container runtime, a supervisor). Restart = stop + start.
    manager: Literal["systemd", "command"] = "systemd"
    start_command: list[str] | None = Field(default=None, min_length=1)
    stop_command: list[str] | None = Field(default=None, min_length=1)
    status_command: list[str] | None = Field(default=None, min_length=1)  # exit 0 = running; only for `command`
    command_timeout_seconds: float = Field(default=90.0, gt=0, le=3600)
    probe_interval_seconds: float = Field(default=5.0, gt=0, le=3600)
    probe_timeout_seconds: float = Field(default=2.0, gt=0, le=300)
    unhealthy_after_probes: int = Field(default=3, ge=1, le=100)
    # How long a (re)started service may take to answer its health URL: loading model weights
    # takes minutes on a large model.
    ready_timeout_seconds: float = Field(default=600.0, gt=0, le=7200)
    # The server's own Prometheus page; default: the health URL's origin + /metrics; false: not scraped.
    metrics_url: str | Literal[False] | None = None
    kind: Literal["sglang", "vllm", "generic"] | None = None  # None: detected from the /metrics families
    slo: ServiceSlo | None = None  # off unless set
    # health: GET health_url; generate: the server's cheapest real request (sglang /health_generate,
    # vLLM a 1-token completion), which a wedged engine behind a live HTTP server fails.
    probe: Literal["health", "generate"] = "health"

    @property
    def unit_name(self) -> str:
        return self.unit or f"{self.name}.service"

    @property
    def effective_metrics_url(self) -> str | None:
        """Where the agent reads the server's metrics; None when nowhere."""
        if self.metrics_url is False:
            return None
        if self.metrics_url is not None:
            return self.metrics_url
        origin = _origin(self.health_url)
        return None if origin is None else origin + "/metrics"

    @property
    def origin(self) -> str | None:
        """`http://host:port` of the health URL (what the generate probe talks to)."""
        return _origin(self.health_url)

    @field_validator("health_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"https?://[^/\s]+", value):
            raise ValueError("must be an http:// or https:// URL")
        return value

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url(cls, value: str | Literal[False] | None) -> str | Literal[False] | None:
        if isinstance(value, str) and not re.match(r"https?://[^/\s]+", value):
            raise ValueError("must be an http:// or https:// URL, or false")
        return value

    @field_validator("start_command", "stop_command", "status_command")
    @classmethod
    def _absolute_program(cls, argv: list[str] | None) -> list[str] | None:
        # No PATH lookup: which binary runs must not depend on the environment the agent inherited.
        if argv is not None and not argv[0].startswith("/"):
            raise ValueError(f"the program must be an absolute path, not {argv[0]!r}")
        return argv

    @model_validator(mode="after")
    def _metrics_needed(self) -> ServiceConfig:
        if self.probe == "generate" and self.health_url is None:
            raise ValueError("probe 'generate' needs health_url (the server's address)")
        if self.probe == "generate" and self.kind == "generic":
            raise ValueError("probe 'generate' needs kind sglang or vllm (or none, to detect it)")
        if self.slo is not None and self.effective_metrics_url is None:
            raise ValueError("slo needs the server's metrics: set metrics_url or health_url")
        return self

    @model_validator(mode="after")
    def _commands_match_manager(self) -> ServiceConfig:
        commands = {"start_command": self.start_command, "stop_command": self.stop_command}
        if self.manager == "command":
            missing = [name for name, argv in commands.items() if argv is None]
            if missing:
                raise ValueError(f"manager 'command' needs {' and '.join(missing)}")
        else:
            given = [name for name, argv in {**commands, "status_command": self.status_command}.items() if argv]
            if given:
                raise ValueError(f"{', '.join(given)}: only for manager 'command'")
        return self


def _origin(url: str | None) -> str | None:
    match = re.match(r"(https?://[^/\s?#]+)", url or "")
    return match.group(1) if match else None


class RemediationConfig(StrictModel):
    rules_dir: str = DEFAULT_RULES_DIR
    allow_reboot: bool = False  # a rule may only use the `reboot` action when the operator allows it
    alertmanager_url: str | None = None  # e.g. http://127.0.0.1:9093; the default for alertmanager actions
    reboot_command: list[str] = Field(default_factory=lambda: ["systemctl", "reboot"], min_length=1)


class AgentConfig(StrictModel):
    mode: Mode = Mode.OBSERVE
    backend: Literal["nvml", "simulated"] = "nvml"
    simulated: SimulatedConfig = SimulatedConfig()
    host_root: str = "/"
    state_dir: str = "/var/lib/gpu-agent"
    interval_seconds: float = Field(default=5.0, gt=0, le=3600)
    # every item is re-planned (and drift put back in enforce mode) this often; the fan curve every loop
    policy_interval_seconds: float = Field(default=60.0, gt=0, le=86400)
    metrics: MetricsConfig = MetricsConfig()
    api: ApiConfig = ApiConfig()
    policy: PolicyConfig = PolicyConfig()
    services: list[ServiceConfig] = Field(default_factory=list)
    remediation: RemediationConfig = RemediationConfig()

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


PathKey = tuple[str | int, ...]
ModelT = TypeVar("ModelT", bound=BaseModel)


def _node_lines(
    node: yaml.Node, path: PathKey, lines: dict[PathKey, int], duplicates: list[tuple[PathKey, int]]
) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child: PathKey = (*path, key)
            if key in seen:
                duplicates.append((child, key_node.start_mark.line + 1))
            seen.add(key)
            lines[child] = key_node.start_mark.line + 1
            _node_lines(value_node, child, lines, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            element: PathKey = (*path, index)
            lines[element] = item.start_mark.line + 1
            _node_lines(item, element, lines, duplicates)


def format_path(path: PathKey) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _data_path(data: Any, loc: tuple[str | int, ...]) -> PathKey:
    """Pydantic's error location minus its union/validator tags, following the actual data."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, Mapping) and isinstance(part, str) and "[" not in part:
            path.append(part)
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int):
            path.append(part)
            node = node[part] if 0 <= part < len(node) else None
    return tuple(path)


def _message(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "greater_than":
        return f"must be > {ctx['gt']:g}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']:g}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']:g}"
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown key"
    msg = str(error["msg"])
    msg = msg.removeprefix("Value error, ")
    return re.sub(r"^Input should be", "must be", msg)


def _suggest(path: PathKey, known: list[str]) -> str:
    name = path[-1] if path else ""
    close = difflib.get_close_matches(str(name), known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


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
    """YAML text -> (data, line of every key and item). Duplicate keys are errors, not last-wins."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        raise ConfigError([ConfigProblem(file, line, "", f"invalid YAML: {exc.problem or exc}")]) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (NUL, most control characters)
        line = text.count("\n", 0, exc.position) + 1
        character = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        raise ConfigError([ConfigProblem(file, line, "", f"invalid YAML: character {character} not allowed")]) from None
    lines: dict[PathKey, int] = {}
    duplicates: list[tuple[PathKey, int]] = []
    if root is not None:
        _node_lines(root, (), lines, duplicates)
    if duplicates:
        raise ConfigError([ConfigProblem(file, line, format_path(p), "duplicate key") for p, line in duplicates])
    return data, lines


def validate_model(model: type[ModelT], data: Any, lines: dict[PathKey, int], file: str) -> ModelT:
    try:
        return model.model_validate({} if data is None else data)
    except ValidationError as exc:
        found: list[tuple[PathKey, bool, ConfigProblem]] = []
        for error in exc.errors():
            loc = tuple(error["loc"])
            path = _data_path(data, loc)
            line = next((lines[path[:n]] for n in range(len(path), -1, -1) if path[:n] in lines), None)
            message = _message(error)
            if error["type"] == "extra_forbidden":
                message += _suggest(path, _known_keys(model, path))
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


def read_config_text(path: str | Path) -> str:
    """A config file's text; ConfigError naming the file (and the line of a byte that is not UTF-8)."""
    file = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([ConfigProblem(file, None, "", f"cannot read: {exc.strerror or exc}")]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        message = f"not UTF-8 text: byte {raw[exc.start]:#04x} at offset {exc.start}"
        raise ConfigError([ConfigProblem(file, line, "", message)]) from None


def load_config(path: str | Path) -> AgentConfig:
    """The config in `path`; refused (ConfigError naming the file) when someone other than root could
    change it, since it decides what the agent does as root (see agent.trust)."""
    file = str(path)
    text = read_config_text(path)
    untrusted = file_problem(path)
    if untrusted is not None:
        raise ConfigError([ConfigProblem(file, None, "", f"refused: {untrusted}")])
    data, lines = parse_yaml(text, file)
    if data is not None and not isinstance(data, dict):
        raise ConfigError([ConfigProblem(file, 1, "", "must be a YAML mapping")])
    return validate_model(AgentConfig, data, lines, file)


def config_from_text(text: str, file: str = "<config>") -> AgentConfig:
    data, lines = parse_yaml(text, file)
    if data is not None and not isinstance(data, dict):
        raise ConfigError([ConfigProblem(file, 1, "", "must be a YAML mapping")])
    return validate_model(AgentConfig, data, lines, file)
