"""The cycle runner, tested apart from the real plugins with recording fakes."""

from __future__ import annotations

import random

import pytest

from scheduler.routing.framework import Cycle, Decision, Router
from scheduler.routing.profiles import SingleProfileHandler
from scheduler.routing.reasons import FilterReason, Outcome, Reject
from tests.scheduler.routing.builders import (
    Recorder,
    RecordingFilter,
    RecordingPicker,
    RecordingReserve,
    RecordingScorer,
    profile,
    req,
    view,
    worker,
)

A, B, C = worker("a"), worker("b"), worker("c")


def make(rec: Recorder, *, reject=None, scores=None, refuse_1=None, refuse_2=None, pre=()):
    f1 = RecordingFilter(rec, "f1", reject)
    f2 = RecordingFilter(rec, "f2")
    s1 = RecordingScorer(rec, "s1", scores)
    s2 = RecordingScorer(rec, "s2")
    r1, r2 = RecordingReserve(rec, "r1", refuse_1), RecordingReserve(rec, "r2", refuse_2)
    prof = profile(filters=[f1, f2], scorers=[("s1", s1, 2.0), ("s2", s2, 1.0)], picker=RecordingPicker(rec))
    return Router(SingleProfileHandler(prof), pre, [r1, r2]), r1, r2


def route(router: Router, *workers, exclude=frozenset()):
    return router.route(req(), view(*workers), 0.0, random.Random(0), exclude)


def test_steps_run_in_framework_order_filter_score_pick_reserve():
    rec = Recorder()
    router, _, _ = make(rec, reject={"b": FilterReason.DRAINING}, scores={"a": 0.2, "c": 0.9})
    decision = route(router, A, B, C)
    assert isinstance(decision, Decision)
    assert decision.decode.id == "c"
    assert rec.calls == [
        # every filter on each worker in view order; the first reason stops the chain for that worker
        ("f1", "filter", "a"),
        ("f2", "filter", "a"),
        ("f1", "filter", "b"),
        ("f1", "filter", "c"),
        ("f2", "filter", "c"),
        # scorers see exactly the survivors
        ("s1", "score", ("a", "c")),
        ("s2", "score", ("a", "c")),
        # totals: a = 2·0.2 + 1·0.5 = 0.9; c = 2·0.9 + 1·0.5 = 2.3
        ("picker", "pick", (("a", 0.9), ("c", 2.3))),
        ("r1", "reserve", "c"),
        ("r2", "reserve", "c"),
    ]
    assert [r.worker_id for r in decision.reservations] == ["c", "c"]
    assert decision.scores == {"c": pytest.approx(2.3)}


def test_reserve_refused_falls_back_to_next_candidate_and_unreserves_partial():
    rec = Recorder()
    router, r1, _ = make(rec, scores={"a": 1.0, "b": 0.5, "c": 0.0}, refuse_2={"a"})
    decision = route(router, A, B, C)
    assert isinstance(decision, Decision) and decision.decode.id == "b"
    reserve_calls = [c for c in rec.calls if c[1] in ("reserve", "release")]
    assert reserve_calls == [
        ("r1", "reserve", "a"),
        ("r2", "reserve", "a"),  # refused
        ("r1", "release", "a", Outcome.UNRESERVED),  # the partial reservation on a is undone
        ("r1", "reserve", "b"),
        ("r2", "reserve", "b"),
    ]
    assert [len(r.releases) for r in r1.made] == [1, 0]


def test_every_candidate_refused_rejects_with_kv_full_counts():
    rec = Recorder()
    router, r1, _ = make(rec, reject={"c": FilterReason.DRAINING}, refuse_1={"a", "b"})
    result = route(router, A, B, C)
    assert isinstance(result, Reject)
    assert result.reason == "no worker fits: 2 kv_full, 1 draining"
    assert result.primary is FilterReason.KV_FULL and result.retryable
    assert r1.made == []


