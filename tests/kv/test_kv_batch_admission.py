"""Batch admission: CP-SAT never breaks capacity, never does worse than greedy, and beats it where greedy errs."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.fleet import LoraState, WorkerCapacity
from scheduler.kv.batch_admission import AdmissionParams, est_ttft_s, plan_admission
from scheduler.kv.ledger import KvLedger, LedgerSettings
from tests.kv.kvkit import request, worker


def test_cp_sat_packs_what_greedy_strands() -> None:
    # A (10 blocks, fast prefill) is every request's favourite; B (6 blocks) is slow.
    # Greedy: r0 (6 blocks) → A leaves 4; r1 (5) → B leaves 1; r2 (5) fits nowhere → 2 admitted.
    # Optimal: r0 → B (6 = 6), r1 and r2 → A (5 + 5 = 10) → 3 admitted.
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    workers = [worker("A", blocks=10, prefill_tps=10_000), worker("B", blocks=6, prefill_tps=100)]
    queue = [request("r0", 90, 6), request("r1", 74, 6), request("r2", 74, 6)]  # ceil(96/16)=6, ceil(80/16)=5
    greedy = plan_admission(queue, workers, ledger, 0.0, use_cp_sat=False)
    exact = plan_admission(queue, workers, ledger, 0.0, AdmissionParams(time_limit_ms=2000))
    assert greedy.assignments == (("r0", "A"), ("r1", "B"))
    assert exact.method == "cp-sat" and exact.status == "OPTIMAL"
    assert exact.assignments == (("r0", "B"), ("r1", "A"), ("r2", "A"))
    assert exact.objective > greedy.objective


def test_aging_lets_the_old_request_win_the_last_room() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    w = [worker("A", blocks=10)]
    queue = [request("young", 150, 10, arrival=99.0), request("old", 150, 10, arrival=0.0)]  # 10 blocks each
    plan = plan_admission(queue, w, ledger, 100.0, AdmissionParams(aging_s=10.0))
    assert plan.assignments == (("old", "A"),)  # weight 1 + 100/10 = 11 vs 1.1


def test_a_pinned_request_is_planned_only_on_its_worker() -> None:
    # A Responses continuation (`previous_response_id`) lives on the worker that stored the response: B, the
    # slow one. Unpinned, both requests would go to fast A; pinned, r0 goes to B or stays queued.
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    workers = [worker("A", blocks=20, prefill_tps=10_000), worker("B", blocks=6, prefill_tps=100)]
    pinned = replace(request("r0", 90, 6), pinned_worker="B")  # 6 blocks
    for cp_sat in (False, True):
        plan = plan_admission([pinned, request("r1", 90, 6)], workers, ledger, 0.0, use_cp_sat=cp_sat)
        assert plan.assignments == (("r0", "B"), ("r1", "A"))
    too_big = replace(
        request("r2", 200, 6), pinned_worker="B"
    )  # 13 blocks: fits A only, and may not go there
    assert plan_admission([too_big], workers, ledger, 0.0).assignments == ()


def test_a_lora_request_is_planned_only_on_workers_serving_its_adapter() -> None:
    # `sql` is served by slow B only: unfiltered, r0 would go to fast A, where the router would then refuse
    # it (no_adapter) at every tick and it would wait out its deadline in the queue.
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    a = worker("A", blocks=20, prefill_tps=10_000)
    b = replace(worker("B", blocks=6, prefill_tps=100), lora=LoraState(frozenset({"sql"})))
    sql = replace(request("r0", 90, 6), adapter="sql")
    for cp_sat in (False, True):
        plan = plan_admission([sql, request("r1", 90, 6)], [a, b], ledger, 0.0, use_cp_sat=cp_sat)
        assert plan.assignments == (("r0", "B"), ("r1", "A"))
    other = replace(request("r2", 90, 6), adapter="chat")
    assert plan_admission([other], [a, b], ledger, 0.0).assignments == ()


def test_priority_and_nothing_fits() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    plan = plan_admission([request("r", 1000, 1000)], [worker("A", blocks=10)], ledger, 0.0)
    assert plan.assignments == () and plan.method == "greedy"


@given(st.integers(0, 10_000), st.integers(1, 24), st.integers(1, 5))
@settings(max_examples=40, deadline=None)
def test_plans_never_exceed_free_pages_or_slots_and_cp_sat_never_loses(seed: int, n: int, m: int) -> None:
    rng = random.Random(seed)
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    workers = [
        worker(
            f"w{j}",
            blocks=rng.randint(5, 60),
            prefill_tps=rng.choice([500.0, 5000.0]),
            max_num_seqs=rng.randint(1, 6),
        )
        for j in range(m)
    ]
    for j, w in enumerate(workers):  # some already busy
        if rng.random() < 0.5:
            ledger.reserve(request(f"busy{j}", 16 * rng.randint(1, 4), 0), w, 0.0)
    queue = [
        request(
            f"q{i}",
            rng.randint(1, 400),
            rng.randint(1, 300),
            priority=rng.randint(0, 2),
            arrival=rng.uniform(0, 30),
        )
        for i in range(n)
    ]
    greedy = plan_admission(queue, workers, ledger, 30.0, use_cp_sat=False)
    exact = plan_admission(queue, workers, ledger, 30.0, AdmissionParams(time_limit_ms=50))
    assert exact.objective >= greedy.objective - 1e-9
    for plan in (greedy, exact):
        assert len({rid for rid, _ in plan.assignments}) == len(plan.assignments)
        by_id = {w.id: w for w in workers}
        used: dict[str, int] = {}
        for rid, wid in plan.assignments:
            req = next(q for q in queue if q.request_id == rid)
            used[wid] = used.get(wid, 0) + ledger.footprint(req, by_id[wid])[0].peak
        for wid, units in used.items():
            assert units <= ledger.free(by_id[wid])
            assert sum(1 for _, x in plan.assignments if x == wid) <= by_id[wid].capacity.max_num_seqs
    # and every planned reservation then succeeds on the ledger
    for rid, wid in exact.assignments:
        req = next(q for q in queue if q.request_id == rid)
        assert ledger.reserve(req, next(w for w in workers if w.id == wid), 30.0) is not None


@pytest.mark.parametrize("limit", [1.0, 5.0])
def test_time_limit_is_respected_roughly(limit: float) -> None:
    rng = random.Random(1)
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    workers = [worker(f"w{j}", blocks=rng.randint(50, 200)) for j in range(8)]
    queue = [request(f"q{i}", rng.randint(100, 3000), rng.randint(1, 500)) for i in range(32)]
    plan = plan_admission(queue, workers, ledger, 0.0, AdmissionParams(time_limit_ms=limit))
    assert plan.solve_ms < limit * 20 + 50  # the solver's own clock; generous for a loaded 2-core box


def test_est_ttft_prefills_the_prompt_on_one_engine_of_a_data_parallel_worker() -> None:
    one = WorkerCapacity(1000.0, 100.0, 1000, 16, 1.0, 256, 8192, 0.5)
    two = replace(one, prefill_tokens_per_s=2000.0, kv_blocks=2000, engines=2)  # two such engines
    r = request(prompt=400)
    # queue 600 at the worker's rate, the 400-token prompt at one engine's 1,000/s
    assert est_ttft_s(r, replace(worker(), capacity=two, inflight_prefill_tokens=600)) == pytest.approx(
        0.5 + 600 / 2000 + 400 / 1000
    )
    assert est_ttft_s(r, replace(worker(), capacity=one, inflight_prefill_tokens=600)) == pytest.approx(
        0.5 + 1000 / 1000
    )
