"""Discrete-event cluster simulator: a trace through the real router, KV ledger and autoscaler.

"One policy, two drivers" (DESIGN.md): the `Router` (`scheduler/routing`), the optional `KvLedger`
(`scheduler/kv`) and any `ScalingPolicy` (`scheduler/autoscaler`) run here exactly as in the gateway, driven
by simulated time and the engine model's state instead of wall-clock time and scraped `/metrics`.

Events, ordered by (time, priority, sequence) so a seeded run replays exactly:
- STEP: an engine's step ends (its tokens, first tokens and finishes take effect) and the next one
  starts; an engine only has a STEP pending while it has work.
- READY: a starting instance finished its cold start.
- ARRIVAL: a trace request is routed (or queued in the admission queue, or failed).
- SCRAPE: the router's scraped view of each instance (running, waiting, KV usage) is refreshed.
- DECIDE: the autoscaler sees one `Observation` (measured as the gateway measures it: request rate from
  arrivals, TTFT from the first tokens, mean lengths and TPOT from the requests completed since the last
  DECIDE) and its targets
  are applied: new instances start cold (billed from the start), surplus ones are first cancelled if
  still starting, else drained, those holding the least KV first (`_kv_held`) — the router stops sending
  them work and they are removed once empty, P/D holds and KV still to come included (soft scale-in:
  nothing is aborted).
- DRAIN_TIMEOUT (only with `drain_timeout_s`, Kubernetes' termination grace period): an instance still
  draining that long after it was told to is removed anyway. Whatever is still on an instance when it is
  removed is aborted, failed with reason `aborted_by_scale_in` and counted in `aborted_by_scale_in`
  (with a KV transfer still pending from a removed prefill instance, its decode side's request too).

P/D: the prefill instance runs the prompt with max_tokens=1 and holds its blocks; the decode instance
receives the KV after prompt KV bytes / `kv_link_gbps` (`kv_link_cross_domain_gbps` when the two sit in
different network domains) and then streams; the held blocks are freed when
the transfer lands (vLLM's NIXL protocol). The client-visible TTFT is the decode side's first token.

Data parallelism (a pool's `dp` > 1, vLLM's `--data-parallel-size`): an instance is dp engines behind one
API server, each with the pool's engine settings and its own KV cache, stepping on its own. Its
`WorkerView` is what the gateway sees of such a server: the capacity of dp engines (`capacity_for(dp=)`),
the engines' summed counts and blocks, and each engine (`engines`: its blocks and, once scraped, its KV
usage; before the first scrape the pool's configured engines), so the KV ledger books each engine on its
own. A hop runs on the engine the ledger booked it on (`KvReservation.engine`, which the gateway pins
with `X-data-parallel-rank`), else on the one vLLM's balancer picks (`simulator.data_parallel`); a
request never spans engines. It is billed for tp × dp GPUs (catalog price × tp × dp), placed on tp × dp
GPUs of one node, and the autoscaler sizes it as dp engines (`pool_specs`). dp = 1 is one engine, as before.

Not modelled: the gateway's own latency and the API server's per-request overhead (~10–25 ms), network
time of token streams, and instance failures.

Topology (`nodes:` in the fleet file, `simulator.cluster_topology`): instances are placed on nodes through
the planner's topology solver, each decision's additions together around the running ones, clipped to
what the inventory holds; scale-in prefers victims that reduce cross-domain pairs and fragmentation.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from placement.catalog import Catalog, load_catalog
from placement.perf_model import PerfModel
from scheduler.autoscaler.signals import Observation, PoolObservation, PoolSpec, ScalingPolicy, within_bounds
from scheduler.fleet import (
    EngineView,
    FleetView,
    PoolRef,
    Role,
    WorkerCapacity,
    WorkerState,
    WorkerView,
    capacity_for,
    configured_engines,
)
from scheduler.routing.config import build_router, parse_routing_config
from scheduler.routing.framework import Decision, ReservePlugin, RouteRequest, booked_engine
from scheduler.routing.reasons import Outcome, Reject
from simulator.cluster_config import FleetConfig, pool_specs
from simulator.cluster_topology import SimTopology
from simulator.data_parallel import DpBalancer, EngineLoad
from simulator.engine import Engine, EngineConfig, StepResult
from simulator.requests import EngineRequest, KvTransfer, RequestRecord


class _Ev(IntEnum):  # priority among events at the same instant
    STEP = 0
    READY = 1
    ARRIVAL = 2
    SCRAPE = 3
    DECIDE = 4
    DRAIN_TIMEOUT = 5


@dataclass(frozen=True, slots=True)
class SimRequest:
    """A trace request: arrival (s), prompt and output lengths (tokens), optional prefix block ids."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class _Req:
    idx: int
    rid: str
    src: SimRequest
    route: RouteRequest
    decision: Decision | None = None
    phase: str = "new"  # new | queued | prefill | decode | done | failed
    queued_at: float = 0.0
    first_token: float | None = None
    decoding: bool = False  # counted among its instance's decode requests (not its prefill backlog)
    # the engine (data-parallel rank) of the instance running its current hop, and on a P/D request's
    # decode hop the engine of its prefill instance that holds its KV until the transfer lands
    rank: int = 0
    held_rank: int = 0
    finished: float | None = None
    fail_reason: str | None = None


