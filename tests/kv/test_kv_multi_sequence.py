"""Requests of several sequences (`n` > 1, a batch of prompts on /v1/completions): the KV footprint is summed
per sequence (each clamped to max_model_len and rounded to blocks on its own), and the context filter checks
each sequence's prompt, not the batch's sum. Single-sequence requests keep their footprint exactly."""

from __future__ import annotations

import json
import random

import pytest

from scheduler.fleet import FleetView
from scheduler.kv.footprint import WorkerKvSpec, need, request_need
from scheduler.routing.filters import ContextLengthFilter
from scheduler.routing.framework import Cycle, RouteRequest
from scheduler.routing.reasons import FilterReason
from server.footprint import parse_request, route_request
from tests.kv.kvkit import two_group_spec, worker

SPEC_4K = WorkerKvSpec(16, 4096)


def _route(body: dict[str, object], kind: str = "completions") -> RouteRequest:
    parsed = parse_request(kind, json.dumps(body).encode())  # type: ignore[arg-type]
    return route_request(parsed, "r", 0.0, default_output_tokens=256)


@pytest.mark.parametrize(
    ("shape", "output", "max_len", "blocks"),
    [
        # 4 sequences of 100 + 4000, each clamped at 4096: 4 · 256 (summed and clamped once it was 256)
        pytest.param(((100,), 4), 4 * 4000, 4096, 4 * 256, id="prompt of 100, n=4, max_tokens 4000 → 1024"),
        # without a context limit: 4 · ceil(4100 / 16) = 4 · 257
        pytest.param(((100,), 4), 4 * 4000, None, 4 * 257, id="the same, no context limit → 1028"),
        # 3 sequences of 2000 + 2000: 3 · ceil(4000 / 16) = 3 · 250; summed and clamped once it was 256
        pytest.param(((2000, 2000, 2000), 1), 3 * 2000, 4096, 3 * 250, id="three 2000-token prompts → 750"),
        # each sequence is clamped on its own: 3000 + min(2000, 1096) = 4096 → 256 blocks each
        pytest.param(((3000,), 2), 2 * 2000, 4096, 2 * 256, id="n=2, each sequence clamped at 4096 → 512"),
        # prompts of different lengths: ceil(150/16) + ceil(2050/16) = 10 + 129, times n = 2
        pytest.param(((100, 2000), 2), 4 * 50, 4096, 2 * (10 + 129), id="two prompts × n=2 → 278"),
    ],
)
def test_footprint_is_summed_per_sequence(
    shape: tuple[tuple[int, ...], int], output: int, max_len: int | None, blocks: int
) -> None:
    fp = request_need(shape, output, WorkerKvSpec(16, max_len))
    assert (fp.peak, fp.steady, fp.group_pages) == (blocks, blocks, blocks)


def test_reserved_output_is_the_total_the_sequences_cover() -> None:
    # n=2, prompt 3000, 2000 each: each clamped to 1096 → 2192 of the 4000 requested
    assert request_need(((3000,), 2), 4000, SPEC_4K).reserved_output == 2 * 1096
    # the request's output split evenly, rounded up per sequence: ceil(10 / 3) = 4 each
    fp = request_need(((16, 16, 16), 1), 10, WorkerKvSpec(16, None))
    assert fp.reserved_output == 12 and fp.peak == 3 * 2  # ceil((16 + 4) / 16) = 2 blocks each


@pytest.mark.parametrize(("prompt", "out"), [(100, 50), (96, 0), (100, 1000), (5000, 10)])
def test_one_sequence_is_need_unchanged(prompt: int, out: int) -> None:
    spec = WorkerKvSpec(16, 512)
    assert request_need(prompt, out, spec) == need(prompt, out, spec)
    assert request_need(((prompt,), 1), out, spec) == need(prompt, out, spec)


def test_compression_worker_sums_head_pages_per_sequence() -> None:
    # tests/kv/test_kv_footprint.py: need(100, 10) on two_group_spec = peak 116, steady 104 head-pages
    spec = WorkerKvSpec(4, None, two_group_spec())
    fp = request_need(((100,), 3), 30, spec)
    assert (fp.peak, fp.steady, fp.group_pages) == (3 * 116, 3 * 104, 3 * 26)


def test_n_and_batches_reach_the_route_request_per_sequence() -> None:
    r = _route({"model": "m", "prompt": [1] * 100, "n": 4, "max_tokens": 4000})
    assert (r.prompt_tokens, r.max_output_tokens, r.n, r.prompt_lens) == (100, 16000, 4, ())
    assert (r.sequences, r.longest_prompt, r.sequence_shape) == (4, 100, ((100,), 4))
    b = _route({"model": "m", "prompt": [[1] * 2000, [2] * 2000, [3] * 2000], "max_tokens": 2000})
    assert (b.prompt_tokens, b.max_output_tokens, b.prompt_lens) == (6000, 6000, (2000, 2000, 2000))
    assert (b.sequences, b.longest_prompt, b.sequence_shape) == (3, 2000, ((2000, 2000, 2000), 1))
    assert request_need(b.sequence_shape, b.max_output_tokens, SPEC_4K).peak == 750
    chat = _route(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 10}, "chat"
    )
    assert chat.sequence_shape == ((chat.prompt_tokens,), 2) and chat.max_output_tokens == 20


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": [1] * 100, "max_tokens": 50},
        {"model": "m", "prompt": [[1] * 100], "max_tokens": 50},
        {"model": "m", "prompt": "x" * 400, "max_tokens": 50},
        {"model": "m", "prompt": ["x" * 400], "max_tokens": 50},
    ],
    ids=["ids", "one id prompt in a list", "text", "one text prompt in a list"],
)
def test_a_single_sequence_keeps_its_scalar_shape(body: dict[str, object]) -> None:
    r = _route(body)
    assert (r.n, r.prompt_lens, r.sequences, r.sequence_shape) == (1, (), 1, 100)
    assert request_need(r.sequence_shape, r.max_output_tokens, SPEC_4K) == need(100, 50, SPEC_4K)


def _context(r: RouteRequest, max_model_len: int) -> FilterReason | None:
    w = worker(blocks=10_000, max_model_len=max_model_len)
    return ContextLengthFilter().filter(Cycle(r, FleetView((w,)), 0.0, random.Random(0)), w)


def test_context_filter_checks_each_prompt_of_a_batch_not_their_sum() -> None:
    ids = _route({"model": "m", "prompt": [[1] * 2000] * 3, "max_tokens": 2000})
    assert _context(ids, 4096) is None  # 2000 + 1 ≤ 4096 per sequence (the sum, 6000, was refused)
    text = _route({"model": "m", "prompt": ["x" * 8000] * 3, "max_tokens": 2000})  # ~2000 tokens each
    assert text.prompt_tokens == 6000 and text.prompt_tokens_floor == 1000  # the longest prompt's floor
    assert _context(text, 4096) is None
    too_long = _route({"model": "m", "prompt": [[1] * 100, [1] * 4096]})
    assert _context(too_long, 4096) is FilterReason.EXCEEDS_CONTEXT  # its longest prompt leaves no room
