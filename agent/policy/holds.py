"""The ledger of GPU settings a job drives outside the policy loop (a `gpu-agent tune` sweep, a GPU
reset), and the one place that puts them back (agent.policy.transaction).

While a job holds a setting, the engine still plans it, so `plan` and `status` show the difference,
but never writes it: the policy loop does not fight the job. A hold names its owner and why, and
whether its job still runs (`Hold.live`): a setting a running job holds is `held`, not drift; a hold
that outlives its job (recovery found no GPU backend to put a killed run's originals back with)
is drift again, naming the owner, and so needs an operator.

`begin` starts a job's transaction: it takes the hold, reads the originals (an original a job
before it could not put back is the original still: a half-done step is never read as one) and
journals them in the store before the job may change anything. `run` runs a whole job inside one
and tells the job how it ended, whatever it raised. `end_conflicting` (a reload that takes the
write away or removes what the job measures) and `end_all` (the agent stopping) put originals back
from outside, while the write guard still allows it. `recover`, at start, puts back what a killed
run left journaled, before the policy loop may touch those settings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent.backend.base import GpuBackend
from agent.config import AgentConfig
from agent.logs import get_logger
from agent.policy.transaction import (
    SETTINGS,
    Ending,
    HardwareTransaction,
    JobStop,
    SettingKey,
    SettingValue,
    TransactionError,
    not_restored,
    originals_from_json,
    originals_to_json,
    put_back,
    retried,
)

log = get_logger()

#: How long recovery waits for the GPU backend to open after a start before it gives up for this run.
RECOVERY_BACKEND_WAIT_SECONDS = 120.0


@dataclass(frozen=True)
class Hold:
    """Who holds a setting off the policy loop, why, and whether that job still runs."""

    owner: str  # "tune-3"
    reason: str  # "tune sweep 3 drives it"
    live: bool  # False: the job is gone and the hold stayed (what it changed was not put back)


class HoldRecord(Protocol):
    """A journaled hold, as the store gives it back (agent.store.holds.HoldRow)."""

    @property
    def row_id(self) -> int: ...
    @property
    def owner(self) -> str: ...
    @property
    def boot_id(self) -> str: ...
    @property
    def originals(self) -> list[dict[str, Any]]: ...


class HoldJournal(Protocol):
    """Where holds are written down before the first change (agent.store: the `gpu_holds` table)."""

    def begin_hold(self, owner: str, boot_id: str, started_seconds: float, originals: list[dict[str, Any]]) -> int: ...
    def end_hold(self, row_id: int, finished_seconds: float, detail: str) -> None: ...
    def open_holds(self) -> Sequence[HoldRecord]: ...


class HeldJob(Protocol):
    """A job `PolicyHolds.run` runs inside a transaction."""

    owner: str  # unique while it runs: "tune-3"
    reason: str  # why the settings are held, as `plan` shows it: "tune sweep 3 drives it"
    keys: tuple[SettingKey, ...]  # the settings it may change

    def body(self, transaction: HardwareTransaction) -> None: ...
    def ended(self, ending: Ending) -> None: ...
    def abort(self, reason: str) -> None: ...
    def conflict(self, config: AgentConfig) -> str | None: ...


class PolicyHolds:
    """The ledger (see the module docstring). `journal` gives the store (None while it is
    unavailable: then no transaction begins); a ledger built without one journals nothing
    (one-shot commands, tests)."""

    def __init__(
        self,
        journal: Callable[[], HoldJournal | None] | None = None,
        boot_id: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._journal = journal
        self.boot_id = boot_id
        self.clock = clock
        self._lock = threading.Lock()
        self._held: dict[SettingKey, tuple[str, str]] = {}  # (owner, reason)
        self._live: set[str] = set()  # owners whose job runs now (or is queued: recovery)
        self._active: list[HardwareTransaction] = []
        # Originals a transaction could not put back: the original still, for the next job.
        self._unrestored: dict[SettingKey, SettingValue] = {}
        self._recovering: set[str] = set()  # owners whose journaled originals recovery puts back
        self._recovered: list[Callable[[str, str], None]] = []

    # -- what the policy engine asks ---------------------------------------------------------------

    def held(self, item: str, gpu: int | None) -> str | None:
        """Why `item` on `gpu` is held, or None when the policy may write it."""
        hold = self.hold(item, gpu)
        return None if hold is None else hold.reason

    def hold(self, item: str, gpu: int | None) -> Hold | None:
        """The hold on `item` of `gpu`, or None when the policy may write it."""
        if gpu is None:
            return None
        with self._lock:
            found = self._held.get((item, gpu))
            return None if found is None else Hold(found[0], found[1], found[0] in self._live)

    def active(self) -> list[HardwareTransaction]:
        with self._lock:
            return list(self._active)

    # -- transactions ------------------------------------------------------------------------------

    def begin(
        self,
        owner: str,
        reason: str,
        backend: GpuBackend,
        keys: Iterable[SettingKey],
        *,
        abort: Callable[[str], None] = lambda _reason: None,
        conflict: Callable[[AgentConfig], str | None] | None = None,
        required: bool = True,
    ) -> HardwareTransaction:
        """Hold `keys`, read and journal their originals, and return the open transaction;
        TransactionError when it cannot begin (nothing changed then). Without `required`, a setting
        whose original cannot be read is left out (named in `unread`) instead."""
        wanted = list(dict.fromkeys(keys))
        with self._lock:
            taken = [key for key in wanted if key in self._held]
            if taken:
                item, gpu = taken[0]
                raise TransactionError(f"{item} of GPU {gpu} is held: {self._held[taken[0]][1]}")
            for key in wanted:
                self._held[key] = (owner, reason)
            self._live.add(owner)
        try:
            originals, unread = self._originals(backend, wanted, required)
            row = self._journal_begin(owner, originals)
        except BaseException:
            self._release(wanted)
            with self._lock:
                self._live.discard(owner)
            raise
        self._release([key for key in wanted if key not in originals])
        transaction = HardwareTransaction(owner, backend, originals, abort, self._closed, conflict)
        transaction.unread = unread
        transaction.journal_row = row
        with self._lock:
            self._active.append(transaction)
        return transaction

    def run(self, job: HeldJob, backend: GpuBackend | None) -> None:
        """Run `job.body` inside a transaction on its keys, then tell `job.ended` how it ended, with
        what was put back: whatever the body raised, and whatever `ended` raises. Never raises."""
        error: Exception | None = None
        restored: tuple[str, ...] = ()
        try:
            if backend is None:
                raise JobStop("failed", "GPU backend unavailable")
            try:
                transaction = self.begin(
                    job.owner, job.reason, backend, job.keys, abort=job.abort, conflict=job.conflict
                )
            except TransactionError as exc:
                raise JobStop("failed", str(exc)) from exc
            try:
                job.body(transaction)
            finally:
                restored = transaction.close()
        except Exception as exc:  # any type: the originals are back, the job hears how it ended
            error = exc
            if not isinstance(exc, JobStop):
                log.exception("job failed", owner=job.owner)
        try:
            job.ended(Ending(error, restored))
        except Exception:
            log.exception("could not record the end of a job", owner=job.owner)

    def end_conflicting(self, config: AgentConfig) -> list[str]:
        """Before a reload switches to `config`: end every transaction `config` would not let go on
        (an item no longer writable, or what its job says), putting its originals back now, under
        the write guard that allowed the change. What was ended and why, one line each."""
        writable = config.writable_items()
        ended = []
        for transaction in self.active():
            why = [f"{item} is no longer in enforce mode" for item in sorted(transaction.items - writable)]
            conflict = transaction.conflict(config) if transaction.conflict is not None else None
            reasons = "; ".join([*why, *([conflict] if conflict else [])])
            if reasons:
                restored = transaction.end(f"the config was reloaded: {reasons}")
                ended.append(f"{transaction.owner} ended ({reasons}); restored: {', '.join(restored) or 'nothing'}")
        for line in ended:
            log.warning("job ended by a reload", detail=line)
        return ended

    def end_all(self, reason: str) -> None:
        """End every transaction still open (the agent stopping), originals back now."""
        for transaction in self.active():
            transaction.end(reason)

    def _originals(
        self, backend: GpuBackend, keys: list[SettingKey], required: bool
    ) -> tuple[dict[SettingKey, SettingValue], list[str]]:
        originals: dict[SettingKey, SettingValue] = {}
        unread: list[str] = []
        for key in keys:
            item, gpu = key
            with self._lock:
                if key in self._unrestored:
                    originals[key] = self._unrestored[key]
                    continue
            read: list[SettingValue] = []
            setting = SETTINGS[item]
            failure = retried(lambda: read.append(setting.read(backend, gpu)))  # noqa: B023  # called at once
            if failure is None:
                originals[key] = read[0]
            elif required:  # a reading of any type: this job cannot know what to put back
                raise TransactionError(f"cannot read the {item} of GPU {gpu} to put it back later: {failure}")
            else:
                unread.append(f"{item} of GPU {gpu} (unreadable: {failure})")
        return originals, unread

    def _journal_begin(self, owner: str, originals: dict[SettingKey, SettingValue]) -> int | None:
        if self._journal is None:
            return None
        journal = self._journal()
        if journal is None:
            raise TransactionError("the state database is unavailable: a GPU setting is never changed unjournaled")
        try:
            return journal.begin_hold(owner, self.boot_id, self.clock(), originals_to_json(originals))
        except Exception as exc:  # the store's error: nothing is changed unjournaled
            raise TransactionError(f"cannot journal the settings to put back: {exc}") from exc

    def _closed(self, transaction: HardwareTransaction, restored: tuple[str, ...]) -> None:
        """A transaction put its originals back: journal it, remember what did not go back, let go."""
        with self._lock:
            if transaction in self._active:
                self._active.remove(transaction)
            for key in transaction.originals:
                if key in transaction.failed:
                    self._unrestored[key] = transaction.originals[key]
                else:
                    self._unrestored.pop(key, None)
        self._journal_end(transaction.journal_row, f"restored: {', '.join(restored) or 'nothing changed'}")
        self._release(transaction.originals)
        with self._lock:
            self._live.discard(transaction.owner)
        if transaction.failed:
            log.error("GPU settings not put back", owner=transaction.owner, detail=not_restored(restored))

    def _journal_end(self, row: int | None, detail: str) -> None:
        journal = self._journal() if self._journal is not None and row is not None else None
        if journal is None or row is None:
            return
        failure = retried(lambda: journal.end_hold(row, self.clock(), detail))
        if failure is not None:  # still open in the journal: the next start puts the same originals back
            log.error("could not journal the end of a hold", error=str(failure), row=row)

    def _release(self, keys: Iterable[SettingKey]) -> None:
        with self._lock:
            for key in keys:
                self._held.pop(key, None)

    # -- recovery at start ---------------------------------------------------------------------------

    def on_recovered(self, listener: Callable[[str, str], None]) -> None:
        """`listener(owner, what was done)` once recovery has dealt with a hold `owner` left."""
        self._recovered.append(listener)

    def recovering(self, owner: str) -> bool:
        with self._lock:
            return owner in self._recovering

    def recover(self, backend: Callable[[], GpuBackend | None]) -> RecoveryTask | None:
        """Hold what an earlier run left journaled (before the first loop) and return the task that
        puts it back once the backend opens; None when nothing was left."""
        journal = self._journal() if self._journal is not None else None
        if journal is None:
            return None
        try:
            rows = list(journal.open_holds())
        except Exception as exc:  # the store's error: logged, and tried again at the next start
            log.error("cannot read the held GPU settings: what an earlier run left is not put back", error=str(exc))
            return None
        if not rows:
            return None
        with self._lock:
            for row in rows:
                self._recovering.add(row.owner)
                self._live.add(row.owner)  # the recovery task is its job now
                for key in originals_from_json(row.originals):
                    self._held[key] = (row.owner, f"{row.owner} left it changed; being put back")
        return RecoveryTask(self, rows, backend)

    def recovery_ended(self, rows: Iterable[HoldRecord]) -> None:
        """The recovery task is over: a hold it could not put back outlives its job from now on."""
        with self._lock:
            for row in rows:
                self._live.discard(row.owner)

    def recover_row(self, backend: GpuBackend, row: HoldRecord) -> None:
        originals = originals_from_json(row.originals)
        if row.boot_id and self.boot_id and row.boot_id != self.boot_id:
            detail = "not put back: the node rebooted since, and a boot starts every GPU at its defaults"
        else:
            lines, failed = put_back(backend, originals)
            detail = f"restored at start: {', '.join(lines) or 'nothing changed'}"
            with self._lock:  # still the originals for the next job on them
                self._unrestored.update({key: originals[key] for key in failed})
        log.warning("held GPU settings an earlier run left recovered", owner=row.owner, detail=detail)
        self._journal_end(row.row_id, detail)
        self._release(originals)
        with self._lock:
            self._recovering.discard(row.owner)
        for listener in self._recovered:
            try:
                listener(row.owner, detail)
            except Exception:
                log.exception("a recovery listener failed", owner=row.owner)


class RecoveryTask:
    """Puts back what an earlier run left held (kill -9, a crash), once the GPU backend opens: a
    task on the action worker's lane of those GPUs."""

    def __init__(self, holds: PolicyHolds, rows: list[HoldRecord], backend: Callable[[], GpuBackend | None]) -> None:
        self.holds = holds
        self.rows = rows
        self.backend = backend
        self.name = "recovery of held GPU settings"
        self.gpus: frozenset[int] | None = frozenset(
            gpu for row in rows for _item, gpu in originals_from_json(row.originals)
        )
        self._aborted = threading.Event()

    def abort(self, reason: str) -> None:
        self._aborted.set()

    def run(self) -> None:
        try:
            self._recover()
        finally:
            self.holds.recovery_ended(self.rows)

    def _recover(self) -> None:
        deadline = time.monotonic() + RECOVERY_BACKEND_WAIT_SECONDS
        backend = self.backend()
        while backend is None and time.monotonic() < deadline and not self._aborted.wait(0.2):
            backend = self.backend()
        if backend is None:
            # Left journaled: the next start tries again; the hold keeps the policy loop off meanwhile,
            # and the plan shows it as drift, naming the owner (a hold that outlived its job).
            log.error("no GPU backend: the held settings an earlier run left are put back later")
            return
        for row in self.rows:
            self.holds.recover_row(backend, row)
