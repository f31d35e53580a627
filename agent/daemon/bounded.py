"""Time-bounded GPU work: a hung NVML call marks that GPU stale instead of freezing the daemon.

Each GPU gets one worker thread. Work for a GPU runs there and is waited on with a timeout; if
it does not return in time the caller gets `StaleGpu` at once, and until the hung call finally
returns every further request for that GPU is answered `StaleGpu` immediately, without queuing
behind it. So one stuck card costs one blocked thread, never the loop, the scrape or the watchdog.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")


class StaleGpu(Exception):
    def __init__(self, key: str, busy_seconds: float) -> None:
        super().__init__(f"{key}: a call has been hung for {busy_seconds:.1f} s")
        self.key = key
        self.busy_seconds = busy_seconds


class _Lane:
    """One daemon thread: a call hung in the driver must not keep the process from exiting."""

    def __init__(self, key: str) -> None:
        self.queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self.busy: Future[Any] | None = None
        self.busy_since = 0.0
        self.thread = threading.Thread(target=self._serve, name=f"gpu-agent-{key}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (item := self.queue.get()) is not None:
            work, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as exc:  # handed to the waiting caller, not swallowed
                future.set_exception(exc)

    def submit(self, work: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self.queue.put((work, future))
        return future


class BoundedRunner:
    """Runs callables on per-key lanes ("gpu0", "gpu1", "policy") with a timeout."""

    def __init__(self, timeout_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.Lock()

    def run(self, key: str, work: Callable[[], T], timeout_seconds: float | None = None) -> T:
        return self.result(key, self.submit(key, work), timeout_seconds)

    def submit(self, key: str, work: Callable[[], T]) -> Future[T]:
        """Start `work` on the key's lane without waiting; StaleGpu at once while the lane is hung.
        Lets the caller start every GPU's work first and then wait on all of them against one deadline."""
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane(key)
            if lane.busy is not None and not lane.busy.done():
                raise StaleGpu(key, self._clock() - lane.busy_since)
            future = lane.submit(work)
            lane.busy = future
            lane.busy_since = self._clock()
        return future

    def result(self, key: str, future: Future[T], timeout_seconds: float | None = None) -> T:
        """What `submit` started, waited for at most the timeout (the runner's by default)."""
        started = self._clock()
        try:
            return future.result(timeout=self.timeout_seconds if timeout_seconds is None else timeout_seconds)
        except FutureTimeout:
            with self._lock:
                lane = self._lanes.get(key)
                since = lane.busy_since if lane is not None and lane.busy is future else started
            raise StaleGpu(key, self._clock() - since) from None

    def shutdown(self) -> None:
        """Let idle lanes end; never waits for a hung call."""
        with self._lock:
            for lane in self._lanes.values():
                lane.queue.put(None)
            self._lanes.clear()
