"""PCIe link degradation: a GPU's link trained below what it and its slot can do.

A narrower link than the maximum is never normal (a badly seated card, a damaged riser or lane). A
lower generation is normal on an idle GPU, which downshifts the link to save power, so a generation
below the maximum only counts while the GPU is busy: utilization above zero or performance state
P0. (An H200 idles in P0 and keeps its link at gen 5 there, so that test holds for it too.)

PCIE_DEGRADED (warning, check mechanicals) after `sustain_loops` consecutive degraded readings, so
a link retraining for a moment is not a fault; PCIE_RESTORED when the link reads at its maximum
again. An idle GPU with a lower generation proves neither, and leaves a reported degradation open.
Growth of the replay counter (link-level retransmissions, a sign of a marginal link) since the
watcher's first reading is carried in both events' data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.state import GpuSample
from agent.watch.boards import Sustained, SustainedWatcher, sample_event


class _Verdict(Enum):
    DEGRADED = "degraded"
    AT_MAXIMUM = "at_maximum"
    IDLE_DOWNSHIFT = "idle_downshift"


@dataclass(frozen=True)
class _Link:
    generation: int
    width: int
    max_generation: int
    max_width: int

    def text(self) -> str:
        return f"gen{self.generation} x{self.width} (max gen{self.max_generation} x{self.max_width})"


@dataclass
class _GpuState(Sustained[_Link]):
    replay_count: int | None = None
    replays_since_start: int = 0


def _link(sample: GpuSample) -> _Link | None:
    g, w, mg, mw = sample.pcie_generation, sample.pcie_width, sample.pcie_max_generation, sample.pcie_max_width
    if g is None or w is None or mg is None or mw is None:
        return None
    return _Link(g, w, mg, mw)


def _busy(sample: GpuSample) -> bool:
    return bool(sample.gpu_utilization_percent) or sample.performance_state == 0


def _verdict(link: _Link, sample: GpuSample) -> _Verdict:
    if link.width < link.max_width:
        return _Verdict.DEGRADED
    if link.generation < link.max_generation:
        return _Verdict.DEGRADED if _busy(sample) else _Verdict.IDLE_DOWNSHIFT
    return _Verdict.AT_MAXIMUM


class PcieWatcher(SustainedWatcher[_GpuState]):
    name = "pcie"

    def _new_state(self) -> _GpuState:
        return _GpuState()

    def _board_event(self, sample: GpuSample, state: _GpuState, now_seconds: float) -> Event | None:
        self._count_replays(state, sample.pcie_replay_count)
        link = _link(sample)
        if link is None:
            return None
        verdict = _verdict(link, sample)
        if verdict is _Verdict.DEGRADED:
            if state.seen(link, self.sustain_loops):
                return self._event(EventKind.PCIE_DEGRADED, state, sample, link, now_seconds)
            return None
        if verdict is _Verdict.AT_MAXIMUM:
            return self._event(EventKind.PCIE_RESTORED, state, sample, link, now_seconds) if state.gone() else None
        state.consecutive = 0  # an idle downshift proves nothing: a reported degradation stays open
        return None

    def _open_fault(self, state: _GpuState) -> Health:
        assert state.reported is not None  # only asked with a fault open
        text = f"PCIe link degraded: {state.reported.text()}"
        return Health(HealthState.DEGRADED, text, SuggestedAction.CHECK_MECHANICALS, (FaultCause.PCIE_DEGRADED,))

    @staticmethod
    def _count_replays(state: _GpuState, count: int | None) -> None:
        if count is None:
            return
        previous = state.replay_count
        if previous is not None:
            # A smaller count restarted from zero (driver reload, GPU reset): all of it is new.
            state.replays_since_start += count - previous if count >= previous else count
        state.replay_count = count

    @staticmethod
    def _event(kind: EventKind, state: _GpuState, sample: GpuSample, link: _Link, now_seconds: float) -> Event:
        data: dict[str, Any] = {
            "generation": link.generation,
            "width": link.width,
            "max_generation": link.max_generation,
            "max_width": link.max_width,
            "replay_count": state.replay_count,
            "replays_since_start": state.replays_since_start,
        }
        if kind is EventKind.PCIE_DEGRADED:
            return sample_event(
                sample,
                kind,
                Severity.WARNING,
                f"PCIe link degraded to {link.text()}",
                now_seconds,
                data=data,
                suggested_action=SuggestedAction.CHECK_MECHANICALS,
            )
        return sample_event(sample, kind, Severity.INFO, f"PCIe link back at {link.text()}", now_seconds, data=data)
