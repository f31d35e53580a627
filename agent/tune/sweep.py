"""The sweep job: hold, set, settle, measure, stop early where it must, put the originals back.

`TuneJob.run` runs on the action worker's thread (agent.daemon.action_worker `Task`). Before its
first change it reads and journals every GPU's original setting; each measured step is journaled
as it completes; the originals go back on every way out (the end, an SLO breach, thin or uneven
traffic, an abort, an error), and only then is the hold on the policy loop released.
`RecoveryJob` does the same restore for a sweep an earlier run left `running` in the journal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from agent.backend.base import ClockDomain, GpuBackend
from agent.backend.errors import GpuError, WriteRefused
from agent.config import ServiceConfig
from agent.logger import get_logger
from agent.policy.holds import PolicyHolds
from agent.store.database import Store, StoreError
from agent.tune.defaults import KNOB_UNITS
from agent.tune.measure import MeasureError, measure_step, wait_settled
from agent.tune.model import Original, StepReading, TuneDocument
from agent.tune.recommend import recommend, thin_traffic, uneven_traffic

log = get_logger()

#: How long recovery waits for the GPU backend to open after a start before it gives up for this run.
RECOVERY_BACKEND_WAIT_SECONDS = 120.0


class TuneStop(Exception):
    """The sweep ends early, for the reason given (state: stopped | failed)."""

    def __init__(self, state: str, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


def hold_owner(row_id: int) -> str:
    return f"tune-{row_id}"


def read_originals(backend: GpuBackend, kind: str, gpus: tuple[int, ...]) -> tuple[Original, ...]:
    originals: list[Original] = []
    for gpu in gpus:
        if kind == "power":
            originals.append(Original(gpu, power_limit_watts=backend.power_limit_watts(gpu)))
        else:
            lock = backend.locked_clocks_mhz(gpu, ClockDomain.GRAPHICS)
            originals.append(Original(gpu, locked_graphics_mhz=lock, locked=lock is not None))
    return tuple(originals)


def restore(backend: GpuBackend, kind: str, originals: tuple[Original, ...]) -> list[str]:
    """Put every original back; what was done or failed, one line per GPU (never raises)."""
    done: list[str] = []
    for original in originals:
        gpu = original.gpu
        try:
            if kind == "power" and original.power_limit_watts is not None:
                backend.set_power_limit_watts(gpu, original.power_limit_watts)
                done.append(f"GPU {gpu} power limit {original.power_limit_watts:g} W")
            elif kind == "clocks" and original.locked_graphics_mhz is not None:
                low, high = original.locked_graphics_mhz
                backend.set_locked_clocks_mhz(gpu, ClockDomain.GRAPHICS, low, high)
                done.append(f"GPU {gpu} clocks locked {low}-{high} MHz")
            elif kind == "clocks":
                backend.reset_locked_clocks(gpu, ClockDomain.GRAPHICS)
                done.append(f"GPU {gpu} clocks unlocked")
        except (GpuError, WriteRefused) as exc:
            done.append(f"GPU {gpu} NOT restored: {exc}")
    return done


class TuneJob:
    """One sweep (see the module docstring); `document` is shared with the runner, which reads it
    under `lock` for `tune status`."""

    def __init__(
        self,
        document: TuneDocument,
        service: ServiceConfig,
        backend: Callable[[], GpuBackend | None],
        store: Callable[[], Store | None],
        holds: PolicyHolds,
        clock: Callable[[], float],
        gpu_model: Callable[[GpuBackend, int], str],
    ) -> None:
        self.document = document
        self.service = service
        self.backend = backend
        self.store = store
        self.holds = holds
        self.clock = clock
        self.gpu_model = gpu_model
        self.lock = threading.Lock()
        self.name = f"tune {document.request.kind} sweep {document.id} of service {service.name}"
        self._aborted = threading.Event()
        self._abort_reason = ""
        self.finished = threading.Event()

    def abort(self, reason: str) -> None:
        if not self._aborted.is_set():
            self._abort_reason = reason
            self._aborted.set()

    def aborted(self) -> bool:
        return self._aborted.is_set()

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> None:
        backend = self.backend()
        originals_read = False
        try:
            if backend is None:
                raise TuneStop("failed", "GPU backend unavailable")
            if self.aborted():
                raise TuneStop("aborted", f"aborted before it started: {self._abort_reason}")
            self._check_settings(backend)
            with self.lock:
                self.document.originals = read_originals(backend, self.document.request.kind, self.document.gpus)
            self._save()  # journaled before the first change: a kill -9 from here on is rolled back
            originals_read = True
            self._sweep(backend)
            self._finish(backend, "done", "")
        except TuneStop as stop:
            self._end(backend, originals_read, stop.state, stop.detail)
        except (GpuError, WriteRefused, MeasureError, StoreError) as exc:
            self._end(backend, originals_read, "failed", str(exc))
        finally:
            self.holds.release(hold_owner(self.document.id))
            self.finished.set()

    def _end(self, backend: GpuBackend | None, originals_read: bool, state: str, detail: str) -> None:
        if backend is not None and originals_read:
            self._finish(backend, state, detail)
            return
        self._close(state, detail)

    def _check_settings(self, backend: GpuBackend) -> None:
        """Every step must be settable on every GPU before the first change."""
        request = self.document.request
        settings = request.settings()
        if not settings:
            raise TuneStop("failed", "no settings between --from and --to")
        unit = KNOB_UNITS[request.kind]
        for gpu in self.document.gpus:
            if request.kind == "power":
                low, high = backend.power_limit_constraints_watts(gpu)
                outside = [s for s in settings if not low <= s <= high]
                if outside:
                    raise TuneStop(
                        "failed", f"{outside[0]:g} {unit} is outside GPU {gpu}'s power limit range {low:g}-{high:g} W"
                    )
            else:
                memory = backend.supported_memory_clocks_mhz(gpu)[0]
                supported = set(backend.supported_graphics_clocks_mhz(gpu, memory))
                unsupported = [s for s in settings if int(s) != s or int(s) not in supported]
                if unsupported:
                    raise TuneStop("failed", f"{unsupported[0]:g} MHz is not a supported graphics clock of GPU {gpu}")

    def _current_setting(self, backend: GpuBackend) -> float:
        """The baseline's setting: the first GPU's original limit, or its lock's top (its maximum clock unlocked)."""
        original = self.document.originals[0]
        if self.document.request.kind == "power":
            assert original.power_limit_watts is not None  # read_originals sets it for power sweeps
            return float(round(original.power_limit_watts, 3))
        if original.locked_graphics_mhz is not None:
            return float(original.locked_graphics_mhz[1])
        return float(backend.max_clock_mhz(original.gpu, ClockDomain.GRAPHICS))

    def _sweep(self, backend: GpuBackend) -> None:
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
                self._set(backend, setting)
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
            if reading is None:
                raise TuneStop("aborted", self._abort_reason)
            thin = thin_traffic(reading, request.min_request_rate)
            if thin is not None:
                raise TuneStop("stopped", f"traffic too thin to measure at {setting:g}: {thin}")
            if first is not None:
                uneven = uneven_traffic(first, reading, request.max_traffic_change)
                if uneven is not None:
                    raise TuneStop("stopped", f"traffic too uneven to compare at {setting:g}: {uneven}")
            first = first or reading
            with self.lock:
                self.document.steps.append(reading)
            self._save()
            if reading.slo_breaches:
                unit = KNOB_UNITS[request.kind]
                where = "at the current setting" if is_baseline else f"at {setting:g} {unit}"
                raise TuneStop("stopped", f"SLO missed {where} ({'; '.join(reading.slo_breaches)}): descent stopped")

    def _set(self, backend: GpuBackend, setting: float) -> None:
        for gpu in self.document.gpus:
            if self.document.request.kind == "power":
                backend.set_power_limit_watts(gpu, setting)
            else:
                backend.set_locked_clocks_mhz(gpu, ClockDomain.GRAPHICS, int(setting), int(setting))

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
        store = self.store()
        if store is None:
            raise StoreError("no store: a sweep never runs unjournaled")
        with self.lock:
            document = self.document.to_json()
        store.save_tune(self.document.id, document, self.clock() if finished else None)

    def _finish(self, backend: GpuBackend, state: str, detail: str) -> None:
        restored = restore(backend, self.document.request.kind, self.document.originals)
        failed = [line for line in restored if "NOT restored" in line]
        note = f"restored: {', '.join(restored) or 'nothing changed'}"
        with self.lock:
            steps = list(self.document.steps)
        if failed:
            state = "failed"
        recommendation, why = None, "the sweep did not finish"
        if state in ("done", "stopped"):  # a sweep cut short by an abort or a failure recommends nothing
            gpu_model = self.gpu_model(backend, self.document.gpus[0])
            recommendation, why = recommend(self.document.request, steps, gpu_model)
        with self.lock:
            self.document.recommendation = recommendation
        parts = [detail] if detail else []
        if recommendation is None and steps:
            parts.append(f"no recommendation: {why}")
        parts.append(note)
        self._close(state, "; ".join(parts))

    def _close(self, state: str, detail: str) -> None:
        with self.lock:
            self.document.state = state  # type: ignore[assignment]  # one of TuneDocument's states
            self.document.detail = detail
            self.document.finished_seconds = self.clock()
            self.document.progress = {}
        log.info("tune finished", tune=self.document.id, state=state, detail=detail)
        try:
            self._save(finished=True)
        except StoreError as exc:
            log.error("could not journal the end of a tune", error=str(exc), tune=self.document.id)


