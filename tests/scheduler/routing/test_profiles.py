"""The P/D decider through the real default plugins: which path each fleet and prompt gets."""

from __future__ import annotations

import random

import pytest

from scheduler.fleet import FleetView, PoolRef, Role
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.framework import Decision, RouteRequest
from scheduler.routing.reasons import FilterReason, Outcome, Reject
from tests.scheduler.routing.builders import MODEL, BlockLedger, req, view, worker

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


@pytest.mark.parametrize(
    ("n", "prompt_lens"),
    [pytest.param(2, (), id="n = 2"), pytest.param(1, (1024, 1024), id="a batch of two prompts")],
)
def test_several_sequences_never_take_the_pd_path(n, prompt_lens):
    """vLLM's prefill hop answers one kv_transfer_params per request: a multi-sequence request is
    served single-hop by a decode worker, however long its prompts."""
    router = build_router(RoutingConfig(pd_threshold_tokens=256))
    request = RouteRequest("r1", MODEL, 2048, 512, 256, n=n, prompt_lens=prompt_lens)
    decision = router.route(request, view(P, D), 0.0, random.Random(0), frozenset())
    assert isinstance(decision, Decision)
    assert (decision.path, decision.decode.id, decision.prefill) == ("single", "d", None)


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


# Configured pools, as the gateway and the simulator put them in the view (`FleetView.pools`).
PREFILL_POOL = PoolRef("prefill-h100-sxm", MODEL, Role.PREFILL)
DECODE_POOL = PoolRef("decode-a100-80gb", MODEL, Role.DECODE)


def with_pools(fleet: FleetView, *pools: PoolRef) -> FleetView:
    return FleetView(fleet.workers, pools)


def test_decode_pool_at_zero_holds_pd_requests_for_it():
    """Prefill up, the decode pool scaled to zero: the request waits for decode (503 pool_empty,
    retryable) instead of being refused as wrong_role."""
    result = route(with_pools(view(P), PREFILL_POOL, DECODE_POOL), 2048)
    assert isinstance(result, Reject)
    assert result.reason == "no worker fits: 1 empty_pool, 1 wrong_role"
    assert (result.primary, result.retryable, result.http_status) == (FilterReason.EMPTY_POOL, True, 503)
    assert result.error_body(MODEL)["error"]["code"] == "pool_empty"
    # short prompts too: the mixed profile takes decode workers, and their pool is coming back
    short = route(with_pools(view(P), PREFILL_POOL, DECODE_POOL), 100)
    assert isinstance(short, Reject) and short.retryable and short.primary is FilterReason.EMPTY_POOL


def test_a_prompt_over_every_decode_context_is_a_400_however_many_prefill_workers():
    """Two prefill workers (wrong_role for the decode pass) outnumbered the decode worker refusing the
    prompt as too long: the client got 503 no_worker_for_role instead of 400 context_length_exceeded."""
    result = route(view(P, worker("p2", gpu="H100-SXM", role="prefill"), D), 10**6)
    assert isinstance(result, Reject) and result.primary is FilterReason.EXCEEDS_CONTEXT
    assert (result.http_status, result.error_body(MODEL)["error"]["code"]) == (400, "context_length_exceeded")


def test_without_configured_pools_a_missing_role_is_still_final():
    result = route(view(P), 2048)
    assert isinstance(result, Reject)
    assert (result.primary, result.retryable) == (FilterReason.WRONG_ROLE, False)


def test_an_empty_pool_of_another_role_or_model_does_not_hold_a_request():
    # the prefill pool at zero cannot serve what no decode worker can: a prompt over every context stays 400
    too_long = route(with_pools(view(D), PREFILL_POOL, DECODE_POOL), 10**6)
    assert isinstance(too_long, Reject) and too_long.primary is FilterReason.EXCEEDS_CONTEXT
    assert not too_long.retryable
    other = PoolRef("decode-other", "other-model", Role.DECODE)
    result = route(with_pools(view(P), PREFILL_POOL, other), 2048)
    assert isinstance(result, Reject) and (result.primary, result.retryable) == (
        FilterReason.WRONG_ROLE,
        False,
    )


