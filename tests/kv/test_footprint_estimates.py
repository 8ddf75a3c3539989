"""The gateway's footprint estimates that feed KV reservations.

- A cold length predictor (fewer than `min_samples` observations) predicts the worst case, so `predicted`
  mode never overbooks before it has learnt anything (it used to reserve min(max_tokens, 256)).
- Text prompts: ASCII at 4 characters a token (unchanged), other characters at 3 UTF-8 bytes a token, so a
  CJK prompt is not counted 3–4× short; the context floor stays c / 8 for c characters.
"""

from __future__ import annotations

import json
import random

import pytest

from scheduler.fleet import FleetView
from scheduler.kv.ledger import KvLedger, LedgerSettings
from scheduler.length_predictor import LengthPredictor
from scheduler.routing.filters import ContextLengthFilter
from scheduler.routing.framework import Cycle, RouteRequest
from scheduler.routing.reasons import FilterReason
from server.footprint import estimate_text_tokens, parse_request, route_request
from tests.kv.kvkit import worker


def _route(
    body: dict[str, object], predictor: LengthPredictor | None = None, kind: str = "completions"
) -> RouteRequest:
    parsed = parse_request(kind, json.dumps(body).encode())  # type: ignore[arg-type]
    return route_request(parsed, "r", 0.0, default_output_tokens=256, predictor=predictor)


# --- C: a cold predictor predicts the worst case ----------------------------------------------------------


def test_cold_predictor_predicts_the_worst_case_then_its_quantile_once_warm() -> None:
    body = {"model": "m", "prompt": [1] * 100, "max_tokens": 1000}
    predictor = LengthPredictor(min_samples=20)
    assert _route(body, predictor).predicted_output_tokens == 1000  # was min(1000, 256) = 256
    for _ in range(19):
        predictor.observe("m", 100, 100)
    assert _route(body, predictor).predicted_output_tokens == 1000  # 19 < min_samples: still cold
    predictor.observe("m", 100, 100)
    assert _route(body, predictor).predicted_output_tokens == 100  # the 0.9-quantile of 20 × 100
    assert _route(body).predicted_output_tokens == 256  # no predictor (no ledger): a routing estimate


def test_predicted_ledger_reserves_the_worst_case_while_the_predictor_is_cold() -> None:
    ledger = KvLedger(LedgerSettings(mode="predicted", watermark=0.0))
    w = worker(blocks=1000)
    req = _route({"model": "m", "prompt": [1] * 100, "max_tokens": 1000}, ledger.predictor)
    fp, worst = ledger.footprint(req, w)
    # ceil(1100 / 16); with the 256 default it reserved ceil(356 / 16) = 23
    assert fp.peak == worst.peak == 69


# --- D: text estimates ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        pytest.param("a" * 400, 100, id="ASCII: ceil(400 / 4), unchanged"),
        pytest.param("a" * 401, 101, id="ASCII: rounded up, unchanged"),
        pytest.param("你好" * 1000, 2000, id="CJK: 2000 characters, 6000 bytes / 3 (was 500)"),
        pytest.param("привет", 4, id="Cyrillic: 12 bytes / 3 (was 2)"),
        pytest.param("héllo wörld", 4, id="mixed: ceil(9 / 4 + 4 / 3) = ceil(3.58)"),
        pytest.param("\ud800", 1, id="a lone surrogate does not raise"),
        pytest.param("", 0, id="empty"),
    ],
)
def test_text_estimate(text: str, tokens: int) -> None:
    assert estimate_text_tokens(text) == tokens


def test_cjk_chat_prompt_and_its_reservation() -> None:
    r = _route(
        {"model": "m", "messages": [{"role": "user", "content": "你" * 1000}], "max_tokens": 16}, kind="chat"
    )
    assert r.prompt_tokens == 1000 + 3 + 3  # the text, the message's framing, the reply priming
    assert r.prompt_tokens_floor == 128  # ceil((ceil(1000 / 4) + 3 + 3) / 2): c / 8, as before
    fp, _ = KvLedger(LedgerSettings(watermark=0.0)).footprint(r, worker(blocks=1000))
    assert fp.peak == 64  # ceil((1006 + 16) / 16); at 4 characters a token it was ceil((256 + 16) / 16) = 17


def test_context_floor_of_a_long_cjk_prompt_still_lets_a_worker_decide() -> None:
    r = _route({"model": "m", "prompt": "字" * 10_000, "max_tokens": 16})
    assert (r.prompt_tokens, r.prompt_tokens_floor) == (10_000, 1250)  # floor: 10,000 characters / 8
    w = worker(blocks=10_000, max_model_len=8192)
    # over the context by the estimate, not by the floor, and no worker fits the estimate: passed on
    assert ContextLengthFilter().filter(Cycle(r, FleetView((w,)), 0.0, random.Random(0)), w) is None


@pytest.mark.parametrize(
    ("prompt", "floor", "fits"),
    [
        # measured on vLLM 0.32 (tiny-llama, Llama's tokenizer, 512 tokens): 451 tokens, served by vLLM;
        # the plain floor, ceil(4,350 / 8) = 544, refused it. Each line: "return" "self" and one character
        # per whitespace run: 12 → ceil((150 · 12 + 1) / 4) = 451 → ceil(451 / 2) = 226
        pytest.param(("\n" + " " * 16 + "return self\n") * 150, 226, True, id="indented code: 451 tokens"),
        pytest.param(" " * 4500, 1, True, id="whitespace only: 282 tokens (was refused at 563)"),
        pytest.param("word " * 1000, 625, False, id="prose, one space a word: unchanged, over 512"),
        pytest.param("x" * 2048, 256, True, id="at the scan threshold: plain, unchanged"),
    ],
)
def test_the_context_floor_counts_a_whitespace_run_as_one_character(
    prompt: str, floor: int, fits: bool
) -> None:
    r = _route({"model": "m", "prompt": prompt, "max_tokens": 4})
    assert r.prompt_tokens_floor == floor
    w = worker(blocks=10_000, max_model_len=512)
    refused = ContextLengthFilter().filter(Cycle(r, FleetView((w,)), 0.0, random.Random(0)), w)
    # under the 512-token context on its floor: passed to the worker, which counts and decides
    assert refused is (None if fits else FilterReason.EXCEEDS_CONTEXT)
