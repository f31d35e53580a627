"""One snapshot builder: the watchers that judge GPU health, and the NodeSnapshot made from a loop's
samples and plans. The daemon builds every loop's snapshot here and `gpu-agent status --direct`
builds its one-off snapshot here, with the same watchers, so both give the same verdict for the
same node. What only a running daemon knows (stale GPUs, services, remediations, collectors,
recent events) comes in as `DaemonParts`. The inference servers' figures and the GPU processes per
service come from the daemon's monitor, or from one read for `status --direct`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent import __version__
from agent.backend.base import GpuIdentity
from agent.backend.errors import GpuError
from agent.config import AgentConfig
from agent.events import Event, FaultCause, Health, HealthState
from agent.host.boottime import boottime_seconds
from agent.host.paths import HostPaths
from agent.policy.plan import ItemPlan
from agent.state import (
    CollectorStatus,
    GpuAttribution,
    GpuSample,
    NodeSnapshot,
    RecentRemediation,
    RemediationCount,
    RemediationFailing,
    ServiceFigures,
    ServiceStatus,
    SloBreachNow,
    TuneResult,
)
from agent.verdict import reboot_recommendation
from agent.watch.devices import DeviceWatcher
from agent.watch.fabric import FabricWatcher
from agent.watch.gpu_health import HealthBook, PollWatcher
from agent.watch.gpu_lost import GpuLostWatcher
from agent.watch.memory_errors import MemoryWatcher
from agent.watch.nvlink import NvLinkWatcher
from agent.watch.pcie import PcieWatcher
from agent.watch.throttle import ThrottleWatcher
from agent.watch.xid import XidWatcher


class NodeWatchers:
    """Every watcher with a say in GPU health. The poll watchers see each loop's samples; the Xid
    watcher is fed by the NVML event wait and the kernel log (a one-off read has neither)."""

    def __init__(
        self,
        identities: Callable[[], Mapping[int, GpuIdentity]] = dict,
        clock: Callable[[], float] = time.time,
        boottime: Callable[[], float] = boottime_seconds,
        process_owner: Callable[[int], str | None] = lambda pid: None,
        kernel_log_followed: Callable[[], bool] = lambda: False,
        release_xids: Callable[[list[Event]], object] = lambda events: None,
    ) -> None:
        # Durations and windows run on `boottime` (monotonic, one reading per boot), times on `clock`.
        # `process_owner`: the configured service a faulting process belongs to (whose Xid it is).
        # `kernel_log_followed`, `release_xids`: an Xid NVML reports waits for its kernel-log line, then
        # goes to `release_xids` (agent/watch/xid.py).
        self.throttle = ThrottleWatcher(clock=boottime)
        self.devices = DeviceWatcher()
        self.xid = XidWatcher(
            identities,
            clock=clock,
            window_clock=boottime,
            process_owner=process_owner,
            kernel_log_followed=kernel_log_followed,
            release=release_xids,
        )
        self.pcie = PcieWatcher()
        polled: list[PollWatcher] = [
            self.throttle,
            MemoryWatcher(),
            GpuLostWatcher(),
            self.pcie,
            NvLinkWatcher(),
            FabricWatcher(),
        ]
        self.polled: tuple[PollWatcher, ...] = (*polled, self.devices)
        self.book = HealthBook([*polled, self.xid, self.devices])

    def observe(self, samples: Sequence[GpuSample], now: float) -> list[Event]:
        """This loop's samples to every poll watcher; the transitions they saw."""
        events: list[Event] = []
        for watcher in self.polled:
            events.extend(watcher.observe(samples, now))
        return events

    def health(
        self, gpus: Iterable[int], stale: frozenset[int] = frozenset(), backend_error: GpuError | None = None
    ) -> dict[int, Health]:
        """The verdict per GPU; a GPU whose readings are stale, or all of them while the backend is
        unavailable, is degraded whatever the watchers last saw."""
        return {gpu: self._gpu_health(gpu, stale, backend_error) for gpu in gpus}

    def _gpu_health(self, gpu: int, stale: frozenset[int], backend_error: GpuError | None) -> Health:
        if backend_error is not None:
            return Health(
                HealthState.DEGRADED,
                f"GPU backend unavailable: {backend_error}",
                causes=(FaultCause.BACKEND_UNAVAILABLE,),
            )
        if gpu in stale:
            return Health(
                HealthState.DEGRADED, "NVML calls for this GPU hang: readings are stale", causes=(FaultCause.STALE,)
            )
        return self.book.gpu_health(gpu)


