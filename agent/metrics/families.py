"""The building blocks of a scrape: metric families in first-use order and the labels every
per-GPU family shares (the readings' own families come from the reading table, agent/readings/)."""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from agent.names.metric_families import DEFAULT_SWITCHES, FAMILIES, FamilySwitches
from agent.printable import printable
from agent.readings.row import Notable, never
from agent.state import NodeSnapshot


def flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


class Families:
    """Metric families of one scrape, in first-use order; empty ones are not exposed.

    Every series is added under the name of its family (agent/names/metric_families.py): a family the
    switches show is written whole, one they do not show keeps only its `notable` series."""

    def __init__(self, switches: FamilySwitches = DEFAULT_SWITCHES) -> None:
        self.switches = switches
        self._families: dict[str, Metric] = {}

    def gauge(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        value: float | None,
        *,
        family: str,
        notable: Notable = never,
    ) -> None:
        self.add(name, documentation, labels, value, counter=False, family=family, notable=notable)

    def counter(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        value: float | None,
        *,
        family: str,
        notable: Notable = never,
    ) -> None:
        self.add(name, documentation, labels, value, counter=True, family=family, notable=notable)

    def one_hot(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        label: str,
        current: Enum,
        *,
        family: str,
        notable: Notable = never,
    ) -> None:
        """One gauge series per member of `current`'s enum, its value as `label`: 1 for `current`, 0 for the others."""
        for member in type(current):
            value = str(member.value)
            self.gauge(
                name, documentation, {**labels, label: value}, float(member is current), family=family, notable=notable
            )

    def quantile(
        self, name: str, documentation: str, labels: dict[str, str], value: float | None, *, family: str
    ) -> None:
        """One quantile of a summary (labels include `quantile`), without _count and _sum: a window's
        quantiles, as client-side summaries give them. Shown only while `family` is on."""
        if family not in FAMILIES:
            raise KeyError(f"{name}: unknown metrics family {family!r}")
        if value is None or not self.switches.shows(family):
            return
        existing = self._families.get(name)
        if existing is None:
            existing = self._families[name] = Metric(name, documentation, "summary")
        existing.add_sample(name, {key: printable(label) for key, label in labels.items()}, value)

    def histogram(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        buckets: list[tuple[float, float]],
        sum_value: float,
        *,
        family: str,
    ) -> None:
        """A cumulative histogram: (upper bound, count at or below it) per bucket, the last +Inf;
        `_count` is the +Inf bucket. Shown only while `family` is on."""
        if family not in FAMILIES:
            raise KeyError(f"{name}: unknown metrics family {family!r}")
        if not self.switches.shows(family):
            return
        existing = self._families.get(name)
        if existing is None:
            existing = self._families[name] = HistogramMetricFamily(name, documentation, labels=list(labels))
        assert isinstance(existing, HistogramMetricFamily)
        existing.add_metric(
            [printable(label) for label in labels.values()],
            [(_le(bound), count) for bound, count in buckets],
            sum_value,
        )

    def add(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        value: float | None,
        *,
        counter: bool,
        family: str,
        notable: Notable = never,
    ) -> None:
        if family not in FAMILIES:
            raise KeyError(f"{name}: unknown metrics family {family!r}")
        if value is not None and not self.switches.shows(family) and not notable(labels, value):
            return
        existing = self._families.get(name)
        if existing is None:
            # prometheus_client appends "_total" to a counter family's samples.
            kind = CounterMetricFamily if counter else GaugeMetricFamily
            existing = self._families[name] = kind(name, documentation, labels=list(labels))
        assert isinstance(existing, (CounterMetricFamily, GaugeMetricFamily)), name
        if value is not None:
            # Label values can carry a reason or name from outside: no terminal escape reaches a scraper's screen.
            existing.add_metric([printable(label) for label in labels.values()], value)

    def __iter__(self) -> Iterator[Metric]:
        return (family for family in self._families.values() if family.samples)


def _le(bound: float) -> str:
    """A bucket's `le` as Prometheus' own clients write it (0.1, 1.0, +Inf)."""
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]


def gpu_label(index: int | None) -> str:
    return "" if index is None else str(index)


def gpu_uuids(snap: NodeSnapshot) -> dict[int, str]:
    return {sample.index: sample.uuid for sample in snap.gpus}
