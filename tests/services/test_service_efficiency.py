"""Tokens per joule: the server's generated tokens over the energy its GPUs used in the same window,
each GPU's cumulative counter interpolated at the scrape times; by hand, then through the window
of real corpus pages."""

from __future__ import annotations

import pytest

from agent.config.service_entry import ServiceConfig
from agent.services.efficiency import EnergyHistory, service_gpus, tokens_per_joule, window_tokens_per_joule
from agent.state import GpuAttribution, GpuSample


def sample(gpu: int, t: float, joules: float | None, up: bool = True) -> GpuSample:
    return GpuSample(gpu, f"GPU-{gpu}", "NVIDIA H200", f"0000000{gpu}:18:00.0", up, t, energy_joules=joules)


def history(watts: dict[int, float], times: range, keep_seconds: float = 600) -> EnergyHistory:
    """GPUs drawing constant power, their counters read at `times`."""
    energy = EnergyHistory(keep_seconds)
    for t in times:
        energy.add([sample(gpu, float(t), 1000.0 + power * t) for gpu, power in watts.items()])
    return energy


def test_the_definition() -> None:
    assert tokens_per_joule(600, 2400) == 0.25
    assert tokens_per_joule(600, 0) is None
    assert tokens_per_joule(-1, 10) is None


def test_counters_are_interpolated_at_the_scrape_times() -> None:
    energy = history({0: 200.0}, range(0, 31, 10))
    assert energy.joules_at(0, 15.0) == pytest.approx(1000 + 200 * 15)
    assert energy.joules_at(0, 30.0) == pytest.approx(1000 + 200 * 30)
    assert energy.joules_at(0, 31.0) is None  # after the last reading: unknown, not extrapolated
    assert energy.joules_at(1, 15.0) is None


def test_tokens_over_the_energy_of_every_gpu_of_the_service() -> None:
    energy = history({0: 200.0, 1: 300.0}, range(0, 61, 5))
    tokens = [(12.0, 0.0), (42.0, 7500.0)]  # 250 tokens/s for 30 s
    # 30 s at 500 W in all: 15000 J
    assert window_tokens_per_joule(tokens, energy, [0, 1]) == pytest.approx(7500 / 15000)
    assert window_tokens_per_joule(tokens, energy, [0]) == pytest.approx(7500 / 6000)
    assert window_tokens_per_joule(tokens, energy, []) is None


def test_only_the_stretch_the_readings_cover_counts() -> None:
    energy = history({0: 100.0}, range(10, 51, 5))
    # the first scrape came before the first reading (the agent had just started): left out
    tokens = [(2.0, 0.0), (20.0, 900.0), (40.0, 2900.0)]
    assert window_tokens_per_joule(tokens, energy, [0]) == pytest.approx(2000 / 2000)
    assert window_tokens_per_joule(tokens[:2], energy, [0]) is None


def test_carried_forward_readings_and_a_counter_going_back() -> None:
    energy = EnergyHistory(600)
    for t, joules in ((0, 1000.0), (1, 1000.0), (2, 1000.0), (3, 1300.0), (6, 1600.0)):
        energy.add([sample(0, float(t), joules)])
    # the value read at 0 and carried to 1 and 2 is the counter at 0 only: 1000 + 100 W * 1.5 s
    assert energy.joules_at(0, 1.5) == pytest.approx(1150.0)
    reloaded = history({0: 100.0}, range(0, 11, 5))
    reloaded.add([sample(0, 15.0, 50.0)])  # the driver reloaded: the counter starts again
    assert window_tokens_per_joule([(2.0, 0.0), (14.0, 100.0)], reloaded, [0]) is None


def test_old_readings_are_dropped() -> None:
    energy = history({0: 100.0}, range(0, 1001, 10), keep_seconds=300)
    assert energy.joules_at(0, 650.0) is None
    assert energy.joules_at(0, 700.0) is not None


def test_the_service_gpus_are_where_its_processes_are_else_its_configured_ones() -> None:
    service = ServiceConfig(name="sglang", gpus=[0, 1])
    held = GpuAttribution(memory_bytes={"sglang": {2: 10, 3: 10}}, pids={"sglang": (1,)}, unattributed=())
    assert service_gpus(service, held, [0, 1, 2, 3]) == [2, 3]
    assert service_gpus(service, None, [0, 1, 2, 3]) == [0, 1]
    assert service_gpus(ServiceConfig(name="sglang"), None, [0, 1, 2, 3]) == [0, 1, 2, 3]
