"""Scorer plugins: one score per candidate in [0, 1], 1 best. Weights live in the profile, not here.

Capacities come from the perf model (`WorkerView.capacity`), so workers on different GPUs are compared
in seconds of their own work, not in raw request counts. With s_w(P, O) = P/prefill_tps_w + O/decode_tps_w
the GPU-seconds this request (prompt P, predicted output O) takes on worker w (`service_time_s`):

| type | quantity per worker (lower is better unless noted) | score |
|---|---|---|
| `capacity-load` | L_w = (demand_w + 1) · s_w(P, O): seconds to clear its queue plus this request | min L / L_w |
| `est-ttft` | T_w = overhead_w + (queued prefill tokens_w + P) / prefill_tps_w | min T / T_w |
| `prefix-affinity` | m_w = leading prompt blocks the worker recently served (higher better) | m_w / blocks, 0 if L_w > load_escape · min L |
| `cost` | C_w = cost_per_hour_w · s_w(P, O): $ per request at full batching | min C / C_w |
| `kv-headroom` | h_w = 1 − (used blocks_w + ceil((P+O)/block)) / blocks_w (higher better) | clamp(h_w, 0, 1) |

Ratio-to-best scores (min x / x_w) are scale-free: the best candidate scores 1 and one twice as slow 0.5,
whatever the absolute numbers, so weights compare like with like. demand_w = max(gateway in-flight,
scraped running + waiting); queued prefill tokens = max(gateway in-flight prefill tokens, scraped
waiting · P). Each candidate list is non-empty (the framework only scores when something passed).

```yaml
plugins:
  - {type: prefix-affinity, params: {lru_blocks: 65536, load_escape: 2.0, ttl_s: 600}}
profiles:
  mixed: {weights: {capacity-load: 3, est-ttft: 2, prefix-affinity: 2, kv-headroom: 1, cost: 0.5}}
```
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from scheduler.fleet import WorkerView
from scheduler.routing.framework import Cycle, Decision, PluginParams, RouteRequest
from scheduler.routing.prefix import PrefixIndex
from scheduler.routing.reasons import Outcome

# Outcomes after which the worker holds none of the request's blocks: its dispatch's prefix record is taken back.
_BUILT_NOTHING = frozenset({Outcome.FAILED_BEFORE_FIRST_BYTE, Outcome.UNRESERVED, Outcome.WORKER_REJECTED})


class NoParams(PluginParams):
    """No parameters: any key is refused."""


def ratio_to_best(values: Sequence[float]) -> list[float]:
    """min(values) / v for each v (lower is better → 1 for the best). All zero → all 1; inf → 0."""
    best = min(values)
    out: list[float] = []
    for v in values:
        if v <= 0.0 or v == best:
            out.append(1.0)
        elif math.isinf(v):
            out.append(0.0)
        else:
            out.append(max(0.0, min(1.0, best / v)))
    return out


def service_time_s(worker: WorkerView, req: RouteRequest) -> float:
    """s_w(P, O): GPU-seconds `req` takes on `worker` at representative batching."""
    return worker.capacity.service_time_s(req.prompt_tokens, req.predicted_output_tokens)


def normalized_load_s(worker: WorkerView, req: RouteRequest) -> float:
    """L_w = (demand_w + 1) · s_w(P, O): seconds of this worker's own work queued, this request included."""
    return (worker.demand + 1) * service_time_s(worker, req)


class CapacityLoadScorer:
    type: ClassVar[str] = "capacity-load"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> list[float]:
        return ratio_to_best([normalized_load_s(w, cycle.req) for w in candidates])


def queued_prefill_tokens(worker: WorkerView, req: RouteRequest) -> int:
    """Prompt tokens queued ahead of `req` on `worker`: max(the gateway's in-flight prefill tokens, the
    scraped waiting count × this prompt) — the first is fresh, the second sees other gateways' requests."""
    return max(worker.inflight_prefill_tokens, (worker.num_waiting or 0) * req.prompt_tokens)


def estimated_ttft_s(worker: WorkerView, req: RouteRequest) -> float:
    """T_w = overhead + queued prefill tokens / prefill_tps + P / engine_prefill_tps (seconds): the queue
    drains at the whole worker's rate, the prompt itself on one engine (the same rate but on a
    data-parallel worker)."""
    capacity = worker.capacity
    rate = capacity.prefill_tokens_per_s
    if rate <= 0:
        return math.inf
    own = req.prompt_tokens * capacity.engines
    return capacity.api_overhead_s + (queued_prefill_tokens(worker, req) + own) / rate


class EstimatedTtftScorer:
    type: ClassVar[str] = "est-ttft"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> list[float]:
        return ratio_to_best([estimated_ttft_s(w, cycle.req) for w in candidates])


class CostParams(NoParams):
    pass


