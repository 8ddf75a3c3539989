"""The `adapter` filter and the `lora-affinity` scorer (scheduler/routing/lora.py), alone and in the router."""

from __future__ import annotations

import dataclasses
import random

import pytest

from scheduler.fleet import LoraState, WorkerView
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.framework import Cycle, Decision, RouteRequest
from scheduler.routing.lora import AdapterFilter, LoraAffinityScorer
from scheduler.routing.prefix import adapter_seed, block_hashes, text_block_hashes
from scheduler.routing.reasons import FilterReason, Reject
from tests.scheduler.routing.builders import req, view, worker


def lora_req(adapter: str | None, prompt: int = 512) -> RouteRequest:
    return dataclasses.replace(req(prompt=prompt), adapter=adapter)


def lora_worker(
    id: str,
    adapters: set[str],
    active: set[str] | None = None,
    queued: set[str] | None = None,
    max_lora: int | None = None,
    **extra: object,
) -> WorkerView:
    """A worker serving `adapters`, with `active` / `queued` the adapters of its running / waiting requests."""
    state = LoraState(
        frozenset(adapters),
        None if active is None else frozenset(active),
        None if queued is None else frozenset(queued),
        max_lora,
    )
    return worker(id, gpu="H100", lora=state, **extra)  # type: ignore[arg-type]


def test_the_filter_passes_only_workers_serving_the_named_adapter() -> None:
    a, b = lora_worker("a", {"sql"}), lora_worker("b", set())
    f = AdapterFilter()
    cycle = Cycle(lora_req("sql"), view(a, b), 0.0, random.Random(0))
    assert [f.filter(cycle, w) for w in (a, b)] == [None, FilterReason.NO_ADAPTER]
    base = Cycle(lora_req(None), view(a, b), 0.0, random.Random(0))
    assert [f.filter(base, w) for w in (a, b)] == [None, None]


@pytest.mark.parametrize(
    ("running", "waiting", "max_lora", "score"),
    [
        pytest.param({"sql"}, set(), 1, 1.0, id="running there: 1"),
        pytest.param(set(), {"sql"}, 1, 1.0, id="waiting there (its slot is coming): 1"),
        pytest.param({"other"}, set(), 2, 0.5, id="a free slot: 0.5"),
        pytest.param({"other"}, set(), 1, 0.0, id="every slot another adapter's: 0"),
        pytest.param({"x"}, {"y"}, 2, 0.0, id="running and waiting fill the slots: 0"),
        pytest.param(None, None, None, 0.5, id="not scraped: 0.5"),
    ],
)
def test_lora_affinity_scores(
    running: set[str] | None, waiting: set[str] | None, max_lora: int | None, score: float
) -> None:
    w = lora_worker("a", {"sql", "other", "x", "y"}, running, waiting, max_lora)
    cycle = Cycle(lora_req("sql"), view(w), 0.0, random.Random(0))
    assert LoraAffinityScorer().score(cycle, [w]) == [score]
    base = Cycle(lora_req(None), view(w), 0.0, random.Random(0))
    assert LoraAffinityScorer().score(base, [w]) == [1.0]  # a base-model request: no preference


def test_the_router_prefers_the_worker_already_running_the_adapter_over_a_full_one() -> None:
    """Two H100s serving `sql` at max_lora 1: `busy` runs `sql` with two requests in flight, `full` runs
    another adapter with one. Without the scorer the less loaded `full` wins and the request waits there for a
    slot; with it, `busy`. A base-model request still goes to the less loaded one."""
    busy = lora_worker("busy", {"sql", "other"}, {"sql"}, set(), 1, inflight=2, running=2)
    full = lora_worker("full", {"sql", "other"}, {"other"}, set(), 1, inflight=1, running=1)
    fleet = view(busy, full)
    router = build_router()
    for seed in range(5):
        d = router.route(lora_req("sql"), fleet, 0.0, random.Random(seed))
        assert isinstance(d, Decision) and d.decode.id == "busy"
        base = router.route(lora_req(None), fleet, 0.0, random.Random(seed))
        assert isinstance(base, Decision) and base.decode.id == "full"
    off = build_router(RoutingConfig.model_validate({"weights": {"lora-affinity": 0}}))
    d = off.route(lora_req("sql"), fleet, 0.0, random.Random(0))
    assert isinstance(d, Decision) and d.decode.id == "full"