class RecoveryJob:
    """Put back what sweeps an earlier run left `running` (kill -9, a crash), then close them."""

    def __init__(
        self,
        documents: list[TuneDocument],
        backend: Callable[[], GpuBackend | None],
        store: Callable[[], Store | None],
        holds: PolicyHolds,
        clock: Callable[[], float],
    ) -> None:
        self.documents = documents
        self.backend = backend
        self.store = store
        self.holds = holds
        self.clock = clock
        self.name = "tune recovery"
        self._aborted = threading.Event()

    def abort(self, reason: str) -> None:
        self._aborted.set()

    def run(self) -> None:
        deadline = time.monotonic() + RECOVERY_BACKEND_WAIT_SECONDS
        backend = self.backend()
        while backend is None and time.monotonic() < deadline and not self._aborted.wait(0.2):
            backend = self.backend()
        for document in self.documents:
            if backend is None:
                # Left running: the next start tries again; the hold keeps the policy loop off meanwhile.
                log.error("tune recovery: no GPU backend; the interrupted sweep is rolled back later", tune=document.id)
                continue
            restored = restore(backend, document.request.kind, document.originals)
            where = document.progress.get("setting")
            detail = (
                f"interrupted (the agent stopped during the sweep{f', at {where:g}' if where is not None else ''});"
                f" restored at start: {', '.join(restored) or 'nothing changed'}"
            )
            document.state = "interrupted"
            document.detail = detail
            document.finished_seconds = self.clock()
            document.progress = {}
            log.warning("interrupted tune rolled back", tune=document.id, detail=detail)
            store = self.store()
            if store is not None:
                try:
                    store.save_tune(document.id, document.to_json(), document.finished_seconds)
                except StoreError as exc:
                    log.error("could not close an interrupted tune", error=str(exc), tune=document.id)
            self.holds.release(hold_owner(document.id))
