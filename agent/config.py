"""Configuration: pydantic v2 models (unknown keys are errors) loaded from YAML.

Every validation problem is reported as `FILE:LINE dotted.field: message`, with the line
taken from the YAML node the field came from, so an operator can jump straight to it.
"""

from __future__ import annotations

import grp
import itertools
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from agent import safe_yaml
from agent.config_errors import ConfigError as ConfigError
from agent.config_errors import ConfigProblem as ConfigProblem
from agent.config_errors import data_path, error_message, known_names, suggestion
from agent.defaults import DEFAULT_METRICS_PORT, DEFAULT_RULES_DIR, DEFAULT_RULES_DIRS, DEFAULT_SOCKET_PATH
from agent.names.alerts import ALERT_NAMES, DEFAULT_RUNBOOK_URL
from agent.names.alerts import DEFAULT_JOB as DEFAULT_ALERT_JOB
from agent.names.alerts import RESERVED_LABELS as RESERVED_ALERT_LABELS
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
EnabledState = Literal["enabled", "disabled"]
PositiveMhz = Annotated[int, Field(gt=0)]
#: A driver version as NVML and nvidia-smi print it: `580.159.04`, `535.104.05`, `580.95`.
DriverVersion = Annotated[str, Field(pattern=r"^\d+\.\d+(\.\d+)?$")]
#: A CUDA version an image was built for: `12.4`, `13.0`.
CudaVersion = Annotated[str, Field(pattern=r"^\d+\.\d+$")]
#: A VBIOS version as NVML prints it, dotted hex: `96.00.AF.00.01`.
VbiosVersion = Annotated[str, Field(pattern=r"^[0-9A-Fa-f]{2}(\.[0-9A-Fa-f]{2}){4}$")]


class StrictModel(BaseModel):
    # allow_inf_nan=False: `.inf` as a power limit or `.nan` as an interval is a typo, never a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# -- checks shared by several fields: what `run` needs, checked by check-config too ----------------

UNIX_SOCKET_PATH_MAX_BYTES = 107  # sun_path is 108 bytes with the terminating NUL


def no_line_breaks(value: str) -> str:
    """CR, LF and NUL end a header line or an argv string early, or smuggle a second one in."""
    for character, name in (("\r", "CR"), ("\n", "LF"), ("\x00", "NUL")):
        if character in value:
            raise ValueError(f"must not contain {name} ({value!r})")
    return value


def http_url(value: str) -> str:
    """An http:// or https:// URL with a host: no file://, no bare host:port, no control characters."""
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError(f"must be an http:// or https:// URL without spaces or control characters ({value!r})")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  # raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        raise ValueError(f"must be an http:// or https:// URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL, not {value!r}")
    return value


def absolute_argv(argv: list[str]) -> list[str]:
    """argv as run without a shell: an absolute program (no PATH lookup: which binary runs must not
    depend on the environment the agent inherited) and no line breaks or NUL in any string."""
    if not argv[0].startswith("/"):
        raise ValueError(f"the program must be an absolute path, not {argv[0]!r}")
    for arg in argv:
        no_line_breaks(arg)
    return argv


