"""The P/D decider through the real default plugins: which path each fleet and prompt gets."""

from __future__ import annotations

import random

import pytest

from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.framework import Decision
from scheduler.routing.reasons import FilterReason, Outcome, Reject
from tests.scheduler.routing.builders import BlockLedger, req, view, worker

P = worker("p", gpu="H100-SXM", role="prefill")
D = worker("d", gpu="A100-80GB", role="decode")
M = worker("m", gpu="L4", role="mixed")


def route(fleet, prompt, *, threshold=256, reserve=(), exclude=frozenset()):
    router = build_router(RoutingConfig(pd_threshold_tokens=threshold), reserve=reserve)
    return router.route(req(prompt=prompt), fleet, 0.0, random.Random(0), exclude)


@pytest.mark.parametrize(
    ("fleet", "prompt", "expected"),
    [
        pytest.param(
            view(P, D),
            2048,
            ("pd", "d", "p"),
            id="long prompt with both pools → P/D pair, decode picked first",
        ),
        pytest.param(
            view(P, D),
            100,
            ("single", "d", None),
            id="prompt under the threshold skips P/D → decode-only hop",
        ),
        pytest.param(
            view(P, D, M),
            100,
            ("single", "d", None),
            id="short prompt may go to mixed or decode: the A100 decode worker wins on load",
        ),
        pytest.param(
            view(worker("p", gpu="H100-SXM", role="prefill", state="draining"), D),
            2048,
            ("decode-only", "d", None),
            id="prefill pool draining → decode worker prefills itself",
        ),
        pytest.param(view(D, M), 2048, ("single", "d", None), id="no prefill pool → never P/D"),
        pytest.param(
            view(P, worker("m2", gpu="H100-SXM", role="mixed")),
            2048,
            ("single", "m2", None),
            id="decode profile picks a mixed worker → single hop, no prefill",
        ),
    ],
)
def test_pd_decider_paths(fleet, prompt, expected):
    decision = route(fleet, prompt)
    assert isinstance(decision, Decision)
    prefill = decision.prefill.id if decision.prefill else None
    assert (decision.path, decision.decode.id, prefill) == expected


def test_threshold_is_configurable():
    assert route(view(P, D), 300, threshold=256).path == "pd"
    assert route(view(P, D), 300, threshold=512).path == "single"


def test_no_decode_side_rejects_with_the_decode_pass_reasons():
    result = route(view(P, worker("d", role="decode", breaker=True)), 2048)
    assert isinstance(result, Reject)
    assert result.reason == "no worker fits: 1 breaker_open, 1 wrong_role"
    assert result.primary is FilterReason.BREAKER_OPEN


def test_only_prefill_workers_for_a_short_prompt_is_wrong_role():
    result = route(view(P), 100)
    assert (
        isinstance(result, Reject) and result.primary is FilterReason.WRONG_ROLE and result.http_status == 503
    )


def test_pd_reserves_decode_then_prefill_and_keeps_decode_when_prefill_cannot_reserve():
    ledger = BlockLedger({"p": 0, "d": 1000})  # the prefill worker has no budget
    decision = route(view(P, D), 2048, reserve=(ledger,))
    assert isinstance(decision, Decision) and decision.path == "decode-only"
    assert [r.worker_id for r in decision.reservations] == ["d"]
    assert ledger.used == {"p": 0, "d": 144}  # ceil((2048 + 256) / 16) = 144 blocks
    decision.release(Outcome.COMPLETED)
    assert ledger.used["d"] == 0 and ledger.double_releases == 0


def test_pd_pair_holds_both_reservations_decode_first():
    ledger = BlockLedger({"p": 1000, "d": 1000})
    decision = route(view(P, D), 2048, reserve=(ledger,))
    assert isinstance(decision, Decision) and decision.path == "pd"
    assert [r.worker_id for r in decision.reservations] == ["d", "p"]
