"""The daemon's side of inference awareness: scraping each service's server off the loop thread,
and turning SLO breaches into `service_latency_regression` events with their cause.

`ServiceScraper` runs one thread per service with a metrics URL (a hanging or huge page delays
nobody else, and never the loop): every `scrape_interval_seconds` it scrapes with a deadline and a size cap, feeds
the service's `LatencyWindow` and computes its figures there. Whatever the page does to the parser
or the window (an exception included) is that service's error. `figures()`, the finished figures,
is what the loop publishes.

`LatencyRegressionWatch` keeps the GPU samples and Xid events of the last window, and per loop
asks `SloWatch` whether a service misses its SLO, naming the cause from what its GPUs did.

`GpuAttributor` maps NVML's compute processes to services on a thread of its own (every 30 s).
`InferenceMonitor` bundles the three behind the few calls the daemon makes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import psutil

from agent.backend.base import GpuBackend, GpuIdentity, GpuProcess
from agent.backend.errors import GpuError
from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.events import Event, EventKind
from agent.host.paths import HostPaths
from agent.logs import get_logger
from agent.policy.profiles import resolve_profile
from agent.services.attribution import Listeners, attribute_gpu_processes, command_service_pids
from agent.services.counters import CounterBook, ServiceEnergy
from agent.services.efficiency import EnergyHistory, service_gpus, window_tokens_per_joule
from agent.services.latency_cause import CauseFinding, SloWatch, attribute_cause
from agent.services.scrape import DEFAULT_MAX_BYTES, UNREADABLE, ScrapeError, ServerReading, fetch_text, parse_reading
from agent.services.window import DEFAULT_WINDOW_SECONDS, LatencyWindow
from agent.state import GpuAttribution, GpuSample, ServiceCounters, ServiceFigures, SloBreachNow

log = get_logger()

#: How often GPU processes are mapped to services: processes come and go with restarts, not loops.
ATTRIBUTION_INTERVAL_SECONDS = 30.0
ATTRIBUTION_RETRY_SECONDS = 1.0
#: GPU energy readings are kept this much longer than the window, so its oldest scrape is covered.
ENERGY_MARGIN_SECONDS = 60.0


class ServiceScraper:
    """Scrapes every service that has a metrics URL, each on its own thread. The page is parsed and
    its figures (quantiles, rates) computed there too: what the loop takes (`figures()`) is ready
    data, so nothing a server writes ever runs on the loop."""

    def __init__(
        self,
        services: Sequence[ServiceConfig],
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.max_bytes = max_bytes
        self._services = {s.name: s for s in services if s.effective_metrics_url is not None}
        self._windows = {
            name: LatencyWindow(name, s.slo.window_seconds if s.slo and s.slo.window_seconds else window_seconds)
            for name, s in self._services.items()
        }
        self._books = {name: CounterBook() for name in self._services}  # the same pages as counters
        self._figures: dict[str, ServiceFigures] = {}
        # A detected kind is kept while its families are on the page (detection reads every line),
        # and detected again when they are gone: the first page does not decide for good.
        self._kinds: dict[str, str | None] = {name: s.kind for name, s in self._services.items()}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(name,), name=f"scrape-{name}", daemon=True)
            for name in self._services
        ]

    def scrape_once(self, name: str, timeout_seconds: float | None = None) -> None:
        """One scrape of `name`, within `timeout_seconds` (default: its probe timeout, cut to its
        scrape interval so that scrapes never pile up behind a slow server)."""
        service = self._services[name]
        url = service.effective_metrics_url
        assert url is not None  # only services with one are kept
        if timeout_seconds is None:
            timeout_seconds = min(service.probe_timeout_seconds, service.scrape_interval_seconds)
        window = self._windows[name]
        reading: ServerReading | None = None
        try:
            reading = self._read(service, url, timeout_seconds)
        except ScrapeError as exc:
            window.add_error(str(exc))
            log.debug("service metrics scrape failed", service=name, url=url, error=str(exc))
        except Exception as exc:  # a parser bug is this service's unreadable page, not the caller's crash
            window.add_error(f"{UNREADABLE}: {type(exc).__name__}")
            log.exception("service metrics scrape crashed", service=name)
        else:
            window.add(reading)
        try:
            if reading is not None:
                self._books[name].add(reading)
            figures = window.figures()
            if figures is not None:
                figures = replace(figures, counters=self._books[name].counters())
        except Exception as exc:  # the same for the figures drawn from what the pages said
            log.exception("service figures failed", service=name)
            window.forget()
            self._books[name] = CounterBook()
            window.add_error(f"{UNREADABLE}: {type(exc).__name__}")
            figures = window.figures()
        with self._lock:
            if figures is None:
                self._figures.pop(name, None)
            else:
                self._figures[name] = figures

    def _read(self, service: ServiceConfig, url: str, timeout_seconds: float) -> ServerReading:
        text = fetch_text(url, timeout_seconds, self.max_bytes)
        kind = self._kinds[service.name]
        reading = parse_reading(text, kind)
        if service.kind is None and kind is not None and not reading.families:
            reading = parse_reading(text, None, reading.timestamp_seconds)
        if service.kind is None:
            self._kinds[service.name] = reading.kind if reading.kind != "generic" else None
        return reading

    def _loop(self, name: str) -> None:
        while not self._stop.is_set():
            try:
                self.scrape_once(name)
            except Exception:  # a bug must not end this service's scraping for good
                log.exception("service metrics scrape crashed", service=name)
            self._stop.wait(self._services[name].scrape_interval_seconds)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(self._services[thread.name.removeprefix("scrape-")].probe_timeout_seconds + 1.0)

    def figures(self) -> dict[str, ServiceFigures]:
        with self._lock:
            return dict(self._figures)


def expected_clocks_mhz(config: AgentConfig, samples: Sequence[GpuSample]) -> dict[int, int]:
    """Per GPU, the graphics clock its policy profile locks it to (the top of the range)."""
    expected: dict[int, int] = {}
    for sample in samples:
        identity = GpuIdentity(sample.index, sample.uuid, sample.name, sample.pci_bus_id, "", "", 0)
        resolved = resolve_profile(config.policy, identity)
        locked = None if resolved is None else resolved.profile.locked_clocks
        if locked is not None and locked.gpu_mhz is not None:
            expected[sample.index] = locked.gpu_mhz[1]
    return expected


class LatencyRegressionWatch:
    """GPU samples and Xid events over the window, and the SLO verdicts drawn from them."""

    def __init__(
        self,
        config: AgentConfig,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.window_seconds = window_seconds
        self.clock = clock
        self._samples: deque[GpuSample] = deque()
        self._xids: deque[Event] = deque()
        self._slo = SloWatch()

    def observe(self, samples: Sequence[GpuSample], events: Sequence[Event]) -> None:
        """Call once per loop with the loop's samples and new events."""
        self._samples.extend(samples)
        self._xids.extend(e for e in events if e.kind is EventKind.XID)
        oldest = self.clock() - self.window_seconds
        while self._samples and self._samples[0].timestamp_seconds < oldest:
            self._samples.popleft()
        while self._xids and self._xids[0].timestamp_seconds < oldest:
            self._xids.popleft()

    def evaluate(self, figures: Mapping[str, ServiceFigures]) -> list[Event]:
        """Events for services that started missing their SLO (or whose cause changed) this loop."""
        now = self.clock()
        window_start = now - self.window_seconds
        samples = list(self._samples)
        xids = list(self._xids)
        events: list[Event] = []
        for service in self.config.services:
            found = figures.get(service.name)
            gpus = None if service.gpus == "all" else list(service.gpus)

            def attribute(found: ServiceFigures | None = found, gpus: list[int] | None = gpus) -> CauseFinding:
                return attribute_cause(
                    samples,
                    gpus=gpus,
                    xid_events=xids,
                    waiting_history=found.waiting_history if found is not None else (),
                    expected_clock_mhz=expected_clocks_mhz(self.config, samples),
                    window_start_seconds=window_start,
                    kv_cache_usage_history=found.kv_cache_usage_history if found is not None else (),
                    queue_time=found.queue_time_trend if found is not None else None,
                    queue_time_p95_seconds=found.quantile("queue", 0.95) if found is not None else None,
                )

            events += self._slo.update(service.name, service.slo, found, attribute, now)
        return events

    def breaches(self) -> tuple[SloBreachNow, ...]:
        """The services over an objective at the last evaluation, for the verdict."""
        return self._slo.breaches()


