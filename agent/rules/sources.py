"""Which rules files count, the systemd way: vendor defaults, admin overrides, masks.

`remediation.rules_dirs` lists directories from lowest to highest priority; the packages give
`/usr/share/gpu-agent/rules.d` (shipped, replaced on every upgrade) then `/etc/gpu-agent/rules.d`
(the admin's). A file of the same name in a later directory replaces the earlier one; an empty
file or a symlink to /dev/null disables it. The winning files are read in name order, whatever
directory they come from, so `15-site.yaml` in /etc runs between the shipped 10- and 20- files.

This is why no rules file is a conffile: an upgrade replaces the shipped ones without a prompt,
and the admin's edits live in files of their own that no upgrade touches.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agent.config_errors import ConfigError, ConfigProblem
from agent.trust import directory_problem

# The directories themselves: remediation.rules_dirs, default agent.defaults.DEFAULT_RULES_DIRS.
RULES_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class RuleSource:
    """One rules file that will be read."""

    path: Path
    origin: Path  # the directory it came from
    replaces: tuple[Path, ...] = ()  # same-named files of lower-priority directories it overrides

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class MaskedRule:
    """A rules file disabled by an empty file or a /dev/null link of the same name."""

    mask: Path
    hides: tuple[Path, ...]  # the files it disables (none: it masks a name nothing ships)


@dataclass(frozen=True)
class ResolvedRules:
    files: list[RuleSource] = field(default_factory=list)
    masked: list[MaskedRule] = field(default_factory=list)
    missing_dirs: list[Path] = field(default_factory=list)
    unread: list[Path] = field(default_factory=list)  # files in a rules dir that are not rules (*.rpmsave, README)

    @property
    def paths(self) -> list[Path]:
        return [source.path for source in self.files]

    def warnings(self) -> list[str]:
        """What an operator should hear about: rules they may think are read but are not."""
        found = [f"{d}: no such directory" for d in self.missing_dirs]
        found += [f"{p}: not read (rules files end in .yaml or .yml)" for p in self.unread]
        if not self.files:
            found.append("no rules files: remediation has nothing to do")
        return found


def _is_mask(path: Path) -> bool:
    if path.is_symlink() and os.path.realpath(path) == os.devnull:
        return True
    return path.is_file() and path.stat().st_size == 0


def resolve_rules(dirs: Iterable[Path]) -> ResolvedRules:
    """The rules files `dirs` (lowest priority first) give; raises ConfigError for a directory
    others may write (whoever may add a file may add a rule, and a hook run as root)."""
    given = list(dirs)
    # The whole path from /, not only the directory: a root-owned rules.d under a user's directory
    # can be swapped by that user.
    refused = [(d, directory_problem(d)) for d in given if d.is_dir()]
    problems = [ConfigProblem(str(d), None, "", f"refused: {why}") for d, why in refused if why]
    if problems:
        raise ConfigError(problems)
    by_name: dict[str, list[tuple[Path, Path]]] = {}  # name -> [(dir, file)], lowest priority first
    missing: list[Path] = []
    unread: list[Path] = []
    for directory in given:
        if not directory.is_dir():
            missing.append(directory)
            continue
        for entry in sorted(directory.iterdir()):
            if entry.name.startswith(".") or entry.is_dir():
                continue
            if entry.suffix in RULES_SUFFIXES:
                by_name.setdefault(entry.name, []).append((directory, entry))
            else:
                unread.append(entry)
    resolved = ResolvedRules(missing_dirs=missing, unread=unread)
    for name in sorted(by_name):
        *lower, (origin, winner) = by_name[name]
        hidden = tuple(path for _, path in lower)
        if _is_mask(winner):
            resolved.masked.append(MaskedRule(winner, hidden))
        else:
            resolved.files.append(RuleSource(winner, origin, hidden))
    return resolved


def describe(resolved: ResolvedRules) -> list[str]:
    """One line per file read or masked, saying where it came from (check-config, status)."""
    lines = []
    for source in resolved.files:
        note = f" (overrides {', '.join(map(str, source.replaces))})" if source.replaces else ""
        lines.append(f"  {source.path}{note}")
    for masked in resolved.masked:
        hides = ", ".join(map(str, masked.hides)) or "nothing"
        lines.append(f"  {masked.mask}: masked (disables {hides})")
    return lines
