"""Metrics: what the collector renders from a snapshot, the HTTP server, and promtool's lint."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FakeClock
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from snapshots import (
    DRIVER_VERSION,
    STARTED_SECONDS,
    TIMESTAMP_SECONDS,
    gpu_uuid,
    h200_sample,
    node_snapshot,
    snapshot_from_backend,
)

from agent import __version__
from agent.backend.base import CLOCK_EVENT_REASONS
from agent.backend.sim import SimulatedBackend
from agent.collect import sample_all
from agent.metrics.collector import SnapshotCollector
from agent.metrics.server import MetricsServer, parse_listen
from agent.names.metric_families import DEFAULT_SWITCHES, FamilySwitches
from agent.state import GpuSample, NodeSnapshot
from agent.verdict import attention, attention_items
from agent.version import current

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
EVERYTHING = FamilySwitches.everything()


def render(snapshot: NodeSnapshot | None, switches: FamilySwitches = EVERYTHING) -> str:
    """The scrape of `snapshot`, every family on unless told (the contract of each series;
    tests/metrics/test_families.py holds what the default leaves out)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(lambda: snapshot, switches=switches))
    return generate_latest(registry).decode()


def samples_of(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def series(samples: Samples, name: str, **labels: str) -> list[dict[str, str]]:
    """Label sets of every series of `name` whose labels include `labels`."""
    return [
        dict(key_labels)
        for (key_name, key_labels) in samples
        if key_name == name and set(labels.items()) <= set(key_labels)
    ]


def gpu(index: int) -> dict[str, str]:
    return {"gpu": str(index), "uuid": gpu_uuid(index)}


@pytest.fixture(scope="module")
def full() -> Samples:
    return samples_of(render(node_snapshot()))


# -- the contract names -------------------------------------------------------------------------


def test_identity_and_agent_series(full: Samples) -> None:
    assert value(full, "gpu_agent_build_info", version=__version__, revision=current().revision) == 1
    assert value(full, "gpu_agent_up") == 1
    assert value(full, "gpu_agent_backend_info", backend="simulated", driver_version=DRIVER_VERSION) == 1
    assert value(full, "gpu_agent_start_time_seconds") == STARTED_SECONDS
    assert value(full, "gpu_agent_snapshot_timestamp_seconds") == TIMESTAMP_SECONDS
    assert value(full, "gpu_agent_collect_duration_seconds") == pytest.approx(0.0345)
    assert series(full, "gpu_agent_gpu_info") == [
        {**gpu(i), "name": name, "pci_bus_id": bus, "driver_version": DRIVER_VERSION}
        for i, name, bus in [
            (0, "NVIDIA H200", "00000000:18:00.0"),
            (1, "NVIDIA H200", "00000000:2A:00.0"),
            (2, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "00000000:3A:00.0"),
            (3, "NVIDIA H200", "00000000:5D:00.0"),
        ]
    ]


def test_power_clocks_fans_in_base_units(full: Samples) -> None:
    assert value(full, "gpu_agent_gpu_power_limit_watts", **gpu(0)) == 700.0
    assert value(full, "gpu_agent_gpu_power_limit_watts", **gpu(2)) == 600.0
    assert value(full, "gpu_agent_gpu_power_usage_watts", **gpu(1)) == 512.5
    assert value(full, "gpu_agent_gpu_clock_hertz", clock="graphics", **gpu(0)) == 1.98e9
    assert value(full, "gpu_agent_gpu_clock_hertz", clock="sm", **gpu(1)) == 9.9e8
    assert value(full, "gpu_agent_gpu_clock_hertz", clock="memory", **gpu(0)) == 3.201e9
    assert value(full, "gpu_agent_gpu_fan_speed_ratio", fan="0", **gpu(2)) == 0.72
    assert value(full, "gpu_agent_gpu_fan_speed_ratio", fan="1", **gpu(2)) == 0.74
    assert series(full, "gpu_agent_gpu_fan_speed_ratio", gpu="0") == []  # SXM: no fans, no series
    assert value(full, "gpu_agent_gpu_temperature_celsius", **gpu(1)) == 90
    assert value(full, "gpu_agent_gpu_temperature_threshold_celsius", threshold="slowdown", **gpu(0)) == 89
    assert value(full, "gpu_agent_gpu_temperature_threshold_celsius", threshold="shutdown", **gpu(0)) == 95
    assert value(full, "gpu_agent_gpu_utilization_ratio", **gpu(0)) == 1.0
    assert value(full, "gpu_agent_gpu_memory_utilization_ratio", **gpu(2)) == 0.71
    assert value(full, "gpu_agent_gpu_memory_total_bytes", **gpu(0)) == 150_754_820_096
    assert value(full, "gpu_agent_gpu_persistence_mode_enabled", **gpu(2)) == 0


def test_clock_events_every_known_reason_and_seconds(full: Samples) -> None:
    active = {
        labels["reason"]: value(full, "gpu_agent_gpu_clock_event_active", **labels)
        for labels in series(full, "gpu_agent_gpu_clock_event_active", gpu="1")
    }
    assert set(active) == set(CLOCK_EVENT_REASONS.values())
    assert {reason for reason, on in active.items() if on} == {"sw_thermal_slowdown", "hw_thermal_slowdown"}
    assert all(
        value(full, "gpu_agent_gpu_clock_event_active", **labels) == 0
        for labels in series(full, "gpu_agent_gpu_clock_event_active", gpu="0")
    )
    assert value(full, "gpu_agent_gpu_clock_event_seconds_total", reason="hw_thermal_slowdown", **gpu(1)) == 42.5
    assert value(full, "gpu_agent_gpu_clock_event_seconds_total", reason="sw_power_cap", **gpu(0)) == 3.0
    assert value(full, "gpu_agent_gpu_violation_seconds_total", reason="thermal", **gpu(1)) == 42.5
    assert value(full, "gpu_agent_gpu_violation_seconds_total", reason="power", **gpu(0)) == 3.0


def test_xids_per_gpu_and_unattributed(full: Samples) -> None:
    assert value(full, "gpu_agent_xid_errors_total", xid="48", **gpu(1)) == 1
    assert value(full, "gpu_agent_xid_errors_total", xid="63", **gpu(1)) == 2
    assert value(full, "gpu_agent_xid_errors_total", xid="79", **gpu(3)) == 1
    # a kernel-log Xid whose PCI address matched no known GPU
    assert value(full, "gpu_agent_xid_errors_total", gpu="", uuid="", xid="13") == 1
    assert value(full, "gpu_agent_xid_last_seen_timestamp_seconds", xid="48", **gpu(1)) == TIMESTAMP_SECONDS - 120


def test_gpu_state_health_stale_and_lost(full: Samples) -> None:
    assert [value(full, "gpu_agent_gpu_up", **gpu(i)) for i in range(4)] == [1, 1, 1, 0]
    assert [value(full, "gpu_agent_gpu_stale", **gpu(i)) for i in range(4)] == [0, 0, 1, 0]
    for index, state in [(0, "healthy"), (1, "unhealthy"), (2, "degraded"), (3, "unhealthy")]:
        one_hot = {
            s["state"]: value(full, "gpu_agent_gpu_health", **s)
            for s in series(full, "gpu_agent_gpu_health", gpu=str(index))
        }
        assert one_hot == {s: float(s == state) for s in ("healthy", "degraded", "unhealthy")}
    # the lost GPU keeps identity, up, stale and the verdicts, and no reading
    lost = {name for (name, labels) in full if ("gpu", "3") in labels}
    assert lost == {
        "gpu_agent_gpu_info",
        "gpu_agent_gpu_up",
        "gpu_agent_gpu_stale",
        "gpu_agent_gpu_health",
        "gpu_agent_gpu_health_info",
        "gpu_agent_gpu_fault",
        "gpu_agent_gpu_pcie_degraded",
        "gpu_agent_gpu_throttled",
        "gpu_agent_gpu_xid_errors_total",
        "gpu_agent_policy_drift",
        "gpu_agent_gpu_read_error",
        "gpu_agent_xid_errors_total",
        "gpu_agent_xid_last_seen_timestamp_seconds",
        "gpu_agent_xid_open",
        "gpu_agent_gpu_xid_last_code",
        "gpu_agent_policy_in_sync",
        "gpu_agent_policy_status",
    }
    assert value(full, "gpu_agent_gpu_read_error", field="temperature_celsius", kind="gpu_lost", **gpu(3)) == 1
    assert value(full, "gpu_agent_gpu_read_error", field="performance_state", kind="unknown", **gpu(2)) == 1
    assert value(full, "gpu_agent_gpu_recovery_action", action="gpu_reset", **gpu(1)) == 1
    assert value(full, "gpu_agent_gpu_recovery_action", action="none", **gpu(1)) == 0
    assert value(full, "gpu_agent_gpu_recovery_action", action="none", **gpu(0)) == 1


def test_ecc_remap_pcie(full: Samples) -> None:
    assert value(full, "gpu_agent_gpu_ecc_errors_total", type="corrected", **gpu(0)) == 3
    assert value(full, "gpu_agent_gpu_ecc_errors_total", type="uncorrected", **gpu(1)) == 1
    assert value(full, "gpu_agent_gpu_ecc_volatile_errors", type="uncorrected", **gpu(1)) == 1
    # ECC off on the RTX board: NVML says NOT_SUPPORTED, so no counters at all (not zeros)
    assert series(full, "gpu_agent_gpu_ecc_errors_total", gpu="2") == []
    assert series(full, "gpu_agent_gpu_ecc_volatile_errors", gpu="2") == []
    assert value(full, "gpu_agent_gpu_ecc_enabled", **gpu(2)) == 0
    assert value(full, "gpu_agent_gpu_row_remap_pending", **gpu(1)) == 1
    assert value(full, "gpu_agent_gpu_row_remap_failed", **gpu(1)) == 0
    assert value(full, "gpu_agent_gpu_remapped_rows", cause="uncorrectable", **gpu(0)) == 0
    assert series(full, "gpu_agent_gpu_retired_pages_pending") == []  # Hopper/Blackwell remap rows instead
    assert value(full, "gpu_agent_gpu_pcie_link_generation", **gpu(2)) == 4
    assert value(full, "gpu_agent_gpu_pcie_link_max_generation", **gpu(2)) == 5
    assert value(full, "gpu_agent_gpu_pcie_link_width", **gpu(2)) == 16
    assert value(full, "gpu_agent_gpu_pcie_replays_total", **gpu(0)) == 0


def test_policy_series(full: Samples) -> None:
    assert value(full, "gpu_agent_policy_in_sync", item="triton_cache", gpu="", uuid="") == 0
    assert value(full, "gpu_agent_policy_in_sync", item="transparent_hugepages", gpu="", uuid="") == 1
    assert value(full, "gpu_agent_policy_in_sync", item="power_limit", **gpu(2)) == 0
    assert value(full, "gpu_agent_policy_in_sync", item="power_limit", **gpu(0)) == 1
    assert value(full, "gpu_agent_policy_in_sync", item="fan_curve", **gpu(0)) == 1  # not applicable counts as in sync
    assert value(full, "gpu_agent_policy_in_sync", item="ecc", **gpu(2)) == 0  # reboot required
    statuses = {
        s["status"]: value(full, "gpu_agent_policy_status", **s)
        for s in series(full, "gpu_agent_policy_status", item="ecc")
    }
    assert statuses == {
        "in_sync": 0,
        "drift": 0,
        "not_applicable": 0,
        "reboot_required": 1,
        "error": 0,
        "held": 0,  # a job drives it (a tune sweep): not drift
    }
    assert value(full, "gpu_agent_policy_status", item="power_limit", status="error", **gpu(3)) == 1
    assert value(full, "gpu_agent_policy_enforced", item="power_limit") == 1
    assert value(full, "gpu_agent_policy_enforced", item="triton_cache") == 0


def test_services_remediations_collectors(full: Samples) -> None:
    assert value(full, "gpu_agent_service_up", service="sglang", unit="sglang.service") == 1
    assert value(full, "gpu_agent_service_up", service="embeddings", unit="embeddings.service") == 0
    assert series(full, "gpu_agent_service_up", service="vllm") == []  # not probed yet
    assert value(full, "gpu_agent_service_consecutive_failures", service="embeddings", unit="embeddings.service") == 3
    assert value(full, "gpu_agent_service_probe_latency_seconds", service="sglang", unit="sglang.service") == 0.0123
    assert series(full, "gpu_agent_service_probe_latency_seconds", service="vllm") == []
    assert value(full, "gpu_agent_remediations_total", rule="xid-reset-gpu", action="reset_gpu", outcome="failed") == 1
    assert (
        value(
            full,
            "gpu_agent_remediations_total",
            rule="service-unhealthy",
            action="restart_service",
            outcome="succeeded",
        )
        == 2
    )
    assert value(full, "gpu_agent_collector_success", collector="kmsg") == 0
    assert value(full, "gpu_agent_collector_success", collector="gpu") == 1
    assert value(full, "gpu_agent_collector_duration_seconds", collector="policy") == 0.017


def test_none_readings_are_omitted_not_zero() -> None:
    bare = GpuSample(0, gpu_uuid(0), "NVIDIA H200", "00000000:18:00.0", up=True, timestamp_seconds=TIMESTAMP_SECONDS)
    samples = samples_of(render(node_snapshot(gpus=(bare,), health={}, policy=(), clock_event_seconds={}, xids=())))
    per_gpu = {name for (name, labels) in samples if ("gpu", "0") in labels}
    # readings are omitted; the verdicts (nothing found: 0) are not
    assert per_gpu == {
        "gpu_agent_gpu_info",
        "gpu_agent_gpu_up",
        "gpu_agent_gpu_stale",
        "gpu_agent_gpu_pcie_degraded",
        "gpu_agent_gpu_throttled",
        "gpu_agent_gpu_xid_errors_total",
    }


def test_unknown_recovery_action_gets_its_own_series() -> None:
    samples = samples_of(render(node_snapshot(gpus=(h200_sample(0, recovery_action=7),))))
    actions = {
        s["action"]: value(samples, "gpu_agent_gpu_recovery_action", **s)
        for s in series(samples, "gpu_agent_gpu_recovery_action")
    }
    assert actions == {
        "none": 0,
        "gpu_reset": 0,
        "node_reboot": 0,
        "drain_p2p": 0,
        "drain_and_reset": 0,
        "unknown_7": 1,
    }


def test_no_snapshot_yet_only_build_info_and_up_zero() -> None:
    samples = samples_of(render(None))
    assert samples == {
        ("gpu_agent_build_info", frozenset({("version", __version__), ("revision", current().revision)})): 1.0,
        ("gpu_agent_up", frozenset()): 0.0,
    }


@needs_promtool
@pytest.mark.parametrize("snapshot", [node_snapshot(), None], ids=["full", "no-snapshot"])
def test_promtool_check_metrics_is_clean(snapshot: NodeSnapshot | None) -> None:
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=render(snapshot), capture_output=True, text=True, timeout=30
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


# -- the HTTP server ----------------------------------------------------------------------------


def get(url: str, accept: str | None = None) -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    snapshot = node_snapshot()
    srv = MetricsServer("127.0.0.1:0", lambda: snapshot)
    try:
        yield srv
    finally:
        srv.close()


def test_http_metrics_serves_the_collector_text(server: MetricsServer) -> None:
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"
    status, content_type, body = get(server.url + "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    assert body == render(node_snapshot(), DEFAULT_SWITCHES)


def test_http_metrics_openmetrics_when_asked(server: MetricsServer) -> None:
    status, content_type, body = get(server.url + "/metrics", accept="application/openmetrics-text; version=1.0.0")
    assert status == 200
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith("# EOF\n")
    families = {family.name: family for family in parse_openmetrics(body)}  # type: ignore[no-untyped-call]
    assert families["gpu_agent_xid_errors"].type == "counter"
    xid48 = [s for s in families["gpu_agent_xid_errors"].samples if s.labels.get("xid") == "48"]
    assert [(s.name, s.value) for s in xid48] == [("gpu_agent_xid_errors_total", 1)]


def test_http_healthz_and_unknown_paths(server: MetricsServer) -> None:
    status, content_type, body = get(server.url + "/healthz")
    assert (status, content_type) == (200, "application/json")
    reply = json.loads(body)
    assert reply["status"] == "ok"
    assert reply["snapshot_age_seconds"] > 0
    assert get(server.url + "/nope")[0] == 404
    status, _, page = get(server.url + "/")
    assert status == 200
    assert 'href="/metrics"' in page
    assert get(server.url + "/metrics?name[]=x")[0] == 200


def test_http_healthz_before_first_snapshot_and_when_stale() -> None:
    current: list[NodeSnapshot | None] = [None]
    clock = FakeClock(wall_seconds=TIMESTAMP_SECONDS + 5)
    srv = MetricsServer("127.0.0.1:0", lambda: current[0], stale_after_seconds=30, clock=clock)
    try:
        status, _, body = get(srv.url + "/healthz")
        assert (status, json.loads(body)["status"]) == (503, "starting")
        assert "gpu_agent_up 0.0" in get(srv.url + "/metrics")[2]
        current[0] = node_snapshot()
        status, _, body = get(srv.url + "/healthz")
        reply = json.loads(body)
        assert (status, reply["status"], reply["snapshot_age_seconds"]) == (200, "ok", 5.0)
        # what needs a look is in the body; the node still takes work (a node problem would be 503)
        assert reply["attention"] == attention(node_snapshot())
        assert reply["causes"] == [item.cause.value for item in attention_items(node_snapshot())]
        assert "service_down" in reply["causes"]
        clock.advance(26)  # 31 s after the snapshot
        status, _, body = get(srv.url + "/healthz")
        assert status == 503
        assert json.loads(body)["status"] == "stale"
    finally:
        srv.close()


def test_a_failing_render_costs_one_scrape_not_the_server() -> None:
    calls = [0]

    def flaky() -> NodeSnapshot:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("snapshot getter broke")
        return node_snapshot()

    srv = MetricsServer("127.0.0.1:0", flaky)
    try:
        status, _, body = get(srv.url + "/metrics")
        assert status == 500
        assert "snapshot getter broke" in body
        status, _, body = get(srv.url + "/metrics")
        assert status == 200
        assert "gpu_agent_up 1.0" in body
    finally:
        srv.close()


def test_close_releases_the_port() -> None:
    srv = MetricsServer("127.0.0.1:0", lambda: None)
    port = srv.port
    srv.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("0.0.0.0:9481", ("0.0.0.0", 9481)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        (":9481", ("0.0.0.0", 9481)),
        ("[::1]:9481", ("::1", 9481)),
        ("[::]:9481", ("::", 9481)),
    ],
)
def test_parse_listen(listen: str, expected: tuple[str, int]) -> None:
    assert parse_listen(listen) == expected


@pytest.mark.parametrize("listen", ["9481", "host:", "host:port", "host:70000"])
def test_parse_listen_rejects(listen: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_listen(listen)


def test_scrape_does_not_wait_for_a_hung_gpu_call(tmp_path: Path) -> None:
    """The loop is stuck in a hung NVML call (holding its own lock); a scrape still answers at once."""
    backend = SimulatedBackend("h200x8", tmp_path)
    backend.init()
    published = snapshot_from_backend(backend)  # what the previous loop published
    backend.hang_call(0, "temperature_celsius", 3.0)
    loop_lock = threading.Lock()

    def stuck_loop() -> None:
        with loop_lock:
            sample_all(backend)

    loop = threading.Thread(target=stuck_loop)
    srv = MetricsServer("127.0.0.1:0", lambda: published)
    try:
        loop.start()
        time.sleep(0.1)
        assert loop_lock.locked()
        started = time.monotonic()
        status, _, body = get(srv.url + "/metrics")
        elapsed = time.monotonic() - started
        assert loop.is_alive(), "the hang did not last through the scrape: the test proves nothing"
        assert status == 200
        assert elapsed < 1.5
        assert body.count("gpu_agent_gpu_up{") == 8
    finally:
        srv.close()
        loop.join(timeout=5)


def test_a_stalled_client_does_not_block_other_scrapes(server: MetricsServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5):  # connects, never sends a request
        started = time.monotonic()
        assert get(server.url + "/metrics")[0] == 200
        assert time.monotonic() - started < 0.5


def test_concurrent_scrapes_while_snapshots_swap() -> None:
    snapshots = [node_snapshot(collect_duration_seconds=float(i)) for i in range(10)]
    current = [snapshots[0]]
    srv = MetricsServer("127.0.0.1:0", lambda: current[0])
    errors: list[BaseException] = []

    def scrape() -> None:
        try:
            for _ in range(5):
                status, _, body = get(srv.url + "/metrics")
                assert status == 200
                assert "gpu_agent_up 1.0" in body
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=scrape) for _ in range(8)]
    try:
        for thread in threads:
            thread.start()
        for snapshot in snapshots:
            current[0] = snapshot
            time.sleep(0.005)
        for thread in threads:
            thread.join(timeout=10)
    finally:
        srv.close()
    assert errors == []


def test_a_snapshot_is_rendered_once_however_often_it_is_scraped() -> None:
    first, second = node_snapshot(), node_snapshot()
    current = [first]
    collected: list[object] = []

    def getter() -> object:
        collected.append(current[0])
        return current[0]

    srv = MetricsServer("127.0.0.1:0", getter)  # type: ignore[arg-type]
    try:
        bodies = []
        for _ in range(3):
            with urllib.request.urlopen(f"{srv.url}/metrics", timeout=5) as response:
                bodies.append(response.read())
        renders_of_first = len(collected)
        current[0] = second
        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=5) as response:
            bodies.append(response.read())
    finally:
        srv.close()
    assert bodies[0] == bodies[1] == bodies[2]
    # one lookup per scrape to find the snapshot, plus one collection for the first scrape only
    assert renders_of_first == 3 + 1
    assert len(collected) == renders_of_first + 2  # a new snapshot is collected again
