"""Policy drop-ins: `agent.d/*.yaml` beside agent.yaml, read after it, in name order.

A drop-in sets only `policy.gpu_overrides`: each override that matches a GPU replaces the keys it
sets in that GPU's profile, after agent.yaml's own overrides (agent.policy.profiles), so a drop-in
changes one setting of the GPUs it names and leaves the rest of their profile as agent.yaml says.
`gpu-agent tune apply` writes `agent.d/90-tune.yaml` and `gpu-agent tune undo` removes it; an
operator may add files of their own (`10-canary.yaml`).

Each file is read as agent.yaml is: trusted (root's alone, and every directory above it), through
the bounded YAML loader, its errors as `FILE:LINE field: message`; a directory others may write is
refused whole. A name that starts with a dot or does not end in `.yaml` is not read: an editor's
backup, or the temporary file `tune apply` renames into place, is never half of the policy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from agent.config import (
    AgentConfig,
    ConfigError,
    ConfigProblem,
    PolicyConfig,
    load_config,
    parse_yaml,
    read_trusted_text,
    validate_model,
)
from agent.config.desired import GpuProfile
from agent.config.fields import StrictModel
from agent.trust import directory_problem

DROPIN_DIRECTORY = "agent.d"
DROPIN_SUFFIX = ".yaml"
#: The drop-in `gpu-agent tune apply` writes and `tune undo` removes: late in name order, so it has the last word.
TUNE_DROPIN = "90-tune.yaml"
#: The only key a drop-in sets: (policy, gpu_overrides).
_ALLOWED = ("policy", "gpu_overrides")


class DropInPolicy(StrictModel):
    gpu_overrides: list[GpuProfile] = Field(min_length=1)


class DropIn(StrictModel):
    policy: DropInPolicy


def dropin_directory(config_path: str | Path) -> Path:
    """Where the drop-ins of the config at `config_path` live: `agent.d/` beside it."""
    return Path(config_path).parent / DROPIN_DIRECTORY


def dropin_files(directory: Path) -> list[Path]:
    """The drop-ins in `directory`, in the order they are read; none when it does not exist.
    ConfigError when someone other than root could add one."""
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise ConfigError([ConfigProblem(str(directory), None, "", "not a directory (drop-ins go in agent.d/)")])
    problem = directory_problem(directory)
    if problem is not None:
        raise ConfigError([ConfigProblem(str(directory), None, "", f"refused: {problem}")])
    return sorted(
        entry
        for entry in directory.iterdir()
        if not entry.name.startswith(".") and entry.name.endswith(DROPIN_SUFFIX) and not entry.is_dir()
    )


def read_overrides(text: str, file: str) -> list[GpuProfile]:
    """A drop-in's overrides, each knowing its `FILE:LINE`; ConfigError naming what is wrong."""
    data, lines = parse_yaml(text, file)
    policy = data.get("policy") if isinstance(data, dict) else None
    stray: list[tuple[str, ...]] = [(key,) for key in (data if isinstance(data, dict) else {}) if key != _ALLOWED[0]]
    stray += [(_ALLOWED[0], key) for key in (policy if isinstance(policy, dict) else {}) if key != _ALLOWED[1]]
    if stray or not isinstance(data, dict):
        where = stray[0] if stray else ()
        raise ConfigError(
            [
                ConfigProblem(
                    file,
                    lines.get(where, 1),
                    ".".join(map(str, where)),
                    "a drop-in sets only policy.gpu_overrides (everything else is agent.yaml's)",
                )
            ]
        )
    dropin = validate_model(DropIn, data, lines, file)
    return [
        override.with_origin(f"{file}:{lines.get(('policy', 'gpu_overrides', number), '?')}")
        for number, override in enumerate(dropin.policy.gpu_overrides)
    ]


def with_dropins(
    config: AgentConfig, config_path: str | Path, edits: Mapping[str, str | None] | None = None
) -> AgentConfig:
    """`config` (agent.yaml alone) with the overrides of every drop-in beside it appended.

    `edits` (file name -> text, or None) reads as if the directory held that text under that name,
    or lacked the file: `tune apply` and `tune undo` check what they are about to write or remove."""
    directory = dropin_directory(config_path)
    files: dict[str, str | Path] = {path.name: path for path in dropin_files(directory)}
    for name, text in (edits or {}).items():
        if text is None:
            files.pop(name, None)
        else:
            files[name] = text
    if not files:
        return config
    overrides: list[GpuProfile] = []
    problems: list[ConfigProblem] = []
    for name in sorted(files):
        source = files[name]
        shown = str(directory / name)
        try:
            text = read_trusted_text(source) if isinstance(source, Path) else source
            overrides += read_overrides(text, shown)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    policy = config.policy.model_copy(update={"gpu_overrides": [*config.policy.gpu_overrides, *overrides]})
    return config.model_copy(update={"policy": policy})


def from_dropin(override: GpuProfile, name: str) -> bool:
    """The override was read from the drop-in `name` (its origin is `.../agent.d/NAME:LINE`)."""
    path = Path(override.origin.rpartition(":")[0]) if override.origin else None
    return path is not None and path.name == name and path.parent.name == DROPIN_DIRECTORY


def without_dropin(policy: PolicyConfig, name: str = TUNE_DROPIN) -> PolicyConfig:
    """`policy` as it is apart from the drop-in `name`: what a sweep measures against, and what
    `tune apply` compares with, so an earlier `tune apply` never counts as the operator's policy."""
    kept = [override for override in policy.gpu_overrides if not from_dropin(override, name)]
    return policy if len(kept) == len(policy.gpu_overrides) else policy.model_copy(update={"gpu_overrides": kept})


def load_checked_config(path: str | Path, dropin_edits: Mapping[str, str | None] | None = None) -> AgentConfig:
    """The config in `path` (agent.config.load_config) with the check only the simulator can make: a
    `simulated.profile` that does not load is a ConfigError naming the file, line and key, so
    check-config, `run` and a reload report it instead of the backend failing when it opens. Then
    the policy drop-ins beside it (`dropin_edits` as `with_dropins` takes them)."""
    config = load_config(path, checks=[(("simulated", "profile"), _validate_profile)])
    return with_dropins(config, path, dropin_edits)


def _validate_profile(value: Any) -> str:
    # The simulator loads only for a config that names a profile: an NVML node's config never does.
    from agent.backend.sim.profiles import validate_profile

    return validate_profile(value)
