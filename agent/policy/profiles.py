"""Which settings a GPU gets, and where each comes from.

A GPU's profile is the first of `policy.gpus` that matches it (every key `match` gives must match:
a model glob, a uuid, an index); then every `policy.gpu_overrides` entry that matches it replaces
the keys that entry sets, in order: agent.yaml's overrides first, then those of the drop-ins in
`agent.d/` beside it, in name order (agent.policy.dropins), so the last word wins. A GPU no profile
matches takes what its overrides set. Each setting remembers where its value came from, which
`plan` shows.

`shadowed` finds what can never count: a profile of `policy.gpus` that an earlier one matches on
every GPU it could match (first match wins, so it is never used), and an override whose every key
a later override, matching every GPU it matches, sets again.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from dataclasses import dataclass

from agent.backend.base import GpuIdentity
from agent.config import PolicyConfig
from agent.config.desired import GpuMatch, GpuProfile

#: The keys of a profile that set something (all but `match`).
SETTINGS: tuple[str, ...] = tuple(name for name in GpuProfile.model_fields if name != "match")
_GLOB_CHARACTERS = "*?["


def matches(match: GpuMatch, identity: GpuIdentity) -> bool:
    """Every key `match` gives matches the GPU."""
    if match.model is not None and not fnmatch.fnmatchcase(identity.name, match.model):
        return False
    if match.uuid is not None and match.uuid.lower() != identity.uuid.lower():
        return False
    return match.index is None or match.index == identity.index


def match_profile(profiles: Sequence[GpuProfile], identity: GpuIdentity) -> int | None:
    """Index of the first profile matching the GPU, or None."""
    return next((number for number, profile in enumerate(profiles) if matches(profile.match, identity)), None)


def set_keys(profile: GpuProfile) -> tuple[str, ...]:
    """The settings an override replaces: those its file gives (`fan_curve: null` too: no curve)."""
    return tuple(key for key in SETTINGS if key in profile.model_fields_set)


def match_text(match: GpuMatch) -> str:
    """`{model: "NVIDIA H200*"}`, as agent.yaml spells it."""
    given = {key: getattr(match, key) for key in ("model", "uuid", "index") if getattr(match, key) is not None}
    return "{" + ", ".join(f"{key}: {json.dumps(value)}" for key, value in given.items()) + "}"


def profile_name(number: int) -> str:
    return f"policy.gpus[{number}]"


def override_name(policy: PolicyConfig, number: int) -> str:
    """An override as `plan` and check-config name it: where a drop-in's came from, else its key."""
    return policy.gpu_overrides[number].origin or f"policy.gpu_overrides[{number}]"


@dataclass(frozen=True)
class ResolvedProfile:
    """The settings in force for one GPU, and where each came from."""

    profile: GpuProfile
    number: int | None  # the first matching profile of policy.gpus; None: only overrides match
    overrides: tuple[int, ...]  # the matching overrides, in the order they apply
    sources: dict[str, str]  # setting -> where its value comes from, for the settings that are set

    def from_overrides(self) -> dict[str, str]:
        """The settings an override gave, and which one (what `plan` says beside the profile)."""
        base = "" if self.number is None else profile_name(self.number)
        return {key: source for key, source in self.sources.items() if source != base}


def resolve_profile(policy: PolicyConfig, identity: GpuIdentity) -> ResolvedProfile | None:
    """The GPU's settings (see the module docstring); None when neither a profile nor an override matches."""
    number = match_profile(policy.gpus, identity)
    overrides = tuple(n for n, override in enumerate(policy.gpu_overrides) if matches(override.match, identity))
    if number is None and not overrides:
        return None
    profile = policy.gpus[number] if number is not None else GpuProfile(match=policy.gpu_overrides[overrides[0]].match)
    sources: dict[str, str] = {}
    if number is not None:
        sources = {key: profile_name(number) for key in SETTINGS if getattr(profile, key) is not None}
    for n in overrides:
        override = policy.gpu_overrides[n]
        keys = set_keys(override)
        profile = profile.model_copy(update={key: getattr(override, key) for key in keys})
        for key in keys:
            sources[key] = override_name(policy, n)
    sources = {key: source for key, source in sources.items() if getattr(profile, key) is not None}
    return ResolvedProfile(profile, number, overrides, sources)


# -- what can never count (check-config) --------------------------------------------------------------


def _glob_covers(outer: str, inner: str) -> bool:
    """Every name `inner` matches, `outer` matches too (as far as can be told without the names)."""
    if outer == inner:
        return True
    if not any(c in inner for c in _GLOB_CHARACTERS):
        return fnmatch.fnmatchcase(inner, outer)
    prefix = outer[:-1]
    return outer.endswith("*") and not any(c in prefix for c in _GLOB_CHARACTERS) and inner.startswith(prefix)


def covers(outer: GpuMatch, inner: GpuMatch) -> bool:
    """Every GPU `inner` matches, `outer` matches too."""
    if outer.uuid is not None and (inner.uuid is None or inner.uuid.lower() != outer.uuid.lower()):
        return False
    if outer.index is not None and inner.index != outer.index:
        return False
    return outer.model is None or (inner.model is not None and _glob_covers(outer.model, inner.model))


def shadowed(policy: PolicyConfig) -> list[str]:
    """One line per profile or override that can never count (see the module docstring)."""
    found: list[str] = []
    for number, profile in enumerate(policy.gpus):
        earlier = next((n for n in range(number) if covers(policy.gpus[n].match, profile.match)), None)
        if earlier is not None:
            found.append(
                f"{profile_name(number)} (match {match_text(profile.match)}) is never used:"
                f" {profile_name(earlier)} (match {match_text(policy.gpus[earlier].match)}) matches every GPU it"
                " matches, and the first matching profile wins (move it before, or make it a policy.gpu_overrides"
                " entry, which changes only the keys it sets)"
            )
    overrides = policy.gpu_overrides
    for number, override in enumerate(overrides):
        keys = set(set_keys(override))
        later = next(
            (
                n
                for n in range(len(overrides) - 1, number, -1)
                if covers(overrides[n].match, override.match) and keys <= set(set_keys(overrides[n]))
            ),
            None,
        )
        if later is not None and keys:
            found.append(
                f"{override_name(policy, number)} (match {match_text(override.match)}) changes nothing:"
                f" {override_name(policy, later)}, read later, matches every GPU it matches and sets"
                f" {', '.join(sorted(keys))} again"
            )
    return found
