"""The building blocks of a scrape: metric families in first-use order and the labels every
per-GPU family shares (the readings' own families come from the reading table, agent/readings/)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.printable import printable
from agent.state import NodeSnapshot


def flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


class Families:
    """Metric families of one scrape, in first-use order; empty ones are not exposed."""

    def __init__(self) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def gauge(self, name: str, documentation: str, labels: dict[str, str], value: float | None) -> None:
        self.add(name, documentation, labels, value, counter=False)

    def counter(self, name: str, documentation: str, labels: dict[str, str], value: float | None) -> None:
        self.add(name, documentation, labels, value, counter=True)

    def one_hot(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        label: str,
        values: Iterable[str],
        current: str | None,
    ) -> None:
        """One gauge series per value of `label`, 1 for `current` and 0 for the others."""
        for value in values:
            self.gauge(name, documentation, {**labels, label: value}, float(value == current))

    def add(self, name: str, documentation: str, labels: dict[str, str], value: float | None, counter: bool) -> None:
        family = self._families.get(name)
        if family is None:
            # prometheus_client appends "_total" to a counter family's samples.
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            family = self._families[name] = kind(name, documentation, labels=list(labels))
        if value is not None:
            # Label values can carry a reason or name from outside: no terminal escape reaches a scraper's screen.
            family.add_metric([printable(label) for label in labels.values()], value)

    def __iter__(self) -> Iterator[Metric]:
        return (family for family in self._families.values() if family.samples)


def gpu_label(index: int | None) -> str:
    return "" if index is None else str(index)


def gpu_uuids(snap: NodeSnapshot) -> dict[int, str]:
    return {sample.index: sample.uuid for sample in snap.gpus}
