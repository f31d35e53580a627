"""The corpus of inference-server pages in tests/fixtures/service-metrics/corpus/, and how it is built.

Each page is written by prometheus-client itself from the families as the servers define them
(names, label names, bucket boundaries, counter suffixes), for the layouts real deployments use:

| case | source of the definitions | layout |
|---|---|---|
| sglang-tp2-all-schedulers | sglang `python/sglang/srt/metrics/collector.py` (commit 00ae9c15) and `managers/scheduler_metrics_mixin.py` (scheduler labels) | TP=2 with `--enable-metrics-for-all-schedulers`: both TP ranks export the same batch |
| sglang-dp2-tp4-all-schedulers | the same | DP attention, TP=4, DP=2, all schedulers: two batches, each exported by two TP ranks |
| vllm-dp2-engine-restart | vLLM 0.11 `vllm/v1/metrics/loggers.py` | two engines (data parallel), engine 1 restarts between the second and third scrape |
| vllm-openmetrics | vLLM 0.11 `vllm/v1/metrics/loggers.py` | one engine answering in OpenMetrics (`_total`/`_created`, `# EOF`) |
| vllm-0.10-names | vLLM 0.10 `vllm/v1/metrics/loggers.py` (commit 005a810b) | the older names: `time_per_output_token_seconds` only, `gpu_cache_usage_perc` beside `kv_cache_usage_perc` |

Every case is three scrapes 150 s apart (0, 150, 300 s). Observations are drawn from a seeded
generator, so rebuilding gives the same pages: `python3 tests/service_pages.py` rewrites them.
Each case folder holds a SOURCE file naming its definitions, and every text page starts with the
same lines as comments (OpenMetrics has no comments).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import ALLOWUTF8
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

CORPUS = Path(__file__).parent / "fixtures" / "service-metrics" / "corpus"
SCRAPE_SECONDS = (0, 150, 300)
MODEL = "meta-llama/Llama-3.1-70B-Instruct"

# sglang collector.py (TokenizerMetricsCollector and SchedulerMetricsCollector defaults)
SGLANG_TTFT = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_E2E = (*SGLANG_TTFT, 600, 1200, 1800, 2400)
SGLANG_ITL = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100)
SGLANG_ITL = (*SGLANG_ITL, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
SGLANG_QUEUE = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500)
SGLANG_QUEUE = (*SGLANG_QUEUE, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)
# vLLM loggers.py
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
VLLM_TTFT = (*VLLM_TTFT, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
VLLM_REQUEST = (*VLLM_REQUEST, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # sglang | vllm
    source: str
    openmetrics: bool
    build: Callable[[], Iterator[bytes]]  # yields one page per scrape

    @property
    def folder(self) -> Path:
        return CORPUS / self.name

    def pages(self) -> list[tuple[float, str]]:
        """(scrape time in seconds, page) as stored in the corpus."""
        suffix = "om" if self.openmetrics else "txt"
        return [(t, (self.folder / f"{int(t):03d}.{suffix}").read_text()) for t in SCRAPE_SECONDS]


class _Requests:
    """Finished requests with a latency drawn around `e2e_seconds`, split as the servers split them."""

    def __init__(self, rng: random.Random, e2e_seconds: float, queue_seconds: float, tokens: int = 200) -> None:
        self.rng = rng
        self.e2e_seconds = e2e_seconds
        self.queue_seconds = queue_seconds
        self.tokens = tokens

    def draw(self) -> tuple[float, float, float, float, int]:
        """(e2e, ttft, itl, queue, generated tokens) of one request."""
        queue = self.rng.expovariate(1 / self.queue_seconds) if self.queue_seconds > 0 else 0.0
        tokens = max(1, int(self.rng.gauss(self.tokens, self.tokens / 5)))
        itl = self.rng.lognormvariate(-3.9, 0.35)  # ~20 ms
        ttft = queue + self.rng.uniform(0.05, 0.4)
        e2e = max(ttft + itl * tokens, self.rng.gauss(self.e2e_seconds, self.e2e_seconds / 4))
        return e2e, ttft, itl, queue, tokens


def _sglang_pages(groups: Sequence[Sequence[dict[str, str]]], seed: int) -> Iterator[bytes]:
    """sglang's tokenizer families (one series) and scheduler families per scheduler; `groups`:
    the schedulers of each data-parallel batch (their TP ranks), which export identical figures."""
    registry = CollectorRegistry()
    tokenizer = {"model_name": MODEL}
    scheduler_labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"]
    if not any("dp_rank" in labels for group in groups for labels in group):
        scheduler_labels.remove("dp_rank")
    e2e = Histogram("sglang:e2e_request_latency_seconds", "e2e", list(tokenizer), buckets=SGLANG_E2E, registry=registry)
    ttft = Histogram(
        "sglang:time_to_first_token_seconds", "ttft", list(tokenizer), buckets=SGLANG_TTFT, registry=registry
    )
    itl = Histogram("sglang:inter_token_latency_seconds", "itl", list(tokenizer), buckets=SGLANG_ITL, registry=registry)
    generated = Counter("sglang:generation_tokens", "gen", list(tokenizer), registry=registry)
    prompt = Counter("sglang:prompt_tokens", "prompt", list(tokenizer), registry=registry)
    running = Gauge("sglang:num_running_reqs", "running", scheduler_labels, registry=registry)
    waiting = Gauge("sglang:num_queue_reqs", "queue", scheduler_labels, registry=registry)
    usage = Gauge("sglang:token_usage", "usage", scheduler_labels, registry=registry)
    throughput = Gauge("sglang:gen_throughput", "tokens/s", scheduler_labels, registry=registry)
    queue = Histogram("sglang:queue_time_seconds", "queue", scheduler_labels, buckets=SGLANG_QUEUE, registry=registry)
    rng = random.Random(seed)
    # per scrape interval and batch: (requests, e2e mean, queue mean, running, waiting, usage)
    plan = [
        [(400, 1.2, 0.05, 10, 0, 0.55), (300, 1.0, 0.05, 8, 0, 0.40)],
        [(120, 1.3, 0.1, 12, 2, 0.70), (90, 1.1, 0.05, 9, 1, 0.45)],
        [(100, 3.5, 2.5, 12, 5, 0.97), (80, 1.2, 0.1, 9, 1, 0.46)],
    ]
    for interval in plan:
        for group, (count, e2e_mean, queue_mean, now_running, now_waiting, now_usage) in zip(groups, interval):
            requests = _Requests(rng, e2e_mean, queue_mean)
            tokens_in_interval = 0
            for _ in range(count):
                e2e_s, ttft_s, itl_s, queue_s, tokens = requests.draw()
                e2e.labels(**tokenizer).observe(e2e_s)
                ttft.labels(**tokenizer).observe(ttft_s)
                itl.labels(**tokenizer).observe(itl_s)
                generated.labels(**tokenizer).inc(tokens)
                prompt.labels(**tokenizer).inc(tokens * 4)
                tokens_in_interval += tokens
                for labels in group:  # every TP rank of the batch observes the same request
                    queue.labels(**labels).observe(queue_s)
            for labels in group:
                running.labels(**labels).set(now_running)
                waiting.labels(**labels).set(now_waiting)
                usage.labels(**labels).set(now_usage)
                throughput.labels(**labels).set(round(tokens_in_interval / 150, 2))
        yield generate_latest(registry)


def _scheduler(tp_rank: int, dp_rank: int | None = None) -> dict[str, str]:
    labels = {"model_name": MODEL, "engine_type": "unified", "tp_rank": str(tp_rank), "pp_rank": "0"}
    return labels if dp_rank is None else {**labels, "dp_rank": str(dp_rank)}


def sglang_tp2() -> Iterator[bytes]:
    return _sglang_pages([[_scheduler(0), _scheduler(1)]], seed=2)


def sglang_dp2_tp4() -> Iterator[bytes]:
    return _sglang_pages([[_scheduler(0, 0), _scheduler(1, 0)], [_scheduler(2, 1), _scheduler(3, 1)]], seed=4)


def _vllm_pages(
    *,
    engines: int,
    itl_names: Sequence[str],
    usage_names: Sequence[str],
    restart_engine: int | None,
    openmetrics: bool,
    seed: int,
) -> Iterator[bytes]:
    labelnames = ["model_name", "engine"]
    rng = random.Random(seed)

    def families(registry: CollectorRegistry) -> dict[str, object]:
        made: dict[str, object] = {
            "running": Gauge("vllm:num_requests_running", "running", labelnames, registry=registry),
            "waiting": Gauge("vllm:num_requests_waiting", "waiting", labelnames, registry=registry),
            "generated": Counter("vllm:generation_tokens", "gen", labelnames, registry=registry),
            "ttft": Histogram(
                "vllm:time_to_first_token_seconds", "ttft", labelnames, buckets=VLLM_TTFT, registry=registry
            ),
            "e2e": Histogram(
                "vllm:e2e_request_latency_seconds", "e2e", labelnames, buckets=VLLM_REQUEST, registry=registry
            ),
            "queue": Histogram(
                "vllm:request_queue_time_seconds", "queue", labelnames, buckets=VLLM_REQUEST, registry=registry
            ),
        }
        for name in usage_names:
            made[name] = Gauge(name, "usage", labelnames, registry=registry)
        for name in itl_names:
            made[name] = Histogram(name, "itl", labelnames, buckets=VLLM_ITL, registry=registry)
        return made

    # One registry per engine process stands in for vLLM's per-engine series: restarting an engine
    # starts its counters from zero while the others keep theirs.
    registries = [CollectorRegistry() for _ in range(engines)]
    metrics = [families(r) for r in registries]
    plan = [
        [(300, 1.4, 0.1, 20, 0, 0.50), (300, 1.4, 0.1, 20, 0, 0.50)],
        [(100, 1.5, 0.2, 22, 1, 0.60), (100, 1.6, 0.2, 22, 1, 0.62)],
        [(100, 1.5, 0.2, 22, 1, 0.60), (20, 13.0, 6.0, 30, 12, 0.98)],
    ]
    for step, interval in enumerate(plan):
        for engine in range(engines):
            if step == 2 and engine == restart_engine:
                registries[engine] = CollectorRegistry()
                metrics[engine] = families(registries[engine])
            count, e2e_mean, queue_mean, now_running, now_waiting, now_usage = interval[engine]
            labels = {"model_name": MODEL, "engine": str(engine)}
            made = metrics[engine]
            requests = _Requests(rng, e2e_mean, queue_mean)
            for _ in range(count):
                e2e_s, ttft_s, itl_s, queue_s, tokens = requests.draw()
                made["e2e"].labels(**labels).observe(e2e_s)  # type: ignore[attr-defined]
                made["ttft"].labels(**labels).observe(ttft_s)  # type: ignore[attr-defined]
                made["queue"].labels(**labels).observe(queue_s)  # type: ignore[attr-defined]
                made["generated"].labels(**labels).inc(tokens)  # type: ignore[attr-defined]
                for name in itl_names:
                    made[name].labels(**labels).observe(itl_s)  # type: ignore[attr-defined]
            made["running"].labels(**labels).set(now_running)  # type: ignore[attr-defined]
            made["waiting"].labels(**labels).set(now_waiting)  # type: ignore[attr-defined]
            for name in usage_names:
                made[name].labels(**labels).set(now_usage)  # type: ignore[attr-defined]
        yield _merged(registries, openmetrics)


def _merged(registries: Sequence[CollectorRegistry], openmetrics: bool) -> bytes:
    """One page of every engine's series, family by family, as vLLM's single registry shows them."""
    merged = CollectorRegistry()
    by_name: dict[str, object] = {}
    for registry in registries:
        for family in registry.collect():
            kept = by_name.setdefault(family.name, family)
            if kept is not family:
                kept.samples.extend(family.samples)  # type: ignore[attr-defined]

    class Fixed:
        def collect(self) -> list[object]:
            return list(by_name.values())

    merged.register(Fixed())  # type: ignore[arg-type]
    if openmetrics:
        # prometheus-client 0.26 escapes the colon of sample names by default; servers write it as is.
        return generate_openmetrics(merged, escaping=ALLOWUTF8)  # type: ignore[no-any-return]
    return generate_latest(merged)


VLLM_011 = "vLLM 0.11 vllm/v1/metrics/loggers.py (PrometheusStatLogger: labels model_name, engine)"
VLLM_010 = "vLLM 0.10 vllm/v1/metrics/loggers.py, commit 005a810bc40faa25b8870fbc8559c3462581eee3"
SGLANG = (
    "sglang python/sglang/srt/metrics/collector.py, commit 00ae9c1590d2d0bb6c0bfff39e312c34ae3dd538 "
    "(TokenizerMetricsCollector, SchedulerMetricsCollector); scheduler labels from "
    "python/sglang/srt/managers/scheduler_metrics_mixin.py (model_name, engine_type, tp_rank, pp_rank, dp_rank)"
)

CASES = (
    Case(
        "sglang-tp2-all-schedulers", "sglang", f"{SGLANG}; TP=2, --enable-metrics-for-all-schedulers", False, sglang_tp2
    ),
    Case(
        "sglang-dp2-tp4-all-schedulers",
        "sglang",
        f"{SGLANG}; TP=4, DP=2 (--enable-dp-attention), --enable-metrics-for-all-schedulers",
        False,
        sglang_dp2_tp4,
    ),
    Case(
        "vllm-dp2-engine-restart",
        "vllm",
        f"{VLLM_011}; data parallel 2 (engine 0 and 1), engine 1 restarted between 150 s and 300 s",
        False,
        lambda: _vllm_pages(
            engines=2,
            itl_names=("vllm:inter_token_latency_seconds",),
            usage_names=("vllm:kv_cache_usage_perc",),
            restart_engine=1,
            openmetrics=False,
            seed=11,
        ),
    ),
    Case(
        "vllm-openmetrics",
        "vllm",
        f"{VLLM_011}; one engine, OpenMetrics exposition",
        True,
        lambda: _vllm_pages(
            engines=1,
            itl_names=("vllm:inter_token_latency_seconds",),
            usage_names=("vllm:kv_cache_usage_perc",),
            restart_engine=None,
            openmetrics=True,
            seed=12,
        ),
    ),
    Case(
        "vllm-0.10-names",
        "vllm",
        f"{VLLM_010}; one engine, the names before 0.11",
        False,
        lambda: _vllm_pages(
            engines=1,
            itl_names=("vllm:time_per_output_token_seconds",),
            usage_names=("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
            restart_engine=None,
            openmetrics=False,
            seed=13,
        ),
    ),
)


def write_corpus() -> None:
    for case in CASES:
        case.folder.mkdir(parents=True, exist_ok=True)
        (case.folder / "SOURCE").write_text(case.source + "\n")
        header = "".join(f"# {line}\n" for line in (f"Built from {case.source}.", "By tests/service_pages.py."))
        for t, page in zip(SCRAPE_SECONDS, case.build()):
            text = page.decode()
            # prometheus-client writes the time a series was created; fixed so rebuilding is stable.
            text = "\n".join(_fixed_created(line) for line in text.splitlines()) + "\n"
            suffix = "om" if case.openmetrics else "txt"
            (case.folder / f"{t:03d}.{suffix}").write_text(text if case.openmetrics else header + text)


def _fixed_created(line: str) -> str:
    name = line.split("{", 1)[0].split(" ", 1)[0]
    if not line.startswith("#") and name.endswith("_created"):
        return line.rsplit(" ", 1)[0] + " 1.7640000e+09"
    return line


if __name__ == "__main__":
    write_corpus()
