"""What `gpu-agent restore` needs when the config on disk no longer validates: the daemon records,
in its state dir, the backend of the last config it ran (a known-good one) and the items it may
have changed and not handed back. `restore` then works from that record (or, without one, from
NVML with the defaults) and restores those items, plus fans and locked clocks, on every GPU the
backend sees.

The state dir of a config that does not parse is found by a plain line match (`state_dir: ...`),
never by parsing the file: a YAML bomb must not stop the one command that hands the fans back.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from agent.config import AgentConfig, Mode, SimulatedConfig
from agent.host import file_reads, safe_json
from agent.logs import get_logger
from agent.names.policy_items import FAN_CURVE, LOCKED_CLOCKS

log = get_logger()

RECORD_NAME = "known-good.json"
#: Always restored by a fallback restore: a fan left manual or clocks left locked are what hurts.
FALLBACK_ITEMS = frozenset({FAN_CURVE, LOCKED_CLOCKS})
_MAX_CONFIG_BYTES = 1 << 20
_RECORD_LIMIT_BYTES = 1 << 20
_STATE_DIR_LINE = re.compile(r"^state_dir:\s*['\"]?([^'\"#\s]+)['\"]?\s*(?:#.*)?$", re.MULTILINE)


def record(config: AgentConfig, items: Collection[str]) -> None:
    """Write the record (atomically, 0600); a failure is logged, never fatal."""
    document = {
        "backend": config.backend,
        "simulated": config.simulated.model_dump(mode="json"),
        "host_root": config.host_root,
        "state_dir": config.state_dir,
        "items": sorted(items),
    }
    directory = Path(config.state_dir)
    temporary = directory / f".{RECORD_NAME}.{os.getpid()}"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(document, file)
        os.replace(temporary, directory / RECORD_NAME)
    except OSError as exc:
        log.warning("could not record the known-good backend for gpu-agent restore", error=str(exc))


def recorded_items(state_dir: str | Path) -> frozenset[str]:
    document = _read(Path(state_dir))
    items = document.get("items") if document else None
    return frozenset(str(i) for i in items) if isinstance(items, list) else frozenset()


def _read(state_dir: Path) -> dict[str, Any] | None:
    try:
        document = safe_json.loads(file_reads.read_text(state_dir / RECORD_NAME, _RECORD_LIMIT_BYTES))
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def state_dir_of(config_path: Path | None) -> str:
    """The `state_dir:` line of a config that may not parse, else the default."""
    default = AgentConfig.model_fields["state_dir"].default
    if config_path is None:
        return str(default)
    try:
        with open(config_path, "rb") as file:
            text = file.read(_MAX_CONFIG_BYTES).decode("utf-8", "replace")
    except OSError:
        return str(default)
    found = _STATE_DIR_LINE.search(text)
    return found.group(1) if found else str(default)


def restore_config(base: AgentConfig, items: Collection[str]) -> AgentConfig:
    """`base`'s backend with exactly `items` writable (nothing else, no GPU reset)."""
    policy = base.policy.model_copy(update={"modes": dict.fromkeys(items, Mode.ENFORCE)})
    return base.model_copy(update={"mode": Mode.OBSERVE, "policy": policy})


def fallback_config(config_path: Path | None) -> tuple[AgentConfig, str]:
    """For a config that does not validate: the recorded known-good backend, or NVML with the
    defaults, with the recorded items plus fans and locked clocks writable; and what it came from."""
    state_dir = state_dir_of(config_path)
    document = _read(Path(state_dir))
    items = FALLBACK_ITEMS | recorded_items(state_dir)
    if document is None:
        return restore_config(AgentConfig(state_dir=state_dir), items), f"no {RECORD_NAME} in {state_dir}: nvml"
    try:
        base = AgentConfig(
            backend=document.get("backend", "nvml"),
            simulated=SimulatedConfig.model_validate(document.get("simulated", {})),
            host_root=str(document.get("host_root", "/")),
            state_dir=str(document.get("state_dir", state_dir)),
        )
    except ValueError as exc:
        log.warning("unusable known-good record; using nvml", error=str(exc))
        return restore_config(AgentConfig(state_dir=state_dir), items), f"unusable {RECORD_NAME}: nvml"
    return restore_config(base, items), f"the backend recorded in {Path(state_dir) / RECORD_NAME}"