def test_a_model_whose_pools_are_all_at_zero_is_held_not_404():
    """Other models' workers are up, every pool of this model is at zero: not model_not_found."""
    others = view(worker("x", role="mixed", model="other-model"))
    result = route(with_pools(others, PREFILL_POOL, DECODE_POOL), 2048)
    assert isinstance(result, Reject)
    assert (result.primary, result.retryable, result.http_status) == (FilterReason.EMPTY_POOL, True, 503)
    assert route(others, 2048).primary is FilterReason.WRONG_MODEL  # no pool known: 404 as before


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


def test_an_empty_pool_whose_context_the_prompt_exceeds_does_not_hold_it():
    """A prompt over every running worker's context and over the empty pool's too stays final: held, it
    would wait for nothing and block the FIFO admission queue behind it."""
    small = PoolRef("decode-l4", MODEL, Role.DECODE, max_model_len=8192)
    fleet = with_pools(view(P, D), PREFILL_POOL, DECODE_POOL, small)
    too_long = route(fleet, 10**6)
    assert isinstance(too_long, Reject) and not too_long.retryable
    assert FilterReason.EMPTY_POOL not in too_long.counts
    assert too_long.counts[FilterReason.EXCEEDS_CONTEXT] == 1
    # one the empty pool could take (its context unknown, or large enough) is held for it
    for big in (
        PoolRef("decode-l4", MODEL, Role.DECODE),
        PoolRef("decode-l4", MODEL, Role.DECODE, 2 * 10**6),
    ):
        held = route(with_pools(view(P, D), PREFILL_POOL, DECODE_POOL, big), 10**6)
        assert isinstance(held, Reject) and (held.primary, held.retryable) == (FilterReason.EMPTY_POOL, True)


@pytest.mark.parametrize("state", ["unhealthy", "starting", "draining"])
def test_a_prompt_no_context_holds_is_a_400_whatever_state_a_worker_is_in(state: str) -> None:
    """A 20,000-token prompt against 8,192-token workers, one of them not ready: 400 exceeds_context, not
    retryable. Counted first by its state (retryable), it was held in the admission queue at the head of
    the model's FIFO until its deadline, then a 429."""
    fleet = view(
        *(worker(f"h{i}", gpu="H100-SXM") for i in range(3)), worker("h9", gpu="H100-SXM", state=state)
    )
    got = build_router().route(RouteRequest("r", MODEL, 20_000, 16, 16), fleet, 0.0, random.Random(0))
    assert isinstance(got, Reject)
    assert (got.primary, got.http_status, got.retryable) == (FilterReason.EXCEEDS_CONTEXT, 400, False)


def test_a_prompt_over_the_context_is_refused_with_the_limit_and_its_size() -> None:
    """The message named only the router's tallies ("no worker fits: 4 exceeds_context, 1 wrong_role"); it
    says, as vLLM does, the model's maximum context and the prompt's tokens (estimated ones marked so)."""
    fleet = view(*(worker(f"h{i}", gpu="H100-SXM") for i in range(2)))
    limit = build_router().route(RouteRequest("r", MODEL, 10, 16, 16), fleet, 0.0, random.Random(0))
    assert not isinstance(limit, Reject)
    exact = build_router().route(RouteRequest("r", MODEL, 20_000, 16, 16), fleet, 0.0, random.Random(0))
    assert isinstance(exact, Reject)
    context = fleet.workers[0].capacity.max_model_len
    assert exact.error_body(MODEL)["error"] == {
        "message": f"The maximum context length of model {MODEL!r} is {context} tokens. However, your prompt contains "
        "20000 input tokens, which leaves no room for any output token. Please reduce the length of the input "
        "prompt.",
        "type": "BadRequestError",
        "param": "input_tokens",  # vLLM's
        "code": "context_length_exceeded",
    }
    estimated = RouteRequest("r", MODEL, 30_000, 16, 16, prompt_tokens_floor=20_000)
    got = build_router().route(estimated, fleet, 0.0, random.Random(0))
    assert isinstance(got, Reject)
    assert "your prompt contains about 30000 input tokens" in got.error_body(MODEL)["error"]["message"]
