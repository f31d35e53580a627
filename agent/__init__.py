"""gpu-agent: keeps a GPU inference node in its declared state, watches it, repairs what it safely can."""

__version__ = "0.1.0"
