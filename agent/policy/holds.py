"""Policy items on GPUs that something else drives for a while (a `gpu-agent tune` sweep): the
engine still plans them, so `plan` and `status` show the difference, but never writes them, so the
policy loop does not fight the one holding them. A hold names its owner and why."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class PolicyHolds:
    def __init__(self) -> None:
        self._held: dict[tuple[str, int], str] = {}
        self._owners: dict[str, set[tuple[str, int]]] = {}
        self._lock = threading.Lock()

    def hold(self, owner: str, keys: Iterable[tuple[str, int]], reason: str) -> None:
        """Hold each (item, GPU) for `owner` until `release(owner)`."""
        with self._lock:
            for key in keys:
                self._held[key] = reason
                self._owners.setdefault(owner, set()).add(key)

    def release(self, owner: str) -> None:
        with self._lock:
            for key in self._owners.pop(owner, set()):
                self._held.pop(key, None)

    def held(self, item: str, gpu: int | None) -> str | None:
        """Why `item` on `gpu` is held, or None when the policy may write it."""
        if gpu is None:
            return None
        with self._lock:
            return self._held.get((item, gpu))
