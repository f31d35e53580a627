"""The action worker: decided actions run one after another in their own thread (a GPU reset can
take a minute; the loop must not wait for it), and until one has finished it counts as an attempt."""

from __future__ import annotations

import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

import structlog

from agent.rules.actions import ActionContext, execute
from agent.rules.model import ActionOutcome, Decision, Outcome
from agent.store import Store

log = structlog.get_logger("gpu-agent")


class ActionWorker:
    def __init__(
        self,
        context: Callable[[], ActionContext | None],
        record: Callable[[ActionOutcome], None],
        on_reset: Callable[[int], None],
        clock: Callable[[], float],
    ) -> None:
        self.context = context  # None while the GPU backend is unavailable
        self.record = record
        self.on_reset = on_reset  # a GPU reset succeeded: its Xid history starts afresh
        self.clock = clock
        self.queue: SimpleQueue[Decision | None] = SimpleQueue()
        self._inflight: list[tuple[Decision, float]] = []  # queued or running: counted as attempts
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, decision: Decision, now: float) -> None:
        with self._lock:
            self._inflight.append((decision, now))
        self.queue.put(decision)

    def history(self, store: Store) -> InflightHistory:
        with self._lock:
            return InflightHistory(store, list(self._inflight))

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="actions", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """An action still running (a reset) past the timeout is left to finish in its daemon thread."""
        self.queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def run(self) -> None:
        while (decision := self.queue.get()) is not None:
            started = self.clock()
            context = self.context()
            if context is None:
                outcome = ActionOutcome(decision, Outcome.FAILED, "GPU backend unavailable", started, self.clock())
            else:
                outcome = execute(decision, context)
            self.record(outcome)
            with self._lock:
                self._inflight = [(d, t) for d, t in self._inflight if d is not decision]
            log.info(
                "action finished",
                rule=decision.rule,
                action=decision.action.kind.value if decision.action else None,
                outcome=outcome.outcome.value,
                detail=outcome.detail,
                seconds=round(outcome.finished_seconds - outcome.started_seconds, 3),
                **target_fields(decision),
            )
            action = decision.action
            reset_done = action is not None and action.kind.value == "reset_gpu" and outcome.outcome is Outcome.SUCCESS
            if reset_done and decision.target.gpu is not None:
                self.on_reset(decision.target.gpu)


class InflightHistory:
    """The store's attempt history plus actions queued or running, so the next loop's evaluation
    counts an action from the moment it is decided, not only once it has finished."""

    def __init__(self, store: Store, inflight: list[tuple[Decision, float]]) -> None:
        self._store = store
        self._inflight = inflight

    def _mine(self, rule: str, target_key: str) -> list[float]:
        return [t for d, t in self._inflight if d.rule == rule and d.target.key == target_key]

    def attempts(self, rule: str, target_key: str, since_seconds: float) -> list[float]:
        extra = [t for t in self._mine(rule, target_key) if t >= since_seconds]
        return sorted(self._store.attempts(rule, target_key, since_seconds) + extra)

    def last_attempt(self, rule: str, target_key: str) -> float | None:
        times = self._mine(rule, target_key)
        stored = self._store.last_attempt(rule, target_key)
        if stored is not None:
            times.append(stored)
        return max(times) if times else None

    def circuit_open(self, rule: str, target_key: str) -> bool:
        return self._store.circuit_open(rule, target_key)

    def handled(self, event_key: str) -> bool:
        return self._store.handled(event_key)


def target_fields(decision: Decision) -> dict[str, Any]:
    fields: dict[str, Any] = {"gpu": decision.target.gpu, "gpu_uuid": decision.target.uuid}
    if decision.target.service:
        fields["service"] = decision.target.service
    if "xid" in decision.event.data:
        fields["xid"] = decision.event.data["xid"]
    return fields