@dataclass(slots=True)
class _Instance:
    id: str
    pool: str
    spec: PoolSpec
    capacity: WorkerCapacity
    created: float
    state: WorkerState
    ranks: tuple[_Rank, ...] = ()  # its engines, in rank order: one unless its pool's dp > 1
    # vLLM's API-server balancer over the engines, for a request no reservation booked on one (dp > 1 only)
    balancer: DpBalancer | None = None
    removed: float | None = None
    busy_mark: float = 0.0  # its `busy_s()` at the last DECIDE (the HPA baseline's utilisation)
    ready_at: float = 0.0  # when it became ready (its cold start's end; 0 for the initial fleet)
    inflight: int = 0
    inflight_prefill_tokens: int = 0
    inflight_decode: int = 0
    # P/D requests routed to this decode instance whose prefill still runs elsewhere: in flight here from
    # dispatch, as the gateway counts them, so a drain waits for their KV instead of retiring under them
    awaiting_kv: int = 0
    scraped: tuple[int, int, float] = (0, 0, 0.0)  # running, waiting, kv usage at the last scrape
    # each engine's KV usage at the last scrape (dp > 1); None before it, when the view shows the engines
    # the pool configures (`configured_engines`), as the gateway's before a worker's first scrape
    engine_usage: tuple[float, ...] | None = None
    view: WorkerView | None = None
    domain: str | None = None  # network domain of its node (or its pool's `domain:`)

    @property
    def engine(self) -> Engine:
        """Rank 0's engine: the instance's only one unless its pool's dp > 1."""
        return self.ranks[0].engine

    def engines(self) -> Iterator[Engine]:
        return (r.engine for r in self.ranks)

    def busy_s(self) -> float:
        """Seconds its engines were busy, their mean: the busy time of the instance as a whole, which an
        HPA's GPU utilisation averages over the pod's GPUs (one engine: that engine's)."""
        ranks = self.ranks
        if len(ranks) == 1:
            return ranks[0].engine.counters.busy_s
        return sum(r.engine.counters.busy_s for r in ranks) / len(ranks)

    def idle(self) -> bool:
        """No engine has work or holds P/D KV for a decode side."""
        return not any(e.has_work() or e.num_held for e in self.engines())


@dataclass(slots=True, eq=False)
class _Rank:
    """One engine of an instance and its step loop. Every engine of a data-parallel instance steps on its
    own, as vLLM's engine cores do; what the gateway counts per worker (in flight, P/D awaits) stays on the
    instance."""

    inst: _Instance
    index: int  # its data-parallel rank
    engine: Engine
    stepping: bool = False  # a STEP is pending: a step under way, or an idle wait (`wake_at`)
    pending: StepResult | None = None
    # An idle engine's timed wake (a KV transfer landing, a P/D hold expiring): new work must not wait for it,
    # so a kick supersedes it. Only the STEP carrying the current `step_token` acts; superseded ones are stale.
    wake_at: float | None = None
    step_token: int = 0


@dataclass(slots=True)
class _PoolTotals:
    """Counters of instances already removed, so pool rates stay continuous across scale-in."""

    generation_tokens: int = 0
    prompt_tokens: int = 0
    busy_s: float = 0.0
    preemptions: int = 0


@dataclass(slots=True)
class SimResult:
    """Raw outcome of a run; `simulator.cluster_report.build_report` turns it into the JSON report."""

    policy: str
    fleet: FleetConfig
    end_s: float
    completed: list[tuple[float, float, float | None, float, int, int]] = field(default_factory=list)
    # (arrival, ttft, tpot | None, e2e, prompt, output) per completed request
    failed: dict[str, int] = field(default_factory=dict)
    aborted_by_scale_in: int = 0
    instance_seconds: dict[str, float] = field(default_factory=dict)  # GPU-seconds by GPU type (× tp × dp)
    cost_usd: dict[str, float] = field(default_factory=dict)
    busy_seconds: float = 0.0  # instance-seconds busy (a data-parallel instance: its engines' mean)
    billed_seconds: float = 0.0  # instance-seconds billed
    preemptions: int = 0
    replicas: list[dict[str, Any]] = field(default_factory=list)
    scale_events: list[dict[str, Any]] = field(default_factory=list)
    requests_total: int = 0
    topology: dict[str, Any] | None = None  # `SimTopology.report()`


