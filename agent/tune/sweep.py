"""The sweep job: set, settle, measure, stop early where it must; the originals go back whatever happens.

`TuneJob.run` runs on the action worker (agent.daemon.action_worker `Task`), inside a hardware
transaction (agent.policy.holds `PolicyHolds.run`): the ledger holds the swept item off the policy
loop, reads and journals every GPU's original setting before the first change, every step's setting
is written through the transaction, and the originals go back on every way out of the job (the end,
an SLO breach, thin or uneven traffic, an abort, an error of any type, a reload that takes the
write away or removes the service, the agent stopping; after a kill -9 the next start's recovery).
Each measured step is journaled in the tune's row as it completes; `ended` closes the row with what
the transaction put back, however the job ended, so no row stays `running` once its job is over.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Protocol

from agent.backend.base import ClockDomain, GpuBackend
from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.logs import get_logger
from agent.policy.holds import PolicyHolds
from agent.policy.transaction import Ending, HardwareTransaction, JobStop, retried
from agent.store.database import Store, StoreError
from agent.tune.defaults import KNOB_UNITS, POLICY_ITEMS
from agent.tune.measure import measure_step, wait_settled
from agent.tune.model import Original, StepReading, TuneDocument
from agent.tune.recommend import recommend, thin_traffic, uneven_traffic

log = get_logger()


class TuneStop(JobStop):
    """The sweep ends early, for the reason given (state: stopped | aborted | failed)."""


def hold_owner(row_id: int) -> str:
    return f"tune-{row_id}"


def originals_of(transaction: HardwareTransaction, kind: str) -> tuple[Original, ...]:
    """The transaction's originals as the tune document shows them, GPU by GPU."""
    originals: list[Original] = []
    for (_item, gpu), value in sorted(transaction.originals.items(), key=lambda entry: entry[0][1]):
        if kind == "power":
            originals.append(Original(gpu, power_limit_watts=value if isinstance(value, float | int) else None))
        else:
            lock = value if isinstance(value, tuple) else None
            originals.append(Original(gpu, locked_graphics_mhz=lock, locked=lock is not None))
    return tuple(originals)


class SweepNode(Protocol):
    """What a sweep reads of the running daemon (its live parts), each when it needs it: the backend
    and the store of the moment, the ledger that holds the swept settings, the wall clock."""

    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def holds(self) -> PolicyHolds: ...
    def current_backend(self) -> GpuBackend | None: ...
    def current_store(self) -> Store | None: ...