class GpuAttributor:
    """Maps the GPUs' compute processes to services every `interval_seconds` on its own thread: an
    NVML process query that hangs, or a long walk of the process table, never holds the loop."""

    def __init__(
        self,
        config: AgentConfig,
        get_backend: Callable[[], GpuBackend | None],
        interval_seconds: float = ATTRIBUTION_INTERVAL_SECONDS,
    ) -> None:
        self.config = config
        self.get_backend = get_backend
        self.interval_seconds = interval_seconds
        self.paths = HostPaths.at(config.host_root)
        self._latest: GpuAttribution | None = None
        self._listeners = Listeners()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # a process exited: map again now, not at the next interval
        self._thread = threading.Thread(target=self._loop, name="gpu-attribution", daemon=True)

    def attribute_once(self) -> GpuAttribution | None:
        backend = self.get_backend()
        if backend is None:
            return None
        processes: dict[int, list[GpuProcess]] = {}
        uuids: dict[int, str] = {}
        for gpu in range(backend.device_count()):
            try:
                uuids[gpu] = backend.identity(gpu).uuid
                processes[gpu] = backend.compute_processes(gpu)
            except GpuError:
                continue  # a lost or failing GPU: the collectors report it
        needs_tree = any(s.manager == "command" for s in self.config.services)
        command_pids = command_service_pids(self.config.services, self._listeners) if needs_tree else {}
        found = attribute_gpu_processes(processes, uuids, self.config.services, self.paths, command_pids)
        with self._lock:
            self._latest = found
        return found

    def _loop(self) -> None:
        while not self._stop.is_set():
            found = None
            try:
                found = self.attribute_once()
            except GpuError as exc:
                log.debug("GPU process attribution failed", error=str(exc))
            except Exception:  # a bug here must not end attribution for good
                log.exception("GPU process attribution crashed")
            # No backend yet (the daemon opens it on its first loop) or a failure: try again soon.
            self._wake.wait(self.interval_seconds if found is not None else ATTRIBUTION_RETRY_SECONDS)
            self._wake.clear()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(1.0)  # a hung NVML call is left behind in its daemon thread

    def latest(self) -> GpuAttribution | None:
        """The last mapping, without the processes that have exited since (they are off the GPU:
        NVML no longer lists them); one gone wakes the thread to map the GPUs again now."""
        with self._lock:
            found = self._latest
        if found is None:
            return None
        alive = without_exited(found, self._exists)
        if alive is not found:
            self._wake.set()
        return alive

    @staticmethod
    def _exists(pid: int) -> bool:
        # NVML's pids are this PID namespace's, as the process table attribution walks (psutil).
        return bool(psutil.pid_exists(pid))


