"""The gateway's live fleet: workers per pool, their scraped stats, health, breaker and in-flight counts.

`Registry.view()` freezes it into the router's `FleetView` (one `WorkerView` per routable worker).

- **Discovery**: each pool has a `Source`; `sync_pool` reconciles its listing (new → added and
  health-checked at once; gone → dropped; terminating → draining; not ready → starting). Sources with a
  `resync_s` are re-listed periodically.
- **Scrape** (`scrape.interval_s`, default 1 s): every worker's `/metrics` concurrently, each with
  `scrape.timeout_s` (not a worker whose breaker is open, unless requests of ours run there); counters become
  per-second rates between scrapes, and a scrape that sees them move marks the engine working (`progress_at`). Stats older than
  `scrape.stale_after_s` are withheld from the view (the router sees None rather than stale numbers).
- **Health** (`health.interval_s`): GET `/health`; `failure_threshold` consecutive failures → unhealthy. A
  `/health` 200 from a worker one of whose engines reports requests running and no step for the pool's
  `stuck_window` counts as a failure (`Registry.stuck`: vLLM's `/health` does not see a hung engine), as
  does one whose engines all show nothing running or waiting and no step for that long while a request of
  ours sent there waits for its first byte (an engine hung in the first step after idle; its probes then ask
  for a 1-token completion: `Registry._takes_a_request`).
  A worker whose breaker is open gets no requests; its next health check after `open_s` is the probe.
  Each health round while a worker is unhealthy calls `on_unhealthy` (the gateway severs its silent
  connections: `server.upstream.ConnectionPool.sever_silent`).
- **LoRA adapters**: after a good health check, at most every `scrape.models_interval_s` (and at once for a
  worker not asked yet), GET `/v1/models` (with the pool's `api_key_env` key: vLLM guards it): the cards
  with a `parent` are the LoRA adapters the worker serves (vLLM's `--lora-modules` and adapters loaded at
  run time). A failed fetch keeps the last list. `adapter_models()` maps each adapter to its base model,
  so a request naming one is routed as that model to the workers listing it (`scheduler.routing.lora`).
- **In-flight accounting**: `track()` returns an `InflightTicket` (dispatch → `first_token()` → `done()`),
  so routing sees new load immediately, without waiting for a scrape. Counts are this process's only.

State in the view: terminating → draining; not ready in discovery or never health-checked → starting;
failed health checks → unhealthy; else ready. The breaker is reported separately (`breaker_open`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from scheduler.fleet import (
    NO_LORA,
    RESOLVING_NO_LORA,
    EngineView,
    FleetView,
    LoraState,
    PoolRef,
    Role,
    WorkerCapacity,
    WorkerState,
    WorkerView,
    configured_engines,
)
from server.breaker import CircuitBreaker
from server.config import HealthConfig, ScrapeConfig
from server.discovery import Endpoint, Source
from server.metrics import GatewayMetrics, WorkerGaugeRow
from server.scrape import WorkerStats, counter_rate, parse_vllm_metrics

log = logging.getLogger("mosaic.registry")
VIEW_AGE_RESOLUTION_S = 0.01  # a cached worker view's scrape_age_s is at most this much behind
PER_EVENT_STREAMS = 32  # streams whose tokens per event a worker's record keeps
# how a failed check's reason begins when an engine was judged stuck (`Registry.stuck`)
STUCK = "engine stuck"


@dataclass(frozen=True, slots=True)
class PoolInfo:
    name: str
    model: str
    gpu: str
    role: Role
    capacity: WorkerCapacity
    domain: str | None = None  # the pool's `domain:`: network domain of workers whose endpoint has none
    lora_resolver: bool = (
        False  # its model's workers load unknown adapters on demand (`models[].lora_resolver`)
    )
    # how long an engine serving a context of n tokens may report running requests and no step
    # before it is judged stuck (`health.stuck_engine_s`, raised to cover such a prefill); None: never judged
    stuck_window: Callable[[int | None], float] | None = field(default=None, compare=False)
    pooling: bool = False  # its workers run vLLM's pooling runner: embeddings, score, rerank; no completions


@dataclass(slots=True)
class WorkerRecord:
    id: str
    url: str
    pool: PoolInfo
    breaker: CircuitBreaker
    discovered_ready: bool = True
    terminating: bool = False
    health_ok: bool | None = None  # None: not checked yet
    # when it last came up (first good check, or the first good one after a failed check): a worker that
    # restarted in between has a new value (the LoRA admin's reconcile tells a restart from an unload by it)
    healthy_since: float | None = None
    health_failures: int = 0
    last_error: str | None = None
    # its server's `system_fingerprint` (JSON-encoded), learned from the usage event the relay drops: vLLM puts
    # it there rather than on the last choice events once usage is asked for (`SseRelay`)
    system_fingerprint: bytes | None = None
    stats: WorkerStats | None = None
    stats_at: float | None = None
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    progress_at: float | None = None  # the last scrape whose token counters had moved: its engine works
    # since when its scrapes show one of its engines with requests running and no step reported since (the
    # longest such stall; None: none), and each stalled engine's (label → since)
    stalled_since: float | None = None
    engine_stalls: dict[str, float] = field(default_factory=dict)
    # since when its scrapes show the same engine marks (gauges and token counters: no engine step since;
    # None before its first scrape), and since when they have also shown every engine idle while a request
    # of ours sent there since then waits for its first byte: an engine hung in the first step after idle,
    # whose gauges froze at zero running (`_untaken_since`; None: not so)
    quiet_since: float | None = None
    untaken_since: float | None = None
    # this gateway's requests sent there with no byte of their answer yet (a stream's first event, a whole
    # answer's end), oldest first: `InflightTicket.answered()` and `done()` remove theirs
    unanswered: dict[InflightTicket, None] = field(default_factory=dict)
    # a failed check of it judged its engine hung while idle: with its requests severed, nothing left shows
    # whether the engine takes requests again, so its probes ask it for a 1-token completion until it answers
    # one (`Registry._takes_a_request`), or until its marks change or a request of ours there is answered
    untaken_stuck: bool = False
    # the gateway's own calls in flight that hold its engine's loop (LoRA loads and unloads run in it, and a
    # Hub download or slow storage makes them long): no stall is judged meanwhile (`engine_call`)
    engine_calls: int = 0
    engine_stuck: bool = False  # its last health check judged its engine stuck (a metric and /admin/workers)
    side_scraping: bool = False  # a scrape of it runs beside the rounds (its breaker is open: `scrape_once`)
    inflight_requests: int = 0
    inflight_prefill_tokens: int = 0
    inflight_decode_requests: int = 0
    dispatched_total: int = 0
    # completion tokens per token event of its recent streams (`Registry.note_stream`): one for vLLM's
    # default, more with speculative decoding or --stream-interval
    per_event: deque[float] = field(default_factory=lambda: deque(maxlen=PER_EVENT_STREAMS))
    domain: str | None = None  # from discovery (Endpoint.domain); the view falls back to the pool's
    # LoRA adapters its /v1/models lists: name → the card's `root` (the adapter's path); when last fetched
    adapters: dict[str, str | None] = field(default_factory=dict)
    adapters_at: float | None = None
    # the context its /v1/models card gives (vLLM's --max-model-len, which its own checks use): routing and
    # the gateway's /v1/models use it over the pool's configured or catalog value
    served_max_model_len: int | None = None
    served_model: str | None = None  # the id of its base model's /v1/models card (the name it serves)
    _capacity: WorkerCapacity | None = field(default=None, repr=False, compare=False)
    # this gateway's requests in flight there per LoRA adapter (`InflightTicket`): demand for its `--max-loras`
    # slots that vLLM's metric shows only once the requests run (queued ones appear in neither label)
    inflight_adapters: dict[str, int] = field(default_factory=dict)
    # its `LoraState` for the stats it was built from (`_lora`): a view is rebuilt per request on a busy
    # worker, the adapters and the scrape change far less often
    _lora_state: tuple[WorkerStats | None, LoraState] | None = field(default=None, repr=False, compare=False)
    _view: WorkerView | None = field(default=None, repr=False, compare=False)
    _view_key: tuple[Any, ...] | None = field(default=None, repr=False, compare=False)

    def state(self) -> WorkerState:
        if self.terminating:
            return WorkerState.DRAINING
        if not self.discovered_ready or self.health_ok is None:
            return WorkerState.STARTING
        return WorkerState.READY if self.health_ok else WorkerState.UNHEALTHY

    def fresh_stats(self, now: float, stale_after_s: float) -> WorkerStats | None:
        if self.stats is None or self.stats_at is None or now - self.stats_at > stale_after_s:
            return None
        return self.stats

    def cached_view(self, now: float, stale_after_s: float) -> WorkerView:
        """`view()`, reused while nothing it shows has changed. Routing takes a view of every worker per
        request, and building one costs ~4 µs (≈ 0.35 ms per request at 100 workers); a request changes the
        in-flight counts of one or two. `scrape_age_s` is refreshed every `VIEW_AGE_RESOLUTION_S`."""
        state = self.state()
        breaker_open = self.breaker.is_open(now)
        stats_at = self.stats_at
        fresh = stats_at is not None and self.stats is not None and now - stats_at <= stale_after_s
        key = (
            state, breaker_open, self.inflight_requests, self.inflight_prefill_tokens,
            self.inflight_decode_requests, (id(self.stats), stats_at) if fresh else None,
            self.generation_tokens_per_s, self.prompt_tokens_per_s,
            int((now - stats_at) / VIEW_AGE_RESOLUTION_S) if fresh and stats_at is not None else None,
        )  # fmt: skip
        if key != self._view_key or self._view is None:
            self._view = self._build_view(now, stale_after_s, state, breaker_open)
            self._view_key = key
        return self._view

    def view(self, now: float, stale_after_s: float) -> WorkerView:
        return self._build_view(now, stale_after_s, self.state(), self.breaker.is_open(now))

    def _build_view(
        self, now: float, stale_after_s: float, state: WorkerState, breaker_open: bool
    ) -> WorkerView:
        s = self.fresh_stats(now, stale_after_s)
        # The cache config (num_gpu_blocks, block_size) is the engine's for its life: the last scrape's holds
        # when it goes stale. Dropped with the load, the KV ledger fell back to the perf model's guess of the
        # blocks — a scrape failing for stale_after_s could over-commit a worker the guess overstates.
        last = self.stats
        p = self.pool
        # Positional, in `VIEW_FIELD_ORDER`.
        return new_worker_view(
            self.id,
            self.url,
            p.name,
            p.model,
            p.gpu,
            p.role,
            state,
            breaker_open,
            self.capacity,
            s.num_running if s else None,
            s.num_waiting if s else None,
            s.kv_usage if s else None,
            last.num_gpu_blocks if last else None,
            last.block_size if last else None,
            self.generation_tokens_per_s if s else None,
            self.prompt_tokens_per_s if s else None,
            s.preemptions_total if s else None,
            (now - self.stats_at) if s and self.stats_at is not None else None,
            self.inflight_requests,
            self.inflight_prefill_tokens,
            self.inflight_decode_requests,
            self.domain or p.domain,
            _engines(last, fresh=s is not None, capacity=self.capacity),
            self._lora(s),
        )

    @property
    def capacity(self) -> WorkerCapacity:
        """The pool's capacity, with the context limit the worker itself serves when its card gives one."""
        served, configured = self.served_max_model_len, self.pool.capacity
        if served is None or served == configured.max_model_len:
            return configured
        if self._capacity is None or self._capacity.max_model_len != served:
            self._capacity = dataclasses.replace(configured, max_model_len=served)
        return self._capacity

    def _lora(self, s: WorkerStats | None) -> LoraState:
        """Its adapters, with their load from a fresh scrape (None fields when stale or not exposed) and this
        gateway's adapters in flight there; built once per scrape, adapter list and set of adapters in flight
        (a new list or set drops it: `Registry.refresh_adapters`, `InflightTicket`)."""
        cached = self._lora_state
        if cached is not None and cached[0] is s:
            return cached[1]
        resolves = self.pool.lora_resolver
        pending = frozenset(self.inflight_adapters)
        if not self.adapters and not pending and (s is None or s.lora_running is None):
            state = RESOLVING_NO_LORA if resolves else NO_LORA
        elif s is None:
            state = LoraState(frozenset(self.adapters), resolves=resolves, pending=pending)
        else:
            state = LoraState(
                frozenset(self.adapters), s.lora_running, s.lora_waiting, s.max_lora, resolves, pending
            )
        self._lora_state = (s, state)
        return state


