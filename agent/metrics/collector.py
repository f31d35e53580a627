"""The scrape: every family of the latest snapshot, in the order /metrics lists them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from agent.metrics import gpu, node, tune
from agent.metrics.families import Families, gpu_uuids
from agent.metrics.services import service_metric_families
from agent.names.metric_families import DEFAULT_SWITCHES, FamilySwitches
from agent.state import NodeSnapshot
from agent.version import current as current_build

SnapshotGetter = Callable[[], "NodeSnapshot | None"]


class SnapshotCollector(Collector):
    """Renders the latest snapshot; before the first one only build info and `gpu_agent_up 0`.
    `switches`: the families shown whole (`metrics.families`); a reload may replace them."""

    def __init__(
        self,
        get_snapshot: SnapshotGetter,
        version: str | None = None,
        revision: str | None = None,
        switches: FamilySwitches = DEFAULT_SWITCHES,
    ) -> None:
        built = current_build()
        self._get_snapshot = get_snapshot
        self.switches = switches
        self._build_labels = {
            "version": built.version if version is None else version,
            "revision": built.revision if revision is None else revision,
        }

    def collect(self) -> Iterator[Metric]:
        snapshot = self._get_snapshot()
        out = Families(self.switches)
        built = "gpu-agent version and the commit it was built from; always 1."
        out.gauge("gpu_agent_build_info", built, self._build_labels, 1, family="node")
        out.gauge(
            "gpu_agent_up",
            "1 once the agent has completed a collection loop and serves its snapshot, 0 before.",
            {},
            0 if snapshot is None else 1,
            family="node",
        )
        if snapshot is None:
            return iter(out)
        for write in SNAPSHOT_FAMILIES:
            write(out, snapshot)
        service_metric_families(
            out, snapshot.service_figures, snapshot.gpu_attribution, gpu_uuids(snapshot), snapshot.service_slo_seconds
        )
        return iter(out)


#: The snapshot's families, in the order /metrics lists them.
SNAPSHOT_FAMILIES: tuple[Callable[[Families, NodeSnapshot], None], ...] = (
    node.backend,
    gpu.gpus,
    gpu.telemetry,
    gpu.last_xid,
    gpu.clock_event_seconds,
    gpu.xids,
    node.policy,
    node.readiness,
    node.services,
    node.remediations,
    node.collectors,
    tune.tune,
)