def test_no_worker_serving_the_adapter_is_a_final_404() -> None:
    reject = build_router().route(lora_req("gone"), view(lora_worker("a", {"sql"})), 0.0, random.Random(0))
    assert isinstance(reject, Reject)
    assert (reject.primary, reject.http_status, reject.retryable) == (FilterReason.NO_ADAPTER, 404, False)
    assert reject.error_body("llama-3-8b")["error"]["code"] == "model_not_found"


def test_a_continuation_pinned_to_a_worker_without_its_adapter_is_that_workers_404() -> None:
    """A Responses continuation may run only where its response is stored; every other worker is counted
    `excluded`. They outnumbered the pinned worker's own reason, and the answer was 502 upstream_failed (the
    SDK retries a 5xx twice) for a request that can never succeed there."""
    fleet = view(lora_worker("a", {"sql"}), lora_worker("b", {"sql"}), lora_worker("c", set()))
    pinned = dataclasses.replace(lora_req("sql"), pinned_worker="c")
    reject = build_router().route(pinned, fleet, 0.0, random.Random(0))
    assert isinstance(reject, Reject)
    assert (reject.primary, reject.http_status, reject.retryable) == (FilterReason.NO_ADAPTER, 404, False)
    assert reject.counts == {FilterReason.EXCLUDED: 2, FilterReason.NO_ADAPTER: 1}
    # pinned to a worker serving it, which failed this request before (a retry): nothing else may take it,
    # and the answer stays the 502 of the failure
    on_a = dataclasses.replace(pinned, pinned_worker="a")
    again = build_router().route(on_a, fleet, 0.0, random.Random(0), exclude=frozenset({"a"}))
    assert isinstance(again, Reject) and again.primary is FilterReason.EXCLUDED and again.http_status == 502


def test_an_adapter_on_a_worker_not_ready_waits_for_it() -> None:
    """The one worker serving it is starting: a retryable reason wins over the others' no_adapter."""
    starting = lora_worker("s", {"sql"}, state="starting")
    reject = build_router().route(
        lora_req("sql"), view(starting, lora_worker("b", set())), 0.0, random.Random(0)
    )
    assert isinstance(reject, Reject) and reject.retryable and reject.primary is FilterReason.STARTING


def test_an_adapters_prefix_hashes_are_its_own() -> None:
    """vLLM keys cached blocks by adapter: the same prompt under two adapters (or the base model) shares none."""
    tokens = list(range(64))
    base, sql, chat = (block_hashes(tokens, 16, seed=adapter_seed(a)) for a in (None, "sql", "chat"))
    assert base == block_hashes(tokens, 16)  # the base model's are unchanged
    assert len(base) == len(sql) == len(chat) == 4
    assert not set(base) & set(sql) and not set(sql) & set(chat)
    assert block_hashes(tokens, 16, seed=adapter_seed("sql")) == sql  # stable
    text = "x" * 256
    assert text_block_hashes(text, 64, seed=adapter_seed("sql")) != text_block_hashes(text, 64)


def test_the_cycle_skips_the_scorer_for_a_request_naming_no_adapter() -> None:
    """`applies`: for a base-model request every score would be 1, so the cycle does not run it (no part, no
    pass over the candidates); for an adapter request it scores."""
    from scheduler.routing.pickers import MaxScorePicker
    from tests.scheduler.routing.builders import profile

    a, b = lora_worker("a", {"sql"}, {"sql"}, set(), 1), lora_worker("b", {"sql"}, {"x"}, set(), 1)
    prof = profile(scorers=[("lora-affinity", LoraAffinityScorer(), 2.0)], picker=MaxScorePicker())
    base = Cycle(lora_req(None), view(a, b), 0.0, random.Random(0)).score(prof, [a, b])
    assert [(s.total, s.parts) for s in base] == [(0.0, {}), (0.0, {})]
    sql = Cycle(lora_req("sql"), view(a, b), 0.0, random.Random(0)).score(prof, [a, b])
    assert [(s.total, s.parts) for s in sql] == [(2.0, {"lora-affinity": 1.0}), (0.0, {"lora-affinity": 0.0})]


