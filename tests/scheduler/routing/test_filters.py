"""Filter plugins, one table: each row a worker, a request and the reason (or None) expected."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from scheduler.fleet import EngineView, Role, WorkerView
from scheduler.routing import filters as f
from scheduler.routing.framework import Cycle, RouteRequest
from scheduler.routing.reasons import FilterReason as R
from tests.scheduler.routing.builders import BlockLedger, cap, profile, req, view, worker

MIXED_ONLY = frozenset({Role.MIXED})


def run(flt, w, r=None, *, roles=frozenset(Role), exclude=frozenset(), reserve=()):
    cycle = Cycle(r or req(), view(w), 0.0, random.Random(0), exclude, reserve)
    cycle.profile = profile(roles=roles, picker=None)
    return flt.filter(cycle, w)


@pytest.mark.parametrize(
    ("flt", "w", "r", "kw", "expected"),
    [
        pytest.param(
            f.ModelFilter(), worker(model="other"), None, {}, R.WRONG_MODEL, id="other model → wrong_model"
        ),
        pytest.param(f.ModelFilter(), worker(), None, {}, None, id="same model passes"),
        pytest.param(
            f.RoleFilter(),
            worker(role="prefill"),
            None,
            {"roles": MIXED_ONLY},
            R.WRONG_ROLE,
            id="prefill worker in a mixed-only profile → wrong_role",
        ),
        pytest.param(
            f.RoleFilter(), worker(role="mixed"), None, {"roles": MIXED_ONLY}, None, id="mixed worker passes"
        ),
        pytest.param(
            f.ExcludedFilter(),
            worker("a"),
            None,
            {"exclude": frozenset({"a"})},
            R.EXCLUDED,
            id="worker the gateway already failed on → excluded",
        ),
        pytest.param(
            f.StateFilter(), worker(state="draining"), None, {}, R.DRAINING, id="draining → draining"
        ),
        pytest.param(
            f.StateFilter(), worker(state="starting"), None, {}, R.STARTING, id="starting → starting"
        ),
        pytest.param(
            f.StateFilter(), worker(state="unhealthy"), None, {}, R.UNHEALTHY, id="unhealthy → unhealthy"
        ),
        pytest.param(f.StateFilter(), worker(state="ready"), None, {}, None, id="ready passes"),
        pytest.param(
            f.BreakerFilter(),
            worker(breaker=True),
            None,
            {},
            R.BREAKER_OPEN,
            id="open breaker → breaker_open",
        ),
        pytest.param(
            f.ContextLengthFilter(),
            worker(),
            req(prompt=8192),
            {},
            R.EXCEEDS_CONTEXT,
            id="8192-token prompt leaves no room for output in 8192 context → exceeds_context",
        ),
        pytest.param(
            f.ContextLengthFilter(),
            worker(),
            req(prompt=8191),
            {},
            None,
            id="8191 + 1 output token fits 8192",
        ),
        pytest.param(
            f.ContextLengthFilter(),
            worker(num_gpu_blocks=10),
            req(prompt=160),
            {},
            R.EXCEEDS_CONTEXT,
            id="ceil(161/16) = 11 blocks > a 10-block cache → exceeds_context",
        ),
        pytest.param(
            f.ContextLengthFilter(),
            worker(num_gpu_blocks=10),
            req(prompt=144),
            {},
            R.EXCEEDS_CONTEXT,
            id="ceil(145/16) = 10 blocks: a 10-block cache holds 9 (one is vLLM's null block) → exceeds_context",
        ),
        pytest.param(
            f.ContextLengthFilter(),
            worker(num_gpu_blocks=10),
            req(prompt=143),
            {},
            None,
            id="ceil(144/16) = 9 blocks fit the 9 usable",
        ),
        pytest.param(
            f.ContextLengthFilter(),
            worker(num_gpu_blocks=20, engines=(EngineView(0, 10), EngineView(1, 10))),
            req(prompt=144),
            {},
            R.EXCEEDS_CONTEXT,
            id="data-parallel: 20 blocks over two engines of 10; one sequence holds one engine's 9 → exceeds_context",
        ),
        pytest.param(
            f.ContextLengthFilter(),
            worker(num_gpu_blocks=20, engines=(EngineView(0, 10), EngineView(1, 10))),
            req(prompt=143),
            {},
            None,
            id="data-parallel: 9 blocks fit one engine",
        ),
        # at-capacity: limit = ceil(256 · 1.5) = 384
        pytest.param(
            f.AtCapacityFilter(),
            worker(inflight=384),
            None,
            {},
            R.AT_CAPACITY,
            id="384 in flight = limit → at_capacity",
        ),
        pytest.param(f.AtCapacityFilter(), worker(inflight=383), None, {}, None, id="383 in flight passes"),
        pytest.param(
            f.AtCapacityFilter(f.AtCapacityParams(inflight_factor=1.0)),
            worker(running=200, waiting=56),
            None,
            {},
            R.AT_CAPACITY,
            id="scraped 200 running + 56 waiting = 256 = limit at factor 1 → at_capacity",
        ),
        # kv-fit from scraped usage, L4: 2183 blocks; expected = 512 + 256 = 768 tokens = 48 blocks
        pytest.param(
            f.KvFitFilter(),
            worker(kv_usage=0.98),
            None,
            {},
            R.KV_FULL,
            id="usage at the 0.98 ceiling → kv_full",
        ),
        pytest.param(
            f.KvFitFilter(),
            worker(kv_usage=0.96),
            None,
            {},
            R.KV_FULL,
            id="(0.98 − 0.96) · 2183 = 43.7 free < 48 needed → kv_full",
        ),
        pytest.param(
            f.KvFitFilter(),
            worker(kv_usage=0.95),
            None,
            {},
            None,
            id="(0.98 − 0.95) · 2183 = 65.5 free ≥ 48 needed passes",
        ),
        pytest.param(
            f.KvFitFilter(), worker(), None, {}, None, id="never scraped passes (the engine queues)"
        ),
        pytest.param(
            f.KvFitFilter(),
            worker(kv_usage=0.0, num_gpu_blocks=60),
            dataclasses.replace(req(prompt=900, output=500), n=2),
            {},
            R.KV_EXCEEDS_CAPACITY,
            id="two sequences, 1,400 tokens = 88 blocks > the 59 the cache holds → kv_exceeds_capacity",
        ),
        pytest.param(
            f.KvFitFilter(),
            worker(kv_usage=0.0, num_gpu_blocks=60),
            dataclasses.replace(req(prompt=900, output=500), n=2, prompt_tokens_floor=256),
            {},
            None,
            id="over by an estimated prompt (900), not by its floor (256 + 500 = 48 blocks): the worker decides",
        ),
        pytest.param(
            f.KvFitFilter(),
            worker(kv_usage=0.0, num_gpu_blocks=60),
            req(prompt=900),
            {},
            None,
            id="900 + 256 tokens clamped to the 944-token context: 59 blocks, over the 0.98 · 60 = 58.8 ceiling "
            "but free on the idle worker → passes (vLLM runs it)",
        ),
        pytest.param(
            f.KvFitFilter(),
            worker(kv_usage=0.05, num_gpu_blocks=60),
            req(prompt=900),
            {},
            R.KV_FULL,
            id="the same with 3 blocks in use: 59 > 0.95 · 60 − 1 = 56 free → kv_full (until the worker is free)",
        ),
        pytest.param(
            f.KvFitFilter(),
            worker(kv_usage=0.0, num_gpu_blocks=49),
            None,
            {},
            None,
            id="48 blocks ≤ 0.98 · 49 = 48.02 passes the empty worker",
        ),
    ],
)
def test_filter(flt, w, r, kw, expected):
    assert run(flt, w, r, **kw) == expected


def test_kv_fit_asks_the_ledger_when_one_is_configured():
    w = worker("a", kv_usage=0.99)  # the scrape says full, the ledger has the final word
    ledger = BlockLedger({"a": 48})  # ceil((512 + 256) / 16) = 48 blocks fits exactly
    assert run(f.KvFitFilter(), w, reserve=(ledger,)) is None
    ledger.used["a"] = 1
    assert run(f.KvFitFilter(), w, reserve=(ledger,)) == R.KV_FULL
    assert (
        run(f.KvFitFilter(f.KvFitParams(use_ledger=False)), worker("a", kv_usage=0.5), reserve=(ledger,))
        is None
    )


def _estimated(prompt: int, floor: int) -> RouteRequest:
    return dataclasses.replace(req(prompt=prompt), prompt_tokens_floor=floor)


SHORT = worker("short")  # 8,192-token context
LONG = worker("long", capacity=dataclasses.replace(cap("L4"), max_model_len=32_768, kv_blocks=4096))


@pytest.mark.parametrize(
    ("r", "workers", "expected"),
    [
        pytest.param(
            _estimated(8250, 4125),
            (SHORT, LONG),
            {"short": R.EXCEEDS_CONTEXT, "long": None},
            id="estimate over the short context: the worker that fits the estimate is preferred",
        ),
        pytest.param(
            _estimated(8250, 4125),
            (SHORT,),
            {"short": None},
            id="no worker fits the estimate but the floor fits: left to the worker",
        ),
        pytest.param(
            _estimated(20_000, 10_000),
            (SHORT,),
            {"short": R.EXCEEDS_CONTEXT},
            id="even the floor is over the context: refused",
        ),
        pytest.param(
            req(prompt=8250),
            (SHORT,),
            {"short": R.EXCEEDS_CONTEXT},
            id="an exact (token-id) prompt over the context: refused",
        ),
    ],
)
def test_an_estimated_prompt_length_steers_but_refuses_only_on_its_floor(
    r: RouteRequest, workers: tuple[WorkerView, ...], expected: dict[str, R | None]
) -> None:
    cycle = Cycle(r, view(*workers), 0.0, random.Random(0), frozenset(), ())
    cycle.profile = profile(picker=None)
    flt = f.ContextLengthFilter()
    assert {w.id: flt.filter(cycle, w) for w in workers} == expected


def _long(**kw: Any) -> WorkerView:
    return worker("long", capacity=LONG.capacity, **kw)


@pytest.mark.parametrize(
    ("long", "exclude", "roles"),
    [
        pytest.param(_long(state="unhealthy"), frozenset(), frozenset(Role), id="unhealthy"),
        pytest.param(_long(state="draining"), frozenset(), frozenset(Role), id="draining"),
        pytest.param(_long(breaker=True), frozenset(), frozenset(Role), id="breaker open"),
        pytest.param(_long(), frozenset({"long"}), frozenset(Role), id="excluded after a failed attempt"),
        pytest.param(_long(role="prefill"), frozenset(), frozenset({Role.MIXED}), id="a role this profile skips"),
    ],
)  # fmt: skip
def test_a_worker_that_cannot_serve_does_not_turn_the_estimate_away(
    long: WorkerView, exclude: frozenset[str], roles: frozenset[Role]
) -> None:
    """A long-context worker that fits the estimate but cannot take the request now made the short one
    refuse it as exceeds_context: the request waited or was refused instead of reaching a worker."""
    cycle = Cycle(_estimated(8250, 4125), view(SHORT, long), 0.0, random.Random(0), exclude, ())
    cycle.profile = profile(roles=roles, picker=None)
    assert f.ContextLengthFilter().filter(cycle, SHORT) is None
