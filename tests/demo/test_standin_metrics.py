"""The stand-in's latency follows the simulated GPU it runs on, and the whole chain names the cause:
a thermal slowdown on GPU 0 -> the stand-in's p95 rises past the SLO -> the regression event names
GPU 0 and thermal slowdown."""

from __future__ import annotations

import time
from pathlib import Path

from agent.backend.sim import SimulatedBackend
from agent.collect import sample_gpu
from agent.config.service_entry import ServiceSlo
from agent.demo.standin_process import StandinServer
from agent.services.latency_cause import attribute_cause, check_slo, regression_event
from agent.services.scrape import scrape
from agent.services.window import LatencyWindow
from agent.state import GpuSample, ServiceFigures


def measure(url: str, backend: SimulatedBackend, seconds: float = 2.0) -> tuple[ServiceFigures, list[GpuSample]]:
    """Scrape the server and sample GPU 0 every 0.5 s for `seconds`."""
    window = LatencyWindow("sglang")
    samples: list[GpuSample] = []
    deadline = time.monotonic() + seconds
    while True:
        window.add(scrape(url))
        samples.append(sample_gpu(backend, 0, slow=True))
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    figures = window.figures()
    assert figures is not None
    return figures, samples


def test_a_thermal_slowdown_raises_latency_and_is_named_as_the_cause(tmp_path: Path) -> None:
    state_dir = tmp_path / "sim"
    backend = SimulatedBackend("h200x2", state_dir)
    backend.init()
    args = ("--flavor", "sglang", "--sim-state-dir", str(state_dir), "--sim-profile", "h200x2", "--gpus", "0")
    slo = ServiceSlo(e2e_p95_seconds=1.5, min_requests=5)
    with StandinServer(tmp_path, extra_args=args) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        healthy, _ = measure(url, backend)
        backend.set_temperature(0, 92)  # above the H200's 89 C slowdown threshold: the clock halves
        time.sleep(0.5)
        slow, samples = measure(url, backend)

    healthy_mean = healthy.latency["e2e"].mean_seconds
    slow_mean = slow.latency["e2e"].mean_seconds
    assert healthy_mean is not None
    assert slow_mean is not None
    assert 1.7 < slow_mean / healthy_mean < 2.3  # half the clock, twice the time
    assert check_slo(slo, healthy) == []
    breaches = check_slo(slo, slow)
    assert [b.objective for b in breaches] == ["e2e_p95"]

    finding = attribute_cause(samples, gpus=[0], waiting_history=slow.waiting_history)
    event = regression_event("sglang", breaches, finding, slow, now=time.time())
    assert (event.gpu, event.data["cause"]) == (0, "thermal_slowdown")
    assert "likely cause: GPU 0 thermal slowdown" in event.message
    assert event.data["evidence"]["temperature_celsius"] == 92
    assert set(event.data["evidence"]["reasons"]) == {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown"}
