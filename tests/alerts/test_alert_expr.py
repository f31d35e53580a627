"""The one small PromQL the catalogue is written in, as the agent evaluates it, and the one template
form of its texts. (That Prometheus reads the rendered PromQL the same: tests/alerts/alert_cases.py.)"""

from __future__ import annotations

import pytest

from agent.alerts.expr import AlertExpr, Compare, Match, Sample, matchers, series
from agent.alerts.text import check, render


def sample(name: str, value: float, **labels: str) -> Sample:
    return Sample(name, labels, value)


def test_matchers_are_anchored_as_promql_anchors_them() -> None:
    assert matchers(a="x", b="~x|y", c="!z", d="!~w.*") == (
        Match("a", "=", "x"),
        Match("b", "=~", "x|y"),
        Match("c", "!=", "z"),
        Match("d", "!~", "w.*"),
    )
    assert Match("state", "=~", "un").holds({"state": "unhealthy"}) is False  # not a search: whole value
    assert Match("state", "!=", "x").holds({}) is True  # a missing label is the empty value
    assert series("up", job="gpu-agent").promql() == 'up{job="gpu-agent"}'


def test_dropped_labels_fold_series_into_one_alert_with_their_maximum() -> None:
    throttled = AlertExpr(Compare(series("t", reason="~a|b"), "==", 1), drop=("reason",))
    found = throttled.evaluate(
        [
            sample("t", 1, gpu="0", reason="a"),
            sample("t", 1, gpu="0", reason="b"),
            sample("t", 0, gpu="1", reason="a"),
            sample("t", 1, gpu="2", reason="c"),
        ]
    )
    assert found == [({"gpu": "0"}, 1)]


def test_an_empty_label_is_no_label_as_in_prometheus() -> None:
    down = AlertExpr(Compare(series("s"), "==", 0), drop=("unit",))
    assert down.evaluate([sample("s", 0, service="a", unit="", gpu="")]) == [({"service": "a"}, 0)]


def test_only_if_keeps_what_matches_on_its_labels() -> None:
    drift = AlertExpr(Compare(series("drift"), "==", 1), only_if=Compare(series("enforced"), "==", 1), on=("item",))
    samples = [
        sample("drift", 1, item="power_limit", gpu="0"),
        sample("drift", 1, item="ecc", gpu="0"),
        sample("enforced", 1, item="power_limit"),
        sample("enforced", 0, item="ecc"),
    ]
    assert drift.evaluate(samples) == [({"item": "power_limit", "gpu": "0"}, 1)]


def test_a_join_lends_its_labels_and_a_missing_lender_drops_the_series() -> None:
    xid = AlertExpr(
        Compare(series("open"), "==", 1), join=series("info", severity="critical"), on=("xid",), take=("action",)
    )
    samples = [
        sample("open", 1, gpu="0", xid="48"),
        sample("open", 1, gpu="1", xid="13"),
        sample("info", 1, xid="48", severity="critical", action="reset_gpu"),
        sample("info", 1, xid="13", severity="warning", action="restart_service"),
    ]
    assert xid.evaluate(samples) == [({"gpu": "0", "xid": "48", "action": "reset_gpu"}, 1)]


def test_the_promql_reads_a_silent_nodes_series_as_last_seen() -> None:
    promql = AlertExpr(Compare(series("gpu_agent_gpu_up"), "==", 0)).promql()
    assert "last_over_time(gpu_agent_gpu_up[10m]) unless on (instance, job) gpu_agent_up == 1" in promql
    assert promql.startswith("max without () (")


def test_texts_are_labels_only() -> None:
    check("GPU {{ $labels.gpu }} on {{ $labels.instance }}")
    for bad in ("{{ $value }}", "{{ $labels.gpu | toUpper }}", "{{ if $labels.unit }}x{{ end }}", "{{ $labels.gpu"):
        with pytest.raises(ValueError):
            check(bad)
    assert render("GPU {{ $labels.gpu }} ({{ $labels.uuid }})", {"gpu": "0"}) == "GPU 0 ()"
