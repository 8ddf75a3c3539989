"""Router plugins backed by the KV ledger: the `kv-best-fit` scorer.

The `kv-fit` filter lives with the other filters (`scheduler.routing.filters.KvFitFilter`): it asks every
reserve plugin that is also a `FitChecker` — the `KvLedger` is one — whether the request fits.

`kv-best-fit` scores how tightly the request fills a worker's remaining reservable KV:

    score_w = 1 − (free_w − need_w) / capacity_w        (1 = the request fills the worker exactly)

with free, need and capacity in the ledger's units for that worker (`KvLedger.free`, the footprint's
`peak`, `KvLedger.capacity`). Best fit packs small requests onto already-busy workers and keeps large holes
open for long-context requests (first-fit/worst-fit fragment the fleet so a 30k-token prompt finds no
worker with room). Combine it with `est-ttft` / `capacity-load` in the profile weights so fit does not
override latency. A worker where the request does not fit scores 0. Without a ledger among the cycle's
reserve plugins it falls back to scraped usage: free = (1 − kv_usage) · blocks, need = ceil((P + O)/bs).

```yaml
routing:
  plugins: [{type: kv-best-fit}]
  profiles: {mixed: {weights: {kv-best-fit: 1}}, decode: {weights: {kv-best-fit: 2}}}
```
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from scheduler.fleet import WorkerView

if TYPE_CHECKING:  # runtime imports would cycle: scheduler.routing.config registers this scorer
    from scheduler.kv.footprint import Footprint
    from scheduler.routing.framework import Cycle, RouteRequest


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@runtime_checkable
class KvBook(Protocol):
    """What the scorer reads from a reserve plugin: the `KvLedger`'s footprint, free and capacity."""

    def footprint(self, req: RouteRequest, worker: WorkerView) -> tuple[Footprint, Footprint]: ...

    def free(self, worker: WorkerView, request_id: str | None = None) -> int: ...

    def capacity(self, worker: WorkerView) -> int: ...


@functools.cache
def _is_kv_book(cls: type) -> bool:
    """`KvBook` is a runtime Protocol; its isinstance check walks the members (µs per request on the
    gateway's hot path), so decide once per class."""
    return issubclass(cls, KvBook)


def find_ledger(cycle: Cycle) -> KvBook | None:
    return next((p for p in cycle.reserve_plugins if _is_kv_book(type(p))), None)


def best_fit_score(free: float, need: float, capacity: float) -> float:
    """1 − (free − need) / capacity, clamped to [0, 1]; 0 when it does not fit or capacity is 0."""
    if capacity <= 0 or need > free:
        return 0.0
    return max(0.0, min(1.0, 1.0 - (free - need) / capacity))


class KvBestFitScorer:
    type: ClassVar[str] = "kv-best-fit"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> list[float]:
        ledger = find_ledger(cycle)
        req = cycle.req
        out: list[float] = []
        for w in candidates:
            if ledger is not None:
                fp, _ = ledger.footprint(req, w)
                out.append(best_fit_score(ledger.free(w, req.holder), fp.peak, ledger.capacity(w)))
            else:
                total = w.kv_blocks_total
                free = (1.0 - (w.kv_usage or 0.0)) * total
                out.append(best_fit_score(free, w.blocks_for(req.expected_tokens), total))
        return out
