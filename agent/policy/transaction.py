"""A change to a GPU setting outside the policy loop, as a transaction.

A job that drives GPU settings for a while (a `gpu-agent tune` sweep's steps, a GPU reset) runs
inside a `HardwareTransaction`, begun by the ledger (agent.policy.holds): before the job may change
anything, the ledger holds the settings off the policy loop, reads their originals and journals
them. Every write the job makes goes through the transaction, and `close` puts back each setting
the job changed (a failed write is tried again), journals the end and lets the hold go.

`close` runs on every way out: the job's `with` block ends however it ends (whatever it raised),
the ledger ends the transaction from outside when a reload would take the write away or the agent
stops (`end`: the job is told to stop, the originals go back at once, under the write guard that
allowed the change), and the next start puts back what a killed run left (the journal). After
`close` the transaction refuses every write (`TransactionClosed`): a job still running can never
change a setting once its originals are back, and nobody reads a half-done step as an original.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from agent.backend.base import ClockDomain, GpuBackend
from agent.names.policy_items import LOCKED_CLOCKS, POWER_LIMIT

#: A setting's value: a power limit in watts, or a graphics clock lock (min, max MHz; None: unlocked).
SettingValue = float | tuple[int, int] | None
#: (policy item, GPU index): one setting of one GPU.
SettingKey = tuple[str, int]

#: How often a write that puts an original back is tried before it is reported as not restored.
RESTORE_ATTEMPTS = 3


class GpuSetting(Protocol):
    """One GPU setting a job may change and must put back, named by its policy item."""

    item: str

    def read(self, backend: GpuBackend, gpu: int) -> SettingValue: ...
    def write(self, backend: GpuBackend, gpu: int, value: SettingValue) -> None: ...
    def text(self, gpu: int, value: SettingValue) -> str: ...
    def from_json(self, value: Any) -> SettingValue: ...


class _PowerLimit:
    item: str = POWER_LIMIT

    def read(self, backend: GpuBackend, gpu: int) -> SettingValue:
        return backend.power_limit_watts(gpu)

    def write(self, backend: GpuBackend, gpu: int, value: SettingValue) -> None:
        if not isinstance(value, float | int):
            raise TypeError(f"a power limit is watts, not {value!r}")
        backend.set_power_limit_watts(gpu, float(value))

    def text(self, gpu: int, value: SettingValue) -> str:
        return f"GPU {gpu} power limit {value:g} W" if isinstance(value, float | int) else f"GPU {gpu} power limit"

    def from_json(self, value: Any) -> SettingValue:
        return float(value)


class _GraphicsLock:
    item: str = LOCKED_CLOCKS

    def read(self, backend: GpuBackend, gpu: int) -> SettingValue:
        return backend.locked_clocks_mhz(gpu, ClockDomain.GRAPHICS)

    def write(self, backend: GpuBackend, gpu: int, value: SettingValue) -> None:
        if value is None:
            backend.reset_locked_clocks(gpu, ClockDomain.GRAPHICS)
        elif isinstance(value, tuple):
            backend.set_locked_clocks_mhz(gpu, ClockDomain.GRAPHICS, value[0], value[1])
        else:
            raise TypeError(f"a clock lock is (min, max) MHz or None, not {value!r}")

    def text(self, gpu: int, value: SettingValue) -> str:
        if isinstance(value, tuple):
            return f"GPU {gpu} clocks locked {value[0]}-{value[1]} MHz"
        return f"GPU {gpu} clocks unlocked"

    def from_json(self, value: Any) -> SettingValue:
        return None if value is None else (int(value[0]), int(value[1]))


#: The settings a job may change outside the policy loop, by policy item.
SETTINGS: dict[str, GpuSetting] = {setting.item: setting for setting in (_PowerLimit(), _GraphicsLock())}


def originals_to_json(originals: Mapping[SettingKey, SettingValue]) -> list[dict[str, Any]]:
    return [
        {"item": item, "gpu": gpu, "value": list(value) if isinstance(value, tuple) else value}
        for (item, gpu), value in sorted(originals.items())
    ]


def originals_from_json(document: list[dict[str, Any]]) -> dict[SettingKey, SettingValue]:
    return {
        (str(entry["item"]), int(entry["gpu"])): SETTINGS[str(entry["item"])].from_json(entry["value"])
        for entry in document
    }


def retried(write: Callable[[], None], attempts: int = RESTORE_ATTEMPTS) -> Exception | None:
    """Run a write that ends a job (an original put back, the journal row closed) until it succeeds,
    at most `attempts` times; the last error (of any type) when it never did, else None."""
    failure: Exception | None = None
    for _attempt in range(attempts):
        try:
            write()
        except Exception as exc:  # any type: tried again, then reported by the caller
            failure = exc
            continue
        return None
    return failure


def put_back(backend: GpuBackend, originals: Mapping[SettingKey, SettingValue]) -> tuple[list[str], list[SettingKey]]:
    """Write every original back, each tried up to RESTORE_ATTEMPTS times: one line per setting
    saying what was put back or why it was NOT restored, and the settings that were not. Never
    raises: whatever a write raised, the other settings still go back."""
    lines: list[str] = []
    failed: list[SettingKey] = []
    for (item, gpu), value in sorted(originals.items()):
        setting = SETTINGS[item]
        failure = retried(partial(setting.write, backend, gpu, value))
        text = setting.text(gpu, value)
        if failure is None:
            lines.append(text)
        else:
            lines.append(f"{text} NOT restored: {failure}")
            failed.append((item, gpu))
    return lines, failed


def not_restored(lines: tuple[str, ...] | list[str]) -> list[str]:
    return [line for line in lines if " NOT restored: " in line]


class JobStop(Exception):
    """A job ends early on purpose: `state` (stopped, aborted, failed) and the reason, as the
    operator reads it."""

    def __init__(self, state: str, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


class TransactionClosed(JobStop):
    """A write after the transaction was closed from outside (a reload, the agent stopping)."""

    def __init__(self, reason: str) -> None:
        super().__init__("aborted", reason)


class TransactionError(Exception):
    """A transaction could not begin: an original unreadable, the journal unwritable, a setting
    another job holds. Nothing was changed."""


class HardwareTransaction:
    """See the module docstring. Built by the ledger (`PolicyHolds.begin`), never directly."""

    def __init__(
        self,
        owner: str,
        backend: GpuBackend,
        originals: dict[SettingKey, SettingValue],
        abort: Callable[[str], None],
        on_close: Callable[[HardwareTransaction, tuple[str, ...]], None],
        conflict: Callable[[Any], str | None] | None = None,
    ) -> None:
        self.owner = owner
        self.backend = backend
        self.originals = originals
        self.conflict = conflict  # why the job cannot go on under a new config (a reload), or None
        self.unread: list[str] = []  # settings left out: their originals could not be read
        self._abort = abort
        self._on_close = on_close
        self._lock = threading.Lock()  # a write and the restore never interleave
        self._changed: set[SettingKey] = set()
        self._closed_because: str | None = None
        self.restored: tuple[str, ...] | None = None  # what `close` put back; None while open
        self.failed: tuple[SettingKey, ...] = ()  # what `close` could not put back
        self.journal_row: int | None = None  # its row in the hold journal (set by the ledger)

    @property
    def items(self) -> frozenset[str]:
        return frozenset(item for item, _gpu in self.originals)

    def write(self, item: str, gpu: int, value: SettingValue) -> None:
        """Set one held setting; TransactionClosed once the originals went back."""
        key = (item, gpu)
        if key not in self.originals:
            raise KeyError(f"{item} of GPU {gpu} is not held by {self.owner}")
        with self._lock:
            self._check_open()
            self._changed.add(key)  # before the write: one that fails half-way is put back too
            SETTINGS[item].write(self.backend, gpu, value)

    def change(self, action: Callable[[], None]) -> None:
        """A change that reaches every held setting at once (a GPU reset), run under the lock."""
        with self._lock:
            self._check_open()
            self._changed.update(self.originals)
            action()

    def _check_open(self) -> None:
        if self._closed_because is not None:
            raise TransactionClosed(self._closed_because)

    def end(self, reason: str) -> tuple[str, ...]:
        """From outside the job (a reload, the agent stopping): tell the job to stop, then put the
        originals back now, without waiting for it."""
        self._abort(reason)
        return self.close(reason)

    def close(self, reason: str = "the job ended") -> tuple[str, ...]:
        """Put back what the job changed, once; every later call returns the same lines. Never raises."""
        with self._lock:
            if self.restored is not None:
                return self.restored
            self._closed_because = reason
            lines, failed = put_back(self.backend, {key: self.originals[key] for key in self._changed})
            self.restored = tuple(lines)
            self.failed = tuple(failed)
        self._on_close(self, self.restored)
        return self.restored

    def __enter__(self) -> HardwareTransaction:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Ending:
    """How a job run by `PolicyHolds.run` ended: what it raised (None: its body returned) and what
    its transaction put back."""

    error: Exception | None
    restored: tuple[str, ...]

    @property
    def state(self) -> str:
        if self.error is None:
            return "done"
        return self.error.state if isinstance(self.error, JobStop) else "failed"

    @property
    def detail(self) -> str:
        if self.error is None:
            return ""
        if isinstance(self.error, JobStop):
            return self.error.detail
        return f"{type(self.error).__name__}: {self.error}"

    @property
    def not_restored(self) -> list[str]:
        return not_restored(self.restored)

    def restore_note(self) -> str:
        return f"restored: {', '.join(self.restored) or 'nothing changed'}"
