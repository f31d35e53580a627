"""Remediation rules: the `rules.d/*.yaml` contract and its loader.

Every `*.yaml` file of a rules directory is read in name order (`10-xid.yaml` before
`20-thermal.yaml`); names starting with a dot (editor lock files) are skipped. A file holds one
top-level key, `rules`, a list of rules. Rule names are unique across all files. Unknown keys are
errors; every problem is reported as `FILE:LINE field: message`.

A full example::

    rules:
      - name: restart-on-app-xid          # [a-z0-9][a-z0-9_.-]*: `gpu-agent ack NAME`, metric label
        description: "A CUDA application crashed the GPU context; the GPU itself is fine"
        match:                            # exactly one condition kind:
          xid: {catalog_action: restart_service}   # the codes the shipped catalog says need this remedy
          # xid: {codes: [13, 31, 43], buckets: [RESTART_APP], except_codes: [45]}  # or list them
          # throttle: {reasons: [hw_thermal_slowdown], held_seconds: 60}   # a slowdown held this long
          # service_unhealthy: {probes: 3, services: [sglang]}  # N failed probes in a row (services: all)
          # gpu_lost: {}                   # the GPU fell off the bus (NVML GPU_IS_LOST)
          # ecc_uncorrected: {}            # new uncorrectable ECC errors
          # row_remap: {failed: true}      # and/or pending: true
          # policy_drift: {reappeared: 2, items: [power_limit]}  # drift back N times after a fix
          # event: {kinds: [pcie_degraded], min_severity: warning, suggested_actions: [reset_gpu]}
          # event: {kinds: [recovery_action], min_suggested_action: reset_gpu}   # reset_gpu or reboot
        gpus: all                         # or [0, 1]: GPU indices this rule watches
        actions:                          # the escalation ladder, one action per step:
          - restart_service: {service: sglang}   # service optional: the services on that GPU
          - reset_gpu: {}                 # attempt 2 within the window
          - alertmanager                  # attempt 3 and later: page now (the fault's alert, docs/alerts.md)
        cooldown_seconds: 300             # no new attempt on the same target sooner than this
        max_attempts: 3                   # per window and target; then the rule's circuit opens
        window_seconds: 3600
        dry_run: false                    # decide and record, but change nothing
        on_exhausted:                     # runs once, when the circuit opens
          - alertmanager                  # GpuAgentRemediationFailing for this rule
          - webhook: {url: "https://hooks.example/gpu", headers: {X-Token: abc}, timeout_seconds: 5}
          - run_hook: {argv: [/usr/local/bin/drain-node, --reason, gpu], timeout_seconds: 60}

Action kinds and their parameters: one module per kind under agent/rules/actions/kinds/, whose
pydantic model the step is validated against here and which its handler then receives as
validated (README's table of actions lists them, written from those modules). A step without
parameters may be written bare: `- reset_gpu`. A kind that needs `remediation.allow_reboot: true`
(reboot) is refused at load time without it.

What each condition reads (see agent/rules/engine.py for targets and storm protection):

- `xid`: XID events; `data["xid"]` is the code. `catalog_action` (a SuggestedAction: none, alert,
  restart_service, reset_gpu, reboot, ...) and `buckets` are resolved to codes from the shipped
  catalog when the rules load (`gpu-agent xid explain N` shows a code's action and bucket); a code
  the catalog lacks counts as action `alert`, bucket `UNKNOWN`.
- `throttle`: the snapshot's `throttle_active_since`; one held slowdown is one fault.
- `service_unhealthy`: the snapshot's services (`consecutive_failures`); checked every loop
  while the service stays down, so the ladder escalates until the service answers again.
- `gpu_lost`, `ecc_uncorrected`, `row_remap`: GPU_LOST, ECC_UNCORRECTED, ROW_REMAP_PENDING /
  ROW_REMAP_FAILED events.
- `policy_drift`: POLICY_DRIFT events whose `data["reappeared"]` (how many times the drift came
  back after being corrected) reaches the threshold; `items` filters on `data["item"]`.
- `event`: any event kind, optionally filtered by minimum severity, suggested actions, and a
  minimum suggested action (the one ranking of remedies, agent/events.py).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ModelWrapValidatorHandler, PrivateAttr, create_model, field_validator, model_validator

from agent.config import (
    ConfigError,
    ConfigProblem,
    ItemName,
    PathKey,
    format_path,
    parse_yaml,
    read_trusted_text,
    validate_model,
)
from agent.config.fields import StrictModel
from agent.events import EventKind, Severity, SuggestedAction
from agent.rules.actions.kind import ActionType, Targets
from agent.rules.actions.registry import KINDS
from agent.rules.model import ActionSpec
from agent.trust import directory_problem
from agent.watch import xid_catalog
from agent.watch.clock_events import SLOWDOWN_REASONS

RULE_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]*$"
# The store prunes history older than this; a longer window would count attempts it no longer has.
MAX_WINDOW_SECONDS = 30 * 24 * 3600.0
RULES_GLOB = "*.yaml"


def _empty_for_null(value: Any) -> Any:
    """`gpu_lost:` (YAML null) and `reset_gpu:` mean the same as `gpu_lost: {}`."""
    if isinstance(value, dict):
        return {key: ({} if item is None else item) for key, item in value.items()}
    return value


def _exactly_one(chosen: list[str], names: Iterable[str], what: str) -> None:
    """`chosen`, those of `names` given, must be one."""
    if len(chosen) != 1:
        given = f"got {', '.join(chosen)}" if chosen else "got none"
        raise ValueError(f"needs exactly one {what} ({given}); one of: {', '.join(names)}")


# -- conditions ------------------------------------------------------------------------------


Code = Annotated[int, Field(ge=1, le=xid_catalog.MAX_CODE)]


class XidCondition(StrictModel):
    """Xid codes to act on: explicit `codes`, NVIDIA resolution `buckets`, and/or `catalog_action`,
    the codes whose default action in the shipped catalog is that remedy (resolved when the rules
    load, so a rule follows the catalog instead of copying its code lists). The catalog's verdict for
    a code it lacks is `alert` with bucket UNKNOWN: such codes match `catalog_action: alert` and
    `buckets: [UNKNOWN]`. `except_codes` takes codes back out."""

    codes: list[Code] = Field(default_factory=list)
    buckets: list[str] = Field(default_factory=list)  # NVIDIA resolution buckets, e.g. RESTART_APP
    catalog_action: list[SuggestedAction] = Field(default_factory=list)  # one remedy or a list
    except_codes: list[Code] = Field(default_factory=list)

    _resolved: frozenset[int] = PrivateAttr(default=frozenset())
    _unknown_codes: bool = PrivateAttr(default=False)

    @field_validator("catalog_action", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("buckets")
    @classmethod
    def _known_buckets(cls, buckets: list[str]) -> list[str]:
        known = sorted({*xid_catalog.catalog().buckets, xid_catalog.UNKNOWN_RESOLUTION})
        unknown = [b for b in buckets if b not in known]
        if unknown:
            raise ValueError(f"unknown resolution bucket {', '.join(unknown)} (known: {', '.join(known)})")
        return buckets

    @model_validator(mode="after")
    def _resolve(self) -> XidCondition:
        if not self.codes and not self.buckets and not self.catalog_action:
            raise ValueError("needs codes, buckets and/or catalog_action")
        both = sorted(set(self.codes) & set(self.except_codes))
        if both:
            raise ValueError(f"codes {', '.join(map(str, both))} are both listed and excepted")
        entries = xid_catalog.catalog().entries
        used = {info.action for info in entries.values()} | {xid_catalog.UNKNOWN_ACTION}
        unused = [action.value for action in self.catalog_action if action not in used]
        if unused:
            known = ", ".join(sorted(action.value for action in used))
            raise ValueError(f"no Xid has catalog action {', '.join(unused)} (the catalog uses: {known})")
        resolved = {
            code
            for code, info in entries.items()
            if info.action in self.catalog_action or info.resolution in self.buckets
        }
        self._resolved = frozenset((resolved | set(self.codes)) - set(self.except_codes))
        self._unknown_codes = (
            xid_catalog.UNKNOWN_ACTION in self.catalog_action or xid_catalog.UNKNOWN_RESOLUTION in self.buckets
        )
        return self

    @property
    def resolved_codes(self) -> frozenset[int]:
        """The catalog codes this condition matches, as resolved at load time."""
        return self._resolved

    def matches(self, code: int) -> bool:
        if code in self._resolved:
            return True
        unlisted = xid_catalog.lookup(code) is None
        return unlisted and self._unknown_codes and code not in self.except_codes


class ThrottleCondition(StrictModel):
    reasons: list[str] = Field(min_length=1)
    held_seconds: float = Field(default=60.0, ge=0, le=86400)

    @field_validator("reasons")
    @classmethod
    def _slowdown_reasons(cls, reasons: list[str]) -> list[str]:
        # Benign reasons (gpu_idle, sync_boost, ...) are never "active since": they would never match.
        unknown = [r for r in reasons if r not in SLOWDOWN_REASONS]
        if unknown:
            raise ValueError(
                f"not a slowdown reason: {', '.join(unknown)} (one of: {', '.join(sorted(SLOWDOWN_REASONS))})"
            )
        return reasons


class ServiceUnhealthyCondition(StrictModel):
    probes: int = Field(default=3, ge=1, le=100)
    services: list[str] | None = Field(default=None, min_length=1)  # None: every configured service


class NoParams(StrictModel):
    """A condition or action that takes no parameters: `gpu_lost: {}`, `reset_gpu: {}`."""


class RowRemapCondition(StrictModel):
    pending: bool = False  # spare rows will be used after the next GPU reset
    failed: bool = False  # no spare rows left: the memory needs service

    @model_validator(mode="after")
    def _not_empty(self) -> RowRemapCondition:
        if not self.pending and not self.failed:
            raise ValueError("needs pending: true and/or failed: true")
        return self


class PolicyDriftCondition(StrictModel):
    reappeared: int = Field(default=1, ge=1)
    items: list[ItemName] | None = Field(default=None, min_length=1)


class EventCondition(StrictModel):
    kinds: list[EventKind] = Field(min_length=1)
    min_severity: Severity = Severity.INFO
    suggested_actions: list[SuggestedAction] | None = Field(default=None, min_length=1)
    #: The event's suggested action at least this drastic (SuggestedAction's ranking: none < alert <
    #: restart_service < check_mechanicals < contact_support < reset_gpu < reboot).
    min_suggested_action: SuggestedAction = SuggestedAction.NONE


CONDITION_KINDS = (
    "xid",
    "throttle",
    "service_unhealthy",
    "gpu_lost",
    "ecc_uncorrected",
    "row_remap",
    "policy_drift",
    "event",
)


class Match(StrictModel):
    xid: XidCondition | None = None
    throttle: ThrottleCondition | None = None
    service_unhealthy: ServiceUnhealthyCondition | None = None
    gpu_lost: NoParams | None = None
    ecc_uncorrected: NoParams | None = None
    row_remap: RowRemapCondition | None = None
    policy_drift: PolicyDriftCondition | None = None
    event: EventCondition | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        return _empty_for_null(value)

    @model_validator(mode="after")
    def _one_condition(self) -> Match:
        _exactly_one(
            [name for name in CONDITION_KINDS if getattr(self, name) is not None], CONDITION_KINDS, "condition"
        )
        return self

    @property
    def kind(self) -> str:
        return next(name for name in CONDITION_KINDS if getattr(self, name) is not None)


# -- actions ---------------------------------------------------------------------------------


class _Step(StrictModel):
    """One step of a ladder: `{KIND: {params}}` with exactly one KIND. `ActionStep` below has a field
    per action kind (agent/rules/actions/registry.py), holding that kind's parameter model."""

    @model_validator(mode="wrap")
    @classmethod
    def _one_action(cls, value: Any, handler: ModelWrapValidatorHandler[_Step]) -> _Step:
        # `- reset_gpu` is `- reset_gpu: {}`.
        value = {value: {}} if isinstance(value, str) else _empty_for_null(value)
        step = handler(value)
        chosen = [name for name in value if name in KINDS]  # in the order written
        _exactly_one(chosen, KINDS, "action kind per step (write two steps for two actions)")
        return step

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) is not None)

    @property
    def action(self) -> ActionType[Any]:
        """The step's kind, as its module declares it."""
        return KINDS[self.kind]

    def spec(self) -> ActionSpec:
        return ActionSpec(getattr(self, self.kind))


