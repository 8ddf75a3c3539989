"""A small fleet driver for KV reservation studies: several engine models behind the KV ledger.

Discrete-event loop over simulated time (an event heap ordered by (time, kind, seq)): arrivals enter the
gateway's admission queue; an admission pass reserves each request's footprint on a worker with the
`KvLedger` (best fit, FIFO with a backfill window, an aging hold for a head that waits too long — or the
CP-SAT batch plan) and dispatches it to that worker's `Engine`; each engine steps on its own clock; a first
token shrinks the reservation to its steady size, a finish releases it. Without a ledger (policy B0) every
request goes straight to the least-loaded engine, which admits greedily and preempts when blocks run out
(vLLM's behaviour). This is the same ledger object the gateway runs; only the clock is simulated.

This is not the cluster simulator (`simulator/cluster.py`, another engineer's): it drives engines directly
and records what the KV bench needs (preemptions, concurrency, reservations against actual peaks).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from placement.catalog import Catalog, load_catalog
from placement.perf_model import PerfModel
from scheduler.fleet import FleetView, Role, WorkerState, WorkerView, capacity_for
from scheduler.kv.batch_admission import AdmissionParams, plan_admission
from scheduler.kv.footprint import Footprint
from scheduler.kv.ledger import KvLedger, KvReservation, LedgerSettings, SpecTable
from scheduler.kv.plugins import best_fit_score
from scheduler.routing.framework import Decision, Router, RouteRequest
from scheduler.routing.reasons import Outcome
from simulator.engine import Engine, EngineConfig, StepResult
from simulator.kv_compression import CompressionEngine, CompressionModel
from simulator.requests import EngineRequest

_DONE, _ARRIVAL, _STEP, _RECONCILE = 0, 1, 2, 3  # same-time order: free memory before admitting


@dataclass(frozen=True)
class WorkerSpec:
    id: str
    gpu: str
    model: str  # catalog model (perf model)
    engine: EngineConfig
    compression: CompressionModel | None = None
    served_model: str = "m"
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Arrival:
    t: float
    request_id: str
    prompt: int
    max_tokens: int
    output: int  # where EOS falls (the trace's output length)
    priority: int = 0


@dataclass(slots=True)
class RequestStats:
    arrival: Arrival
    worker: str = ""
    dispatched: float | None = None
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    preemptions: int = 0
    reserved_blocks: float | None = None  # reservation at admission, in vLLM-block equivalents
    actual_peak_blocks: float = 0.0  # what the request really held at its worst moment
    alloc_slots: int = 0  # head-token slots allocated at its end (pages incl. group padding)
    ideal_slots: int = 0  # head-token slots an unpadded, unrounded layout would hold
    rejected: bool = False


@dataclass(slots=True)
class WorkerStats:
    busy_s: float = 0.0
    running_time: float = 0.0  # ∫ num_running dt over steps
    stranded_time: float = 0.0  # ∫ free KV fraction dt while requests wait (gateway queue or engine)
    waiting_time: float = 0.0  # time with something waiting


@dataclass(slots=True)
class FleetRun:
    requests: dict[str, RequestStats]
    workers: dict[str, WorkerStats]
    engines: dict[str, Engine]
    compression: dict[str, bool]
    ledger: KvLedger | None
    start: float
    end: float
    admission_solves: list[tuple[str, float, float]] = field(default_factory=list)  # (method, ms, objective)
    estimate_errors: list[float] = field(default_factory=list)


class OracleLedger(KvLedger):
    """Policy B4: reserves exactly what each request will hold (known from the simulator's draw)."""

    def __init__(
        self,
        settings: LedgerSettings,
        specs: SpecTable,
        oracle: Callable[[RouteRequest, WorkerView], Footprint],
    ) -> None:
        super().__init__(settings, specs)
        self._oracle = oracle

    def footprint(self, req: RouteRequest, worker: WorkerView) -> tuple[Footprint, Footprint]:
        fp = self._oracle(req, worker)
        return fp, fp


class _Worker:
    def __init__(self, spec: WorkerSpec, catalog: Catalog) -> None:
        self.spec = spec
        perf = PerfModel(catalog.gpu(spec.gpu), catalog.model(spec.model))
        if spec.compression is None:
            self.engine: Engine = Engine(perf, spec.engine, spec.seed)
        else:
            self.engine = CompressionEngine(perf, spec.engine, spec.compression, spec.seed)
        blocks = spec.engine.num_gpu_blocks or perf.kv_capacity_blocks(
            spec.engine.gpu_memory_utilization, spec.engine.block_size
        )
        self.blocks = blocks
        self.capacity = capacity_for(
            spec.gpu,
            spec.model,
            catalog=catalog,
            max_num_seqs=spec.engine.max_num_seqs,
            block_size=spec.engine.block_size,
            num_gpu_blocks=blocks,
            max_model_len=self.engine.max_model_len,
        )
        self.busy = False
        self.inflight: dict[str, int] = {}  # dispatched request → prompt tokens (until finished)
        self.prefilling: set[str] = set()
        self.stats = WorkerStats()

    def view(self) -> WorkerView:
        e = self.engine
        return WorkerView(
            id=self.spec.id,
            url="sim://" + self.spec.id,
            pool=self.spec.id,
            model=self.spec.served_model,
            gpu=self.spec.gpu,
            role=Role.MIXED,
            state=WorkerState.READY,
            breaker_open=False,
            capacity=self.capacity,
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            kv_usage=e.kv_usage,
            num_gpu_blocks=self.blocks,
            block_size=e.block_size,
            preemptions_total=float(e.counters.preemptions),
            scrape_age_s=0.0,
            inflight_requests=len(self.inflight),
            inflight_prefill_tokens=sum(self.inflight[r] for r in self.prefilling),
            inflight_decode_requests=len(self.inflight) - len(self.prefilling),
        )


class KvFleet:
    """Run `arrivals` through workers built from `specs` under one reservation policy (ledger or None)."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        ledger: KvLedger | None,
        admission: Literal["greedy", "plan-greedy", "cp-sat"] = "greedy",
        window: int = 64,
        aging_s: float = 30.0,
        reconcile_every_s: float = 1.0,
        catalog: Catalog | None = None,
        admission_params: AdmissionParams | None = None,
        router: Router | None = None,
        seed: int = 0,
    ) -> None:
        cat = catalog or load_catalog()
        self.workers = [_Worker(s, cat) for s in specs]
        self.by_id = {w.spec.id: w for w in self.workers}
        self.ledger = ledger
        self.admission = admission
        self.window = window
        self.aging_s = aging_s
        self.reconcile_every_s = reconcile_every_s
        self.admission_params = admission_params or AdmissionParams(max_head=window, time_limit_ms=5.0)
        # With a router (built with this ledger as its Reserve plugin), FIFO-with-backfill admission picks
        # each worker as the gateway does: filters, weighted scorers (est-ttft, kv-best-fit, ...), max score.
        self.router = router
        self._rng = random.Random(seed)
        self.queue: list[Arrival] = []
        self.reservations: dict[str, KvReservation] = {}
        self.stats: dict[str, RequestStats] = {}
        self.solves: list[tuple[str, float, float]] = []
        self.errors: list[float] = []
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._ereq: dict[str, EngineRequest] = {}
        self._held: str | None = None
        self._generated: dict[str, int] = {}

    # ---- events ----
    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def run(self, arrivals: Sequence[Arrival], max_time_s: float = 1e7) -> FleetRun:
        for a in arrivals:
            self.stats[a.request_id] = RequestStats(a)
            self._push(a.t, _ARRIVAL, a)
        start = min((a.t for a in arrivals), default=0.0)
        if self.ledger is not None:
            self._push(start, _RECONCILE, None)
        now = start
        while self._heap:
            now, kind, _, payload = heapq.heappop(self._heap)
            if now > max_time_s:
                break
            if kind == _ARRIVAL:
                self._on_arrival(payload, now)  # type: ignore[arg-type]
            elif kind == _STEP:
                self._on_step(payload, now)  # type: ignore[arg-type]
            elif kind == _DONE:
                self._on_done(payload, now)  # type: ignore[arg-type]
            elif self._heap:  # reconcile only while something else is still to happen
                self._reconcile(now)
            if self.queue and not self._heap:
                self._reject_unplaceable(now)
        end = max((s.finished for s in self.stats.values() if s.finished is not None), default=now)
        return FleetRun(
            self.stats,
            {w.spec.id: w.stats for w in self.workers},
            {w.spec.id: w.engine for w in self.workers},
            {w.spec.id: w.spec.compression is not None for w in self.workers},
            self.ledger,
            start,
            end,
            self.solves,
            self.errors,
        )

    def _on_arrival(self, a: Arrival, now: float) -> None:
        if self.ledger is None:  # B0: straight to the least-loaded engine
            w = min(self.workers, key=lambda w: (w.engine.num_running + w.engine.num_waiting, w.spec.id))
            self._dispatch(a, w, now)
            return
        self.queue.append(a)
        self._admit(now)

    def _on_step(self, w: _Worker, now: float) -> None:
        e = w.engine
        if not e.has_work():
            w.busy = False
            return
        running = e.num_running
        res = e.step(now)
        if res.idle:
            w.busy = False
            return
        st = w.stats
        st.busy_s += res.duration_s
        st.running_time += running * res.duration_s
        if self.queue or e.num_waiting:
            st.waiting_time += res.duration_s
            st.stranded_time += (1.0 - e.kv_usage) * res.duration_s
        self._push(res.end, _DONE, (w, res))

    def _on_done(self, item: tuple[_Worker, StepResult], now: float) -> None:
        w, res = item
        for rid in res.first_tokens:
            s = self.stats[rid]
            s.first_token = now
            w.prefilling.discard(rid)
            r = self.reservations.get(rid)
            if r is not None:
                r.first_token(now)
        if self.ledger is not None and self.ledger.settings.mode == "predicted":
            self._stream(res, now)
        for rec in res.finished:
            s = self.stats[rec.request_id]
            s.finished, s.output_tokens, s.preemptions = now, rec.output_tokens, rec.num_preemptions
            w.inflight.pop(rec.request_id, None)
            w.prefilling.discard(rec.request_id)
            r = self.reservations.pop(rec.request_id, None)
            if r is not None:
                r.release(Outcome.COMPLETED)
            if self.ledger is not None:
                self.ledger.predictor.observe(w.spec.served_model, rec.prompt_tokens, rec.output_tokens)
        if self.queue:
            self._admit(now)
        self._step_at(w, now)

    def _stream(self, res: StepResult, now: float) -> None:
        """Every emitted token reaches its reservation, as the gateway relays each streamed one: the ledger
        grows predicted reservations that reach their reserved output, and its reconcile bounds what a
        request holds by the tokens it has streamed."""
        for rid in (*res.decoded, *res.prefilled):
            n = self._generated[rid] = self._generated.get(rid, 0) + 1
            r = self.reservations.get(rid)
            if r is not None:
                r.on_tokens(n, now)

    def _step_at(self, w: _Worker, now: float) -> None:
        if w.engine.has_work():
            w.busy = True
            self._push(now, _STEP, w)
        else:
            w.busy = False

    def _reconcile(self, now: float) -> None:
        assert self.ledger is not None
        for sample in self.ledger.reconcile([w.view() for w in self.workers], now):
            self.errors.append(sample.error_frac)
        self._push(now + self.reconcile_every_s, _RECONCILE, None)
        if self.queue:  # capacity withheld by an earlier reconcile may be back
            self._admit(now)

    # ---- admission ----
    def _admit(self, now: float) -> None:
        ledger = self.ledger
        assert ledger is not None
        views = {w.spec.id: w.view() for w in self.workers}
        if self.admission in ("cp-sat", "plan-greedy"):
            head = [self._route_req(a) for a in self.queue[: self.window]]
            plan = plan_admission(
                head,
                list(views.values()),
                ledger,
                now,
                self.admission_params,
                use_cp_sat=self.admission == "cp-sat",
            )
            self.solves.append((plan.method, plan.solve_ms, plan.objective))
            placed = dict(plan.assignments)
            for a in list(self.queue[: self.window]):
                wid = placed.get(a.request_id)
                if wid is not None and self._reserve(a, views[wid], now):
                    self._dispatch(a, self.by_id[wid], now)
            self.queue = [a for a in self.queue if a.request_id not in self.reservations]
            return
        if self.router is not None:
            self._admit_routed(views, now)
            return
        kept: list[Arrival] = []
        frees = {wid: ledger.free(v) for wid, v in views.items()}
        holds = (
            {(self._held, v.id): ledger.free(v, self._held) - frees[v.id] for v in views.values()}
            if self._held
            else {}
        )
        for i, a in enumerate(self.queue):
            if i >= self.window:
                kept.extend(self.queue[i:])
                break
            req = self._route_req(a)
            best, best_score = None, -1.0
            for v in views.values():
                # cheap pre-check against the free pages before the full fit test (holds, overbooking)
                if ledger.footprint(req, v)[0].peak > frees[v.id] + holds.get((a.request_id, v.id), 0):
                    continue
                if ledger.fits(req, v, now):
                    fp, _ = ledger.footprint(req, v)
                    score = best_fit_score(ledger.free(v, a.request_id), fp.peak, ledger.capacity(v))
                    if score > best_score:
                        best, best_score = v, score
            if best is not None and self._reserve(a, best, now):
                self._dispatch(a, self.by_id[best.id], now)
                views[best.id] = self.by_id[best.id].view()
                frees[best.id] = ledger.free(views[best.id])
            else:
                kept.append(a)
        self.queue = kept
        self._age_hold(views, now)

    def _admit_routed(self, views: dict[str, WorkerView], now: float) -> None:
        """FIFO with a backfill window, each request placed by the router (its ledger reserves)."""
        assert self.router is not None
        kept: list[Arrival] = []
        for i, a in enumerate(self.queue):
            if i >= self.window:
                kept.extend(self.queue[i:])
                break
            d = self.router.route(self._route_req(a), FleetView(tuple(views.values())), now, self._rng)
            if not isinstance(d, Decision):
                kept.append(a)
                continue
            res = next(r for r in d.reservations if isinstance(r, KvReservation))
            self.reservations[a.request_id] = res
            ledger = self.ledger
            assert ledger is not None
            self.stats[a.request_id].reserved_blocks = res.units / ledger.spec_for(d.decode).units_per_block
            self._dispatch(a, self.by_id[d.decode.id], now)
            views[d.decode.id] = self.by_id[d.decode.id].view()
        self.queue = kept
        self._age_hold(views, now)

    def _age_hold(self, views: dict[str, WorkerView], now: float) -> None:
        """Set room aside for a head request that has waited `aging_s`, so small ones stop overtaking it."""
        ledger = self.ledger
        assert ledger is not None
        if self._held is not None and (not self.queue or self.queue[0].request_id != self._held):
            ledger.drop_hold(self._held)
            self._held = None
        if not self.queue or now - self.queue[0].t < self.aging_s or self._held is not None:
            return
        head = self.queue[0]
        req = self._route_req(head)
        fits_ever = [v for v in views.values() if ledger.can_ever_fit(req, v)]
        if fits_ever:
            v = max(
                fits_ever, key=lambda v: (ledger.free(v) / max(1, ledger.footprint(req, v)[0].peak), v.id)
            )
            ledger.hold(head.request_id, v, ledger.footprint(req, v)[0].peak, now)
            self._held = head.request_id

    def _route_req(self, a: Arrival) -> RouteRequest:
        model = self.workers[0].spec.served_model
        predicted = a.max_tokens
        if self.ledger is not None and self.ledger.settings.mode == "predicted":
            predicted = self.ledger.predictor.predict(model, a.prompt, a.max_tokens)
        return RouteRequest(
            a.request_id, model, a.prompt, a.max_tokens, predicted, priority=a.priority, arrival_s=a.t
        )

    def _reserve(self, a: Arrival, v: WorkerView, now: float) -> bool:
        assert self.ledger is not None
        r = self.ledger.reserve(self._route_req(a), v, now)
        if r is None:
            return False
        self.reservations[a.request_id] = r
        self.stats[a.request_id].reserved_blocks = r.units / self.ledger.spec_for(v).units_per_block
        return True

    def engine_request(self, a: Arrival) -> EngineRequest:
        er = self._ereq.get(a.request_id)
        if er is None:
            er = self._ereq[a.request_id] = EngineRequest(
                a.request_id, a.prompt, a.max_tokens, natural_output_tokens=a.output
            )
        return er

    def _dispatch(self, a: Arrival, w: _Worker, now: float) -> None:
        s = self.stats[a.request_id]
        s.worker, s.dispatched = w.spec.id, now
        er = self.engine_request(a)
        out = min(a.output, a.max_tokens, w.engine.max_model_len - a.prompt)
        if isinstance(w.engine, CompressionEngine):
            kv = w.engine.ragged
            s.actual_peak_blocks = kv.peak_units(er, out) / kv.units_per_block
            kv.enter_decode(er)
            s.alloc_slots = kv.blocks_for(er, a.prompt + out) * kv.block_size
            kv.leave_decode(er)
            s.ideal_slots = kv.ideal_slots(er, out)
        else:
            bs = w.engine.block_size
            s.actual_peak_blocks = math.ceil((a.prompt + out) / bs)
            s.alloc_slots, s.ideal_slots = s.actual_peak_blocks * bs, a.prompt + out
        w.engine.add_request(er, now)
        w.inflight[a.request_id] = a.prompt
        w.prefilling.add(a.request_id)
        if not w.busy:
            w.busy = True
            self._push(now, _STEP, w)

    def _reject_unplaceable(self, now: float) -> None:
        """Nothing in flight and nothing fits: the queue can never drain; count those requests rejected."""
        for a in self.queue:
            self.stats[a.request_id].rejected = True
        self.queue = []


def oracle_for(fleet: KvFleet) -> Callable[[RouteRequest, WorkerView], Footprint]:
    """The B4 footprint: exact peak and steady units from each worker's engine (prefill peak, final size)."""

    cache: dict[tuple[str, str], Footprint] = {}

    def fp(req: RouteRequest, view: WorkerView) -> Footprint:
        key = (req.request_id, view.id)
        if key not in cache:
            cache[key] = exact(req, view)
        return cache[key]

    def exact(req: RouteRequest, view: WorkerView) -> Footprint:
        w = fleet.by_id[view.id]
        a = fleet.stats[req.request_id].arrival
        er = fleet.engine_request(a)
        out = min(a.output, a.max_tokens, w.engine.max_model_len - a.prompt)
        if isinstance(w.engine, CompressionEngine):
            kv = w.engine.ragged
            d = kv.draw(er)
            was = d.decoding
            d.decoding = True
            final = kv.blocks_for(er, a.prompt + out)
            d.decoding = was
            return Footprint(kv.peak_units(er, out), final, 0, out)
        blocks = math.ceil((a.prompt + out) / w.engine.block_size)
        return Footprint(blocks, blocks, blocks, out)

    return fp


def with_oracle(fleet: KvFleet, settings: LedgerSettings, specs: SpecTable) -> KvFleet:
    """Give `fleet` an OracleLedger (built after the fleet, since the oracle reads its engines)."""
    fleet.ledger = OracleLedger(settings, specs, oracle_for(fleet))
    return fleet