def _engines(last: WorkerStats | None, fresh: bool, capacity: WorkerCapacity) -> tuple[EngineView, ...]:
    """A data-parallel worker's engines: the pool's configured ones (`dp`) until a scrape shows the server's
    cache config, then the scrape's, which win (a server started with another `--data-parallel-size` is
    booked as it runs). Their cache config outlives a stale scrape (as `num_gpu_blocks` does), their usage
    and preemptions do not."""
    if last is None or last.num_gpu_blocks is None:
        return configured_engines(capacity)
    if not last.engine_views:
        return ()
    if fresh:
        return last.engine_views
    return tuple(EngineView(e.rank, e.num_gpu_blocks) for e in last.engine_views)


# The order `WorkerRecord._build_view` passes a view's fields in.
VIEW_FIELD_ORDER = (
    "id", "url", "pool", "model", "gpu", "role", "state", "breaker_open", "capacity", "num_running",
    "num_waiting", "kv_usage", "num_gpu_blocks", "block_size", "generation_tokens_per_s", "prompt_tokens_per_s",
    "preemptions_total", "scrape_age_s", "inflight_requests", "inflight_prefill_tokens",
    "inflight_decode_requests", "domain", "engines", "lora",
)  # fmt: skip
_VIEW_SETTERS = tuple(
    getattr(WorkerView, name).__set__ for name in VIEW_FIELD_ORDER
)  # the slots' descriptors
# Slot filling is only equivalent to the constructor while the fields are exactly these and nothing validates.
_FAST_VIEWS = tuple(f.name for f in dataclasses.fields(WorkerView)) == VIEW_FIELD_ORDER and not hasattr(
    WorkerView, "__post_init__"
)


