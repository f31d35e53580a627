"""The values shell completion offers that only the node knows, read when TAB is pressed through
`gpu-agent --complete-values KIND` (agent/cli/completion.py writes the scripts that ask). Nothing is
written: the store is opened read-only, and nothing heavy is imported until a value is asked for
(`--help` builds the option that offers them); with a daemon running the config, not even the config
models: its state_dir is the one the daemon published."""

from __future__ import annotations

import os

#: The KINDs `--complete-values` takes.
DYNAMIC_KINDS = ("ack-targets", "gpus")


def dynamic_values(kind: str, config_path: str | None = None) -> list[str]:
    """The values of KIND this node has (`gpu-agent --complete-values KIND`), from the store of
    the config at `config_path` ($GPU_AGENT_CONFIG, else the default), opened read-only; nothing
    when there is no config or store, or it cannot be read (completion never fails loudly).
      ack-targets  `all`, then the rules, `gpu:INDEX`, `gpu:UUID` and `service:NAME` whose
                   attempts ran out or circuit is open, the missing GPUs not acknowledged, and
                   `reboot` while a reboot is recommended
      gpus         the GPU indices the store has seen on this node"""
    import sqlite3

    from agent.defaults import DEFAULT_CONFIG_PATH, REBOOT_FLAG_NAME

    path = config_path or os.environ.get("GPU_AGENT_CONFIG") or DEFAULT_CONFIG_PATH
    state_dir = _state_dir(path)
    if state_dir is None:
        return []
    database = os.path.join(state_dir, "gpu-agent.db")
    # A URI's own characters escaped (SQLite reads the rest of a file: URI as it is).
    uri = "file:" + database.replace("%", "%25").replace("?", "%3f").replace("#", "%23") + "?mode=ro"
    try:
        if not os.path.isfile(database):
            return []
        connection = sqlite3.connect(uri, uri=True, timeout=1)
    except (OSError, sqlite3.Error, ValueError):
        return []
    try:
        if kind == "gpus":
            rows = connection.execute("SELECT DISTINCT gpu FROM gpu_inventory WHERE gpu >= 0 ORDER BY gpu").fetchall()
            return [str(row[0]) for row in rows]
        owed = "SELECT rule, gpu, uuid, service FROM circuits UNION SELECT rule, gpu, uuid, service FROM remediations"
        owed += " WHERE counted = 1 AND acked = 0"
        found: dict[str, None] = {"all": None}
        for rule, gpu, uuid, service in connection.execute(owed).fetchall():
            found[str(rule)] = None
            for value in (
                f"gpu:{gpu}" if gpu is not None else None,
                uuid and f"gpu:{uuid}",
                service and f"service:{service}",
            ):
                if value:
                    found[value] = None
        missing = "SELECT DISTINCT gpu, uuid FROM gpu_inventory WHERE present = 0 AND acked = 0"
        for gpu, uuid in connection.execute(missing).fetchall():
            found[f"gpu:{gpu}"] = None
            found[f"gpu:{uuid}"] = None
        if os.path.isfile(os.path.join(state_dir, REBOOT_FLAG_NAME)):
            found["reboot"] = None
        return list(found)
    except sqlite3.Error:
        return []
    finally:
        connection.close()


def _state_dir(config_path: str) -> str | None:
    """The state_dir of the daemon running the config at `config_path`, as it published it (no config
    read: agent/api.py `read_published`), else the config's; None when the config cannot be read."""
    from agent.api import read_published

    published = read_published(config_path)
    if published is not None:
        return published.state_dir
    from pathlib import Path

    from agent.config import load_config
    from agent.config_errors import ConfigError

    try:
        return load_config(Path(config_path)).state_dir
    except (ConfigError, OSError, ValueError):
        return None
