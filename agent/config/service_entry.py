"""One entry of the `services:` section: an inference service the agent probes, scrapes, restarts
and tunes, with its latency objectives (`slo`) and its drain before a stop (`drain`)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from agent.config.fields import StrictModel, absolute_argv, http_url, one_of_set

#: A CUDA version an image was built for: `12.4`, `13.0`.
CudaVersion = Annotated[str, Field(pattern=r"^\d+\.\d+$")]


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
        return one_of_set(self, "e2e_p95_seconds", "ttft_p95_seconds")


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
