"""One step of a sweep, measured over its dwell.

GPU side (the service's GPUs): the energy counter (NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION) read at
both ends gives the joules, its difference over the time between gives the mean power (each GPU's,
and their sum); SM clock, temperature and clock-event reasons are sampled every `sample_seconds`
(mean clock, hottest reading, every reason seen). A GPU without the energy field falls back to
integrating its sampled power.

Server side: its own `/metrics`, scraped with agent.services.scrape (total deadline, size bound) at
every sample and fed to a `LatencyWindow` as wide as the dwell: the generated-token counter's
increase is the tokens, the e2e and TTFT histograms' increases give the p95s and the requests
finished, the running and waiting gauges the requests in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.backend.base import ClockDomain, GpuBackend
from agent.backend.errors import GpuError
from agent.config.service_entry import ServiceConfig
from agent.policy.transaction import JobStop
from agent.services.scrape import ScrapeError, scrape
from agent.services.window import LatencyWindow
from agent.tune.model import StepReading
from agent.tune.recommend import slo_breaches
from agent.watch.clock_events import decode

DEFAULT_SAMPLE_SECONDS = 0.5
SCRAPE_TIMEOUT_SECONDS = 2.0
#: How far apart two readings of the clocks must agree for them to count as settled.
SETTLE_POLL_SECONDS = 0.25


class MeasureError(JobStop):
    """A step could not be measured (the server's metrics, a GPU reading): the sweep fails."""

    def __init__(self, detail: str) -> None:
        super().__init__("failed", detail)


@dataclass
class _GpuTrack:
    gpu: int
    energy_start_joules: float | None
    energy_end_joules: float | None = None
    power_samples_watts: list[float] = field(default_factory=list)
    clock_samples_mhz: list[int] = field(default_factory=list)
    max_temperature_celsius: int | None = None
    reasons: int = 0


def _energy_joules(backend: GpuBackend, gpu: int) -> float | None:
    try:
        return backend.slow_fields(gpu).energy_joules
    except GpuError:
        return None


def _sample(backend: GpuBackend, track: _GpuTrack) -> None:
    try:
        track.power_samples_watts.append(backend.power_usage_watts(track.gpu))
        track.clock_samples_mhz.append(backend.clock_mhz(track.gpu, ClockDomain.SM))
        temperature = backend.temperature_celsius(track.gpu)
        track.reasons |= backend.clock_event_reasons(track.gpu)
    except GpuError as exc:
        raise MeasureError(f"GPU {track.gpu}: {exc}") from exc
    if track.max_temperature_celsius is None or temperature > track.max_temperature_celsius:
        track.max_temperature_celsius = temperature


def _scrape(service: ServiceConfig, window: LatencyWindow, in_flight: list[float]) -> None:
    url = service.effective_metrics_url
    if url is None:
        raise MeasureError(f"service {service.name} has no metrics URL")
    try:
        reading = scrape(url, service.kind, SCRAPE_TIMEOUT_SECONDS)
    except ScrapeError as exc:
        raise MeasureError(f"service {service.name} metrics: {exc}") from exc
    window.add(reading)
    if reading.running is not None:
        in_flight.append(reading.running + (reading.waiting or 0.0))


def wait_settled(backend: GpuBackend, gpus: Sequence[int], timeout_seconds: float, aborted: Callable[[], bool]) -> bool:
    """Wait until two readings of every GPU's SM clock, SETTLE_POLL_SECONDS apart, agree (the power
    controller has found its clock), at most `timeout_seconds`; False when aborted."""
    deadline = time.monotonic() + timeout_seconds
    previous: list[int] | None = None
    while time.monotonic() < deadline:
        try:
            current = [backend.clock_mhz(gpu, ClockDomain.SM) for gpu in gpus]
        except GpuError as exc:
            raise MeasureError(f"reading the clocks: {exc}") from exc
        if current == previous:
            return True
        previous = current
        if _sleep(SETTLE_POLL_SECONDS, aborted):
            return False
    return not aborted()


def _sleep(seconds: float, aborted: Callable[[], bool]) -> bool:
    """Sleep in slices, True as soon as the sweep is aborted."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if aborted():
            return True
        time.sleep(min(left, 0.1))
    return aborted()


def measure_step(
    backend: GpuBackend,
    gpus: Sequence[int],
    service: ServiceConfig,
    setting: float,
    *,
    baseline: bool,
    dwell_seconds: float,
    aborted: Callable[[], bool],
    sample_seconds: float = DEFAULT_SAMPLE_SECONDS,
) -> StepReading | None:
    """Measure the node as it runs now for `dwell_seconds`; None when aborted before the end."""
    window = LatencyWindow(service.name, window_seconds=dwell_seconds * 10 + 60)
    in_flight: list[float] = []
    _scrape(service, window, in_flight)
    started = time.monotonic()
    tracks = [_GpuTrack(gpu, _energy_joules(backend, gpu)) for gpu in gpus]
    for track in tracks:
        _sample(backend, track)
    dwell_deadline = started + dwell_seconds
    while time.monotonic() < dwell_deadline:
        if _sleep(min(sample_seconds, max(0.0, dwell_deadline - time.monotonic())), aborted):
            return None
        for track in tracks:
            _sample(backend, track)
        if time.monotonic() < dwell_deadline:
            _scrape(service, window, in_flight)
    for track in tracks:
        track.energy_end_joules = _energy_joules(backend, track.gpu)
    seconds = time.monotonic() - started
    _scrape(service, window, in_flight)
    return _reading(service, setting, baseline, seconds, tracks, window, in_flight)


def _joules(track: _GpuTrack, seconds: float) -> float:
    start, end = track.energy_start_joules, track.energy_end_joules
    if start is not None and end is not None and end >= start:
        return end - start
    samples = track.power_samples_watts
    return sum(samples) / len(samples) * seconds if samples else 0.0


def _reading(
    service: ServiceConfig,
    setting: float,
    baseline: bool,
    seconds: float,
    tracks: Sequence[_GpuTrack],
    window: LatencyWindow,
    in_flight: Sequence[float],
) -> StepReading:
    figures = window.figures()
    per_gpu_joules = [_joules(track, seconds) for track in tracks]
    joules = sum(per_gpu_joules)
    tokens_per_second = figures.generation_tokens_per_second if figures is not None else None
    covered = figures.window_seconds if figures is not None and figures.window_seconds > 0 else seconds
    mean_power_watts = joules / seconds if seconds > 0 else 0.0
    e2e = figures.latency.get("e2e") if figures is not None else None
    temperatures = [t.max_temperature_celsius for t in tracks if t.max_temperature_celsius is not None]
    clocks = [c for t in tracks for c in t.clock_samples_mhz]
    reasons = 0
    for track in tracks:
        reasons |= track.reasons
    return StepReading(
        setting=setting,
        baseline=baseline,
        seconds=round(seconds, 3),
        mean_power_watts=round(mean_power_watts, 1),
        mean_sm_mhz=round(sum(clocks) / len(clocks), 1) if clocks else 0.0,
        tokens_per_second=round(tokens_per_second, 2) if tokens_per_second is not None else None,
        tokens_per_joule=(
            round(tokens_per_second / mean_power_watts, 5)
            if tokens_per_second is not None and mean_power_watts > 0
            else None
        ),
        e2e_p95_seconds=figures.quantile("e2e", 0.95) if figures is not None else None,
        ttft_p95_seconds=figures.quantile("ttft", 0.95) if figures is not None else None,
        max_temperature_celsius=max(temperatures) if temperatures else None,
        throttle_reasons=tuple(r for r in decode(reasons) if r != "gpu_idle"),
        request_rate=round(e2e.requests / covered, 3) if e2e is not None and covered > 0 else None,
        requests_in_flight=round(sum(in_flight) / len(in_flight), 2) if in_flight else None,
        requests=e2e.requests if e2e is not None else 0.0,
        slo_breaches=slo_breaches(service.slo, figures),
        gpu_power_watts=tuple(round(j / seconds, 1) if seconds > 0 else 0.0 for j in per_gpu_joules),
    )
