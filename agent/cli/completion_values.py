"""The values shell completion offers that only the node knows, read when TAB is pressed through
`gpu-agent --complete-values KIND` (agent/cli/completion.py writes the scripts that ask). Nothing is
written: the store is opened read-only, and nothing heavy is imported until a value is asked for
(`--help` builds the option that offers them)."""

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
    from pathlib import Path

    from agent.config import load_config
    from agent.config_errors import ConfigError
    from agent.defaults import DEFAULT_CONFIG_PATH, REBOOT_FLAG_NAME

    path = config_path or os.environ.get("GPU_AGENT_CONFIG") or DEFAULT_CONFIG_PATH
    try:
        database = Path(load_config(Path(path)).state_dir) / "gpu-agent.db"
        if not database.is_file():
            return []
        connection = sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True, timeout=1)
    except (ConfigError, OSError, sqlite3.Error, ValueError):
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
        if (database.parent / REBOOT_FLAG_NAME).is_file():
            found["reboot"] = None
        return list(found)
    except sqlite3.Error:
        return []
    finally:
        connection.close()