class ClusterSimulator:
    def __init__(
        self,
        fleet: FleetConfig,
        policy: ScalingPolicy | None,
        policy_name: str = "fixed",
        catalog: Catalog | None = None,
        reserve: Iterable[ReservePlugin] = (),
    ) -> None:
        self.fleet = fleet
        self.catalog = catalog or load_catalog()
        self.policy = policy
        self.policy_name = policy_name
        self.specs = {s.name: s for s in pool_specs(fleet, self.catalog)}
        self.router = build_router(parse_routing_config(fleet.routing), reserve=tuple(reserve))
        self.rng = random.Random(fleet.seed)
        self._pools = {p.name: p for p in fleet.pools}
        self._perf = {
            p.name: PerfModel(self.catalog.gpu(p.gpu), self.catalog.model(p.model or fleet.model), p.tp)
            for p in fleet.pools
        }
        k = fleet.engine
        self._engine_cfg = EngineConfig(
            max_num_seqs=k.max_num_seqs,
            max_num_batched_tokens=k.max_num_batched_tokens,
            block_size=k.block_size,
            gpu_memory_utilization=k.gpu_memory_utilization,
            num_gpu_blocks=k.num_gpu_blocks,
        )
        self._caps = {
            p.name: capacity_for(
                self.catalog.gpu(p.gpu),
                self.catalog.model(p.model or fleet.model),
                p.tp,
                self.catalog,
                max_num_seqs=k.max_num_seqs,
                block_size=k.block_size,
                gpu_memory_utilization=k.gpu_memory_utilization,
                num_gpu_blocks=k.num_gpu_blocks,
                cost_per_hour=self.specs[p.name].cost_per_hour,
                dp=p.dp,
            )
            for p in fleet.pools
        }
        # as the gateway: a request for the role of a pool at zero waits for it (the router's empty_pool)
        # when a policy can bring the pool back, else is refused at once (pool_stays_empty)
        self._pool_refs = tuple(
            PoolRef(
                p.name,
                p.model or fleet.model,
                Role(p.role),
                self._caps[p.name].max_model_len,
                waited_for=p.max_replicas > 0 and policy is not None,
            )
            for p in fleet.pools
        )
        self._heap: list[tuple[float, int, int, _Ev, Any]] = []
        self._seq = 0
        self._instances: dict[str, _Instance] = {}
        self._live: list[_Instance] = []
        self._n_created = 0
        self._reqs: dict[str, _Req] = {}
        self._queue: deque[_Req] = deque()
        self._fleet_view: FleetView | None = None
        self._retired = {p.name: _PoolTotals() for p in fleet.pools}
        self._window = _Window()
        self._now = 0.0
        # When the trace was served: the last arrival, completion or failure. Billing ends here for every
        # policy alike, not at the last event popped (a stale drain timeout or READY of a cancelled instance,
        # or the tick that noticed the end), which moved the end by up to a drain timeout per policy.
        self._served_s = 0.0
        self._pending_arrival = False
        self._open_requests = 0  # arrived, not yet completed or failed (queued ones included)
        self.topology = SimTopology.build(fleet, self.catalog)
        self.result = SimResult(policy_name, fleet, 0.0)

    # -- event plumbing --------------------------------------------------------------------------

    def _push(self, t: float, kind: _Ev, obj: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, int(kind), self._seq, kind, obj))

    def run(self, requests: Iterable[SimRequest]) -> SimResult:
        arrivals = iter(requests)
        self.topology.place_initial()
        for pool in self.fleet.pools:
            for _ in range(pool.replicas):
                self._start_instance(pool.name, 0.0, cold=False)
        self._next_arrival(arrivals)
        self._push(self.fleet.scrape_interval_s, _Ev.SCRAPE)
        self._push(self.fleet.decision_interval_s, _Ev.DECIDE)
        self._sample_replicas(0.0)
        while self._heap:
            t, _, _, kind, obj = heapq.heappop(self._heap)
            self._now = t
            if kind is _Ev.STEP:
                self._on_step(obj, t)
            elif kind is _Ev.ARRIVAL:
                self._on_arrival(obj, t)
                self._next_arrival(arrivals)
            elif kind is _Ev.READY:
                self._on_ready(obj, t)
            elif kind is _Ev.DRAIN_TIMEOUT:
                self._on_drain_timeout(obj, t)
            elif not self._pending_arrival and self._open_requests == 0:
                continue  # periodic events stop once the trace is served
            elif kind is _Ev.SCRAPE:
                self._on_scrape(t)
                self._push(t + self.fleet.scrape_interval_s, _Ev.SCRAPE)
            elif kind is _Ev.DECIDE:
                self._on_decide(t)
                self._push(t + self.fleet.decision_interval_s, _Ev.DECIDE)
        return self._finish()

    def _next_arrival(self, arrivals: Iterator[SimRequest]) -> None:
        src = next(arrivals, None)
        self._pending_arrival = src is not None
        if src is not None:
            self._push(src.arrival_s, _Ev.ARRIVAL, src)

    # -- instances -------------------------------------------------------------------------------

    def _start_instance(self, pool: str, now: float, cold: bool) -> _Instance:
        self._n_created += 1
        iid = f"{pool}-{self._n_created}"
        inst = _Instance(
            iid,
            pool,
            self.specs[pool],
            self._caps[pool],
            now,
            WorkerState.STARTING if cold else WorkerState.READY,
        )
        # Every engine gets the instance's seed, as the simulated worker's: a data-parallel server's engines
        # are replicas of one model, so a request's answer does not depend on the engine that runs it.
        seed = self.fleet.seed * 1_000_003 + self._n_created
        dp = self._pools[pool].dp
        inst.ranks = tuple(
            _Rank(inst, rank, Engine(self._perf[pool], self._engine_cfg, seed=seed)) for rank in range(dp)
        )
        if dp > 1:
            inst.balancer = DpBalancer()
        inst.domain = self.topology.start(iid, pool)
        self._instances[iid] = inst
        self._live.append(inst)
        self._fleet_view = None
        if cold:
            self._push(now + self.fleet.cold_start_s, _Ev.READY, inst)
        return inst

    def _on_ready(self, inst: _Instance, now: float) -> None:
        if inst.removed is not None:
            return  # cancelled while starting
        inst.state = WorkerState.READY
        inst.ready_at = now
        self._dirty(inst)
        self._drain_queue(now)

    def _on_drain_timeout(self, inst: _Instance, now: float) -> None:
        if inst.removed is None and inst.state is WorkerState.DRAINING:
            self._remove(inst, now)  # the grace period is over: what still runs there is aborted

    def _remove(self, inst: _Instance, now: float) -> None:
        inst.removed = now
        if inst.inflight or inst.awaiting_kv or not inst.idle():
            # Soft scale-in removes an instance only once it is empty; anything still here is aborted.
            self.result.aborted_by_scale_in += self._abort_all(inst, now)
        totals = self._retired[inst.pool]
        for engine in inst.engines():
            c = engine.counters
            totals.generation_tokens += c.generation_tokens
            totals.prompt_tokens += c.prompt_tokens
            totals.busy_s += c.busy_s
            totals.preemptions += c.preemptions
        self._bill(inst, now)
        self.topology.remove(inst.id)
        self._live.remove(inst)
        self._fleet_view = None

    def _abort_all(self, inst: _Instance, now: float) -> int:
        """Abort every request still on `inst` (being removed); returns how many requests failed.

        A request prefilling here fails; one whose KV this prefill instance still holds for its decode side
        fails there too (the decode side cannot fetch it from a removed instance)."""
        aborted = 0
        for view in [v for engine in inst.engines() for v in engine.requests()]:
            req = self._reqs.get(view.request_id)
            if req is None or req.decision is None:
                continue
            if req.phase == "decode" and req.decision.decode.id != inst.id:
                on = self._instances[req.decision.decode.id]  # held here for a transfer not yet landed
            else:
                on = inst
            self._abort_request(req, on, now)
            aborted += 1
        if inst.awaiting_kv:  # still prefilling elsewhere for this decode instance: nowhere to land now
            for req in [r for r in self._reqs.values() if r.phase == "prefill"]:
                assert req.decision is not None and req.decision.prefill is not None
                if req.decision.decode.id == inst.id:
                    self._abort_request(req, self._instances[req.decision.prefill.id], now)
                    aborted += 1
        return aborted

    def _abort_request(self, req: _Req, inst: _Instance, now: float) -> None:
        """Drop `req` from `inst`'s engine, undo its in-flight counts there, release it, fail it."""
        assert req.decision is not None
        unit = inst.ranks[req.rank]
        unit.engine.abort(req.rid, now)
        inst.inflight -= 1
        if req.decoding:
            inst.inflight_decode -= 1
        else:
            inst.inflight_prefill_tokens -= req.src.input_tokens
        prefill = req.decision.prefill
        if req.phase == "prefill":  # its decode instance no longer waits for this KV
            decode = self._instances[req.decision.decode.id]
            decode.awaiting_kv -= 1
            self._maybe_retire(decode, now)
        if req.phase == "decode" and prefill is not None and prefill.id != inst.id:
            src = self._instances[prefill.id].ranks[req.held_rank]
            if src.inst.removed is None and src.engine.release_held(req.rid):  # its KV is no longer needed
                self._kick(src, now)
        req.decision.release(Outcome.WORKER_ERROR)
        self.router.on_complete(inst.id, req.route, Outcome.WORKER_ERROR, now)
        self._fail(req, "aborted_by_scale_in")
        self._dirty(inst)
        if inst.removed is None:
            self._kick(unit, now)
            self._maybe_retire(inst, now)

    def _bill(self, inst: _Instance, now: float) -> None:
        seconds = now - inst.created
        gpu = inst.spec.gpu
        pool = self._pools[inst.pool]
        gpus = pool.tp * pool.dp  # dp engines of tp GPUs each
        self.result.instance_seconds[gpu] = self.result.instance_seconds.get(gpu, 0.0) + seconds * gpus
        self.result.cost_usd[gpu] = (
            self.result.cost_usd.get(gpu, 0.0) + seconds / 3600 * inst.spec.cost_per_hour
        )
        self.result.billed_seconds += seconds
        self.result.busy_seconds += inst.busy_s()

    def _dirty(self, inst: _Instance) -> None:
        inst.view = None
        self._fleet_view = None

    def _view(self) -> FleetView:
        if self._fleet_view is None:
            self._fleet_view = FleetView(tuple(self._worker_view(i) for i in self._live), self._pool_refs)
        return self._fleet_view

    def _worker_view(self, inst: _Instance) -> WorkerView:
        if inst.view is None:
            running, waiting, usage = inst.scraped
            ranks = inst.ranks
            if len(ranks) == 1:
                blocks, engines = ranks[0].engine.num_gpu_blocks, ()
            else:
                # as a data-parallel vLLM server's scrape shows it (`server.scrape`): the server's blocks are
                # its engines' sum, and each engine is listed with its own blocks and usage, so the KV ledger
                # books each on its own (a sequence's blocks all come from the engine that runs it)
                blocks = sum(r.engine.num_gpu_blocks for r in ranks)
                usages = inst.engine_usage
                engines = (
                    configured_engines(inst.capacity)
                    if usages is None
                    else tuple(
                        EngineView(r.index, r.engine.num_gpu_blocks, u)
                        for r, u in zip(ranks, usages, strict=True)
                    )
                )
            inst.view = WorkerView(
                id=inst.id,
                url=f"sim://{inst.id}",
                pool=inst.pool,
                model=inst.spec.model,
                gpu=inst.spec.gpu,
                role=Role(inst.spec.role),
                state=inst.state,
                breaker_open=False,
                capacity=inst.capacity,
                num_running=running,
                num_waiting=waiting,
                kv_usage=usage,
                num_gpu_blocks=blocks,
                block_size=ranks[0].engine.block_size,
                inflight_requests=inst.inflight,
                inflight_prefill_tokens=inst.inflight_prefill_tokens,
                inflight_decode_requests=inst.inflight_decode,
                domain=inst.domain,  # the router's pd-domain-affinity pairs prefill with decode by it
                engines=engines,
            )
        return inst.view

    def _kick(self, unit: _Rank, now: float) -> None:
        """Something changed on `unit`'s engine (work arrived, blocks freed): step it now, unless a step is
        under way (its end looks at the engine again). An idle wait for a timed wake is cut short: the engine
        may have runnable work now that it did not have when the wait began."""
        if unit.stepping and unit.wake_at is None:
            return
        self._schedule_step(unit, now)

    def _schedule_step(self, unit: _Rank, t: float, wake: bool = False) -> None:
        unit.stepping = True
        unit.step_token += 1
        unit.wake_at = t if wake else None
        self._push(t, _Ev.STEP, (unit, unit.step_token))

    def _on_step(self, event: tuple[_Rank, int], now: float) -> None:
        unit, token = event
        if token != unit.step_token:
            return  # a wake superseded by a kick
        unit.wake_at = None
        inst = unit.inst
        if inst.removed is not None:  # removed with a step under way (drain timeout): nothing to apply
            unit.pending, unit.stepping = None, False
            return
        if unit.pending is not None:
            result, unit.pending = unit.pending, None
            self._apply(inst, result, now)
        engine = unit.engine
        engine.expire_held(now)
        if engine.has_work():
            result = engine.step(now)
            if not result.idle:
                unit.pending = result
                self._schedule_step(unit, result.end)
                return
            if result.kv_received:  # transfers that landed in a step that ran nothing: the prefill side's
                self._apply(inst, result, now)  # held blocks are freed now, not at their hold's expiry
            if result.preempted:
                # Everything running was preempted and, as in vLLM, nothing admitted in that step: the next
                # step admits (what landed, the recompute), at once, as vLLM's engine loop, `run_offline` and
                # the worker runtime go on. Waiting for a kick left runnable work until the next arrival.
                self._schedule_step(unit, now)
                return
            wake = engine.next_event_time()  # work, none runnable: it waits for a KV transfer to land
            if wake is not None and wake > now:
                self._schedule_step(unit, wake, wake=True)
                return
        unit.stepping = False
        self._maybe_retire(inst, now)
        expiry = engine.next_hold_expiry()  # held blocks its decode side never fetched free at their timeout
        if inst.removed is None and expiry is not None:
            self._schedule_step(unit, max(expiry, now), wake=True)

    def _maybe_retire(self, inst: _Instance, now: float) -> None:
        if (
            inst.state is WorkerState.DRAINING
            and inst.inflight == 0
            and inst.awaiting_kv == 0
            and inst.idle()
            and inst.removed is None
        ):
            self._remove(inst, now)

    def _apply(self, inst: _Instance, result: StepResult, now: float) -> None:
        for rid in result.first_tokens:
            req = self._reqs.get(rid)
            if req is None:  # aborted after this step was computed (its instance's peer was removed)
                continue
            if req.phase == "decode" or req.decision is None or req.decision.prefill is None:
                req.first_token = now
                self._window.first_token(now - req.src.arrival_s)  # the gateway observes TTFT here
                if not req.decoding:  # prefilled here: its prompt leaves this instance's backlog
                    req.decoding = True
                    inst.inflight_prefill_tokens -= req.src.input_tokens
                    inst.inflight_decode += 1
                for res in req.decision.reservations if req.decision else ():
                    first = getattr(res, "first_token", None)
                    if first is not None and res.worker_id == inst.id:
                        first(now)
        for rid in result.kv_received:
            req = self._reqs.get(rid)
            if req is None:
                continue
            if req.decision is not None and req.decision.prefill is not None:
                src = self._instances[req.decision.prefill.id].ranks[req.held_rank]
                src.engine.release_held(rid)
                self._kick(src, now)
                self._maybe_retire(src.inst, now)
        for rec in result.finished:
            req = self._reqs.get(rec.request_id)
            if req is None:
                continue
            if req.phase == "prefill":
                self._prefill_done(req, inst, now)
            else:
                self._complete(req, inst, rec, now)
        self._dirty(inst)

    # -- requests --------------------------------------------------------------------------------

    def _on_arrival(self, src: SimRequest, now: float) -> None:
        idx = self.result.requests_total
        self.result.requests_total += 1
        self._served_s = max(self._served_s, now)
        rid = f"r{idx}"
        route = RouteRequest(
            rid,
            self.fleet.model,
            src.input_tokens,
            src.output_tokens,
            src.output_tokens,
            prefix_hashes=src.hash_ids,
            arrival_s=src.arrival_s,
        )
        req = _Req(idx, rid, src, route)
        self._reqs[rid] = req
        self._open_requests += 1
        self._window.arrive()
        if self._queue or not self._try_dispatch(req, now):
            self._enqueue(req, now)

    def _enqueue(self, req: _Req, now: float) -> None:
        if req.phase == "failed":
            return
        if len(self._queue) >= self.fleet.admission_queue_size:
            self._fail(req, "admission_queue_full")
            return
        req.phase = "queued"
        req.queued_at = now
        self._queue.append(req)

    def _try_dispatch(self, req: _Req, now: float) -> bool:
        """Route and send; False when it should wait in the admission queue (a retryable reject)."""
        if req.src.input_tokens < 1:
            self._fail(req, "empty_prompt")
            return True
        decision = self.router.route(req.route, self._view(), now, self.rng)
        if isinstance(decision, Reject):
            if decision.retryable:
                return False
            self._fail(req, decision.primary.value)
            return True
        self.router.on_dispatch(decision, req.route, now)
        req.decision = decision
        if decision.prefill is not None:
            inst = self._instances[decision.prefill.id]
            self._instances[decision.decode.id].awaiting_kv += 1
            req.phase = "prefill"
            er = EngineRequest(
                req.rid,
                req.src.input_tokens,
                max_tokens=1,
                ignore_eos=True,
                kv_transfer=KvTransfer(prefill_only=True),
            )
        else:
            inst = self._instances[decision.decode.id]
            req.phase = "decode"
            er = EngineRequest(
                req.rid, req.src.input_tokens, max_tokens=req.src.output_tokens, ignore_eos=True
            )
        self._send(inst, er, req, now)
        return True

    def _send(self, inst: _Instance, er: EngineRequest, req: _Req, now: float) -> None:
        # a removed instance never steps again: a request sent there would stay open forever
        assert inst.removed is None, f"{req.rid} sent to removed instance {inst.id}"
        unit = inst.ranks[0] if inst.balancer is None else inst.ranks[self._engine_for(inst, req)]
        req.rank = unit.index
        try:
            unit.engine.add_request(er, now, arrival=req.src.arrival_s)
        except ValueError:  # e.g. prompt over the instance's max_model_len
            if req.decision is not None:
                prefill = req.decision.prefill
                if req.phase == "prefill":  # counted on its decode instance at dispatch
                    self._instances[req.decision.decode.id].awaiting_kv -= 1
                elif prefill is not None and prefill.id != inst.id:
                    # the decode hop refused a request prefilled elsewhere: its KV held there is never
                    # fetched, so it is freed now (as a scale-in abort frees it, `_abort_request`), not at
                    # the hold's timeout, which held a draining prefill instance (billed) that long.
                    # `_prefill_done` retires that instance if it is draining and now empty.
                    src = self._instances[prefill.id].ranks[req.held_rank]
                    if src.inst.removed is None and src.engine.release_held(req.rid):
                        self._kick(src, now)
                req.decision.release(Outcome.FAILED_BEFORE_FIRST_BYTE)
            self._fail(req, "engine_rejected")
            return
        inst.inflight += 1
        if er.kv_transfer is not None and er.kv_transfer.remote_prefilled:
            # Prefilled elsewhere: no prompt in this instance's backlog, a decode request from dispatch on,
            # as the gateway's in-flight ticket counts it (`server.registry.InflightTicket`): one policy,
            # two drivers, so routing reads the same load in both.
            req.decoding = True
            inst.inflight_decode += 1
        else:
            inst.inflight_prefill_tokens += req.src.input_tokens
        self._dirty(inst)
        self._kick(unit, now)

    def _engine_for(self, inst: _Instance, req: _Req) -> int:
        """The engine of data-parallel `inst` that runs `req`'s hop: the one the KV ledger booked it on (the
        gateway pins it there, `server.proxy.pinned_headers`), else the one vLLM's API-server balancer picks
        from the engines' live load. Its `in_flight` (the server's unfinished requests on the engine) is
        the engine's running and waiting sequences: the simulator has no API-server overhead in which a
        request could be on its way to the engine."""
        assert req.decision is not None and inst.balancer is not None
        booked = booked_engine(req.decision.reservations, inst.id)
        if booked is not None:
            return booked
        return inst.balancer.pick(
            [
                EngineLoad(e.num_waiting, e.num_running, e.kv_usage, e.num_running + e.num_waiting)
                for e in inst.engines()
            ]
        )

    def _prefill_done(self, req: _Req, inst: _Instance, now: float) -> None:
        inst.inflight -= 1
        inst.inflight_prefill_tokens -= req.src.input_tokens
        self.router.on_complete(inst.id, req.route, Outcome.COMPLETED, now)
        assert req.decision is not None
        decode = self._instances[req.decision.decode.id]
        decode.awaiting_kv -= 1
        kv_bytes = req.src.input_tokens * self._perf[decode.pool].model.kv_bytes_per_token
        gbps = self.topology.bandwidth_gbps(inst.domain, decode.domain)
        transfer = KvTransfer(remote_prefilled=True, transfer_delay_s=kv_bytes / (gbps * 1e9))
        req.phase = "decode"
        req.held_rank = req.rank  # the prefill engine keeps its KV until the decode side's transfer lands
        er = EngineRequest(
            req.rid,
            req.src.input_tokens,
            max_tokens=req.src.output_tokens,
            ignore_eos=True,
            kv_transfer=transfer,
        )
        self._send(decode, er, req, now)
        self._maybe_retire(inst, now)

    def _complete(self, req: _Req, inst: _Instance, rec: RequestRecord, now: float) -> None:
        """`rec`: the decode engine's record. Its output tokens, not the trace's: the engine clamps a request
        whose prompt + output passes max_model_len, as vLLM's API does (the row counted the asked-for ones)."""
        first, tpot, out = rec.first_token, rec.tpot, rec.output_tokens
        req.phase = "done"
        req.finished = now
        self._served_s = max(self._served_s, now)
        self._open_requests -= 1
        inst.inflight -= 1
        inst.inflight_decode -= 1
        if req.decision is not None:
            req.decision.release(Outcome.COMPLETED)
        self.router.on_complete(inst.id, req.route, Outcome.COMPLETED, now)
        ttft = (first if first is not None else now) - req.src.arrival_s
        e2e = now - req.src.arrival_s
        self.result.completed.append((req.src.arrival_s, ttft, tpot, e2e, req.src.input_tokens, out))
        self._window.complete(req.src.input_tokens, out, tpot)
        del self._reqs[req.rid]
        self._maybe_retire(inst, now)
        self._drain_queue(now)

    def _fail(self, req: _Req, reason: str) -> None:
        if req.phase in ("done", "failed"):
            return
        self._served_s = max(self._served_s, self._now)
        req.phase = "failed"
        req.fail_reason = reason
        self._open_requests -= 1
        self.result.failed[reason] = self.result.failed.get(reason, 0) + 1
        self._reqs.pop(req.rid, None)

    def _drain_queue(self, now: float) -> None:
        while self._queue:
            head = self._queue[0]
            if now - head.queued_at > self.fleet.admission_deadline_s:
                self._queue.popleft()
                self._fail(head, "admission_deadline")
                continue
            if not self._try_dispatch(head, now):
                return
            self._queue.popleft()

    # -- periodic --------------------------------------------------------------------------------

    def _on_scrape(self, now: float) -> None:
        for inst in self._live:
            ranks = inst.ranks
            if len(ranks) == 1:
                e = ranks[0].engine
                scraped = (e.num_running, e.num_waiting, e.kv_usage)
            else:
                # a data-parallel server's scrape (`server.scrape`): counts summed over its engines, KV usage
                # their mean (engines of equal size), and each engine's own usage
                usage = tuple(r.engine.kv_usage for r in ranks)
                scraped = (
                    sum(r.engine.num_running for r in ranks),
                    sum(r.engine.num_waiting for r in ranks),
                    sum(usage) / len(usage),
                )
                if usage != inst.engine_usage:
                    inst.engine_usage = usage
                    self._dirty(inst)
            if scraped != inst.scraped:
                inst.scraped = scraped
                self._dirty(inst)
        self._drain_queue(now)

    def _pool_counters(self, pool: str) -> tuple[int, int, float, int]:
        t = self._retired[pool]
        gen, prompt, busy, pre = t.generation_tokens, t.prompt_tokens, t.busy_s, t.preemptions
        for inst in self._live:
            if inst.pool == pool:
                for engine in inst.engines():
                    c = engine.counters
                    gen += c.generation_tokens
                    prompt += c.prompt_tokens
                    busy += c.busy_s
                    pre += c.preemptions
        return gen, prompt, busy, pre

    def _on_decide(self, now: float) -> None:
        interval = self.fleet.decision_interval_s
        pools: dict[str, PoolObservation] = {}
        for name in self._pools:
            gen, prompt, _, _ = self._pool_counters(name)
            prev = self._window.counters.get(name, (0, 0))
            self._window.counters[name] = (gen, prompt)
            members = [i for i in self._live if i.pool == name]
            ready = sum(i.state is WorkerState.READY for i in members)
            # As the HPA averages a per-pod metric: over the pods that report it, the ready ones (a draining
            # pod is terminating and excluded); busy time over ready time since the last decision, so one
            # that became ready mid-interval weighs by the time it was ready (the live reader samples it
            # per scrape, ready scrapes only).
            busy = ready_s = 0.0
            for i in members:
                busy_s = i.busy_s()
                if i.state is WorkerState.READY:
                    busy += busy_s - i.busy_mark
                    ready_s += now - max(now - interval, i.ready_at)
                i.busy_mark = busy_s
            pools[name] = PoolObservation(
                ready=ready,
                starting=sum(i.state is WorkerState.STARTING for i in members),
                draining=sum(i.state is WorkerState.DRAINING for i in members),
                decode_tokens_per_s=(gen - prev[0]) / interval,
                prompt_tokens_per_s=(prompt - prev[1]) / interval,
                num_waiting=sum(
                    e.num_waiting for i in members if i.state is WorkerState.READY for e in i.engines()
                ),
                gpu_utilization=min(1.0, busy / ready_s) if ready_s > 0 else 0.0,
                starting_ready_in_s=tuple(
                    max(0.0, i.created + self.fleet.cold_start_s - now)
                    for i in members
                    if i.state is WorkerState.STARTING
                ),
            )
        obs = self._window.observation(now, interval, pools, {self.fleet.model: len(self._queue)})
        if self.policy is not None:
            decision = self.policy.decide(obs)
            provisioned = {name: po.provisioned for name, po in pools.items()}
            targets = self.topology.clip(decision.targets, provisioned, now)
            for name, target in targets.items():
                self._apply_target(name, target, pools[name], now)
        self._sample_replicas(now)

    def _apply_target(self, pool: str, target: int, obs: PoolObservation, now: float) -> None:
        have = obs.provisioned
        # last line of defence against a policy's out-of-range target: never above max_replicas, never scaled
        # in below min_replicas (nor below 0), and never raised past the target (scale-ups were placed for it)
        bounds = self._pools[pool]
        target = within_bounds(target, have, bounds.min_replicas, bounds.max_replicas)
        if target == have:
            return
        self.result.scale_events.append({"t": round(now, 3), "pool": pool, "before": have, "after": target})
        if target > have:
            for _ in range(target - have):
                self._start_instance(pool, now, cold=True)
            return
        surplus = have - target
        members = {i.id: i for i in self._live if i.pool == pool}
        starting = sorted(
            (i for i in members.values() if i.state is WorkerState.STARTING), key=lambda i: -i.created
        )
        for iid in self.topology.victims_first([i.id for i in starting])[:surplus]:
            self._remove(members[iid], now)  # cancelled before it served anything
            surplus -= 1
        # Least KV first, then fewest in flight: a drain ends only once the victim's KV is gone, a prefill
        # instance's holds included (it has no request in flight while its decode side has not pulled them).
        ready = [i for i in members.values() if i.state is WorkerState.READY]
        held = self._kv_held(ready)
        ready.sort(key=lambda i: (held[i.id], i.inflight, i.id))
        for iid in self.topology.victims_first([i.id for i in ready])[:surplus]:
            inst = members[iid]
            inst.state = WorkerState.DRAINING
            self._dirty(inst)
            self._maybe_retire(inst, now)
            if inst.removed is None and self.fleet.drain_timeout_s is not None:
                self._push(now + self.fleet.drain_timeout_s, _Ev.DRAIN_TIMEOUT, inst)

    def _kv_held(self, insts: list[_Instance]) -> dict[str, int]:
        """KV blocks each of `insts` holds or is owed, by id: its engine's blocks in use (its requests', KV
        landing from a prefill instance, and a prefill instance's holds its decode side has not pulled yet),
        plus the prompt blocks of P/D requests still prefilling elsewhere for it (taken when their transfer
        starts). A request waiting for admission holds none yet."""
        held = {i.id: sum(e.kv.used for e in i.engines()) for i in insts}
        if any(i.awaiting_kv for i in insts):
            for req in self._reqs.values():
                decision = req.decision
                if req.phase == "prefill" and decision is not None and decision.decode.id in held:
                    kv = self._instances[decision.decode.id].engine.kv  # its engines' blocks are alike
                    held[decision.decode.id] += -(-req.src.input_tokens // kv.block_size) * kv.units_per_block
        return held

    def _sample_replicas(self, now: float) -> None:
        counts: dict[str, Any] = {"t": round(now, 3)}
        for name in self._pools:
            counts[name] = sum(
                1 for i in self._live if i.pool == name and i.state is not WorkerState.DRAINING
            )
        self.result.replicas.append(counts)
        self.topology.sample(now, {i.id for i in self._live if i.state is not WorkerState.DRAINING})

    def _finish(self) -> SimResult:
        end = self._served_s  # module note at `_served_s`: the same end for every policy
        for req in list(self._queue):
            self._fail(req, "admission_deadline")
        self._queue.clear()
        for inst in list(self._live):
            self._remove(inst, end)
        self.result.preemptions = sum(t.preemptions for t in self._retired.values())
        self.result.end_s = end
        self.result.topology = self.topology.report()
        return self.result


@dataclass(slots=True)
class _Window:
    """What happened since the last DECIDE, measured as the live gateway measures it
    (`server.gateway_signals`): the request rate from arrivals; TTFT when a request's first token reaches
    the client (the gateway observes it on the first byte relayed, so a queue shows in TTFT while those
    requests are still decoding); the mean input and output lengths and TPOT from completed requests only.
    A gateway learns a request's lengths from the worker's `usage` when it finishes, never at arrival, so
    the trace's output lengths of requests still in flight are not seen here."""

    arrivals: int = 0
    completed: int = 0
    input_tokens: int = 0  # of the requests completed in the window
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    counters: dict[str, tuple[int, int]] = field(default_factory=dict)  # pool → generation, prompt tokens

    def arrive(self) -> None:
        self.arrivals += 1

    def first_token(self, ttft: float) -> None:
        self.ttfts.append(ttft)

    def complete(self, input_tokens: int, output_tokens: int, tpot: float | None) -> None:
        self.completed += 1
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        if tpot is not None:
            self.tpots.append(tpot)

    def observation(
        self, now: float, interval: float, pools: dict[str, PoolObservation], queue: dict[str, int]
    ) -> Observation:
        n = self.completed  # none completed: 0.0, the gateway's "not observed" (policies fall back)
        obs = Observation(
            now=now,
            pools=pools,
            admission_queue=queue,
            ttft_p90_s=_p90(self.ttfts),
            tpot_p90_s=_p90(self.tpots),
            request_rate=self.arrivals / interval,
            mean_input_tokens=self.input_tokens / n if n else 0.0,
            mean_output_tokens=self.output_tokens / n if n else 0.0,
        )
        self.arrivals = self.completed = self.input_tokens = self.output_tokens = 0
        self.ttfts.clear()
        self.tpots.clear()
        return obs


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
