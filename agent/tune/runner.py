"""The daemon's side of `gpu-agent tune`: the API methods, the refusals, the job on the action
worker, the recovery of a sweep an earlier run left half-done, the last tune for `status` and the
last measured sweep of each service and kind for /metrics.

Refusals (before anything is journaled or changed), each with its reason: a request out of bounds
(`checked_request`); the item the sweep turns (`power_limit`, `locked_clocks`) is not in enforce
mode; the service is unknown, has no metrics, is down or not probed yet; its traffic over the
daemon's latency window is below the floor; another tune, a remediation or a queued action is
running; the GPUs asked for are not the service's; a step a GPU does not accept; and, unless
`--force`, a sick subject (agent.tune.preflight).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from agent.api import ApiError
from agent.config import AgentConfig, Mode
from agent.config.service_entry import ServiceConfig
from agent.logs import get_logger
from agent.state import TuneResult, TuneStepFigures
from agent.store.database import StoreError
from agent.tune.defaults import POLICY_ITEMS
from agent.tune.model import TuneDocument, TuneRequest
from agent.tune.passive import PowerHistory, passive_report
from agent.tune.preflight import identities, setting_range, sick_subject, swept_gpus
from agent.tune.sweep import SweepNode, TuneJob, close_interrupted, hold_owner

if TYPE_CHECKING:
    from agent.services.monitor import InferenceMonitor
    from agent.services.prober import HealthProber
    from agent.state import NodeSnapshot

log = get_logger()

#: The API methods that change the node: only root or the agent's own user may call them.
PRIVILEGED_METHODS = frozenset({"tune_start", "tune_abort"})
MAX_STEPS = 64
MIN_DWELL_SECONDS = 1.0
MAX_DWELL_SECONDS = 3600.0
#: The longest sweep accepted, all steps with their settling included: a sweep holds its GPUs at
#: settings the operator did not choose, so it is an experiment of a sitting, not a day.
MAX_SWEEP_SECONDS = 2 * 3600.0


#: Sweep states whose steps measured what they meant to: the last of them is what /metrics shows.
MEASURED_STATES = ("done", "stopped")


class TaskQueue(Protocol):
    """Where a sweep runs: the action worker's lanes (agent/daemon/lanes.py), behind whatever touches
    the sweep's GPUs, and what they are busy with (None: the node is quiet)."""

    def submit_task(self, task: TuneJob) -> None: ...
    def busy(self) -> str | None: ...


class TuneNode(SweepNode, Protocol):
    """What the advisor reads of the running daemon (its live parts, agent/daemon/live.py), each when
    it needs it: what a sweep reads (the backend and the store of the moment, the ledger that holds
    its settings, the clock), and the config a reload swapped in, the lanes a sweep runs on, the
    services' probes and figures, the GPUs the collector knows and the last published snapshot (the
    GPUs that answer, their identities and health: the preflight's)."""

    @property
    def config(self) -> AgentConfig: ...
    @property
    def lanes(self) -> TaskQueue: ...
    @property
    def prober(self) -> HealthProber: ...
    @property
    def inference(self) -> InferenceMonitor: ...
    def gpu_count(self) -> int: ...
    def snapshot(self) -> NodeSnapshot | None: ...