def listen_address(value: str) -> tuple[int, str]:
    """HOST:PORT or [IPV6]:PORT -> (address family, host) as the metrics server binds it; ValueError
    when the host is malformed, unknown, or not an address of this machine."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        raise ValueError("must be HOST:PORT with a port in 1-65535")
    if not host.isascii() or any(c.isspace() or not c.isprintable() for c in host):
        raise ValueError(f"HOST must be an IP address or a host name, not {host!r}")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"an IPv6 address goes in brackets, as [::1]:{port}")
    bare = host.removeprefix("[").removesuffix("]") or "0.0.0.0"  # noqa: S104  # nosec B104  # as metrics does
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    # Bind port 0 of that address: refused here when `run` could not listen there (not an address of
    # this host, a name that does not resolve), without taking the port a running agent holds.
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((bare, 0))
    except (OSError, UnicodeError, TypeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"cannot listen on {bare}: {reason}") from None
    return family, bare


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


class PolicyConfig(StrictModel):
    node: NodePolicy = NodePolicy()
    gpus: list[GpuProfile] = Field(default_factory=list)  # first matching profile wins
    # Then every matching override, in order, replaces the keys it sets (agent.policy.profiles):
    # agent.yaml's, then those of the drop-ins in agent.d/ beside it (`gpu-agent tune apply`).
    gpu_overrides: list[GpuProfile] = Field(default_factory=list)
    modes: dict[ItemName, Mode] = Field(default_factory=dict)  # per-item override of the top-level mode


class ServiceSlo(StrictModel):
    """Latency objectives on the server's own histograms (p95 over the sliding window)."""

    e2e_p95_seconds: float | None = Field(default=None, gt=0)
    ttft_p95_seconds: float | None = Field(default=None, gt=0)
    # Fewer requests than this in the window: no verdict (a p95 of three requests is noise).
    min_requests: int = Field(default=20, ge=1)
    # The window the p95 is over (None: the agent's 5 minutes); a breach ends when the slow requests
    # are fewer than 5 % of it.
    window_seconds: float | None = Field(default=None, ge=10, le=3600)

    @model_validator(mode="after")
    def _not_empty(self) -> ServiceSlo:
        if self.e2e_p95_seconds is None and self.ttft_p95_seconds is None:
            raise ValueError("needs e2e_p95_seconds and/or ttft_p95_seconds")
        return self


class ServiceDrain(StrictModel):
    """Before the agent stops the service (a restart, a GPU reset): run `hook` (e.g. take the node
    out of the load balancer), then wait until the server's own running-requests gauge reads 0;
    both within `timeout_seconds`, after which the stop goes ahead regardless."""

    hook: list[str] = Field(min_length=1)  # argv, never a shell; the event as JSON on stdin
    timeout_seconds: float = Field(default=60.0, gt=0, le=3600)

    @field_validator("hook")
    @classmethod
    def _absolute_program(cls, argv: list[str]) -> list[str]:
        return absolute_argv(argv)


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
    # Lower bounds: a probe every 1e-300 s burns a core; tests and fast local services use 0.05 s.
    command_timeout_seconds: float = Field(default=90.0, ge=0.01, le=3600)
    probe_interval_seconds: float = Field(default=5.0, ge=0.01, le=3600)
    # How often the server's /metrics is read, apart from the loop: the latency window spans five
    # minutes, and a page of ~50 KB every second is most of what the daemon spends on a service
    # (vLLM renders it on its API server's event loop, too).
    scrape_interval_seconds: float = Field(default=5.0, ge=0.01, le=3600)
    probe_timeout_seconds: float = Field(default=2.0, ge=0.01, le=300)
    unhealthy_after_probes: int = Field(default=3, ge=1, le=100)
    # How long a (re)started service may take to answer its health URL: loading model weights
    # takes minutes on a large model.
    ready_timeout_seconds: float = Field(default=600.0, ge=0.01, le=7200)
    # The CUDA version the service's image was built for: a driver that supports less is drift of
    # the `driver` item (and an alert) before the service crashes on start.
    cuda_version: CudaVersion | None = None
    # The server's own Prometheus page; default: the health URL's origin + /metrics; false: not scraped.
    metrics_url: str | Literal[False] | None = None
    kind: Literal["sglang", "vllm", "generic"] | None = None  # None: detected from the /metrics families
    slo: ServiceSlo | None = None  # off unless set
    # health: GET health_url; generate: the server's cheapest real request (sglang /health_generate,
    # vLLM a 1-token completion), which a wedged engine behind a live HTTP server fails.
    probe: Literal["health", "generate"] = "health"
    drain: ServiceDrain | None = None  # off unless set: a restart stops the service at once

    @property
    def unit_name(self) -> str:
        return self.unit or f"{self.name}.service"

    @property
    def shown_unit(self) -> str:
        """The unit status, metrics and events name: a command-managed service has none (unless given)."""
        return self.unit_name if self.manager == "systemd" else self.unit or ""

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
        return None if value is None else http_url(value)

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url(cls, value: str | Literal[False] | None) -> str | Literal[False] | None:
        if isinstance(value, str) and not re.match(r"https?://[^/\s]+", value):
            raise ValueError("must be an http:// or https:// URL, or false")
        return value

    @field_validator("start_command", "stop_command", "status_command")
    @classmethod
    def _absolute_program(cls, argv: list[str] | None) -> list[str] | None:
        return None if argv is None else absolute_argv(argv)

    @model_validator(mode="after")
    def _metrics_needed(self) -> ServiceConfig:
        if self.probe == "generate" and self.health_url is None:
            raise ValueError("probe 'generate' needs health_url (the server's address)")
        if self.probe == "generate" and self.kind == "generic":
            raise ValueError("probe 'generate' needs kind sglang or vllm (or none, to detect it)")
        if self.slo is not None and self.effective_metrics_url is None:
            raise ValueError("slo needs the server's metrics: set metrics_url or health_url")
        if self.drain is not None and (self.effective_metrics_url is None or self.kind == "generic"):
            raise ValueError(
                "drain waits on the server's running-requests gauge: it needs metrics_url or health_url,"
                " and kind sglang or vllm (or none, to detect it)"
            )
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


