"""Clock slowdowns ("throttling") from NVML clock-event reasons, and the thermal margin.

Events: THROTTLE_STARTED when a slowdown reason appears, THROTTLE_ENDED (with its duration) when
it goes; TEMPERATURE_MARGIN_LOW once when the temperature climbs to within `slowdown_margin_celsius`
of the board's slowdown threshold (re-armed after it falls 2 C below that line again).

Time per reason (`clock_event_seconds`, every reason including benign ones such as gpu_idle) is
integrated between samples on the watcher's clock (CLOCK_BOOTTIME): a reason seen active in one
sample is counted until the next sample, and a wall-clock step in between counts for nothing.
Where the board keeps its own counter the total follows the counter instead:

- ``power_violation_ns`` (nvmlDeviceGetViolationStatus, NVML_PERF_POLICY_POWER: "how long power
  violations held the GPU below application clocks") is the power limiter's time, which is what
  the sw_power_cap reason reports, so sw_power_cap follows it.
- ``thermal_violation_ns`` (NVML_PERF_POLICY_THERMAL) counts thermal violations of any kind: it
  covers both sw_thermal_slowdown and hw_thermal_slowdown and cannot be split between them, so
  those two are integrated from samples and the counter is not used.

An agent restart is not a reboot: `totals` gives the daemon's node memory (agent/daemon/node_memory.py) each
board's time per reason and the start of each slowdown active now, and `restore` takes them back at
start, so the exported counter does not go down and a held slowdown keeps its start time (a rule's
"held 60 s" does not start again). The time between the two runs is not counted.

How long a slowdown has been held (`held_seconds`, what a rule's `held_seconds` compares with, and
the duration of THROTTLE_ENDED) is measured on `clock`, CLOCK_BOOTTIME by default: a step of the
wall clock is not time held, and the reading survives an agent restart on the same boot. The wall
time a slowdown started (`active_since`) is what people read and what names the episode.

Counters are read on the slow tier: between two counter readings sw_power_cap is integrated, and
each counter reading replaces that estimate with the counter's delta. A reported total never goes
down (Prometheus would read that as a counter reset); it waits for the counter to catch up instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.events import Event, EventKind, FaultCause, Health, HealthState, Severity, SuggestedAction
from agent.host.boottime import boottime_seconds
from agent.state import GpuSample
from agent.watch.boards import BoardStates, sample_event
from agent.watch.clock_events import SLOWDOWN_REASONS, decode
from agent.watch.gpu_health import combine

#: Violation counter field of GpuSample -> the reason whose time it measures (see module docstring).
COUNTER_REASONS: dict[str, str] = {"power_violation_ns": "sw_power_cap"}
#: The hardware protecting itself from heat or a failing power supply: a real problem right now.
_CRITICAL_REASONS = frozenset({"hw_thermal_slowdown", "hw_power_brake_slowdown"})
#: The power limiter holding clocks under a configured limit: expected, and healthy.
EXPECTED_REASONS = frozenset({"sw_power_cap"})
MARGIN_HYSTERESIS_CELSIUS = 2


@dataclass(frozen=True)
class ClockEventTotal:
    """How long one clock-event reason held one board on this boot, and since when while it holds."""

    gpu: int
    uuid: str
    reason: str
    seconds: float
    active_since_seconds: float | None = None  # a slowdown active at the last save: when it started
    active_since_boottime_seconds: float | None = None  # the same start on CLOCK_BOOTTIME of this boot


@dataclass
class _Total:
    counted_seconds: float = 0.0  # from counter deltas (or integration before the counter baseline)
    pending_seconds: float = 0.0  # integrated since the last counter reading
    reported_seconds: float = 0.0  # what clock_event_seconds() returns: never decreases

    def publish(self) -> None:
        self.reported_seconds = max(self.reported_seconds, self.counted_seconds + self.pending_seconds)


@dataclass
class _GpuState:
    last_timestamp_seconds: float | None = None  # the previous reasons reading, on the watcher's clock
    last_reasons: tuple[str, ...] = ()
    started_seconds: dict[str, float] = field(default_factory=dict)  # active slowdown reason -> since (wall)
    started_boottime: dict[str, float] = field(default_factory=dict)  # the same starts on the watcher's clock
    totals: dict[str, _Total] = field(default_factory=dict)
    counters_ns: dict[str, int] = field(default_factory=dict)
    slowdown_celsius: int | None = None
    margin_low: tuple[int, int] | None = None  # (temperature, slowdown threshold) while the margin is low


class ThrottleWatcher:
    name = "throttle"

    def __init__(self, slowdown_margin_celsius: int = 5, clock: Callable[[], float] = boottime_seconds) -> None:
        self.slowdown_margin_celsius = slowdown_margin_celsius
        self._clock = clock
        self._gpus = BoardStates(_GpuState)

    def observe(self, samples: Sequence[GpuSample], now_seconds: float) -> list[Event]:
        events: list[Event] = []
        tick = self._clock()
        for sample, state in self._gpus.answering(samples):
            self._integrate(state, sample, tick)
            self._count(state, sample)
            for total in state.totals.values():
                total.publish()
            if sample.clock_event_reasons is not None:
                events += self._transitions(state, sample, now_seconds)
            events += self._margin(state, sample, now_seconds)
        return events

    def clock_event_seconds(self) -> dict[tuple[int, str], float]:
        """(gpu, reason) -> seconds that reason was active since the agent started watching."""
        return {
            (gpu, reason): total.reported_seconds
            for gpu, state in self._gpus.items()
            for reason, total in state.totals.items()
        }

    def active_since(self) -> dict[tuple[int, str], float]:
        """(gpu, slowdown reason) -> when it started (sample timestamp), for the slowdowns active now."""
        return {
            (gpu, reason): since for gpu, state in self._gpus.items() for reason, since in state.started_seconds.items()
        }

    def held_seconds(self) -> dict[tuple[int, str], float]:
        """(gpu, slowdown reason) -> how long it has been held, on the watcher's clock, for those active now."""
        now = self._clock()
        return {
            (gpu, reason): max(0.0, now - since)
            for gpu, state in self._gpus.items()
            for reason, since in state.started_boottime.items()
        }

    def totals(self) -> list[ClockEventTotal]:
        """Every board's time per reason and, for a slowdown active now, its start: for the store."""
        return [
            ClockEventTotal(
                gpu,
                uuid,
                reason,
                total.reported_seconds,
                state.started_seconds.get(reason),
                state.started_boottime.get(reason),
            )
            for gpu, uuid, state in sorted(self._gpus.boards(), key=lambda board: board[0])
            for reason, total in sorted(state.totals.items())
        ]

    def restore(self, totals: list[ClockEventTotal]) -> None:
        """The totals and active slowdowns an earlier run of the agent on this boot left. Time counted
        since this run started (the store opened late) adds to them; a slowdown this run saw start
        keeps that start."""
        answering = {gpu: uuid for gpu, uuid, _ in self._gpus.boards()}
        for stored in totals:
            if answering.get(stored.gpu, stored.uuid) != stored.uuid:
                continue  # another board answers at that index now: the stored one's time is not its
            state = self._gpus.board(stored.gpu, stored.uuid)
            total = state.totals.setdefault(stored.reason, _Total())
            total.counted_seconds += stored.seconds
            total.publish()
            if stored.active_since_seconds is not None and stored.reason not in state.started_seconds:
                state.started_seconds[stored.reason] = stored.active_since_seconds
                # A row saved without the boot-clock start (an older agent): the hold counts from now.
                boottime = stored.active_since_boottime_seconds
                state.started_boottime[stored.reason] = self._clock() if boottime is None else boottime

    def health(self, gpu: int) -> Health:
        state = self._gpus.get(gpu)
        if state is None:
            return Health.healthy()
        parts: list[Health] = []
        slowed = [r for r in state.started_seconds if r not in EXPECTED_REASONS]
        if slowed:
            parts.append(
                Health(
                    HealthState.DEGRADED,
                    f"clocks slowed by {', '.join(slowed)}",
                    SuggestedAction.CHECK_MECHANICALS,
                    (FaultCause.CLOCKS_SLOWED,),
                )
            )
        if state.margin_low is not None:
            parts.append(
                Health(
                    HealthState.DEGRADED,
                    _margin_text(*state.margin_low),
                    SuggestedAction.CHECK_MECHANICALS,
                    (FaultCause.TEMPERATURE_MARGIN,),
                )
            )
        return combine(parts)

    # -- internals ------------------------------------------------------------------------

    @staticmethod
    def _integrate(state: _GpuState, sample: GpuSample, tick: float) -> None:
        """Time between two readings on the watcher's clock: a wall-clock step is not time slowed."""
        mask = sample.clock_event_reasons
        if mask is None:
            # Nothing is known about the reasons until the next reading: that gap is not counted.
            state.last_timestamp_seconds = None
            return
        now = tick
        if state.last_timestamp_seconds is not None and now > state.last_timestamp_seconds:
            elapsed = now - state.last_timestamp_seconds
            for reason in state.last_reasons:
                state.totals.setdefault(reason, _Total()).pending_seconds += elapsed
        state.last_timestamp_seconds = now
        state.last_reasons = tuple(decode(mask))
        for reason in state.last_reasons:
            state.totals.setdefault(reason, _Total())

    @staticmethod
    def _count(state: _GpuState, sample: GpuSample) -> None:
        for field_name, reason in COUNTER_REASONS.items():
            value: int | None = getattr(sample, field_name)
            if value is None:
                continue
            total = state.totals.setdefault(reason, _Total())
            previous = state.counters_ns.get(field_name)
            if previous is not None and value >= previous:
                total.counted_seconds += (value - previous) / 1e9
            else:
                # The first reading is the counter's baseline, a smaller one a reset (GPU reset, driver
                # reload): for the stretch before it, the integrated estimate is all there is.
                total.counted_seconds += total.pending_seconds
            total.pending_seconds = 0.0
            state.counters_ns[field_name] = value

    def _transitions(self, state: _GpuState, sample: GpuSample, now_seconds: float) -> list[Event]:
        events: list[Event] = []
        active = [r for r in state.last_reasons if r in SLOWDOWN_REASONS]
        tick = self._clock()
        for reason in active:
            if reason not in state.started_seconds:
                state.started_seconds[reason] = sample.timestamp_seconds
                state.started_boottime[reason] = tick
                events.append(self._started(sample, reason, now_seconds))
        for reason in [r for r in state.started_seconds if r not in active]:
            state.started_seconds.pop(reason)
            duration = max(0.0, tick - state.started_boottime.pop(reason, tick))
            events.append(
                sample_event(
                    sample,
                    EventKind.THROTTLE_ENDED,
                    Severity.INFO,
                    f"{reason} slowdown ended after {duration:.0f} s",
                    now_seconds,
                    key_detail=reason,
                    data={"reason": reason, "duration_seconds": duration},
                )
            )
        return events

    @staticmethod
    def _started(sample: GpuSample, reason: str, now_seconds: float) -> Event:
        if reason in _CRITICAL_REASONS:
            severity = Severity.CRITICAL
        elif reason in EXPECTED_REASONS:
            # Informational: the power limit the operator set is doing its job.
            severity = Severity.INFO
        else:
            severity = Severity.WARNING
        action = SuggestedAction.NONE if reason in EXPECTED_REASONS else SuggestedAction.CHECK_MECHANICALS
        context = []
        if sample.temperature_celsius is not None:
            context.append(f"{sample.temperature_celsius} C")
        if sample.power_usage_watts is not None:
            limit = f" of {sample.power_limit_watts:.0f} W limit" if sample.power_limit_watts is not None else ""
            context.append(f"{sample.power_usage_watts:.0f} W{limit}")
        if sample.sm_clock_mhz is not None:
            context.append(f"SM {sample.sm_clock_mhz} MHz")
        detail = f" ({', '.join(context)})" if context else ""
        return sample_event(
            sample,
            EventKind.THROTTLE_STARTED,
            severity,
            f"clocks slowed by {reason}{detail}",
            now_seconds,
            key_detail=reason,
            data={
                "reason": reason,
                "clock_event_reasons": sample.clock_event_reasons,
                "temperature_celsius": sample.temperature_celsius,
                "power_usage_watts": sample.power_usage_watts,
                "power_limit_watts": sample.power_limit_watts,
                "sm_clock_mhz": sample.sm_clock_mhz,
            },
            suggested_action=action,
        )

    def _margin(self, state: _GpuState, sample: GpuSample, now_seconds: float) -> list[Event]:
        if sample.slowdown_temperature_celsius is not None:
            state.slowdown_celsius = sample.slowdown_temperature_celsius
        temperature, slowdown = sample.temperature_celsius, state.slowdown_celsius
        if temperature is None or slowdown is None:
            return []
        line = slowdown - self.slowdown_margin_celsius
        if state.margin_low is not None:
            # Re-armed only well below the line, so a temperature hovering on it raises one event.
            state.margin_low = None if temperature < line - MARGIN_HYSTERESIS_CELSIUS else (temperature, slowdown)
            return []
        if temperature < line:
            return []
        state.margin_low = (temperature, slowdown)
        return [
            sample_event(
                sample,
                EventKind.TEMPERATURE_MARGIN_LOW,
                Severity.WARNING,
                _margin_text(temperature, slowdown),
                now_seconds,
                data={
                    "temperature_celsius": temperature,
                    "slowdown_temperature_celsius": slowdown,
                    "margin_celsius": slowdown - temperature,
                },
                suggested_action=SuggestedAction.CHECK_MECHANICALS,
            )
        ]


def _margin_text(temperature_celsius: int, slowdown_celsius: int) -> str:
    if temperature_celsius >= slowdown_celsius:
        return f"temperature {temperature_celsius} C is at or above the slowdown threshold {slowdown_celsius} C"
    return (
        f"temperature {temperature_celsius} C is within {slowdown_celsius - temperature_celsius} C "
        f"of the slowdown threshold {slowdown_celsius} C"
    )
