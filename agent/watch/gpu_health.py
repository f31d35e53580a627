"""Per-GPU health: each watcher keeps its own view, `combine` folds them into one verdict.

The verdict follows gpud's shape (state + reason + suggested action): the worst state wins, the
reasons of every source in that state are kept, and of their suggested actions the most drastic
one is offered, because acting on a milder one would leave the worse fault in place. "Most drastic"
is the one ranking of remedies, `SuggestedAction`'s order (agent/events.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from agent.events import ACTION_ORDER as ACTION_ORDER
from agent.events import Event, Health, HealthState, SuggestedAction, more_drastic
from agent.state import GpuSample

_STATE_RANK = {HealthState.HEALTHY: 0, HealthState.DEGRADED: 1, HealthState.UNHEALTHY: 2}


class HealthSource(Protocol):
    """Anything with a per-GPU health view: the poll watchers, the Xid watcher, service probes."""

    def health(self, gpu: int) -> Health: ...


class PollWatcher(HealthSource, Protocol):
    """A watcher the daemon calls once per loop with that loop's samples.

    `observe` returns each event once per transition (started/ended, appeared/cleared), never once
    per loop while a condition lasts. A reading that is None (unsupported or not read this loop)
    changes nothing and emits nothing.
    """

    name: str

    def observe(self, samples: Sequence[GpuSample], now_seconds: float) -> list[Event]: ...


def combine(healths: Iterable[Health]) -> Health:
    """One verdict from many: worst state, its reasons joined with "; ", its most drastic action,
    and the causes of every fault open (the worst state's first).

    Nothing to combine is healthy.
    """
    worst: list[Health] = []
    healths = list(healths)
    for health in healths:
        if not worst or _STATE_RANK[health.state] > _STATE_RANK[worst[0].state]:
            worst = [health]
        elif health.state is worst[0].state:
            worst.append(health)
    if not worst:
        return Health.healthy()
    reasons = list(dict.fromkeys(h.reason for h in worst if h.reason))
    action = SuggestedAction.NONE
    for health in worst:
        action = more_drastic(action, health.suggested_action)
    open_faults = sorted(
        (h for h in healths if h.state is not HealthState.HEALTHY), key=lambda h: -_STATE_RANK[h.state]
    )
    causes = tuple(dict.fromkeys(cause for h in open_faults for cause in h.causes))
    return Health(worst[0].state, "; ".join(reasons), action, causes)


class HealthBook:
    """Per-GPU health across every source (poll watchers and any other `.health(gpu)` provider)."""

    def __init__(self, sources: Iterable[HealthSource]) -> None:
        self.sources: list[HealthSource] = list(sources)

    def add(self, source: HealthSource) -> None:
        self.sources.append(source)

    def gpu_health(self, gpu: int) -> Health:
        return combine(source.health(gpu) for source in self.sources)

    def by_gpu(self, gpus: Iterable[int]) -> dict[int, Health]:
        """What NodeSnapshot.health holds: the verdict for each GPU index."""
        return {gpu: self.gpu_health(gpu) for gpu in gpus}