@dataclass(frozen=True)
class DaemonParts:
    """What only a running daemon knows; a one-off read leaves them empty."""

    started_seconds: float | None = None  # None: started now
    stale_gpus: frozenset[int] = frozenset()
    backend_error: GpuError | None = None  # the backend is not open: every GPU is degraded
    services: tuple[ServiceStatus, ...] = ()
    remediations: tuple[RemediationCount, ...] = ()
    remediation_failing: tuple[RemediationFailing, ...] = ()
    collectors: tuple[CollectorStatus, ...] = ()
    recent_events: tuple[Event, ...] = ()
    recent_remediations: tuple[RecentRemediation, ...] = ()
    rules_sources: tuple[str, ...] = ()  # the rules files read or masked, and where from
    rules_loaded: int | None = None  # rules the remediator runs; None: remediation off (rules_dirs: [])
    slo_breaches: tuple[SloBreachNow, ...] = ()
    collect_duration_seconds: float = 0.0
    tunes: tuple[TuneResult, ...] = ()  # the last measured sweep per service and kind


def item_modes(config: AgentConfig, plans: Iterable[ItemPlan]) -> dict[str, str]:
    """The mode (observe/enforce) of each planned item; "gpu" (an unreadable GPU) is no item."""
    return {p.item: config.item_mode(p.item).value for p in plans if p.item != "gpu"}


def service_slo_seconds(config: AgentConfig) -> dict[str, dict[str, float]]:
    """Each service's p95 objectives by latency kind, as exported next to the p95 itself."""
    found: dict[str, dict[str, float]] = {}
    for service in config.services:
        slo = service.slo
        if slo is None:
            continue
        kinds = {"e2e": slo.e2e_p95_seconds, "ttft": slo.ttft_p95_seconds}
        found[service.name] = {kind: seconds for kind, seconds in kinds.items() if seconds is not None}
    return found


def build_snapshot(
    config: AgentConfig,
    now: float,
    samples: Sequence[GpuSample],
    watchers: NodeWatchers,
    *,
    driver_version: str | None,
    policy: tuple[ItemPlan, ...],
    daemon: DaemonParts | None = None,
    service_figures: Mapping[str, ServiceFigures] | None = None,
    gpu_attribution: GpuAttribution | None = None,
) -> NodeSnapshot:
    """The snapshot of `samples` once `watchers` have observed them."""
    parts = daemon or DaemonParts()
    reboot = reboot_recommendation(config.state_dir, HostPaths.at(config.host_root))
    return NodeSnapshot(
        timestamp_seconds=now,
        started_seconds=now if parts.started_seconds is None else parts.started_seconds,
        version=__version__,
        backend=config.backend,
        driver_version=driver_version,
        gpus=tuple(samples),
        stale_gpus=parts.stale_gpus,
        health=watchers.health(sorted(s.index for s in samples), parts.stale_gpus, parts.backend_error),
        policy=policy,
        item_modes=item_modes(config, policy),
        services=parts.services,
        remediations=parts.remediations,
        remediation_failing=parts.remediation_failing,
        clock_event_seconds=watchers.throttle.clock_event_seconds(),
        throttle_active_since=watchers.throttle.active_since(),
        throttle_held_seconds=watchers.throttle.held_seconds(),
        xids=tuple(watchers.xid.counts()),
        open_xids=watchers.xid.open_marks(),
        collectors=parts.collectors,
        recent_events=parts.recent_events,
        collect_duration_seconds=parts.collect_duration_seconds,
        service_figures=dict(service_figures or {}),
        gpu_attribution=gpu_attribution,
        service_slo_seconds=service_slo_seconds(config),
        backend_error="" if parts.backend_error is None else str(parts.backend_error),
        pcie_degraded=frozenset(
            s.index for s in samples if watchers.pcie.health(s.index).state is not HealthState.HEALTHY
        ),
        reboot_recommended=None if reboot is None else reboot[0],
        reboot_recommended_cause="" if reboot is None else reboot[1],
        recent_remediations=parts.recent_remediations,
        rules_sources=parts.rules_sources,
        rules_loaded=parts.rules_loaded,
        rules_dirs=tuple(config.remediation.rules_dirs) if parts.rules_loaded is not None else (),
        slo_breaches=parts.slo_breaches,
        tunes=parts.tunes,
    )