def test_nothing_passes_filters_then_no_scorer_picker_or_reserve_runs():
    rec = Recorder()
    router, _, _ = make(rec, reject={"a": FilterReason.BREAKER_OPEN, "b": FilterReason.BREAKER_OPEN})
    result = route(router, A, B)
    assert isinstance(result, Reject) and result.reason == "no worker fits: 2 breaker_open"
    assert {c[1] for c in rec.calls} == {"filter"}


def test_empty_fleet_rejects_as_no_workers():
    rec = Recorder()
    router, _, _ = make(rec)
    result = route(router)
    assert isinstance(result, Reject)
    assert result.primary is FilterReason.NO_WORKERS and result.http_status == 503


class ExplodingHandler:
    """Reserves on two workers, then fails: the runner must unreserve both, last first."""

    def handle(self, cycle: Cycle):
        cycle.reserve(A)
        cycle.reserve(B)
        raise RuntimeError("plugin bug")


def test_exception_after_reserve_unreserves_everything_in_reverse_order():
    rec = Recorder()
    r1, r2 = RecordingReserve(rec, "r1"), RecordingReserve(rec, "r2")
    router = Router(ExplodingHandler(), (), [r1, r2])
    with pytest.raises(RuntimeError, match="plugin bug"):
        router.route(req(), view(A, B), 0.0, random.Random(0))
    releases = [c[:3] for c in rec.calls if c[1] == "release"]
    assert releases == [
        ("r2", "release", "b"),
        ("r1", "release", "b"),
        ("r2", "release", "a"),
        ("r1", "release", "a"),
    ]
    assert all(len(r.releases) == 1 for r in r1.made + r2.made)


class ReserveThenRejectHandler:
    def handle(self, cycle: Cycle):
        cycle.reserve(A)
        return Reject.from_counts({FilterReason.AT_CAPACITY: 1})


def test_reject_after_a_reservation_releases_it():
    rec = Recorder()
    r1 = RecordingReserve(rec, "r1")
    router = Router(ReserveThenRejectHandler(), (), [r1])
    result = router.route(req(), view(A), 0.0, random.Random(0))
    assert isinstance(result, Reject)
    assert [r.releases for r in r1.made] == [[Outcome.UNRESERVED]]


def test_decision_release_is_reverse_order_and_lease_releases_once():
    rec = Recorder()
    router, _, _ = make(rec)
    decision = route(router, A)
    assert isinstance(decision, Decision)
    with decision.lease():
        pass
    assert [c for c in rec.calls if c[1] == "release"] == [
        ("r2", "release", "a", Outcome.COMPLETED),
        ("r1", "release", "a", Outcome.COMPLETED),
    ]


def test_lease_releases_with_error_outcome_when_the_block_raises():
    rec = Recorder()
    router, r1, _ = make(rec)
    decision = route(router, A)
    assert isinstance(decision, Decision)
    with pytest.raises(ValueError), decision.lease(Outcome.FAILED_BEFORE_FIRST_BYTE):
        raise ValueError("connect refused")
    assert r1.made[0].releases == [Outcome.FAILED_BEFORE_FIRST_BYTE]


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")], ids=["above 1", "below 0", "NaN"])
def test_a_scorer_breaking_the_unit_interval_is_an_error_and_nothing_stays_reserved(bad):
    rec = Recorder()
    router, r1, _ = make(rec, scores={"a": bad})
    with pytest.raises(ValueError, match="outside \\[0, 1\\]"):
        route(router, A, B)
    assert r1.made == []


class RejectLongPrompts:
    def pre_filter(self, cycle: Cycle) -> FilterReason | None:
        return FilterReason.EXCEEDS_CONTEXT if cycle.req.prompt_tokens > 100 else None


