"""`gpu-agent status` lines for the inference figures, from the status JSON (agent/documents.py
builds it). Standard library only: the status command imports it without prometheus-client."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from agent import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


#: Figures read longer ago than this say how old they are on the status screen.
SHOW_AGE_AFTER_SECONDS = 10.0


def service_figures_line(document: Mapping[str, Any]) -> str:
    """A `status_document` as one line:
    `p95 e2e 0.72 s, TTFT 0.15 s, queue 0.02 s; running 9 / waiting 0; 320 tokens/s (0.52/J)`
    (the queue part and the tokens per joule only where the server and the GPUs give them), and
    `read 40 s ago` once the figures are older than SHOW_AGE_AFTER_SECONDS."""
    latency = document["latency_seconds"]
    error = document["metrics_error"]
    if not latency and error:
        return f"metrics unavailable ({error})"
    rate = document["generation_tokens_per_second"]
    e2e = latency.get("e2e", {}).get("0.95")
    ttft = latency.get("ttft", {}).get("0.95")
    queue = f", queue {_seconds(latency['queue'].get('0.95'))}" if "queue" in latency else ""
    efficiency = document.get("tokens_per_joule")
    per_joule = "" if efficiency is None else f" ({efficiency:.2f}/J)"  # tokens per joule; the screen is 100 wide
    line = (
        f"p95 e2e {_seconds(e2e)}, TTFT {_seconds(ttft)}{queue}; running {_count(document['requests_running'])}"
        f" / waiting {_count(document['requests_waiting'])}; {'-' if rate is None else f'{rate:.0f}'} tokens/s"
        f"{per_joule}"
    )
    read_ago = document.get("read_seconds_ago")
    if read_ago is not None and read_ago >= SHOW_AGE_AFTER_SECONDS:
        line += f"; read {read_ago:.0f} s ago"
    return f"{line} (last scrape: {error})" if error else line


def unattributed_lines(processes: Iterable[Mapping[str, Any]]) -> Iterable[str]:
    """From `unattributed_document`: `GPU 3: pid 4242 python (jupyter.service) 1.0 GiB, in no configured service`."""
    for process in processes:
        name = process["command"] or "?"
        unit = f" ({process['unit']})" if process["unit"] else ""
        used = process["used_memory_bytes"]
        size = "" if used is None else f" {used / 2**30:.1f} GiB"
        yield f"GPU {process['gpu']}: pid {process['pid']} {name}{unit}{size}, in no configured service"
