"""A pooling request's sequences (embeddings, score, rerank) end at their prefill and free their KV then, and
vLLM runs at most `max_num_seqs` at once, scheduled as blocks free: the ledger reserves its largest
`max_num_seqs` sequences, and at most what one request may take on the worker, so a batch larger than a
worker's KV is served in turns (a reviewer found a 7,200-document rerank
refused as `kv_exceeds_capacity` that vLLM served), while a generation batch of the same shape, whose
sequences all hold their KV to the end, is still sized whole."""

from __future__ import annotations

import json

import httpx
import pytest

from scheduler.kv.footprint import resident_shape
from scheduler.kv.ledger import KvLedger, LedgerSettings
from scheduler.routing.framework import RouteRequest
from scheduler.routing.reasons import Outcome
from server.config import validate_config
from server.footprint import parse_request, route_request
from tests.gateway.serverkit import GatewayThread
from tests.kv.kvkit import simulated_l4_pool, worker


@pytest.mark.parametrize(
    ("shape", "seqs", "resident"),
    [
        (100, 4, 100),  # one sequence
        (((5, 9, 7), 1), 4, ((5, 9, 7), 1)),  # fewer than max_num_seqs: all of them
        (((5, 9, 7, 1, 8), 1), 3, ((9, 8, 7), 1)),  # the three largest
        (((5, 9), 3), 4, ((9, 9, 9, 5), 1)),  # n copies count as sequences
        (((5, 9, 7), 1), None, ((5, 9, 7), 1)),  # unbounded
    ],
)
def test_the_largest_max_num_seqs_sequences_are_resident(
    shape: object, seqs: int | None, resident: object
) -> None:
    assert resident_shape(shape, seqs) == resident  # type: ignore[arg-type]


def _route(kind: str, body: dict[str, object]) -> RouteRequest:
    return route_request(parse_request(kind, json.dumps({"model": "m", **body}).encode()), "r", 0.0, 16)  # type: ignore[arg-type]


def test_a_pooling_batch_larger_than_the_kv_fits_by_its_resident_sequences() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    w = worker(blocks=1000, max_model_len=512, max_num_seqs=8)
    embed = _route("embeddings", {"input": [[1] * 300] * 2000})  # 2,000 × 19 blocks: 38× the worker's KV
    fp, _ = ledger.footprint(embed, w)
    assert fp.peak == 8 * 19  # what vLLM holds at once
    assert ledger.exceeds_capacity(embed, w) is None
    res = ledger.reserve(embed, w, 0.0)
    assert res is not None and ledger.reserved(w.id) == 8 * 19
    generate = _route("completions", {"prompt": [[1] * 300] * 2000, "max_tokens": 1})
    assert ledger.footprint(generate, w)[0].peak == 2000 * 19  # every sequence holds its KV to its end
    assert ledger.exceeds_capacity(generate, w) == (2000 * 19, 1000)


def test_a_pooling_batch_is_reserved_at_most_what_one_request_may_take() -> None:
    """Fewer sequences than max_num_seqs but more KV than the worker has: vLLM schedules them as blocks free;
    the ledger reserves the whole worker for it (it waits for the worker to empty) instead of refusing it."""
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    w = worker(blocks=100, max_model_len=512)
    embed = _route("embeddings", {"input": [[1] * 300] * 40})  # 40 × 19 = 760 blocks
    fp, worst = ledger.footprint(embed, w)
    assert fp.peak == worst.peak == 100 and fp.steady == 100
    assert ledger.exceeds_capacity(embed, w) is None
    other = ledger.reserve(_route("embeddings", {"input": [1] * 16}), w, 0.0)
    assert other is not None and not ledger.fits(embed, w, 0.0)  # it waits for the worker to empty
    other.release(Outcome.COMPLETED)
    assert ledger.fits(embed, w, 0.0)


def test_a_large_rerank_is_sized_by_its_resident_pairs() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    w = worker(blocks=1000, block_size=128, max_model_len=512, max_num_seqs=256)
    rerank = _route("rerank", {"query": "hello world " * 100, "documents": ["a"] * 7200})
    fp, _ = ledger.footprint(rerank, w)
    assert fp.peak == 256 * 3  # each pair 301 tokens: 3 blocks of 128, 256 at once
    assert ledger.exceeds_capacity(rerank, w) is None


def test_through_the_gateway_an_embedding_batch_over_the_workers_kv_is_served() -> None:
    """The simulated L4 holds 467 blocks of 16 tokens (7,472 tokens); 40 inputs of 300 token ids are 12,000:
    the gateway refused them (`kv_exceeds_capacity`), the worker embeds them a few at a time."""
    pool = {**simulated_l4_pool("llama-3-8b"), "runner": "pooling"}
    cfg = validate_config({"pools": [pool], "health": {"interval_s": 60}})
    with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        r = http.post("/v1/embeddings", json={"model": "llama-3-8b", "input": [[9] * 300] * 40})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 12_000 and len(r.json()["data"]) == 40
