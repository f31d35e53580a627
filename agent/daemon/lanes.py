"""The action worker's lanes: no job waits for another that touches nothing it touches.

A job that changes nothing on the node (an alert, a webhook, a reboot recommendation: lane
`notify`) runs on the notify lane, one after another in the order decided, whatever else runs. A
job that changes the node (a restart, a reset, a reboot, a hook, a tune sweep, a recovery) names
its footprint, the GPUs it touches (None: the whole node), and runs on a thread of its own as soon
as no running job and no earlier waiting job overlaps it: two jobs on the same GPU run in the order
they came, a restart on GPU 1 never waits for a sweep on GPU 0.

A task (`submit_task`: a tune sweep, a recovery) is a node job that is no rule's action: it
journals itself, and gives up where it safely can once asked (`abort`). The lanes are one of the
daemon's live parts (agent/daemon/live.py): the action worker puts its remediations on them, the
advisor its sweeps, and both ask `busy`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from queue import SimpleQueue
from typing import Protocol

from agent.logs import get_logger
from agent.rules.actions.kind import Footprint, Lane

log = get_logger()


def overlaps(a: Footprint, b: Footprint) -> bool:
    """Whether two footprints share a GPU (the whole node, None, overlaps everything)."""
    return a is None or b is None or bool(a & b)


class Task(Protocol):
    """A job that is no rule's action (a tune sweep, a recovery): it journals itself, and gives up
    where it safely can, putting back what it changed, once `abort` is called. `gpus`: what it
    touches (None: the whole node)."""

    name: str
    gpus: frozenset[int] | None

    def run(self) -> None: ...
    def abort(self, reason: str) -> None: ...


@dataclass(eq=False)
class LaneJob:
    """One job: what it is (`name`, for `busy` and the logs), its lane and footprint, and its work."""

    name: str
    lane: Lane
    footprint: Footprint
    work: Callable[[], None]
    abort: Callable[[str], None] | None = None  # a task: asked to give up where it safely can
    started: threading.Event = field(default_factory=threading.Event)


class Lanes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiting: list[LaneJob] = []  # node jobs in the order they came
        self._running: list[LaneJob] = []  # node jobs running now, each on its own thread
        self._notify: SimpleQueue[LaneJob | None] = SimpleQueue()
        self._notifying: list[LaneJob] = []  # the notify lane's jobs queued or running
        self._started = False
        self._notify_thread: threading.Thread | None = None
        # Set once the agent is stopping: a job that starts now gives up at once (a task aborts, an
        # action is closed unstarted), and a running action sees it (its context's `cancel`).
        self.stopping = threading.Event()

    def start(self) -> None:
        self._notify_thread = threading.Thread(target=self._notify_loop, name="actions-notify", daemon=True)
        self._notify_thread.start()
        with self._lock:
            self._started = True
            self._dispatch()

    def put(self, job: LaneJob) -> None:
        with self._lock:
            if job.lane is Lane.NOTIFY:
                self._notifying.append(job)
                self._notify.put(job)
                return
            self._waiting.append(job)
            if self._started:
                self._dispatch()

    def submit_task(self, task: Task) -> None:
        """Queue a task behind whatever touches its GPUs."""
        self.put(LaneJob(task.name, Lane.NODE, task.gpus, partial(self._run_task, task), task.abort))

    def busy(self) -> str | None:
        """What runs or is queued on the node, or None when the node is quiet."""
        running = self.running()
        if running:
            return f"{running[0].name} is running"
        waiting = self.waiting()
        return f"{len(waiting)} job(s) are queued" if waiting else None

    def _run_task(self, task: Task) -> None:
        if self.stopping.is_set():
            task.abort("the agent is stopping")
        task.run()

    def running(self) -> list[LaneJob]:
        """The node jobs running now."""
        with self._lock:
            return list(self._running)

    def waiting(self) -> list[LaneJob]:
        """The node jobs waiting for one they overlap."""
        with self._lock:
            return list(self._waiting)

    def stop(self, timeout_seconds: float) -> list[LaneJob]:
        """Let every job queued so far run or be closed (the caller has told them the agent stops),
        waiting at most `timeout_seconds` in all; the jobs still running then."""
        self._notify.put(None)
        deadline = time.monotonic() + timeout_seconds
        with self._changed:
            while self._running or self._waiting or self._notifying:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return [job for job in (*self._running, *self._notifying) if job.started.is_set()]

    def _dispatch(self) -> None:
        """Start every waiting job that overlaps no running job and no job waiting before it (lock held)."""
        blocking = [job.footprint for job in self._running]
        for job in list(self._waiting):
            if any(overlaps(job.footprint, other) for other in blocking):
                blocking.append(job.footprint)  # the jobs after it that overlap it wait their turn
                continue
            self._waiting.remove(job)
            self._running.append(job)
            threading.Thread(target=self._run_node_job, args=(job,), name=f"action {job.name}", daemon=True).start()
            blocking.append(job.footprint)

    def _run_node_job(self, job: LaneJob) -> None:
        try:
            _run(job)
        finally:
            with self._changed:
                self._running.remove(job)
                self._dispatch()
                self._changed.notify_all()

    def _notify_loop(self) -> None:
        while (job := self._notify.get()) is not None:
            try:
                _run(job)
            finally:
                with self._changed:
                    self._notifying.remove(job)
                    self._changed.notify_all()


def _run(job: LaneJob) -> None:
    job.started.set()
    try:
        job.work()
    except Exception:  # one job's bug must not end its lane: the jobs behind it still run
        log.exception("action worker job failed", job=job.name)
