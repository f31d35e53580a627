"""Occurrence keys for condition events, stable across agent restarts.

Watchers key a condition by what it is ("gpu_lost:GPU-...", "service_unhealthy:sglang"). A
condition still present when the agent restarts is reported again at the first look; it must map
to the same stored event, or rules would act on it twice. A condition that cleared and came back
is a new fault and must get a new key. So each condition key carries an episode number, bumped
when its clearing event arrives (GPU_RECOVERED ends GPU_LOST, ...), and kept in `state_dir`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import replace
from pathlib import Path

from agent.events import CLEARS, Event
from agent.host import file_reads, safe_json

FILE_NAME = "episodes.json"
_CONDITIONS = frozenset(kind for kinds in CLEARS.values() for kind in kinds)
# One number per condition key; far more than any node has.
_FILE_LIMIT_BYTES = 4 * 1024 * 1024


class Episodes:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self._lock = threading.Lock()
        self._numbers: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            loaded = safe_json.loads(file_reads.read_text(self.path, _FILE_LIMIT_BYTES))
            if isinstance(loaded, dict):
                self._numbers = {str(k): int(v) for k, v in loaded.items()}

    def keyed(self, event: Event) -> Event:
        """The event with its occurrence key; a clearing event also closes the episodes it ends."""
        cleared = CLEARS.get(event.kind)
        if cleared is None and event.kind not in _CONDITIONS:
            return event  # keys that already name one occurrence (Xids carry their time, ECC its counter)
        subject = event.key.partition(":")[2]
        with self._lock:
            if cleared is None:
                number = self._numbers.get(event.key, 0)
            else:
                conditions = [f"{kind.value}:{subject}" for kind in cleared]
                # A clearing event is keyed by the episode it ends: every recovery of a flapping
                # service is its own stored event, not a duplicate of the first one.
                number = max(self._numbers.get(condition, 0) for condition in conditions)
                for condition in conditions:
                    self._numbers[condition] = self._numbers.get(condition, 0) + 1
                self._save()
        return replace(event, key=f"{event.key}#{number}")

    def _save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(self._numbers, sort_keys=True))
            os.replace(tmp, self.path)
