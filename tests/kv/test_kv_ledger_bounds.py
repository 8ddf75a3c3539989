"""Bounds the ledger promises (docs/kv.md), as a review found them broken: the worst-case sum under
overbooking, growth made before the first token, and vLLM's null block under any watermark and unit."""

from __future__ import annotations

from scheduler.kv.footprint import CompressionSpec
from scheduler.kv.ledger import KvLedger, LedgerSettings, SpecTable
from scheduler.length_predictor import LengthPredictor
from tests.kv.kvkit import request, worker


def test_predicted_mode_bounds_the_worst_case_sum_whatever_each_request_predicts() -> None:
    """Capacity 100, allowance 10%: an overbooked request (2 blocks reserved, 105 worst case) and then an exact
    one (98, prediction = worst case) were both admitted, worst cases summing to 203 > 110 (the bound was only
    checked for requests predicted below their worst case)."""
    led = KvLedger(LedgerSettings(mode="predicted", watermark=0.0, max_overbook_frac=0.1))
    w = worker(blocks=100, block_size=16)
    a = led.reserve(request("a", prompt=16, max_out=16 * 104, predicted=16), w, 0.0)
    assert a is not None and (a.units, a.worst_units) == (2, 105)
    assert led.reserve(request("b", prompt=16 * 98, max_out=0, predicted=0), w, 0.0) is None
    assert led.stats.refused == 1
    small = led.reserve(request("c", prompt=16 * 5, max_out=0, predicted=0), w, 0.0)  # 105 + 5 ≤ 110
    assert small is not None and led._books["w0"].worst_reserved == 110


def test_growth_before_the_first_token_survives_it() -> None:
    """Grown while prefilling (16 output tokens in: 2 blocks → 3), the reservation shrank back to its
    admission-time steady size at the first token though it had 32 output tokens reserved."""
    led = KvLedger(LedgerSettings(mode="predicted", watermark=0.0))
    r = led.reserve(request("a", prompt=16, max_out=16 * 100, predicted=16), worker("w0", blocks=1000), 0.0)
    assert r is not None
    assert r.on_tokens(16, 1.0) and r.reserved_output == 32
    r.first_token(2.0)
    assert r.units * 16 >= 16 + r.reserved_output  # the prompt's and the reserved output's blocks


def test_the_null_block_stays_out_of_reach_under_any_watermark_and_unit() -> None:
    """A watermark of 1e-17 (1 − w == 1.0 in floats) left every block reservable, and on a compression
    worker (units are head-pages) a watermark below 1/num_gpu_blocks left less than one block's worth."""
    stock = KvLedger(LedgerSettings(watermark=1e-17))
    assert stock.capacity(worker("s", blocks=1000)) == 999
    comp = KvLedger(
        LedgerSettings(watermark=0.0005), SpecTable(by_pool={"c": CompressionSpec.uniform(256, 0.3)})
    )
    w = worker("c0", blocks=1000, pool="c")
    assert comp.total_units(w) - comp.capacity(w) >= 256  # one block of 256 heads at least


def test_a_request_past_the_watermark_is_admitted_alone_and_only_alone() -> None:
    """Capacity keeps the watermark back (floor(100 · 0.98) = 98 blocks), but one request on an empty worker
    may take every block but the null one, as vLLM admits it: 99 blocks alone, not beside another request;
    100 never."""
    from scheduler.routing.reasons import Outcome

    led = KvLedger(LedgerSettings(watermark=0.02))
    w = worker("w0", blocks=100)
    assert led.capacity(w) == 98
    big = request("big", prompt=16 * 98, max_out=16)  # 99 blocks
    assert led.exceeds_capacity(big, w) is None and led.can_ever_fit(big, w)
    small = led.reserve(request("small", prompt=8, max_out=8), w, 0.0)  # 1 block
    assert small is not None
    assert not led.fits(big, w, 0.0) and led.reserve(big, w, 0.0) is None  # not alone: waits (kv_full)
    small.release(Outcome.COMPLETED)
    alone = led.reserve(big, w, 0.0)
    assert alone is not None and led.reserved("w0") == 99
    assert led.reserve(request("next", prompt=8, max_out=8), w, 0.0) is None  # nothing beside it
    assert led.exceeds_capacity(request("huge", prompt=16 * 99, max_out=16), w) == (100, 99)
    alone.release(Outcome.COMPLETED)
    assert led.reserved("w0") == 0


def test_a_request_that_never_fits_is_final_even_when_its_workers_are_busy() -> None:
    """110 blocks on a worker of 100 (98 reservable): a 400 kv_exceeds_capacity at once. With the worker at
    max_num_seqs, starting again or its breaker open, the filters before kv-fit answered a retryable reason
    and the request waited its whole queue deadline for a 429. A worker not yet scraped (capacity a guess)
    may still fit it: then the answer stays retryable."""
    import dataclasses
    import random

    from scheduler.fleet import FleetView, WorkerState
    from scheduler.routing.config import RoutingConfig, build_router
    from scheduler.routing.reasons import FilterReason, Reject

    led = KvLedger(LedgerSettings(watermark=0.02))
    router = build_router(RoutingConfig(), reserve=[led])
    huge = request("huge", prompt=16 * 80, max_out=16 * 30)
    scraped = worker("w0", blocks=100, max_num_seqs=4, scraped_blocks=100)
    for busy in (
        dataclasses.replace(scraped, inflight_requests=8),
        dataclasses.replace(scraped, state=WorkerState.STARTING),
        dataclasses.replace(scraped, breaker_open=True),
    ):
        r = router.route(huge, FleetView((busy, worker("x", model="other"))), 0.0, random.Random(0))
        assert isinstance(r, Reject) and (r.primary, r.retryable) == (FilterReason.KV_EXCEEDS_CAPACITY, False)
        # alone on the worker a request may take all but the null block (99), past the watermark's 98
        assert r.details["kv_need_blocks"] == 110 and r.details["kv_reservable_blocks"] == 99
    guess = dataclasses.replace(worker("w0", blocks=100, max_num_seqs=4), inflight_requests=8)
    r = router.route(huge, FleetView((guess,)), 0.0, random.Random(0))
    assert isinstance(r, Reject) and r.primary is FilterReason.AT_CAPACITY and r.retryable


