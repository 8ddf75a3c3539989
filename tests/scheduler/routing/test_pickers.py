"""Pickers: order, ties by the injected rng, round-robin rotation, least-loaded by raw counts."""

from __future__ import annotations

import random

from scheduler.routing.framework import Cycle, Scored
from scheduler.routing.pickers import LeastLoadedPicker, MaxScorePicker, RoundRobinPicker
from tests.scheduler.routing.builders import req, view, worker


def cycle(seed: int = 0) -> Cycle:
    return Cycle(req(), view(), 0.0, random.Random(seed))


def ids(workers) -> list[str]:
    return [w.id for w in workers]


def scored(**totals: float) -> list[Scored]:
    return [Scored(worker(k), v) for k, v in totals.items()]


def test_max_score_orders_by_total_descending():
    assert ids(MaxScorePicker().pick(cycle(), scored(a=0.2, b=2.5, c=1.0))) == ["b", "c", "a"]


def test_max_score_breaks_ties_with_the_rng_and_replays_with_the_same_seed():
    tie = scored(a=1.0, b=1.0 + 1e-12, c=1.0, d=0.5)  # 1e-12 apart counts as a tie
    firsts = {ids(MaxScorePicker().pick(cycle(seed), tie))[0] for seed in range(40)}
    assert firsts == {"a", "b", "c"}  # every tied candidate wins for some seed; d never does
    runs = [ids(MaxScorePicker().pick(cycle(7), tie)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][-1] == "d"


def test_max_score_ties_totals_within_1e_9_whatever_their_digits():
    """Rounding to multiples of 1e-9 split 5.0000000004 and 5.0000000006 (2e-10 apart) into two buckets: b won
    every time. Totals within 1e-9 of the best tie; 2e-9 apart do not."""
    for a_total, b_total in ((5.0000000004, 5.0000000006), (5.0000000001, 5.0000000009), (5.0, 5.0000000002)):
        firsts = {
            ids(MaxScorePicker().pick(cycle(seed), scored(a=a_total, b=b_total)))[0] for seed in range(40)
        }
        assert firsts == {"a", "b"}, (a_total, b_total)
    apart = {ids(MaxScorePicker().pick(cycle(seed), scored(a=5.0, b=5.000000002)))[0] for seed in range(40)}
    assert apart == {"b"}


def test_round_robin_rotates_over_ids_and_skips_missing_ones():
    rr = RoundRobinPicker()
    picks = [ids(rr.pick(cycle(), scored(a=0, b=0, c=0)))[0] for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]
    # b disappears (e.g. draining): the cursor is at "a", the next id after it is "c"
    assert ids(rr.pick(cycle(), scored(c=0, a=0))) == ["c", "a"]


def test_least_loaded_uses_raw_request_counts_not_capacity():
    s = [
        Scored(worker("h", gpu="H100-SXM", inflight=5), 0.0),
        Scored(worker("l", gpu="L4", inflight=4), 0.0),
        Scored(worker("m", gpu="L4", running=2, waiting=1), 0.0),  # demand 3 from the scrape
    ]
    assert ids(LeastLoadedPicker().pick(cycle(), s)) == ["m", "l", "h"]