def resolving_worker(id: str, adapters: set[str], **kw: object) -> WorkerView:
    """A worker whose model resolves adapters on demand (`models[].lora_resolver`)."""
    w = lora_worker(id, adapters, **kw)  # type: ignore[arg-type]
    return dataclasses.replace(w, lora=dataclasses.replace(w.lora, resolves=True))


def test_a_worker_resolving_adapters_on_demand_passes_the_filter_for_any_name() -> None:
    a, b, plain = resolving_worker("a", {"sql"}), resolving_worker("b", set()), lora_worker("c", set())
    cycle = Cycle(lora_req("brand-new"), view(a, b, plain), 0.0, random.Random(0))
    assert [AdapterFilter().filter(cycle, w) for w in (a, b, plain)] == [None, None, FilterReason.NO_ADAPTER]


@pytest.mark.parametrize(
    ("listed", "running", "max_lora", "score"),
    [
        pytest.param({"sql"}, set(), 2, 0.5, id="listed, a free slot: 0.5"),
        pytest.param(set(), set(), 2, 0.25, id="to resolve first, a free slot: 0.25"),
        pytest.param(set(), {"other"}, 1, 0.0, id="to resolve, every slot taken: 0"),
        pytest.param(set(), None, None, 0.25, id="to resolve, not scraped: 0.25"),
        pytest.param({"sql"}, None, None, 0.5, id="listed, not scraped: 0.5"),
        pytest.param({"sql"}, {"sql"}, 1, 1.0, id="running there: 1"),
    ],
)
def test_a_worker_that_must_resolve_the_adapter_first_scores_half(
    listed: set[str], running: set[str] | None, max_lora: int | None, score: float
) -> None:
    w = resolving_worker(
        "w", listed, active=running, queued=None if running is None else set(), max_lora=max_lora
    )
    cycle = Cycle(lora_req("sql"), view(w), 0.0, random.Random(0))
    assert LoraAffinityScorer().score(cycle, [w]) == [score]


def test_the_router_prefers_the_worker_listing_an_adapter_over_one_that_would_resolve_it() -> None:
    a, b = resolving_worker("a", set()), resolving_worker("b", {"sql"})
    picked = [build_router().route(lora_req("sql"), view(a, b), 0.0, random.Random(s)) for s in range(8)]
    assert all(isinstance(d, Decision) and d.decode.id == "b" for d in picked)
    # a name neither lists goes to either (the first request makes one of them load it)
    new = build_router().route(lora_req("brand-new"), view(a, b), 0.0, random.Random(0))
    assert isinstance(new, Decision) and new.decode.id in ("a", "b")


@pytest.mark.parametrize(
    ("pending", "running", "max_lora", "score"),
    [
        pytest.param(
            {"other"}, set(), 1, 0.0, id="the gateway's request of another adapter fills the slot: 0"
        ),
        pytest.param({"other"}, set(), 2, 0.5, id="one of two slots taken by the gateway's: 0.5"),
        pytest.param({"other"}, {"x"}, 2, 0.0, id="running and the gateway's fill two slots: 0"),
        pytest.param({"sql"}, {"x"}, 1, 1.0, id="the gateway's request of the same adapter: 1"),
        pytest.param({"sql"}, None, None, 1.0, id="the same adapter in flight, not scraped: 1"),
        pytest.param({"other"}, None, None, 0.5, id="another in flight, not scraped: 0.5"),
    ],
)
def test_the_gateways_own_requests_in_flight_take_slots(
    pending: set[str], running: set[str] | None, max_lora: int | None, score: float
) -> None:
    w = lora_worker(
        "w",
        {"sql", "other", "x"},
        active=running,
        queued=None if running is None else set(),
        max_lora=max_lora,
    )
    w = dataclasses.replace(w, lora=dataclasses.replace(w.lora, pending=frozenset(pending)))
    cycle = Cycle(lora_req("sql"), view(w), 0.0, random.Random(0))
    assert LoraAffinityScorer().score(cycle, [w]) == [score]
