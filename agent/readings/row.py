"""What one row of the reading table says about one GPU reading: the backend call it comes from and
that call's tier, the `/metrics` family it is exported in (name, help, type, unit, labels, the shape
of its series), the dcgm-exporter field the compatibility rules record it as, and the family name
that groups it with related readings. The table itself is `GpuSample` (agent/readings/table.py):
each of its reading fields is declared with `reading(...)`, so the field and its row are one line.

Nothing here knows Prometheus: a row gives (labels, value) pairs in base units, and
`agent/metrics/` writes them; `agent/metrics/dcgm.py` writes the recording rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from agent.backend.base import GpuBackend

#: Where a row is kept in its dataclass field's metadata.
_ROW = "reading_row"

Labels = tuple[tuple[str, str], ...]


class Tier(Enum):
    """How often a call is made: the fast tier every loop, the slow tier every
    `counters_interval_seconds` (counters, limits and link state: 0.2-1.3 ms a call on an H200)."""

    FAST = "fast"
    SLOW = "slow"


class Section(Enum):
    """Where `/metrics` lists a row's family: the device section comes with each GPU's verdicts and
    read errors, GPU by GPU; the telemetry section (GPM, field values, NVLink, fabric, processes)
    follows for every GPU."""

    DEVICE = "device"
    TELEMETRY = "telemetry"


@dataclass(frozen=True)
class Call:
    """One backend call for one GPU. Rows that share a call (the parts of one structure, such as
    `utilization`) share one `Call` with a `name`; a row with a call of its own leaves the name
    empty and lends it its field name. The name keys `GpuSample.read_errors`."""

    read: Callable[[GpuBackend, int], Any]
    tier: Tier
    name: str = ""
    #: A NOT_SUPPORTED answer stands for this GPU from then on: an older GPU costs one call, never a loop of them.
    remember_unsupported: bool = False
    #: A sample field that says whether the call is supported: True once it answers, False on NOT_SUPPORTED.
    supported_field: str = ""


def fast(
    read: Callable[[GpuBackend, int], Any],
    name: str = "",
    *,
    remember_unsupported: bool = False,
    supported_field: str = "",
) -> Call:
    return Call(read, Tier.FAST, name, remember_unsupported, supported_field)


def slow(read: Callable[[GpuBackend, int], Any], name: str = "", *, remember_unsupported: bool = False) -> Call:
    return Call(read, Tier.SLOW, name, remember_unsupported)


@dataclass(frozen=True)
class Unit:
    """The base unit `/metrics` gives a reading, which its metric name ends in ("" for counts, flags,
    states and codes, which have none), and how a value as carried in the sample converts to it."""

    base: str
    to_base: Callable[[Any], float] | None = None

    def export(self, value: Any) -> float:
        return value if self.to_base is None else self.to_base(value)


CELSIUS = Unit("celsius")
WATTS = Unit("watts")
JOULES = Unit("joules")
BYTES = Unit("bytes")
BYTES_PER_SECOND = Unit("bytes_per_second")
RATIO = Unit("ratio")
MHZ = Unit("hertz", lambda mhz: mhz * 1e6)
PERCENT = Unit("ratio", lambda percent: percent / 100.0)
NANOSECONDS = Unit("seconds", lambda ns: ns * 1e-9)
FLAG = Unit("", float)  # a bool as 0 or 1
NUMBER = Unit("")  # a count, a state, a code


@dataclass(frozen=True)
class Metric:
    """A `/metrics` family: its name as scraped (a counter's ends in `_total`), help and type.
    Rows that are series of one family (the clocks per domain) share one."""

    name: str
    help: str
    counter: bool = False


def gauge(name: str, help: str) -> Metric:
    return Metric(name, help)


def counter(name: str, help: str) -> Metric:
    return Metric(name, help, counter=True)


Series = Callable[[Any, Any], Iterable[tuple[Labels, Any]]]

#: Whether one series (its labels, its value in base units) is worth showing while its family is
#: switched off (agent/names/metric_families.py): a counter or flag that is not 0, a link that is down.
Notable = Callable[[Mapping[str, str], float], bool]


def never(_labels: Mapping[str, str], _value: float) -> bool:
    """Shown only while the family is on."""
    return False


def nonzero(_labels: Mapping[str, str], value: float) -> bool:
    """A counter that counted something, a flag that is set: shown whether the family is on or not."""
    return value != 0


def zero(_labels: Mapping[str, str], value: float) -> bool:
    """A state flag that is off where on is normal (a link that is down)."""
    return value == 0


def current_except(label: str, *normal: str) -> Notable:
    """The current state of a one-hot family when it is none of the `normal` ones (a recovery action
    other than none, a fabric registration neither completed nor unsupported)."""

    def notable(labels: Mapping[str, str], value: float) -> bool:
        return value == 1 and labels.get(label) not in normal

    return notable


@dataclass(frozen=True)
class Shape:
    """How one reading becomes series: the labels it adds, and its (labels, value) pairs from the
    reading and the sample it is in (a reading that is None gives none, unless the shape says
    otherwise)."""

    labels: tuple[str, ...]
    series: Series


def _scalar(value: Any, _sample: Any) -> Iterable[tuple[Labels, Any]]:
    return () if value is None else (((), value),)


#: One series of the reading itself.
SCALAR = Shape((), _scalar)


def per_position(label: str) -> Shape:
    """A tuple reading, one series per position (`fan` 0, 1, ...)."""

    def series(value: Sequence[Any] | None, _sample: Any) -> Iterator[tuple[Labels, Any]]:
        for position, item in enumerate(value or ()):
            yield ((label, str(position)),), item

    return Shape((label,), series)


def per_key(label: str) -> Shape:
    """A mapping reading, one series per key (`counter` crc_flit, crc_data, ...), in key order."""

    def series(value: Mapping[str, Any] | None, _sample: Any) -> Iterator[tuple[Labels, Any]]:
        for key, item in sorted((value or {}).items()):
            yield ((label, key),), item

    return Shape((label,), series)


def one_hot(label: str, states: Callable[[Any], tuple[Sequence[str], str | None]]) -> Shape:
    """A state as one series per possible state, True for the current one; `states(value)` gives
    the possible states and the current one."""

    def series(value: Any, _sample: Any) -> Iterator[tuple[Labels, Any]]:
        if value is None:
            return
        possible, current = states(value)
        for state in possible:
            yield ((label, state),), state == current

    return Shape((label,), series)


def bit_flags(label: str, bits: Mapping[int, str]) -> Shape:
    """A bit mask as one series per known bit, True while it is set."""

    def series(value: int | None, _sample: Any) -> Iterator[tuple[Labels, Any]]:
        if value is None:
            return
        for bit, name in bits.items():
            yield ((label, name),), bool(value & bit)

    return Shape((label,), series)


@dataclass(frozen=True)
class Dcgm:
    """The dcgm-exporter field a row is recorded as, in dcgm-exporter's unit (the rules convert from
    the row's base unit). `select` picks the field's series among the row's, as a PromQL matcher;
    `bits` turns a row's flags back into dcgm-exporter's one bit mask; the rest of the rule follows
    from the row (agent/metrics/dcgm.py)."""

    name: str
    unit: str
    note: str = ""  # after the unit in the rule's comment
    select: str = ""
    #: A bit mask dcgm-exporter gives as one value, from a `bit_flags` row: (label value, bit) each.
    bits: tuple[tuple[str, int], ...] = ()
    #: 0 for a GPU that has no series (as dcgm-exporter gives it); rows with a `notable` filter get it anyway.
    zero_fill: bool = False


@dataclass(frozen=True)
class Row:
    """One reading: a field of `GpuSample` (also its key in `status --json`) and what it is."""

    field: str
    call: Call
    attribute: str  # the part of the call's answer this field holds; "" for the answer itself
    family: str  # a stable name that groups related readings (temperature, clocks, nvlink, ...)
    metric: Metric | None  # None: carried in the sample, exported through another row or not at all
    labels: Labels
    shape: Shape
    unit: Unit
    section: Section
    dcgm: tuple[Dcgm, ...]
    notable: Notable = never  # which series show while the family is off

    def series(self, sample: Any) -> Iterator[tuple[Labels, float]]:
        """The row's series of one sample: labels after `gpu` and `uuid`, values in base units; a
        value the GPU did not give is left out, never exported as 0."""
        for labels, value in self.shape.series(getattr(sample, self.field), sample):
            if value is not None:
                yield self.labels + labels, self.unit.export(value)


def reading(
    call: Call,
    attribute: str = "",
    *,
    family: str,
    metric: Metric | None = None,
    labels: Mapping[str, str] | None = None,
    shape: Shape = SCALAR,
    unit: Unit = NUMBER,
    section: Section = Section.DEVICE,
    dcgm: Dcgm | tuple[Dcgm, ...] = (),
    notable: Notable = never,
) -> Any:
    """A `GpuSample` field that is a reading (None until read), and its row. `notable`: which of its
    series `/metrics` shows while `family` is switched off (agent/names/metric_families.py)."""
    if dcgm and metric is None:
        raise ValueError("a dcgm-exporter field records a metric: give the row one")
    row = Row(
        field="",  # the field's name, filled in by `rows_of`
        call=call,
        attribute=attribute,
        family=family,
        metric=metric,
        labels=tuple((labels or {}).items()),
        shape=shape,
        unit=unit,
        section=section,
        dcgm=dcgm if isinstance(dcgm, tuple) else (dcgm,),
        notable=notable,
    )
    return dataclasses.field(default=None, metadata={_ROW: row})


def rows_of(sample_type: type) -> tuple[Row, ...]:
    """The rows of a dataclass declared with `reading(...)`, in field order, named after their fields."""
    rows = []
    calls: dict[str, Call] = {}
    for declared in dataclasses.fields(sample_type):
        row: Row | None = declared.metadata.get(_ROW)
        if row is None:
            continue
        call = row.call if row.call.name else replace(row.call, name=declared.name)
        if calls.setdefault(call.name, call) is not call:
            raise ValueError(f"two different calls are named {call.name!r} (row {declared.name})")
        rows.append(replace(row, field=declared.name, call=call))
    return tuple(rows)


@dataclass(frozen=True)
class Reader:
    """One call and the sample fields it fills: what the collector runs."""

    call: Call
    fields: tuple[tuple[str, str], ...]  # (sample field, attribute of the answer; "" for the answer itself)

    def values(self, answer: Any) -> dict[str, Any]:
        answered = {self.call.supported_field: True} if self.call.supported_field else {}
        if answer is None and any(attribute for _, attribute in self.fields):
            return answered  # e.g. the first GPM sample: nothing to difference yet
        return {**answered, **{name: getattr(answer, a) if a else answer for name, a in self.fields}}

    def unsupported_values(self) -> dict[str, Any]:
        return {self.call.supported_field: False} if self.call.supported_field else {}


def readers(rows: Iterable[Row], tier: Tier) -> tuple[Reader, ...]:
    """The calls of one tier, each once, in the order of their first row."""
    filled: dict[str, list[Row]] = {}
    for row in rows:
        if row.call.tier is tier:
            filled.setdefault(row.call.name, []).append(row)
    return tuple(Reader(group[0].call, tuple((r.field, r.attribute) for r in group)) for group in filled.values())