if TYPE_CHECKING:
    ActionStep = _Step
else:
    ActionStep = create_model(
        "ActionStep",
        __base__=_Step,
        __module__=__name__,
        **{name: (action.params | None, None) for name, action in KINDS.items()},
    )


# -- rules -----------------------------------------------------------------------------------


class Rule(StrictModel):
    name: str = Field(max_length=100)
    description: str = ""
    match: Match
    gpus: Literal["all"] | list[Annotated[int, Field(ge=0)]] = "all"
    actions: list[ActionStep] = Field(min_length=1)
    cooldown_seconds: float = Field(default=300.0, ge=0, le=MAX_WINDOW_SECONDS)
    max_attempts: int = Field(default=3, ge=1, le=1000)
    window_seconds: float = Field(default=3600.0, gt=0, le=MAX_WINDOW_SECONDS)
    dry_run: bool = False
    on_exhausted: list[ActionStep] = Field(default_factory=list)

    _source: str = PrivateAttr(default="")

    @field_validator("name")
    @classmethod
    def _usable_name(cls, name: str) -> str:
        if not re.fullmatch(RULE_NAME_PATTERN, name):
            raise ValueError(
                "must be lowercase letters, digits, '-', '_' and '.', starting with a letter or digit "
                "(it is a metric label and the argument of `gpu-agent ack`)"
            )
        if name == "all":
            raise ValueError("'all' is reserved: `gpu-agent ack all` acknowledges every rule")
        return name

    @model_validator(mode="after")
    def _fits_condition(self) -> Rule:
        if self.match.service_unhealthy is not None:
            if self.gpus != "all":
                raise ValueError("gpus does not apply to service_unhealthy (it watches services, not GPUs)")
            needs_gpu = [step.kind for step in self.steps if step.action.targets is Targets.GPU]
            if needs_gpu:
                raise ValueError(f"{needs_gpu[0]} needs a GPU: service_unhealthy faults have none")
        return self

    @property
    def source(self) -> str:
        """Where the rule was defined, `FILE:LINE` (empty for rules built in code)."""
        return self._source

    def placed_steps(self) -> Iterator[tuple[Literal["actions", "on_exhausted"], int, ActionStep]]:
        """`steps`, each with where it stands (ladder, position): what the checks of a step report."""
        for ladder in ("actions", "on_exhausted"):
            for position, step in enumerate(self.actions if ladder == "actions" else self.on_exhausted):
                yield ladder, position, step

    @property
    def steps(self) -> tuple[ActionStep, ...]:
        """Every step: the ladder, then `on_exhausted`."""
        return (*self.actions, *self.on_exhausted)

    @property
    def aims_at_services(self) -> bool:
        """A step of the rule is aimed at services (restart_service): the engine then targets each service."""
        return any(step.action.targets is Targets.SERVICES for step in self.steps)

    def watches_gpu(self, gpu: int | None) -> bool:
        """A rule limited to some GPUs does not act on a fault whose GPU is unknown."""
        return self.gpus == "all" or (gpu is not None and gpu in self.gpus)