class CostScorer:
    """$ per request on each worker: cost/h per unit of capacity (for this request's shape)."""

    type: ClassVar[str] = "cost"
    Params = CostParams

    def __init__(self, params: CostParams | None = None) -> None:
        self.params = params or CostParams()

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> list[float]:
        return ratio_to_best([w.capacity.cost_per_hour * service_time_s(w, cycle.req) for w in candidates])


class KvHeadroomScorer:
    """Fraction of the worker's KV blocks still free after this request (scraped usage; 0 used if unknown)."""

    type: ClassVar[str] = "kv-headroom"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> list[float]:
        out: list[float] = []
        for w in candidates:
            total = w.kv_blocks_total
            if total <= 0:
                out.append(0.0)
                continue
            used = (w.kv_usage or 0.0) * total
            need = w.blocks_for(cycle.req.expected_tokens)
            out.append(max(0.0, min(1.0, 1.0 - (used + need) / total)))
        return out


class PrefixAffinityParams(PluginParams):
    lru_blocks: int = Field(default=65536, ge=1)  # block hashes remembered per worker
    # Load escape: no affinity for a worker whose L_w exceeds load_escape × the least loaded candidate's,
    # so a popular prefix cannot pile every request onto one worker (llm-d's prefix scorer has no escape;
    # SGLang's cache-aware router uses a balance threshold the same way).
    load_escape: float = Field(default=2.0, ge=1.0)
    ttl_s: float | None = Field(default=None, gt=0)  # entries older than this count as evicted
    min_blocks: int = Field(default=1, ge=1)  # prompts with fewer full blocks score 0 everywhere


class PrefixAffinityScorer:
    """m_w / blocks where m_w = leading prompt blocks recently dispatched to w; fed by `on_dispatch`."""

    type: ClassVar[str] = "prefix-affinity"
    Params = PrefixAffinityParams

    # In-flight dispatches whose blocks were new on their worker, remembered to take back on a failure: at
    # most this many (a request whose completion is never reported falls out oldest first).
    MAX_PENDING = 65536

    def __init__(self, params: PrefixAffinityParams | None = None) -> None:
        self.params = params or PrefixAffinityParams()
        self.index = PrefixIndex(self.params.lru_blocks, self.params.ttl_s)
        # (id of the request, worker id) → (the request, dispatch time, hashes the dispatch added there); the
        # entry holds the request, so its id is not reused by another while the entry exists
        self._pending: OrderedDict[tuple[int, str], tuple[RouteRequest, float, list[int]]] = OrderedDict()

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> list[float]:
        hashes = cycle.req.prefix_hashes
        if len(hashes) < self.params.min_blocks:
            return [0.0] * len(candidates)
        workers = cycle.view.workers
        if self.index.workers() > len(workers):  # some left the fleet: their entries (and memory) go too
            self.index.keep_only(w.id for w in workers)
        loads = [normalized_load_s(w, cycle.req) for w in candidates]
        ceiling = self.params.load_escape * min(loads)
        out: list[float] = []
        for w, load in zip(candidates, loads, strict=True):
            if load > ceiling:
                out.append(0.0)
            else:
                out.append(self.index.match(w.id, hashes, cycle.now) / len(hashes))
        return out

    def on_dispatch(self, decision: Decision, req: RouteRequest, now: float) -> None:
        """Both sides of a P/D pair hold the prompt's KV afterwards (the decode side receives it): recorded
        now, so the next request with the prefix follows it before this one ends (llm-d's prefix scorer
        does the same). The blocks new on each worker are remembered until the request ends."""
        if not req.prefix_hashes:
            return
        for worker in (decision.prefill, decision.decode):
            if worker is None:
                continue
            added = self.index.fresh(worker.id, req.prefix_hashes, now)
            self.index.record(worker.id, req.prefix_hashes, now)
            if added:
                self._pending[(id(req), worker.id)] = (req, now, added)
                if len(self._pending) > self.MAX_PENDING:
                    self._pending.popitem(last=False)

    def on_complete(self, worker_id: str, req: RouteRequest, outcome: Outcome, now: float) -> None:
        """A finished request frees its blocks into the worker's cache now (vLLM's free queue is LRU by
        release time), so refresh their recency. One that failed before its first byte, or was taken back
        inside the routing cycle, or was refused by the worker (a 4xx: vLLM checks a request before it schedules
        it), built nothing there: the blocks its dispatch added are taken back (else
        the prefix's next requests, its own retry among them, are steered to a worker that lacks it)."""
        if not req.prefix_hashes:
            return
        pending = self._pending.pop((id(req), worker_id), None)
        if outcome in (Outcome.COMPLETED, Outcome.CLIENT_DISCONNECTED):
            self.index.record(worker_id, req.prefix_hashes, now)
        elif pending is not None and outcome in _BUILT_NOTHING:
            self.index.unrecord(worker_id, pending[2], pending[1])
