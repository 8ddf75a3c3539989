"""Raw HTTP against the worker app (httpx.ASGITransport): vLLM's error shapes, clamping, failure injection."""

from __future__ import annotations

import json
from typing import Any

import pytest

from simulator.engine import EngineConfig
from simulator.worker_app import FaultConfig, WorkerConfig

pytestmark = pytest.mark.anyio
CFG = WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=1e4, engine=EngineConfig(max_model_len=256))
C, CHAT = "/v1/completions", "/v1/chat/completions"
M = "llama-3-8b"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}

ERRORS = [
    pytest.param(C, {"model": "gpt-4", "prompt": "hi"}, 404, "NotFoundError", "model", id="unknown model → 404"),
    pytest.param(C, {"model": M, "prompt": "x" * 1100}, 400, "BadRequestError", "input_tokens",
                 id="prompt of 275 tokens over max_model_len 256 → 400 input_tokens"),
    pytest.param(C, {"model": M, "prompt": "x" * 1100, "stream": True}, 400, "BadRequestError", "input_tokens",
                 id="prompt over max_model_len while streaming → plain JSON 400"),
    # vLLM 0.32 refuses only a prompt *over* max_model_len as input_tokens; one that fills it leaves
    # max_tokens = 0, refused by SamplingParams ("max_tokens must be at least 1, got 0.")
    pytest.param(C, {"model": M, "prompt": "x" * 1024}, 400, "BadRequestError", "max_tokens",
                 id="prompt of exactly max_model_len leaves max_tokens 0 → 400 max_tokens"),
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
    pytest.param(C, {"model": M, "prompt": ["hi", [1, 2]]}, 400, "Bad Request", "body.prompt.0",
                 id="a batch mixing a string and token ids (pydantic's first error location)"),
    pytest.param(CHAT, {"model": M, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 250}, 400,
                 "BadRequestError", None, id="chat min_tokens over the context left (max_tokens clamped) → 400"),
    pytest.param(C, {"model": M, "prompt": "x" * 800, "max_tokens": 100, "min_tokens": 80}, 400,
                 "BadRequestError", None, id="min_tokens over max_tokens clamped to the context → 400"),
    pytest.param(C, {"model": M, "prompt": "hi", "n": 0}, 400, "BadRequestError", None, id="n 0 → 400, no param"),
    pytest.param(C, {"model": M, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
                 "BadRequestError", "stream_options", id="stream_options without stream → 400"),
    pytest.param(C, {"model": M, "prompt": 5}, 400, "Bad Request", "body.prompt", id="prompt of wrong type"),
    # vLLM's CompletionRequest refuses a missing prompt in a before-validator, not as a type error
    pytest.param(C, {"model": M}, 400, "BadRequestError", "prompt", id="completions without prompt"),
    pytest.param(CHAT, {"model": M}, 400, "Bad Request", "body.messages", id="chat without messages"),
    pytest.param(C, {"model": M, "prompt": "hi", "max_tokens": "ten"}, 400, "Bad Request", "body.max_tokens",
                 id="max_tokens not an integer"),
    pytest.param(C, {"model": M, "prompt": "hi", "temperature": "hot"}, 400, "Bad Request", "body.temperature",
                 id="temperature not a number"),
    # --- as vLLM 0.32's source has them (entrypoints/openai/*/protocol.py, renderers/params.py,
    # sampling_params.py); each failed before the simulator followed vLLM here
    # max_completion_tokens counts when sent, 0 included (`is not None`), and names itself when too large
    pytest.param(CHAT, {"model": M, "messages": MSG, "max_completion_tokens": 0}, 400, "BadRequestError",
                 "max_tokens", id="chat max_completion_tokens 0 → 400 max_tokens"),
    pytest.param(CHAT, {"model": M, "messages": MSG, "max_completion_tokens": 0, "max_tokens": 5}, 400,
                 "BadRequestError", "max_tokens", id="chat max_completion_tokens 0 wins over max_tokens 5"),
    pytest.param(CHAT, {"model": M, "messages": MSG, "max_completion_tokens": 600}, 400, "BadRequestError",
                 "max_completion_tokens", id="chat max_completion_tokens over max_model_len names itself"),
    pytest.param(CHAT, {"model": M, "messages": MSG, "max_tokens": 600}, 400, "BadRequestError", "max_tokens",
                 id="chat max_tokens over max_model_len"),
    # greedy sampling allows one completion
    pytest.param(C, {"model": M, "prompt": "hi", "n": 2, "temperature": 0}, 400, "BadRequestError", None,
                 id="completions n 2 at temperature 0"),
    pytest.param(CHAT, {"model": M, "messages": MSG, "n": 2, "temperature": 0.0}, 400, "BadRequestError", None,
                 id="chat n 2 at temperature 0"),
    # pydantic types vLLM's models refuse (lax mode accepts "5" for an int, not 1.5)
    pytest.param(C, {"model": M, "prompt": "hi", "stop": 5}, 400, "Bad Request", "body.stop", id="stop 5"),
    pytest.param(C, {"model": M, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "Bad Request",
                 "body.stop", id="more than 4 stop strings"),
    pytest.param(C, {"model": M, "prompt": "hi", "top_k": 1.5}, 400, "Bad Request", "body.top_k", id="top_k 1.5"),
    pytest.param(C, {"model": M, "prompt": "hi", "seed": 1.5}, 400, "Bad Request", "body.seed", id="seed 1.5"),
    pytest.param(CHAT, {"model": M, "messages": MSG, "response_format": {"type": "nope"}}, 400, "Bad Request",
                 "body.response_format.type", id="response_format of an unknown type"),
    pytest.param(C, {"model": M, "prompt": "hi", "stream": "maybe"}, 400, "Bad Request", "body.stream",
                 id="stream neither a boolean nor a boolean word"),
    pytest.param(C, {"model": M, "prompt": "hi", "ignore_eos": None}, 400, "Bad Request", "body.ignore_eos",
                 id="ignore_eos null (not nullable in vLLM)"),
    pytest.param(C, {"model": M, "prompt": "hi", "max_tokens": "ten", "stream_options": {}, "stream": True,
                     "logprobs": "3"}, 400, "BadRequestError", "logprobs",
                 id="a before-validator error wins over a type error"),
    # order and params at the context limit; empty inputs name no param
    pytest.param(C, {"model": M, "prompt": "x" * 1100, "max_tokens": 600}, 400, "BadRequestError", "max_tokens",
                 id="prompt and max_tokens both over the context → max_tokens first"),
    pytest.param(C, {"model": M, "prompt": []}, 400, "BadRequestError", None, id="prompt []"),
    pytest.param(C, {"model": M, "prompt": [[]]}, 400, "BadRequestError", None, id="prompt [[]]"),
    pytest.param(C, {"model": M, "prompt": [""]}, 400, "BadRequestError", None, id='prompt [""]'),
    pytest.param(C, {"model": M, "prompt": ""}, 400, "BadRequestError", "prompt", id='prompt ""'),
    pytest.param(CHAT, {"model": M, "messages": []}, 400, "BadRequestError", None, id="messages []"),
    pytest.param(C, {"model": M, "prompt": "hi", "stop": ""}, 400, "BadRequestError", None,
                 id="an empty stop string"),
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
        pytest.param(b"[1, 2]", "application/json", "body", id="JSON that is not an object → Bad Request"),
        pytest.param(b"", "application/json", "body", id="no body → body missing"),
        pytest.param(b"null", "application/json", "body", id="JSON null → body missing"),
        pytest.param(
            b'{"model": "llama-3-8b", "prompt": "hi"}',
            "application/json ;charset=utf-8",
            None,
            id="a space before the parameter (vLLM does not strip the media type)",
        ),
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


async def test_unparseable_bodies_in_vllms_words(asgi) -> None:
    """FastAPI's validation errors as vLLM's handler words them (vLLM 0.32, compared against it)."""
    head = "1 validation error:\n  "
    cases = {
        b"": (head + "{'type': 'missing', 'loc': 'body', 'msg': 'Field required', 'input': 'None'}"),
        b"[1, 2]": (
            head
            + "{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary "
            "or object to extract fields from', 'input': '<list of 2 items>'}"
        ),
        b'{"model": ': (
            head + "{'type': 'json_invalid', 'loc': 'body.10', 'msg': 'JSON decode error', "
            "'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}"
        ),
    }
    async with asgi(CFG) as (client, _):
        for content, message in cases.items():
            for path in (C, "/v1/chat/completions", "/tokenize"):
                resp = await client.post(path, content=content, headers={"content-type": "application/json"})
                assert resp.json()["error"]["message"] == message, (path, content)


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


async def test_error_messages_are_vllm_032s(asgi) -> None:
    """The wording of vLLM 0.32's TokenizeParams, prompt-length and SamplingParams errors (VLLMValidationError's
    str(): the message, then ` (parameter=…, value=…)` when it has them)."""
    cases = [
        (C, {"model": M, "prompt": "hi", "max_tokens": 600},
         "max_tokens=600 cannot be greater than max_model_len=256. Please request fewer output tokens. "
         "(parameter=max_tokens, value=600)"),
        (CHAT, {"model": M, "messages": MSG, "max_completion_tokens": 600},
         "max_completion_tokens=600 cannot be greater than max_model_len=256. Please request fewer output "
         "tokens. (parameter=max_completion_tokens, value=600)"),
        (CHAT, {"model": M, "messages": MSG, "max_completion_tokens": 0, "max_tokens": 5},
         "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
        # a text prompt is tokenised up to max_model_len + 1 tokens, hence "at least"; token ids are counted
        (C, {"model": M, "prompt": "x" * 1100},
         "This model's maximum context length is 256 tokens. However, your prompt contains at least 257 input "
         "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the "
         "input prompt. (parameter=input_tokens, value=257)"),
        (C, {"model": M, "prompt": list(range(300))},
         "This model's maximum context length is 256 tokens. However, your prompt contains 300 input tokens, "
         "which exceeds this limit even without any output tokens. Please reduce the length of the input "
         "prompt. (parameter=input_tokens, value=300)"),
        (C, {"model": M, "prompt": "hi", "n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
        (C, {"model": M, "prompt": [[]]}, "The decoder prompt cannot be empty"),
        (C, {"model": M, "prompt": []}, "You must pass at least one prompt"),
        # ids outside the model's vocabulary (Llama-3's 128,256): vLLM names the prompt's largest; a client's
        # id past 2^32 was a 500 (the fingerprint's 4-byte packing), which the gateway's breaker counts
        (C, {"model": M, "prompt": [5, 128256, 7]}, "Token id 128256 is out of vocabulary"),
        (C, {"model": M, "prompt": [2**32]}, "Token id 4294967296 is out of vocabulary"),
        (C, {"model": M, "prompt": [[1, 2], [200000, 9]]}, "Token id 200000 is out of vocabulary"),
        (C, {"model": M, "prompt": [[300000], []]}, "Token id 300000 is out of vocabulary"),  # prompt by prompt
        (C, {"model": M, "prompt": [[], [300000]]}, "The decoder prompt cannot be empty"),
        # tool calls, as a vLLM without a tool-call parser refuses them (the simulator makes none)
        (CHAT, {"model": M, "messages": MSG, "tools": [TOOL]},
         '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
        (CHAT, {"model": M, "messages": MSG, "tools": [TOOL], "tool_choice": "required"},
         'tool_choice="required" requires --tool-call-parser to be set'),
        (CHAT, {"model": M, "messages": MSG, "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "f"}}},
         'tool_choice=function "f" requires --tool-call-parser to be set'),
        (CHAT, {"model": M, "messages": MSG, "tool_choice": "auto"},
         "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)"),
        (CHAT, {"model": M, "messages": MSG, "tools": []},
         "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely. "
         "(parameter=tools)"),
        # text that is not UTF-8-encodable (a lone surrogate) was a 500; vLLM's tokenizer refuses it
        (CHAT, {"model": M, "messages": [{"role": "user", "content": "\ud800"}]},
         "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"),
        (C, {"model": M, "prompt": ["ok", "a\ud800b"]},
         "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"),
    ]  # fmt: skip
    async with asgi(CFG) as (client, _):
        for (
            path,
            body,
            message,
        ) in cases:  # json.dumps escapes a lone surrogate (httpx's json= cannot send one)
            resp = await client.post(
                path, content=json.dumps(body), headers={"content-type": "application/json"}
            )
            assert (resp.status_code, resp.json()["error"]["message"]) == (400, message), body


async def test_fields_are_coerced_as_vllms_pydantic_models_do(asgi) -> None:
    """pydantic's lax mode, as vLLM's request models validate: boolean words and 0/1 are booleans, a numeric
    string or an integral float is an integer. `stream: "true"` streams; `ignore_eos: "yes"` runs to
    max_tokens. vLLM tests `stream_options` against the raw `stream`, so `"false"` (a non-empty string) passes
    that check, then is coerced to False: no stream."""
    async with asgi(CFG) as (client, _):
        streamed = await client.post(C, json={"model": M, "prompt": "hi", "max_tokens": "3", "stream": "true",
                                              "ignore_eos": "yes"})  # fmt: skip
        plain = await client.post(C, json={"model": M, "prompt": "hi", "max_tokens": 4.0, "ignore_eos": 1,
                                           "stream": "off", "n": "2", "temperature": "0.5", "logprobs": True})  # fmt: skip
        quirk = await client.post(C, json={"model": M, "prompt": "hi", "max_tokens": 2, "stream": "false",
                                           "stream_options": {"include_usage": "yes"}})  # fmt: skip
        chat = await client.post(CHAT, json={"model": M, "messages": MSG, "max_completion_tokens": 2,
                                             "ignore_eos": "on", "logprobs": "no", "top_logprobs": 3})  # fmt: skip
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = [e for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 3 + 1
    assert plain.status_code == 200, plain.text
    assert [c["finish_reason"] for c in plain.json()["choices"]] == ["length", "length"]
    assert plain.json()["usage"]["completion_tokens"] == 2 * 4
    assert quirk.status_code == 200 and quirk.headers["content-type"] == "application/json"
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 2
