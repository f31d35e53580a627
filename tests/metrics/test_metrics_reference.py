"""docs/metrics-reference.md, the metrics reference, is written from tests/fixtures/metrics-golden-all.txt: the
whole /metrics text of a fixed node that holds every family the exporter knows
(tests/metrics/test_metrics_golden.py). Each family's name as exposed, type, labels and HELP text
come from there, so the page cannot drift from the exporter: a changed family changes the golden
file, and then this page. Regenerate both when a change to the exporter is meant:

    UPDATE_GOLDEN=1 PYTHONPATH=$PWD .venv/bin/python -m pytest tests/metrics/test_metrics_golden.py tests/metrics/test_metrics_reference.py
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "fixtures" / "metrics-golden-all.txt"
REFERENCE = REPO / "docs" / "metrics-reference.md"
#: Labels every histogram and summary has: the bucket bound and the quantile, not the family's own.
STRUCTURAL_LABELS = {"le", "quantile"}
INTRO = """# Metrics reference

Every family gpu-agent exports on `/metrics` (`metrics.listen` in agent.yaml, `0.0.0.0:9481` by
default), in the order the endpoint lists them. What they mean together, the Grafana dashboard and
the alert and recording rules built on them: the README's "Metrics, dashboard, alerts" and
[inference.md](inference.md) for the inference servers' figures. Which families a scrape shows by
default, what each costs a fleet and how to switch them: [metrics.md](metrics.md).

This page is written from `tests/fixtures/metrics-golden-all.txt`, the whole `/metrics` text of a
fixed node with every family switched on, so it cannot drift from the exporter
(`tests/metrics/test_metrics_reference.py`; `UPDATE_GOLDEN=1` rewrites both). A counter is shown
as exposed, with `_total`; a summary as its family, exposed with its `quantile` label and as
`_sum` and `_count`.

| metric | type | labels | meaning |
|---|---|---|---|
"""


def exposed_name(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


def reference(exposition: str) -> str:
    """The reference page of an exposition text: a table row per family, in its order."""
    rows = []
    for family in text_string_to_metric_families(exposition):
        labels = sorted({label for sample in family.samples for label in sample.labels} - STRUCTURAL_LABELS)
        shown = ", ".join(f"`{label}`" for label in labels) or "-"
        meaning = family.documentation.replace("|", "\\|")
        rows.append(f"| `{exposed_name(family.name, family.type)}` | {family.type} | {shown} | {meaning} |")
    return INTRO + "\n".join(rows) + "\n"


def test_the_reference_is_the_golden_files_families() -> None:
    written = reference(GOLDEN.read_text())
    if os.environ.get("UPDATE_GOLDEN") == "1":
        REFERENCE.write_text(written)
        pytest.skip(f"rewrote {REFERENCE}: review its diff")
    assert REFERENCE.read_text() == written, (
        "docs/metrics-reference.md is not the golden file's: regenerate (UPDATE_GOLDEN=1)"
    )


def test_every_family_in_the_golden_file_has_its_row() -> None:
    """Checked on the page itself, apart from the generator: a family the page leaves out fails."""
    golden = GOLDEN.read_text()
    families = re.findall(r"^# TYPE (\S+) (\S+)$", golden, re.MULTILINE)
    assert len(families) > 90
    page = REFERENCE.read_text()
    for name, kind in families:
        help_text = re.search(rf"^# HELP {re.escape(name)} (.*)$", golden, re.MULTILINE)
        assert help_text is not None, name
        row = f"| `{name}` | {kind} |"  # the TYPE line names a counter as exposed, with _total
        assert row in page, f"docs/metrics-reference.md has no row for {name}"
        assert help_text.group(1).replace("|", "\\|") in page, name
