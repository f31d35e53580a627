"""Passive advice: what the node's own history says about the power limits it has run at.

The daemon keeps, per service and GPU model, the time, generated tokens and joules of the
service's GPUs at each power limit they ran at, and the worst p95 e2e latency seen there
(`PowerHistory`: summed in memory every loop from the snapshot's readings and the service's
figures, written to the store once a minute). `passive_report` turns that into tokens/J and
tokens/s per limit and says whether a lower limit looked free: more tokens per joule, tokens/s
within the tolerance of the best, p95 within the SLO. History mixes whatever traffic ran at each
limit, so it is a hint for a sweep, never a measurement; nothing is changed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from agent.config import AgentConfig
from agent.logger import get_logger
from agent.services.window import ServiceFigures
from agent.state import GpuSample
from agent.store.database import Store, StoreError
from agent.store.tunes import HistoryRow
from agent.tune.defaults import DEFAULT_THROUGHPUT_TOLERANCE

log = get_logger()

FLUSH_SECONDS = 60.0
MIN_SECONDS_PER_LIMIT = 60.0  # less time than this at a limit says nothing


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
            key = (service.name, gpus[0].name, f"power:{limit:g}")
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
    """What each limit did, and whether a lower one looked free (see the module docstring)."""
    limits: list[dict[str, Any]] = []
    for row in rows:
        if not row.setting.startswith("power:") or row.seconds <= 0 or row.joules <= 0:
            continue
        limits.append(
            {
                "gpu_model": row.gpu_model,
                "power_limit_watts": float(row.setting.split(":", 1)[1]),
                "seconds": round(row.seconds, 1),
                "tokens_per_second": round(row.tokens / row.seconds, 2),
                "tokens_per_joule": round(row.tokens / row.joules, 5),
                "mean_power_watts": round(row.joules / row.seconds, 1),
                "e2e_p95_max_seconds": row.e2e_p95_max_seconds,
                "enough": row.seconds >= MIN_SECONDS_PER_LIMIT,
            }
        )
    limits.sort(key=lambda item: (item["gpu_model"], -item["power_limit_watts"]))
    verdicts: list[str] = []
    for model in sorted({item["gpu_model"] for item in limits}):
        seen = [item for item in limits if item["gpu_model"] == model and item["enough"]]
        if len(seen) < 2:
            verdicts.append(f"{model}: history at one limit only; a sweep (gpu-agent tune power) measures the others")
            continue
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
        if free:
            pick = max(free, key=lambda item: item["tokens_per_joule"])
            gain = pick["tokens_per_joule"] / top["tokens_per_joule"] - 1
            verdicts.append(
                f"{model}: {pick['power_limit_watts']:g} W looked free: {gain:+.1%} tokens/J against"
                f" {top['power_limit_watts']:g} W with tokens/s within {tolerance:.0%} and p95 within the SLO"
                " (traffic differed; confirm with a sweep)"
            )
        else:
            verdicts.append(f"{model}: no lower limit looked free against {top['power_limit_watts']:g} W")
    return {"schema": 1, "service": service, "limits": limits, "verdicts": verdicts, "changed": False}


def render_passive(report: dict[str, Any]) -> str:
    lines = [f"power history of service {report['service']} (no changes made)"]
    header = ("GPU model", "limit", "time", "mean power", "tokens/s", "tokens/J", "worst p95 e2e")
    rows = [header]
    for item in report.get("limits", []):
        p95 = item.get("e2e_p95_max_seconds")
        rows.append(
            (
                item["gpu_model"],
                f"{item['power_limit_watts']:g} W",
                f"{item['seconds'] / 60:.1f} min" + ("" if item["enough"] else " (too short)"),
                f"{item['mean_power_watts']:.0f} W",
                f"{item['tokens_per_second']:.1f}",
                f"{item['tokens_per_joule']:.3f}",
                "-" if p95 is None else f"{p95:.3f} s",
            )
        )
    if len(rows) == 1:
        lines.append("(no history yet: the daemon keeps it while the service serves)")
    else:
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    lines += report.get("verdicts", [])
    return "\n".join(lines)
