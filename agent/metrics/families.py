"""The building blocks of a scrape: metric families in first-use order, per-GPU family tables and
the unit conversions every family uses (base units: hertz, seconds, ratios 0-1)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.printable import printable
from agent.state import GpuSample, NodeSnapshot

_MHZ_TO_HERTZ = 1e6
_NS_TO_SECONDS = 1e-9


def flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


def percent_to_ratio(percent: int | None) -> float | None:
    return None if percent is None else percent / 100.0


def mhz_to_hertz(mhz: int | None) -> float | None:
    return None if mhz is None else mhz * _MHZ_TO_HERTZ


def ns_to_seconds(ns: int | None) -> float | None:
    return None if ns is None else ns * _NS_TO_SECONDS


Reader = Callable[[GpuSample], "float | None"]


@dataclass(frozen=True)
class GpuFamily:
    """Per-GPU series of one family: (extra labels, reader) each, e.g. ({"clock": "sm"}, ...)."""

    name: str
    documentation: str
    series: tuple[tuple[tuple[tuple[str, str], ...], Reader], ...]
    counter: bool = False


def single(name: str, documentation: str, read: Reader, counter: bool = False) -> GpuFamily:
    return GpuFamily(name, documentation, (((), read),), counter)


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