class TuneRunner:
    def __init__(self, *, node: TuneNode) -> None:
        self.node = node
        self.job: TuneJob | None = None
        self._measured: dict[tuple[str, str], TuneResult] = {}  # (service, kind) -> its last measured sweep
        self._measured_id = 0  # the newest sweep taken into it
        self.history = PowerHistory()  # fed every loop by the daemon (observe), kept for --passive
        self._lock = threading.Lock()  # one start at a time
        self._interrupted: dict[str, TuneDocument] = {}  # sweeps an earlier run left, by hold owner
        node.holds.on_recovered(self._recovered)

    # -- the API ------------------------------------------------------------------------------------

    def handlers(self) -> dict[str, Callable[[Mapping[str, Any]], Any]]:
        return {
            "tune_start": self.start,
            "tune_status": self.status,
            "tune_abort": self.abort,
            "tune_passive": self.passive,
        }

    def passive(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Advice from the node's history; changes nothing (and so needs no enforce mode)."""
        name = str(params.get("service", ""))
        service = next((s for s in self.node.config.services if s.name == name), None)
        if service is None:
            raise ApiError(f"no service named {name!r}")
        store = self.node.current_store()
        if store is None:
            raise ApiError("the state database is unavailable")
        self.history.flush(store, force=True)
        slo = service.slo.e2e_p95_seconds if service.slo is not None else None
        return passive_report(name, store.history(name), slo)

    def start(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Check, journal and queue a sweep (the job holds its GPUs' item once it runs); its document
        (state running) or ApiError(reason)."""
        request = checked_request(params)
        with self._lock:
            config = self.node.config
            service = self._check(config, request)
            gpus, service_gpus = self._gpus(request, service)
            backend, snapshot = self.node.current_backend(), self.node.snapshot()
            if backend is None or snapshot is None:
                raise ApiError("refused: the daemon has not read the GPUs yet; try again in a moment")
            bounds = setting_range(backend, request, gpus)
            sick = sick_subject(snapshot, service.name, service_gpus, self.node.inference.figures().get(service.name))
            if sick and not request.force:
                raise ApiError(
                    f"refused: {'; '.join(sick)}: a sweep would measure that, not the setting (--force sweeps anyway)"
                )
            swept = swept_gpus(config.policy, identities(snapshot), gpus)
            store = self.node.current_store()
            if store is None:
                raise ApiError("refused: the state database is unavailable, and a sweep never runs unjournaled")
            started = self.node.clock()
            slo = service.slo
            objectives = {}
            if slo is not None:
                objectives = {
                    k: v for k, v in (("e2e_p95", slo.e2e_p95_seconds), ("ttft_p95", slo.ttft_p95_seconds)) if v
                }
            document = TuneDocument(
                0,
                request,
                gpus,
                (),
                "running",
                started,
                slo=objectives,
                service_gpus=service_gpus,
                swept=swept,
                setting_range=bounds,
            )
            try:
                document.id = store.begin_tune(started, document.to_json())
            except StoreError as exc:
                raise ApiError(f"refused: cannot journal the sweep: {exc}") from exc
            node = self.node
            job = TuneJob(document, service, node)
            self.job = job
            node.lanes.submit_task(job)
        log.info("tune started", tune=document.id, kind=request.kind, service=service.name, gpus=list(gpus))
        with job.lock:
            return document.to_json()

    def status(self, params: Mapping[str, Any]) -> dict[str, Any] | None:
        """A tune's document: `id`'s, else the running one, else the last one."""
        wanted = params.get("id")
        job = self.job
        if job is not None and (wanted is None or wanted == job.document.id):
            with job.lock:
                return job.document.to_json()
        store = self.node.current_store()
        if store is None:
            return None
        row = store.tune(int(wanted)) if wanted is not None else store.last_tune()
        return row.document if row is not None else None

    def abort(self, params: Mapping[str, Any]) -> dict[str, Any]:
        job = self.job
        if job is None or job.finished.is_set():
            raise ApiError("no tune is running")
        job.abort(str(params.get("reason") or "aborted by gpu-agent tune --abort"))
        return {"id": job.document.id, "aborting": True}

    def results(self) -> tuple[TuneResult, ...]:
        """The last measured sweep of each service and kind (/metrics): read from the store at start
        (`recover`), then taken from each sweep as it ends, never from the store on the loop."""
        job = self.job
        if job is not None and job.finished.is_set() and job.document.id > self._measured_id:
            with job.lock:
                document = job.document.to_json()
            self._take(document)
        return tuple(self._measured.values())

    def _take(self, document: dict[str, Any]) -> None:
        self._measured_id = max(self._measured_id, int(document.get("id") or 0))
        result = measured_result(document)
        if result is not None:
            self._measured[(result.service, result.kind)] = result

    def last(self) -> dict[str, Any] | None:
        """The last tune, short, for `status`."""
        try:
            document = self.status({})
        except StoreError:
            return None
        return summary(document) if document else None

    # -- recovery at start ---------------------------------------------------------------------------

    def recover(self) -> None:
        """Close the sweeps an earlier run left running (before the first loop): one whose settings
        the hold journal still holds once recovery has put them back (`holds.recover`, run first),
        any other at once (it was stopped before its first change, or after its restore)."""
        store = self.node.current_store()
        if store is None:
            return
        try:
            rows = store.running_tunes()
            for measured in store.last_measured_tunes():
                self._take(measured.document)
        except StoreError as exc:
            log.error("cannot read the tune journal: an interrupted sweep is not closed", error=str(exc))
            return
        for row in rows:
            document = TuneDocument.from_json(row.document)
            if self.node.holds.recovering(hold_owner(document.id)):
                with self._lock:
                    self._interrupted[hold_owner(document.id)] = document
            else:
                close_interrupted(document, store, self.node.clock, "nothing left to put back")

    def _recovered(self, owner: str, what: str) -> None:
        """The hold journal's recovery put back (or not) what sweep `owner` left changed."""
        with self._lock:
            document = self._interrupted.pop(owner, None)
        store = self.node.current_store()
        if document is not None and store is not None:
            close_interrupted(document, store, self.node.clock, what)

    # -- checks --------------------------------------------------------------------------------------

    def _check(self, config: AgentConfig, request: TuneRequest) -> ServiceConfig:
        item = POLICY_ITEMS[request.kind]
        if config.item_mode(item) is not Mode.ENFORCE:
            raise ApiError(
                f"refused: {item} is in observe mode; a sweep changes it, so it needs mode: enforce"
                f" (or policy.modes.{item}: enforce)"
            )
        service = next((s for s in config.services if s.name == request.service), None)
        if service is None:
            names = ", ".join(s.name for s in config.services) or "none"
            raise ApiError(f"refused: no service named {request.service!r} (configured: {names})")
        if service.effective_metrics_url is None:
            raise ApiError(f"refused: service {service.name} has no metrics (set metrics_url or health_url)")
        status = next((s for s in self.node.prober.statuses() if s.name == service.name), None)
        if status is None or status.up is None:
            raise ApiError(f"refused: service {service.name} has not been probed yet; try again in a moment")
        if not status.up:
            raise ApiError(f"refused: service {service.name} is down ({status.detail or 'failing its probe'})")
        self._check_traffic(service, request)
        job = self.job
        if job is not None and not job.finished.is_set():
            raise ApiError(f"refused: tune {job.document.id} is running (gpu-agent tune --abort stops it)")
        busy = self.node.lanes.busy()
        if busy is not None:
            raise ApiError(f"refused: {busy}; a sweep waits for the node to be quiet")
        store = self.node.current_store()
        if store is not None and store.running_remediations():
            raise ApiError("refused: a remediation is running")
        return service

    def _check_traffic(self, service: ServiceConfig, request: TuneRequest) -> None:
        figures = self.node.inference.figures().get(service.name)
        e2e = figures.latency.get("e2e") if figures is not None else None
        if figures is None or e2e is None or figures.window_seconds <= 0:
            raise ApiError(f"refused: no request figures from service {service.name}'s metrics yet")
        rate = e2e.requests / figures.window_seconds
        if rate < request.min_request_rate:
            raise ApiError(
                f"refused: traffic too thin to measure: {rate:.2f} requests/s over the last"
                f" {figures.window_seconds:.0f} s (floor {request.min_request_rate:g}/s)"
            )

    def _gpus(self, request: TuneRequest, service: ServiceConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The GPUs to sweep, and all of the service's (each step measures them all)."""
        own = list(range(self.node.gpu_count())) if service.gpus == "all" else list(service.gpus)
        if not own:
            raise ApiError(f"refused: no GPUs known for service {service.name}")
        if request.gpus is None:
            return tuple(own), tuple(own)
        foreign = [g for g in request.gpus if g not in own]
        if foreign:
            raise ApiError(
                f"refused: GPU {foreign[0]} is not one of service {service.name}'s GPUs"
                f" ({', '.join(map(str, own))}); its tokens/J counts only those"
            )
        return tuple(sorted(set(request.gpus))), tuple(own)


def checked_request(params: Mapping[str, Any]) -> TuneRequest:
    """The request from the API's params, checked; ApiError naming what is wrong."""
    try:
        request = TuneRequest.from_json(dict(params))
    except (TypeError, ValueError, KeyError) as exc:
        raise ApiError(f"bad tune request: {exc}") from exc
    if request.kind not in POLICY_ITEMS:
        raise ApiError(f"bad tune request: kind must be one of {', '.join(POLICY_ITEMS)}")
    if request.step <= 0 or request.start <= 0 or request.stop <= 0:
        raise ApiError("bad tune request: --from, --to and --step must be positive")
    if not MIN_DWELL_SECONDS <= request.dwell_seconds <= MAX_DWELL_SECONDS:
        raise ApiError(f"bad tune request: --dwell must be {MIN_DWELL_SECONDS:g}-{MAX_DWELL_SECONDS:g} s")
    if not 0 <= request.throughput_tolerance < 1 or not request.max_traffic_change > 0:
        raise ApiError("bad tune request: tolerances must be ratios (0.05 = 5 %)")
    if not request.min_request_rate > 0:
        raise ApiError("bad tune request: --min-request-rate must be positive")
    if not isinstance(request.force, bool):
        raise ApiError("bad tune request: force is true or false")
    if len(request.settings()) > MAX_STEPS:
        raise ApiError(f"bad tune request: more than {MAX_STEPS} steps; use a larger --step")
    if not 0 <= request.settle_seconds <= MAX_DWELL_SECONDS:
        raise ApiError(f"bad tune request: the settle time must be 0-{MAX_DWELL_SECONDS:g} s")
    # Every step settles, then dwells; the current setting may be measured as a step of its own.
    steps = len(request.settings()) + 1
    longest = steps * (request.settle_seconds + request.dwell_seconds)
    if longest > MAX_SWEEP_SECONDS:
        raise ApiError(
            f"bad tune request: the sweep could take {_duration(longest)} ({steps} steps x"
            f" ({request.dwell_seconds:g} s dwell + {request.settle_seconds:g} s settle)); at most"
            f" {_duration(MAX_SWEEP_SECONDS)}: fewer steps (a larger --step) or a shorter --dwell"
        )
    return request


def measured_result(document: dict[str, Any]) -> TuneResult | None:
    """A sweep's figures for /metrics; None for one that did not measure to its end (running,
    aborted, failed, interrupted: its figures stand for nothing) or measured no step."""
    if document.get("state") not in MEASURED_STATES or not document.get("steps"):
        return None
    parsed = TuneDocument.from_json(document)
    recommendation = parsed.recommendation
    model = parsed.swept[0].model if parsed.swept else (recommendation.gpu_model if recommendation else "")
    # A setting measured twice (the current one apart from the sweep's own step): the sweep's step counts.
    by_setting = {s.setting: s for s in sorted(parsed.steps, key=lambda s: not s.baseline)}
    return TuneResult(
        service=parsed.request.service,
        kind=parsed.request.kind,
        gpu_model=model,
        finished_seconds=parsed.finished_seconds or parsed.started_seconds,
        steps=tuple(
            TuneStepFigures(s.setting, s.tokens_per_joule, s.tokens_per_second, s.e2e_p95_seconds)
            for _, s in sorted(by_setting.items())
        ),
        recommended=recommendation.setting if recommendation is not None else None,
    )


def _duration(seconds: float) -> str:
    hours, minutes = divmod(round(seconds / 60), 60)
    return " ".join(part for part in (f"{hours} h" if hours else "", f"{minutes} min" if minutes else "") if part)


def summary(document: dict[str, Any]) -> dict[str, Any]:
    """The last tune in a few fields (status)."""
    request = document.get("request", {})
    recommendation = document.get("recommendation") or {}
    return {
        "id": document.get("id"),
        "kind": request.get("kind"),
        "service": request.get("service"),
        "state": document.get("state"),
        "started_seconds": document.get("started_seconds"),
        "finished_seconds": document.get("finished_seconds"),
        "steps": len(document.get("steps", [])),
        "recommended": recommendation.get("setting"),
        "tokens_per_joule_change_ratio": recommendation.get("tokens_per_joule_change_ratio"),
        "tokens_per_second_change_ratio": recommendation.get("tokens_per_second_change_ratio"),
        "detail": document.get("detail", ""),
    }
