"""Scorer formulas with exact numbers, the prefix LRU with its load escape, and the [0, 1] property."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.fleet import WorkerCapacity
from scheduler.routing import scorers as s
from scheduler.routing.framework import Cycle, Decision
from scheduler.routing.prefix import PrefixIndex, block_hashes, text_block_hashes
from scheduler.routing.reasons import Outcome
from tests.scheduler.routing.builders import req, view, worker


def capacity(prefill: float, decode: float, cost: float = 1.0, blocks: int = 1000) -> WorkerCapacity:
    return WorkerCapacity(prefill, decode, blocks, 16, cost, 256, 8192, 0.0)


SLOW = capacity(1000, 100, cost=2.0)  # s(100, 10) = 100/1000 + 10/100 = 0.2 s
FAST = capacity(2000, 200, cost=8.0)  # s(100, 10) = 100/2000 + 10/200 = 0.1 s
R = req(prompt=100, output=10)


def score(scorer, *workers, r=R, now=0.0):
    return list(scorer.score(Cycle(r, view(*workers), now, random.Random(0)), workers))


def test_capacity_load_is_queued_seconds_of_own_work_ratio_to_best():
    a = worker("a", capacity=SLOW)  # L = (0 + 1) · 0.2 = 0.2
    b = worker("b", capacity=FAST, inflight=3)  # L = (3 + 1) · 0.1 = 0.4
    assert score(s.CapacityLoadScorer(), a, b) == pytest.approx([1.0, 0.5])  # 0.2/0.2, 0.2/0.4


def test_capacity_load_prefers_the_bigger_gpu_at_equal_request_counts():
    a = worker("a", capacity=SLOW, inflight=4)  # L = 5 · 0.2 = 1.0
    b = worker("b", capacity=FAST, inflight=4)  # L = 5 · 0.1 = 0.5
    assert score(s.CapacityLoadScorer(), a, b) == pytest.approx([0.5, 1.0])


def test_est_ttft_divides_queued_prefill_by_that_gpus_rate():
    a = worker("a", capacity=SLOW)  # T = 100 / 1000 = 0.1
    b = worker("b", capacity=FAST, prefill_tokens=300)  # T = (300 + 100) / 2000 = 0.2
    c = worker("c", capacity=FAST, prefill_tokens=300, waiting=5)  # queued = max(300, 5·100) → 600/2000 = 0.3
    assert score(s.EstimatedTtftScorer(), a, b, c) == pytest.approx([1.0, 0.5, 1 / 3])


def test_est_ttft_of_a_data_parallel_worker_prefills_its_own_prompt_on_one_engine():
    # Two engines of 1,000 prompt tokens/s: the queue drains at 2,000/s, this prompt at one engine's 1,000/s.
    dp2 = dataclasses.replace(capacity(2000, 200, cost=4.0), engines=2)
    a = worker("a", capacity=SLOW, prefill_tokens=200)  # T = (200 + 100) / 1000 = 0.3
    b = worker("b", capacity=dp2, prefill_tokens=200)  # T = 200 / 2000 + 100 / 1000 = 0.2
    c = worker(
        "c", capacity=FAST, prefill_tokens=200
    )  # one engine as fast as both: (200 + 100) / 2000 = 0.15
    assert score(s.EstimatedTtftScorer(), a, b, c) == pytest.approx([0.5, 0.75, 1.0])


def test_cost_is_dollars_per_hour_per_unit_of_capacity():
    # a: 2 $/h · 0.2 s = 0.4; b: 8 $/h · 0.1 s = 0.8 → the slow cheap GPU is cheaper per request here
    assert score(s.CostScorer(), worker("a", capacity=SLOW), worker("b", capacity=FAST)) == pytest.approx(
        [1.0, 0.5]
    )


def test_kv_headroom_counts_this_request():
    # used 0.5 · 1000 = 500, need ceil(110 / 16) = 7 → 1 − 507/1000 = 0.493; unknown usage → 1 − 7/1000
    got = score(s.KvHeadroomScorer(), worker("a", capacity=SLOW, kv_usage=0.5), worker("b", capacity=SLOW))
    assert got == pytest.approx([0.493, 0.993])
    assert score(s.KvHeadroomScorer(), worker("c", capacity=SLOW, kv_usage=1.0)) == [0.0]


def test_prefix_affinity_scores_the_matched_leading_blocks():
    scorer = s.PrefixAffinityScorer()
    a, b = worker("a", capacity=SLOW), worker("b", capacity=SLOW)
    scorer.on_dispatch(Decision(a), req(prefix=(1, 2, 3, 4)), now=0.0)
    # leading 1, 2, 3 match; 9 misses → 3/4; b has nothing → 0
    assert score(scorer, a, b, r=req(prompt=100, output=10, prefix=(1, 2, 3, 9))) == [0.75, 0.0]
    # a miss on the first block stops the match (chained hashes)
    assert score(scorer, a, r=req(prompt=100, output=10, prefix=(7, 2, 3, 4))) == [0.0]


def test_prefix_affinity_load_escape_drops_affinity_on_a_hot_worker():
    scorer = s.PrefixAffinityScorer()  # load_escape 2.0
    hot = worker("a", capacity=SLOW, inflight=2)  # L = 3 · 0.2 = 0.6 > 2 · 0.2
    cold = worker("b", capacity=SLOW)  # L = 0.2
    r = req(prompt=100, output=10, prefix=(1, 2))
    scorer.on_dispatch(Decision(hot), r, now=0.0)
    assert score(scorer, hot, cold, r=r) == [0.0, 0.0]
    warm = worker("a", capacity=SLOW, inflight=1)  # L = 0.4 ≤ 2 · 0.2 → affinity counts
    assert score(scorer, warm, cold, r=r) == [1.0, 0.0]


def test_prefix_affinity_records_both_sides_of_a_pd_pair_and_refreshes_on_completion():
    scorer = s.PrefixAffinityScorer(s.PrefixAffinityParams(ttl_s=10.0))
    d, p = worker("d", role="decode"), worker("p", role="prefill")
    r = req(prefix=(5, 6))
    scorer.on_dispatch(Decision(d, p), r, now=0.0)
    assert scorer.index.match("d", (5, 6), 5.0) == 2 and scorer.index.match("p", (5, 6), 5.0) == 2
    assert scorer.index.match("d", (5, 6), 10.5) == 0  # older than ttl 10 s
    scorer.on_complete("d", r, Outcome.COMPLETED, 8.0)
    assert scorer.index.match("d", (5, 6), 10.5) == 2  # refreshed at completion
    scorer.on_complete("p", r, Outcome.FAILED_BEFORE_FIRST_BYTE, 9.0)
    assert scorer.index.match("p", (5, 6), 10.5) == 0  # a failure refreshes nothing


@pytest.mark.parametrize(
    ("outcome", "kept"),
    [
        (Outcome.FAILED_BEFORE_FIRST_BYTE, 1),  # nothing built there: only the block held before stays
        (Outcome.UNRESERVED, 1),  # taken back inside the routing cycle: it never ran there
        (Outcome.WORKER_REJECTED, 1),  # the worker answered 4xx: refused before it was scheduled
        (Outcome.COMPLETED, 3),
        (Outcome.CLIENT_DISCONNECTED, 3),
        (Outcome.WORKER_ERROR, 3),  # failed after its first byte: its prompt was prefilled there
    ],
)
def test_a_dispatch_that_built_nothing_takes_back_the_blocks_it_added(outcome: Outcome, kept: int):
    """Recorded at dispatch (so the prefix's next requests follow it); when it ends having built nothing,
    the blocks it added go (its retry was steered back to the failed worker), those held before stay."""
    scorer = s.PrefixAffinityScorer()
    a = worker("a")
    earlier = req(prefix=(1,))
    scorer.on_dispatch(Decision(a), earlier, now=0.0)
    scorer.on_complete("a", earlier, Outcome.COMPLETED, 1.0)
    r = req(prefix=(1, 2, 3))
    scorer.on_dispatch(Decision(a), r, now=2.0)
    assert scorer.index.match("a", (1, 2, 3), 2.0) == 3
    scorer.on_complete("a", r, outcome, 3.0)
    assert scorer.index.match("a", (1, 2, 3), 3.0) == kept
    assert not scorer._pending  # nothing remembered once it ended


def test_a_failed_dispatch_keeps_blocks_a_later_request_recorded():
    """Two requests with one new prefix on one worker: the first fails, the second (dispatched later) still
    holds the blocks; a request failing on one side of a P/D pair takes back only that side's."""
    scorer = s.PrefixAffinityScorer()
    a = worker("a")
    first, second = req(prefix=(7, 8)), req(prefix=(7, 8))
    scorer.on_dispatch(Decision(a), first, now=0.0)
    scorer.on_dispatch(Decision(a), second, now=0.5)
    scorer.on_complete("a", first, Outcome.FAILED_BEFORE_FIRST_BYTE, 1.0)
    assert scorer.index.match("a", (7, 8), 1.0) == 2
    d, p = worker("d", role="decode"), worker("p", role="prefill")
    r = req(prefix=(4, 5))
    scorer.on_dispatch(Decision(d, p), r, now=2.0)
    scorer.on_complete("p", r, Outcome.COMPLETED, 3.0)
    scorer.on_complete("d", r, Outcome.FAILED_BEFORE_FIRST_BYTE, 3.0)
    assert (scorer.index.match("p", (4, 5), 3.0), scorer.index.match("d", (4, 5), 3.0)) == (2, 0)


def test_prefix_index_is_a_bounded_lru_per_worker():
    index = PrefixIndex(capacity=3)
    index.record("a", [1, 2, 3], 0.0)  # a prompt's head is its most recent entry: oldest first 3, 2, 1
    index.record("a", [4], 2.0)  # evicts 3, the first prompt's tail
    assert index.size("a") == 3
    assert index.match("a", [1, 2, 3], 3.0) == 2 and index.match("a", [4], 3.0) == 1
    index.forget("a")
    assert index.size("a") == 0


def test_prefix_index_evicts_a_prompts_tail_first():
    """An 80-block prompt, then an unrelated 30-block one, in 100 entries: the first loses its last 10
    blocks and still matches 70 (as vLLM frees a request's blocks tail first). Evicting its head first
    left 70 entries that matched 0 (chained hashes stop at the first miss)."""
    index = PrefixIndex(capacity=100)
    a, b = list(range(80)), list(range(1000, 1030))
    index.record("w", a, 0.0)
    index.record("w", b, 1.0)
    assert index.match("w", a, 2.0) == 70 and index.match("w", b, 2.0) == 30


def test_prefix_affinity_forgets_workers_that_left_the_fleet():
    """An autoscaled pool replaces its pods: the entries of workers no longer in the fleet are dropped
    when the next request is scored (they were kept for every worker id ever dispatched to)."""
    scorer = s.PrefixAffinityScorer()
    for gen in range(5):
        pods = [worker(f"pod-{gen}-{i}", capacity=SLOW) for i in range(3)]
        r = req(prompt=100, output=10, prefix=(gen, gen + 1))
        score(scorer, *pods, r=r)
        scorer.on_dispatch(Decision(pods[0]), r, now=float(gen))
    # pruned when the ids held (4) outnumbered the fleet (3): only pod-4-0 is left; before, all 5 were kept
    assert scorer.index.workers() == 1 and scorer.index.size("pod-4-0") == 2


def test_block_hashes_are_chained_stable_and_full_blocks_only():
    h = block_hashes(list(range(40)), block_size=16)
    assert len(h) == 2  # 40 // 16; the partial third block is not cached by vLLM either
    assert h == block_hashes(list(range(32)), block_size=16)
    other = block_hashes([99, *range(1, 40)], block_size=16)
    assert other[0] != h[0] and other[1] != h[1]  # chained: a change in block 0 changes every later hash
    assert text_block_hashes("x" * 130, chars_per_block=64) == text_block_hashes(
        "x" * 128 + "yz", chars_per_block=64
    )
    assert block_hashes([1] * 64, 16, max_blocks=2) == block_hashes([1] * 32, 16)
    assert all(0 <= v < 2**63 for v in h)


SCORERS = [
    s.CapacityLoadScorer(),
    s.EstimatedTtftScorer(),
    s.CostScorer(),
    s.KvHeadroomScorer(),
    s.PrefixAffinityScorer(s.PrefixAffinityParams(lru_blocks=8)),
]
GPUS = ["T4", "L4", "A10G", "A100-80GB", "H100-SXM"]

workers_st = st.lists(
    st.builds(
        lambda gpu, inflight, pre, running, waiting, usage: (gpu, inflight, pre, running, waiting, usage),
        st.sampled_from(GPUS[1:]),
        st.integers(0, 500),
        st.integers(0, 100_000),
        st.none() | st.integers(0, 300),
        st.none() | st.integers(0, 300),
        st.none() | st.floats(0.0, 1.0),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(
    rows=workers_st,
    prompt=st.integers(0, 8000),
    output=st.integers(0, 4000),
    prefix=st.lists(st.integers(0, 5), max_size=6),
    seen=st.lists(st.integers(0, 5), max_size=6),
)
def test_every_scorer_gives_one_score_in_unit_interval_per_candidate(rows, prompt, output, prefix, seen):
    ws = [
        worker(f"w{i}", gpu=g, inflight=n, prefill_tokens=p, running=r, waiting=q, kv_usage=u)
        for i, (g, n, p, r, q, u) in enumerate(rows)
    ]
    r = req(prompt=prompt, output=output, prefix=tuple(prefix))
    SCORERS[-1].on_dispatch(Decision(ws[0]), req(prefix=tuple(seen)), 0.0)
    for scorer in SCORERS:
        got = score(scorer, *ws, r=r)
        assert len(got) == len(ws)
        assert all(0.0 <= x <= 1.0 for x in got), (type(scorer).__name__, got)
    best = score(s.CapacityLoadScorer(), *ws, r=r)
    assert max(best) == 1.0  # ratio-to-best: some candidate is the best