def new_worker_view(*values: Any) -> WorkerView:
    """`WorkerView(**dict(zip(VIEW_FIELD_ORDER, values)))` at half the cost: a frozen dataclass's `__init__`
    calls `object.__setattr__` per field (22 of them: ≈ 2.5 µs per view, and routing needs a new view of
    a worker after each change of its in-flight counts); this fills the slots through their descriptors
    (≈ 1.1 µs). Equal to the constructor's result (`tests/gateway/test_hot_path.py`); the constructor is
    used instead if `WorkerView`'s fields ever differ from `VIEW_FIELD_ORDER` or it gains a `__post_init__`."""
    if not _FAST_VIEWS:
        return WorkerView(**dict(zip(VIEW_FIELD_ORDER, values, strict=True)))
    view = object.__new__(WorkerView)
    for set_slot, value in zip(_VIEW_SETTERS, values, strict=True):
        set_slot(view, value)
    return view


class FirstTokenHook(Protocol):
    def first_token(self) -> None: ...


class SlotLike(Protocol):
    """`server.upstream.SlotWait`: whether a post still waits for a connection slot (not sent yet)."""

    waiting: bool


class InflightTicket:
    """One request's load on one worker. `first_token()` moves its prompt out of the prefill backlog;
    `done()` removes it entirely. Both are idempotent; `done()` implies the first. Apart from them,
    `answered()` says a byte of its answer came (a stream's first event): until then, or `done()`, it is
    one of the worker's `unanswered` requests, which the stuck-engine check reads (`sent_at`, and `slot`:
    one still waiting for a connection was not sent yet)."""

    __slots__ = ("__weakref__", "_done", "_first", "adapter", "prompt_tokens", "record", "sent_at", "slot")

    def __init__(
        self,
        record: WorkerRecord,
        prompt_tokens: int,
        prefilled_remotely: bool,
        adapter: str | None = None,
        sent_at: float = 0.0,
        slot: SlotLike | None = None,
    ) -> None:
        self.record = record
        self.prompt_tokens = prompt_tokens if not prefilled_remotely else 0
        self._first = prefilled_remotely
        self._done = False
        self.adapter = adapter
        self.sent_at = sent_at
        self.slot = slot
        record.unanswered[self] = None
        if adapter is not None:
            held = record.inflight_adapters.get(adapter, 0)
            record.inflight_adapters[adapter] = held + 1
            if not held:  # a new adapter in flight there: its LoRA state changes
                record._lora_state = None
        record.inflight_requests += 1
        record.dispatched_total += 1
        record.inflight_prefill_tokens += self.prompt_tokens
        if self._first:
            record.inflight_decode_requests += 1

    def first_token(self) -> None:
        if self._first or self._done:
            return
        self._first = True
        self.record.inflight_prefill_tokens -= self.prompt_tokens
        self.record.inflight_decode_requests += 1

    def answered(self) -> None:
        """A byte of its answer came: the worker's engine took it (and so steps; an untaken stall ends)."""
        record = self.record
        if record.unanswered.pop(self, 0) is None and record.untaken_since is not None:
            record.untaken_since = None
            record.stalled_since = min(record.engine_stalls.values(), default=None)
        record.untaken_stuck = False

    def done(self) -> None:
        if self._done:
            return
        self.record.unanswered.pop(self, None)
        if not self._first:
            self.record.inflight_prefill_tokens -= self.prompt_tokens
        else:
            self.record.inflight_decode_requests -= 1
        self._done = True
        self.record.inflight_requests -= 1
        if self.adapter is not None:
            held = self.record.inflight_adapters
            left = held[self.adapter] - 1
            if left:
                held[self.adapter] = left
            else:  # its last request there ended
                del held[self.adapter]
                self.record._lora_state = None


@dataclass(slots=True)
class _Pool:
    info: PoolInfo
    source: Source
    task: asyncio.Task[None] | None = None
    ids: set[str] = field(default_factory=set)


