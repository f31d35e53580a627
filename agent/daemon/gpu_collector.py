"""The GPU collector: which GPUs there are, and one sample of each per loop, never waiting on a
hung GPU for more than one call timeout.

Every GPU's reads start before any is waited for, each in its own lane: eight hung GPUs cost one
timeout, not eight. A GPU whose reads do not come back in time is stale: it keeps its last sample,
marked so. The slow tier (counters, link state) is read every `counters_interval_seconds`; in between,
a sample carries the last slow readings.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from functools import partial

from agent.backend.base import GpuBackend, GpuIdentity
from agent.backend.errors import GpuError, GpuErrorKind
from agent.collect import carry_slow_fields, sample_identified
from agent.daemon.bounded import BoundedRunner, StaleGpu
from agent.daemon.session import FaultSink
from agent.daemon.timing import LoopTiming, due, timed
from agent.logs import get_logger
from agent.state import CollectorStatus, GpuSample

log = get_logger()


class GpuCollector:
    def __init__(
        self, runner: BoundedRunner, timing: LoopTiming, clock: Callable[[], float], on_fault: FaultSink
    ) -> None:
        self.runner = runner
        self.timing = timing
        self.clock = clock
        self.on_fault = on_fault
        self.identities: dict[int, GpuIdentity] = {}
        self.samples: dict[int, GpuSample] = {}
        self.stale: frozenset[int] = frozenset()
        self.rescan = threading.Event()  # udev saw an NVIDIA device come or go: enumerate again
        self.last_slow_seconds = float("-inf")
        self._statuses: dict[str, CollectorStatus] = {}
        # Readers each GPU (by UUID: a replaced board asks again) answered NOT_SUPPORTED: not asked again.
        self._unsupported: dict[str, set[str]] = {}

    def collect(self, backend: GpuBackend, now: float, slow_every_seconds: float) -> list[GpuSample]:
        slow = due(now, self.last_slow_seconds, slow_every_seconds)
        self._enumerate_if_needed(backend, slow)
        started = time.monotonic()
        pending = self._start_reads(backend, slow)
        deadline = time.monotonic() + self.timing.call_timeout_seconds
        stale: set[int] = set()
        samples: list[GpuSample] = []
        for gpu, identity in sorted(self.identities.items()):
            try:
                sample = self._take(gpu, pending[gpu], deadline, slow)
            except StaleGpu as exc:
                stale.add(gpu)
                sample = self._stale_sample(gpu, identity, now, exc)
            samples.append(sample)
            self.samples[gpu] = sample
        if slow:
            self.last_slow_seconds = now
        if stale - self.stale:
            log.warning("GPU calls hung: readings are stale", gpus=sorted(stale - self.stale))
        self.stale = frozenset(stale)
        self._record(
            CollectorStatus("gpu", not stale, time.monotonic() - started, f"stale: {sorted(stale)}" if stale else "")
        )
        return samples

    def unavailable(self, now: float, error: GpuError | None) -> list[GpuSample]:
        """GPUs known from before the backend went away stay in the snapshot, down, rather than vanish
        from metrics (an alert on gpu_up == 0 must still fire)."""
        kind = error.kind.value if error is not None else GpuErrorKind.UNKNOWN.value
        self._unsupported.clear()  # the driver that comes back may be another one: ask everything again
        return [
            GpuSample(gpu, i.uuid, i.name, i.pci_bus_id, up=False, timestamp_seconds=now, read_errors={"backend": kind})
            for gpu, i in sorted(self.identities.items())
        ]

    def statuses(self) -> list[CollectorStatus]:
        return list(self._statuses.values())

    # -- enumerate ---------------------------------------------------------------------------

    def _enumerate_if_needed(self, backend: GpuBackend, slow: bool) -> None:
        """At start, when udev says so, when the count changes, and on every slow pass (polling
        covers hosts without udev)."""
        wanted = slow or self.rescan.is_set() or not self.identities
        if not wanted and len(self.identities) == self._device_count(backend):
            return
        self.rescan.clear()
        try:
            self._enumerate(backend)
        except GpuError as exc:
            self.on_fault("enumerate", exc.kind)
        except StaleGpu:
            pass

    def _enumerate(self, backend: GpuBackend) -> None:
        def read() -> tuple[int, dict[int, GpuIdentity]]:
            found: dict[int, GpuIdentity] = {}
            count = backend.device_count()
            for gpu in range(count):
                with contextlib.suppress(GpuError):
                    found[gpu] = backend.identity(gpu)
            return count, found

        count, found = timed("enumerate", partial(self.runner.run, "library", read), self._record)
        # A GPU NVML still counts but cannot identify (lost) keeps its last identity, so its
        # kernel-log lines still map to it; one that left the count is gone.
        previous = self.identities
        self.identities = {
            gpu: identity for gpu in range(count) if (identity := found.get(gpu) or previous.get(gpu)) is not None
        }

    def _device_count(self, backend: GpuBackend) -> int:
        try:
            count: int = self.runner.run("library", backend.device_count)
        except GpuError as exc:
            self.on_fault("device_count", exc.kind)
            return len(self.identities)
        except StaleGpu:
            return len(self.identities)
        return count

    # -- sample ------------------------------------------------------------------------------

    def _start_reads(self, backend: GpuBackend, slow: bool) -> dict[int, Future[GpuSample] | StaleGpu]:
        pending: dict[int, Future[GpuSample] | StaleGpu] = {}
        for gpu, identity in sorted(self.identities.items()):
            unsupported = self._unsupported.setdefault(identity.uuid, set())
            work = partial(sample_identified, backend, identity, slow=slow, clock=self.clock, unsupported=unsupported)
            try:
                pending[gpu] = self.runner.submit(f"gpu{gpu}", work)
            except StaleGpu as exc:  # its lane is still busy with a call that hung earlier
                pending[gpu] = exc
        return pending

    def _take(self, gpu: int, started: Future[GpuSample] | StaleGpu, deadline: float, slow: bool) -> GpuSample:
        if isinstance(started, StaleGpu):
            raise started
        sample = self.runner.result(f"gpu{gpu}", started, max(0.0, deadline - time.monotonic()))
        for field_name, kind in sample.read_errors.items():
            self.on_fault(f"GPU {gpu} {field_name}", kind)
        previous = self.samples.get(gpu)
        if not slow and previous is not None:
            return carry_slow_fields(previous, sample)
        return sample

    def _stale_sample(self, gpu: int, identity: GpuIdentity, now: float, exc: StaleGpu) -> GpuSample:
        sample = self.samples.get(gpu) or GpuSample(
            gpu, identity.uuid, identity.name, identity.pci_bus_id, up=False, timestamp_seconds=now
        )
        return replace(sample, read_errors={**sample.read_errors, "stale": str(exc)})

    def _record(self, status: CollectorStatus) -> None:
        self._statuses[status.name] = status
