"""The daemon-side parts: scraping real servers on their own threads (a hanging one delays nobody),
and SLO verdicts drawn from the window's GPU samples."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import DEFAULT_POLICY, write_agent_config
from slow_endpoint import SlowEndpoint

from agent.backend import open_backend
from agent.collect import sample_all
from agent.config import AgentConfig
from agent.config.service_entry import ServiceConfig
from agent.demo.standin_process import StandinServer, free_port
from agent.events import Event, EventKind, Severity
from agent.services.monitor import InferenceMonitor, LatencyRegressionWatch, ServiceScraper, expected_clocks_mhz
from agent.state import GpuSample, LatencyFigures, ServiceFigures


def scraped(port: int, name: str) -> ServiceConfig:
    return ServiceConfig.model_validate(
        {
            "name": name,
            "health_url": f"http://127.0.0.1:{port}/health",
            "probe_timeout_seconds": 0.5,
            "scrape_interval_seconds": 0.3,
        }
    )


def test_each_service_is_scraped_on_its_own_thread_and_a_hang_delays_nobody(tmp_path: Path) -> None:
    with StandinServer(tmp_path) as good, StandinServer(tmp_path) as wedged:
        wedged.set_mode("hang")
        scraper = ServiceScraper([scraped(good.port, "good"), scraped(wedged.port, "wedged")])
        scraper.start()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                figures = scraper.figures()
                good_figures = figures.get("good")
                if good_figures is not None and "e2e" in good_figures.latency and "wedged" in figures:
                    break
                time.sleep(0.1)
        finally:
            started = time.monotonic()
            scraper.stop()
            stop_seconds = time.monotonic() - started
    assert good_figures is not None
    assert good_figures.kind == "sglang"
    assert good_figures.latency["e2e"].requests > 0
    assert figures["wedged"].error == "timed out after 0.3 s"
    assert figures["wedged"].latency == {}
    assert stop_seconds < 2.0


def sample(gpu: int, t: float, reasons: int = 0, temperature: int = 66) -> GpuSample:
    return GpuSample(
        gpu,
        f"GPU-{gpu}",
        "NVIDIA H200",
        "00000000:18:00.0",
        True,
        t,
        temperature_celsius=temperature,
        graphics_clock_mhz=1980,
        clock_event_reasons=reasons,
        gpu_utilization_percent=95,
    )


def breaching(p95: float) -> ServiceFigures:
    latency = {"e2e": LatencyFigures(100, 1.0, {0.5: 1.0, 0.95: p95, 0.99: p95})}
    return ServiceFigures("sglang", "sglang", 0.0, 300.0, latency, running=10, waiting=0)


def test_a_breach_is_named_from_the_service_gpus_in_the_window() -> None:
    now = [1000.0]
    config = AgentConfig.model_validate(
        {
            "services": [
                {
                    "name": "sglang",
                    "health_url": "http://127.0.0.1:30000/health",
                    "gpus": [1],
                    "slo": {"e2e_p95_seconds": 1.5},
                }
            ]
        }
    )
    watch = LatencyRegressionWatch(config, window_seconds=300, clock=lambda: now[0])
    old_xid = Event(EventKind.XID, Severity.WARNING, 1, "GPU-1", "Xid 13", 500.0, "nvml", "xid:1", {"xid": 13})
    watch.observe([sample(1, 500.0)], [old_xid])  # before the window: forgotten
    watch.observe([sample(0, 990.0, reasons=0x40, temperature=92), sample(1, 990.0)], [])
    watch.observe([sample(1, 995.0, reasons=0x40, temperature=91), sample(1, 1000.0, reasons=0x40, temperature=91)], [])
    assert watch.evaluate({"sglang": breaching(1.2)}) == []
    (event,) = watch.evaluate({"sglang": breaching(2.0)})
    assert event.kind is EventKind.SERVICE_LATENCY_REGRESSION
    assert (event.gpu, event.data["cause"]) == (1, "thermal_slowdown")  # GPU 0 is hotter, but not the service's
    assert watch.evaluate({"sglang": breaching(2.0)}) == []


def test_expected_clocks_come_from_the_matching_policy_profile() -> None:
    config = AgentConfig.model_validate(
        {"policy": {"gpus": [{"match": {"index": 1}, "locked_clocks": {"gpu_mhz": [1500, 1755]}}]}}
    )
    assert expected_clocks_mhz(config, [sample(0, 0.0), sample(1, 0.0)]) == {1: 1755}


def standin_config(tmp_path: Path, port: int, state_dir: Path) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "backend": "simulated",
            "simulated": {"profile": "h200x2"},
            "state_dir": str(state_dir),
            "host_root": str(tmp_path / "root"),
            "services": [
                {
                    "name": "sglang",
                    "manager": "command",
                    "start_command": ["/bin/true"],
                    "stop_command": ["/bin/true"],
                    "health_url": f"http://127.0.0.1:{port}/health",
                    "gpus": [0],
                    "probe_timeout_seconds": 1,
                    "scrape_interval_seconds": 0.3,
                    "slo": {"e2e_p95_seconds": 1.5, "min_requests": 5},
                }
            ],
        }
    )


def test_the_monitor_names_a_thermal_slowdown_behind_a_real_servers_latency(tmp_path: Path) -> None:
    state_dir = tmp_path / "sim"
    port = free_port()
    args = ("--flavor", "sglang", "--sim-state-dir", str(state_dir), "--sim-profile", "h200x2", "--gpus", "0")
    config = standin_config(tmp_path, port, state_dir)
    backend = open_backend(config)
    with StandinServer(tmp_path, port=port, extra_args=args):
        monitor = InferenceMonitor(config, lambda: backend)
        monitor.start()
        try:
            events: list[Event] = []
            injected_at = time.monotonic() + 2.0
            deadline = time.monotonic() + 20
            while not events and time.monotonic() < deadline:
                if injected_at is not None and time.monotonic() >= injected_at:
                    backend.set_temperature(0, 92)  # type: ignore[attr-defined]
                    injected_at = None
                events = monitor.on_loop(sample_all(backend), [])
                assert not events or injected_at is None, "a regression before the slowdown"
                time.sleep(0.3)
            attribution = monitor.attributor.attribute_once()
        finally:
            monitor.stop()
    (event,) = events
    assert event.kind is EventKind.SERVICE_LATENCY_REGRESSION
    assert (event.gpu, event.data["cause"]) == (0, "thermal_slowdown")
    assert "service sglang: e2e p95" in event.message
    assert "likely cause: GPU 0 thermal slowdown" in event.message
    # the stand-in registered itself on simulated GPU 0: its memory is the service's
    assert attribution is not None
    assert set(attribution.memory_bytes) == {"sglang"}
    assert set(attribution.memory_bytes["sglang"]) == {0}
    assert attribution.memory_bytes["sglang"][0] > 0
    assert attribution.unattributed == ()


def served(endpoint: SlowEndpoint, name: str, **fields: object) -> ServiceConfig:
    return ServiceConfig.model_validate(
        {"name": name, "health_url": endpoint.url("/health"), "probe_timeout_seconds": 2.0, **fields}
    )


E2E_PAGE = """\
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{{le="0.5"}} {low}
sglang:e2e_request_latency_seconds_bucket{{le="{bound}"}} {mid}
sglang:e2e_request_latency_seconds_bucket{{le="+Inf"}} {top}
sglang:e2e_request_latency_seconds_count {top}
sglang:e2e_request_latency_seconds_sum 3
sglang:num_running_reqs 2
"""


def test_each_service_is_scraped_at_its_own_interval_not_the_loops(tmp_path: Path) -> None:
    """A service that asks for 0.2 s is read every 0.2 s; one that says nothing, every 5 s (the
    default): its first read at start, and none in the next 1.5 s."""
    body = tmp_path / "page.txt"
    body.write_text("sglang:num_running_reqs 2\n")
    with SlowEndpoint("file", "--body", str(body)) as fast, SlowEndpoint("file", "--body", str(body)) as slow:
        scraper = ServiceScraper([served(fast, "fast", scrape_interval_seconds=0.2), served(slow, "slow")])
        scraper.start()
        try:
            time.sleep(1.5)
        finally:
            scraper.stop()
        fast_reads = sum(line.startswith("request ") for line in fast.lines)
        slow_reads = sum(line.startswith("request ") for line in slow.lines)
    assert ServiceConfig(name="slow").scrape_interval_seconds == 5.0
    assert fast_reads >= 5
    assert slow_reads == 1


def test_a_page_that_cannot_be_believed_is_that_services_error_and_the_figures_stay(tmp_path: Path) -> None:
    """A real server answers a good page, then one with NaN counts, then `le="abc"`: each bad
    scrape is the service's "unreadable page" error (the crash of `gpu-agent run` and of `status
    --direct` before), the figures of the good pages stay, and a good page clears the error."""
    body = tmp_path / "page.txt"
    pages = [
        E2E_PAGE.format(low=1, bound="1.0", mid=2, top=4),
        E2E_PAGE.format(low=3, bound="1.0", mid=5, top=8),
        E2E_PAGE.format(low="NaN", bound="1.0", mid="NaN", top="NaN"),
        E2E_PAGE.format(low=5, bound="abc", mid=7, top=9),
        E2E_PAGE.format(low=5, bound="1.0", mid=7, top=12),
    ]
    seen = []
    with SlowEndpoint("file", "--body", str(body)) as server:
        scraper = ServiceScraper([served(server, "llm")])
        for text in pages:
            body.write_text(text)
            scraper.scrape_once("llm")
            seen.append(scraper.figures()["llm"])
    good, nan, abc, again = seen[1], seen[2], seen[3], seen[4]
    assert good.error == "" and good.latency["e2e"].requests == 4
    assert nan.error.startswith("unreadable page: sglang:e2e_request_latency_seconds has a bucket that is not")
    assert abc.error == "unreadable page: sglang:e2e_request_latency_seconds has a bucket le='abc'"
    assert nan.latency == abc.latency == good.latency  # the last good figures, with the error
    assert again.error == "" and again.latency["e2e"].requests == 8


def test_the_first_page_does_not_pin_the_server_kind(tmp_path: Path) -> None:
    body = tmp_path / "page.txt"
    with SlowEndpoint("file", "--body", str(body)) as server:
        scraper = ServiceScraper([served(server, "llm")])
        body.write_text("sglang:num_running_reqs 2\n")
        scraper.scrape_once("llm")
        assert (scraper.figures()["llm"].kind, scraper.figures()["llm"].running) == ("sglang", 2)
        body.write_text("vllm:num_requests_running 5\nvllm:num_requests_waiting 1\n")
        scraper.scrape_once("llm")
        assert (scraper.figures()["llm"].kind, scraper.figures()["llm"].running) == ("vllm", 5)
        configured = ServiceScraper([served(server, "llm", kind="sglang")])
        configured.scrape_once("llm")
        assert (configured.figures()["llm"].kind, configured.figures()["llm"].running) == ("sglang", None)


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("file", "unreadable page: sglang:e2e_request_latency_seconds has a bucket le='abc'"),
        ("drip", "timed out after 2 s"),
    ],
)
def test_status_direct_reports_a_hostile_server_instead_of_crashing_or_hanging(
    tmp_path: Path, mode: str, error: str
) -> None:
    """`le="abc"` crashed `status --direct`; a server trickling its headers hung it."""
    body = tmp_path / "page.txt"
    body.write_text(E2E_PAGE.format(low=5, bound="abc", mid=7, top=9))
    with SlowEndpoint(mode, "--body", str(body), "--interval", "0.2") as server:
        service = (
            "services:\n  - {name: llm, manager: command, start_command: [/bin/true], stop_command: [/bin/true],"
            f' health_url: "{server.url("/health")}"}}\n'
        )
        config, _port = write_agent_config(tmp_path, mode="observe", policy=DEFAULT_POLICY + service)
        began = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "agent.cli", "status", "--direct", "--json", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - began
    assert result.returncode in (0, 2), result.stderr
    (listed,) = json.loads(result.stdout)["services"]
    assert listed["metrics"]["metrics_error"] == error
    assert took < 20, took
