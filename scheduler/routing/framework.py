"""The routing cycle: PreFilter → Filter → Score → Pick → Reserve, over one frozen `FleetView`.

Shaped like the Kubernetes scheduling framework (and llm-d's endpoint picker). One cycle:

1. **PreFilter** (`PreFilter.pre_filter`): request-level checks, once; a reason rejects the whole request.
2. A **profile handler** (`profiles.py`) decides which scheduling profiles run: for P/D, `decode` then
   `prefill`; short prompts skip P/D. Each `Cycle.run(profile)` does:
   - **Filter**: every worker of the snapshot either passes or gets one `FilterReason`;
   - **Score**: each scorer scores all candidates in [0, 1] (1 best); weights live in the profile.
     When exactly one candidate passed the filters nothing is scored (as the Kubernetes scheduler does):
     it gets total 0 and no parts, as under a profile without scorers, and goes on to Pick and Reserve;
   - **Pick**: the picker orders candidates best first (ties broken by the injected rng);
   - **Reserve**: every `ReservePlugin` reserves on the first candidate in that order; if one refuses,
     the ones already made for that worker are released (reverse order) and the next candidate is tried.
3. On a `Reject` or an exception, every reservation made in the cycle is released in reverse order
   (Unreserve, `Outcome.UNRESERVED`); on a `Decision` the caller owns them and releases them exactly once
   (`Decision.release(outcome)`, or `with decision.lease() as d:`).

Plugins only read the snapshot; Reserve is the only step that changes state (the KV ledger). `now` and
`rng` come in with each cycle, so a seeded run replays exactly.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import ConfigDict

from scheduler.config_numbers import NoBoolNumbers
from scheduler.fleet import FleetView, Role, WorkerView
from scheduler.routing.reasons import (
    CONTEXT_FACT,
    KV_EXCEEDS_FACT,
    REJECT_TABLE,
    FilterReason,
    Outcome,
    Reject,
)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows about a request: its footprint, not its body.

    prompt_tokens, max_output_tokens and predicted_output_tokens count the whole request: every prompt of a
    batch once, and every sequence's output (a batch of k prompts with `n` completions each decodes k·n
    sequences, each with its own `max_tokens`);
    predicted_output_tokens: the length predictor's estimate (≤ max_output_tokens);
    prefix_hashes: chained hashes of the prompt's blocks (`scheduler.routing.prefix.block_hashes`);
    prompt_tokens_floor: when `prompt_tokens` is an estimate (a text prompt the gateway did not tokenize),
    the fewest tokens the longest prompt can have; context checks refuse only on it, so a prompt the
    estimate over-counts is left to the worker to judge. None: `prompt_tokens` is exact;
    n: completions per prompt (the request's `n`); prompt_lens: each prompt's tokens when the request is a
    batch of several prompts (Σ = prompt_tokens), () for one prompt. vLLM gives every sequence its own KV
    blocks and context limit, so KV footprints and context checks go per sequence (`sequence_shape`).
    """

    request_id: str
    model: str
    prompt_tokens: int
    max_output_tokens: int
    predicted_output_tokens: int
    prefix_hashes: tuple[int, ...] = ()
    priority: int = 0
    arrival_s: float = 0.0
    prompt_tokens_floor: int | None = None
    n: int = 1
    prompt_lens: tuple[int, ...] = ()
    # the driver's number for the request, unique among its live requests (the gateway's accept counter);
    # 0: unnumbered. Request ids come from clients and may repeat; what belongs to one request (its KV
    # holds) belongs to its `holder`, never to its request id alone
    ticket: int = 0
    # never the P/D two-hop path: an API without a prefill handover (OpenAI's Responses), or a request whose
    # prompt logprobs only the worker that runs its prompt can compute, goes to one decode or mixed worker
    # that prefills the request itself
    single_hop: bool = False
    # the only worker that may serve it (a Responses continuation: `previous_response_id` names a response
    # stored on one worker); `Router.route` excludes every other worker
    pinned_worker: str | None = None
    # the LoRA adapter the request names (`model` is then its base model): only workers serving it may
    # take it (`scheduler.routing.lora`)
    adapter: str | None = None
    # False for a pooling request (embeddings): it ends at its prefill, so its prompt alone must fit the
    # context (vLLM's pooling runner takes a prompt of max_model_len), where a generation needs one more token
    generates: bool = True
    # the longest prompt one sequence's context must hold when that is not the longest of `prompt_lens`: a
    # score request's KV is counted by its (query, document) pairs, a cross-encoder's prompts, while an
    # embedding model's worker encodes (and so needs room for) each text alone; None: `longest_prompt`'s own
    context_tokens: int | None = None

    @property
    def holder(self) -> str | int:
        """Who the request is to the KV ledger's holds: its ticket when numbered, else its request id."""
        return self.ticket or self.request_id

    @property
    def expected_tokens(self) -> int:
        """prompt + predicted output: the tokens of KV the request is expected to hold at its end."""
        return self.prompt_tokens + self.predicted_output_tokens

    @property
    def sequences(self) -> int:
        """Sequences vLLM decodes for it: prompts × n."""
        return max(1, self.n) * max(1, len(self.prompt_lens))

    @property
    def longest_prompt(self) -> int:
        """The longest prompt's tokens: what one sequence's context must hold (`prompt_tokens` for one prompt;
        `context_tokens` when set)."""
        if self.context_tokens is not None:
            return self.context_tokens
        return max(self.prompt_lens) if self.prompt_lens else self.prompt_tokens

    @property
    def sequence_shape(self) -> int | tuple[tuple[int, ...], int]:
        """The prompt side of the KV footprint (`scheduler.kv.footprint.request_need`): `prompt_tokens` for
        a single sequence, else (each prompt's tokens, n)."""
        if self.n <= 1 and len(self.prompt_lens) <= 1:
            return self.prompt_lens[0] if self.prompt_lens else self.prompt_tokens
        return (self.prompt_lens or (self.prompt_tokens,), max(1, self.n))