class AlertsConfig(StrictModel):
    """The agent's alert pushes, labelled as Prometheus labels this target: the rules' alerts (docs/alerts.md)."""

    instance: str | None = None  # None: "<host name>:<metrics.listen port>"
    job: str = DEFAULT_ALERT_JOB
    #: The target's other labels (cluster, rack, ...) and Prometheus' external labels.
    labels: dict[str, str] = Field(default_factory=dict)
    #: Where docs/alerts.md is read: each alert's `runbook_url` is this with the alert's section.
    runbook_url: str = DEFAULT_RUNBOOK_URL
    #: Seconds an alert's condition holds before it is pushed, by name; else the catalogue's `for`, as the rules'.
    for_seconds: dict[str, Annotated[float, Field(ge=0, le=86400)]] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name) or name.startswith("__"):
                raise ValueError(f"{name!r} is not a Prometheus label name")
            if name in RESERVED_ALERT_LABELS:
                raise ValueError(f"{name!r} is set by the agent (alerts.instance, alerts.job, the catalogue)")
        return {name: no_line_breaks(text) for name, text in value.items()}

    _one_line = field_validator("instance", "job", "runbook_url")(
        lambda value: None if value is None else no_line_breaks(value)
    )
    _known_alerts = field_validator("for_seconds")(
        lambda value: known_names(value, ALERT_NAMES, "alert", "alerts are listed in docs/alerts.md")
    )


class RemediationConfig(StrictModel):
    # Lowest priority first; a same-named file in a later one replaces or masks (agent/rules/sources.py).
    # [] turns remediation off on purpose; a daemon that finds no rules in the dirs given needs attention.
    rules_dirs: list[str] = Field(default_factory=lambda: list(DEFAULT_RULES_DIRS))
    allow_reboot: bool = False  # a rule may only use the `reboot` action when the operator allows it
    # e.g. http://127.0.0.1:9093, or a list (an HA pair): where the agent pushes its alerts
    alertmanager_url: str | list[str] | None = None
    reboot_command: list[str] = Field(default_factory=lambda: ["/usr/bin/systemctl", "reboot"], min_length=1)

    _http_urls = field_validator("alertmanager_url")(
        lambda value: (
            [http_url(u) for u in value] if isinstance(value, list) else None if value is None else http_url(value)
        )
    )

    @property
    def alertmanager_urls(self) -> tuple[str, ...]:
        """Every Alertmanager the agent pushes to (none: no pushes)."""
        given = self.alertmanager_url
        return tuple(dict.fromkeys([given] if isinstance(given, str) else given or []))

    @field_validator("reboot_command")
    @classmethod
    def _absolute_program(cls, argv: list[str]) -> list[str]:
        return absolute_argv(argv)

    @model_validator(mode="before")
    @classmethod
    def _rules_dir_alias(cls, data: Any) -> Any:
        """`rules_dir: X`, the name before rules_dirs, is `rules_dirs: [X]`. Its old default, which
        agent.yaml files from earlier packages still spell out, means the default list: the shipped
        rules moved to /usr/share and must not vanish on upgrade."""
        if not isinstance(data, dict) or "rules_dir" not in data:
            return data
        data = dict(data)
        if "rules_dirs" in data:
            raise ValueError("give rules_dirs or rules_dir (its old name), not both")
        old = data.pop("rules_dir")
        data["rules_dirs"] = list(DEFAULT_RULES_DIRS) if old == DEFAULT_RULES_DIR else [old]
        return data


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
