"""Tokens per joule: what a service generates for the energy its GPUs use over the same window.

`tokens_per_joule(tokens, joules)` is the one definition of the figure (the power and clock
advisor optimises the same one). `window_tokens_per_joule` applies it to a service's window: its
server's generated-token counter (every series added up, resets included: agent.services.scrape)
and the cumulative energy counters of its GPUs (NVML's total energy consumption, read each loop),
both taken at the same instants. The scrapes and the GPU samples come at their own times, so each
GPU's counter is interpolated linearly at the scrape times; the widest stretch of scrapes that
every GPU's readings cover is used. Which GPUs: those the attribution found the service's
processes on, else the service's configured `gpus`.

    gpu_agent_service_tokens_per_joule{service}  =  generated tokens / joules of the service's GPUs
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Collection, Iterable, Sequence

from agent.config.service_entry import ServiceConfig
from agent.state import GpuAttribution, GpuSample


def tokens_per_joule(generated_tokens: float, energy_joules: float) -> float | None:
    """Generated tokens per joule; None when no energy was used (or the counters make no sense)."""
    if energy_joules <= 0 or generated_tokens < 0:
        return None
    return generated_tokens / energy_joules


class EnergyHistory:
    """Each GPU's cumulative energy counter with its sample times, for the last `keep_seconds`."""

    def __init__(self, keep_seconds: float) -> None:
        self.keep_seconds = keep_seconds
        self._points: dict[int, deque[tuple[float, float]]] = {}

    def add(self, samples: Iterable[GpuSample]) -> None:
        newest = None
        for sample in samples:
            if not sample.up or sample.energy_joules is None:
                continue
            points = self._points.setdefault(sample.index, deque())
            # The counter is read on the slow tier and carried forward between reads: a carried
            # value is not the counter at the later sample's time, so only fresh readings count.
            if points and (sample.timestamp_seconds <= points[-1][0] or sample.energy_joules == points[-1][1]):
                continue
            points.append((sample.timestamp_seconds, sample.energy_joules))
            newest = max(newest or sample.timestamp_seconds, sample.timestamp_seconds)
        if newest is None:
            return
        for points in self._points.values():
            while points and points[0][0] < newest - self.keep_seconds:
                points.popleft()

    def gpus(self) -> list[int]:
        return sorted(gpu for gpu, points in self._points.items() if points)

    def joules_at(self, gpu: int, timestamp_seconds: float) -> float | None:
        """The GPU's counter at that instant, interpolated between the readings around it; None
        outside the readings kept."""
        points = self._points.get(gpu)
        if not points or not points[0][0] <= timestamp_seconds <= points[-1][0]:
            return None
        times = [t for t, _ in points]
        after = bisect.bisect_left(times, timestamp_seconds)
        t1, j1 = points[after]
        if t1 == timestamp_seconds or after == 0:
            return j1
        t0, j0 = points[after - 1]
        return j0 + (j1 - j0) * (timestamp_seconds - t0) / (t1 - t0)


def window_tokens_per_joule(
    generated_tokens_history: Sequence[tuple[float, float]], energy: EnergyHistory, gpus: Collection[int]
) -> float | None:
    """Tokens per joule over the widest stretch of `generated_tokens_history` ((time, cumulative
    tokens) per scrape) that every GPU's energy readings cover; None when under two scrapes are
    covered, no GPU is known, or a GPU's counter went back (a driver reload)."""
    if not gpus:
        return None
    covered = [
        (t, tokens)
        for t, tokens in generated_tokens_history
        if all(energy.joules_at(gpu, t) is not None for gpu in gpus)
    ]
    if len(covered) < 2:
        return None
    (start, first), (end, last) = covered[0], covered[-1]
    joules = 0.0
    for gpu in gpus:
        before, after = energy.joules_at(gpu, start), energy.joules_at(gpu, end)
        if before is None or after is None or after < before:
            return None
        joules += after - before
    return tokens_per_joule(last - first, joules)


def service_gpus(service: ServiceConfig, attribution: GpuAttribution | None, known_gpus: Sequence[int]) -> list[int]:
    """The GPUs whose energy counts for the service: where its processes hold memory, else its
    configured `gpus` (`all`: every GPU with energy readings)."""
    if attribution is not None:
        held = attribution.memory_bytes.get(service.name)
        if held:
            return sorted(held)
    return list(known_gpus) if service.gpus == "all" else sorted(service.gpus)
