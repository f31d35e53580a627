"""`gpu-agent check-config`: the config and every rules file validated, and what the daemon would
only find out when a fault needs it (a rules directory that is not there, a hook it may not run)
refused now."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agent.cli.common import EXIT_ERROR, EXIT_OK, CliError, config_path, print_text
from agent.defaults import DEFAULT_CONFIG_PATH

if TYPE_CHECKING:
    from agent.config import AgentConfig
    from agent.rules.config import Rule


def cmd_check_config(args: argparse.Namespace) -> int:
    from agent.policy.dropins import dropin_directory, dropin_files, load_checked_config
    from agent.policy.profiles import shadowed
    from agent.rules.config import ignored_parameters, load_rules
    from agent.rules.sources import describe, resolve_rules
    from agent.version import package_notice

    path, _ = config_path(args)
    if path is None:
        raise CliError(f"no config: {DEFAULT_CONFIG_PATH} does not exist (give --config PATH)")
    config = load_checked_config(path)
    resolved = resolve_rules(Path(d) for d in (args.rules or config.remediation.rules_dirs))
    _check_rules_dirs_exist(Path(path), resolved.missing_dirs, from_config=not args.rules)
    rules = load_rules(resolved.paths, allow_reboot=config.remediation.allow_reboot)
    _check_steps(rules)
    _check_drain_hooks(config, str(path))
    print_text(
        f"{path}: ok ({config.mode.value} mode, {config.backend} backend, {len(config.policy.gpus)} GPU profiles, "
        f"{len(config.services)} services); {len(rules)} rules from {len(resolved.files)} files:"
    )
    for line in describe(resolved):
        print_text(line)
    dropins = dropin_files(dropin_directory(path))
    if dropins:
        print_text(f"policy drop-ins, read after {path} in this order:")
        for dropin in dropins:
            print_text(f"  {dropin}")
    warnings = shadowed(config.policy) + resolved.warnings() + ignored_parameters(rules)
    notice = package_notice(_daemon_version(config.api.socket))
    if notice is not None:
        warnings.append(notice)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return EXIT_ERROR if warnings and args.strict else EXIT_OK


def _daemon_version(socket_path: str) -> str | None:
    """The version of the daemon answering on the config's socket; None when none answers."""
    from agent import api

    try:
        document = api.call(socket_path, "status", timeout_seconds=2.0)
    except (OSError, ValueError, api.ApiError):
        return None
    version = document.get("version") if isinstance(document, dict) else None
    return version if isinstance(version, str) else None


def _check_rules_dirs_exist(path: Path, missing: Sequence[Path], *, from_config: bool) -> None:
    """A rules directory named that does not exist is a typo the daemon would run with, without its
    rules: an error. Only the default directory for the admin's overrides may be absent."""
    from agent.config import parse_yaml, read_trusted_text
    from agent.config_errors import ConfigError, ConfigProblem
    from agent.defaults import DEFAULT_RULES_DIR

    wrong = [d for d in missing if str(d) != DEFAULT_RULES_DIR]
    if not wrong:
        return
    lines = parse_yaml(read_trusted_text(path), str(path))[1] if from_config else {}
    problems = []
    for directory in wrong:
        line = lines.get(("remediation", "rules_dirs")) or lines.get(("remediation", "rules_dir"))
        where = "remediation.rules_dirs" if from_config else "--rules"
        message = f"{directory}: no such directory (a typo? the daemon would run without these rules)"
        problems.append(ConfigProblem(str(path), line, where, message))
    raise ConfigError(problems)


def _check_steps(rules: Sequence[Rule]) -> None:
    """What each step's kind can check now rather than at 3 a.m. when a fault needs it (the hooks the
    rules would run are trusted programs)."""
    from agent.config_errors import ConfigError, ConfigProblem

    problems: list[ConfigProblem] = []
    for rule in rules:
        file, _, line = rule.source.rpartition(":")
        for ladder, position, step in rule.placed_steps():
            for field, problem in step.action.problems(step.spec().options):
                where = f"rule {rule.name}: {ladder}[{position}].{step.kind}.{field}"
                problems.append(ConfigProblem(file, int(line) if line.isdigit() else None, where, problem))
    if problems:
        raise ConfigError(problems)


def _check_drain_hooks(config: AgentConfig, file: str) -> None:
    """The services' drain hooks, checked as the rules' hooks are: refused now, not mid-restart."""
    from agent.config_errors import ConfigError, ConfigProblem
    from agent.trust import executable_problem

    problems: list[ConfigProblem] = []
    for position, service in enumerate(config.services):
        if service.drain is not None:
            problem = executable_problem(service.drain.hook[0])
            if problem is not None:
                problems.append(ConfigProblem(file, None, f"services[{position}].drain.hook[0]", problem))
    if problems:
        raise ConfigError(problems)
