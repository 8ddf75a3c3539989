"""The KV ledger's part in the gateway's admission queue (`server.admission.QueuePolicy`): backfill,
aging holds and the batch-admission tick.

**Backfill** (`kv.queue.backfill`, default 32): the first 1 + backfill waiters of a model may each ask
the router when it is their turn, so small requests use KV that the large request at the head cannot.

**Aging** (`kv.queue.aging_s`, default 2 s): once the head has waited that long, it gets a ledger hold
(`KvLedger.hold`) of its footprint's peak on its *best worker* — among the model's routable decode/mixed
workers where it could ever fit, the one with the most free units per unit it needs (closest to fitting),
ties by id. Other requests cannot reserve held pages, so that worker drains towards the head's need and
the head is dispatched as soon as its hold covers it (the router's `kv-fit` lets the holder use its own
hold). The hold stays on that worker while it remains a candidate. It is dropped when the waiter leaves
the queue for any reason — admitted (the reservation replaces it), deadline (429), client disconnect —
and lapses after `kv.lease_s` if it ever leaked.

**Batch** (`kv.batch_admission.enabled`, off by default): the head waiter runs one tick at a time per
model: `build_instance` over the first `max_head` waiters × the model's routable decode/mixed workers
(on the event loop, against the live ledger), `solve_instance` (CP-SAT under `time_limit_ms`, hinted with
greedy; greedy alone with `solver: greedy`) on a worker thread so the loop keeps serving, then each
assignment is routed by the router restricted to its planned worker (every other decode/mixed worker
excluded; P/D prefill workers stay eligible). The router's `kv-fit` filter and the ledger's `reserve` are
the authority, so a plan made against a ledger that changed during the solve can never over-commit: an
assignment that no longer fits is simply not admitted this tick. In batch mode aging is the plan's weight
(1 + age / `batch_admission.aging_s`), not holds.

**Keys.** Request ids come from the client (`X-Request-Id`) and may repeat, so nothing here is keyed by them:
a waiter's hold is keyed by a gateway-unique waiter key (`hold_key`: the request id while no other live
waiter uses it, else `<id>#<n>`) and plans are answered by `server.admission.plan_keys` (the request id,
made unique within the planned head), and a hold belongs to the waiter's ticket (`RouteRequest.holder`, the
gateway's number for the request). Two waiters with one id neither drop each other's hold nor overwrite each
other's planned decision (which would leak its reservation until the lease sweep), and neither can use or
remove the pages held for the other.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.fleet import FleetView, Role, WorkerState, WorkerView
from scheduler.kv.batch_admission import build_instance, solve_instance
from scheduler.kv.config import KvConfig, admission_params
from scheduler.kv.ledger import KvLedger
from scheduler.routing.framework import Decision, RouteRequest
from scheduler.routing.lora import serves
from scheduler.routing.reasons import Outcome, Reject
from server.admission import plan_keys

RouteFn = Callable[[RouteRequest, frozenset[str]], Decision | Reject]


@dataclass(slots=True)
class KvQueueStats:
    holds: int = 0  # holds placed (a move to another worker counts again)
    holds_dropped: int = 0  # holds removed when their waiter left
    ticks: int = 0
    planned: int = 0  # assignments in the plans
    admitted: int = 0  # assignments the router then admitted on the planned worker
    methods: Counter[str] = field(default_factory=Counter)  # "cp-sat" / "greedy" plans
    last_solve_ms: float = 0.0


def candidates(view: FleetView, model: str) -> list[WorkerView]:
    """The workers a queued request of `model` can be reserved on: ready decode/mixed, breaker closed."""
    return [
        w
        for w in view.for_model(model)
        if w.role != Role.PREFILL and w.state is WorkerState.READY and not w.breaker_open
    ]


class KvQueuePolicy:
    """`QueuePolicy[Decision]` for `AdmissionQueue` (see the module docstring)."""

    def __init__(
        self,
        cfg: KvConfig,
        ledger: KvLedger,
        view: Callable[[], FleetView],
        route: RouteFn,
        clock: Callable[[], float],
    ) -> None:
        self.ledger = ledger
        self._view = view
        self._route = route
        self._clock = clock
        self.backfill = cfg.queue.backfill
        self.aging_s = cfg.queue.aging_s
        self.batch = cfg.batch_admission.enabled
        self.max_head = cfg.batch_admission.max_head
        self.params = admission_params(cfg)
        self.use_cp_sat = cfg.batch_admission.solver == "cp-sat"
        self.held: dict[str, str] = {}  # waiter key (`hold_key`) → worker id of its hold
        self._keys: dict[int, str] = {}  # id() of a live waiter's RouteRequest → its waiter key
        self._seq = 0
        self.stats = KvQueueStats()

    def hold_key(self, req: RouteRequest) -> str:
        """The waiter's gateway-unique key (kept until `leave(req)`; the queue passes the same object)."""
        key = self._keys.get(id(req))
        if key is None:
            key = req.request_id
            if key in self.held or key in self._keys.values():
                self._seq += 1
                key = f"{req.request_id}#{self._seq}"
            self._keys[id(req)] = key
        return key

    # ---- aging ----------------------------------------------------------------------------------
    def before_attempt(self, req: RouteRequest, waited_s: float) -> None:
        if self.aging_s is None or waited_s < self.aging_s:
            return
        workers = [w for w in candidates(self._view(), req.model) if serves(w, req.adapter)]
        if req.pinned_worker is not None:  # a continuation can only ever run on its own worker
            workers = [w for w in workers if w.id == req.pinned_worker]
        rid = self.hold_key(req)
        current = next((w for w in workers if w.id == self.held.get(rid)), None)
        if current is not None and self.ledger.can_ever_fit(req, current):
            target = current
        else:
            fits = [w for w in workers if self.ledger.can_ever_fit(req, w)]
            if not fits:
                return  # nowhere it could ever fit: the router's reject says why, the deadline ends it
            target = max(fits, key=lambda w: (self._closeness(req, w), w.id))
            if rid in self.held:
                self.ledger.drop_hold(rid)
            self.stats.holds += 1
        need = self.ledger.footprint(req, target)[0].peak
        self.ledger.hold(rid, target, need, self._clock(), owner=req.holder)  # (re)set, renewed
        self.held[rid] = target.id

    def _closeness(self, req: RouteRequest, w: WorkerView) -> float:
        """Free units per unit needed (1 = fits now): units differ between stock and compression workers."""
        return self.ledger.free(w, req.holder) / max(1, self.ledger.footprint(req, w)[0].peak)

    def leave(self, req: RouteRequest) -> None:
        key = self._keys.pop(id(req), None)
        if key is not None and self.held.pop(key, None) is not None:
            self.ledger.drop_hold(key)
            self.stats.holds_dropped += 1

    # ---- batch ----------------------------------------------------------------------------------
    async def plan(self, model: str, reqs: list[RouteRequest]) -> dict[str, Decision]:
        """Decisions for some of `reqs`, by `server.admission.plan_keys(reqs)` (request ids may repeat)."""
        workers = candidates(self._view(), model)
        inst = build_instance(reqs, workers, self.ledger, self._clock(), self.params)
        if self.use_cp_sat and inst.value:
            plan = await asyncio.to_thread(solve_instance, inst, self.params, True)
        else:
            plan = solve_instance(inst, self.params, False)
        self.stats.ticks += 1
        self.stats.methods[plan.method] += 1
        self.stats.last_solve_ms = plan.solve_ms
        self.stats.planned += len(plan.assignments)
        ids = frozenset(w.id for w in workers)
        keys = plan_keys(reqs)
        out: dict[str, Decision] = {}
        try:
            for i, j in plan.indices:
                wid = inst.worker_ids[j]
                decision = self._route(reqs[i], ids - {wid})
                if not isinstance(decision, Decision):
                    continue  # no longer fits there (the ledger moved during the solve): stays queued
                if decision.decode.id != wid:  # a worker that joined after the plan's view: not the plan
                    self.discard(decision)
                    continue
                if keys[i] in out:  # cannot happen (one assignment per request); never drop a reservation
                    self.discard(decision)
                    continue
                out[keys[i]] = decision
                self.stats.admitted += 1
        except BaseException:
            for decision in out.values():  # nobody will receive them: release, never leak
                self.discard(decision)
            raise
        return out

    def discard(self, decision: Decision) -> None:
        decision.release(Outcome.UNRESERVED)
