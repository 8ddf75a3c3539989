"""The kv-fit filter's two answers when a reserve plugin says "does not fit": `kv_full` (retryable: it fits an
empty worker) or `kv_exceeds_capacity` (final), decided by the plugin's `CapacityBound.exceeds_capacity`.
Fake checkers here; the ledger's own answer is in tests/kv/test_kv_ledger_sequences.py."""

from __future__ import annotations

import random

from scheduler.fleet import FleetView, WorkerView
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.filters import KvFitFilter
from scheduler.routing.framework import CapacityBound, Cycle, FitChecker, RouteRequest
from scheduler.routing.reasons import KV_EXCEEDS_FACT, REJECT_TABLE, FilterReason, Outcome, Reject
from tests.kv.kvkit import request, worker


class _Res:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    def release(self, outcome: Outcome) -> None:
        pass


class FullChecker:
    """Never fits now; `room` blocks per worker id could ever be reserved; the request needs `need`."""

    def __init__(self, need: int, room: dict[str, int]) -> None:
        self.need, self.room = need, room

    def fits(self, req: RouteRequest, worker: WorkerView, now: float) -> bool:
        return False

    def reserve(self, req: RouteRequest, worker: WorkerView, now: float) -> _Res | None:
        return None

    def exceeds_capacity(self, req: RouteRequest, worker: WorkerView) -> tuple[int, int] | None:
        room = self.room[worker.id]
        return None if self.need <= room else (self.need, room)


class PlainChecker:
    """A FitChecker without the CapacityBound face: "does not fit" stays `kv_full`."""

    def fits(self, req: RouteRequest, worker: WorkerView, now: float) -> bool:
        return False

    def reserve(self, req: RouteRequest, worker: WorkerView, now: float) -> _Res | None:
        return None


def _filter(checker: object, w: WorkerView) -> tuple[FilterReason | None, Cycle]:
    cycle = Cycle(request(), FleetView((w,)), 0.0, random.Random(0), reserve_plugins=[checker])  # type: ignore[list-item]
    return KvFitFilter().filter(cycle, w), cycle


def test_protocols() -> None:
    assert isinstance(FullChecker(1, {}), CapacityBound) and isinstance(FullChecker(1, {}), FitChecker)
    assert not isinstance(PlainChecker(), CapacityBound)


def test_filter_answers_exceeds_only_when_the_checker_says_never() -> None:
    w = worker("a")
    reason, cycle = _filter(FullChecker(60, {"a": 58}), w)
    assert reason is FilterReason.KV_EXCEEDS_CAPACITY
    assert cycle.facts[KV_EXCEEDS_FACT] == {"kv_need_blocks": 60, "kv_reservable_blocks": 58}
    reason, cycle = _filter(FullChecker(58, {"a": 58}), w)
    assert reason is FilterReason.KV_FULL and KV_EXCEEDS_FACT not in cycle.facts
    assert _filter(PlainChecker(), w)[0] is FilterReason.KV_FULL


def test_router_rejects_final_with_the_largest_workers_numbers() -> None:
    router = build_router(RoutingConfig(), reserve=[FullChecker(60, {"a": 49, "b": 58})])  # type: ignore[list-item]
    out = router.route(request(), FleetView((worker("a"), worker("b"))), 0.0, random.Random(0))
    assert isinstance(out, Reject)
    assert out.primary is FilterReason.KV_EXCEEDS_CAPACITY and not out.retryable and out.http_status == 400
    assert out.reason == "no worker fits: 2 kv_exceeds_capacity"
    assert out.details == {"kv_need_blocks": 60, "kv_reservable_blocks": 58}
    assert out.error_body("m")["error"]["message"] == (
        "The request's KV-cache footprint of 60 blocks exceeds the 58 blocks the largest worker of model "
        "'m' can reserve for one request; lower max_tokens (or n, or the prompt length)"
    )


def test_one_worker_that_could_fit_keeps_the_request_waiting() -> None:
    router = build_router(RoutingConfig(), reserve=[FullChecker(60, {"a": 49, "b": 60})])  # type: ignore[list-item]
    out = router.route(request(), FleetView((worker("a"), worker("b"))), 0.0, random.Random(0))
    assert isinstance(out, Reject)
    assert out.primary is FilterReason.KV_FULL and out.retryable and out.http_status == 429


def test_table_row() -> None:
    rule = REJECT_TABLE[FilterReason.KV_EXCEEDS_CAPACITY]
    assert (rule.status, rule.error_type, rule.code, rule.retryable) == (
        400,
        "BadRequestError",
        "kv_exceeds_capacity",
        False,
    )
    # without details (a reject built from counts alone) the message is the summary
    body = Reject.from_counts({FilterReason.KV_EXCEEDS_CAPACITY: 1}).error_body()
    assert body["error"]["message"] == "no worker fits: 1 kv_exceeds_capacity"