# ---------------------------------------------------------------------------------------------------
# Extension points: one Protocol, one method each.


class PluginParams(NoBoolNumbers):
    """A plugin's `params:` block. Unknown keys are typos; `.inf` and `.nan` are too (an infinite factor
    or weight overflowed `ceil`/`round` on every request, a NaN one silently disabled its check)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Reservation(Protocol):
    """A debit on one worker (e.g. KV blocks). `release` is idempotent: the first call frees, later ones
    do nothing. The framework releases a reservation at most once itself; the gateway does so at the end."""

    worker_id: str

    def release(self, outcome: Outcome) -> None: ...


class ReservePlugin(Protocol):
    """Reserve capacity on `worker` for `req`, or return None when it does not fit (→ next candidate)."""

    def reserve(self, req: RouteRequest, worker: WorkerView, now: float) -> Reservation | None: ...


@runtime_checkable
class FitChecker(Protocol):
    """Optional second face of a ReservePlugin: would `reserve` succeed? Read-only; used by the kv-fit
    filter so workers that cannot hold the request are filtered (with `kv_full`) before scoring."""

    def fits(self, req: RouteRequest, worker: WorkerView, now: float) -> bool: ...


# the leading model/role partition's reasons: workers the request was never for
_PARTITION_REASONS = frozenset({FilterReason.WRONG_MODEL, FilterReason.WRONG_ROLE})


@runtime_checkable
class CapacityBound(Protocol):
    """Optional face of a `FitChecker`: can the request *ever* be admitted on `worker`? None when it fits
    the worker's reservable capacity with nothing else reserved, held or withheld; else (the request's KV
    need, that most it could reserve), both in the worker's KV blocks. The kv-fit filter then answers
    `kv_exceeds_capacity` (final: waiting cannot help) instead of `kv_full` (retryable)."""

    def exceeds_capacity(self, req: RouteRequest, worker: WorkerView) -> tuple[int, int] | None: ...


class PreFilter(Protocol):
    """Request-level check run once per cycle; a reason rejects the request on every worker."""

    def pre_filter(self, cycle: Cycle) -> FilterReason | None: ...


class Filter(Protocol):
    """None if `worker` may serve the request in the current profile, else the one reason it may not."""

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None: ...


class Scorer(Protocol):
    """One score per candidate, in the same order, each in [0, 1], 1 best. Candidates are non-empty.

    A scorer that has an opinion on some requests only may also define `applies(req) -> bool`: the cycle
    skips it for a request it does not apply to, as if its weight were 0 there (its scores would be the same
    for every candidate, which ranks nothing and costs a pass over the candidates)."""

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> Sequence[float]: ...


class Picker(Protocol):
    """Order the scored candidates best first (a permutation of them); ties broken with `cycle.rng`."""

    def pick(self, cycle: Cycle, scored: Sequence[Scored]) -> Sequence[WorkerView]: ...


class ProfileHandler(Protocol):
    """Decide which profiles run, in which order, and build the Decision (or Reject) from their results."""

    def handle(self, cycle: Cycle) -> Decision | Reject: ...


@runtime_checkable
class DispatchObserver(Protocol):
    """Feedback: the gateway (or simulator) dispatched `decision` for `req` at `now`."""

    def on_dispatch(self, decision: Decision, req: RouteRequest, now: float) -> None: ...


@runtime_checkable
class CompletionObserver(Protocol):
    """Feedback: `req` ended on `worker_id` with `outcome` at `now`."""

    def on_complete(self, worker_id: str, req: RouteRequest, outcome: Outcome, now: float) -> None: ...


# ---------------------------------------------------------------------------------------------------
# Profiles and results


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    name: str
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class SchedulingProfile:
    """One pass of Filter → Score → Pick → Reserve over workers of `roles`."""

    name: str
    roles: frozenset[Role]
    filters: tuple[Filter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker
    # Derived once (`__post_init__`), read by `Cycle.filter` on every request: the kinds of the leading
    # model/role filters (applied as one partition pass) and the filters left to call per worker.
    partition: tuple[str, ...] = field(init=False, repr=False, compare=False)
    per_worker: tuple[Filter, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kinds: list[str] = []
        for f in self.filters:
            kind = getattr(f, "partition", None)
            if kind not in ("model", "role"):
                break
            kinds.append(kind)
        object.__setattr__(self, "partition", tuple(kinds))
        object.__setattr__(self, "per_worker", self.filters[len(kinds) :])


@dataclass(frozen=True, slots=True)
class Scored:
    """A candidate, its weighted total Σ wᵢ·sᵢ, and each scorer's raw score by name."""

    worker: WorkerView
    total: float
    parts: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """The picked worker and its reservations, or None with every worker's reason counted."""

    profile: str
    worker: WorkerView | None
    reservations: tuple[Reservation, ...]
    counts: Mapping[FilterReason, int]
    scored: tuple[Scored, ...] = ()


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to send the request: `decode` always (a mixed worker, or the decode side of a P/D pair),
    `prefill` only for the P/D two-hop path. The caller owns `reservations` and must release them once."""

    decode: WorkerView
    prefill: WorkerView | None = None
    reservations: tuple[Reservation, ...] = ()
    path: str = "single"  # "single" | "pd" | "decode-only" (P/D eligible, no prefill worker available)
    scores: Mapping[str, float] = field(default_factory=dict)  # picked workers' weighted totals by worker id

    def release(self, outcome: Outcome) -> None:
        """Release every reservation, last made first (each reservation is itself idempotent)."""
        for reservation in reversed(self.reservations):
            reservation.release(outcome)

    @contextmanager
    def lease(self, outcome_on_error: Outcome = Outcome.WORKER_ERROR) -> Iterator[Decision]:
        """`with decision.lease() as d:` releases with COMPLETED on exit, `outcome_on_error` on exception.

        To report another outcome (client disconnected, ...) call `release` inside the block; the
        reservations' idempotence makes the exit's release a no-op.
        """
        try:
            yield self
        except BaseException:
            self.release(outcome_on_error)
            raise
        self.release(Outcome.COMPLETED)


def booked_engine(reservations: Iterable[object], worker_id: str) -> int | None:
    """The engine of data-parallel worker `worker_id` that a reservation booked the request on (the KV
    ledger's `KvReservation.engine`), None when none did: the worker's own balancer then picks. Both drivers
    run the hop there: the gateway pins it with `X-data-parallel-rank` (`server.proxy.pinned_headers`), the
    cluster simulator sends it to that engine."""
    for res in reservations:
        engine = getattr(res, "engine", None)  # only the KV ledger's reservations book an engine
        if engine is not None and getattr(res, "worker_id", None) == worker_id:
            return engine
    return None


# ---------------------------------------------------------------------------------------------------
# The cycle


class Cycle:
    """State of one routing cycle: the request, the frozen snapshot, `now`, `rng`, and the reservations
    made so far (a stack, so Unreserve runs in reverse). `facts` is a scratch dict PreFilters may fill
    for later plugins (request facts computed once)."""

    __slots__ = ("_held", "exclude", "facts", "now", "profile", "req", "reserve_plugins", "rng", "view")

    def __init__(
        self,
        req: RouteRequest,
        view: FleetView,
        now: float,
        rng: random.Random,
        exclude: frozenset[str] = frozenset(),
        reserve_plugins: Sequence[ReservePlugin] = (),
    ) -> None:
        self.req = req
        self.view = view
        self.now = now
        self.rng = rng
        self.exclude = exclude
        self.reserve_plugins = tuple(reserve_plugins)
        self.facts: dict[str, Any] = {}
        self.profile: SchedulingProfile | None = None
        self._held: list[Reservation] = []

    @property
    def roles(self) -> frozenset[Role]:
        """Roles the running profile accepts (all roles outside a profile)."""
        return self.profile.roles if self.profile is not None else frozenset(Role)

    @property
    def held(self) -> tuple[Reservation, ...]:
        return tuple(self._held)

    def filter(self, profile: SchedulingProfile) -> tuple[list[WorkerView], dict[FilterReason, int]]:
        """Workers passing every filter of `profile`, and a count of each rejected worker's first reason."""
        self.profile = profile
        passed: list[WorkerView] = []
        counts: dict[FilterReason, int] = {}  # a plain dict: Counter() costs ~1 µs to build per cycle
        workers: Sequence[WorkerView] = self.view.workers
        # Leading model/role filters partition the fleet: apply them as one cheap pass (same counts, same
        # order of precedence) instead of a plugin call per worker. Big fleets route 2-3x faster.
        kinds = profile.partition
        if kinds:
            model, roles = self.req.model, profile.roles
            kept: list[WorkerView] = []
            for worker in workers:
                for kind in kinds:
                    if kind == "model" and worker.model != model:
                        counts[FilterReason.WRONG_MODEL] = counts.get(FilterReason.WRONG_MODEL, 0) + 1
                        break
                    if kind == "role" and worker.role not in roles:
                        counts[FilterReason.WRONG_ROLE] = counts.get(FilterReason.WRONG_ROLE, 0) + 1
                        break
                else:
                    kept.append(worker)
            workers = kept
        pinned = self.req.pinned_worker
        if pinned is not None:  # the others are excluded whatever else a filter would say of them, so the
            # answer is the pinned worker's own reason (`Reject.from_counts(pinned=True)`)
            others = sum(1 for w in workers if w.id != pinned)
            if others:
                counts[FilterReason.EXCLUDED] = counts.get(FilterReason.EXCLUDED, 0) + others
                workers = [w for w in workers if w.id == pinned]
        filters = profile.per_worker
        for worker in workers:
            for f in filters:  # a plain loop: this is the router's hottest path (workers × filters)
                reason = f.filter(self, worker)
                if reason is not None:
                    counts[reason] = counts.get(reason, 0) + 1
                    break
            else:
                passed.append(worker)
        return passed, counts

    def score(self, profile: SchedulingProfile, candidates: Sequence[WorkerView]) -> list[Scored]:
        """Σ weight · score per candidate; raises ValueError if a scorer breaks its [0, 1] contract."""
        totals = [0.0] * len(candidates)
        parts: list[dict[str, float]] = [{} for _ in candidates]
        for ws in profile.scorers:
            applies = getattr(ws.scorer, "applies", None)
            if applies is not None and not applies(self.req):
                continue
            scores = list(ws.scorer.score(self, candidates))
            if len(scores) != len(candidates):
                raise ValueError(
                    f"scorer {ws.name!r} returned {len(scores)} scores for {len(candidates)} candidates"
                )
            name, weight = ws.name, ws.weight
            for i, s in enumerate(scores):
                if not 0.0 <= s <= 1.0:  # also catches NaN
                    raise ValueError(f"scorer {name!r} scored {candidates[i].id!r} {s}, outside [0, 1]")
                parts[i][name] = s
                totals[i] += weight * s
        return [Scored(w, totals[i], parts[i]) for i, w in enumerate(candidates)]

    def run(self, profile: SchedulingProfile) -> ProfileResult:
        """Filter → Score → Pick → Reserve for one profile; the first candidate every plugin reserves wins."""
        candidates, counts = self.filter(profile)
        if not candidates:
            # A configured pool of this model and role with no worker now will be back (an autoscaler
            # scaled it to zero, its pods are not listed yet): wait for it rather than refuse the request
            # as if nothing could ever serve it (wrong_role / wrong_model alone are final). Not for a
            # prompt over its context: that would wait (and hold the FIFO queue behind it) for nothing.
            req = self.req
            tokens = req.longest_prompt if req.prompt_tokens_floor is None else req.prompt_tokens_floor
            empty = len(self.view.empty_pools(req.model, profile.roles, tokens, generates=req.generates))
            if empty:
                counts[FilterReason.EMPTY_POOL] = counts.get(FilterReason.EMPTY_POOL, 0) + empty
            elif (exceeding := self._exceeds_everywhere(profile, counts)) is not None:
                counts = exceeding
            elif never := len(
                self.view.empty_pools(
                    req.model, profile.roles, tokens, waited_for=False, generates=req.generates
                )
            ):
                counts[FilterReason.POOL_STAYS_EMPTY] = counts.get(FilterReason.POOL_STAYS_EMPTY, 0) + never
            return ProfileResult(profile.name, None, (), counts)
        # One survivor: scores would only rank it against itself (the Kubernetes scheduler skips scoring
        # then too). It is scored as by a profile without scorers (total 0, no parts); the picker still
        # runs, so stateful pickers and the rng draws are exactly as before.
        scored = [Scored(candidates[0], 0.0, {})] if len(candidates) == 1 else self.score(profile, candidates)
        for worker in profile.picker.pick(self, scored):
            made = self.reserve(worker)
            if made is not None:
                return ProfileResult(profile.name, worker, made, counts, tuple(scored))
            # a ReservePlugin refused: the ledger says it does not fit
            counts[FilterReason.KV_FULL] = counts.get(FilterReason.KV_FULL, 0) + 1
        return ProfileResult(profile.name, None, (), counts, tuple(scored))

    def _exceeds_everywhere(
        self, profile: SchedulingProfile, counts: Mapping[FilterReason, int]
    ) -> dict[FilterReason, int] | None:
        """When nothing passed for passing reasons only (starting, draining, a breaker, at capacity, KV full),
        but the request exceeds the empty ledger of every worker of its model and the profile's roles (their
        `num_gpu_blocks` scraped): counts saying so, so the answer is the final 400 `kv_exceeds_capacity` now,
        not a 429 after the queue's deadline (the kv-fit filter, which says it, runs after those filters)."""
        if any(not REJECT_TABLE[r].retryable for r in counts if r not in _PARTITION_REASONS):
            return None  # a final reason already (a prompt over the context, ...)
        bounds = [p for p in self.reserve_plugins if isinstance(p, CapacityBound)]
        req = self.req
        workers = [
            w
            for w in self.view.workers
            if w.model == req.model
            and w.role in profile.roles
            and (req.pinned_worker is None or w.id == req.pinned_worker)  # a continuation can go nowhere else
        ]
        if not bounds or not workers:
            return None
        largest: tuple[int, int] | None = None
        for worker in workers:
            if not worker.num_gpu_blocks:  # its capacity is the perf model's guess: it may fit
                return None
            over = next((o for b in bounds if (o := b.exceeds_capacity(req, worker)) is not None), None)
            if over is None:
                return None
            if largest is None or over[1] > largest[1]:
                largest = over
        assert largest is not None
        self.facts[KV_EXCEEDS_FACT] = {"kv_need_blocks": largest[0], "kv_reservable_blocks": largest[1]}
        out = {r: n for r, n in counts.items() if r in _PARTITION_REASONS}
        out[FilterReason.KV_EXCEEDS_CAPACITY] = len(workers)
        return out

    def reserve(self, worker: WorkerView) -> tuple[Reservation, ...] | None:
        """Reserve on `worker` with every plugin; if one refuses, release the others (reverse) → None."""
        made: list[Reservation] = []
        for plugin in self.reserve_plugins:
            reservation = plugin.reserve(self.req, worker, self.now)
            if reservation is None:
                for r in reversed(made):
                    r.release(Outcome.UNRESERVED)
                return None
            made.append(reservation)
        self._held.extend(made)
        return tuple(made)

    def unreserve_all(self, keep: Sequence[Reservation] = ()) -> None:
        """Release (reverse order) every reservation held by the cycle except those in `keep`."""
        held = self._held
        if len(held) == len(keep) and all(a is b for a, b in zip(held, keep, strict=True)):
            return  # the usual end of a cycle: the Decision carries exactly what was reserved
        kept = {id(r) for r in keep}
        for r in reversed(self._held):
            if id(r) not in kept:
                r.release(Outcome.UNRESERVED)
        self._held = [r for r in self._held if id(r) in kept]

    def decide(
        self, decode: ProfileResult, prefill: ProfileResult | None = None, path: str = "single"
    ) -> Decision:
        """A Decision from picked results; carries every reservation they made, decode's first."""
        assert decode.worker is not None, "decide() needs a picked decode worker"
        reservations = decode.reservations + (prefill.reservations if prefill is not None else ())
        picked = [r for r in (decode, prefill) if r is not None and r.worker is not None]
        scores = {s.worker.id: s.total for r in picked for s in r.scored if s.worker.id == r.worker.id}  # type: ignore[union-attr]
        return Decision(decode.worker, prefill.worker if prefill else None, reservations, path, scores)

    def reject(self, *results: ProfileResult) -> Reject:
        """A Reject summarising the reasons of the failed profile runs (summed)."""
        counts: Counter[FilterReason] = Counter()
        for r in results:
            counts.update(r.counts)
        details = {**self.facts.get(CONTEXT_FACT, {}), **self.facts.get(KV_EXCEEDS_FACT, {})}
        return Reject.from_counts(counts, details=details, pinned=self.req.pinned_worker is not None)


class Router:
    """Runs routing cycles. Build it once (`config.build_router`), call `route` per request.

    `route` is pure apart from the reserve plugins it is given (and stateful pickers such as
    round-robin's cursor); feedback reaches stateful plugins only through `on_dispatch` / `on_complete`.
    """

    def __init__(
        self,
        handler: ProfileHandler,
        pre_filters: Sequence[PreFilter] = (),
        reserve_plugins: Sequence[ReservePlugin] = (),
        observers: Sequence[object] = (),
        policy: str = "custom",
        description: Mapping[str, Any] | None = None,
    ) -> None:
        self.handler = handler
        self.pre_filters = tuple(pre_filters)
        self.reserve_plugins = tuple(reserve_plugins)
        self.observers = tuple(observers)
        # Protocol isinstance checks are slow (typing walks the members): sort the observers once.
        self._on_dispatch = tuple(o for o in self.observers if isinstance(o, DispatchObserver))
        self._on_complete = tuple(o for o in self.observers if isinstance(o, CompletionObserver))
        self.policy = policy
        self._description = dict(description or {})

    def route(
        self,
        req: RouteRequest,
        view: FleetView,
        now: float,
        rng: random.Random,
        exclude: frozenset[str] = frozenset(),
    ) -> Decision | Reject:
        """One cycle over the frozen `view`. Every reservation not handed out in the Decision is released.
        A request pinned to one worker (`RouteRequest.pinned_worker`) has every other worker excluded, the
        way the batch admission restricts a planned request: the filters then say why the pinned one cannot
        take it, and the reject summary counts the others as `excluded`."""
        if req.pinned_worker is not None:
            exclude = exclude.union(w.id for w in view.workers if w.id != req.pinned_worker)
        cycle = Cycle(req, view, now, rng, exclude, self.reserve_plugins)
        try:
            for pre in self.pre_filters:
                reason = pre.pre_filter(cycle)
                if reason is not None:
                    return Reject.from_counts({reason: max(1, len(view.for_model(req.model)))})
            result = self.handler.handle(cycle)
        except BaseException:
            cycle.unreserve_all()
            raise
        cycle.unreserve_all(keep=result.reservations if isinstance(result, Decision) else ())
        return result

    def on_dispatch(self, decision: Decision, req: RouteRequest, now: float) -> None:
        """Tell stateful plugins (prefix affinity) where `req` went. Call once per dispatched Decision."""
        for obs in self._on_dispatch:
            obs.on_dispatch(decision, req, now)

    def on_complete(self, worker_id: str, req: RouteRequest, outcome: Outcome, now: float) -> None:
        """Tell stateful plugins that `req` ended on `worker_id` (call once per worker it was sent to)."""
        for obs in self._on_complete:
            obs.on_complete(worker_id, req, outcome, now)

    def describe(self) -> dict[str, Any]:
        """The policy, profiles, plugins and weights, as JSON-able data (for /admin/routing)."""
        return {"policy": self.policy, **self._description}
