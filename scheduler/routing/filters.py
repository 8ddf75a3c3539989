"""Filter plugins: each returns None (the worker may serve the request) or one `FilterReason`.

Default order (the first reason wins, so workers of other models count as `wrong_model`):

| type | reason | rule |
|---|---|---|
| `model` | wrong_model | worker.model ≠ req.model |
| `role` | wrong_role | worker.role ∉ the running profile's roles |
| `excluded` | excluded | worker.id ∈ the cycle's `exclude` (the gateway already failed on it) |
| `state` | starting / draining / unhealthy | worker.state ≠ ready |
| `breaker` | breaker_open | worker.breaker_open |
| `context-length` | exceeds_context | longest prompt ≥ max_model_len, or ceil((prompt+1)/block) > the worker's KV blocks less vLLM's null block, per sequence (an estimated prompt: see the class) |
| `at-capacity` | at_capacity | demand ≥ ceil(max_num_seqs · inflight_factor) |
| `kv-fit` | kv_full | a reserve plugin's `fits` says no; without one, scraped KV usage: |
|  |  | usage ≥ max_usage, or ceil(expected/block) > (max_usage − usage) · blocks |
|  | kv_exceeds_capacity | `fits` says no and the plugin's `exceeds_capacity` (`CapacityBound`) says it never could |

```yaml
plugins:
  - {type: at-capacity, params: {inflight_factor: 1.5}}
  - {type: kv-fit, params: {max_usage: 0.98}}
```
demand = max(gateway in-flight, scraped running + waiting) (`WorkerView.demand`); expected = prompt +
predicted output tokens.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

from pydantic import Field

from scheduler.fleet import WorkerState, WorkerView
from scheduler.routing.framework import CapacityBound, Cycle, FitChecker, PluginParams
from scheduler.routing.reasons import CONTEXT_FACT, KV_EXCEEDS_FACT, FilterReason


class NoParams(PluginParams):
    """No parameters: any key is refused."""


class ModelFilter:
    type: ClassVar[str] = "model"
    partition: ClassVar[str] = "model"  # the framework may apply it as a fleet partition (same result)
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        return None if worker.model == cycle.req.model else FilterReason.WRONG_MODEL


class RoleFilter:
    type: ClassVar[str] = "role"
    partition: ClassVar[str] = "role"  # the framework may apply it as a fleet partition (same result)
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        return None if worker.role in cycle.roles else FilterReason.WRONG_ROLE


class ExcludedFilter:
    type: ClassVar[str] = "excluded"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        return FilterReason.EXCLUDED if worker.id in cycle.exclude else None


_STATE_REASONS = {
    WorkerState.STARTING: FilterReason.STARTING,
    WorkerState.DRAINING: FilterReason.DRAINING,
    WorkerState.UNHEALTHY: FilterReason.UNHEALTHY,
}


class StateFilter:
    type: ClassVar[str] = "state"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        return _STATE_REASONS.get(worker.state)  # StrEnum: a plain str state hashes the same


class BreakerFilter:
    type: ClassVar[str] = "breaker"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        return FilterReason.BREAKER_OPEN if worker.breaker_open else None


class ContextLengthFilter:
    """The prompt (plus one output token, unless it generates none: a pooling request) must fit the worker's
    context limit and its whole KV cache.

    Per sequence: each prompt of a batch (and each of `n` completions) has its own context, so the
    longest prompt is checked (`RouteRequest.longest_prompt`), not their sum; what all sequences need
    together is the kv-fit filter's question.

    An estimated prompt length (`RouteRequest.prompt_tokens_floor` set) steers, it does not refuse: workers
    that fit the estimate are preferred, and only when none of the model's workers does is the check made on
    the floor, so a prompt that may fit still reaches a worker, which tokenizes it and decides."""

    type: ClassVar[str] = "context-length"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        req = cycle.req
        longest = req.longest_prompt
        if _fits(longest, worker, req.generates):
            return None
        if req.prompt_tokens_floor is None or not _fits(req.prompt_tokens_floor, worker, req.generates):
            return _exceeds(cycle, worker, longest)
        # Over by the estimate, not by the floor: pass only if no worker that could take the request now
        # fits the estimate (a down, draining, excluded or wrong-role one that would fit must not turn this
        # one away). Computed once per cycle and profile (P/D runs two), only on this rare path.
        key = f"{_ESTIMATE_FITS_SOMEWHERE}.{'+'.join(sorted(cycle.roles))}"
        some_fit = cycle.facts.get(key)
        if some_fit is None:
            some_fit = cycle.facts[key] = any(
                _could_serve(cycle, w) and _fits(longest, w, req.generates) for w in cycle.view.workers
            )
        return _exceeds(cycle, worker, longest) if some_fit else None


def _exceeds(cycle: Cycle, worker: WorkerView, prompt_tokens: int) -> FilterReason:
    """EXCEEDS_CONTEXT, recording for the error message the largest context among the workers exceeded."""
    limit = _context_limit(worker)
    seen = cycle.facts.get(CONTEXT_FACT)
    if seen is None or limit > seen["context_limit_tokens"]:
        exact = cycle.req.prompt_tokens_floor is None
        cycle.facts[CONTEXT_FACT] = {
            "context_limit_tokens": limit,
            "prompt_tokens": prompt_tokens,
            "exact": exact,
            "generates": cycle.req.generates,
        }
    return FilterReason.EXCEEDS_CONTEXT


def _context_limit(worker: WorkerView) -> int:
    """The most tokens one sequence may hold on `worker`: max_model_len, or its KV cache less the null block."""
    capacity = worker.capacity
    block = worker.block_size or capacity.block_size
    kv = (worker.engine_kv_blocks - 1) * block
    return kv if capacity.max_model_len is None else min(capacity.max_model_len, kv)


_ESTIMATE_FITS_SOMEWHERE = "context-length.estimate_fits_somewhere"


def _could_serve(cycle: Cycle, worker: WorkerView) -> bool:
    """The model, role, state, breaker and exclusion filters would pass `worker` in this cycle."""
    return (
        worker.model == cycle.req.model
        and worker.role in cycle.roles
        and worker.state not in _STATE_REASONS
        and not worker.breaker_open
        and worker.id not in cycle.exclude
    )


def _fits(prompt_tokens: int, worker: WorkerView, generates: bool = True) -> bool:
    tokens = prompt_tokens + int(generates)
    capacity = worker.capacity
    limit = capacity.max_model_len
    if limit is not None and tokens > limit:
        return False
    block = worker.block_size or capacity.block_size
    return (
        -(-tokens // block) <= worker.engine_kv_blocks - 1
    )  # ceil(tokens / block_size) blocks; one is vLLM's null block


class AtCapacityParams(PluginParams):
    # limit = ceil(max_num_seqs · inflight_factor): >1 lets a short queue form on the worker so its next
    # batch is ready; beyond it requests wait in the gateway's admission queue, where routing is still free.
    inflight_factor: float = Field(default=1.5, gt=0)


class AtCapacityFilter:
    type: ClassVar[str] = "at-capacity"
    Params = AtCapacityParams

    def __init__(self, params: AtCapacityParams | None = None) -> None:
        self.params = params or AtCapacityParams()

    def limit(self, worker: WorkerView) -> int:
        return max(1, math.ceil(worker.capacity.max_num_seqs * self.params.inflight_factor))

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        return FilterReason.AT_CAPACITY if worker.demand >= self.limit(worker) else None


class KvFitParams(PluginParams):
    # Scraped-usage fallback (no ledger): keep this fraction as the ceiling so a burst between scrapes
    # does not push the worker into preemption.
    max_usage: float = Field(default=0.98, gt=0, le=1)
    use_ledger: bool = True  # ask a reserve plugin's `fits` when one is configured


_CHECKERS = "kv-fit/checkers"


@functools.cache
def _is_fit_checker(cls: type) -> bool:
    """`FitChecker` is a runtime Protocol; its isinstance check is slow, so decide once per class."""
    return issubclass(cls, FitChecker)


@functools.cache
def _is_capacity_bound(cls: type) -> bool:
    return issubclass(cls, CapacityBound)


def _full_or_exceeds(cycle: Cycle, checker: object, worker: WorkerView) -> FilterReason:
    """`kv_full` (may fit once others finish), or `kv_exceeds_capacity` when the checker says the request
    would not fit even the worker's empty ledger; the largest such worker's numbers go to `cycle.facts`
    for the Reject's message."""
    if not _is_capacity_bound(type(checker)):
        return FilterReason.KV_FULL
    over = checker.exceeds_capacity(cycle.req, worker)  # type: ignore[attr-defined]
    if over is None:
        return FilterReason.KV_FULL
    need, room = over
    return _kv_exceeds(cycle, need, room)


