"""The advisor's measuring half on a real GPU, read-only: `agent.tune.measure.measure_step` over a
load this script runs, compared with the script's own count of the same window.

The load is a small inference-shaped loop in PyTorch: a "request" is one prefill (four bf16
8192x8192 matmuls) then 40 "tokens" (one matmul each, synchronised, so each token's time is real
GPU time), back to back (phase `full`) or with an idle gap as long as the busy time (`half`). An
HTTP server in this process exports it as sglang does (`sglang:generation_tokens_total`, the e2e
and TTFT histograms with sglang's buckets, running and waiting gauges), so the agent reads it
through the same scrape path as a real server. For each phase the agent measures one step at the
card's fixed power limit (nothing is set: the backend has no writable item, its write guard
refuses every setter), while the script counts the tokens it generated and reads the energy
counter and the power itself around the same window.

Usage (on the GPU host, repository root, agent dependencies and PyTorch importable):

    PYTHONUNBUFFERED=1 python3 -m bench.h200_tune_measure [--dwell 10] [--gpu 0] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pynvml

from agent.backend.nvml import NvmlBackend
from agent.config.service_entry import ServiceConfig
from agent.demo.standin_process import free_port
from agent.demo.standin_traffic import SGLANG_E2E_BOUNDS, SGLANG_TTFT_BOUNDS, _Histogram
from agent.tune.measure import measure_step

TOKENS_PER_REQUEST = 40
MODEL = 'model_name="bench"'


class Load:
    """The matmul "server": its counters, and the loop that drives the GPU."""

    def __init__(self, gpu: int) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(f"cuda:{gpu}")
        self.a = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        self.lock = threading.Lock()
        self.tokens = 0
        self.ttft = _Histogram(SGLANG_TTFT_BOUNDS)
        self.e2e = _Histogram(SGLANG_E2E_BOUNDS)
        self.running = 0
        self.idle_share = 0.0  # 0: back to back; 0.5: an idle gap as long as each request
        self.stop = threading.Event()

    def run(self) -> None:
        torch = self.torch
        while not self.stop.is_set():
            started = time.monotonic()
            with self.lock:
                self.running = 1
            for _ in range(4):
                torch.matmul(self.a, self.b)
            torch.cuda.synchronize(self.device)
            first = time.monotonic() - started
            for _ in range(TOKENS_PER_REQUEST):
                torch.matmul(self.a, self.b)
                torch.cuda.synchronize(self.device)
                with self.lock:
                    self.tokens += 1
            busy = time.monotonic() - started
            with self.lock:
                self.running = 0
                self.ttft.observe(first)
                self.e2e.observe(busy)
            if self.idle_share > 0:
                self.stop.wait(busy * self.idle_share / (1 - self.idle_share))

    def count(self) -> int:
        with self.lock:
            return self.tokens

    def render(self) -> str:
        with self.lock:
            lines = [
                "# TYPE sglang:generation_tokens_total counter",
                f"sglang:generation_tokens_total{{{MODEL}}} {float(self.tokens)}",
                "# TYPE sglang:num_running_reqs gauge",
                f"sglang:num_running_reqs{{{MODEL}}} {float(self.running)}",
                "# TYPE sglang:num_queue_reqs gauge",
                f"sglang:num_queue_reqs{{{MODEL}}} 0.0",
                "# TYPE sglang:time_to_first_token_seconds histogram",
                *self.ttft.lines("sglang:time_to_first_token_seconds", MODEL),
                "# TYPE sglang:e2e_request_latency_seconds histogram",
                *self.e2e.lines("sglang:e2e_request_latency_seconds", MODEL),
            ]
        return "\n".join(lines) + "\n"


def serve(load: Load, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = load.render().encode() if self.path.startswith("/metrics") else b"OK"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def phase(
    name: str, load: Load, backend: NvmlBackend, service: ServiceConfig, gpu: int, dwell: float
) -> dict[str, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    limit_watts = backend.power_limit_watts(gpu)
    time.sleep(3.0)  # the load's clocks and power settle
    power_samples: list[float] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.1):
            power_samples.append(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000)

    sampler = threading.Thread(target=sample)
    tokens_before, energy_before, t0 = (
        load.count(),
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle),
        time.monotonic(),
    )
    sampler.start()
    step = measure_step(backend, [gpu], service, limit_watts, baseline=True, dwell_seconds=dwell, aborted=lambda: False)
    tokens_after, t1 = load.count(), time.monotonic()
    energy_after = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    sampling.set()
    sampler.join()
    assert step is not None
    joules = (energy_after - energy_before) / 1000
    own = {
        "seconds": round(t1 - t0, 3),
        "tokens_per_second": round((tokens_after - tokens_before) / (t1 - t0), 2),
        "tokens_per_joule": round((tokens_after - tokens_before) / joules, 5),
        "mean_power_watts_energy": round(joules / (t1 - t0), 1),
        "mean_power_watts_sampled": round(sum(power_samples) / len(power_samples), 1),
    }
    agent = asdict(step)
    agreement = {
        key: round(agent[field] / own[key] - 1, 4)
        for key, field in (
            ("tokens_per_second", "tokens_per_second"),
            ("tokens_per_joule", "tokens_per_joule"),
            ("mean_power_watts_sampled", "mean_power_watts"),
        )
        if agent[field] and own[key]
    }
    return {
        "phase": name,
        "power_limit_watts": limit_watts,
        "agent": agent,
        "own": own,
        "relative_difference": agreement,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--dwell", type=float, default=10.0)
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    backend = NvmlBackend(writable_items=())  # read-only: every setter is refused before NVML
    backend.init()
    pynvml.nvmlInit()
    load = Load(args.gpu)
    port = free_port()
    server = serve(load, port)
    service = ServiceConfig(name="bench", health_url=f"http://127.0.0.1:{port}/health", kind="sglang", metrics_url=None)
    worker = threading.Thread(target=load.run, daemon=True)
    worker.start()
    results = []
    try:
        for name, idle_share in (("full", 0.0), ("half", 0.5)):
            load.idle_share = idle_share
            result = phase(name, load, backend, service, args.gpu, args.dwell)
            results.append(result)
            print(json.dumps(result, indent=1))
    finally:
        load.stop.set()
        worker.join(10)
        server.shutdown()
    document = {
        "what": "agent.tune.measure.measure_step on a real GPU at its fixed limit, against the script's own count",
        "gpu_name": backend.identity(args.gpu).name,
        "driver": backend.driver_version(),
        "write_guard": sorted(backend.write_guard.writable_items),
        "dwell_seconds": args.dwell,
        "phases": results,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune-measure.json").write_text(json.dumps(document, indent=1) + "\n")
    backend.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
