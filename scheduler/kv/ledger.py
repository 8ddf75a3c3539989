"""KV budget ledger: reserve each request's KV footprint on a worker before dispatch (the router's Reserve step).

Per worker, in the worker's ledger units (blocks, or head-pages for compression workers; `footprint.py`):

    total     = num_gpu_blocks · units_per_block      scraped `vllm:cache_config_info`, else the perf model
    capacity  = floor(total · (1 − watermark) · share) − shrink
    admit  ⇔  reserved + need.peak + holds of others ≤ capacity
              (predicted mode also: worst_reserved + worst.peak ≤ capacity · (1 + overbook allowance))

`share` is this gateway process's part of every worker (1/N for N gateway replicas, DESIGN "Scaling the
gateway out"); `shrink` comes from `reconcile`: when a worker reports more KV in use than this process's
requests can hold (plus the other processes' shares, plus what was released since the last reconcile)
explain, by more than `reconcile_tolerance` of the total, the excess is withheld until usage falls back.
What a request can hold (`_held_at_most`) is its prompt and the tokens it has streamed so far when it
streams, else its reservation: a worst-case reservation counted whole hid usage nobody here reserved.

Lifecycle of a `KvReservation` (every path ends in exactly one `release`):
admission → `reserve` holds `peak` → `first_token` shrinks to `steady` (the transient prefill chunk is
freed; on a P/D prefill worker it releases everything, as the decode worker has pulled the KV) → `on_tokens` renews the lease and, in predicted mode, grows the output reservation as tokens
stream → `release(outcome)` (idempotent: later calls are no-ops, counted in `stats.double_releases`).
A reservation whose lease (`lease_s` since the last renewal) has passed is released by `sweep(now)` with
`Outcome.LEASE_EXPIRED`, so a lost completion can never leak pages.

Holds (aging): `hold(key, worker, units, now, owner)` sets pages aside for one waiting request (a large
long-context request that many small ones keep overtaking); others cannot reserve them, the holder's reserve
can. `key` names the hold (the gateway passes a key unique per waiter, since client request ids may repeat);
`owner` is the `RouteRequest.holder` whose reserve may use it (default: the key): the gateway's ticket, so a
second request carrying the waiter's X-Request-Id can neither use the pages nor drop the hold.

Reconcile counts, as "released since the last reconcile", only pages a worker may still have shown in use at
its last scrape: a release with `Outcome.UNRESERVED` (the router's rollback, the batch queue's probes and
unplanned decisions) never reached a worker and is not counted, so steady probing cannot blind the shrink.

Data-parallel workers (`WorkerView.engines`: a vLLM server driving two or more engines, each with its own
KV cache) get one book per engine (`per_engine`, the default): a sequence's blocks all come from the one
engine that runs it, so a worker-wide sum would admit a request no single engine has room for (two
100-block engines, three 65-block requests). Worker-level questions answer for the roomiest engine (`free`,
`capacity`, `fits`, `exceeds_capacity`), `reserve` picks the engine with the most free units (ties: the lower
rank; the holder's own hold first) and records it in `KvReservation.engine`, the rank the gateway pins the
request to (`X-data-parallel-rank`). Each engine is reconciled against its own usage and preemptions;
`snapshot` and `reserved` sum a worker's engines.

`forget(worker_id)` drops a removed worker's books (at once, or when its last reservation is released);
`reconcile(fleet_view)` calls it for every worker the view no longer lists, so the gateway's per-scrape
reconcile drops workers discovery removed (and their `mosaic_kv_*` series, read from `snapshot`).

Pure: no clock (every method takes `now`), no I/O. Not thread-safe: the gateway calls it from its event loop.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Literal

from scheduler.fleet import FleetView, Role, WorkerView
from scheduler.kv.footprint import (
    CompressionSpec,
    Footprint,
    SequenceShape,
    WorkerKvSpec,
    request_need,
    resident_shape,
)
from scheduler.length_predictor import LengthPredictor
from scheduler.routing.framework import RouteRequest
from scheduler.routing.reasons import Outcome

_NEED_CACHE_MAX = 65_536


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    mode: Literal["worst_case", "predicted"] = "worst_case"
    watermark: float = 0.02
    share: float = 1.0
    lease_s: float = 900.0
    max_overbook_frac: float = 0.1  # predicted mode: Σ worst-case peaks may exceed capacity by this fraction
    preemption_budget: float = 0.0  # preemptions seen per reconcile before the overbook allowance halves
    reconcile_tolerance: float = 0.02
    per_engine: bool = True  # a data-parallel worker's engines are booked apart (module docstring)

    def __post_init__(self) -> None:
        if not 0.0 <= self.watermark < 1.0 or not 0.0 < self.share <= 1.0 or self.lease_s <= 0:
            raise ValueError("watermark in [0, 1), share in (0, 1], lease_s > 0")


@dataclass(slots=True)
class SpecTable:
    """Which workers compress KV: a layout per pool, else per model, else stock vLLM."""

    by_pool: Mapping[str, CompressionSpec] = field(default_factory=dict)
    by_model: Mapping[str, CompressionSpec] = field(default_factory=dict)
    # one spec object per distinct (block size, context, layout): the workers of a pool share it, so a
    # request's footprint is computed once per spec, not once per worker (`KvLedger._footprint`)
    _interned: dict[tuple[int, int | None, int, int], WorkerKvSpec] = field(default_factory=dict)

    def spec_for(self, worker: WorkerView) -> WorkerKvSpec:
        comp = self.by_pool.get(worker.pool) or self.by_model.get(worker.model)
        # one engine's sequences (a DP worker's capacity is its engines' sum)
        seqs = worker.capacity.max_num_seqs // max(1, worker.capacity.engines)
        key = (worker.effective_block_size, worker.capacity.max_model_len, id(comp), seqs)
        spec = self._interned.get(key)
        if spec is None:
            spec = self._interned[key] = WorkerKvSpec(key[0], key[1], comp, seqs or None)
        return spec


def _within_the_worker(sized: tuple[Footprint, Footprint], book: _Book) -> tuple[Footprint, Footprint]:
    """A pooling request's footprint, at most what one request may take on the worker (`lone_capacity`):
    vLLM schedules its prefill-only sequences as blocks free, so a batch larger than the KV runs in turns
    (and takes the whole worker meanwhile) where a generation of that size could never run."""
    cap = book.lone_capacity
    fp, worst = sized
    if cap <= 0 or worst.peak <= cap:
        return sized
    return _capped(fp, cap), _capped(worst, cap)


def _capped(fp: Footprint, cap: int) -> Footprint:
    return replace(fp, peak=min(fp.peak, cap), steady=min(fp.steady, cap))


@dataclass(frozen=True, slots=True)
class ReconcileSample:
    """One worker's reported usage against this process's reservations (the estimate-error metric)."""

    worker_id: str
    reported_units: float
    reserved_units: int
    error_frac: float  # (reported − reserved) / total: > 0 means the worker holds more than was reserved
    shrink_units: int


@dataclass(slots=True)
class LedgerStats:
    reserved: int = 0
    refused: int = 0
    released: Counter[str] = field(default_factory=Counter)
    double_releases: int = 0
    grows: int = 0
    grow_refused: int = 0


class KvReservation:
    """Pages held on one worker for one request. Use as a context manager or call `release` once."""

    __slots__ = (
        "_ledger",
        "book_id",
        "early",
        "engine",
        "expires_s",
        "fp_steady",
        "fp_worst_steady",
        "generated",
        "handoff",
        "holder",
        "key",
        "max_output",
        "model",
        "outcome",
        "prefilled",
        "prompt_tokens",
        "request_id",
        "reserved_output",
        "shape",
        "units",
        "worker_id",
        "worst_units",
    )

    def __init__(
        self,
        ledger: KvLedger,
        key: int,
        req: RouteRequest,
        worker_id: str,
        fp: Footprint,
        worst: Footprint,
        now: float,
        worker_role: Role = Role.MIXED,
        book_id: str | None = None,
        engine: int | None = None,
    ) -> None:
        self._ledger = ledger
        self.key = key
        self.worker_id = worker_id
        self.book_id = (
            worker_id if book_id is None else book_id
        )  # the ledger's book: an engine's on DP workers
        self.engine = engine  # the data-parallel rank it is booked on (None: a single-engine worker)
        self.request_id = req.request_id
        self.holder = req.holder
        self.model = req.model
        self.prompt_tokens = req.prompt_tokens
        self.shape = req.sequence_shape
        self.max_output = req.max_output_tokens
        self.reserved_output = fp.reserved_output
        self.units = fp.peak
        self.fp_steady = fp.steady
        self.worst_units = worst.peak
        self.fp_worst_steady = worst.steady
        self.prefilled = False
        self.generated: int | None = None  # output tokens streamed so far (`on_tokens`); None: not streamed
        # A P/D prefill worker's pages are handed to the decode worker: the decode hop's first token means
        # the KV has been pulled, so `first_token` releases them then (not at the end of the request).
        self.handoff = worker_role == Role.PREFILL
        self.early = False  # released by `first_token`: the request's own final release is then expected
        self.outcome: Outcome | None = None
        self.expires_s = now + ledger.settings.lease_s

    @property
    def released(self) -> bool:
        return self.outcome is not None

    def release(self, outcome: Outcome) -> None:
        """Free the pages (first call only; later calls are counted and ignored)."""
        self._ledger._release(self, outcome)

    def touch(self, now: float) -> None:
        """Renew the lease (call on streamed chunks; `on_tokens` does it too)."""
        if self.outcome is None:
            self.expires_s = now + self._ledger.settings.lease_s

    def first_token(self, now: float) -> None:
        """Prefill is done: drop the transient first-chunk pages (peak → steady). On a P/D prefill worker
        (called when the decode hop streams its first token, so the KV has been pulled): release it all
        (outcome completed); the request's own release at its end is then a silent no-op."""
        self._ledger._settle(self, now)

    def on_tokens(self, generated: int, now: float) -> bool:
        """`generated` output tokens so far; grows the reservation if needed. False if it could not grow."""
        return self._ledger._grow(self, generated, now)

    def __enter__(self) -> KvReservation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release(Outcome.COMPLETED if exc_type is None else Outcome.WORKER_ERROR)

    def __repr__(self) -> str:
        where = self.worker_id if self.engine is None else f"{self.worker_id} engine {self.engine}"
        return f"KvReservation({self.request_id!r} on {where!r}, {self.units} units, outcome={self.outcome})"


