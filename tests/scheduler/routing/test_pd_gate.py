"""Conditional disaggregation (scheduler/routing/pd_gate.py): exact decisions on hand-built fleet views.

Rates from the perf model (Llama-3-8B): H100 prefill 27,959.26 tok/s, A100 12,019.70 tok/s, API overhead
0.012 s. Prompt 2,048 tokens throughout, so an idle A100 decode worker prefills it locally in
L_d = 0.012 + 2048 / 12019.70 = 0.1824 s.
"""

from __future__ import annotations

import random

import pytest

from scheduler.routing.config import RoutingConfig, RoutingConfigError, build_router, parse_routing_config
from scheduler.routing.framework import Decision
from scheduler.routing.pd_gate import PdGate, prefill_queue_wait_s
from scheduler.routing.reasons import Outcome
from tests.scheduler.routing.builders import BlockLedger, cap, req, view, worker

H100 = cap("H100-SXM").prefill_tokens_per_s
A100 = cap("A100-80GB").prefill_tokens_per_s
PROMPT = 2048
IDLE_P = worker("p", gpu="H100-SXM", role="prefill")
D = worker("d", gpu="A100-80GB", role="decode")


def prefill(id: str = "p", queued: int = 0, waiting: int | None = None):
    return worker(id, gpu="H100-SXM", role="prefill", prefill_tokens=queued, waiting=waiting)


def route(fleet, *, wait=None, margin=0.5, reserve=()):
    cfg = RoutingConfig(pd_max_prefill_wait_s=wait, pd_local_prefill_margin_s=margin)
    decision = build_router(cfg, reserve=reserve).route(req(prompt=PROMPT), fleet, 0.0, random.Random(0))
    assert isinstance(decision, Decision)
    return decision


@pytest.mark.parametrize(
    ("fleet", "wait", "margin", "expected"),
    [
        pytest.param(view(IDLE_P, D), 1.0, 0.5, ("pd", "p"), id="prefill idle (W = 0) → remote prefill"),
        pytest.param(
            view(prefill(queued=56_000), D),
            1.0,
            0.5,
            ("decode-only", None),
            id="prefill queue 56k tok: W = 56000/27959 = 2.003 s > bound 1 and > L_d + 0.5 = 0.68 → local",
        ),
        pytest.param(
            view(prefill(queued=56_000), D),
            None,
            0.5,
            ("pd", "p"),
            id="bound null → always remote, however long the prefill queue (the behaviour before the gate)",
        ),
        pytest.param(
            view(prefill(queued=14_000), D),
            1.0,
            0.5,
            ("pd", "p"),
            id="W = 14000/27959 = 0.501 s under the bound → remote",
        ),
        pytest.param(
            view(prefill(queued=14_000), D),
            0.25,
            0.5,
            ("pd", "p"),
            id="W = 0.501 over bound 0.25 but not over L_d + 0.5 = 0.682 → remote (local is not sooner)",
        ),
        pytest.param(
            view(prefill(queued=14_000), D),
            0.25,
            None,
            ("decode-only", None),
            id="margin null: over the bound is enough → local",
        ),
        pytest.param(
            view(prefill(queued=56_000), worker("d", gpu="A100-80GB", role="decode", prefill_tokens=48_000)),
            1.0,
            0.5,
            ("pd", "p"),
            id="decode worker has its own 48k-token prefill queue: L_d = 0.012 + 50048/12020 = 4.18 s > W → remote",
        ),
        pytest.param(
            view(prefill("p1", queued=56_000), prefill("p2"), D),
            1.0,
            0.5,
            ("pd", "p2"),
            id="one prefill worker saturated, one idle: the pool's best wait is 0 → remote, to the idle one",
        ),
        pytest.param(
            view(prefill(waiting=30), D),
            1.0,
            0.5,
            ("decode-only", None),
            id="scraped waiting 30 × 2048 = 61,440 tok queued (no gateway in-flight): W = 2.198 s → local",
        ),
    ],
)
def test_gate_decisions(fleet, wait, margin, expected):
    decision = route(fleet, wait=wait, margin=margin)
    assert (decision.path, decision.prefill.id if decision.prefill else None) == expected
    assert decision.decode.id == "d"


def test_verdict_exposes_the_estimates():
    v = PdGate(1.0, 0.5).verdict(req(prompt=PROMPT), D, [prefill(queued=56_000)])
    assert v.local and v.reason == "pool-saturated"
    assert v.best_prefill_wait_s == pytest.approx(56_000 / H100)  # 2.0029 s
    assert v.local_prefill_s == pytest.approx(0.012 + PROMPT / A100)  # 0.1824 s
    v = PdGate(0.25, 0.5).verdict(req(prompt=PROMPT), D, [prefill(queued=14_000)])
    assert (v.local, v.reason) == (False, "local-not-sooner")
    assert PdGate().verdict(req(prompt=PROMPT), D, [prefill(queued=10**6)]).reason == "remote"


def test_queue_wait_is_the_est_ttft_queue_without_this_prompt():
    assert prefill_queue_wait_s(prefill(queued=27_959), req(prompt=PROMPT)) == pytest.approx(27_959 / H100)
    # max(in-flight 1,000, scraped 2 waiting × 2,048) = 4,096 tokens queued
    assert prefill_queue_wait_s(prefill(queued=1_000, waiting=2), req(prompt=PROMPT)) == pytest.approx(
        4096 / H100
    )


def test_local_prefill_keeps_the_decode_reservation_and_releases_the_prefill_one():
    ledger = BlockLedger({"p": 1000, "d": 1000})
    decision = route(view(prefill(queued=56_000), D), wait=1.0, reserve=(ledger,))
    assert decision.path == "decode-only"
    assert [r.worker_id for r in decision.reservations] == ["d"]
    assert ledger.used == {"p": 0, "d": 144}  # ceil((2048 + 256) / 16) = 144 blocks on d only
    decision.release(Outcome.COMPLETED)
    assert ledger.used == {"p": 0, "d": 0} and ledger.double_releases == 0


def test_describe_shows_the_knobs():
    router = build_router(RoutingConfig(pd_max_prefill_wait_s=1.5, pd_local_prefill_margin_s=None))
    described = router.describe()
    assert (described["pd_max_prefill_wait_s"], described["pd_local_prefill_margin_s"]) == (1.5, None)
    assert router.handler.describe()["pd_max_prefill_wait_s"] == 1.5  # type: ignore[attr-defined]
    default = build_router().describe()
    assert (default["pd_max_prefill_wait_s"], default["pd_local_prefill_margin_s"]) == (None, 0.5)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            {"pd_max_prefill_wait_s": -1},
            "routing.pd_max_prefill_wait_s: Input should be greater than or equal to 0",
            id="negative bound refused",
        ),
        pytest.param(
            {"pd_local_prefill_margin_s": "soon"},
            "routing.pd_local_prefill_margin_s: Input should be a valid number, unable to parse string as a number",
            id="non-number margin refused",
        ),
    ],
)
def test_config_errors(data, message):
    with pytest.raises(RoutingConfigError) as err:
        parse_routing_config(data)
    assert str(err.value) == message
