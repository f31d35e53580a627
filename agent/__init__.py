"""gpu-agent: keeps a GPU inference node in its declared state, watches it, repairs what it safely can."""

from __future__ import annotations

#: False when the agent runs, True to the type checker (mypy and ruff take any name `TYPE_CHECKING`
#: so). The modules of the fast start (agent/cli/fast_start.py) guard their imports made only for
#: annotations with it, `from agent import TYPE_CHECKING`, rather than import `typing`: typing alone
#: is a tenth of a bare interpreter's start, and this package is loaded before any of them anyway.
TYPE_CHECKING = False


def __getattr__(name: str) -> str:
    # Looked up when first asked for: in a git checkout the version comes from git (agent/version.py).
    if name == "__version__":
        from agent.version import current

        return current().version
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