@dataclass(slots=True)
class _Book:
    total: int = 0  # units on the worker (last seen)
    unshared: float = 0.0  # min(total · (1 − watermark), total − the null block), derived with `total`
    base_capacity: int = 0  # floor(unshared · share) (capacity = it − shrink)
    usable: int = 0  # total − the null block (watermark 0: total): the most one sequence can ever hold
    # floor(usable · share): what a request may take when it is alone on the worker (`lone_room`)
    lone_capacity: int = 0
    reserved: int = 0
    worst_reserved: int = 0
    shrink: int = 0
    released_since_reconcile: int = 0
    overbook: float = 0.0  # current allowance (predicted mode)
    last_sample_at: float | None = None  # when the scrape last reconciled was taken
    last_preemptions: float | None = None
    error_frac: float | None = None
    active: dict[int, KvReservation] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)  # hold key → units
    hold_owner: dict[str, str | int] = field(default_factory=dict)  # hold key → the holder that may use it
    hold_expiry: dict[str, float] = field(default_factory=dict)  # a hold nobody claims lapses like a lease
    forgotten: bool = False  # the worker was removed: drop the book when its last reservation ends
    key: tuple[object, ...] = ()  # what the spec was derived from (pool, model, block size, limits, blocks)
    spec: WorkerKvSpec = field(default_factory=WorkerKvSpec)
    needs: dict[tuple[SequenceShape, int], Footprint] = field(default_factory=dict)  # memoised footprints
    view: WorkerView | None = None  # the snapshot the key was last checked against (a cycle reuses it)
    book_id: str = ""  # its key in `KvLedger._books`: the worker's id, or `<worker>#dp<rank>` for an engine
    worker_id: str = ""  # the worker the book is of (an engine's book: its server's)
    engine: int | None = None  # the data-parallel rank of an engine's book


