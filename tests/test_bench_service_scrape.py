"""bench/service_scrape runs in a tiny configuration and writes a valid result document (its
figures are measurements, not checked)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import service_scrape
from bench.common import SCHEMA


def test_service_scrape_benchmark_measures_a_real_sized_page(tmp_path: Path) -> None:
    out = tmp_path / "service_scrape.json"
    returned = service_scrape.main(["--rounds", "3", "--dp-ranks", "2", "--warmup-seconds", "1", "--out", str(out)])
    document = json.loads(out.read_text())
    assert document == json.loads(json.dumps(returned))
    assert document["schema"] == SCHEMA
    assert document["benchmark"] == "service_scrape"
    results = document["results"]
    assert results["page"]["bytes"] > 10_000  # the stand-in's sglang page with two ranks, filled by traffic
    for phase in ("fetch", "parse", "scrape", "parse_whole_page", "window"):
        for clock in ("wall_ms", "cpu_ms"):
            assert results[phase][clock]["n"] >= 1
        assert results[phase]["wall_ms"]["min"] > 0
    assert [goal["met"] in (True, False) for goal in document["targets"]] == [True, True]
