"""NVLink health: per-link error counters that grow, and links that go down.

The counters (CRC flit, CRC data, replay, recovery; NVML field values, slow tier) only grow until
the driver reloads. The first reading of a board is its baseline: errors counted before the agent
started are not news. Every later increase is an NVLINK_ERRORS event (warning; one per link per
pass, with the increase per counter in its data) and keeps the GPU degraded for `hold_seconds`, so
a link that keeps erring stays visible between passes. A link that reads down is NVLINK_DOWN
(warning, degraded while it lasts; collective operations over it fall back or hang); NVLINK_UP when
it reads up again. A GPU without NVLink (a single H200, PCIe boards) reads None and is left alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.state import GpuSample
from agent.watch.boards import BoardStates, sample_event

#: How long a GPU stays degraded after its last NVLink error increase.
DEFAULT_HOLD_SECONDS = 600.0

#: A link's change of state: its event kind, severity, message tail and suggested action.
_LINK_DOWN = (EventKind.NVLINK_DOWN, Severity.WARNING, "is down", SuggestedAction.RESET_GPU)
_LINK_UP = (EventKind.NVLINK_UP, Severity.INFO, "is up again", SuggestedAction.NONE)


@dataclass
class _GpuState:
    counts: dict[int, Mapping[str, int]] = field(default_factory=dict)  # link -> counter -> count
    down: set[int] = field(default_factory=set)
    last_error_seconds: float | None = None
    last_error_text: str = ""


class NvLinkWatcher:
    name = "nvlink_errors"

    def __init__(self, hold_seconds: float = DEFAULT_HOLD_SECONDS) -> None:
        if hold_seconds < 0:
            raise ValueError("hold_seconds must not be negative")
        self.hold_seconds = hold_seconds
        self._gpus = BoardStates(_GpuState)
        self._now_seconds = 0.0

    def observe(self, samples: Sequence[GpuSample], now_seconds: float) -> list[Event]:
        self._now_seconds = now_seconds
        events: list[Event] = []
        for sample, state in self._gpus.answering(samples):
            events.extend(self._errors(sample, state, now_seconds))
            events.extend(self._states(sample, state, now_seconds))
        return events

    def _errors(self, sample: GpuSample, state: _GpuState, now_seconds: float) -> list[Event]:
        events: list[Event] = []
        for link in sample.nvlink_errors or ():
            previous = state.counts.get(link.link)
            state.counts[link.link] = dict(link.counts)
            if previous is None:
                continue  # the baseline
            # A smaller count restarted from zero (driver reload, GPU reset): all of it is new.
            grown = {
                counter: count - previous[counter] if count >= previous.get(counter, 0) else count
                for counter, count in link.counts.items()
                if counter in previous and count != previous[counter]
            }
            grown = {counter: increase for counter, increase in grown.items() if increase > 0}
            if not grown:
                continue
            text = f"NVLink {link.link} errors: " + ", ".join(f"{c} +{n}" for c, n in sorted(grown.items()))
            state.last_error_seconds = now_seconds
            state.last_error_text = text
            events.append(
                sample_event(
                    sample,
                    EventKind.NVLINK_ERRORS,
                    Severity.WARNING,
                    text,
                    now_seconds,
                    data={"link": link.link, "increase": grown, "counts": dict(link.counts)},
                    key_detail=str(link.link),
                    suggested_action=SuggestedAction.ALERT,
                )
            )
        return events

    @staticmethod
    def _states(sample: GpuSample, state: _GpuState, now_seconds: float) -> list[Event]:
        if sample.nvlink_up is None:
            return []
        events: list[Event] = []
        for link, up in enumerate(sample.nvlink_up):
            if up and link in state.down:
                state.down.discard(link)
                kind, severity, text, action = _LINK_UP
            elif not up and link not in state.down:
                state.down.add(link)
                kind, severity, text, action = _LINK_DOWN
            else:
                continue
            events.append(
                sample_event(
                    sample,
                    kind,
                    severity,
                    f"NVLink {link} {text}",
                    now_seconds,
                    data={"link": link},
                    key_detail=str(link),
                    suggested_action=action,
                )
            )
        return events

    def health(self, gpu: int) -> Health:
        state = self._gpus.get(gpu)
        if state is None:
            return Health.healthy()
        if state.down:
            links = ", ".join(str(link) for link in sorted(state.down))
            return Health(
                HealthState.DEGRADED, f"NVLink down: link {links}", SuggestedAction.RESET_GPU, (FaultCause.NVLINK_DOWN,)
            )
        recent = (
            state.last_error_seconds is not None and self._now_seconds - state.last_error_seconds < self.hold_seconds
        )
        if recent:
            return Health(
                HealthState.DEGRADED, state.last_error_text, SuggestedAction.ALERT, (FaultCause.NVLINK_ERRORS,)
            )
        return Health.healthy()
