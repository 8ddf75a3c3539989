"""KV ledger on data-parallel workers: one book per engine, the request pinned to the engine it was booked on.

Every request here is hand-sized on 16-token blocks in worst-case mode: prompt + max_tokens tokens, rounded up
to blocks (1,000 + 40 → 65 blocks; 440 + 40 → 30; 1,240 + 40 → 80; 1,720 + 40 → 110). Watermark 0 keeps the
arithmetic exact (capacity = blocks).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from scheduler.fleet import EngineView, FleetView, WorkerView
from scheduler.kv.ledger import KvLedger, LedgerSettings
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.framework import Decision, RouteRequest
from scheduler.routing.reasons import Outcome
from tests.kv.kvkit import request, worker


def dp_worker(*blocks: int, wid: str = "w0", usage: tuple[float | None, ...] = ()) -> WorkerView:
    engines = tuple(
        EngineView(rank, b, usage[rank] if rank < len(usage) else None) for rank, b in enumerate(blocks)
    )
    return replace(worker(wid, blocks=sum(blocks), scraped_blocks=sum(blocks)), engines=engines)


def exact(per_engine: bool = True, **kw: float) -> KvLedger:
    return KvLedger(LedgerSettings(watermark=0.0, per_engine=per_engine, **kw))


def r65(rid: str) -> RouteRequest:
    return request(rid, 1000, 40)


def test_two_100_block_engines_admit_two_65_block_requests_not_three() -> None:
    w = dp_worker(100, 100)
    ledger = exact()
    made = [ledger.reserve(request(f"r{i}", 1000, 40), w, 0.0) for i in range(3)]
    assert [m.engine if m else None for m in made] == [0, 1, None]  # the third fits neither engine's 35 free
    assert all(m.worker_id == "w0" for m in made if m)  # the worker's id, whatever engine it is booked on
    assert ledger.reserved("w0") == 130 and ledger.stats.refused == 1
    # pooled (kv.data_parallel: pooled): the 200-block sum admits all three, and one engine must preempt
    pooled = exact(per_engine=False)
    assert all(pooled.reserve(request(f"r{i}", 1000, 40), w, 0.0) for i in range(3))
    assert [m.engine for m in pooled.active("w0")] == [None, None, None]  # nothing to pin


def test_the_engine_with_the_most_free_units_is_booked_lower_rank_first_on_ties() -> None:
    w = dp_worker(100, 100)
    ledger = exact()
    a = ledger.reserve(request("a", 440, 40), w, 0.0)  # 30 blocks; tie 100/100 → rank 0
    b = ledger.reserve(request("b", 1000, 40), w, 0.0)  # 65; free 70/100 → rank 1
    c = ledger.reserve(request("c", 440, 40), w, 0.0)  # 30; free 70/35 → rank 0
    assert (a and a.engine, b and b.engine, c and c.engine) == (0, 1, 0)
    assert ledger.free(w) == 40 and ledger.capacity(w) == 100  # the roomiest engine: 100 − 60
    assert c is not None
    c.release(Outcome.COMPLETED)
    assert ledger.free(w) == 70
    d = ledger.reserve(request("d", 1000, 40), w, 0.0)  # 65; free 70/35 → rank 0 again
    assert d is not None and d.engine == 0 and ledger.free(w) == 35


def test_worker_level_answers_are_the_roomiest_engines() -> None:
    w = dp_worker(100, 60)
    ledger = exact()
    assert ledger.total_units(w) == 160
    assert ledger.fits(request("x", 1240, 40), w, 0.0)  # 80 blocks: engine 0 only
    assert ledger.can_ever_fit(request("x", 1240, 40), w)
    # 110 blocks: less than the 160 the engines sum to, more than either holds → a final refusal's bound
    big = request("big", 1720, 40)
    assert not ledger.fits(big, w, 0.0) and not ledger.can_ever_fit(big, w)
    assert ledger.exceeds_capacity(big, w) == (110, 100)
    assert ledger.exceeds_capacity(request("x", 1240, 40), w) is None
    assert exact(per_engine=False).exceeds_capacity(big, w) is None  # pooled: the sum hides it


def test_a_hold_sits_in_one_engine_and_its_owner_is_booked_there() -> None:
    w = dp_worker(100, 100)
    ledger = exact()
    first = ledger.reserve(request("first", 440, 40), w, 0.0)  # 30 on rank 0
    assert first is not None and first.engine == 0
    ledger.hold("big", w, 80, 0.0)  # in the roomiest engine: rank 1 (100 free against 70)
    assert ledger.snapshot()["w0"]["holds"] == 80
    other = ledger.reserve(request("other", 1000, 40), w, 0.0)  # 65: rank 1 keeps only 20 for others
    assert other is not None and other.engine == 0
    assert not ledger.fits(request("more", 440, 40), w, 0.0)  # 5 free on rank 0, 20 on rank 1
    owner = ledger.reserve(request("big", 1240, 40), w, 0.0)  # 80 blocks: its own hold
    assert owner is not None and owner.engine == 1
    assert ledger.snapshot()["w0"]["holds"] == 0  # the reservation replaced the hold


def test_hold_moves_with_the_room_and_is_not_kept_twice() -> None:
    w = dp_worker(100, 100)
    ledger = exact()
    ledger.hold("k", w, 50, 0.0)  # rank 0 (tie)
    r = ledger.reserve(request("x", 1000, 40), w, 0.0)  # 65 → rank 1 (50 free for others on rank 0)
    assert r is not None and r.engine == 1
    ledger.hold("k", w, 50, 1.0)  # renewed: rank 0 still has the most room for k (100 vs 35)
    assert ledger.snapshot()["w0"]["holds"] == 50
    r.release(Outcome.COMPLETED)
    ledger.reserve(request("y", 1240, 40, predicted=None), w, 0.0)  # 80 on rank 1 (100 vs 50 for others)
    ledger.hold("k", w, 50, 2.0)  # rank 0 (100 free for k) against rank 1 (20): stays; one hold only
    assert ledger.snapshot()["w0"]["holds"] == 50
    ledger.drop_hold("k")
    assert ledger.snapshot()["w0"]["holds"] == 0


def test_each_engine_is_reconciled_against_its_own_usage() -> None:
    ledger = exact(reconcile_tolerance=0.02)
    w = dp_worker(100, 100)
    [s0, s1] = ledger.reconcile(FleetView((dp_worker(100, 100, usage=(0.0, 0.5)),)), 1.0)
    # engine 1 shows 50 blocks nobody here reserved: 50 − 2 (tolerance) withheld there only
    assert (s0.worker_id, s0.shrink_units, s1.worker_id, s1.shrink_units) == ("w0#dp0", 0, "w0#dp1", 48)
    assert ledger.snapshot()["w0"]["shrink_units"] == 48
    assert ledger.estimate_error("w0") == pytest.approx(0.5)  # the engine furthest from its reservations
    first = ledger.reserve(r65("a"), w, 0.0)
    assert first is not None and first.engine == 0
    assert ledger.reserve(r65("b"), w, 0.0) is None  # engine 1 has 52 left
    # a worker-wide usage (0.25 = 50 of 200 blocks) would have explained it with room to spare: pooled
    pooled = exact(per_engine=False, reconcile_tolerance=0.02)
    [p] = pooled.reconcile(FleetView((replace(dp_worker(100, 100), kv_usage=0.25),)), 1.0)
    assert p.shrink_units == 46  # 50 − 4: the pooled book only sees the sum


def test_engine_books_leave_with_the_worker_and_when_it_restarts_without_engines() -> None:
    ledger = exact()
    w = dp_worker(100, 100)
    r = ledger.reserve(r65("a"), w, 0.0)
    assert r is not None
    ledger.reconcile(FleetView(()), 1.0)  # discovery removed w0: forgotten once its reservation ends
    assert "w0" in ledger.snapshot()
    r.release(Outcome.COMPLETED)
    assert ledger.snapshot() == {}
    # restarted with one engine: the engines' books go, the worker is one book again
    ledger.reserve(r65("b"), w, 0.0)
    ledger.active("w0")[0].release(Outcome.COMPLETED)
    single = worker("w0", blocks=100, scraped_blocks=100)
    s = ledger.reserve(r65("c"), single, 0.0)
    assert s is not None and s.engine is None and s.book_id == "w0"
    assert ledger.snapshot()["w0"]["total_units"] == 100
    assert ledger.free(single) == 35


def test_a_single_book_goes_once_the_worker_turns_out_data_parallel() -> None:
    """Booked as one engine before its first scrape (no engines known), then scraped as two: the single book
    was kept for good beside the engines' (total_units 400 for a 200-block server)."""
    ledger = exact()
    before = worker("w0", blocks=200)
    r = ledger.reserve(r65("a"), before, 0.0)
    assert r is not None and r.book_id == "w0" and r.engine is None
    w = dp_worker(100, 100)
    assert ledger.reserve(r65("b"), w, 1.0) is not None  # now booked per engine
    assert ledger.snapshot()["w0"]["total_units"] == 200 + 200  # the old book lives while "a" runs there
    r.release(Outcome.COMPLETED)
    for res in ledger.active("w0"):
        res.release(Outcome.COMPLETED)
    ledger.reconcile(FleetView((w,)), 5.0)
    assert ledger.snapshot()["w0"]["total_units"] == 200
    assert ledger.free(w) == 100