def _room_alone(book: _Book) -> int:
    """The most one request may take on the book's engine when nothing else is reserved or held there:
    its lone capacity, less any shrink (never below zero). Admission, growth, `lone_room` and
    `can_ever_fit` all bound a lone request by this one figure, so they cannot disagree."""
    return max(0, book.lone_capacity - book.shrink)


@dataclass(slots=True)
class _DataParallel:
    """A data-parallel worker's engines as books: the views derived from the worker's last view."""

    view: WorkerView
    views: tuple[WorkerView, ...]  # one per engine, id `<worker>#dp<rank>`, the engine's blocks and usage
    ranks: tuple[int, ...]


class KvLedger:
    """Reserved KV per worker against its capacity. Implements the router's ReservePlugin and FitChecker."""

    def __init__(
        self,
        settings: LedgerSettings | None = None,
        specs: SpecTable | None = None,
        predictor: LengthPredictor | None = None,
    ) -> None:
        self.settings = settings or LedgerSettings()
        self.specs = specs or SpecTable()
        self.predictor = predictor or LengthPredictor()
        self.stats = LedgerStats()
        self._share_ceiling = self.settings.share  # `set_share`
        self._books: dict[str, _Book] = {}
        self._dp: dict[str, _DataParallel] = {}  # worker id → its engines, for data-parallel workers
        self._next_key = 0
        # the request last sized, and its footprints by (spec, prefill side): routing asks for one request
        # on every worker of the fleet, and the workers of a pool share their spec
        self._sized: RouteRequest | None = None
        self._sizes: dict[tuple[int, bool], tuple[Footprint, Footprint]] = {}

    # --- capacity --------------------------------------------------------------------------------------
    def spec_for(self, worker: WorkerView) -> WorkerKvSpec:
        return self._engine_books(worker)[0].spec

    def total_units(self, worker: WorkerView) -> int:
        """num_gpu_blocks (scraped, else the perf model's) × units per block (summed over a DP worker's engines)."""
        return sum(b.total for b in self._engine_books(worker))

    def capacity(self, worker: WorkerView) -> int:
        """floor(total · (1 − watermark) · share) − shrink, never below 0 (a DP worker: its roomiest engine's)."""
        if not worker.engines and worker.id not in self._dp:  # one engine (inlined: routing asks per worker)
            return self._capacity_of(self._book(worker))
        return self._capacity_of(self._roomiest(self._engine_books(worker), None))

    def _capacity_of(self, book: _Book) -> int:
        return max(0, book.base_capacity - book.shrink)

    def reserved(self, worker_id: str) -> int:
        return sum(b.reserved for b in self._books_of(worker_id))

    def free(self, worker: WorkerView, holder: str | int | None = None) -> int:
        """Units `holder` (a `RouteRequest.holder`) could reserve now (holds of other requests excluded); on a
        DP worker, in its roomiest engine (one request's blocks all come from one engine)."""
        if not worker.engines and worker.id not in self._dp:  # one engine (inlined: routing asks per worker)
            return self._free_of(self._book(worker), holder)
        return self._free_of(self._roomiest(self._engine_books(worker), holder), holder)

    def _roomiest(self, books: tuple[_Book, ...], holder: str | int | None) -> _Book:
        """The book with the most units free for `holder` (the lowest rank among equals)."""
        if len(books) == 1:
            return books[0]
        return max(books, key=lambda b: (self._free_of(b, holder), -(b.engine or 0)))

    def _free_of(self, book: _Book, holder: str | int | None) -> int:
        return self._capacity_of(book) - book.reserved - self._held_for_others(book, holder)

    @staticmethod
    def _held_for_others(book: _Book, holder: str | int | None) -> int:
        """Units held for requests other than `holder` (its own holds it may use)."""
        if not book.holds:
            return 0
        owner = book.hold_owner
        return sum(u for k, u in book.holds.items() if owner.get(k, k) != holder)

    def active(self, worker_id: str | None = None) -> list[KvReservation]:
        """Live reservations, on one worker or on all."""
        if worker_id is None:
            return [r for b in self._books.values() for r in b.active.values()]
        return [r for b in self._books_of(worker_id) for r in b.active.values()]

    # --- footprint -------------------------------------------------------------------------------------
    def footprint(self, req: RouteRequest, worker: WorkerView) -> tuple[Footprint, Footprint]:
        """(the footprint to reserve, the worst-case footprint); equal in worst_case mode.

        A prefill worker (P/D) computes the prompt and one token (the prefill hop runs with max_tokens=1), so
        its footprint is the prompt's KV plus one token, whatever the request's max_tokens.
        """
        book = self._book(worker) if not worker.engines else self._engine_books(worker)[0]
        return self._footprint(book, req, worker.role == Role.PREFILL)

    def _footprint(self, book: _Book, req: RouteRequest, prefill: bool) -> tuple[Footprint, Footprint]:
        if self._sized is not req:
            self._sized = req
            self._sizes.clear()
        key = (id(book.spec), prefill)
        sized = self._sizes.get(key)
        if sized is not None:
            return sized if req.generates else _within_the_worker(sized, book)
        shape = req.sequence_shape
        if not req.generates:  # pooling: its sequences end at their prefill, at most max_num_seqs at once
            shape = resident_shape(shape, book.spec.max_num_seqs)
        if prefill:
            fp = self._need(book, shape, 1)
            sized = fp, fp
        else:
            worst = self._need(book, shape, req.max_output_tokens)
            if self.settings.mode == "worst_case":
                sized = worst, worst
            else:
                predicted = min(req.max_output_tokens, max(1, req.predicted_output_tokens))
                sized = self._need(book, shape, predicted), worst
        self._sizes[key] = sized
        return sized if req.generates else _within_the_worker(sized, book)

    @staticmethod
    def _need(book: _Book, shape: SequenceShape, output: int) -> Footprint:
        """`request_need` memoised per worker: routing asks for the same request shape on every filter,
        score and retry. `shape` is `RouteRequest.sequence_shape`: the prompt tokens of a single sequence,
        or (each prompt's tokens, n) for a batch or n > 1 (footprint summed per sequence)."""
        fp = book.needs.get((shape, output))
        if fp is None:
            if len(book.needs) >= _NEED_CACHE_MAX:
                book.needs.clear()
            fp = book.needs[(shape, output)] = request_need(shape, output, book.spec)
        return fp

    def can_ever_fit(self, req: RouteRequest, worker: WorkerView) -> bool:
        """Whether the request fits this worker's capacity when nothing else is reserved."""
        fp, _ = self.footprint(req, worker)
        return any(fp.peak <= _room_alone(b) for b in self._engine_books(worker))

    def exceeds_capacity(self, req: RouteRequest, worker: WorkerView) -> tuple[int, int] | None:
        """The router's `CapacityBound`: None when `req` would be admitted on this worker with nothing else
        reserved, held or withheld (no shrink: that may lift); else (its need, the most it could get) in
        the worker's blocks (ledger units ÷ units per block; need rounded up, room down). Predicted mode
        also needs the worst-case peak within capacity · (1 + overbook.max_frac). A DP worker: None when one
        of its engines would admit it, else the bound of the engine with the most room."""
        fp, worst = self.footprint(req, worker)
        books = self._engine_books(worker)
        bounds = []
        for book in books:
            bound = self._exceeds(book, fp, worst)
            if bound is None:
                return None
            bounds.append(bound)
        return max(bounds, key=lambda b: b[1])

    def _exceeds(self, book: _Book, fp: Footprint, worst: Footprint) -> tuple[int, int] | None:
        room = book.lone_capacity  # alone on the worker (`lone_room`): the most it could ever get
        if self._share_ceiling > self.settings.share:  # a lowered share may come back (`set_share`)
            room = math.floor(book.usable * self._share_ceiling)
        need_units = fp.peak
        if need_units <= room and self.settings.mode == "predicted" and worst.peak > fp.peak:
            limit = math.floor(room * (1.0 + self.settings.max_overbook_frac))
            if worst.peak > limit:
                need_units, room = worst.peak, limit
        if need_units <= room:
            return None
        per_block = book.spec.units_per_block
        return -(-need_units // per_block), room // per_block

    # --- ReservePlugin / FitChecker ----------------------------------------------------------------------
    def fits(self, req: RouteRequest, worker: WorkerView, now: float) -> bool:
        if not worker.engines and worker.id not in self._dp:  # one engine (inlined: routing asks per worker)
            book = self._book(worker)
            fp, worst = self._footprint(book, req, worker.role == Role.PREFILL)
            return self._admissible(book, req.holder, fp, worst)
        books = self._engine_books(worker)
        fp, worst = self._footprint(books[0], req, worker.role == Role.PREFILL)
        return any(self._admissible(b, req.holder, fp, worst) for b in books)

    def reserve(self, req: RouteRequest, worker: WorkerView, now: float) -> KvReservation | None:
        fp, worst = self.footprint(req, worker)  # the public one: a subclass may size it otherwise (oracle)
        book = self._engine_for(self._engine_books(worker), req.holder, fp, worst)
        if book is None:
            self.stats.refused += 1
            return None
        self._next_key += 1
        res = KvReservation(
            self, self._next_key, req, worker.id, fp, worst, now, worker.role, book.book_id, book.engine
        )
        book.active[res.key] = res
        book.reserved += res.units
        book.worst_reserved += res.worst_units
        if book.holds:  # usually none: the holder's reservation replaces its hold
            for k in [k for k in book.holds if book.hold_owner.get(k, k) == req.holder]:
                self._pop_hold(book, k)
        self.stats.reserved += 1
        return res

    def _engine_for(
        self, books: tuple[_Book, ...], holder: str | int, fp: Footprint, worst: Footprint
    ) -> _Book | None:
        """The book to reserve on: the only one; on a DP worker, the engine holding pages for `holder` when it
        admits the request, else the admitting engine with the most free units (spreading the load: each
        engine's batch sets its own step time, and with expert parallelism, where vLLM steps a DP group's
        engines together, the busiest one sets everyone's pace)."""
        if len(books) == 1:
            return books[0] if self._admissible(books[0], holder, fp, worst) else None
        admitting = [b for b in books if self._admissible(b, holder, fp, worst)]
        if not admitting:
            return None
        for b in admitting:
            if b.holds and any(b.hold_owner.get(k, k) == holder for k in b.holds):
                return b
        return self._roomiest(tuple(admitting), holder)

    def _admissible(self, book: _Book, holder: str | int, fp: Footprint, worst: Footprint) -> bool:
        capacity = self._capacity_of(book)
        held = self._held_for_others(book, holder)
        if not book.reserved and not held:  # alone on it: peak and worst case bounded as `_exceeds` does
            capacity = max(capacity, _room_alone(book))
        if fp.peak > capacity - book.reserved - held:
            return False
        if self.settings.mode == "predicted":
            # the bound is on the sum of every reservation's worst case, this one's too even when it is
            # exact (a cold predictor, a small max_tokens): skipping those let overbooked ones exceed it
            limit = capacity * (1.0 + book.overbook)
            return book.worst_reserved + worst.peak <= limit
        return True

    def lone_room(self, worker: WorkerView, holder: str | int | None = None) -> int | None:
        """What one request may take on the worker (its roomiest engine) when nothing is reserved or held for
        others there: all of it but the null block (less shrink, within this process's share); None when no
        engine is empty. The batch planner gives such a request a worker alone.

        The watermark is a margin against many requests' estimates erring together. Alone, a request's
        reservation bounds what it can use, and vLLM admits a sequence of up to every block but the null one:
        with the watermark, a worker whose KV only just covers its max_model_len (vLLM's own advice when the
        cache is smaller than the context) refused for good every request that left out max_tokens."""
        rooms = [
            _room_alone(b)
            for b in self._engine_books(worker)
            if not b.reserved and not self._held_for_others(b, holder)
        ]
        return max(rooms, default=None)

    # --- holds (aging) ---------------------------------------------------------------------------------
    def hold(
        self, key: str, worker: WorkerView, units: int, now: float, owner: str | int | None = None
    ) -> None:
        """Set `units` aside on `worker` under `key` for request `owner` (default: `key`; replaces the key's
        previous hold there) until the owner reserves there, `drop_hold(key)` is called, or `lease_s` passes
        (then `sweep` drops it). Only the owner's `fits`/`reserve` may use held units. On a DP worker the
        pages are held in the engine with the most room for the owner (the one `reserve` would pick)."""
        books = self._engine_books(worker)
        holder = key if owner is None else owner
        book = self._roomiest(books, holder)
        for other in books:
            if other is not book and key in other.holds:
                self._pop_hold(other, key)
        book.holds[key] = max(0, int(units))
        book.hold_expiry[key] = now + self.settings.lease_s
        if owner is not None and owner != key:
            book.hold_owner[key] = owner
        else:
            book.hold_owner.pop(key, None)

    def drop_hold(self, key: str) -> None:
        for book in list(self._books.values()):
            if key in book.holds:
                self._pop_hold(book, key)

    @staticmethod
    def _pop_hold(book: _Book, key: str) -> None:
        book.holds.pop(key, None)
        book.hold_expiry.pop(key, None)
        book.hold_owner.pop(key, None)

    def forget(self, worker_id: str) -> bool:
        """The worker left the fleet: drop its books (memoised footprints, holds, reconcile state) so neither
        memory nor `/metrics` keeps it. With reservations still open the book stays until the last one is
        released (then it goes). True when dropped now. Seeing the worker again (a view of it) cancels a
        pending forget; after a drop it starts from a fresh book. A DP worker: each engine's book."""
        engines_dropped = self._forget_engines(worker_id)
        return self._forget_book(worker_id) and engines_dropped

    def _forget_engines(self, worker_id: str) -> bool:
        """Drop a DP worker's engine books (each when its last reservation ends). True when all went now."""
        dp = self._dp.pop(worker_id, None)
        return dp is None or all([self._forget_book(v.id) for v in dp.views])

    def _forget_book(self, book_id: str) -> bool:
        book = self._books.get(book_id)
        if book is None:
            return True
        if book.active:
            book.forgotten = True
            book.holds.clear()
            book.hold_expiry.clear()
            book.hold_owner.clear()
            return False
        del self._books[book_id]
        return True

    # --- lifecycle -------------------------------------------------------------------------------------
    def _release(self, res: KvReservation, outcome: Outcome) -> None:
        if res.outcome is not None:
            if res.early:  # the request's end after a P/D hand-off release: expected, once
                res.early = False
                return
            self.stats.double_releases += 1
            return
        res.outcome = Outcome(outcome)
        book = self._books[res.book_id]
        del book.active[res.key]
        book.reserved -= res.units
        book.worst_reserved -= res.worst_units
        if res.outcome is not Outcome.UNRESERVED:  # an unreserved one never ran: no page to explain
            book.released_since_reconcile += res.units
        self.stats.released[res.outcome.value] += 1
        if book.forgotten and not book.active:
            del self._books[res.book_id]

    def _settle(self, res: KvReservation, now: float) -> None:
        if res.outcome is not None or res.prefilled:
            return
        if res.handoff:
            self._release(res, Outcome.COMPLETED)
            res.early = True
            return
        res.prefilled = True
        res.touch(now)
        self._resize(res, res.fp_steady, res.fp_worst_steady)

    def _resize(self, res: KvReservation, units: int, worst_units: int) -> None:
        book = self._books[res.book_id]
        book.reserved += units - res.units
        book.worst_reserved += worst_units - res.worst_units
        if units < res.units:
            book.released_since_reconcile += res.units - units
        res.units, res.worst_units = units, worst_units

    def _grow(self, res: KvReservation, generated: int, now: float) -> bool:
        res.touch(now)
        res.generated = generated
        if res.outcome is not None or generated < res.reserved_output:
            return True
        if res.reserved_output >= res.max_output:
            return True  # already the worst case (or the context limit): nothing more can be needed
        target = self.predictor.grow(res.model, res.prompt_tokens, generated, res.max_output)
        book = self._books[res.book_id]
        fp = self._need(book, res.shape, target)
        new_units = fp.steady if res.prefilled else fp.peak
        delta = new_units - res.units
        held = self._held_for_others(book, res.holder)
        capacity = self._capacity_of(book)
        if len(book.active) == 1 and not held:  # alone on it: it may grow as far as it could be admitted
            capacity = max(capacity, _room_alone(book))
        if delta > 0 and book.reserved + delta + held > capacity:
            self.stats.grow_refused += 1
            return False
        self._resize(res, new_units, res.worst_units)
        res.reserved_output = fp.reserved_output
        if not res.prefilled:  # grown before its first token: the steady size it shrinks to then grows too
            res.fp_steady = max(res.fp_steady, fp.steady)
        self.stats.grows += 1
        return True

    def sweep(self, now: float) -> list[KvReservation]:
        """Release (LEASE_EXPIRED) every reservation whose lease has passed, drop lapsed holds; returns the former."""
        for b in self._books.values():
            for key in [k for k, t in b.hold_expiry.items() if t <= now]:
                self._pop_hold(b, key)
        expired = [r for b in self._books.values() for r in b.active.values() if r.expires_s <= now]
        for r in expired:
            r.release(Outcome.LEASE_EXPIRED)
        return expired

    def set_share(self, share: float, ceiling: float | None = None) -> None:
        """This process's part of every worker changed (`server.peers`: the listed gateway replicas). Applies
        at once: a smaller share refuses new reservations until this process's own fall below it (nothing
        already reserved is taken back); the reconcile's allowance for the others' shares follows.
        `ceiling` (≥ share): the largest share this process has had lately; a request that fits it is not
        refused for good (`exceeds_capacity`) while the share is lower — a rollout's surge replica lowers
        every share for minutes, and such a request waits for it to end instead of a final 400."""
        ceiling = share if ceiling is None else max(share, ceiling)
        if not 0.0 < ceiling <= 1.0:
            raise ValueError(f"share ceiling must be in (0, 1], got {ceiling}")
        self._share_ceiling = ceiling
        if share == self.settings.share:
            return
        self.settings = replace(self.settings, share=share)  # validated there: (0, 1]
        for book in self._books.values():
            book.base_capacity = math.floor(book.unshared * share)
            book.lone_capacity = math.floor(book.usable * share)

    # --- reconcile -------------------------------------------------------------------------------------
    def reconcile(self, view: FleetView | Iterable[WorkerView], now: float) -> list[ReconcileSample]:
        """Compare reported KV usage with reservations; shrink capacity by unexplained usage. Per worker.

        Given a `FleetView` (the whole fleet, as the gateway passes its registry's view after every scrape
        round), books of workers it no longer lists are forgotten (`forget`): discovery removed them. An
        iterable of views is taken as a subset and forgets nothing. A DP worker's engines are reconciled
        one by one, each against its own usage (`WorkerView.engines`)."""
        given = view.workers if isinstance(view, FleetView) else tuple(view)
        views = [self._views_of(g) for g in given]
        if isinstance(view, FleetView):  # the whole fleet: workers it no longer lists were removed
            given_ids = {g.id for g in given}
            for wid in [wid for wid in self._dp if wid not in given_ids]:
                self.forget(wid)
            listed = given_ids | {v.id for vs in views for v in vs}
            for bid in [bid for bid, b in self._books.items() if bid not in listed and not b.forgotten]:
                self._forget_book(bid)
        out: list[ReconcileSample] = []
        for g, vs in zip(given, views, strict=True):
            if all(v.kv_usage is None for v in vs):
                continue
            for w, book in zip(vs, self._engine_books(g), strict=True):
                if w.kv_usage is not None:
                    self._reconcile_book(book, w, w.kv_usage, now, out)
        return out

    def _reconcile_book(
        self, book: _Book, w: WorkerView, usage: float, now: float, out: list[ReconcileSample]
    ) -> None:
        """One book against its worker's (or engine's) sample: `usage`, the view's `kv_usage`."""
        s = self.settings
        # A worker whose scrape failed keeps its last sample until it is stale: reconciling it again
        # would count the releases since then as unexplained (capacity withheld from an idle worker)
        # and regrow the overbook allowance on no news. One reconcile per sample.
        taken = None if w.scrape_age_s is None else now - w.scrape_age_s
        if taken is not None and book.last_sample_at is not None and abs(taken - book.last_sample_at) < 1e-6:
            return
        book.last_sample_at = taken
        total = book.total
        used = usage * total
        own = self._held_at_most(book)
        explained = own + book.released_since_reconcile + total * (1.0 - s.share)
        excess = used - explained - s.reconcile_tolerance * total
        book.shrink = max(0, math.ceil(excess))
        book.released_since_reconcile = 0
        book.error_frac = (used - book.reserved) / total if total else 0.0
        self._track_preemptions(book, w.preemptions_total)
        out.append(ReconcileSample(w.id, used, book.reserved, book.error_frac, book.shrink))

    def _held_at_most(self, book: _Book) -> int:
        """What this process's requests can hold on the worker now, at most: a streaming request's prompt
        and the tokens it has streamed, plus a block per sequence (the engine may be a step or an unsent
        event ahead), never more than its reservation; any other request (not streamed, or no token yet)
        its reservation. A worst-case reservation is mostly unused for most of a request's life: counted
        whole, it explained away usage nobody here reserved — another gateway's surplus replica, clients
        sent to the worker directly, image or audio tokens the estimate leaves out — up to the slack of this
        process's own reservations, and a worker was over-committed."""
        held = 0
        for res in book.active.values():
            g = res.generated
            if g is None or not res.prefilled:
                held += res.units
                continue
            step = book.spec.block_size * (
                1 if isinstance(res.shape, int) else len(res.shape[0]) * max(1, res.shape[1])
            )
            # g plus a block per sequence, rounded up to whole blocks per sequence: the same few output sizes
            # recur, so the memoised footprints answer (a reconcile is per scrape, over every reservation)
            output = (g // step + 2) * step
            held += min(res.units, self._need(book, res.shape, output).steady)
        return held

    def _track_preemptions(self, book: _Book, total: float | None) -> None:
        """Predicted mode: halve the overbook allowance when preemptions exceed the budget, else regrow it."""
        if total is None:
            return
        delta = 0.0 if book.last_preemptions is None else max(0.0, total - book.last_preemptions)
        book.last_preemptions = total
        cap = self.settings.max_overbook_frac
        if delta > self.settings.preemption_budget:
            book.overbook /= 2.0
        else:
            book.overbook = min(cap, book.overbook + cap / 4.0)

    def estimate_error(self, worker_id: str) -> float | None:
        """Last (reported − reserved) / total for the worker, None before its first reconcile (a DP worker:
        its engine's furthest from 0)."""
        errors = [b.error_frac for b in self._books_of(worker_id) if b.error_frac is not None]
        return max(errors, key=abs) if errors else None

    def snapshot(self) -> dict[str, dict[str, float | int | None]]:
        """Per worker: total, reserved, shrink, active count, estimate error (for /metrics and /admin); a DP
        worker's engines summed (estimate error: the engine's furthest from 0)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for b in self._books.values():
            row = out.get(b.worker_id)
            if row is None:
                out[b.worker_id] = {
                    "total_units": b.total,
                    "reserved_units": b.reserved,
                    "shrink_units": b.shrink,
                    "active": len(b.active),
                    "estimate_error": b.error_frac,
                    "holds": sum(b.holds.values()),
                }
                continue
            for name, value in (
                ("total_units", b.total), ("reserved_units", b.reserved), ("shrink_units", b.shrink),
                ("active", len(b.active)), ("holds", sum(b.holds.values())),
            ):  # fmt: skip
                row[name] = (row[name] or 0) + value
            err, mine = row["estimate_error"], b.error_frac
            if mine is not None and (err is None or abs(mine) > abs(err)):
                row["estimate_error"] = mine
        return out

    # --- internals -------------------------------------------------------------------------------------
    def _views_of(self, worker: WorkerView) -> tuple[WorkerView, ...]:
        """The views books are kept for: the worker's own, or one per engine of a data-parallel worker (its
        engine's blocks, usage and preemptions; id `<worker>#dp<rank>`), derived once per worker view."""
        dp = self._dp.get(worker.id)
        if dp is not None and dp.view is worker:
            return dp.views
        if len(worker.engines) < 2 or not self.settings.per_engine:
            if dp is not None:  # restarted without data parallelism: the engines' books go
                self._forget_engines(worker.id)
            return (worker,)
        views = tuple(
            replace(
                worker,
                id=f"{worker.id}#dp{e.rank}",
                num_gpu_blocks=e.num_gpu_blocks,
                kv_usage=e.kv_usage,
                preemptions_total=e.preemptions_total,
                engines=(),
            )
            for e in worker.engines
        )
        if dp is not None and tuple(v.id for v in dp.views) != tuple(v.id for v in views):
            for gone in {v.id for v in dp.views} - {v.id for v in views}:  # fewer engines now
                self._forget_book(gone)
        if dp is None:
            # a server first booked as one engine (before its first scrape), or restarted with DP: its single
            # book goes once its reservations end (it was kept for good)
            self._forget_book(worker.id)
        self._dp[worker.id] = _DataParallel(worker, views, tuple(e.rank for e in worker.engines))
        return views

    def _engine_books(self, worker: WorkerView) -> tuple[_Book, ...]:
        """The worker's book, or its engines' (rank order) on a data-parallel worker."""
        if not worker.engines and worker.id not in self._dp:  # one engine: the routing hot path
            return (self._book(worker),)
        views = self._views_of(worker)
        if views[0] is worker:
            return (self._book(worker),)
        ranks = self._dp[worker.id].ranks
        books = tuple(self._book(v) for v in views)
        for book, rank in zip(books, ranks, strict=True):
            book.worker_id, book.engine = worker.id, rank
        return books

    def _books_of(self, worker_id: str) -> list[_Book]:
        """The books kept for a worker id: its own and, for a DP worker, its engines' (lookup only)."""
        found = [self._books[worker_id]] if worker_id in self._books else []
        dp = self._dp.get(worker_id)
        if dp is not None:
            found += [self._books[v.id] for v in dp.views if v.id in self._books]
        return found

    def _book(self, worker: WorkerView) -> _Book:
        book = self._books.get(worker.id)
        if book is None:
            book = self._books[worker.id] = _Book(overbook=self.settings.max_overbook_frac)
            book.book_id = book.worker_id = worker.id
        elif book.view is worker:
            return book
        book.forgotten = False  # seen again (a fresh view): a pending forget no longer applies
        book.view = worker
        key = (
            worker.pool,
            worker.model,
            worker.effective_block_size,
            worker.capacity.max_model_len,
            worker.kv_blocks_total,
        )
        if key != book.key:  # first sight, or a scrape changed the cache config: re-derive the spec
            book.key = key
            book.spec = self.specs.spec_for(worker)
            book.total = worker.kv_blocks_total * book.spec.units_per_block
            s = self.settings
            # vLLM's null block is never reservable, whatever the watermark's rounding (a tiny watermark, or
            # head-page units where it leaves less than one block's worth); a watermark of 0, which the
            # config refuses, is an idealised ledger with nothing kept back (unit tests' arithmetic)
            usable = max(0, book.total - book.spec.units_per_block) if s.watermark > 0 else book.total
            book.usable = usable
            book.unshared = min(book.total * (1.0 - s.watermark), usable)
            book.base_capacity = math.floor(book.unshared * s.share)
            book.lone_capacity = math.floor(usable * s.share)
            book.needs.clear()
        return book
