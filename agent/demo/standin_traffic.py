"""The stand-in server's traffic and its /metrics page (agent/demo/standin.py serves them): simulated
requests through a server whose speed its GPUs set, and the families sglang or vLLM export about
them, as those servers name and bucket them. Standard library only, as the server is."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterable

FLAVORS = ("sglang", "vllm")
MODEL_NAME = "standin/Llama-3.1-8B-Instruct"
# Bucket boundaries as the servers define them (sglang srt/metrics/collector.py, vLLM v1/metrics/loggers.py).
Bounds = tuple[float, ...]
SGLANG_TTFT_BOUNDS: Bounds = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_E2E_BOUNDS: Bounds = (*SGLANG_TTFT_BOUNDS, 600, 1200, 1800, 2400)
_SGLANG_ITL_LOW: Bounds = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1)
SGLANG_ITL_BOUNDS: Bounds = (*_SGLANG_ITL_LOW, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)
_SGLANG_QUEUE_LOW: Bounds = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200)
SGLANG_QUEUE_BOUNDS: Bounds = (*_SGLANG_QUEUE_LOW, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800)
SGLANG_QUEUE_BOUNDS = (*SGLANG_QUEUE_BOUNDS, 2000, 2500, 3000)
_VLLM_TTFT_LOW: Bounds = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
VLLM_TTFT_BOUNDS: Bounds = (*_VLLM_TTFT_LOW, 20, 40, 80, 160, 640, 2560)
_VLLM_ITL_LOW: Bounds = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
VLLM_ITL_BOUNDS: Bounds = (*_VLLM_ITL_LOW, 20, 40, 80)
_VLLM_REQUEST_LOW: Bounds = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120)
VLLM_REQUEST_BOUNDS: Bounds = (*_VLLM_REQUEST_LOW, 240, 480, 960, 1920, 7680)
TOKEN_BOUNDS: Bounds = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
SGLANG_STAGES = ("tokenize", "wait_queue", "prefill_forward", "decode_forward", "detokenize", "response")
# A healthy request: prompt processed in 0.1 s, then 40 tokens at 12 ms each (0.5-0.7 s end to end,
# p95 under 0.8 s); a GPU at half its clock doubles that, past a 1.5 s p95 objective.
BASE_TTFT_SECONDS = 0.1
BASE_ITL_SECONDS = 0.012
OUTPUT_TOKENS = 40
PROMPT_TOKENS = 512
KV_TOKENS_PER_REQUEST = PROMPT_TOKENS + OUTPUT_TOKENS
KV_CAPACITY_TOKENS = 400_000


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value))


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = (*bounds, math.inf)
        self.buckets = [0] * len(self.bounds)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.buckets[next(i for i, bound in enumerate(self.bounds) if value <= bound)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out: list[str] = []
        cumulative = 0
        for bound, count in zip(self.bounds, self.buckets):
            cumulative += count
            out.append(f'{name}_bucket{{le="{_number(bound)}",{labels}}} {_number(cumulative)}')
        out.append(f"{name}_sum{{{labels}}} {_number(self.total)}")
        out.append(f"{name}_count{{{labels}}} {_number(self.count)}")
        return out


class _Page:
    """A /metrics page in the text format, family by family, as a server started at `started`
    (a Unix time) writes it: a counter with its `_created` gauge, a histogram with its buckets."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.lines: list[str] = []

    def family(self, name: str, kind: str, text: str, body: list[str]) -> None:
        self.lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}", *body])

    def counters(self, counters: Iterable[tuple[str, str, float]], labels: str) -> None:
        for name, text, value in counters:
            self.family(f"{name}_total", "counter", text, [f"{name}_total{{{labels}}} {_number(value)}"])
            self.family(f"{name}_created", "gauge", text, [f"{name}_created{{{labels}}} {_number(self.started)}"])

    def histograms(self, histograms: Iterable[tuple[str, str, _Histogram]], labels: str) -> None:
        for name, text, histogram in histograms:
            self.family(name, "histogram", text, histogram.lines(name, labels))


