"""Named families of /metrics: what a default scrape shows, how `metrics.families` switches them,
what a family that is off still shows (its notable series), how the config names them, and gzip."""

from __future__ import annotations

import gzip
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from snapshots import inference_fields, node_snapshot, telemetry_gpus

from agent.config import ConfigError, config_from_text
from agent.metrics.collector import SnapshotCollector
from agent.metrics.families import Families
from agent.metrics.server import MetricsServer, accepts_gzip
from agent.names.metric_families import DEFAULT_SWITCHES, FAMILIES, FAMILY_NAMES, FamilySwitches
from agent.state import NodeSnapshot, TuneResult, TuneStepFigures

ROOT = Path(__file__).resolve().parents[2]
METRICS_DOC = ROOT / "docs" / "metrics.md"

Series = set[tuple[str, frozenset[tuple[str, str]]]]


def full_snapshot() -> NodeSnapshot:
    gpu0, *others = telemetry_gpus()
    last_sweep = TuneResult(
        "sglang",
        "power",
        "NVIDIA H200",
        1_700_000_000.0,
        (TuneStepFigures(600, 2.1, 900.0, 0.8), TuneStepFigures(450, 2.4, 880.0, 0.9)),
        450,
    )
    return node_snapshot(
        gpus=(replace(gpu0, retired_pages_pending=False), *others), tunes=(last_sweep,), **inference_fields()
    )


def render(snapshot: NodeSnapshot, switches: FamilySwitches) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot, switches=switches))
    return generate_latest(registry).decode()


