"""Passive advice: what the node's own history says about the power limits it has run at.

The daemon keeps, per service, GPU model and traffic band, the time, generated tokens and joules of
the service's GPUs at each power limit they ran at, and the worst p95 e2e latency seen there
(`PowerHistory`: summed in memory every loop from the snapshot's readings and the service's
figures, written to the store once a minute). The band is the service's request rate over its
latency window, in powers of two (`1-2`, `2-4`, ... requests/s; `idle` under 0.1/s): tokens per
joule at an idle hour and at a saturated one are not the same figure, and a limit is compared only
with other limits at the same traffic.

`passive_report` turns that into tokens/J and tokens/s per limit and band, and per model and band
says whether a lower limit looked free (more tokens per joule, tokens/s within the tolerance of the
best, p95 within the SLO), or why it cannot tell: how long each limit ran at that traffic, against
the minute it takes to say anything. History is whatever traffic came, so it is a hint for a sweep,
never a measurement; nothing is changed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agent.config import AgentConfig
from agent.logs import get_logger
from agent.state import GpuSample, ServiceFigures
from agent.store.database import Store, StoreError
from agent.store.tunes import HistoryRow
from agent.tune.defaults import DEFAULT_THROUGHPUT_TOLERANCE

log = get_logger()

FLUSH_SECONDS = 60.0
MIN_SECONDS_PER_LIMIT = 60.0  # less time than this at a limit says nothing
IDLE_REQUESTS_PER_SECOND = 0.1  # under this the service is idle: a band of its own, never compared
#: History kept before traffic bands: its traffic is unknown, so it is shown, never compared.
UNBANDED = "unbanded"


def traffic_band(requests_per_second: float) -> str:
    """The band of a request rate: `idle`, or its power-of-two bracket, `2-4` (requests/s)."""
    if requests_per_second < IDLE_REQUESTS_PER_SECOND:
        return "idle"
    low = 2.0 ** math.floor(math.log2(requests_per_second))
    return f"{low:g}-{low * 2:g}"


def _band_order(band: str) -> float:
    return -1.0 if band == "idle" else math.inf if band == UNBANDED else float(band.split("-", 1)[0])


def _band_text(band: str) -> str:
    if band == "idle":
        return f"idle (under {IDLE_REQUESTS_PER_SECOND:g} requests/s)"
    return "traffic unknown (kept before traffic bands)" if band == UNBANDED else f"{band} requests/s"


def _setting_key(limit: float, band: str) -> str:
    """The store's key of a limit at a band: `power:600@2-4`."""
    return f"power:{limit:g}@{band}"


def _parse_key(setting: str) -> tuple[float, str] | None:
    if not setting.startswith("power:"):
        return None
    value, _, band = setting.removeprefix("power:").partition("@")
    return float(value), band or UNBANDED


