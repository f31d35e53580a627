"""What every command shares: the config a command runs with, the policy engine, the store, its output
and its one-line failure. Every import beyond the standard library is made where it is used: `status`
against a daemon, `--version` and `--help` load none of the heavy modules."""

from __future__ import annotations

import argparse
import os
import sys

from agent import TYPE_CHECKING
from agent.defaults import DEFAULT_CONFIG_PATH

if TYPE_CHECKING:  # the heavy modules (pydantic models, the policy engine) load only for commands that use them
    from agent.config import AgentConfig
    from agent.policy.engine import PolicyEngine
    from agent.store.database import Store

EXIT_OK = 0
EXIT_ERROR = 1


class CliError(Exception):
    """A failure worth one clear line on stderr and exit 1, never a traceback."""


def config_path(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(path, explicit). Without --config or $GPU_AGENT_CONFIG, the default file if it exists.
    (A string: pathlib is a tenth of `status`'s start against a daemon.)"""
    given = args.config or os.environ.get("GPU_AGENT_CONFIG")
    if given:
        return str(given), True
    return (DEFAULT_CONFIG_PATH, False) if os.path.exists(DEFAULT_CONFIG_PATH) else (None, False)


def load(args: argparse.Namespace) -> AgentConfig:
    from agent.config import AgentConfig
    from agent.policy.dropins import load_checked_config

    path, _ = config_path(args)
    if path is None:
        print(f"note: {DEFAULT_CONFIG_PATH} not found; using built-in defaults (observe mode, nvml)", file=sys.stderr)
        return AgentConfig()
    return load_checked_config(path)


def make_engine(config: AgentConfig) -> PolicyEngine:
    from agent.backend import open_backend
    from agent.host.paths import HostPaths
    from agent.policy.base import HostContext
    from agent.policy.engine import PolicyEngine

    backend = open_backend(config)
    return PolicyEngine(config, backend, HostContext(HostPaths.at(config.host_root)))


def open_store(config: AgentConfig) -> Store:
    from agent.store.database import Store, StoreError

    try:
        # The daemon alone puts a database from before a downgrade back: the CLI may run beside an
        # older daemon that still holds the current one.
        return Store.open(config.state_dir, reuse_newer=False)
    except StoreError as exc:
        raise CliError(str(exc)) from None


def print_text(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
