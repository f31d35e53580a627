"""gpu-agent: keeps a GPU inference node in its declared state, watches it, repairs what it safely can."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # Looked up when first asked for: in a git checkout the version comes from git (agent/version.py).
    if name == "__version__":
        from agent.version import current

        return current().version
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
