"""Reconcile explains a worker's reported usage with what this process's requests can hold now, not with
their whole reservations: a worst-case reservation is mostly unused while its request streams, and counted
whole it hid KV nobody here reserved (another gateway's surplus replica, clients sent to the worker
directly, image tokens the estimate leaves out), so the worker was over-committed (review finding)."""

from __future__ import annotations

from scheduler.fleet import FleetView
from scheduler.kv.ledger import KvLedger, LedgerSettings
from scheduler.routing.reasons import Outcome
from tests.kv.kvkit import request, worker

BLOCKS = 1000


def streaming(ledger: KvLedger, n: int, generated: int) -> list:
    """`n` requests of 160 prompt tokens and max_tokens 1,440 (100 blocks each, worst case), each past its
    first token with `generated` tokens streamed."""
    w = worker(blocks=BLOCKS)
    out = []
    for i in range(n):
        res = ledger.reserve(request(f"r{i}", prompt=160, max_out=1440), w, now=0.0)
        assert res is not None and res.units == 100
        res.first_token(0.0)
        res.on_tokens(generated, 0.0)
        out.append(res)
    return out


def test_usage_nobody_reserved_is_withheld_while_reservations_are_mostly_unused() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.01, reconcile_tolerance=0.02))
    streaming(ledger, 4, generated=10)  # each holds ceil(170 / 16) = 11 blocks of its 100
    # 600 blocks used by something else + the four requests' 44
    [sample] = ledger.reconcile(FleetView((worker(blocks=BLOCKS, kv_usage=0.644),)), 1.0)
    # explained: 4 × ceil((160 + 32) / 16) = 48 (10 streamed + a block of margin, in whole blocks);
    # 644 − 48 − 20 tolerance
    assert sample.shrink_units == 576
    assert ledger.capacity(worker(blocks=BLOCKS)) == 990 - 576
    # 400 reserved of 414: the next 100-block request does not fit (before: shrink 224, capacity 766, it did)
    assert ledger.reserve(request("x", prompt=160, max_out=1440), worker(blocks=BLOCKS), now=1.0) is None


def test_the_bound_grows_with_the_stream_and_never_exceeds_the_reservation() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.01, reconcile_tolerance=0.0))
    [res] = streaming(ledger, 1, generated=10)
    assert ledger.reconcile([worker(blocks=BLOCKS, kv_usage=0.012)], 1.0)[0].shrink_units == 0  # 12 ≤ 12
    # 800 streamed: a block of margin, rounded up to whole blocks: (800 // 16 + 2) · 16 = 832 output tokens,
    # ceil((160 + 832) / 16) = 62 blocks at most
    res.on_tokens(800, 2.0)
    assert ledger.reconcile([worker(blocks=BLOCKS, kv_usage=0.062)], 2.0)[0].shrink_units == 0
    assert ledger.reconcile([worker(blocks=BLOCKS, kv_usage=0.072)], 3.0)[0].shrink_units == 10
    res.on_tokens(5000, 4.0)  # past max_tokens (events are not tokens): the reservation caps it
    assert ledger.reconcile([worker(blocks=BLOCKS, kv_usage=0.1)], 4.0)[0].shrink_units == 0
    assert ledger.reconcile([worker(blocks=BLOCKS, kv_usage=0.101)], 5.0)[0].shrink_units == 1


def test_requests_not_streamed_or_before_their_first_token_count_their_reservation() -> None:
    """Nothing tells how far they are: a whole answer, a prompt still prefilling."""
    ledger = KvLedger(LedgerSettings(watermark=0.01, reconcile_tolerance=0.0))
    w = worker(blocks=BLOCKS)
    whole = ledger.reserve(request("whole", prompt=160, max_out=1440), w, now=0.0)
    prefilling = ledger.reserve(request("prefilling", prompt=160, max_out=1440), w, now=0.0)
    assert whole is not None and prefilling is not None
    whole.first_token(0.0)  # the gateway's estimate of its prefill's end: still never streamed
    assert ledger.reconcile([worker(blocks=BLOCKS, kv_usage=0.2)], 1.0)[0].shrink_units == 0  # 100 + 100
    whole.release(Outcome.COMPLETED)
    prefilling.release(Outcome.COMPLETED)
