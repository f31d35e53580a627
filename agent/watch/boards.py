"""What the poll watchers share: per-board state, a base for faults that must last, and one sample's event."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from agent.events import Event, EventKind, Health, Severity, SuggestedAction
from agent.state import GpuSample

S = TypeVar("S")
F = TypeVar("F")


class BoardStates(Generic[S]):
    """A watcher's state per GPU index, for the board in that slot: when another board (another
    UUID) answers at an index, its state starts from nothing, so one card's history never judges
    the next."""

    def __init__(self, new_state: Callable[[], S]) -> None:
        self._new_state = new_state
        self._boards: dict[int, tuple[str, S]] = {}

    def answering(self, samples: Iterable[GpuSample]) -> Iterator[tuple[GpuSample, S]]:
        """Each sample of a GPU that answered, with its board's state."""
        for sample in samples:
            if sample.up:
                yield sample, self.board(sample.index, sample.uuid)

    def board(self, gpu: int, uuid: str) -> S:
        """The state of board `uuid` at index `gpu`: a fresh one if another board was there."""
        board = self._boards.get(gpu)
        if board is None or board[0] != uuid:
            board = self._boards[gpu] = (uuid, self._new_state())
        return board[1]

    def get(self, gpu: int) -> S | None:
        board = self._boards.get(gpu)
        return None if board is None else board[1]

    def items(self) -> Iterator[tuple[int, S]]:
        return ((gpu, state) for gpu, (_, state) in self._boards.items())

    def boards(self) -> Iterator[tuple[int, str, S]]:
        """(index, uuid, state) of every board seen."""
        return ((gpu, uuid, state) for gpu, (uuid, state) in self._boards.items())


@dataclass
class Sustained(Generic[F]):
    """A board's fault that must last to be reported: the passes in a row it was seen, and what was
    reported of it (None: no fault open)."""

    consecutive: int = 0
    reported: F | None = None

    def seen(self, fault: F, sustain_loops: int) -> bool:
        """One more pass with the fault: True when it opens now (it lasted `sustain_loops` passes and
        none was open), `fault` then being what was reported."""
        self.consecutive += 1
        if self.reported is not None or self.consecutive < sustain_loops:
            return False
        self.reported = fault
        return True

    def gone(self) -> bool:
        """A pass without the fault: True when an open one closes now."""
        self.consecutive = 0
        if self.reported is None:
            return False
        self.reported = None
        return True


SS = TypeVar("SS", bound=Sustained[Any])


class SustainedWatcher(ABC, Generic[SS]):
    """A poll watcher that reports a fault once it lasted `sustain_loops` passes in a row (a single
    reading is noise), keeping a state per board; a board's health is that of its open fault."""

    def __init__(self, sustain_loops: int = 3) -> None:
        if sustain_loops < 1:
            raise ValueError("sustain_loops must be at least 1")
        self.sustain_loops = sustain_loops
        self._gpus: BoardStates[SS] = BoardStates(self._new_state)

    def observe(self, samples: Sequence[GpuSample], now_seconds: float) -> list[Event]:
        events: list[Event] = []
        for sample, state in self._gpus.answering(samples):
            event = self._board_event(sample, state, now_seconds)
            if event is not None:
                events.append(event)
        return events

    def health(self, gpu: int) -> Health:
        state = self._gpus.get(gpu)
        if state is None or state.reported is None:
            return Health.healthy()
        return self._open_fault(state)

    @abstractmethod
    def _new_state(self) -> SS:
        """A board's state before its first reading."""

    @abstractmethod
    def _board_event(self, sample: GpuSample, state: SS, now_seconds: float) -> Event | None:
        """Judge one answering GPU's sample against its board's state: the event it makes, if any."""

    @abstractmethod
    def _open_fault(self, state: SS) -> Health:
        """The health of a board whose fault is open (`state.reported` is set)."""


def sample_event(
    sample: GpuSample,
    kind: EventKind,
    severity: Severity,
    text: str,
    now_seconds: float,
    *,
    data: dict[str, Any],
    key_detail: str = "",
    suggested_action: SuggestedAction = SuggestedAction.NONE,
) -> Event:
    """A poll watcher's event about the GPU in `sample`: the message reads "GPU <index>: <text>",
    the key is "<kind>:<uuid>" with ":<key_detail>" where one board can have several such faults."""
    return Event(
        kind=kind,
        severity=severity,
        gpu=sample.index,
        uuid=sample.uuid,
        message=f"GPU {sample.index}: {text}",
        timestamp_seconds=now_seconds,
        source="poll",
        key=f"{kind.value}:{sample.uuid}" + (f":{key_detail}" if key_detail else ""),
        data=data,
        suggested_action=suggested_action,
    )