def test_a_listed_dp_worker_keeps_its_engine_books_through_reconciles() -> None:
    ledger = exact(reconcile_tolerance=0.0)
    w = dp_worker(100, 100, usage=(0.65, 0.0))
    r = ledger.reserve(r65("a"), w, 0.0)
    assert r is not None and r.engine == 0
    r.release(Outcome.COMPLETED)  # the next scrape may still show its 65 blocks on engine 0
    ledger.reconcile(FleetView((w,)), 1.0)  # the whole fleet, w0 in it: its books are kept, with that release
    assert ledger.snapshot()["w0"]["shrink_units"] == 0  # 65 used, explained by the 65 just released
    assert ledger.snapshot()["w0"]["total_units"] == 200


def test_a_lost_completion_on_an_engine_is_released_by_the_sweep() -> None:
    ledger = exact(lease_s=10.0)
    w = dp_worker(100, 100)
    r = ledger.reserve(r65("a"), w, 0.0)
    assert r is not None and r.engine == 0
    assert ledger.sweep(11.0) == [r] and r.outcome is Outcome.LEASE_EXPIRED
    assert ledger.reserved("w0") == 0 and ledger.free(w) == 100


def test_the_router_books_an_engine_and_the_decision_carries_it() -> None:
    ledger = exact()
    router = build_router(RoutingConfig(), reserve=[ledger])
    view = FleetView((dp_worker(100, 100),))
    engines = []
    for i in range(2):
        d = router.route(request(f"r{i}", 1000, 40), view, float(i), random.Random(0))
        assert isinstance(d, Decision)
        [res] = d.reservations
        engines.append(getattr(res, "engine", None))
    assert engines == [0, 1]
