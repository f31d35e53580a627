"""Which alerts of the catalogue the agent's verdict holds now: each pushed alert's condition evaluated
over the samples the agent's `/metrics` serves for this snapshot (the same families, switched as
`metrics.families` switches them), so a push fires for exactly the series a Prometheus rule fires for.
The labels are the rule's: what the series leaves, the target's as `alerts` in agent.yaml names them
(instance, job, the fleet's), the alert's name and severity."""

from __future__ import annotations

from agent.alerts.catalog import AlertSpec, pushed
from agent.alerts.expr import Sample
from agent.alerts.text import render
from agent.config import AgentConfig
from agent.daemon.alert_book import Found
from agent.metrics.collector import SnapshotCollector
from agent.names.metric_families import FamilySwitches
from agent.state import NodeSnapshot


def target_labels(config: AgentConfig, hostname: str) -> dict[str, str]:
    """The labels Prometheus gives this target: `alerts.instance` (else host name and metrics port),
    `alerts.job`, and `alerts.labels`."""
    port = config.metrics.listen.rpartition(":")[2]
    instance = config.alerts.instance or f"{hostname}:{port}"
    return {**config.alerts.labels, "instance": instance, "job": config.alerts.job}


def samples(snapshot: NodeSnapshot, switches: FamilySwitches) -> list[Sample]:
    """The samples `/metrics` serves for `snapshot`."""
    collector = SnapshotCollector(lambda: snapshot, switches=switches)
    return [Sample(s.name, s.labels, s.value) for family in collector.collect() for s in family.samples]


def found_alerts(snapshot: NodeSnapshot, config: AgentConfig) -> list[Found]:
    """Every pushed alert that holds on `snapshot`, in the catalogue's order."""
    served = samples(snapshot, FamilySwitches.of(config.metrics.families))
    target = target_labels(config, snapshot.hostname)
    found: list[Found] = []
    for spec, expr in pushed():
        for labels, _value in expr.evaluate(served):
            found.append(_found(spec, {**labels, **target}, config))
    return found


def _found(spec: AlertSpec, labels: dict[str, str], config: AgentConfig) -> Found:
    labels = {**labels, "alertname": spec.name, "severity": spec.severity.value}
    annotations = {
        "summary": render(spec.summary, labels),
        "description": render(spec.description, labels),
        "runbook_url": spec.runbook_url(config.alerts.runbook_url),
    }
    return Found(spec.name, labels, annotations, config.alerts.for_seconds.get(spec.name, spec.for_seconds))
