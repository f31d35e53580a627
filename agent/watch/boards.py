"""What the poll watchers share: per-board state, and the event one GPU's sample makes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from agent.events import Event, EventKind, Severity, SuggestedAction
from agent.state import GpuSample

S = TypeVar("S")


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