def series(text: str) -> Series:
    return {
        (sample.name, frozenset(sample.labels.items()))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def names(found: Series) -> set[str]:
    return {name for name, _ in found}


def test_every_family_of_the_catalog_has_series_and_each_switch_changes_the_scrape() -> None:
    """No family name is a dead switch: on the fully featured node, switching any one family away
    from its default changes what is scraped."""
    snapshot = full_snapshot()
    default = series(render(snapshot, DEFAULT_SWITCHES))
    for name, info in FAMILIES.items():
        switched = FamilySwitches.of({name: not info.default_on})
        changed = series(render(snapshot, switched))
        assert changed != default, f"switching {name} changes nothing"
        if info.default_on:
            assert changed < default, name  # off: only its notable series stay
        else:
            assert changed > default, name  # on: every series of it


def test_a_family_that_is_off_keeps_what_happened() -> None:
    """Off by default, ECC, NVLink per link, row remapping, clock events and open faults still show
    what is not 0: the errors counted, the link down, the remap pending, the fault open."""
    default = series(render(full_snapshot(), DEFAULT_SWITCHES))
    gpu1 = ("gpu", "1")

    def has(name: str, *labels: tuple[str, str]) -> bool:
        return any(n == name and set(labels) <= set(found) for n, found in default)

    assert has("gpu_agent_gpu_ecc_errors_total", gpu1, ("type", "uncorrected"))
    assert not has("gpu_agent_gpu_ecc_errors_total", ("gpu", "0"), ("type", "uncorrected"))  # 0: not listed
    assert has("gpu_agent_gpu_nvlink_link_errors_total", gpu1, ("link", "1"), ("counter", "crc_flit"))
    assert not has("gpu_agent_gpu_nvlink_link_errors_total", gpu1, ("link", "0"))  # no errors on link 0
    assert has("gpu_agent_gpu_nvlink_up", gpu1, ("link", "1"))  # down
    assert not has("gpu_agent_gpu_nvlink_up", gpu1, ("link", "0"))  # up, as it should be
    assert has("gpu_agent_gpu_row_remap_pending", gpu1)
    assert has("gpu_agent_gpu_clock_event_active", gpu1, ("reason", "hw_thermal_slowdown"))
    assert not has("gpu_agent_gpu_clock_event_active", gpu1, ("reason", "gpu_idle"))
    assert has("gpu_agent_gpu_fault", gpu1, ("cause", "xid"))
    assert not has("gpu_agent_gpu_fault", ("gpu", "0"))  # a healthy GPU has no open fault
    assert has("gpu_agent_gpu_recovery_action", gpu1, ("action", "gpu_reset"))
    assert not has("gpu_agent_gpu_recovery_action", ("gpu", "0"))  # none: the normal action
    assert has("gpu_agent_gpu_fabric_state", gpu1, ("state", "in_progress"))
    # off and nothing notable: a family that only describes shows nothing
    assert names(default) & {"gpu_agent_gpu_max_clock_hertz", "gpu_agent_gpu_pcie_link_width"} == set()
    assert "gpu_agent_service_request_latency_seconds" not in names(default)  # the window's quantiles


def test_the_switches_take_the_defaults_and_the_config() -> None:
    assert DEFAULT_SWITCHES.on == frozenset(name for name, info in FAMILIES.items() if info.default_on)
    switched = FamilySwitches.of({"nvlink_links": True, "temperature": False})
    assert switched.shows("nvlink_links") and not switched.shows("temperature") and switched.shows("power")
    assert FamilySwitches.everything().on == frozenset(FAMILY_NAMES)
    with pytest.raises(KeyError, match="nvlink_link"):
        FamilySwitches.of({"nvlink_link": True})
    with pytest.raises(KeyError, match="no_such_family"):
        Families().gauge("gpu_agent_x", "x", {}, 1.0, family="no_such_family")


def test_the_config_knows_the_family_names_and_says_did_you_mean() -> None:
    config = config_from_text("metrics:\n  families: {nvlink_links: true, modes: true, temperature: false}\n")
    assert config.metrics.families == {"nvlink_links": True, "modes": True, "temperature": False}
    with pytest.raises(ConfigError) as info:
        config_from_text("metrics:\n  listen: 127.0.0.1:9481\n  families: {nvlink_link: true}\n", "agent.yaml")
    assert [str(p) for p in info.value.problems] == [
        "agent.yaml:3 metrics.families: unknown family 'nvlink_link' (did you mean 'nvlink_links'?); "
        "the families are listed in docs/metrics.md"
    ]


def test_the_metrics_reference_lists_every_family() -> None:
    """docs/metrics.md: one table row per family with its default and the series it adds on an
    8-GPU node (bench/metrics_series.py measures them)."""
    rows = re.findall(r"^\| `([a-z_]+)` \| (on|off) \|", METRICS_DOC.read_text(), re.MULTILINE)
    assert dict(rows) == {name: "on" if info.default_on else "off" for name, info in FAMILIES.items()}


# -- gzip ------------------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    snapshot = full_snapshot()
    srv = MetricsServer("127.0.0.1:0", lambda: snapshot)
    try:
        yield srv
    finally:
        srv.close()


def fetch(url: str, accept_encoding: str | None) -> tuple[dict[str, str], bytes]:
    headers = {} if accept_encoding is None else {"Accept-Encoding": accept_encoding}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
        return dict(response.headers), response.read()


def test_metrics_are_gzipped_when_the_scraper_asks(server: MetricsServer) -> None:
    """What Prometheus sends on every scrape (`Accept-Encoding: gzip`) gets a gzipped body, a
    fraction of the plain one; a scraper that does not ask gets the text."""
    plain_headers, plain = fetch(server.url + "/metrics", None)
    assert "Content-Encoding" not in plain_headers and plain_headers["Vary"] == "Accept-Encoding"
    headers, body = fetch(server.url + "/metrics", "gzip, deflate")
    assert headers["Content-Encoding"] == "gzip"
    assert int(headers["Content-Length"]) == len(body) < len(plain) / 4
    assert gzip.decompress(body) == plain
    # served again from the same snapshot: the same bytes, compressed once
    assert fetch(server.url + "/metrics", "gzip")[1] == body
    assert "Content-Encoding" not in fetch(server.url + "/metrics", "gzip;q=0, identity")[0]
    assert "Content-Encoding" not in fetch(server.url + "/healthz", "gzip")[0]


def test_accept_encoding_is_read_as_http_says() -> None:
    assert accepts_gzip("gzip")
    assert accepts_gzip("deflate, GZIP;q=0.5")
    assert accepts_gzip("*")
    assert accepts_gzip("x-gzip")
    assert not accepts_gzip("")
    assert not accepts_gzip("identity")
    assert not accepts_gzip("gzip;q=0")
    assert not accepts_gzip("gzip;q=zero")
    assert not accepts_gzip("br, deflate")


def test_a_reload_switches_families_from_the_next_scrape(server: MetricsServer) -> None:
    _, before = fetch(server.url + "/metrics", None)
    assert b"gpu_agent_gpu_pcie_link_width" not in before
    server.switches = FamilySwitches.of({"pcie_link": True})
    _, after = fetch(server.url + "/metrics", None)
    assert b"gpu_agent_gpu_pcie_link_width" in after  # the rendering of that snapshot was not reused