class Registry:
    """Workers of every pool, kept fresh by background loops started with `start()`."""

    def __init__(
        self,
        scrape: ScrapeConfig,
        health: HealthConfig,
        metrics: GatewayMetrics,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        auth: dict[str, tuple[bytes, bytes]] | None = None,
    ) -> None:
        self._scrape_cfg = scrape
        # pool → the Authorization header its workers expect (`server.dispatch.worker_auth_headers`): vLLM's
        # --api-key guards /v1/models (not /health or /metrics)
        self._auth = {
            pool: (k.decode("latin-1"), v.decode("latin-1")) for pool, (k, v) in (auth or {}).items()
        }
        self._adapter_models: dict[str, str] | None = None  # `adapter_models()`, rebuilt when adapters change
        self._health_cfg = health
        self._metrics = metrics
        self._clock = clock
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=64))
        self._pools: dict[str, _Pool] = {}
        self._pool_refs: tuple[PoolRef, ...] = ()  # the view's configured pools (empty ones hold requests)
        self._workers: dict[str, WorkerRecord] = {}
        # Workers dropped from a listing with requests still running on them: one listed again under the
        # same id and URL is the same server (a slice rewritten, a partial listing) and gets its record back
        self._departed: dict[str, WorkerRecord] = {}
        # (when, seq, ticket or lease): prefills estimated over then (non-streaming requests, whose first
        # token the gateway never sees); retired lazily by `view()`, so no timer per request
        # Held weakly: a request that ended before its estimate leaves nothing to do, and its lease
        # (decision, reservations, request) is not kept alive until the next view.
        self._prefill_ends: list[tuple[float, int, weakref.ReferenceType[FirstTokenHook]]] = []
        self._prefill_seq = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self.on_refresh: list[Callable[[], None]] = []  # called after each scrape round (admission wake-up)
        # called (as a task) after each good `/v1/models` read of a health check: the run-time adapters'
        # reconcile (`server.lora_admin`), which loads on a worker what it should serve and lacks
        self.on_adapters: Callable[[WorkerRecord], Awaitable[None]] | None = None
        # called at each health round while a worker is unhealthy (its failed check included): the gateway
        # closes the connections to it that have been silent since about when its checks began failing
        self.on_unhealthy: Callable[[WorkerRecord], None] | None = None
        # called with the model when a worker's /v1/models gives a context limit it had not given before
        self.on_context: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ pools and discovery
    def add_pool(self, info: PoolInfo, source: Source, waited_for: bool = True) -> None:
        """`waited_for=False` (nothing can add a worker to the pool: `max_replicas: 0`, `gateway.stays_empty`):
        a request only it could serve is refused at once rather than held for it (`PoolRef.waited_for`)."""
        self._pools[info.name] = _Pool(info, source)
        ref = PoolRef(info.name, info.model, info.role, info.capacity.max_model_len, waited_for)
        self._pool_refs = (*self._pool_refs, ref)

    async def start(self) -> None:
        """Start sources, list them once, health-check everything, then run the background loops."""
        for pool in self._pools.values():
            await pool.source.start()
        await asyncio.gather(*(self.resync(name) for name in self._pools))
        await self.health_once()
        await self.scrape_once()
        self._loops.append(asyncio.create_task(self._every(self._scrape_cfg.interval_s, self.scrape_once)))
        self._loops.append(asyncio.create_task(self._every(self._health_cfg.interval_s, self.health_once)))
        for name, pool in self._pools.items():
            if pool.source.resync_s:
                pool.task = asyncio.create_task(
                    self._every(pool.source.resync_s, lambda n=name: self.resync(n))
                )

    async def stop(self) -> None:
        tasks = [*self._loops, *self._tasks, *(p.task for p in self._pools.values() if p.task)]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for pool in self._pools.values():
            with contextlib.suppress(Exception):
                await pool.source.stop()
        if self._own_client:
            await self._client.aclose()

    async def resync(self, pool_name: str) -> None:
        pool = self._pools[pool_name]
        try:
            endpoints = await pool.source.list()
        except Exception as exc:  # keep the last good listing: a flaky API server must not empty the pool
            log.warning("discovery for pool %s failed: %s", pool_name, exc)
            return
        self.sync_pool(pool_name, endpoints)

    def sync_pool(self, pool_name: str, endpoints: Iterable[Endpoint]) -> None:
        pool = self._pools[pool_name]
        seen: set[str] = set()
        for ep in endpoints:
            wid = f"{pool_name}/{ep.name}"
            seen.add(wid)
            rec = self._workers.get(wid)
            if rec is None and (back := self._departed.pop(wid, None)) is not None and back.url == ep.url:
                rec = self._workers[wid] = back  # in-flight counts, breaker, last scrape, adapters carry on
                if back.adapters:
                    self._adapter_models = None
            if rec is None or rec.url != ep.url:
                cfg = self._health_cfg
                rec = WorkerRecord(wid, ep.url, pool.info, CircuitBreaker(cfg.failure_threshold, cfg.open_s))
                self._workers[wid] = rec
                self._spawn(self._check(rec))
            rec.discovered_ready = ep.ready
            rec.terminating = ep.terminating
            if rec.domain != ep.domain:  # not in the cached view's key: drop the cached view instead
                rec.domain, rec._view = ep.domain, None
        for wid in pool.ids - seen:
            # in-flight tickets keep their record object; counts stay right
            gone = self._workers.pop(wid, None)
            if gone is not None and gone.adapters:
                self._adapter_models = None
            if gone is not None and gone.inflight_requests > 0:
                self._departed[wid] = gone
            else:
                self._metrics.forget_worker(wid)
        for wid in [w for w, r in self._departed.items() if r.inflight_requests <= 0 or w in seen]:
            del self._departed[wid]  # nothing left running there (or listed anew under another URL)
            if wid not in seen:
                self._metrics.forget_worker(wid)
        pool.ids = seen

    # ------------------------------------------------------------------ the view
    def view(self) -> FleetView:
        now = self._clock()
        ends = self._prefill_ends
        while ends and ends[0][0] <= now:
            hook = heapq.heappop(ends)[2]()
            if hook is not None:
                hook.first_token()  # a no-op for a ticket already done or a lease already released
        stale = self._scrape_cfg.stale_after_s
        return FleetView(
            tuple(rec.cached_view(now, stale) for rec in self._workers.values()), self._pool_refs
        )

    def records(self) -> list[WorkerRecord]:
        return list(self._workers.values())

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def models(self) -> list[str]:
        """Models of every configured pool (served or not yet), in config order."""
        return list(dict.fromkeys(p.info.model for p in self._pools.values()))

    def pools(self) -> list[PoolInfo]:
        return [p.info for p in self._pools.values()]

    def track(
        self,
        worker_id: str,
        prompt_tokens: int,
        prefilled_remotely: bool = False,
        adapter: str | None = None,
        slot: SlotLike | None = None,
    ) -> InflightTicket:
        """A request about to be sent to the worker (`slot`: the post's `SlotWait`, if it may queue for a
        connection first). KeyError when the worker left the fleet since routing."""
        rec = self._workers.get(worker_id)
        if rec is None:  # removed between routing and dispatch: account on a detached record
            raise KeyError(worker_id)
        return InflightTicket(rec, prompt_tokens, prefilled_remotely, adapter, self._clock(), slot)

    def prefill_ends_in(self, ticket: FirstTokenHook, seconds: float) -> None:
        """`ticket.first_token()` runs `seconds` from now (at the first `view()` after, i.e. before the next
        routing decision reads the fleet): for requests whose first token is not observed (non-streaming
        answers come whole). An `InflightTicket` (its prompt leaves the prefill backlog) or a whole
        `server.failure.Lease` (its tickets and its KV reservations' first-token hooks too)."""
        self._prefill_seq += 1
        heapq.heappush(self._prefill_ends, (self._clock() + seconds, self._prefill_seq, weakref.ref(ticket)))

    def tokens_per_event(self, worker_id: str) -> float:
        """Completion tokens per streamed token event on the worker: the largest of its last
        `PER_EVENT_STREAMS` streams (an upper bound, as KV accounting needs), 1 before any."""
        rec = self._workers.get(worker_id)
        return max(rec.per_event, default=1.0) if rec is not None else 1.0

    def note_stream(self, worker_id: str, events: int, tokens: int) -> None:
        """A stream ended on the worker with `tokens` completion tokens (its usage) in `events` token events."""
        rec = self._workers.get(worker_id)
        if rec is not None and events > 0 and tokens > 0:
            rec.per_event.append(max(1.0, tokens / events))

    # ------------------------------------------------------------------ passive health
    def report_success(self, worker_id: str) -> None:
        """A request to the worker succeeded (or was judged by it, a 4xx): its breaker's count, probation and
        backoff end. An open breaker is left to its probe (a request dispatched before it opened)."""
        rec = self._workers.get(worker_id)
        if rec is not None and rec.breaker.opened_at is None:
            rec.breaker.record_success()

    def report_first_byte(self, worker_id: str) -> None:
        """A stream from the worker began (`CircuitBreaker.record_first_byte`); its success is told at its end."""
        rec = self._workers.get(worker_id)
        if rec is not None and rec.breaker.opened_at is None:
            rec.breaker.record_first_byte()

    def report_failure(self, worker_id: str, kind: str, hard: bool = False) -> None:
        """A request to the worker failed (`kind`: connect, timeout, status_5xx...); `hard` ejects at once."""
        rec = self._workers.get(worker_id)
        if rec is None:
            if worker_id in self._departed:  # still running requests: its series stays until they end
                self._metrics.upstream_errors.labels(worker_id, kind).inc()
            return  # gone (its series were forgotten): a late failure must not bring one back
        self._metrics.upstream_errors.labels(worker_id, kind).inc()
        rec.last_error = kind
        if self._record_failure(rec, self._clock(), kind, hard=hard, stream=kind.startswith("stream_")):
            log.warning("worker %s ejected (circuit breaker open) after %s", worker_id, kind)

    def _record_failure(
        self,
        rec: WorkerRecord,
        now: float,
        why: str,
        hard: bool = False,
        stream: bool = False,
        check: bool = False,
    ) -> bool:
        """`rec.breaker.record_failure` under the ejection limit; a failure it holds back is counted
        (`mosaic_breaker_ejections_overflow_total`) and logged at the first of a streak. True: it opened."""
        breaker = rec.breaker
        overflows, held = breaker.overflows, breaker.held_back

        def may_open() -> bool:  # the peers are scanned only for a failure that would open the breaker
            out, _, limit = self._ejection_room(rec, now)
            return out < limit

        opened = breaker.record_failure(now, hard=hard, stream=stream, check=check, may_open=may_open)
        if breaker.overflows > overflows:
            self._metrics.ejections_overflow.labels(rec.id).inc()
            if not held:
                out, peers, _ = self._ejection_room(rec, now)
                log.warning(
                    "worker %s not ejected after %s: %d of the %d workers serving %s as %s are out already "
                    "(health.max_ejection_percent: %s)",
                    rec.id, why, out, peers, rec.pool.model, rec.pool.role.value,
                    f"{self._health_cfg.max_ejection_percent:g}",
                )  # fmt: skip
        return opened

    def _ejection_room(self, rec: WorkerRecord, now: float) -> tuple[int, int, int]:
        """(out, peers, limit): of `rec`'s peers — the workers serving its model in its role that were checked
        and are not leaving, itself included — those out of rotation besides itself (failing their health
        checks, or their breaker open), how many there are, and how many may be out at once
        (`health.max_ejection_percent` of them, at least one). Failures may open `rec`'s breaker while out <
        limit. A worker failing its checks counts as out: a model whose other worker restarts is not left
        without its last one. `rec` itself not passing its checks, or leaving, is no peer: (0, 0, 1)."""
        if rec.health_ok is not True or rec.terminating:
            return 0, 0, 1
        model, role = rec.pool.model, rec.pool.role
        peers = [
            r
            for r in self._workers.values()
            if r.pool.model == model
            and r.pool.role == role
            and r.health_ok is not None
            and r.discovered_ready
            and not r.terminating
        ]
        limit = max(1, math.floor(self._health_cfg.max_ejection_percent * len(peers) / 100 + 1e-9))
        out = sum(1 for r in peers if r is not rec and (r.health_ok is False or r.breaker.is_open(now)))
        return out, len(peers), limit

    # ------------------------------------------------------------------ loops
    async def _every(self, interval_s: float, fn: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await fn()
            except Exception:  # a loop must survive anything one round throws
                log.exception("background round failed")

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop yet (sync_pool before start): start() health-checks everything
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def health_once(self) -> None:
        await asyncio.gather(*(self._check(rec) for rec in list(self._workers.values())))

    async def _check(self, rec: WorkerRecord) -> None:
        now = self._clock()
        probing = rec.breaker.is_open(now)
        if probing and not rec.breaker.probe_due(now):
            if rec.health_ok is False and self.on_unhealthy is not None:
                self.on_unhealthy(rec)  # no probe this round; its requests still wait on it
            return
        ok, hard, why = await self._get_health(rec.url)
        if ok and (rec.stalled_since is not None or (probing and rec.untaken_stuck)):
            if probing:  # an open breaker's worker is not scraped without our requests there: look again now
                await self._scrape(rec)
            # a probe needs fresh evidence that the engine steps again: unreadable /metrics is none
            stuck = self.stuck(rec, self._clock(), stale_is_stuck=probing)
            if stuck is not None and not await self._paused(rec):
                ok, why = False, stuck  # /health 200 from an API server whose engine is hung: a failed check
                if rec.untaken_since is not None and rec.stalled_since == rec.untaken_since:
                    rec.untaken_stuck = True
        if ok and probing and rec.untaken_stuck and not await self._paused(rec):
            ok, why = await self._takes_a_request(rec)
        rec.engine_stuck = not ok and why.startswith(STUCK)
        now = self._clock()
        if probing:
            rec.breaker.record_probe(ok, now, hard=hard)
        elif ok:
            rec.breaker.record_check_ok()
        if ok:
            if rec.health_ok is not True or rec.health_failures:  # first up, or back after a failed check
                rec.healthy_since = now
            if rec.health_ok is False:
                log.info("worker %s is healthy again", rec.id)
            rec.health_ok = True
            rec.health_failures = 0
            due = rec.adapters_at is None or now - rec.adapters_at >= self._scrape_cfg.models_interval_s
            if (
                due
                and await self.refresh_adapters(rec)
                and self.on_adapters is not None
                and not rec.terminating
            ):
                self._spawn(self.on_adapters(rec))  # a load can take minutes: not in the health round
            return
        rec.last_error = why
        rec.health_failures += 1
        if rec.health_failures >= self._health_cfg.failure_threshold or rec.health_ok is None:
            if rec.health_ok is True:  # once per spell; a worker not up yet (starting, loading) only at INFO
                log.warning("worker %s is unhealthy: %s (%d failed checks)", rec.id, why, rec.health_failures)
            elif rec.health_ok is None:
                log.info("worker %s is not healthy yet: %s", rec.id, why)
            rec.health_ok = False
        if not probing:
            self._record_failure(rec, now, why, hard=hard, check=True)
        if rec.health_ok is False and self.on_unhealthy is not None:
            self.on_unhealthy(rec)

    @property
    def client(self) -> httpx.AsyncClient:
        """The client of health checks, scrapes and `/v1/models` reads (the LoRA admin's calls too)."""
        return self._client

    def auth_header(self, pool: str) -> tuple[str, str] | None:
        """The Authorization header the pool's workers expect (its `api_key_env`), or None."""
        return self._auth.get(pool)

    async def refresh_adapters(self, rec: WorkerRecord) -> bool:
        """Its LoRA adapters from `/v1/models` (module docstring); False, and the last list kept, when that
        fails."""
        auth = self._auth.get(rec.pool.name)
        asked_at, rec.adapters_at = rec.adapters_at, self._clock()  # a concurrent check does not ask again
        try:
            resp = await self._client.get(
                rec.url + "/v1/models",
                headers=dict([auth]) if auth else None,
                timeout=self._scrape_cfg.timeout_s,
            )
            resp.raise_for_status()
            cards = resp.json()["data"]
            adapters = {
                c["id"]: c.get("root") for c in cards if isinstance(c, dict) and c.get("parent") is not None
            }
            if not all(isinstance(name, str) for name in adapters):
                raise ValueError("a card's id is not a string")
            served = _served_context(cards)
            rec.served_model = next(
                (c["id"] for c in cards if isinstance(c, dict) and c.get("parent") is None), rec.served_model
            )
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            rec.last_error = f"models: {type(exc).__name__}"
            rec.adapters_at = asked_at  # asked again at the next good health check
            return False
        if served is not None and served != rec.served_max_model_len:
            configured = rec.pool.capacity.max_model_len
            if served != configured:
                log.info(
                    "worker %s serves max_model_len %d (its pool's is %s): routing and /v1/models use %d",
                    rec.id,
                    served,
                    configured if configured is not None else "unknown",
                    served,
                )
            rec.served_max_model_len, rec._view = served, None  # the capacity is in the cached view
            if self.on_context is not None:
                self.on_context(rec.pool.model)
        if adapters != rec.adapters:
            if rec.adapters or adapters:
                log.info("worker %s serves LoRA adapters: %s", rec.id, ", ".join(sorted(adapters)) or "none")
            # not in the cached view's key: drop the cached view and LoRA state
            rec.adapters, rec._view, rec._lora_state = adapters, None, None
            self._adapter_models = None
        return True

    def served_context(self, model: str) -> int | None:
        """The largest context a worker of `model` serves by its own /v1/models card; None when none gave one."""
        served = [
            r.served_max_model_len
            for r in self._workers.values()
            if r.pool.model == model and r.served_max_model_len is not None
        ]
        return max(served) if served else None

    def adapter_models(self) -> dict[str, str]:
        """Each LoRA adapter some worker lists → the model of that worker's pool. An adapter name listed under
        two models maps to the first in sorted order (a name is one adapter to a client)."""
        if self._adapter_models is None:
            index: dict[str, str] = {}
            models = set(self.models())  # a configured model's name is that model, never an adapter
            for rec in sorted(self._workers.values(), key=lambda r: r.pool.model):
                for name in rec.adapters:
                    if name not in models:
                        index.setdefault(name, rec.pool.model)
            self._adapter_models = index
        return self._adapter_models

    def adapter_cards(self) -> dict[str, tuple[str, str | None]]:
        """Each adapter → (its base model, its `root` as a worker listed it), for the gateway's /v1/models."""
        roots: dict[str, str | None] = {}
        for rec in self._workers.values():
            for name, root in rec.adapters.items():
                roots.setdefault(name, root)
        return {name: (model, roots.get(name)) for name, model in self.adapter_models().items()}

    async def _get_health(self, url: str) -> tuple[bool, bool, str]:
        try:
            resp = await self._client.get(url + "/health", timeout=self._health_cfg.timeout_s)
        except httpx.ConnectError:
            return False, True, "health: connect"
        except httpx.HTTPError as exc:
            return False, False, f"health: {type(exc).__name__}"
        return resp.status_code == 200, False, f"health: status {resp.status_code}"

    async def scrape_once(self) -> None:
        now = self._clock()
        targets = []
        for rec in self._workers.values():
            if not rec.breaker.is_open(now):
                targets.append(rec)
            elif rec.inflight_requests > 0 and not rec.side_scraping:
                # requests of ours still run on a worker whose breaker is open: whether its token counters
                # move decides whether the gateway cuts them (`progress_at`, `on_unhealthy`). Scraped beside
                # the round, not in it: a hung worker's scrape must not hold every other worker's stats back
                rec.side_scraping = True
                self._spawn(self._side_scrape(rec))
        await asyncio.gather(*(self._scrape(rec) for rec in targets))
        for cb in self.on_refresh:
            cb()

    async def _side_scrape(self, rec: WorkerRecord) -> None:
        try:
            await self._scrape(rec)
        finally:
            rec.side_scraping = False

    async def _scrape(self, rec: WorkerRecord) -> None:
        try:
            resp = await self._client.get(rec.url + "/metrics", timeout=self._scrape_cfg.timeout_s)
            resp.raise_for_status()
            stats = parse_vllm_metrics(resp.text)
        except (httpx.HTTPError, ValueError) as exc:  # one bad worker never ends the round
            if self._workers.get(rec.id) is rec or self._departed.get(rec.id) is rec:  # not left meanwhile
                self._metrics.scrape_errors.labels(rec.id).inc()
            rec.last_error = f"scrape: {type(exc).__name__}"
            return
        now = self._clock()
        prev, prev_at = rec.stats, rec.stats_at
        if prev is not None and prev_at is not None:
            dt = now - prev_at
            rec.prompt_tokens_per_s = counter_rate(prev.prompt_tokens_total, stats.prompt_tokens_total, dt)
            rec.generation_tokens_per_s = counter_rate(
                prev.generation_tokens_total, stats.generation_tokens_total, dt
            )
            if (rec.generation_tokens_per_s or 0) > 0 or (rec.prompt_tokens_per_s or 0) > 0:
                rec.progress_at = now
        rec.engine_stalls = _engine_stalls(rec.engine_stalls, prev, stats, now)
        if prev is None or stats.engine_marks != prev.engine_marks:
            rec.quiet_since = now
            if prev is not None:
                rec.untaken_stuck = False  # it stepped (for someone): it takes requests
        rec.untaken_since = _untaken_since(rec, stats, now)
        rec.stalled_since = min(
            (*rec.engine_stalls.values(), *(() if rec.untaken_since is None else (rec.untaken_since,))),
            default=None,
        )
        rec.stats, rec.stats_at = stats, now

    def stuck(self, rec: WorkerRecord, now: float, stale_is_stuck: bool = False) -> str | None:
        """Why the worker's engine is judged stuck, or None. vLLM's `/health` asks only whether the engine
        process died, so an engine hung in a step (a collective that never returns, a deadlock) answers
        200 while its API server stays up. Its `/metrics` shows it: every engine step sends the scheduler's
        stats, which the API server records (the gauges) with the step's tokens (the counters), so a hung
        engine's gauges freeze where its last step left them and its counters stop. Stuck: fresh stats
        with `vllm:num_requests_running` above zero, and neither a token counter nor a scheduler gauge
        changed for the pool's `stuck_window` (raised to cover the longest prefill of the context the worker
        serves: a step that prefills a whole prompt reports only at its end). Never while an engine call of
        ours runs there (`engine_call`). `stale_is_stuck` (a probe): stats that could not be read again are
        no sign that it steps again."""
        since, window = rec.stalled_since, rec.pool.stuck_window
        if since is None or window is None or rec.engine_calls:
            return None
        if now - since < window(rec.served_max_model_len or rec.pool.capacity.max_model_len):
            return None
        if since == rec.untaken_since:  # every engine idle, and none took what was sent (`_untaken_since`)
            what, where = "none running or waiting, request(s) sent there not taken up,", ""
        else:
            label = min(rec.engine_stalls, key=rec.engine_stalls.__getitem__)
            marks = rec.stats.engine_marks if rec.stats is not None else ()
            running = next((round(m.num_running or 0) for m in marks if m.engine == label), None)
            what = f"{running} request(s) running"
            where = f" on engine {label}" if len(marks) > 1 else ""  # a data-parallel server: which one
        if rec.fresh_stats(now, self._scrape_cfg.stale_after_s) is None:
            if not stale_is_stuck:
                return None
            return f"{STUCK}: {what}{where} at the last scrape {now - since:.0f} s ago, none since"
        return f"{STUCK}: {what}{where} and no engine step for {now - since:.0f} s"

    async def _paused(self, rec: WorkerRecord) -> bool:
        """Whether vLLM says its engine is paused or asleep on purpose (`GET /is_paused`, `/is_sleeping`: a
        server in dev mode, as RL frameworks run it to update weights, its requests kept in `keep` mode),
        which stops its steps as a hang does. A hung engine cannot answer them (they ask the engine): a
        time-out, or any other answer, is no."""
        headers = dict([auth]) if (auth := self._auth.get(rec.pool.name)) else None

        async def says(path: str, key: str) -> bool:
            try:
                resp = await self._client.get(
                    rec.url + path, headers=headers, timeout=self._health_cfg.timeout_s
                )
                return resp.status_code == 200 and resp.json().get(key) is True
            except (httpx.HTTPError, ValueError, AttributeError):
                return False

        return any(await asyncio.gather(says("/is_paused", "is_paused"), says("/is_sleeping", "is_sleeping")))

    async def _takes_a_request(self, rec: WorkerRecord) -> tuple[bool, str]:
        """The probe of a worker whose engine was judged hung while idle (`WorkerRecord.untaken_stuck`) and has
        not stepped since: `/health` 200 says nothing of it, and once the requests that showed it were severed
        its gauges and counters say nothing either (a resumed engine whose only requests were aborted before
        it scheduled them reports no step). So the probe asks it for a 1-token completion of its base model
        (on a pooling worker, which serves no completions, the embedding of one word, or a reranker's score
        of one pair when it serves no embeddings, or a classifier's classification of one word), within `health.timeout_s`: answered → it takes requests
        (passed); no answer → still stuck; a 4xx was refused before the engine (a model name or prompt it
        does not take), which shows nothing about the engine and is not held against it (passed, as before
        this probe)."""
        auth = self._auth.get(rec.pool.name)
        timeout = self._health_cfg.timeout_s
        model = rec.served_model or rec.pool.model
        probes = (
            [
                ("/v1/embeddings", {"model": model, "input": "ping"}, "an embedding of one word"),
                # a cross-encoder (a reranker, vLLM's classify task) has no /v1/embeddings: a 404 there
                ("/score", {"model": model, "queries": "ping", "documents": "ping"}, "a score of one pair"),
                # a classifier of several labels has no scoring route either
                ("/classify", {"model": model, "input": "ping"}, "a classification of one word"),
            ]
            if rec.pool.pooling
            else [
                (
                    "/v1/completions",
                    {"model": model, "prompt": "ping", "max_tokens": 1},
                    "a 1-token completion",
                )
            ]
        )
        try:
            for path, body, asked in probes:
                what = asked  # named in the verdict: the last probe sent
                resp = await self._client.post(
                    rec.url + path, json=body, headers=dict([auth]) if auth else None, timeout=timeout
                )
                if resp.status_code != 404:
                    break
        except httpx.TimeoutException:
            return False, f"{STUCK}: {what} sent as its probe had no answer within {timeout:g} s"
        except httpx.HTTPError as exc:
            return False, f"health: probe ({what}): {type(exc).__name__}"
        if resp.status_code >= 500:
            return False, f"health: probe ({what}): status {resp.status_code}"
        if resp.status_code != 200:
            log.info("worker %s refused the probe, %s (%d): passed", rec.id, what, resp.status_code)
        rec.untaken_stuck = False
        return True, ""

    @contextlib.contextmanager
    def engine_call(self, rec: WorkerRecord) -> Iterator[None]:
        """Around a call of ours that holds the worker's engine loop (vLLM runs LoRA loads and unloads in it):
        no stall is judged meanwhile, and the stall it caused is forgotten when it ends."""
        rec.engine_calls += 1
        try:
            yield
        finally:
            rec.engine_calls -= 1
            rec.stalled_since = rec.untaken_since = None
            rec.engine_stalls = {}

    # ------------------------------------------------------------------ reporting
    def gauge_rows(self) -> list[WorkerGaugeRow]:
        now = self._clock()
        return [
            WorkerGaugeRow(
                r.id,
                r.pool.name,
                r.state().value,
                r.inflight_requests,
                r.inflight_prefill_tokens,
                r.breaker.is_open(now),
                (now - r.stats_at) if r.stats_at is not None else None,
                r.pool.capacity.cost_per_hour,
                r.engine_stuck,
            )
            for r in self._workers.values()
        ]

    def describe(self) -> list[dict[str, Any]]:
        """Each worker's identity, state, breaker, parsed stats and in-flight counts (for /admin/workers)."""
        now = self._clock()
        out = []
        for r in self._workers.values():
            v = r.view(now, self._scrape_cfg.stale_after_s)
            stats = r.stats
            out.append(
                {
                    "id": r.id,
                    "url": r.url,
                    "pool": r.pool.name,
                    "model": r.pool.model,
                    "gpu": r.pool.gpu,
                    "role": r.pool.role.value,
                    "state": v.state.value,
                    "domain": v.domain,
                    "breaker": {
                        "state": r.breaker.state(now).value,
                        "trips": r.breaker.trips,
                        "failures": r.breaker.failures,
                        "probation": r.breaker.probation,  # closed by a probe: one failure re-opens it
                        # failures that would have ejected it, held back by health.max_ejection_percent
                        "overflows": r.breaker.overflows,
                    },
                    "last_error": r.last_error,
                    "engine_stuck": r.engine_stuck,  # its last health check judged its engine stuck
                    "lora_adapters": sorted(r.adapters),
                    "lora_inflight": dict(sorted(r.inflight_adapters.items())),
                    "inflight": {
                        "requests": r.inflight_requests,
                        "prefill_tokens": r.inflight_prefill_tokens,
                        "decode_requests": r.inflight_decode_requests,
                        "dispatched_total": r.dispatched_total,
                    },
                    "scrape_age_s": None if r.stats_at is None else round(now - r.stats_at, 3),
                    "stale": stats is not None and v.scrape_age_s is None,
                    "stats": None
                    if stats is None
                    else {
                        **{k: getattr(stats, k) for k in stats.__slots__},  # type: ignore[attr-defined]
                        "engine_views": [dataclasses.asdict(e) for e in stats.engine_views],
                        "engine_marks": [dataclasses.asdict(m) for m in stats.engine_marks],
                        **{  # frozensets → sorted lists (JSON)
                            k: None if getattr(stats, k) is None else sorted(getattr(stats, k))
                            for k in ("lora_running", "lora_waiting")
                        },
                        "prompt_tokens_per_s": r.prompt_tokens_per_s,
                        "generation_tokens_per_s": r.generation_tokens_per_s,
                        "mean_itl_s": stats.mean_itl_s,
                        "mean_ttft_s": stats.mean_ttft_s,
                    },
                    "capacity": {k: getattr(r.pool.capacity, k) for k in r.pool.capacity.__slots__},  # type: ignore[attr-defined]
                }
            )
        return out


def _served_context(cards: list[Any]) -> int | None:
    """The `max_model_len` of the base model's card (vLLM's /v1/models: the card without a `parent`), if it
    gives a positive integer."""
    for c in cards:
        if isinstance(c, dict) and c.get("parent") is None:
            value = c.get("max_model_len")
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _untaken_since(rec: WorkerRecord, stats: WorkerStats, now: float) -> float | None:
    """`WorkerRecord.untaken_since` after a scrape (`stats`, at `now`; `rec.quiet_since` already updated):
    when, since a scrape whose marks still stand, every engine shows nothing running or waiting and a request
    of ours was sent there that has had no byte of its answer. A vLLM engine hung in the first step after it
    was idle (a collective that never returns, a GPU fault) leaves its gauges at zero, where its last step
    left them, so `_engine_stalls` (requests running, no step) cannot see it; what shows it is that requests
    go in and nothing moves: a healthy engine takes a request up within a step (it shows as running or
    waiting, or its prompt is counted). Keeps the stall's start while it lasts; ends when the marks change
    or the requests that showed it end (severed, cancelled) or are answered. Token counters the worker does
    not export give no evidence. A request still waiting for a connection slot was not sent: not evidence."""
    since = rec.quiet_since
    marks = stats.engine_marks
    if since is None or since >= now or not marks:
        return None  # the marks changed at this scrape (or there is nothing to compare)
    if any(m.num_running is None or m.num_running > 0 or (m.num_waiting or 0) > 0 for m in marks):
        return None
    if all(m.prompt_tokens_total is None and m.generation_tokens_total is None for m in marks):
        return None
    for ticket in rec.unanswered:  # oldest first
        if ticket.sent_at >= since and (ticket.slot is None or not ticket.slot.waiting):
            return now if rec.untaken_since is None else rec.untaken_since
    return None


def _engine_stalls(
    stalls: dict[str, float], prev: WorkerStats | None, stats: WorkerStats, now: float
) -> dict[str, float]:
    """`WorkerRecord.engine_stalls` after a scrape: an engine (its `engine` label; one per data-parallel rank)
    with requests running that reported no step since the scrape before keeps its stall's start (now when
    it begins); any other has none. A step shows as a token counter that moved or a gauge that changed
    (requests running or waiting, KV usage: a chunk of a long prefill allocates blocks before its prompt is
    counted). Token counters the worker does not export (not a vLLM, or `--disable-log-stats`) or a first
    scrape (nothing to compare) give no evidence. Engines apart: one hung rank of a data-parallel server
    whose other ranks work is seen."""
    if prev is None:
        return {}
    before = {m.engine: m for m in prev.engine_marks}
    stalled = {}
    for marks in stats.engine_marks:
        was = before.get(marks.engine)
        if was is None or not marks.num_running:
            continue
        if marks.prompt_tokens_total is None and marks.generation_tokens_total is None:
            continue  # no token counters: no evidence
        if marks != was:  # a counter moved (or reset: a restarted server) or a gauge changed: it stepped
            continue
        stalled[marks.engine] = stalls.get(marks.engine, now)
    return stalled