class Traffic:
    """Simulated requests through a server whose speed the GPUs set; renders its /metrics page.

    Every `tick(seconds, slowdown)` admits `request_rate * seconds` requests into a queue; at most
    `max_running` are served at once, each taking the healthy time times `slowdown`, so a slower
    GPU first lengthens every request and, once the server saturates, makes requests wait.
    """

    def __init__(
        self,
        flavor: str,
        request_rate: float,
        max_running: int,
        legacy_names: bool = False,
        dp_ranks: int = 1,
        concurrency: int | None = None,
        drain_seconds: float = 5.0,
        tp_ranks: int = 1,
    ) -> None:
        self.flavor = flavor
        # with --enable-metrics-for-all-schedulers every TP rank exports its group's batch again
        self.tp_ranks = tp_ranks
        self.drain_seconds = drain_seconds
        self.drain_from: float | None = None  # requests running when a drain began
        self.dp_ranks = dp_ranks  # sglang's scheduler families come once per data-parallel rank
        self.request_rate = request_rate
        self.concurrency = concurrency  # closed loop: this many clients, each waiting for its answer
        self.last_tick_monotonic: float | None = None
        self.max_running = max_running
        self.legacy_names = legacy_names
        self.random = random.Random(13)  # noqa: S311  # nosec B311 (simulated latencies, not security)
        self.lock = threading.Lock()
        self.arrived = 0.0
        self.waiting = 0.0
        self.running = 0.0
        self.served_fraction = 0.0
        self.slowdown = 1.0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = 0
        self.started = time.time()
        self.generation_tokens_per_second = 0.0
        if flavor == "sglang":
            ttft, itl, e2e, queue = SGLANG_TTFT_BOUNDS, SGLANG_ITL_BOUNDS, SGLANG_E2E_BOUNDS, SGLANG_QUEUE_BOUNDS
        else:
            ttft, itl, e2e, queue = VLLM_TTFT_BOUNDS, VLLM_ITL_BOUNDS, VLLM_REQUEST_BOUNDS, VLLM_REQUEST_BOUNDS
        self.ttft = _Histogram(ttft)
        self.itl = _Histogram(itl)
        self.e2e = _Histogram(e2e)
        # sglang's queue time is a scheduler family: each data-parallel rank observes its own requests
        self.queue_times = [_Histogram(queue) for _ in range(dp_ranks if flavor == "sglang" else 1)]
        self.decode_time = _Histogram(VLLM_REQUEST_BOUNDS if flavor == "vllm" else SGLANG_E2E_BOUNDS)
        self.prompt_hist = _Histogram(TOKEN_BOUNDS)
        self.generation_hist = _Histogram(TOKEN_BOUNDS)
        self.stages = {stage: _Histogram(SGLANG_E2E_BOUNDS) for stage in SGLANG_STAGES}

    @staticmethod
    def healthy_e2e_seconds() -> float:
        return BASE_TTFT_SECONDS + BASE_ITL_SECONDS * (OUTPUT_TOKENS - 1)

    def advance_to(self, now_monotonic: float, slowdown: float, draining: bool = False) -> None:
        """Let the traffic run up to `now_monotonic` at the pace `slowdown` sets."""
        with self.lock:
            last = self.last_tick_monotonic
            self.last_tick_monotonic = now_monotonic
        if last is not None and now_monotonic > last:
            self.tick(now_monotonic - last, slowdown, draining)

    def _arrivals(self, seconds: float, service_seconds: float) -> float:
        """Requests arriving in `seconds`: the fixed rate, or in a closed loop one per client whose
        request was served (the clients beyond `max_running` stay waiting)."""
        if self.concurrency is None:
            return self.request_rate * seconds
        in_service = min(self.concurrency, self.max_running)
        self.waiting = max(0.0, float(self.concurrency - self.max_running))
        return in_service / service_seconds * seconds

    def tick(self, seconds: float, slowdown: float, draining: bool = False) -> None:
        with self.lock:
            self.slowdown = slowdown
            service_seconds = self.healthy_e2e_seconds() * slowdown
            capacity_per_second = self.max_running / service_seconds
            if draining and self.drain_from is None:
                self.drain_from = self.running
            elif not draining:
                self.drain_from = None
            # Draining, the load balancer sends nothing new: what runs finishes within drain_seconds.
            arriving = 0.0 if draining else self._arrivals(seconds, service_seconds)
            self.waiting += arriving
            serve = min(self.waiting, capacity_per_second * seconds)
            self.waiting -= serve
            if self.drain_from is not None:
                self.running = max(0.0, self.running - self.drain_from * seconds / self.drain_seconds)
            else:
                in_flight = arriving / seconds * service_seconds if seconds > 0 else 0.0
                self.running = min(float(self.max_running), in_flight)
            queue_delay = self.waiting / capacity_per_second
            self.served_fraction += serve
            served = int(self.served_fraction)
            self.served_fraction -= served
            for _ in range(served):
                self._complete(slowdown, queue_delay)
            self.generation_tokens_per_second = serve * OUTPUT_TOKENS / seconds if seconds > 0 else 0.0

    def _complete(self, slowdown: float, queue_delay: float) -> None:
        jitter = self.random.uniform(0.85, 1.25)
        ttft = queue_delay + BASE_TTFT_SECONDS * slowdown * jitter
        itl_mean = BASE_ITL_SECONDS * slowdown * self.random.uniform(0.9, 1.15)
        # The ITL histogram sees each gap; observing a handful per request keeps its shape at a fraction of the cost.
        for _ in range(4):
            self.itl.observe(itl_mean * self.random.uniform(0.8, 1.3))
        decode = itl_mean * (OUTPUT_TOKENS - 1)
        self.ttft.observe(ttft)
        self.e2e.observe(ttft + decode)
        self.queue_times[self.requests % len(self.queue_times)].observe(queue_delay)
        self.decode_time.observe(decode)
        self.prompt_hist.observe(PROMPT_TOKENS)
        self.generation_hist.observe(OUTPUT_TOKENS)
        share = (BASE_TTFT_SECONDS * slowdown * jitter) / 3
        for stage, value in zip(SGLANG_STAGES, (0.002, queue_delay, share * 2, decode, share / 4, 0.001)):
            self.stages[stage].observe(value)
        self.prompt_tokens += PROMPT_TOKENS
        self.generation_tokens += OUTPUT_TOKENS
        self.requests += 1

    def kv_cache_usage_ratio(self) -> float:
        return min(1.0, self.running * KV_TOKENS_PER_REQUEST / KV_CAPACITY_TOKENS)

    def render(self) -> str:
        with self.lock:
            lines = self._sglang_lines() if self.flavor == "sglang" else self._vllm_lines()
            lines += self._process_lines()
        return "\n".join(lines) + "\n"

    def _sglang_lines(self) -> list[str]:
        request = f'model_name="{MODEL_NAME}"'
        # (data-parallel rank, labels) of every scheduler that exports: one per DP rank, or with
        # all schedulers every TP rank of it, numbered globally as sglang numbers them
        ranks = [
            (r, f'dp_rank="{r}",engine_type="unified",{request},pp_rank="0",tp_rank="{r * self.tp_ranks + t}"')
            for r in range(self.dp_ranks)
            for t in range(self.tp_ranks)
        ]
        page = _Page(self.started)

        def gauge(name: str, text: str, value: float, split: bool = False) -> None:
            # each data-parallel rank reports its own share of the load (`split`); ratios are alike
            share = value / self.dp_ranks if split else value
            page.family(name, "gauge", text, [f"{name}{{{labels}}} {_number(share)}" for _, labels in ranks])

        running = round(self.running)
        gauge("sglang:num_running_reqs", "The number of running requests.", running, split=True)
        gauge("sglang:num_used_tokens", "The number of used tokens.", running * KV_TOKENS_PER_REQUEST, split=True)
        gauge("sglang:token_usage", "The token usage.", self.kv_cache_usage_ratio())
        throughput = self.generation_tokens_per_second
        gauge("sglang:gen_throughput", "The generation throughput (token/s).", throughput, split=True)
        gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", round(self.waiting), split=True)
        gauge("sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.", 0)
        gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", 0.42)
        gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", KV_CAPACITY_TOKENS)
        gauge("sglang:utilization", "The utilization.", min(1.0, self.running / self.max_running))
        counters = (
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("sglang:generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
            ("sglang:cached_tokens", "Number of cached prompt tokens.", self.prompt_tokens * 0.42),
            ("sglang:num_requests", "Number of requests processed.", self.requests),
            ("sglang:num_aborted_requests", "Number of requests aborted.", 0),
        )
        page.counters(counters, request)
        histograms = (
            ("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
            ("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
            ("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", self.e2e),
            ("sglang:prompt_tokens_histogram", "Histogram of prompt token length.", self.prompt_hist),
            ("sglang:generation_tokens_histogram", "Histogram of generation token length.", self.generation_hist),
        )
        page.histograms(histograms, request)
        queue: list[str] = []
        for rank, labels in ranks:
            queue += self.queue_times[rank].lines("sglang:queue_time_seconds", labels)
        page.family("sglang:queue_time_seconds", "histogram", "Histogram of queueing time in seconds.", queue)
        stages: list[str] = []
        for _, labels in ranks:
            for stage, histogram in self.stages.items():
                stages += histogram.lines("sglang:per_stage_req_latency_seconds", f'{labels},stage="{stage}"')
        page.family(
            "sglang:per_stage_req_latency_seconds", "histogram", "The latency of each stage of requests.", stages
        )
        return page.lines

    def _vllm_lines(self) -> list[str]:
        labels = f'engine="0",model_name="{MODEL_NAME}"'
        page = _Page(self.started)

        def gauge(name: str, text: str, value: float) -> None:
            page.family(name, "gauge", text, [f"{name}{{{labels}}} {_number(value)}"])

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", round(self.running))
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", round(self.waiting))
        usage = "vllm:gpu_cache_usage_perc" if self.legacy_names else "vllm:kv_cache_usage_perc"
        gauge(usage, "KV-cache usage. 1 means 100 percent usage.", self.kv_cache_usage_ratio())
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                self.prompt_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                self.prompt_tokens * 0.42,
            ),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", 0),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
        )
        page.counters(counters, labels)
        success = [
            f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {_number(value)}'
            for reason, value in (("stop", self.requests), ("length", 0), ("abort", 0))
        ]
        page.family("vllm:request_success_total", "counter", "Count of successfully processed requests.", success)
        itl = "vllm:time_per_output_token_seconds" if self.legacy_names else "vllm:inter_token_latency_seconds"
        histograms = (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
            (itl, "Histogram of inter-token latency in seconds.", self.itl),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e),
            (
                "vllm:request_queue_time_seconds",
                "Time spent in WAITING phase for request.",
                self.queue_times[0],
            ),
            (
                "vllm:request_decode_time_seconds",
                "Time spent in DECODE phase for request.",
                self.decode_time,
            ),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", self.prompt_hist),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.", self.generation_hist),
        )
        page.histograms(histograms, labels)
        return page.lines

    def _process_lines(self) -> list[str]:
        uptime = time.time() - self.started
        return [
            "# HELP python_info Python platform information",
            "# TYPE python_info gauge",
            'python_info{implementation="CPython",major="3",minor="12",patchlevel="3",version="3.12.3"} 1.0',
            "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.",
            "# TYPE process_cpu_seconds_total counter",
            f"process_cpu_seconds_total {_number(time.process_time())}",
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {_number(self.started)}",
            "# HELP process_uptime_seconds Seconds since the server started.",
            "# TYPE process_uptime_seconds gauge",
            f"process_uptime_seconds {_number(uptime)}",
        ]


def run_traffic(
    traffic: Traffic,
    slowdown: Callable[[], float],
    stop: threading.Event,
    tick_seconds: float,
    draining: Callable[[], bool] = lambda: False,
) -> None:
    """Advance the simulated traffic every tick at the pace the GPUs allow now."""
    traffic.advance_to(time.monotonic(), slowdown(), draining())
    while not stop.wait(tick_seconds):
        traffic.advance_to(time.monotonic(), slowdown(), draining())
