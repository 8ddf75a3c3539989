"""vLLM `/metrics` text → the numbers the router reads (`WorkerStats`), tolerant of renamed metrics.

Names (vLLM v1; REFERENCE.md), with the legacy name each replaced:

| stat | metric | legacy |
|---|---|---|
| num_running | `vllm:num_requests_running` | |
| num_waiting | `vllm:num_requests_waiting` | |
| kv_usage | `vllm:kv_cache_usage_perc` (0–1) | `vllm:gpu_cache_usage_perc` |
| num_gpu_blocks, block_size | labels of `vllm:cache_config_info` | |
| prompt/generation tokens | `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` | |
| preemptions | `vllm:num_preemptions_total` | |
| prefix cache | `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` | `vllm:gpu_prefix_cache_*` |
| ITL | `vllm:inter_token_latency_seconds` (sum, count) | `vllm:time_per_output_token_seconds` |
| TTFT | `vllm:time_to_first_token_seconds` (sum, count) | |
| LoRA load | labels of `vllm:lora_requests_info`: `running_lora_adapters`, `waiting_lora_adapters` (comma-separated names), `max_lora` | |

`vllm:lora_requests_info` (a server started with `--enable-lora`) is a gauge vLLM sets to the current time
under that step's label values, and never removes an old label set: the exposition carries one series per
combination ever seen, and the current one is the series with the largest value (the latest time).

A data-parallel vLLM server exposes one series per engine (`engine` label): counts and counters are
summed across engines; `kv_usage` (each engine's fraction of its own cache) is their mean. Its
`cache_config_info` is the exception: the API server sums the engines' block counts into its one cache config
(vLLM 0.32 `v1/engine/core_client.py`, "Sum num_gpu_blocks from all engines in DP case") and repeats that
total on every engine's row (measured: two engines of 8 blocks each report `num_gpu_blocks="16"` twice), so
the rows' value is the server's total, not summed again. Each engine is also kept on its own
(`WorkerStats.engine_views`: total ÷ engines blocks, its usage and preemptions, in rank order) when there are
two or more: a sequence lives in one engine's cache, so the KV ledger reserves per engine. The engines of
one server are alike (same GPU, same `--gpu-memory-utilization`); a block or two of difference between
them is inside the ledger's watermark. Every engine's (one without an `engine` label too) running and waiting
counts, KV usage and token counters are kept apart as well (`WorkerStats.engine_marks`): what its steps change,
which the registry's stuck-engine check compares from one scrape to the next.
When both a v1 name and its legacy name are present, the v1 name wins.

Parsing is `prometheus_client.parser`; lines of families we do not read are dropped first (a real vLLM
exposition is mostly histogram buckets), which makes a scrape several times cheaper.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from scheduler.fleet import EngineView

# sample name → (stat key, is_legacy)
_SAMPLES: dict[str, tuple[str, bool]] = {
    "vllm:num_requests_running": ("num_running", False),
    "vllm:num_requests_waiting": ("num_waiting", False),
    "vllm:kv_cache_usage_perc": ("kv_usage", False),
    "vllm:gpu_cache_usage_perc": ("kv_usage", True),
    "vllm:prompt_tokens_total": ("prompt_tokens_total", False),
    "vllm:generation_tokens_total": ("generation_tokens_total", False),
    "vllm:num_preemptions_total": ("preemptions_total", False),
    "vllm:request_success_total": ("requests_success_total", False),
    "vllm:prefix_cache_queries_total": ("prefix_cache_queries_total", False),
    "vllm:prefix_cache_hits_total": ("prefix_cache_hits_total", False),
    "vllm:gpu_prefix_cache_queries_total": ("prefix_cache_queries_total", True),
    "vllm:gpu_prefix_cache_hits_total": ("prefix_cache_hits_total", True),
    "vllm:inter_token_latency_seconds_sum": ("itl_sum", False),
    "vllm:inter_token_latency_seconds_count": ("itl_count", False),
    "vllm:time_per_output_token_seconds_sum": ("itl_sum", True),
    "vllm:time_per_output_token_seconds_count": ("itl_count", True),
    "vllm:time_to_first_token_seconds_sum": ("ttft_sum", False),
    "vllm:time_to_first_token_seconds_count": ("ttft_count", False),
}
# What shows one engine's steps (`EngineMarks`): every step's stats set the gauges, its tokens the counters
_STEP_KEYS = ("num_running", "num_waiting", "prompt_tokens_total", "generation_tokens_total")
_CACHE_INFO = "vllm:cache_config_info"
_LORA_INFO = "vllm:lora_requests_info"
_WANTED_PREFIXES = tuple(sorted({*_SAMPLES, _CACHE_INFO, _LORA_INFO}))
# Family names as they appear in `# TYPE`/`# HELP` lines (counters and histograms drop their suffix there).
_WANTED_FAMILIES = frozenset(_WANTED_PREFIXES) | frozenset(
    n.removesuffix("_total").removesuffix("_sum").removesuffix("_count") for n in _WANTED_PREFIXES
)


@dataclass(frozen=True, slots=True)
class EngineMarks:
    """One engine's (its `engine` label's) series that every step of it changes or may change: an engine that
    steps moves its token counters or its gauges, a hung one leaves all of them where its last step did
    (`server.registry`'s stuck-engine check). None where the worker does not export the series."""

    engine: str
    num_running: float | None = None
    num_waiting: float | None = None
    kv_usage: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One scrape's worth of a worker's state; None where the worker does not expose the metric."""

    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    preemptions_total: float | None = None
    requests_success_total: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    engines: int = 0  # distinct `engine` label values seen (0 when the label is absent)
    engine_views: tuple[EngineView, ...] = ()  # per engine, when ≥ 2 engines all report num_gpu_blocks
    engine_marks: tuple[EngineMarks, ...] = ()  # per engine label ("" when absent), in label order
    legacy_names: tuple[str, ...] = field(default=())  # legacy metric names read (for /admin/workers)
    # `vllm:lora_requests_info`'s latest series: adapters with running / waiting requests, and --max-loras
    lora_running: frozenset[str] | None = None
    lora_waiting: frozenset[str] | None = None
    max_lora: int | None = None

    @property
    def mean_itl_s(self) -> float | None:
        return self.itl_sum / self.itl_count if self.itl_sum is not None and self.itl_count else None

    @property
    def mean_ttft_s(self) -> float | None:
        return self.ttft_sum / self.ttft_count if self.ttft_sum is not None and self.ttft_count else None


def _keep(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return len(parts) >= 3 and parts[1] in ("TYPE", "HELP") and parts[2] in _WANTED_FAMILIES
    return line.startswith(_WANTED_PREFIXES)


def parse_vllm_metrics(text: str) -> WorkerStats:
    """Parse a vLLM Prometheus exposition; raises ValueError when the text is not valid exposition format."""
    kept = "\n".join(line for line in text.splitlines() if _keep(line)) + "\n"
    new: dict[str, float] = defaultdict(float)
    old: dict[str, float] = defaultdict(float)
    usage_by_engine: dict[str, tuple[float, bool]] = {}
    server_blocks: int | None = None  # the server's total, on every engine's row (module docstring)
    block_size: int | None = None
    engines: set[str] = set()
    legacy: set[str] = set()
    preemptions_by_engine: dict[str, float] = defaultdict(float)
    steps: dict[tuple[str, str, bool], float] = defaultdict(float)  # (engine, step key, legacy) → value
    lora: tuple[float, dict[str, str]] | None = None  # the latest lora_requests_info series (value, labels)
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            engine = sample.labels.get("engine", "")
            if engine:
                engines.add(engine)
            if sample.name == _LORA_INFO:
                if math.isfinite(sample.value) and (lora is None or sample.value > lora[0]):
                    lora = (sample.value, sample.labels)
                continue
            if sample.name == _CACHE_INFO:
                blocks = _count_label(sample.labels.get("num_gpu_blocks"))
                if blocks is not None:
                    server_blocks = max(blocks, server_blocks or 0)
                size = _count_label(sample.labels.get("block_size"))
                if size is not None:
                    block_size = size
                continue
            hit = _SAMPLES.get(sample.name)
            if hit is None or not math.isfinite(sample.value):
                # a NaN usage ranked the worker best (every comparison with it fails); a NaN count raised
                # in round(): an unusable sample is a missing one
                continue
            key, is_legacy = hit
            if key == "kv_usage":
                prev = usage_by_engine.get(engine)
                if prev is None or (prev[1] and not is_legacy):  # a v1 series replaces a legacy one
                    usage_by_engine[engine] = (float(sample.value), is_legacy)
            else:
                (old if is_legacy else new)[key] += float(sample.value)
                if key == "preemptions_total":
                    preemptions_by_engine[engine] += float(sample.value)
                elif key in _STEP_KEYS:
                    steps[(engine, key, is_legacy)] += float(sample.value)
            if is_legacy:
                legacy.add(sample.name)
    values = {**old, **new}  # v1 names win over legacy ones
    return WorkerStats(
        num_running=_int(values.get("num_running")),
        num_waiting=_int(values.get("num_waiting")),
        kv_usage=sum(u for u, _ in usage_by_engine.values()) / len(usage_by_engine)
        if usage_by_engine
        else None,
        num_gpu_blocks=server_blocks,
        block_size=block_size,
        prompt_tokens_total=values.get("prompt_tokens_total"),
        generation_tokens_total=values.get("generation_tokens_total"),
        preemptions_total=values.get("preemptions_total"),
        requests_success_total=values.get("requests_success_total"),
        prefix_cache_queries_total=values.get("prefix_cache_queries_total"),
        prefix_cache_hits_total=values.get("prefix_cache_hits_total"),
        itl_sum=values.get("itl_sum"),
        itl_count=values.get("itl_count"),
        ttft_sum=values.get("ttft_sum"),
        ttft_count=values.get("ttft_count"),
        engines=len(engines),
        engine_views=_engine_views(engines, server_blocks, usage_by_engine, preemptions_by_engine),
        engine_marks=_engine_marks(steps, usage_by_engine),
        legacy_names=tuple(sorted(legacy)),
        lora_running=_names(lora[1].get("running_lora_adapters")) if lora else None,
        lora_waiting=_names(lora[1].get("waiting_lora_adapters")) if lora else None,
        max_lora=_count_label(lora[1].get("max_lora")) if lora else None,
    )


def _engine_marks(
    steps: dict[tuple[str, str, bool], float], usage: dict[str, tuple[float, bool]]
) -> tuple[EngineMarks, ...]:
    """Each engine's `EngineMarks` (a v1 series over a legacy one, as for the totals), in label order."""
    labels = sorted({engine for engine, _, _ in steps} | set(usage))

    def value(engine: str, key: str) -> float | None:
        found = steps.get((engine, key, False))
        return found if found is not None else steps.get((engine, key, True))

    return tuple(
        EngineMarks(
            e,
            *(value(e, k) for k in _STEP_KEYS[:2]),
            usage[e][0] if e in usage else None,
            *(value(e, k) for k in _STEP_KEYS[2:]),
        )
        for e in labels
    )


def _names(text: str | None) -> frozenset[str]:
    """A comma-joined label of adapter names (`""`: none)."""
    return frozenset(n for n in (text or "").split(",") if n)


def _engine_views(
    engines: set[str],
    server_blocks: int | None,
    usage: dict[str, tuple[float, bool]],
    preemptions: dict[str, float],
) -> tuple[EngineView, ...]:
    """The engines in rank order (numeric labels by value), each with an equal part of the server's blocks;
    () unless there are two or more and the server reports its blocks."""
    if len(engines) < 2 or server_blocks is None:
        return ()
    order = sorted(engines, key=lambda e: (0, int(e), e) if e.isdigit() else (1, 0, e))
    return tuple(
        EngineView(
            rank,
            server_blocks // len(engines),
            usage[e][0] if e in usage else None,
            preemptions.get(e),
        )
        for rank, e in enumerate(order)
    )


def _count_label(text: str | None) -> int | None:
    """A count in a label of `vllm:cache_config_info` (`"27000"`, vLLM's `"None"` when unset); None when
    absent, not a number or not a finite non-negative one (`inf` raised OverflowError, which escaped the
    scrape's error handling and skipped the round's follow-up work for the whole fleet)."""
    if text in (None, "", "None"):
        return None
    try:
        value = float(text)  # type: ignore[arg-type]
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value >= 0 else None


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def counter_rate(prev: float | None, cur: float | None, dt_s: float) -> float | None:
    """Per-second rate between two counter samples; a counter reset (restart) yields None, not a negative rate."""
    if prev is None or cur is None or dt_s <= 0 or cur < prev:
        return None
    return (cur - prev) / dt_s
