"""The simulated worker's `/metrics`: vLLM v1's metric names, types, labels and buckets, read from the engine.

Rendered by prometheus_client from a per-app `CollectorRegistry` (never the global one) through a custom
collector, so gauges and counters are read from the engine at scrape time (no per-step updates) and
histograms accept bulk observations (`observe(value, count)`: a step's inter-token latencies are one call).
Every family carries `model_name` and `engine` labels, as vLLM ≥ 0.10 does (cache_config_info only
`engine`, as in vLLM 0.32), with one series per engine of a data-parallel worker (`engine="0"`, `"1"`, …,
in rank order; request_success_total by reason, then engine, as vLLM renders it). `cache_config_info` has a
row per engine, each with the server's total `num_gpu_blocks` (vLLM 0.32's API server sums its engines'
blocks into one cache config, `v1/engine/core_client.py`) and the engine's own `num_gpu_blocks_override`.
One `WorkerMetrics` per engine holds that engine's histograms; the first (rank 0) owns the server's
registry, and later engines join it with `add_engine`. Times are simulated
seconds (at time scale X, X times the wall-clock figure a client measures).

Families (REFERENCE.md, "Metrics"): gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:cache_config_info`; counters `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, `vllm:num_preemptions_total`,
`vllm:request_success_total{finished_reason=stop|length|abort|error|repetition}`,
`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`; histograms
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:request_queue_time_seconds`, `vllm:request_inference_time_seconds`, `vllm:request_prefill_time_seconds`,
`vllm:request_decode_time_seconds`, `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`,
`vllm:iteration_tokens_total`; with LoRA adapters, `vllm:lora_requests_info` (no `model_name`/`engine`
labels, one gauge for the server as in vLLM: `simulator.lora.LoraRequestStates`, set at engine steps).
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
from simulator.lora import LORA_INFO, LORA_INFO_HELP, LORA_INFO_LABELS, LoraRequestStates
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
    """One engine's histograms, fed by its driver, and the collector reading every engine of the server at
    scrape time; `render()` → the server's exposition (any rank's gives the same)."""

    def __init__(
        self, engine: Engine, model_name: str, rank: int = 0, lora: LoraRequestStates | None = None
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.rank = rank
        self.lora = lora  # the server's LoRA tracking (shared by its engines); None: LoRA not enabled
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
        self.ranks: list[WorkerMetrics] = [self]  # the server's engines, shared by all of them
        if rank == 0:
            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(self)  # type: ignore[arg-type]

    def add_engine(self, engine: Engine) -> WorkerMetrics:
        """The next engine of this data-parallel server: its own histograms, the same exposition."""
        added = WorkerMetrics(engine, self.model_name, rank=len(self.ranks), lora=self.lora)
        added.registry = self.registry
        self.ranks.append(added)
        added.ranks = self.ranks
        return added

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
        ranks, labels = self.ranks, ["model_name", "engine"]
        values = [[self.model_name, str(m.rank)] for m in ranks]

        def gauge(name: str, doc: str, attr: str) -> GaugeMetricFamily:  # an `Engine` property
            g = GaugeMetricFamily(name, doc, labels=labels)
            for m, v in zip(ranks, values, strict=True):
                g.add_metric(v, getattr(m.engine, attr))
            return g

        def counter(name: str, doc: str, attr: str) -> CounterMetricFamily:  # an `EngineCounters` field
            c = CounterMetricFamily(name, doc, labels=labels)
            for m, v in zip(ranks, values, strict=True):
                c.add_metric(v, getattr(m.engine.counters, attr), created=m.created)
            return c

        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"
        )
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting")
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage")
        total_blocks = str(sum(m.engine.num_gpu_blocks for m in ranks))
        info: GaugeMetricFamily | None = None
        for m in ranks:
            eng, cfg = m.engine, m.engine.config
            info_labels = {
                "block_size": str(eng.block_size),
                "cache_dtype": "auto",
                "enable_prefix_caching": str(cfg.enable_prefix_caching),
                "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
                "num_gpu_blocks": total_blocks,
                "num_gpu_blocks_override": str(cfg.num_gpu_blocks),
            }
            if info is None:
                # vLLM 0.32 labels cache_config_info with `engine` but not `model_name`.
                info = GaugeMetricFamily(
                    "vllm:cache_config_info",
                    "Information of the LLMEngine CacheConfig",
                    labels=[*info_labels, "engine"],
                )
            info.add_metric([*info_labels.values(), str(m.rank)], 1.0)
        assert info is not None
        yield info
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions"
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens")
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens")
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      "prefix_cache_queries")  # fmt: skip
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      "prefix_cache_hits")  # fmt: skip
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=["finished_reason", *labels],
        )
        # vLLM exports every FinishReason, 0 until one occurs; the simulator never finishes with error or
        # repetition (no KV-load failures, no repetition detection), but exports them as vLLM does
        for reason in FINISHED_REASONS:
            for m, v in zip(ranks, values, strict=True):
                success.add_metric([reason, *v], m.engine.counters.success.get(reason, 0), created=m.created)
        yield success
        for name, doc, attr in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "queue"),
            ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
             "inference"),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             "prefill"),
            ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "decode"),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
            ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iteration_tokens"),
        ):  # fmt: skip
            fam = HistogramMetricFamily(name, doc, labels=labels)
            for m, v in zip(ranks, values, strict=True):
                hist: Hist = getattr(m, attr)
                fam.add_metric(v, hist.cumulative(), hist.sum)
                fam.add_sample(name + "_created", dict(zip(labels, v, strict=True)), m.created)
            yield fam
        if self.lora is not None:  # registered last in vLLM's PrometheusStatLogger too
            info = GaugeMetricFamily(LORA_INFO, LORA_INFO_HELP, labels=LORA_INFO_LABELS)
            for label_values, when in self.lora.series.items():
                info.add_metric(label_values, when)
            yield info