def test_pre_filter_reason_rejects_before_any_worker_is_looked_at():
    rec = Recorder()
    router, _, _ = make(rec, pre=[RejectLongPrompts()])
    result = route(router, A, B)
    assert isinstance(result, Reject)
    assert result.reason == "no worker fits: 2 exceeds_context"  # counted once per worker of the model
    assert result.http_status == 400 and not result.retryable
    assert rec.calls == []


def test_excluded_ids_reach_filters_through_the_cycle():
    seen: list[frozenset[str]] = []

    class Spy:
        def filter(self, cycle: Cycle, w):
            seen.append(cycle.exclude)
            return None

    rec = Recorder()
    prof = profile(filters=[Spy()], picker=RecordingPicker(rec))
    Router(SingleProfileHandler(prof)).route(req(), view(A), 0.0, random.Random(0), frozenset({"z"}))
    assert seen == [frozenset({"z"})]


def test_observers_get_dispatch_and_completion_feedback():
    log: list[tuple[str, str]] = []

    class Obs:
        def on_dispatch(self, decision: Decision, r, now: float) -> None:
            log.append(("dispatch", decision.decode.id))

        def on_complete(self, worker_id: str, r, outcome: Outcome, now: float) -> None:
            log.append(("complete", worker_id + ":" + outcome.value))

    rec = Recorder()
    prof = profile(picker=RecordingPicker(rec))
    router = Router(SingleProfileHandler(prof), observers=[Obs(), object()])
    decision = router.route(req(), view(A), 0.0, random.Random(0))
    assert isinstance(decision, Decision)
    router.on_dispatch(decision, req(), 1.0)
    router.on_complete("a", req(), Outcome.COMPLETED, 2.0)
    assert log == [("dispatch", "a"), ("complete", "a:completed")]


# ---------------------------------------------------------------------------------------------------
# One candidate left after the filters: no scoring (the Kubernetes scheduler's shortcut), same result


def test_a_sole_candidate_is_not_scored_but_still_picked_and_reserved():
    rec = Recorder()
    router, r1, r2 = make(rec, reject={"b": FilterReason.DRAINING, "c": FilterReason.BREAKER_OPEN})
    decision = route(router, A, B, C)
    assert isinstance(decision, Decision) and decision.decode.id == "a"
    assert [c for c in rec.calls if c[1] == "score"] == []  # neither scorer ran
    # the picker still sees the survivor (total 0, as under a profile without scorers), Reserve runs
    assert [c for c in rec.calls if c[1] in ("pick", "reserve")] == [
        ("picker", "pick", (("a", 0.0),)),
        ("r1", "reserve", "a"),
        ("r2", "reserve", "a"),
    ]
    assert decision.reservations == (r1.made[0], r2.made[0])
    assert decision.scores == {"a": 0.0}


def test_a_sole_candidate_gets_the_decision_and_rng_draws_scoring_would_have_given():
    """The real `mosaic` policy over one worker: the decision is the one the scored path gives — the same
    worker, path and reservations — and the picker draws the rng exactly as often (seeded replays of the
    simulator do not shift)."""
    from scheduler.routing.config import build_router
    from tests.scheduler.routing.builders import BlockLedger

    w = worker("solo", gpu="H100")
    ledger = BlockLedger({"solo": 10_000})
    router = build_router(reserve=[ledger])
    rng = random.Random(7)
    decision = router.route(req(prompt=64, output=16), view(w), 0.0, rng)
    assert isinstance(decision, Decision)
    assert (decision.decode.id, decision.prefill, decision.path) == ("solo", None, "single")
    assert [r.worker_id for r in decision.reservations] == ["solo"] and ledger.used == {
        "solo": 5
    }  # ceil(80/16)
    scored_path = router.handler.mixed.scorers  # type: ignore[attr-defined]
    assert scored_path  # the policy has scorers: they were skipped, not absent
    reference = random.Random(7)
    reference.random()  # MaxScorePicker: one draw per candidate
    assert rng.random() == reference.random()
