"""The alert conditions, in the small part of PromQL they need, written once and read two ways.

An `AlertExpr` is rendered as the expression of a Prometheus alert rule (`promql`) and evaluated by
the agent over the very samples its `/metrics` serves (`evaluate`), so the agent's pushes and the
shipped rules fire for the same series with the same labels: they cannot drift apart.

The shape: a condition on one series (`when`), optionally kept only where a second condition holds
for the same target and labels (`only_if`, PromQL's `and on (...)`), optionally joined with a series
that lends it labels (`join` with `take`, PromQL's `* on (...) group_left (...)`), then labels that
are not the alert's identity dropped (`drop`, PromQL's `max without (...)`). The labels of the result
are the alert's labels: the target's (`instance`, `job` and what the fleet adds) and what is left of
the series' own.

For Prometheus every series is read through `held`: while the target is down, or its agent has not
served a snapshot since it started, a series keeps the last value it had within `KEEP_FIRING`, so a
node whose agent died (or restarts) keeps its open alerts firing a while instead of resolving them,
while an agent that answers and no longer lists a fault resolves its alert at the next evaluation.
(Prometheus' own `keep_firing_for` would also hold the alert of a fault the agent has fixed.)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

#: How long a silent node's open alerts keep firing, in PromQL duration syntax.
KEEP_FIRING = "10m"
#: The series that says the agent serves a snapshot of a completed loop (0 before its first loop).
AGENT_UP = "gpu_agent_up"
#: The labels every target has: what PromQL matches two series of one node on.
TARGET = ("instance", "job")

MatchOp = Literal["=", "!=", "=~", "!~"]
CompareOp = Literal["==", "!=", ">", ">=", "<", "<="]

Labels = Mapping[str, str]


@dataclass(frozen=True)
class Sample:
    """One series of the agent's `/metrics` (name with a counter's `_total`) and its value."""

    name: str
    labels: Labels
    value: float


@dataclass(frozen=True)
class Match:
    label: str
    op: MatchOp
    value: str

    def holds(self, labels: Labels) -> bool:
        found = labels.get(self.label, "")
        if self.op in ("=", "!="):
            return (found == self.value) is (self.op == "=")
        # PromQL anchors a regular expression at both ends.
        return (re.fullmatch(self.value, found) is not None) is (self.op == "=~")

    def promql(self) -> str:
        return f'{self.label}{self.op}"{self.value}"'


def matchers(**by_label: str) -> tuple[Match, ...]:
    """Matchers from `label="value"` (equality), `label="~regex"` and `label="!value"`/`"!~regex"`."""
    found = []
    for label, text in by_label.items():
        if text.startswith("!~"):
            found.append(Match(label, "!~", text[2:]))
        elif text.startswith("~"):
            found.append(Match(label, "=~", text[1:]))
        elif text.startswith("!"):
            found.append(Match(label, "!=", text[1:]))
        else:
            found.append(Match(label, "=", text))
    return tuple(found)


@dataclass(frozen=True)
class Series:
    """A selector: a metric name and label matchers."""

    name: str
    where: tuple[Match, ...] = ()

    def selects(self, sample: Sample) -> bool:
        return sample.name == self.name and all(match.holds(sample.labels) for match in self.where)

    def promql(self) -> str:
        return self.name + ("{" + ", ".join(m.promql() for m in self.where) + "}" if self.where else "")


def series(name: str, **by_label: str) -> Series:
    return Series(name, matchers(**by_label))


_COMPARE = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
}


@dataclass(frozen=True)
class Compare:
    """A series filtered by its value, as PromQL's comparison of a vector with a number."""

    series: Series
    op: CompareOp
    value: float

    def holds(self, sample: Sample) -> bool:
        return self.series.selects(sample) and bool(_COMPARE[self.op](sample.value, self.value))

    def promql(self, read: str) -> str:
        return f"{read} {self.op} {self.value:g}"


def held(selector: str) -> str:
    """`selector`, or while its node is silent (the target down, the agent before its first loop) the
    last value it had within KEEP_FIRING."""
    on = ", ".join(TARGET)
    return f"(\n  {selector}\n  or last_over_time({selector}[{KEEP_FIRING}]) unless on ({on}) {AGENT_UP} == 1\n)"


@dataclass(frozen=True)
class AlertExpr:
    when: Compare
    drop: tuple[str, ...] = ()  # labels of the series that are not the alert's
    only_if: Compare | None = None  # kept only where this holds on the same target and `on` labels
    join: Series | None = None  # lends `take` to each result, matched on the target and `on` labels
    take: tuple[str, ...] = ()
    on: tuple[str, ...] = ()

    def promql(self) -> str:
        on = ", ".join((*TARGET, *self.on))
        expr = self.when.promql(held(self.when.series.promql()))
        if self.only_if is not None:
            expr = f"({expr})\nand on ({on})\n({self.only_if.promql(held(self.only_if.series.promql()))})"
        if self.join is not None:
            expr = f"({expr})\n* on ({on}) group_left ({', '.join(self.take)})\n{held(self.join.promql())}"
        return f"max without ({', '.join(self.drop)}) (\n{_indent(expr)}\n)"

    def evaluate(self, samples: Iterable[Sample]) -> list[tuple[dict[str, str], float]]:
        """What the expression gives over one node's samples: (labels, value) per result, the
        labels without the target's (the caller adds its own). In the order first found."""
        kept = list(samples)
        results: dict[tuple[tuple[str, str], ...], tuple[dict[str, str], float]] = {}
        allowed = [s.labels for s in kept if self.only_if is not None and self.only_if.holds(s)]
        lenders = [s for s in kept if self.join is not None and self.join.selects(s)]
        for sample in kept:
            if not self.when.holds(sample):
                continue
            if self.only_if is not None and not any(_same(sample.labels, other, self.on) for other in allowed):
                continue
            labels = {k: v for k, v in sample.labels.items() if k not in self.drop and v != ""}
            value = sample.value
            if self.join is not None:
                lender = next((s for s in lenders if _same(sample.labels, s.labels, self.on)), None)
                if lender is None:
                    continue
                labels.update({k: lender.labels[k] for k in self.take if lender.labels.get(k, "") != ""})
                value *= lender.value
            key = tuple(sorted(labels.items()))
            if key not in results or value > results[key][1]:
                results[key] = (labels, value)
        return list(results.values())


def _same(a: Labels, b: Labels, on: tuple[str, ...]) -> bool:
    return all(a.get(label, "") == b.get(label, "") for label in on)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
