"""The fleet as the router sees it: one frozen snapshot (`FleetView`) of frozen `WorkerView`s per cycle.

A `WorkerView` joins three sources, each with its own freshness:

- **capacity** (`WorkerCapacity`): static facts from the perf model for that GPU, model and tensor-parallel
  degree (`capacity_for`), so an L4 and an H100 can be compared in the same units;
- **scraped** stats from the worker's `/metrics` (vLLM v1 names), `None` when never scraped or stale;
- **gateway-side in-flight accounting**, updated at dispatch / first token / completion, so routing never
  waits for the next scrape.

Everything here is immutable: the gateway (or the cluster simulator) builds a new `FleetView` per cycle
(`dataclasses.replace` on the views it changes) and the router's plugins only read it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from placement.catalog import Catalog, GpuSpec, ModelSpec, load_catalog
from placement.perf_model import PerfModel


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


def prefill_only_models(pools: Iterable[tuple[str, str, str]]) -> dict[str, list[str]]:
    """Models whose every pool is a prefill pool, each with its pools' names, from (name, model, role) per
    pool: a config mistake (a prefill worker only prefills; nothing could finish a request), refused at
    load by the gateway's config and the simulator's fleet."""
    by_model: dict[str, list[str]] = {}
    finishing: set[str] = set()
    for name, model, role in pools:
        by_model.setdefault(model, []).append(name)
        if role != Role.PREFILL:
            finishing.add(model)
    return {model: names for model, names in by_model.items() if model not in finishing}


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    """What one worker can do, from the perf model (or overridden by config).

    prefill_tokens_per_s: sustained prefill rate at a 2,048-token chunk (`PerfModel.prefill_tokens_per_s`);
    decode_tokens_per_s: batch decode throughput at a representative batch (see `capacity_for`);
    kv_blocks: vLLM's `num_gpu_blocks`; cost_per_hour: $ for the whole worker (every GPU of it);
    max_model_len: the engine's context limit (None = unknown, not checked).

    A data-parallel worker (`engines` > 1, vLLM's `--data-parallel-size`) is the sum of its engines: rates,
    blocks, sequences and cost are `engines` times one engine's. One sequence still runs on one engine, so
    what bounds a single request is `engine_kv_blocks` and `engine_prefill_tokens_per_s`.
    """

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_blocks: int
    block_size: int
    cost_per_hour: float
    max_num_seqs: int
    max_model_len: int | None = None
    api_overhead_s: float = 0.0  # fixed per-request TTFT at the worker's API server
    engines: int = 1  # engines behind the worker's API server (data parallelism), each on its own GPUs

    @property
    def engine_kv_blocks(self) -> int:
        """One engine's blocks: all a single sequence can hold."""
        return self.kv_blocks // self.engines

    @property
    def engine_prefill_tokens_per_s(self) -> float:
        """One engine's prefill rate: the rate a single prompt is prefilled at."""
        return self.prefill_tokens_per_s / self.engines

    def service_time_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """GPU-seconds one request of this shape occupies at representative batching:

        s = prompt / prefill_tokens_per_s + output / decode_tokens_per_s

        (the decode term is this request's share of a batched step, not its wall-clock decode time).
        Its inverse is the worker's request throughput for that shape: the unit capacity is measured in.
        """
        prefill = prompt_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s > 0 else math.inf
        decode = output_tokens / self.decode_tokens_per_s if self.decode_tokens_per_s > 0 else math.inf
        return prefill + decode

    def blocks_for(self, tokens: int) -> int:
        """KV blocks a sequence of `tokens` tokens occupies: ceil(tokens / block_size)."""
        return -(-max(0, tokens) // self.block_size)


# A representative decode batch: 64 sequences of 1,024 tokens of context, fewer when the KV cache or
# max_num_seqs cannot hold that many (an L4 with Llama-3-8B holds ~34 such sequences).
REPRESENTATIVE_BATCH = 64
REPRESENTATIVE_CONTEXT = 1024


def capacity_for(
    gpu: str | GpuSpec,
    model: str | ModelSpec,
    tp: int = 1,
    catalog: Catalog | None = None,
    *,
    max_num_seqs: int = 256,
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    num_gpu_blocks: int | None = None,
    max_model_len: int | None = None,
    cost_per_hour: float | None = None,
    decode_batch: int = REPRESENTATIVE_BATCH,
    decode_context: int = REPRESENTATIVE_CONTEXT,
    dp: int = 1,
) -> WorkerCapacity:
    """A worker's `WorkerCapacity` from the perf model for (gpu, model, tp) and the engine knobs.

    Per engine: decode batch b = max(1, min(decode_batch, max_num_seqs, kv_tokens // decode_context)), so
    the rate is one the engine can actually sustain; kv_blocks = `num_gpu_blocks` if given, else
    `PerfModel.kv_capacity_blocks`. A worker of `dp` engines (data parallelism) has `dp` times each rate,
    the blocks and `max_num_seqs`; cost = gpu.cost_per_hour · tp · dp unless `cost_per_hour` is given (the
    whole worker's). max_model_len defaults to the model's max context. Raises `CatalogError` for unknown
    names, ValueError for dp < 1.
    """
    if dp < 1:
        raise ValueError(f"dp must be ≥ 1, got {dp}")
    cat = catalog if catalog is not None else load_catalog()
    gpu_spec = gpu if isinstance(gpu, GpuSpec) else cat.gpu(gpu)
    model_spec = model if isinstance(model, ModelSpec) else cat.model(model)
    perf = PerfModel(gpu_spec, model_spec, tp)
    blocks = (
        num_gpu_blocks
        if num_gpu_blocks is not None
        else perf.kv_capacity_blocks(gpu_memory_utilization, block_size)
    )
    batch = max(1, min(decode_batch, max_num_seqs, (blocks * block_size) // max(1, decode_context)))
    return WorkerCapacity(
        prefill_tokens_per_s=perf.prefill_tokens_per_s() * dp,
        decode_tokens_per_s=perf.decode_tokens_per_s(batch, decode_context) * dp,
        kv_blocks=blocks * dp,
        block_size=block_size,
        cost_per_hour=cost_per_hour if cost_per_hour is not None else gpu_spec.cost_per_hour * tp * dp,
        max_num_seqs=max_num_seqs * dp,
        max_model_len=max_model_len if max_model_len is not None else model_spec.max_context,
        api_overhead_s=perf.constants.api_overhead_s,
        engines=dp,
    )


@functools.cache
def configured_engines(capacity: WorkerCapacity) -> tuple[EngineView, ...]:
    """The engines a worker of this capacity has before its first scrape shows them: () for one engine,
    else `engines` views of `engine_kv_blocks` each, ranks 0..N−1 (what `vllm serve --data-parallel-size N`
    starts). The scrape's engines replace them (`server.registry`)."""
    if capacity.engines < 2:
        return ()
    return tuple(EngineView(rank, capacity.engine_kv_blocks) for rank in range(capacity.engines))


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine of a data-parallel vLLM server (its `engine` label), as the worker's scrape showed it.

    `rank` is the engine's place among the server's engines in label order: the value of the
    `X-data-parallel-rank` header that pins a request to it (vLLM indexes the engines its API server drives
    in rank order; the labels are 0..N−1 unless the server fronts a slice of a multi-node group)."""

    rank: int
    num_gpu_blocks: int
    kv_usage: float | None = None  # None when the worker's scrape is stale
    preemptions_total: float | None = None


@dataclass(frozen=True, slots=True)
class LoraState:
    """A worker's LoRA adapters: those it serves (`adapters`, from its `/v1/models`: the cards with a
    `parent`) and, from its `vllm:lora_requests_info`, the adapters of its running and waiting requests and
    how many adapters one batch may hold (`max_lora`, vLLM's `--max-loras`); None where not scraped."""

    adapters: frozenset[str] = frozenset()
    running: frozenset[str] | None = None
    waiting: frozenset[str] | None = None
    max_lora: int | None = None
    # it loads an adapter it does not list on the first request naming it (its model's `lora_resolver`)
    resolves: bool = False
    # the adapters of the gateway's own requests in flight there, queued ones included (vLLM's metric shows
    # an adapter only once its requests run)
    pending: frozenset[str] = frozenset()


NO_LORA = LoraState()
RESOLVING_NO_LORA = LoraState(resolves=True)


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker in one routing cycle's snapshot. Scraped fields are None when never scraped or stale."""

    id: str
    url: str
    pool: str
    model: str
    gpu: str
    role: Role
    state: WorkerState
    breaker_open: bool
    capacity: WorkerCapacity
    # scraped from /metrics (vLLM v1 names, summed across the `engine` label)
    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc, a fraction in [0, 1]
    num_gpu_blocks: int | None = None  # from vllm:cache_config_info
    block_size: int | None = None
    generation_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    preemptions_total: float | None = None
    scrape_age_s: float | None = None
    # gateway-side in-flight accounting (this gateway process only)
    inflight_requests: int = 0  # dispatched, not yet completed
    inflight_prefill_tokens: int = 0  # prompt tokens of dispatched requests whose first token has not arrived
    inflight_decode_requests: int = 0  # requests past their first token, still streaming
    # network domain (rack / RDMA group / zone) of the worker's node; None when unknown. Filled by the
    # cluster simulator (topology placement), the embedded actuator, static pools' `domain:` and Kubernetes
    # discovery (the node's topology label); read by the `pd-domain-affinity` scorer.
    domain: str | None = None
    # a data-parallel server's engines (two or more, each with its own KV cache), from the scrape; () for a
    # single engine. The KV ledger reserves per engine and the gateway pins the request to the one it chose.
    engines: tuple[EngineView, ...] = ()
    # LoRA adapters it serves and their load (`LoraState`); NO_LORA for a worker serving none (or not
    # asked yet): a request naming an adapter goes only to workers that list it
    lora: LoraState = NO_LORA

    @property
    def demand(self) -> int:
        """Requests on the worker: max(gateway in-flight, scraped running + waiting).

        The in-flight count is fresh; the scrape also sees other gateways' requests. The max of the two
        never under-counts either source.
        """
        scraped = (self.num_running or 0) + (self.num_waiting or 0)
        return max(self.inflight_requests, scraped)

    @property
    def kv_blocks_total(self) -> int:
        """Blocks the worker reports (`num_gpu_blocks`), else the perf model's estimate."""
        return self.num_gpu_blocks if self.num_gpu_blocks else self.capacity.kv_blocks

    @property
    def engine_kv_blocks(self) -> int:
        """The most blocks one sequence can hold: the largest engine's on a data-parallel worker (its
        blocks are the engines' sum, and a sequence's all come from one engine), else `kv_blocks_total`."""
        if self.engines:
            return max(e.num_gpu_blocks for e in self.engines)
        return self.kv_blocks_total

    @property
    def effective_block_size(self) -> int:
        return self.block_size if self.block_size else self.capacity.block_size

    def blocks_for(self, tokens: int) -> int:
        """ceil(tokens / block_size) with the worker's reported block size."""
        return -(-max(0, tokens) // self.effective_block_size)


@dataclass(frozen=True, slots=True)
class PoolRef:
    """A configured pool, known whether or not it has a worker right now (scaled to zero, pods not yet
    listed): the router holds a request for an empty pool of the right model and role instead of refusing
    it (`FilterReason.EMPTY_POOL`)."""

    name: str
    model: str
    role: Role
    max_model_len: int | None = None  # its workers' context limit (None = unknown): longer prompts never wait
    # False: nothing can add a worker to it (`max_replicas: 0`; a fixed empty list; no autoscaler to start
    # one): a request only it could serve is refused at once (`FilterReason.POOL_STAYS_EMPTY`), not held
    waited_for: bool = True

    def could_serve(self, prompt_tokens: int, generates: bool = True) -> bool:
        """The prompt (and one output token, unless it generates none: embeddings) fits its context."""
        return self.max_model_len is None or prompt_tokens + int(generates) <= self.max_model_len


@dataclass(frozen=True, slots=True)
class FleetView:
    """A frozen snapshot of every known worker, taken at the start of a routing cycle, and the configured
    pools (`pools`; empty when the caller knows none, e.g. a bare list of workers)."""

    workers: tuple[WorkerView, ...] = ()
    pools: tuple[PoolRef, ...] = ()

    def empty_pools(
        self,
        model: str,
        roles: frozenset[Role],
        prompt_tokens: int,
        waited_for: bool = True,
        generates: bool = True,
    ) -> list[PoolRef]:
        """Configured pools of `model` in one of `roles` whose context fits `prompt_tokens`, `waited_for` or
        not, and that have no worker in the view, in any state. (Called only when nothing else fits, which is
        common under load: the workers are scanned only for the few matching pools, and the scan stops once
        all are seen.)"""
        wanted = {
            p.name: p
            for p in self.pools
            if p.model == model
            and p.role in roles
            and p.waited_for == waited_for
            and p.could_serve(prompt_tokens, generates)
        }
        for w in self.workers:
            if not wanted:
                break
            wanted.pop(w.pool, None)
        return list(wanted.values())

    def for_model(self, model: str) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.workers if w.model == model)

    def get(self, worker_id: str) -> WorkerView | None:
        for w in self.workers:
            if w.id == worker_id:
                return w
        return None

    def models(self) -> tuple[str, ...]:
        """Served model names, in first-seen order (the union `/v1/models` lists)."""
        return tuple(dict.fromkeys(w.model for w in self.workers))

    def has_role(self, model: str, role: Role) -> bool:
        return any(w.model == model and w.role == role for w in self.workers)