def test_a_sample_is_reconciled_once_however_many_scrape_rounds_reuse_it() -> None:
    """A worker whose scrape fails keeps its last sample (until stale) in every round's view: reconciled
    again after its 90 blocks were released, the old 90% usage read as unexplained and 88 blocks of an idle
    worker were withheld. Now a sample is reconciled once; the releases wait for a newer scrape."""
    import dataclasses

    led = KvLedger(LedgerSettings(watermark=0.02))
    w = worker("w0", blocks=100)
    held = [led.reserve(request(f"r{i}", prompt=16 * 9, max_out=16), w, 0.0) for i in range(9)]  # 90 blocks
    sample = dataclasses.replace(w, kv_usage=0.90, scrape_age_s=0.5)  # taken at t = 0.5
    assert led.reconcile([sample], 1.0)[0].shrink_units == 0
    for r in held:
        assert r is not None
        r.release("completed")
    for now in (2.0, 3.0):  # the same sample, older each round
        assert led.reconcile([dataclasses.replace(sample, scrape_age_s=now - 0.5)], now) == []
    assert led.capacity(w) == 98
    fresh = dataclasses.replace(w, kv_usage=0.0, scrape_age_s=0.1)
    assert led.reconcile([fresh], 4.0)[0].shrink_units == 0 and led.capacity(w) == 98


def test_in_predicted_mode_a_request_within_the_lone_bound_is_admitted_on_an_empty_worker() -> None:
    """`exceeds_capacity` bounds the worst case by the lone room · (1 + max_frac); admission bounded it by the
    watermarked capacity, so a request between the two waited on an empty worker until its 429."""
    led = KvLedger(LedgerSettings(mode="predicted", watermark=0.02, max_overbook_frac=0.0))
    w = worker("w0", blocks=100)  # capacity 98, alone 99
    r = request("r", prompt=16, max_out=16 * 98, predicted=16)  # predicted 2 blocks, worst 99
    assert led.exceeds_capacity(r, w) is None and led.fits(r, w, 0.0)
    defaults = KvLedger(LedgerSettings(mode="predicted"))  # watermark 0.02, overbook 0.1
    wide = worker("w1", blocks=1000)  # worst bound alone: floor(999 · 1.1) = 1098
    big = request("big", prompt=16, max_out=16 * 1090, predicted=16)  # worst 1091 blocks
    assert defaults.exceeds_capacity(big, wide) is None and defaults.reserve(big, wide, 0.0) is not None


def test_batch_admission_plans_a_lone_request_on_a_data_parallel_workers_empty_engine() -> None:
    """Two engines of 100 blocks, one holding a small request: the other admits a 99-block request alone,
    and the plan must offer it (it summed both engines' reservations and left it out until its 429)."""
    from dataclasses import replace

    from scheduler.fleet import EngineView
    from scheduler.kv.batch_admission import AdmissionParams, build_instance

    w = replace(
        worker("w0", blocks=200, scraped_blocks=200), engines=(EngineView(0, 100), EngineView(1, 100))
    )
    led = KvLedger(LedgerSettings(watermark=0.02))
    assert led.reserve(request("small", prompt=8, max_out=8), w, 0.0) is not None
    big = request("big", prompt=16 * 98, max_out=16)  # 99 blocks: past capacity 98, within alone 99
    assert led.fits(big, w, 0.0) and led.lone_room(w) == 99
    inst = build_instance([big], [w], led, 0.0, AdmissionParams())
    assert inst.need == {(0, 0): 98}  # all of the empty engine's free pages


def test_a_request_alone_grows_as_far_as_it_could_be_admitted_and_not_beside_another() -> None:
    """Growth was bounded by the watermarked capacity (98 of 100 blocks) though the same request, asked for
    its full length on the empty worker, is admitted at 99: alone it now grows to 99. With a second request
    beside it, the watermark holds (the books stay within 98)."""
    from scheduler.routing.reasons import Outcome

    led = KvLedger(LedgerSettings(mode="predicted", watermark=0.02), predictor=LengthPredictor(min_samples=1))
    w = worker("w0", blocks=100)  # capacity 98, alone 99
    r = led.reserve(request("a", prompt=16 * 90, max_out=16 * 9, predicted=16), w, 0.0)  # 91 blocks now
    assert r is not None and r.units == 91
    while r.reserved_output < r.max_output:
        assert r.on_tokens(r.reserved_output, 1.0)
    assert (r.units, led.reserved("w0"), led.stats.grow_refused) == (99, 99, 0)
    r.release(Outcome.COMPLETED)

    r = led.reserve(request("a2", prompt=16 * 90, max_out=16 * 9, predicted=16), w, 2.0)
    other = led.reserve(request("b", prompt=8, max_out=8, predicted=8), w, 2.0)  # 1 block beside it
    assert r is not None and other is not None
    while r.on_tokens(r.reserved_output, 3.0) and r.reserved_output < r.max_output:
        pass
    assert led.reserved("w0") <= 98 and led.stats.grow_refused == 1
