"""KV ledger: capacity, reserve/release exactly once, leases, reconcile, predicted mode, holds, invariants."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.fleet import EngineView, FleetView, Role
from scheduler.kv.ledger import KvLedger, LedgerSettings, SpecTable
from scheduler.length_predictor import LengthPredictor
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.framework import Decision
from scheduler.routing.reasons import FilterReason, Outcome, Reject
from tests.kv.kvkit import request, two_group_spec, worker


@pytest.mark.parametrize(
    ("settings_", "blocks", "scraped", "capacity"),
    [
        pytest.param(
            LedgerSettings(watermark=0.02), 100, None, 98, id="perf-model blocks: floor(100 · 0.98) = 98"
        ),
        pytest.param(
            LedgerSettings(watermark=0.02), 100, 200, 196, id="scraped num_gpu_blocks wins: 200 · 0.98"
        ),
        pytest.param(
            LedgerSettings(watermark=0.02, share=0.5), 100, None, 49, id="two gateways: floor(98 · 0.5) = 49"
        ),
        pytest.param(
            LedgerSettings(watermark=0.0, share=1 / 3), 100, None, 33, id="three gateways: floor(33.3) = 33"
        ),
    ],
)
def test_capacity(settings_: LedgerSettings, blocks: int, scraped: int | None, capacity: int) -> None:
    assert KvLedger(settings_).capacity(worker(blocks=blocks, scraped_blocks=scraped)) == capacity


def test_reserve_until_full_then_refuse() -> None:
    ledger, w = KvLedger(), worker(blocks=100)  # capacity 98
    made = [ledger.reserve(request(f"r{i}", 100, 50), w, 0.0) for i in range(10)]  # 10 blocks each
    assert all(r is not None for r in made[:9])
    assert made[9] is None  # 90 + 10 > 98
    assert ledger.reserved("w0") == 90
    assert ledger.stats.refused == 1
    assert ledger.fits(request("small", 100, 20), w, 0.0)  # ceil(120/16) = 8 ≤ 8 free


def test_release_is_idempotent_and_counted_once() -> None:
    ledger, w = KvLedger(), worker()
    r = ledger.reserve(request(), w, 0.0)
    assert r is not None
    r.release(Outcome.CLIENT_DISCONNECTED)
    r.release(Outcome.COMPLETED)
    assert ledger.reserved("w0") == 0
    assert r.outcome is Outcome.CLIENT_DISCONNECTED
    assert ledger.stats.released == {"client_disconnected": 1}
    assert ledger.stats.double_releases == 1


def test_context_manager_releases_with_the_outcome() -> None:
    ledger, w = KvLedger(), worker()
    with ledger.reserve(request("a"), w, 0.0) as r:  # type: ignore[union-attr]
        assert ledger.reserved("w0") == 10
    assert r.outcome is Outcome.COMPLETED
    with pytest.raises(RuntimeError), ledger.reserve(request("b"), w, 0.0) as r2:  # type: ignore[union-attr]
        raise RuntimeError("upstream died")
    assert r2.outcome is Outcome.WORKER_ERROR
    assert ledger.reserved("w0") == 0


def test_compression_worker_reserves_peak_then_steady_after_first_token() -> None:
    specs = SpecTable(by_pool={"comp": two_group_spec()})
    ledger = KvLedger(LedgerSettings(watermark=0.0), specs)
    w = worker(blocks=50, block_size=4, pool="comp")  # 50 blocks · 8 heads = 400 head-pages
    assert ledger.capacity(w) == 400
    r = ledger.reserve(request(prompt=100, max_out=10), w, 0.0)
    assert r is not None and r.units == 116  # test_kv_footprint: peak 116, steady 104
    r.first_token(1.0)
    assert ledger.reserved("w0") == 104
    r.first_token(2.0)  # once only
    assert ledger.reserved("w0") == 104


def test_prefill_worker_reserves_the_prompt_and_one_token() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    r = ledger.reserve(request(prompt=100, max_out=1000), worker(role=Role.PREFILL), 0.0)
    assert r is not None and r.units == 7  # ceil((100 + 1)/16), not ceil(1100/16) = 69


def test_lease_timeout_sweeps_lost_reservations() -> None:
    ledger, w = KvLedger(LedgerSettings(lease_s=10.0)), worker()
    a = ledger.reserve(request("a"), w, 0.0)
    b = ledger.reserve(request("b"), w, 5.0)
    assert a is not None and b is not None
    b.touch(8.0)  # renewed: expires at 18
    assert ledger.sweep(9.99) == []
    assert ledger.sweep(10.0) == [a]
    assert a.outcome is Outcome.LEASE_EXPIRED
    a.release(Outcome.COMPLETED)  # the late completion is a no-op
    assert ledger.reserved("w0") == 10 and ledger.stats.double_releases == 1
    assert ledger.sweep(18.0) == [b]
    assert ledger.reserved("w0") == 0


def test_reconcile_shrinks_capacity_by_unexplained_usage() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.02, reconcile_tolerance=0.02))
    w = worker(blocks=100)
    assert ledger.reserve(request(), w, 0.0) is not None  # 10 blocks
    [sample] = ledger.reconcile(FleetView((worker(blocks=100, kv_usage=0.5),)), 1.0)
    # used 50 − explained 10 − tolerance 2 = 38 withheld; error = (50 − 10) / 100
    assert sample.shrink_units == 38
    assert sample.error_frac == pytest.approx(0.4)
    assert ledger.capacity(w) == 98 - 38
    assert ledger.estimate_error("w0") == pytest.approx(0.4)
    ledger.reconcile([worker(blocks=100, kv_usage=0.05)], 2.0)  # usage fell back: nothing withheld
    assert ledger.capacity(w) == 98


def test_reconcile_counts_other_gateways_shares_and_recent_releases() -> None:
    ledger = KvLedger(LedgerSettings(share=0.5, reconcile_tolerance=0.0))
    w = worker(blocks=100)
    r = ledger.reserve(request(), w, 0.0)
    assert r is not None
    ledger.reconcile([worker(blocks=100, kv_usage=0.55)], 1.0)  # 55 ≤ 10 mine + 50 others'
    assert ledger.snapshot()["w0"]["shrink_units"] == 0
    r.release(Outcome.COMPLETED)  # the next scrape may still see these 10 blocks
    ledger.reconcile([worker(blocks=100, kv_usage=0.6)], 2.0)  # 60 ≤ 0 + 10 released + 50
    assert ledger.snapshot()["w0"]["shrink_units"] == 0


def test_predicted_mode_reserves_the_prediction_bounded_by_overbooking() -> None:
    ledger = KvLedger(LedgerSettings(mode="predicted", watermark=0.0, max_overbook_frac=0.2))
    w = worker(blocks=100)
    # predicted: ceil((100 + 60)/16) = 10 blocks; worst: ceil((100 + 380)/16) = 30 blocks
    made = [ledger.reserve(request(f"r{i}", 100, 380, predicted=60), w, 0.0) for i in range(5)]
    assert [m is not None for m in made] == [
        True,
        True,
        True,
        True,
        False,
    ]  # worst 4·30 = 120 ≤ 120; 150 > 120
    assert ledger.reserved("w0") == 40


def test_predicted_mode_grows_as_tokens_stream() -> None:
    pred = LengthPredictor(min_samples=1)
    ledger = KvLedger(LedgerSettings(mode="predicted", watermark=0.0), predictor=pred)
    w = worker(blocks=100)
    r = ledger.reserve(request("a", 100, 1000, predicted=60), w, 0.0)
    assert r is not None and r.units == 10
    assert r.on_tokens(30, 1.0)  # below the reservation: nothing to do
    assert r.units == 10
    assert r.on_tokens(60, 2.0)  # reached: nothing seen → double to 120 → ceil(220/16) = 14
    assert (r.reserved_output, r.units, ledger.reserved("w0")) == (120, 14, 14)
    assert ledger.stats.grows == 1


def test_grow_refused_when_the_worker_is_full() -> None:
    ledger = KvLedger(LedgerSettings(mode="predicted", watermark=0.0, max_overbook_frac=1.0))
    w = worker(blocks=20)
    # predicted ceil(160/16) = 10 each; worst ceil(300/16) = 19 each, 38 ≤ 20 · (1 + 1.0)
    r = ledger.reserve(request("a", 100, 200, predicted=60), w, 0.0)
    assert ledger.reserve(request("b", 100, 200, predicted=60), w, 0.0) is not None  # 20 = full
    assert r is not None and not r.on_tokens(60, 1.0)
    assert ledger.stats.grow_refused == 1 and ledger.reserved("w0") == 20


def test_preemptions_above_budget_halve_the_overbook_allowance() -> None:
    ledger = KvLedger(LedgerSettings(mode="predicted", max_overbook_frac=0.2, preemption_budget=0))
    ledger.reconcile([worker(kv_usage=0.0, preemptions=5)], 0.0)  # first sight: baseline only
    assert ledger._books["w0"].overbook == pytest.approx(0.2)
    ledger.reconcile([worker(kv_usage=0.0, preemptions=7)], 1.0)
    assert ledger._books["w0"].overbook == pytest.approx(0.1)
    ledger.reconcile([worker(kv_usage=0.0, preemptions=7)], 2.0)  # none: regrow by max/4
    assert ledger._books["w0"].overbook == pytest.approx(0.15)


def test_hold_keeps_room_for_the_aged_request_only() -> None:
    ledger, w = KvLedger(LedgerSettings(watermark=0.0)), worker(blocks=20)
    ledger.hold("big", w, 15, 0.0)
    assert not ledger.fits(request("small", 100, 0), w, 0.0)  # 7 blocks > 20 − 15
    big = ledger.reserve(request("big", 200, 0), w, 0.0)  # 13 blocks, may use its own hold
    assert big is not None and ledger.snapshot()["w0"]["holds"] == 0


def test_an_unclaimed_hold_lapses_with_the_lease() -> None:
    ledger, w = KvLedger(LedgerSettings(watermark=0.0, lease_s=10.0)), worker(blocks=20)
    ledger.hold("gone", w, 15, 0.0)  # the request hit its deadline and never came back
    assert not ledger.fits(request("small", 100, 0), w, 5.0)
    ledger.sweep(10.0)
    assert ledger.fits(request("small", 100, 0), w, 10.0)


def test_router_reserves_through_the_ledger_and_rejects_kv_full() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    router = build_router(RoutingConfig(), reserve=[ledger])
    view = FleetView((worker("a", blocks=20), worker("b", blocks=12)))  # room for 2 + 1 requests of 10 blocks
    rng = random.Random(0)
    decisions = [router.route(request(f"r{i}", 160, 0), view, 0.0, rng) for i in range(3)]
    assert all(isinstance(d, Decision) for d in decisions)
    assert (ledger.reserved("a"), ledger.reserved("b")) == (20, 10)
    fourth = router.route(request("r4", 160, 0), view, 0.0, rng)  # 0 and 2 blocks free
    assert isinstance(fourth, Reject) and fourth.primary is FilterReason.KV_FULL and fourth.retryable
    assert fourth.counts[FilterReason.KV_FULL] == 2
    decisions[0].release(Outcome.COMPLETED)  # type: ignore[union-attr]
    assert isinstance(router.route(request("r4", 160, 0), view, 1.0, rng), Decision)


# ------------------------------------------------------------------------------------------------
# Property: under any interleaving of reserves, completions, errors, disconnects, duplicate releases,
# first tokens, growth and lease sweeps, reserved never exceeds capacity (a request alone on its worker or
# engine: the lone room), every reservation ends exactly once, and the books always equal the sum of live
# reservations.

OUTCOMES = [
    Outcome.COMPLETED,
    Outcome.WORKER_ERROR,
    Outcome.CLIENT_DISCONNECTED,
    Outcome.FAILED_BEFORE_FIRST_BYTE,
]

op = st.one_of(
    st.tuples(
        st.just("reserve"), st.integers(0, 2), st.integers(1, 400), st.integers(1, 300), st.integers(1, 300)
    ),
    st.tuples(st.just("release"), st.integers(0, 1000), st.sampled_from(OUTCOMES)),
    st.tuples(st.just("first_token"), st.integers(0, 1000)),
    st.tuples(st.just("tokens"), st.integers(0, 1000), st.integers(0, 400)),
    st.tuples(st.just("advance"), st.floats(0.0, 30.0)),
)


@given(st.lists(op, max_size=80), st.sampled_from(["worst_case", "predicted"]), st.booleans(), st.booleans())
@settings(max_examples=120, deadline=None)
def test_ledger_invariants_under_random_lifecycles(
    ops: list[tuple], mode: str, compressed: bool, data_parallel: bool
) -> None:
    specs = SpecTable(by_pool={"p": two_group_spec()}) if compressed else SpecTable()
    settings_ = LedgerSettings(mode=mode, lease_s=20.0)  # type: ignore[arg-type]
    ledger = KvLedger(settings_, specs, LengthPredictor(min_samples=1))
    workers = [worker(f"w{i}", blocks=40 + 20 * i, block_size=4) for i in range(3)]
    engine_caps: list[tuple[int, int]] = []  # per engine: (capacity, lone room)
    if data_parallel:  # w2 (80 blocks) as two engines of 40: each request's pages within one engine
        workers[2] = replace(workers[2], engines=(EngineView(0, 40), EngineView(1, 40)))
        engine = worker("w2", blocks=40, block_size=4)
        fresh = KvLedger(settings_, specs)
        engine_caps = [(fresh.capacity(engine), fresh.lone_room(engine) or 0)] * 2
    # a request alone on a worker (engine) may take every block but the null one, past the watermark
    lone = [KvLedger(settings_, specs).lone_room(w) or 0 for w in workers]
    made = []
    now = 0.0
    for o in ops:
        if o[0] == "reserve":
            _, wi, prompt, max_out, pred = o
            r = ledger.reserve(
                request(f"r{len(made)}", prompt, max_out, predicted=min(pred, max_out)), workers[wi], now
            )
            if r is not None:
                made.append(r)
        elif o[0] == "advance":
            now += o[1]
            ledger.sweep(now)
        elif made:
            r = made[o[1] % len(made)]
            if o[0] == "release":
                r.release(o[2])
            elif o[0] == "first_token":
                r.first_token(now)
            else:
                r.on_tokens(o[2], now)
        for w, lone_w in zip(workers, lone, strict=True):
            live = [x for x in made if x.worker_id == w.id and x.outcome is None]
            assert ledger.reserved(w.id) == sum(x.units for x in live)
            if w.engines:
                for e, (cap, lone_e) in enumerate(engine_caps):
                    on_e = [x.units for x in live if x.engine == e]
                    assert sum(on_e) <= (lone_e if len(on_e) == 1 else cap)
                assert all(x.engine in (0, 1) for x in live)
            else:
                assert ledger.reserved(w.id) <= (lone_w if len(live) == 1 else ledger.capacity(w))
    for r in made:  # the gateway's finally: release everything still held
        r.release(Outcome.COMPLETED)
    assert all(ledger.reserved(w.id) == 0 for w in workers)
    assert sum(ledger.stats.released.values()) == len(made)  # each ended exactly once
    assert all(r.outcome is not None for r in made)


def test_one_request_sized_across_workers_of_different_specs_and_roles() -> None:
    """Footprints are shared by workers of one spec (computed once per request and spec), never across
    specs or roles: asked in any order, each worker gets what a fresh ledger computes for it alone."""
    fleet = [
        worker("a16", block_size=16),
        worker("b16", block_size=16),
        worker("c32", block_size=32, pool="q"),
        worker("p16", block_size=16, role=Role.PREFILL),
        worker("d16", block_size=16, max_model_len=4096),
    ]
    r = request("r", 1000, 300)
    shared = KvLedger(LedgerSettings(mode="predicted"))
    for order in (fleet, fleet[::-1]):
        got = {w.id: shared.footprint(r, w) for w in order}
        assert got == {w.id: KvLedger(LedgerSettings(mode="predicted")).footprint(r, w) for w in fleet}
    units = {w.id: shared.footprint(r, w)[1].peak for w in fleet}
    assert units["a16"] == units["b16"] == units["d16"] == 82  # ceil(1,300 / 16) blocks
    assert units["c32"] == 41  # ceil(1,300 / 32): another spec, not the 16-token pool's 82
    assert units["p16"] == 63  # the prefill side: prompt + 1 token, ceil(1,001 / 16)
