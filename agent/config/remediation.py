"""What the agent does about a fault, as configured: the `remediation:` section (its rules files,
reboots, the command that reboots, the Alertmanagers it pushes to) and the `alerts:` section (how
its pushes are labelled, where their runbooks are)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from agent.config.fields import StrictModel, absolute_argv, http_url, no_line_breaks
from agent.config_errors import known_names
from agent.defaults import DEFAULT_RULES_DIR, DEFAULT_RULES_DIRS
from agent.names.alerts import ALERT_NAMES, DEFAULT_RUNBOOK_URL
from agent.names.alerts import DEFAULT_JOB as DEFAULT_ALERT_JOB
from agent.names.alerts import RESERVED_LABELS as RESERVED_ALERT_LABELS


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
