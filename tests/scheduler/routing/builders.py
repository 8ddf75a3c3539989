"""Small builders and fakes for the router tests: `worker(gpu="L4", inflight=3)`, `req(prompt=512)`,
a recording plugin that logs every call the cycle runner makes, and a counting KV ledger."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.fleet import FleetView, Role, WorkerCapacity, WorkerState, WorkerView, capacity_for
from scheduler.routing.framework import Cycle, Filter, RouteRequest, SchedulingProfile, Scored, WeightedScorer
from scheduler.routing.reasons import FilterReason, Outcome

MODEL = "llama-3-8b"


@functools.cache
def cap(gpu: str = "L4", model: str = MODEL) -> WorkerCapacity:
    return capacity_for(gpu, model)


def worker(
    id: str | None = None,
    *,
    gpu: str = "L4",
    role: Role | str = Role.MIXED,
    state: WorkerState | str = WorkerState.READY,
    model: str = MODEL,
    breaker: bool = False,
    inflight: int = 0,
    prefill_tokens: int = 0,
    running: int | None = None,
    waiting: int | None = None,
    kv_usage: float | None = None,
    capacity: WorkerCapacity | None = None,
    **extra: Any,
) -> WorkerView:
    return WorkerView(
        id=id or f"{gpu.lower()}-{Role(role).value}",
        url=f"http://{id or gpu.lower()}:8000",
        pool=f"{Role(role).value}-{gpu.lower()}",
        model=model,
        gpu=gpu,
        role=Role(role),
        state=WorkerState(state),
        breaker_open=breaker,
        capacity=capacity or cap(gpu),  # the served name may be any string; capacity is for llama-3-8b
        num_running=running,
        num_waiting=waiting,
        kv_usage=kv_usage,
        inflight_requests=inflight,
        inflight_prefill_tokens=prefill_tokens,
        **extra,
    )


def view(*workers: WorkerView) -> FleetView:
    return FleetView(tuple(workers))


def req(
    prompt: int = 512,
    output: int = 256,
    *,
    max_output: int | None = None,
    model: str = MODEL,
    prefix: tuple[int, ...] = (),
    id: str = "r1",
) -> RouteRequest:
    return RouteRequest(id, model, prompt, max_output if max_output is not None else output, output, prefix)


# ---------------------------------------------------------------------------------------------------
# Fakes


@dataclass
class Recorder:
    """A shared call log: each fake appends (plugin, method, worker ids...)."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)


class RecordingFilter:
    """Rejects the workers in `reject` with `reason`; logs every call."""

    def __init__(self, rec: Recorder, name: str, reject: dict[str, FilterReason] | None = None) -> None:
        self.rec, self.name, self.reject = rec, name, reject or {}

    def filter(self, cycle: Cycle, worker: WorkerView) -> FilterReason | None:
        self.rec.calls.append((self.name, "filter", worker.id))
        return self.reject.get(worker.id)


class RecordingScorer:
    """Scores from a table (worker id → score, default 0.5); logs the candidates it was given."""

    def __init__(self, rec: Recorder, name: str, scores: dict[str, float] | None = None) -> None:
        self.rec, self.name, self.scores = rec, name, scores or {}

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> list[float]:
        self.rec.calls.append((self.name, "score", tuple(w.id for w in candidates)))
        return [self.scores.get(w.id, 0.5) for w in candidates]


class RecordingPicker:
    """Orders by total descending, then id; logs the totals it saw."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def pick(self, cycle: Cycle, scored: Sequence[Scored]) -> list[WorkerView]:
        self.rec.calls.append(("picker", "pick", tuple((s.worker.id, round(s.total, 9)) for s in scored)))
        return [s.worker for s in sorted(scored, key=lambda s: (-s.total, s.worker.id))]


@dataclass
class FakeReservation:
    worker_id: str
    plugin: str
    rec: Recorder
    releases: list[Outcome] = field(default_factory=list)

    def release(self, outcome: Outcome) -> None:
        self.releases.append(outcome)
        self.rec.calls.append((self.plugin, "release", self.worker_id, outcome))


class RecordingReserve:
    """Refuses the workers in `refuse`; keeps every reservation it made (to count releases)."""

    def __init__(self, rec: Recorder, name: str, refuse: set[str] | None = None) -> None:
        self.rec, self.name, self.refuse = rec, name, refuse or set()
        self.made: list[FakeReservation] = []

    def reserve(self, req: RouteRequest, worker: WorkerView, now: float) -> FakeReservation | None:
        self.rec.calls.append((self.name, "reserve", worker.id))
        if worker.id in self.refuse:
            return None
        r = FakeReservation(worker.id, self.name, self.rec)
        self.made.append(r)
        return r


class BlockLedger:
    """A real-enough ReservePlugin: per-worker block budget, debit on reserve, credit on first release.

    Also a FitChecker. `double_releases` counts releases after the first (must stay 0)."""

    def __init__(self, budget: dict[str, int]) -> None:
        self.budget = dict(budget)
        self.used = dict.fromkeys(budget, 0)
        self.double_releases = 0
        self.outstanding: list[LedgerReservation] = []

    def need(self, req: RouteRequest, worker: WorkerView) -> int:
        return worker.blocks_for(req.prompt_tokens + req.max_output_tokens)

    def fits(self, req: RouteRequest, worker: WorkerView, now: float) -> bool:
        return self.used[worker.id] + self.need(req, worker) <= self.budget[worker.id]

    def reserve(self, req: RouteRequest, worker: WorkerView, now: float) -> LedgerReservation | None:
        if not self.fits(req, worker, now):
            return None
        n = self.need(req, worker)
        self.used[worker.id] += n
        r = LedgerReservation(worker.id, n, self)
        self.outstanding.append(r)
        return r


@dataclass
class LedgerReservation:
    worker_id: str
    blocks: int
    ledger: BlockLedger
    released: int = 0

    def release(self, outcome: Outcome) -> None:
        self.released += 1
        if self.released > 1:
            self.ledger.double_releases += 1
            return
        self.ledger.used[self.worker_id] -= self.blocks


def profile(
    name: str = "mixed",
    *,
    roles: frozenset[Role] = frozenset(Role),
    filters: Sequence[Filter] = (),
    scorers: Sequence[tuple[str, Any, float]] = (),
    picker: Any,
) -> SchedulingProfile:
    return SchedulingProfile(
        name, roles, tuple(filters), tuple(WeightedScorer(n, s, w) for n, s, w in scorers), picker
    )