def without_exited(found: GpuAttribution, exists: Callable[[int], bool]) -> GpuAttribution:
    """`found` without the processes `exists` says are gone; `found` itself when none is."""
    pids = {service: tuple(pid for pid in held if exists(pid)) for service, held in found.pids.items()}
    unattributed = tuple(process for process in found.unattributed if exists(process.pid))
    if pids == found.pids and unattributed == found.unattributed:
        return found
    return replace(found, pids=pids, unattributed=unattributed)


class InferenceMonitor:
    """Everything inference-aware the daemon runs, behind four calls:

    - `start()` / `stop()`: the scrape and attribution threads;
    - `on_loop(samples, events)` once per loop: the window's GPU history, and the
      `service_latency_regression` events to add to the loop's events;
    - `figures()` and `attribution()` for the snapshot (metrics, status); the figures carry
      tokens per joule, from the GPUs' energy kept here.
    """

    def __init__(
        self,
        config: AgentConfig,
        get_backend: Callable[[], GpuBackend | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.scraper = ServiceScraper(config.services)
        self.watch = LatencyRegressionWatch(config, clock=clock)
        self.attributor = GpuAttributor(config, get_backend)
        # Longer than the window by a margin: the window's oldest scrape needs a reading before it.
        self.energy = EnergyHistory(DEFAULT_WINDOW_SECONDS + ENERGY_MARGIN_SECONDS)
        self.service_energy = ServiceEnergy()  # the joules of each service's GPUs, as a counter

    def start(self) -> None:
        self.scraper.start()
        self.attributor.start()

    def stop(self) -> None:
        self.scraper.stop()
        self.attributor.stop()

    def on_loop(self, samples: Sequence[GpuSample], events: Sequence[Event]) -> list[Event]:
        self.watch.observe(samples, events)
        self.energy.add(samples)
        attribution = self.attributor.latest()
        known = self.energy.gpus()
        self.service_energy.add(
            samples, {service.name: service_gpus(service, attribution, known) for service in self.config.services}
        )
        return self.watch.evaluate(self.scraper.figures())

    def figures(self) -> dict[str, ServiceFigures]:
        found = self.scraper.figures()
        attribution = self.attributor.latest()
        known = self.energy.gpus()
        efficient: dict[str, ServiceFigures] = {}
        for service in self.config.services:
            figures = found.get(service.name)
            if figures is None:
                continue
            gpus = service_gpus(service, attribution, known)
            ratio = window_tokens_per_joule(figures.generated_tokens_history, self.energy, gpus)
            counters = figures.counters or ServiceCounters()
            counters = replace(counters, gpu_energy_joules=self.service_energy.joules(service.name))
            efficient[service.name] = replace(figures, tokens_per_joule=ratio, counters=counters)
        return efficient

    def breaches(self) -> tuple[SloBreachNow, ...]:
        return self.watch.breaches()

    def attribution(self) -> GpuAttribution | None:
        return self.attributor.latest()


#: A one-off read (`status --direct`) waits at most this long for one server's /metrics.
ONE_OFF_SCRAPE_SECONDS = 2.0


def read_once(config: AgentConfig, backend: GpuBackend) -> tuple[dict[str, ServiceFigures], GpuAttribution | None]:
    """What `status --direct` can know without a daemon: one scrape per service (its gauges; latency
    quantiles need two scrapes a window apart) and one mapping of GPU processes to services."""
    scraper = ServiceScraper(config.services)
    for service in config.services:
        if service.effective_metrics_url is not None:
            scraper.scrape_once(service.name, min(service.probe_timeout_seconds, ONE_OFF_SCRAPE_SECONDS))
    try:
        attribution = GpuAttributor(config, lambda: backend).attribute_once()
    except GpuError as exc:
        log.debug("GPU process attribution failed", error=str(exc))
        attribution = None
    return scraper.figures(), attribution
