"""The simulated worker's `/metrics`: vLLM v1's metric names, types, labels and buckets, read from the engine.

Rendered by prometheus_client from a per-app `CollectorRegistry` (never the global one) through a custom
collector, so gauges and counters are read from the engine at scrape time (no per-step updates) and
histograms accept bulk observations (`observe(value, count)`: a step's inter-token latencies are one call).
Every family carries `model_name` and `engine="0"` labels, as vLLM ≥ 0.10 does (cache_config_info only
`engine`, as in vLLM 0.32). Times are simulated
seconds (at time scale X, X times the wall-clock figure a client measures).

Families (REFERENCE.md, "Metrics"): gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:cache_config_info`; counters `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, `vllm:num_preemptions_total`,
`vllm:request_success_total{finished_reason=stop|length|abort|error|repetition}`,
`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`; histograms
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:request_queue_time_seconds`, `vllm:request_inference_time_seconds`, `vllm:request_prefill_time_seconds`,
`vllm:request_decode_time_seconds`, `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`,
`vllm:iteration_tokens_total`.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from simulator.engine import Engine
from simulator.requests import RequestRecord

# vLLM v1 (vllm/v1/metrics/loggers.py) bucket boundaries.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# `finished_reason` series of vllm:request_success_total, in vLLM's FinishReason order (vllm/v1/engine)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def buckets_1_2_5(maximum: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, … up to `maximum` (vLLM's build_1_2_5_buckets for token-count histograms)."""
    out, mantissa, exponent = [], (1, 2, 5), 0
    while True:
        for m in mantissa:
            v = m * 10**exponent
            if v > maximum:
                return tuple(out)
            out.append(v)
        exponent += 1


class Hist:
    """A histogram's state: counts per bucket (le semantics), sum, with bulk observations."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            out.append(("+Inf" if bound == float("inf") else _le(bound), float(acc)))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


class WorkerMetrics:
    """Histograms fed by the worker runtime plus a collector reading the engine; `render()` → exposition."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.created = time.time()
        mml = engine.max_model_len
        self.ttft = Hist(TTFT_BUCKETS)
        self.itl = Hist(ITL_BUCKETS)
        self.e2e = Hist(REQUEST_LATENCY_BUCKETS)
        self.queue = Hist(REQUEST_LATENCY_BUCKETS)
        self.inference = Hist(REQUEST_LATENCY_BUCKETS)
        self.prefill = Hist(REQUEST_LATENCY_BUCKETS)
        self.decode = Hist(REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Hist(buckets_1_2_5(mml))
        self.generation_tokens = Hist(buckets_1_2_5(mml))
        cap = engine.config.max_num_batched_tokens
        self.iteration_tokens = Hist([b for b in ITERATION_TOKEN_BUCKETS if b <= cap])
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

    def observe_finished(self, rec: RequestRecord) -> None:
        """A request finished (not aborted): the per-request histograms, as vLLM records them at finish."""
        self.e2e.observe(rec.e2e)
        if rec.queue_time is not None:
            self.queue.observe(rec.queue_time)
        if rec.inference_time is not None:
            self.inference.observe(rec.inference_time)
        if rec.prefill_time is not None:
            self.prefill.observe(rec.prefill_time)
        if rec.decode_time is not None:
            self.decode.observe(rec.decode_time)
        self.prompt_tokens.observe(rec.prompt_tokens)
        self.generation_tokens.observe(rec.output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- prometheus_client collector protocol
    def collect(self) -> Iterator[Metric]:
        eng, labels, values = self.engine, ["model_name", "engine"], [self.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value, created=self.created)
            return c

        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", eng.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", eng.num_waiting
        )
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.kv_usage)
        cfg = eng.config
        info_labels = {
            "block_size": str(eng.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
            "num_gpu_blocks": str(eng.num_gpu_blocks),
            "num_gpu_blocks_override": str(cfg.num_gpu_blocks),
        }
        # vLLM 0.32 labels cache_config_info with `engine` but not `model_name`.
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*info_labels, "engine"],
        )
        info.add_metric([*info_labels.values(), "0"], 1.0)
        yield info
        c = eng.counters
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.preemptions
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      c.prefix_cache_queries)  # fmt: skip
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      c.prefix_cache_hits)  # fmt: skip
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["finished_reason", *labels],
        )
        # vLLM exports every FinishReason, 0 until one occurs; the simulator never finishes with error or
        # repetition (no KV-load failures, no repetition detection), but exports them as vLLM does
        for reason in FINISHED_REASONS:
            success.add_metric([reason, *values], c.success.get(reason, 0), created=self.created)
        yield success
        for name, doc, hist in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", self.queue),
            ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
             self.inference),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             self.prefill),
            ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", self.decode),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
            ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", self.iteration_tokens),
        ):  # fmt: skip
            fam = HistogramMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, hist.cumulative(), hist.sum)
            fam.add_sample(name + "_created", dict(zip(labels, values, strict=True)), self.created)
            yield fam