class RulesFile(StrictModel):
    rules: list[Rule] = Field(default_factory=list)


# -- loading ---------------------------------------------------------------------------------


def rule_files(paths: Iterable[Path]) -> list[Path]:
    """Each directory expanded to its `*.yaml` files in name order; files are taken as given."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.glob(RULES_GLOB) if not p.name.startswith(".") and p.is_file())
        else:
            files.append(path)
    return files


def _load_file(file: Path, allow_reboot: bool) -> list[Rule]:
    where = str(file)
    # Rules can run hooks as root: the trust check (the file and every directory from /) runs on
    # the descriptor that is then read, so a link swapped after the check changes nothing.
    data, lines = parse_yaml(read_trusted_text(file), where)
    if data is not None and not isinstance(data, dict):
        raise ConfigError([ConfigProblem(where, 1, "", "must be a YAML mapping with a `rules` list")])
    parsed = validate_model(RulesFile, data, lines, where)
    problems: list[ConfigProblem] = []
    for index, rule in enumerate(parsed.rules):
        rule._source = f"{where}:{lines.get(('rules', index, 'name'), lines.get(('rules', index), 0))}"
        if allow_reboot:
            continue
        for ladder, position, step in rule.placed_steps():
            if step.action.needs_allow_reboot:
                path: PathKey = ("rules", index, ladder, position, step.kind)
                message = f"not allowed: set remediation.allow_reboot: true in agent.yaml to let rules {step.kind}"
                line = lines.get(path, lines.get(path[:-1]))  # `- reboot` has no key of its own
                problems.append(ConfigProblem(where, line, format_path(path), message))
    if problems:
        raise ConfigError(problems)
    return parsed.rules


def _missing_why(path: Path) -> str:
    """Why a given rules path cannot be found; a dangling or looping link says where it points."""
    if not path.is_symlink():
        return "no such file or directory"
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python 3.11 raises it for a loop; 3.13 raises OSError(ELOOP)
        return "symbolic link loop"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symbolic link loop"
    return f"broken symbolic link to {os.readlink(path)}"


def load_rules(paths: Iterable[Path], allow_reboot: bool = False) -> list[Rule]:
    """Rules from rules directories and/or files, in order; raises ConfigError listing every problem.

    A missing path is an error: a typo in `rules_dir` must not silently disable remediation.
    """
    given = list(paths)
    missing = [ConfigProblem(str(p), None, "", _missing_why(p)) for p in given if not p.exists()]
    if missing:
        raise ConfigError(missing)
    # Whoever may add a file to the directory may add a rule (and a hook): the directory counts too,
    # and so does every directory above it (whoever owns a parent can swap the whole rules dir).
    # A sticky rules dir (/tmp-like) is refused: others could still add their own files to it.
    unsafe = [(p, directory_problem(p)) for p in given if p.is_dir()]
    refused = [ConfigProblem(str(p), None, "", f"refused: {why}") for p, why in unsafe if why]
    if refused:
        raise ConfigError(refused)
    problems: list[ConfigProblem] = []
    rules: list[Rule] = []
    first_seen: dict[str, Rule] = {}
    for file in rule_files(given):
        try:
            loaded = _load_file(file, allow_reboot)
        except ConfigError as exc:
            problems += exc.problems
            continue
        for index, rule in enumerate(loaded):
            earlier = first_seen.get(rule.name)
            if earlier is None:
                first_seen[rule.name] = rule
                rules.append(rule)
                continue
            line = int(rule.source.rpartition(":")[2]) or None
            message = f"duplicate rule name {rule.name!r}, first defined at {earlier.source}"
            problems.append(ConfigProblem(str(file), line, f"rules[{index}].name", message))
    if problems:
        raise ConfigError(problems)
    return rules


def ignored_parameters(rules: Iterable[Rule]) -> list[str]:
    """What the rules' steps carry that does nothing any more (a kind's `ignored`, kept from an earlier
    release so that an upgrade loads the admin's files): `FILE:LINE rule NAME: LADDER[i].KIND.FIELD:
    why`, one line each, for check-config's warnings and the daemon's log."""
    return [
        f"{rule.source} rule {rule.name}: {ladder}[{position}].{step.kind}.{field}: {why}"
        for rule in rules
        for ladder, position, step in rule.placed_steps()
        for field, why in step.action.ignored_fields(step.spec().options)
    ]
