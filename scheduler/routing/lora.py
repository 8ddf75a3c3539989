"""LoRA adapters: the `adapter` filter and the `lora-affinity` scorer.

A request may name one of the LoRA adapters a vLLM server serves (`--lora-modules`, or loaded at run time)
instead of its base model. The gateway routes it as the base model (capacity, KV, queues and metrics are
the base model's) with `RouteRequest.adapter` set, and forwards the body as sent, so the worker applies
the adapter. What each worker serves and runs is its `WorkerView.lora` (`LoraState`).

| type | kind | rule |
|---|---|---|
| `adapter` | filter | reason `no_adapter` when the request names an adapter the worker does not list in its `/v1/models` (and does not resolve adapters on demand) |
| `lora-affinity` | scorer | 1 when the adapter already has requests running or waiting on the worker, or the gateway has one in flight there; 0.5 when it has room for one more adapter in a batch (fewer than `max_lora` adapters running, waiting or in flight from the gateway), or its LoRA load is not scraped; 0 when every slot holds another adapter; halved on a worker that would resolve the adapter on demand (it does not list it yet) |

Why the scorer: vLLM batches requests of at most `--max-loras` distinct adapters in one step (1 unless
set); a request for another adapter waits in its queue until a slot frees, i.e. until the requests of
some adapter have all finished, which can be whole generations. A worker already running the adapter
adds the request to a slot it has; one with a free slot loads it; one with every slot taken makes it wait.
vLLM's metric names an adapter only once its requests run, so the gateway adds the adapters of its own
requests in flight on the worker (`LoraState.pending`, queued ones included): a worker whose slots the
gateway has just filled with other adapters' requests is not taken for one with room.
A request naming no adapter scores 1 everywhere (no effect on its ranking), and the cycle skips the scorer
for it (`applies`).

Workers whose model resolves adapters on demand (`LoraState.resolves`: vLLM's LoRA resolver plugins) take
any adapter name, listed or not: the first request naming a new one makes the worker load it (from disk or
the Hub), so one that lists it already is preferred (the halved score), and the load spreads to others as
the first's slots fill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from scheduler.fleet import WorkerView
from scheduler.routing.filters import NoParams
from scheduler.routing.framework import Cycle, RouteRequest
from scheduler.routing.reasons import FilterReason


class AdapterFilter:
    type: ClassVar[str] = "adapter"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        return None if serves(worker, cycle.req.adapter) else FilterReason.NO_ADAPTER


class LoraAffinityScorer:
    type: ClassVar[str] = "lora-affinity"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    @staticmethod
    def applies(req: RouteRequest) -> bool:
        """Only requests naming an adapter: for the rest it scores 1 everywhere (`Scorer` skips it then)."""
        return req.adapter is not None

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> list[float]:
        adapter = cycle.req.adapter
        if adapter is None:
            return [1.0] * len(candidates)
        return [lora_affinity(w, adapter) for w in candidates]


def serves(worker: WorkerView, adapter: str | None) -> bool:
    """Whether `worker` can take a request naming `adapter` (None: its base model, which every worker of the
    model serves; a worker resolving adapters on demand serves any). The one rule for the filter and the gateway's other worker choices (KV holds and batch
    plans in the admission queue, the tokenizer routes)."""
    return adapter is None or adapter in worker.lora.adapters or worker.lora.resolves


def lora_affinity(worker: WorkerView, adapter: str) -> float:
    """The `lora-affinity` score of one worker for a request naming `adapter` (module docstring)."""
    lora = worker.lora
    # a worker that would resolve the adapter first (it does not list it) is worth half: it loads it before
    # it runs the request
    listed = 1.0 if adapter in lora.adapters else 0.5
    if adapter in lora.pending:  # the gateway's own request of it is there: it batches with that one
        return 1.0
    if lora.running is None or lora.waiting is None or lora.max_lora is None:
        return (
            0.5 * listed
        )  # not scraped (stale, or a server without the metric): neither preferred nor avoided
    busy = lora.running | lora.waiting | lora.pending  # each takes a slot when it runs
    if adapter in busy:
        return 1.0
    return 0.5 * listed if len(busy) < lora.max_lora else 0.0
