"""The shipped alert rules are the catalogue's, and the catalogue's cases (tests/alerts/alert_cases.py)
hold both ways an alert is judged: Prometheus' (promtool runs the shipped file on them, and its
rendering of every summary and description must be the agent's) and the agent's own (its evaluation
of the same condition over the same series, with the same `for`, fires the same alerts)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from alert_cases import CASES, Case

from agent.alerts.catalog import BY_NAME, CATALOGUE, NODE_PROBLEMS, AlertSeverity, alert_severity
from agent.alerts.expr import AlertExpr, Sample
from agent.alerts.rules_file import RUNBOOKS_MARK, alert_rules, runbooks
from agent.alerts.text import check, render
from agent.events import Severity
from agent.verdict import NodeProblem
from agent.watch import xid_catalog

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "packaging/prometheus/gpu-agent-alerts.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
IDENTITY = ("alertname", "severity", "instance", "job")


def test_the_shipped_rules_are_the_catalogues() -> None:
    assert SHIPPED.read_text() == alert_rules(), f"regenerate: python -m agent.alerts > {SHIPPED.relative_to(ROOT)}"


def test_every_alert_has_its_runbook_section_in_the_docs() -> None:
    """docs/alerts.md ends with the catalogue's sections (each alert's runbook_url points at one)."""
    text = (ROOT / "docs/alerts.md").read_text()
    assert RUNBOOKS_MARK in text
    assert text[text.index(RUNBOOKS_MARK) :] == runbooks(), "regenerate: python -m agent.alerts --runbooks"
    assert {re.sub(r"[^a-z0-9]", "", h.lower()) for h in re.findall(r"^### (\w+)$", text, re.M)} == {
        spec.anchor for spec in CATALOGUE
    }


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_does_not() -> None:
    fired = {c.alert for c in CASES if any(c.fires.values())}
    quiet = {c.alert for c in CASES if any(not alerts for alerts in c.fires.values())}
    assert set(BY_NAME) - fired == set()
    assert set(BY_NAME) - quiet == set()
    assert {c.alert for c in CASES} <= set(BY_NAME)


def test_every_text_is_in_the_one_template_form_the_agent_renders() -> None:
    for spec in CATALOGUE:
        check(spec.summary)
        check(spec.description)
        assert "{{ $labels.instance }}" in spec.summary, spec.name


def test_one_severity_mapping_pages_fatal_as_critical() -> None:
    """The Xid catalog's severities are all mapped: the Xid alerts select on exactly these."""
    assert {s: alert_severity(s) for s in Severity} == {
        Severity.FATAL: AlertSeverity.CRITICAL,
        Severity.CRITICAL: AlertSeverity.CRITICAL,
        Severity.WARNING: AlertSeverity.WARNING,
        Severity.INFO: AlertSeverity.INFO,
    }
    assert {xid_catalog.verdict(code).severity for code in xid_catalog.all_codes()} <= {s.value for s in Severity}


def test_the_node_problems_are_the_verdicts() -> None:
    assert set(NODE_PROBLEMS) <= {problem.value for problem in NodeProblem}


def _labels(case: Case, extra: Mapping[str, str]) -> dict[str, str]:
    node = next(series.labels for series in case.series)
    return {"instance": node["instance"], "job": node["job"], **extra}


def _promtool_test(case: Case) -> dict[str, Any]:
    spec = BY_NAME[case.alert]
    checks = []
    for minute, alerts in sorted(case.fires.items()):
        expected = []
        for extra in alerts:
            labels = _labels(case, extra)
            expected.append(
                {
                    "exp_labels": {**labels, "severity": spec.severity.value},
                    "exp_annotations": {
                        "summary": render(spec.summary, labels),
                        "description": render(spec.description, labels),
                        "runbook_url": spec.runbook_url(),
                    },
                }
            )
        checks.append({"eval_time": f"{minute}m", "alertname": case.alert, "exp_alerts": expected})
    return {
        "interval": "1m",
        "input_series": [{"series": series.selector(), "values": series.values} for series in case.series],
        "alert_rule_test": checks,
    }


@needs_promtool
def test_promtool_runs_every_case_on_the_shipped_rules(tmp_path: Path) -> None:
    """One promtool run of every case: the rules fire as written, and Prometheus renders each alert's
    text as the agent does (`exp_annotations` are the agent's rendering)."""
    assert PROMTOOL is not None
    document = {
        "rule_files": [str(SHIPPED)],
        "evaluation_interval": "1m",
        "tests": [_promtool_test(case) for case in CASES],
    }
    tests = tmp_path / "alert-cases.yaml"
    tests.write_text(yaml.safe_dump(document, sort_keys=False))
    proc = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("case", [c for c in CASES if c.agent], ids=lambda c: f"{c.alert}:{c.why or 'fires'}")
def test_the_agent_fires_what_prometheus_fires(case: Case) -> None:
    """The agent's evaluation of each case, minute by minute with the alert's `for`, fires exactly the
    alerts promtool checks the rule fires (the node's labels aside: the agent adds its own)."""
    spec = BY_NAME[case.alert]
    assert isinstance(spec.expr, AlertExpr)
    held_since: dict[tuple[tuple[str, str], ...], int] = {}
    for minute in range(max(case.fires) + 1):
        samples = [
            Sample(series.name, {k: v for k, v in series.labels.items() if k not in ("instance", "job")}, value)
            for series in case.series
            if series.labels["instance"] == "gpu-node-1:9481" and (value := series.at(minute)) is not None
        ]
        held = {tuple(sorted(labels.items())) for labels, _ in spec.expr.evaluate(samples)}
        held_since = {key: held_since.get(key, minute) for key in held}
        if minute in case.fires:
            firing = {key for key, since in held_since.items() if (minute - since) * 60 >= spec.for_seconds}
            assert firing == {tuple(sorted(extra.items())) for extra in case.fires[minute]}, (minute, held_since)


def test_series_notation_is_read_as_promtool_reads_it() -> None:
    from alert_cases import s

    points = s("x", "_x2 1+1x2 0x1 stale 7").points()
    assert points == [None, None, 1.0, 2.0, 3.0, 0.0, 0.0, "stale", 7.0]
    series = s("x", "1 _x6 2 stale")
    assert [series.at(m) for m in (0, 3, 5, 6, 7, 8)] == [1.0, 1.0, 1.0, None, 2.0, None]