def _kv_exceeds(cycle: Cycle, need: int, room: int) -> FilterReason:
    """`kv_exceeds_capacity`, the largest worker's (need, room) kept in `cycle.facts` for the message."""
    seen = cycle.facts.get(KV_EXCEEDS_FACT)
    if seen is None or room > seen["kv_reservable_blocks"]:
        cycle.facts[KV_EXCEEDS_FACT] = {"kv_need_blocks": need, "kv_reservable_blocks": room}
    return FilterReason.KV_EXCEEDS_CAPACITY


class KvFitFilter:
    type: ClassVar[str] = "kv-fit"
    Params = KvFitParams

    def __init__(self, params: KvFitParams | None = None) -> None:
        self.params = params or KvFitParams()
        self._key = f"{_CHECKERS}/{id(self)}"  # this filter's entry in `cycle.facts`

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        checkers = cycle.facts.get(self._key)
        if checkers is None:  # once per cycle, not per worker
            checkers = (
                [p for p in cycle.reserve_plugins if _is_fit_checker(type(p))]
                if self.params.use_ledger
                else []
            )
            cycle.facts[self._key] = checkers
        if checkers:
            req, now = cycle.req, cycle.now
            for checker in checkers:  # a loop, not all(<generator>): this runs per worker per request
                if not checker.fits(req, worker, now):
                    return _full_or_exceeds(cycle, checker, worker)
            return None
        if worker.kv_usage is None:
            return None  # never scraped: nothing to go on; the worker's own scheduler queues if needed
        req = cycle.req
        # each sequence holds at most the worker's context (vLLM clamps max_tokens to it)
        need = worker.blocks_for(min(req.expected_tokens, req.sequences * _context_limit(worker)))
        total = worker.kv_blocks_total
        if need > total - 1:  # more than the whole cache (one block is vLLM's null block)
            # waiting cannot help, and a retryable kv_full held it at the head of the FIFO admission queue,
            # everyone behind it, to its deadline. Over by an estimated prompt only (not by its floor), the
            # worker, which counts it, decides.
            floor = req.prompt_tokens_floor
            if floor is not None and worker.blocks_for(floor + req.predicted_output_tokens) <= total - 1:
                return None
            return _kv_exceeds(cycle, need, total - 1)
        free = (1.0 - worker.kv_usage) * total - 1
        if need > self.params.max_usage * total:
            # fits the cache but not under the headroom ceiling (a long context on a small cache): it goes
            # when the worker has that room free, as vLLM runs it (alone if it must), kv_full until then
            return None if need <= free else FilterReason.KV_FULL
        if (
            worker.kv_usage >= self.params.max_usage
            or need > (self.params.max_usage - worker.kv_usage) * total
        ):
            return FilterReason.KV_FULL
        return None