class TuneJob:
    """One sweep (see the module docstring); `document` is shared with the runner, which reads it
    under `lock` for `tune status`."""

    def __init__(self, document: TuneDocument, service: ServiceConfig, node: SweepNode) -> None:
        self.document = document
        self.service = service
        self.node = node
        self.lock = threading.Lock()
        kind = document.request.kind
        self.name = f"tune {kind} sweep {document.id} of service {service.name}"
        self.owner = hold_owner(document.id)
        self.reason = f"tune sweep {document.id} drives it"
        self.keys = tuple((POLICY_ITEMS[kind], gpu) for gpu in document.gpus)
        self.gpus: frozenset[int] | None = frozenset(document.measured_gpus)  # what the action worker keeps free
        self._aborted = threading.Event()
        self._abort_reason = ""
        self._result = ("done", "")  # how the body ended when it returned
        self.finished = threading.Event()

    def abort(self, reason: str) -> None:
        if not self._aborted.is_set():
            self._abort_reason = reason
            self._aborted.set()

    def aborted(self) -> bool:
        return self._aborted.is_set()

    def conflict(self, config: AgentConfig) -> str | None:
        """Why a reload to `config` ends the sweep: its service gone, or measured elsewhere now."""
        service = next((s for s in config.services if s.name == self.service.name), None)
        if service is None:
            return f"service {self.service.name} is no longer configured"
        if (service.effective_metrics_url, service.gpus) != (self.service.effective_metrics_url, self.service.gpus):
            return f"service {self.service.name}'s metrics URL or GPUs changed"
        return None

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> None:
        self.node.holds.run(self, self.node.current_backend())

    def body(self, transaction: HardwareTransaction) -> None:
        """Inside the transaction: the originals are read, held and journaled already."""
        if self.aborted():
            raise TuneStop("aborted", f"aborted before it started: {self._abort_reason}")
        with self.lock:
            self.document.originals = originals_of(transaction, self.document.request.kind)
        self._save()
        state, detail = self._sweep(transaction)
        with self.lock:
            measured = copy.deepcopy(self.document)
        recommendation, why = recommend(measured)
        with self.lock:
            self.document.recommendation = recommendation
        if recommendation is None and self._steps():
            detail = "; ".join(part for part in (detail, f"no recommendation: {why}") if part)
        self._result = (state, detail)

    def ended(self, ending: Ending) -> None:
        """However the job ended: close the row with what was put back (see the module docstring)."""
        state, detail = self._result if ending.error is None else (ending.state, ending.detail)
        if ending.not_restored:
            state = "failed"
        parts = [detail] if detail else []
        if ending.error is not None and self._steps():
            parts.append("no recommendation: the sweep did not finish")
        parts.append(ending.restore_note())
        self._close(state, "; ".join(parts))
        self.finished.set()

    def _steps(self) -> list[StepReading]:
        with self.lock:
            return list(self.document.steps)

    def _current_setting(self, backend: GpuBackend) -> float:
        """The baseline's setting: the first GPU's original limit, or its lock's top (its maximum clock unlocked)."""
        original = self.document.originals[0]
        if self.document.request.kind == "power":
            assert original.power_limit_watts is not None  # the transaction read it for power sweeps
            return float(round(original.power_limit_watts, 3))
        if original.locked_graphics_mhz is not None:
            return float(original.locked_graphics_mhz[1])
        return float(backend.max_clock_mhz(original.gpu, ClockDomain.GRAPHICS))

    def _sweep(self, transaction: HardwareTransaction) -> tuple[str, str]:
        """Every step measured: ("done", ""), or ("stopped", why) where the traffic or the SLO says
        the descent must end; an abort or a failure raises."""
        backend = transaction.backend
        request = self.document.request
        current = self._current_setting(backend)
        uniform = len({(o.power_limit_watts, o.locked_graphics_mhz) for o in self.document.originals}) == 1
        settings = request.settings()
        # The node as it runs now is the reference: measured first, as a step of its own unless the
        # sweep sets that very value (a clock sweep from an unlocked GPU always measures it apart).
        unlocked = request.kind == "clocks" and not self.document.originals[0].locked
        separate_baseline = unlocked or not uniform or current not in settings
        plan: list[tuple[float, bool, bool]] = [(current, True, False)] if separate_baseline else []
        plan += [(s, s == current and not separate_baseline, True) for s in settings]
        total = len(plan)
        per_step = request.dwell_seconds + 1.0
        first: StepReading | None = None
        for number, (setting, is_baseline, change) in enumerate(plan, start=1):
            left = (total - number + 1) * per_step
            self._progress(number, total, setting, left, "settling")
            if change:
                self._save()  # the step it is about to set, journaled first: recovery can say where it stopped
                self._set(transaction, setting)
            if not wait_settled(backend, self.document.measured_gpus, request.settle_seconds, self.aborted):
                raise TuneStop("aborted", self._abort_reason)
            self._progress(number, total, setting, left - 1.0, "measuring")
            reading = measure_step(
                backend,
                self.document.measured_gpus,
                self.service,
                setting,
                baseline=is_baseline,
                dwell_seconds=request.dwell_seconds,
                aborted=self.aborted,
            )
            if reading is None or self.aborted():  # an abort may have put the originals back meanwhile
                raise TuneStop("aborted", self._abort_reason)
            thin = thin_traffic(reading, request.min_request_rate)
            if thin is not None:
                return "stopped", f"traffic too thin to measure at {setting:g}: {thin}"
            if first is not None:
                uneven = uneven_traffic(first, reading, request.max_traffic_change)
                if uneven is not None:
                    return "stopped", f"traffic too uneven to compare at {setting:g}: {uneven}"
            first = first or reading
            with self.lock:
                self.document.steps.append(reading)
            self._save()
            if reading.slo_breaches:
                unit = KNOB_UNITS[request.kind]
                where = "at the current setting" if is_baseline else f"at {setting:g} {unit}"
                return "stopped", f"SLO missed {where} ({'; '.join(reading.slo_breaches)}): descent stopped"
        return "done", ""

    def _set(self, transaction: HardwareTransaction, setting: float) -> None:
        item = POLICY_ITEMS[self.document.request.kind]
        for gpu in self.document.gpus:
            if self.document.request.kind == "power":
                transaction.write(item, gpu, setting)
            else:
                transaction.write(item, gpu, (int(setting), int(setting)))

    # -- progress and the journal -------------------------------------------------------------------

    def _progress(self, number: int, total: int, setting: float, seconds_left: float, doing: str) -> None:
        with self.lock:
            self.document.progress = {
                "step": number,
                "steps": total,
                "setting": setting,
                "seconds_left": round(max(0.0, seconds_left), 1),
                "doing": doing,
            }

    def _save(self, finished: bool = False) -> None:
        store = self.node.current_store()
        if store is None:
            raise StoreError("no store: a sweep never runs unjournaled")
        with self.lock:
            document = self.document.to_json()
        store.save_tune(self.document.id, document, self.node.clock() if finished else None)

    def _close(self, state: str, detail: str) -> None:
        with self.lock:
            self.document.state = state  # type: ignore[assignment]  # one of TuneDocument's states
            self.document.detail = detail
            self.document.finished_seconds = self.node.clock()
            self.document.progress = {}
        log.info("tune finished", tune=self.document.id, state=state, detail=detail)
        failure = retried(lambda: self._save(finished=True))
        if failure is not None:  # left running: the next start closes it as interrupted
            log.error("could not journal the end of a tune", error=str(failure), tune=self.document.id)


def close_interrupted(document: TuneDocument, store: Store, clock: Callable[[], float], what: str) -> None:
    """Close a sweep an earlier run left `running` (kill -9, a crash): `what` says what recovery did."""
    where = document.progress.get("setting")
    at = f", at {where:g}" if isinstance(where, float | int) else ""
    document.state = "interrupted"
    document.detail = f"interrupted (the agent stopped during the sweep{at}); {what}"
    document.finished_seconds = clock()
    document.progress = {}
    log.warning("interrupted tune closed", tune=document.id, detail=document.detail)
    try:
        store.save_tune(document.id, document.to_json(), document.finished_seconds)
    except StoreError as exc:
        log.error("could not close an interrupted tune", error=str(exc), tune=document.id)