class PowerHistory:
    """Per-limit sums for every service with figures, flushed to the store now and then."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str, str], HistoryRow] = {}
        self._last_seconds: float | None = None
        self._flushed_monotonic = time.monotonic()

    def observe(
        self, config: AgentConfig, now: float, samples: Sequence[GpuSample], figures: Mapping[str, ServiceFigures]
    ) -> None:
        """One loop: the time since the last loop at the limits seen now."""
        elapsed = 0.0 if self._last_seconds is None else now - self._last_seconds
        self._last_seconds = now
        if not 0 < elapsed < 600:
            return
        by_index = {s.index: s for s in samples if s.up}
        for service in config.services:
            found = figures.get(service.name)
            if found is None or found.generation_tokens_per_second is None:
                continue
            indices = sorted(by_index) if service.gpus == "all" else list(service.gpus)
            gpus = [by_index[i] for i in indices if i in by_index]
            limits = {g.power_limit_watts for g in gpus}
            watts = [g.power_usage_watts for g in gpus]
            if not gpus or len(limits) != 1 or None in limits or None in watts:
                continue
            limit = next(iter(limits))
            e2e = found.latency.get("e2e")
            if limit is None or e2e is None or found.window_seconds <= 0:
                continue  # no request rate yet: its traffic band is unknown
            key = (service.name, gpus[0].name, _setting_key(limit, traffic_band(e2e.requests / found.window_seconds)))
            old = self._pending.get(key)
            p95 = found.quantile("e2e", 0.95)
            worst = max((v for v in (p95, old.e2e_p95_max_seconds if old else None) if v is not None), default=None)
            self._pending[key] = HistoryRow(
                service.name,
                gpus[0].name,
                key[2],
                (old.seconds if old else 0.0) + elapsed,
                (old.tokens if old else 0.0) + found.generation_tokens_per_second * elapsed,
                (old.joules if old else 0.0) + sum(w for w in watts if w is not None) * elapsed,
                worst,
                now,
            )

    def flush(self, store: Store | None, force: bool = False) -> None:
        """Write the sums to the store, at most once a minute unless forced."""
        if store is None or not self._pending:
            return
        if not force and time.monotonic() - self._flushed_monotonic < FLUSH_SECONDS:
            return
        rows, self._pending = list(self._pending.values()), {}
        self._flushed_monotonic = time.monotonic()
        try:
            store.add_history(rows)
        except StoreError as exc:
            log.error("could not keep the power history", error=str(exc))


def passive_report(
    service: str,
    rows: Sequence[HistoryRow],
    slo_e2e_p95_seconds: float | None,
    tolerance: float = DEFAULT_THROUGHPUT_TOLERANCE,
) -> dict[str, Any]:
    """What each limit did at each traffic band, and per model and band whether a lower limit looked
    free, or why that cannot be told (see the module docstring). `comparable`: some band had two
    limits with enough time to compare."""
    limits: list[dict[str, Any]] = []
    for row in rows:
        parsed = _parse_key(row.setting)
        if parsed is None or row.seconds <= 0 or row.joules <= 0:
            continue
        limits.append(
            {
                "gpu_model": row.gpu_model,
                "power_limit_watts": parsed[0],
                "traffic_band": parsed[1],
                "seconds": round(row.seconds, 1),
                "tokens_per_second": round(row.tokens / row.seconds, 2),
                "tokens_per_joule": round(row.tokens / row.joules, 5),
                "mean_power_watts": round(row.joules / row.seconds, 1),
                "e2e_p95_max_seconds": row.e2e_p95_max_seconds,
                "enough": row.seconds >= MIN_SECONDS_PER_LIMIT,
            }
        )
    limits.sort(key=lambda item: (item["gpu_model"], _band_order(item["traffic_band"]), -item["power_limit_watts"]))
    verdicts: list[str] = []
    comparable = False
    groups = sorted(
        {(item["gpu_model"], item["traffic_band"]) for item in limits}, key=lambda g: (g[0], _band_order(g[1]))
    )
    for model, band in groups:
        here = [item for item in limits if (item["gpu_model"], item["traffic_band"]) == (model, band)]
        where = f"{model} at {_band_text(band)}"
        if band in ("idle", UNBANDED):
            verdicts.append(f"{where}: not compared (tokens per joule there says nothing about a limit)")
            continue
        seen = [item for item in here if item["enough"]]
        if len(seen) < 2:
            needs = f"each limit needs {MIN_SECONDS_PER_LIMIT / 60:g} min at this traffic"
            verdicts.append(
                f"{where}: too little history to compare limits: {_times(here)}; {needs} (a sweep,"
                " gpu-agent tune power, measures them now)"
            )
            continue
        comparable = True
        verdicts.append(f"{where}: {_verdict(seen, slo_e2e_p95_seconds, tolerance)}")
    if not limits:
        verdicts.append("no history yet: the daemon keeps it while the service serves, per power limit and traffic")
    return {
        "schema": 1,
        "service": service,
        "limits": limits,
        "verdicts": verdicts,
        "comparable": comparable,
        "changed": False,
    }


def _times(items: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{item['power_limit_watts']:g} W for {_minutes(item['seconds'])}" for item in items)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _verdict(seen: Sequence[dict[str, Any]], slo_e2e_p95_seconds: float | None, tolerance: float) -> str:
    """Whether a limit below the highest looked free among limits seen long enough at one band."""
    top = max(seen, key=lambda item: item["power_limit_watts"])
    best_tps = max(item["tokens_per_second"] for item in seen)
    free = [
        item
        for item in seen
        if item["power_limit_watts"] < top["power_limit_watts"]
        and item["tokens_per_joule"] > top["tokens_per_joule"]
        and item["tokens_per_second"] >= best_tps * (1 - tolerance)
        and (
            slo_e2e_p95_seconds is None
            or item["e2e_p95_max_seconds"] is None
            or item["e2e_p95_max_seconds"] <= slo_e2e_p95_seconds
        )
    ]
    if not free:
        return f"no lower limit looked free against {top['power_limit_watts']:g} W"
    pick = max(free, key=lambda item: item["tokens_per_joule"])
    gain = pick["tokens_per_joule"] / top["tokens_per_joule"] - 1
    return (
        f"{pick['power_limit_watts']:g} W looked free: {gain:+.1%} tokens/J against {top['power_limit_watts']:g} W"
        f" with tokens/s within {tolerance:.0%} and p95 within the SLO (confirm with a sweep)"
    )


def render_passive(report: dict[str, Any]) -> str:
    lines = [f"power history of service {report['service']} (no changes made), by traffic band"]
    header = ("GPU model", "traffic", "limit", "time", "mean power", "tokens/s", "tokens/J", "worst p95 e2e")
    rows = [header]
    for item in report.get("limits", []):
        p95 = item.get("e2e_p95_max_seconds")
        band = item.get("traffic_band", UNBANDED)
        rows.append(
            (
                item["gpu_model"],
                "idle" if band == "idle" else "unknown" if band == UNBANDED else f"{band} req/s",
                f"{item['power_limit_watts']:g} W",
                _minutes(item["seconds"]) + ("" if item["enough"] else " (too short)"),
                f"{item['mean_power_watts']:.0f} W",
                f"{item['tokens_per_second']:.1f}",
                f"{item['tokens_per_joule']:.3f}",
                "-" if p95 is None else f"{p95:.3f} s",
            )
        )
    if len(rows) > 1:
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    lines += report.get("verdicts", [])
    return "\n".join(lines)
