"""Logging: the agent's logger, which every module that logs takes at import (`log = get_logger()`),
and (agent/logs/destinations.py) where its lines go: the journal, JSON lines or the console.

structlog, and asyncio with it, loads on the first line logged: a large part of a direct
`gpu-agent status`, which logs nothing. So this module imports only the standard library, and
agent/logs/destinations.py, which imports structlog, is imported only to configure the output: a
configuration asked for before structlog has loaded (`configure_when_used`) is applied just before
the first line."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from agent import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

_lock = threading.Lock()
_pending: Callable[[], None] | None = None


def configure_when_used(configure: Callable[[], None]) -> None:
    """Run `configure` (a structlog configuration) before the first line is logged: now when
    structlog is already loaded, else when a logger is first used."""
    global _pending
    with _lock:
        if "structlog" in sys.modules:
            _pending = None
            configure()
        else:
            _pending = configure


def _structlog_logger(name: str) -> Any:
    global _pending
    with _lock:
        import structlog

        configure, _pending = _pending, None
        if configure is not None:
            configure()
        return structlog.get_logger(name)


class _Logger:
    """structlog's logger `name`, loaded when a method is first looked up."""

    __slots__ = ("_loaded", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._loaded: Any = None

    def __getattr__(self, method: str) -> Any:
        loaded = self._loaded
        if loaded is None:
            loaded = self._loaded = _structlog_logger(self._name)
        return getattr(loaded, method)


def get_logger(name: str = "gpu-agent") -> Any:
    """The logger every module logs through (structlog's, loaded on first use)."""
    return _Logger(name)


def log_to_stderr_when_used() -> None:
    """One-shot commands: agent/logs/destinations.py's `configure_cli_logging` (warnings and worse, to
    stderr, never into the answer on stdout), applied when a line is first logged."""

    def configure() -> None:
        from agent.logs.destinations import configure_cli_logging

        configure_cli_logging()

    configure_when_used(configure)
