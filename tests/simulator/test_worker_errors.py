"""Raw HTTP against the worker app (httpx.ASGITransport): vLLM's error shapes, clamping, failure injection."""

from __future__ import annotations

from typing import Any

import pytest

from simulator.engine import EngineConfig
from simulator.worker_app import FaultConfig, WorkerConfig

pytestmark = pytest.mark.anyio
CFG = WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=1e4, engine=EngineConfig(max_model_len=256))
C, CHAT = "/v1/completions", "/v1/chat/completions"
M = "llama-3-8b"

ERRORS = [
    pytest.param(C, {"model": "gpt-4", "prompt": "hi"}, 404, "NotFoundError", "model", id="unknown model → 404"),
    pytest.param(C, {"model": M, "prompt": "x" * 1100}, 400, "BadRequestError", "input_tokens",
                 id="prompt of 275 tokens over max_model_len 256 → 400 input_tokens"),
    pytest.param(C, {"model": M, "prompt": "x" * 1100, "stream": True}, 400, "BadRequestError", "input_tokens",
                 id="prompt over max_model_len while streaming → plain JSON 400"),
    pytest.param(C, {"model": M, "prompt": "x" * 1024}, 400, "BadRequestError", "input_tokens",
                 id="prompt of exactly max_model_len leaves no room → 400"),
    pytest.param(C, {"model": M, "prompt": "hi", "max_tokens": -1}, 400, "BadRequestError", "max_tokens",
                 id="max_tokens -1 → 400 max_tokens"),
    pytest.param(C, {"model": M, "prompt": "hi", "max_tokens": 0}, 400, "BadRequestError", "max_tokens",
                 id="max_tokens 0 → 400 max_tokens"),
    pytest.param(C, {"model": M, "prompt": "hi", "max_tokens": 1000}, 400, "BadRequestError", "max_tokens",
                 id="max_tokens over max_model_len → 400 max_tokens (vLLM 0.32)"),
    pytest.param(C, {"model": M, "prompt": "hi", "max_tokens": 3, "min_tokens": 5}, 400, "BadRequestError",
                 None, id="min_tokens over max_tokens → 400, no param (as vLLM)"),
    # sampling ranges, as vLLM 0.32 checks them (tests/real_vllm/test_fidelity.py runs the same against it)
    pytest.param(C, {"model": M, "prompt": "hi", "temperature": -5}, 400, "BadRequestError", "temperature",
                 id="temperature below 0"),
    pytest.param(C, {"model": M, "prompt": "hi", "temperature": 2.5}, 400, "BadRequestError", "temperature",
                 id="temperature over 2"),
    pytest.param(C, {"model": M, "prompt": "hi", "top_p": 0}, 400, "BadRequestError", "top_p", id="top_p 0"),
    pytest.param(C, {"model": M, "prompt": "hi", "top_k": -5}, 400, "BadRequestError", None, id="top_k -5"),
    pytest.param(C, {"model": M, "prompt": "hi", "min_p": 2}, 400, "BadRequestError", None, id="min_p 2"),
    pytest.param(C, {"model": M, "prompt": "hi", "presence_penalty": 5}, 400, "BadRequestError", None,
                 id="presence_penalty 5"),
    pytest.param(C, {"model": M, "prompt": "hi", "repetition_penalty": 0}, 400, "BadRequestError", None,
                 id="repetition_penalty 0"),
    pytest.param(C, {"model": M, "prompt": "hi", "logprobs": 21}, 400, "BadRequestError", "logprobs",
                 id="logprobs over 20"),
    pytest.param(CHAT, {"model": M, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400,
                 "BadRequestError", "top_logprobs", id="chat top_logprobs without logprobs"),
    pytest.param(C, {"model": M, "prompt": "hi", "logprobs": -1}, 400, "BadRequestError", "logprobs",
                 id="logprobs -1 (the whole vocabulary) over 20"),
    pytest.param(C, {"model": M, "prompt": "hi", "logprobs": -5}, 400, "BadRequestError", "logprobs",
                 id="logprobs -5"),
    pytest.param(CHAT, {"model": M, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                        "top_logprobs": -1}, 400, "BadRequestError", "logprobs",
                 id="chat top_logprobs -1 (the whole vocabulary) over 20"),
    pytest.param(CHAT, {"model": M, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": -5}, 400,
                 "BadRequestError", "top_logprobs", id="chat top_logprobs -5, before the logprobs check"),
    pytest.param(C, {"model": M, "prompt": "hi", "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, 400,
                 "BadRequestError", "kv_transfer_params", id="kv_transfer_params with n 2 → 400"),
    pytest.param(C, {"model": M, "prompt": ["a", "b"], "kv_transfer_params": {"do_remote_prefill": True}}, 400,
                 "BadRequestError", "kv_transfer_params", id="kv_transfer_params with a batch → 400"),
    pytest.param(C, {"model": M, "prompt": ["hi", "x" * 1100]}, 400, "BadRequestError", "input_tokens",
                 id="a batch with one prompt over max_model_len → 400 input_tokens, nothing served"),
    pytest.param(C, {"model": M, "prompt": ["hi", [1, 2]]}, 400, "Bad Request", "body.prompt",
                 id="a batch mixing a string and token ids"),
    pytest.param(CHAT, {"model": M, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 250}, 400,
                 "BadRequestError", None, id="chat min_tokens over the context left (max_tokens clamped) → 400"),
    pytest.param(C, {"model": M, "prompt": "x" * 800, "max_tokens": 100, "min_tokens": 80}, 400,
                 "BadRequestError", None, id="min_tokens over max_tokens clamped to the context → 400"),
    pytest.param(C, {"model": M, "prompt": "hi", "n": 0}, 400, "BadRequestError", None, id="n 0 → 400, no param"),
    pytest.param(C, {"model": M, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
                 "BadRequestError", "stream_options", id="stream_options without stream → 400"),
    pytest.param(C, {"model": M, "prompt": 5}, 400, "Bad Request", "body.prompt", id="prompt of wrong type"),
    pytest.param(C, {"model": M}, 400, "Bad Request", "body.prompt", id="completions without prompt"),
    pytest.param(CHAT, {"model": M}, 400, "Bad Request", "body.messages", id="chat without messages"),
    pytest.param(C, {"model": M, "prompt": "hi", "max_tokens": "ten"}, 400, "Bad Request", "body.max_tokens",
                 id="max_tokens not an integer"),
    pytest.param(C, {"model": M, "prompt": "hi", "temperature": "hot"}, 400, "Bad Request", "body.temperature",
                 id="temperature not a number"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "type_", "param"), ERRORS)
async def test_error_shape(
    asgi, path: str, body: dict[str, Any], status: int, type_: str, param: str | None
) -> None:
    async with asgi(CFG) as (client, _):
        resp = await client.post(path, json=body)
    assert resp.status_code == status
    assert resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (type_, param, status)


@pytest.mark.parametrize(
    ("content", "ctype", "param"),
    [
        pytest.param(
            b'{"model": ', "application/json", "body.10", id="malformed JSON → Bad Request at offset 10"
        ),
        pytest.param(b"[1, 2]", "application/json", None, id="JSON that is not an object → Bad Request"),
        pytest.param(
            b'{"model": "llama-3-8b", "prompt": "hi"}', "text/plain", None, id="not application/json"
        ),
        pytest.param(
            b'{"model": "llama-3-8b", "prompt": "hi"}',
            "application/json-patch+json",
            None,
            id="a media type that only contains application/json",
        ),
    ],
)
async def test_unparseable_bodies(asgi, content: bytes, ctype: str, param: str | None) -> None:
    async with asgi(CFG) as (client, _):
        resp = await client.post(C, content=content, headers={"content-type": ctype})
    assert resp.status_code == 400
    assert (resp.json()["error"]["type"], resp.json()["error"]["param"]) == ("Bad Request", param)


async def test_unknown_path_is_plain_404_and_unknown_fields_are_accepted(asgi) -> None:
    async with asgi(CFG) as (client, _):
        missing = await client.get("/v1/nothing")
        ok = await client.post(C, json={"model": M, "prompt": "hi", "max_tokens": 2, "frobnicate": {"x": 1},
                                        "temperature": 0.7, "logprobs": None, "ignore_eos": True})  # fmt: skip
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


async def test_prompt_that_fits_has_max_tokens_clamped(asgi) -> None:
    async with asgi(CFG) as (client, _):
        resp = await client.post(
            C, json={"model": M, "prompt": "x" * 1000, "max_tokens": 200, "ignore_eos": True}
        )
    body = resp.json()
    # 1000 chars → 250 prompt tokens; 256 − 250 = 6 output tokens fit
    assert resp.status_code == 200
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (250, 6)
    assert body["choices"][0]["finish_reason"] == "length"


async def test_error_rate_one_answers_500_and_faults_can_change_at_run_time(asgi) -> None:
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1e4, faults=FaultConfig(error_rate=1.0))
    async with asgi(cfg) as (client, _):
        failed = await client.post(C, json={"model": M, "prompt": "hi", "max_tokens": 2})
        cleared = await client.post("/sim/faults", json={"error_rate": 0.0, "healthy": False})
        ok = await client.post(C, json={"model": M, "prompt": "hi", "max_tokens": 2})
        health = await client.get("/health")
        bad = await client.post("/sim/faults", json={"error_rate": 3})
        unknown = await client.post("/sim/faults", json={"nope": 1})
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "InternalServerError"
    assert cleared.status_code == 200 and ok.status_code == 200
    assert health.status_code == 503
    assert bad.status_code == 400 and "error_rate" in bad.json()["error"]["message"]
    assert unknown.status_code == 400 and "nope" in unknown.json()["error"]["message"]


async def test_midstream_error_ends_with_error_event_and_done(asgi) -> None:
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1e4, faults=FaultConfig(midstream_error_rate=1.0))
    async with asgi(cfg) as (client, rt):
        body = {"model": M, "prompt": "hi", "max_tokens": 10, "ignore_eos": True, "stream": True}
        resp = await client.post(C, json=body)
        events = [e for e in resp.text.split("\n\n") if e]
        assert rt.engine.num_running == 0 and rt.engine.kv.used == 0  # the cut request was aborted
    assert resp.status_code == 200
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    assert len(events) == 5 + 2  # tokens 0–4 (the cut comes at max_tokens // 2), error, [DONE]
    assert rt.engine.counters.success == {"stop": 0, "length": 0}


async def test_sampling_values_at_vllms_bounds_are_served(asgi) -> None:
    """The edges vLLM accepts (measured): top_k -1 and 0 disable, temperature 0 and 2, top_p 1, min_p 0 and 1,
    penalties ±2, 20 logprobs."""
    edges = [{"top_k": -1}, {"top_k": 0}, {"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"min_p": 0},
             {"min_p": 1}, {"presence_penalty": -2}, {"frequency_penalty": 2}, {"logprobs": 20}]  # fmt: skip
    async with asgi(CFG) as (client, _):
        for extra in edges:
            resp = await client.post(C, json={"model": M, "prompt": "hi", "max_tokens": 1, **extra})
            assert resp.status_code == 200, (extra, resp.text)


async def test_completions_default_to_16_tokens_and_an_empty_model_name_is_the_served_one(asgi) -> None:
    """vLLM's (and OpenAI's legacy) completions default max_tokens is 16; the simulated worker filled the
    context (here 254 tokens). An empty `model` is vLLM's served model, not a 404. Chat still fills the
    context, as in vLLM. (tests/real_vllm/test_fidelity.py checks both against vLLM itself.)"""
    async with asgi(CFG) as (client, _):
        plain = await client.post(C, json={"model": M, "prompt": "hi", "ignore_eos": True})
        null = await client.post(
            C, json={"model": "", "prompt": "hi", "max_tokens": None, "ignore_eos": True}
        )
        chat = await client.post(
            CHAT, json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        )
    assert plain.status_code == null.status_code == chat.status_code == 200
    assert plain.json()["usage"]["completion_tokens"] == null.json()["usage"]["completion_tokens"] == 16
    used = chat.json()["usage"]
    assert used["prompt_tokens"] + used["completion_tokens"] == 256
