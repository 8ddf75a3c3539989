"""The KV ledger on requests of several sequences, and requests that can never fit.

- `n` > 1 and batches of prompts reserve Σ per sequence (`scheduler.kv.footprint.request_need`), through the
  ledger's footprint, reserve, release and growth.
- A request whose footprint exceeds every worker's reservable capacity even with nothing reserved (share
  and watermark applied, shrink not) is refused at once: `kv_exceeds_capacity`, 400, final — not `kv_full`,
  which would hold it in the admission queue until its deadline and then answer a retryable 429.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from scheduler.fleet import FleetView
from scheduler.kv.ledger import KvLedger, LedgerSettings
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.framework import Decision, RouteRequest
from scheduler.routing.reasons import FilterReason, Outcome, Reject
from server.config import validate_config
from server.footprint import parse_request, route_request
from tests.gateway.serverkit import GatewayThread
from tests.kv.kvkit import request, simulated_l4_pool, worker


def _route(body: dict[str, object]) -> RouteRequest:
    return route_request(parse_request("completions", json.dumps(body).encode()), "r", 0.0, 256)


# --- A: several sequences --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "blocks"),
    [
        # each of the 4 sequences: min(100 + 4000, 4096) → 256 blocks (one clamped sum was 256 in all)
        pytest.param({"prompt": [1] * 100, "n": 4, "max_tokens": 4000}, 4 * 256, id="n=4 → 1024 blocks"),
        # each of the 3 sequences: ceil((2000 + 2000) / 16) = 250 (one clamped sum was 256 in all)
        pytest.param({"prompt": [[1] * 2000] * 3, "max_tokens": 2000}, 3 * 250, id="3 prompts → 750 blocks"),
        # one sequence: as before, ceil(min(100 + 4000, 4096) / 16)
        pytest.param({"prompt": [1] * 100, "max_tokens": 4000}, 256, id="n=1 → 256 blocks, unchanged"),
    ],
)
def test_the_ledger_reserves_every_sequence(body: dict[str, object], blocks: int) -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    w = worker(blocks=2000, max_model_len=4096)
    req = _route({"model": "m", **body})
    fp, worst = ledger.footprint(req, w)
    assert fp.peak == worst.peak == blocks
    res = ledger.reserve(req, w, 0.0)
    assert res is not None and ledger.reserved(w.id) == blocks
    res.release(Outcome.COMPLETED)
    assert ledger.reserved(w.id) == 0


def test_predicted_mode_splits_the_prediction_over_the_sequences_and_grows_them_together() -> None:
    ledger = KvLedger(LedgerSettings(mode="predicted", watermark=0.0, max_overbook_frac=10.0))
    w = worker(blocks=2000)
    # n=4, prompt 100, max_tokens 400, predicted 4 · 60 = 240 in all → 60 per sequence:
    # 4 · ceil(160 / 16) = 40 blocks now, worst 4 · ceil(500 / 16) = 128
    req = RouteRequest("r", "m", 100, 1600, 240, n=4)
    fp, worst = ledger.footprint(req, w)
    assert (fp.peak, worst.peak, fp.reserved_output) == (40, 128, 240)
    res = ledger.reserve(req, w, 0.0)
    assert res is not None and res.units == 40
    res.first_token(0.0)
    # 240 tokens streamed over the 4 sequences: the cold predictor doubles → 480 in all, 120 each:
    # 4 · ceil(220 / 16) = 56 blocks
    assert res.on_tokens(240, 1.0)
    assert res.units == 56 and res.reserved_output == 480
    res.release(Outcome.COMPLETED)
    assert ledger.reserved(w.id) == 0


def test_prefill_worker_reserves_each_sequences_prompt() -> None:
    from scheduler.fleet import Role

    ledger = KvLedger(LedgerSettings(watermark=0.0))
    p = worker("p", blocks=2000, role=Role.PREFILL)
    # 3 prompts of 2000, one token each: 3 · ceil(2001 / 16) = 3 · 126
    fp, _ = ledger.footprint(_route({"model": "m", "prompt": [[1] * 2000] * 3, "max_tokens": 500}), p)
    assert fp.peak == 3 * 126


# --- B: can never fit -----------------------------------------------------------------------------------


def _router_and_ledger(mode: str = "worst_case") -> tuple[object, KvLedger]:
    ledger = KvLedger(LedgerSettings(mode=mode, share=0.5))  # type: ignore[arg-type]
    return build_router(RoutingConfig(), reserve=[ledger]), ledger


def _route_on(router: object, req: RouteRequest, *workers: object) -> Decision | Reject:
    return router.route(req, FleetView(tuple(workers)), 0.0, random.Random(0))  # type: ignore[attr-defined]


def test_a_request_over_every_workers_reservable_capacity_is_refused_as_final() -> None:
    router, ledger = _router_and_ledger()
    # capacity = floor(blocks · 0.98 · 0.5): 49 and 58; one request alone may take floor((blocks − the null
    # block) · 0.5): 49 and 59; the request: ceil((944 + 16) / 16) = 60 blocks
    a, b = worker("a", blocks=100), worker("b", blocks=120)
    assert (ledger.capacity(a), ledger.capacity(b)) == (49, 58)
    out = _route_on(router, request("big", 944, 16), a, b)
    assert isinstance(out, Reject)
    assert out.primary is FilterReason.KV_EXCEEDS_CAPACITY and not out.retryable
    assert out.http_status == 400
    assert out.details == {"kv_need_blocks": 60, "kv_reservable_blocks": 59}
    assert out.error_body("m") == {
        "error": {
            "message": "The request's KV-cache footprint of 60 blocks exceeds the 59 blocks the largest worker "
            "of model 'm' can reserve for one request; lower max_tokens (or n, or the prompt length)",
            "type": "BadRequestError",
            "param": None,
            "code": "kv_exceeds_capacity",
        }
    }


def test_a_request_that_fits_an_empty_worker_stays_kv_full_and_retryable() -> None:
    router, ledger = _router_and_ledger()
    a = worker("a", blocks=100)  # 49 reservable
    held = ledger.reserve(request("held", 304, 16), a, 0.0)  # 20 blocks
    assert held is not None
    out = _route_on(router, request("r", 624, 16), a)  # 40 blocks: 20 + 40 > 49 now, 40 ≤ 49 empty
    assert isinstance(out, Reject) and out.primary is FilterReason.KV_FULL and out.retryable
    held.release(Outcome.COMPLETED)
    assert isinstance(_route_on(router, request("r", 624, 16), a), Decision)


def test_shrink_from_reconcile_does_not_make_a_request_final() -> None:
    router, ledger = _router_and_ledger()
    a = worker("a", blocks=100, kv_usage=0.9)
    ledger.reconcile([a], 0.0)  # 90 used, 50 explained by the other share, 2 tolerance → shrink 38
    assert ledger.capacity(a) == 49 - 38
    out = _route_on(router, request("r", 624, 16), a)  # 40 blocks > 11 now, ≤ 49 with nothing withheld
    assert isinstance(out, Reject) and out.primary is FilterReason.KV_FULL and out.retryable


def test_predicted_mode_is_final_when_the_worst_case_exceeds_the_overbook_limit() -> None:
    router, _ = _router_and_ledger("predicted")
    a = worker("a", blocks=100)  # 49 reservable; worst-case peaks may reach floor(49 · 1.1) = 53
    # predicted ceil((16 + 16) / 16) = 2 blocks, worst ceil((16 + 1000) / 16) = 64 > 53
    out = _route_on(router, request("r", 16, 1000, predicted=16), a)
    assert isinstance(out, Reject) and out.primary is FilterReason.KV_EXCEEDS_CAPACITY
    assert out.details == {"kv_need_blocks": 64, "kv_reservable_blocks": 53}


def test_a_chat_request_without_max_tokens_is_served_on_a_worker_whose_kv_just_covers_its_context() -> None:
    """The L4 at gpu_memory_utilization 0.75 holds 467 blocks and serves max_model_len 7,456 (466 blocks), as
    vLLM clamps it. A request without max_tokens reserves up to max_model_len: past the watermark's 457
    blocks, it was refused for good (400 kv_exceeds_capacity) though the worker serves it; alone it fits."""
    cfg = validate_config({"pools": [simulated_l4_pool("llama-3-8b")], "health": {"interval_s": 60}})
    with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        chat = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "Hi"}]}
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        body = {"model": "llama-3-8b", "prompt": [9] * 7300, "max_tokens": 100, "ignore_eos": True}  # ≤ 7,456
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 100


def test_gateway_answers_400_at_once_when_a_prompt_exceeds_its_share_of_every_worker() -> None:
    """Two gateway replicas: this one owns half of the L4's 466 reservable blocks. A 4,000-token prompt (251
    blocks with max_tokens 16) fits the worker but never this gateway's share: 400 at once, not a 429 after
    5 s."""
    cfg = validate_config(
        {
            "pools": [simulated_l4_pool("llama-3-8b")],
            "gateway": {"replicas": 2},
            "health": {"interval_s": 60},
            "limits": {"queue_deadline_s": 5.0},
        }
    )
    with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        body = {"model": "llama-3-8b", "prompt": [9] * 4000, "max_tokens": 16}
        t0 = time.monotonic()
        r = http.post("/v1/completions", json=body)
        elapsed = time.monotonic() - t0
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "kv_exceeds_capacity" and err["param"] is None
        assert "footprint of 251 blocks exceeds the 233 blocks" in err["message"]  # floor((467 − 1) / 2)
        assert elapsed < 2.0
        ok = http.post("/v1/completions", json={**body, "prompt": [9] * 1000})  # 64 blocks: served
        assert ok.status_code == 200
