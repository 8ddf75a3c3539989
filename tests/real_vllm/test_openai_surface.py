"""The OpenAI surface a client sees, from the real vLLM server directly and through Mosaic in front of it.

Every test runs against `target`: "vllm" (the real server) and "mosaic" (the gateway with a static endpoint
pointing at that server). The same assertions on both are the point: Mosaic must not change what a client sees.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from gateway_harness import Target

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

CHAT = [{"role": "user", "content": "Write a haiku about paged attention."}]
# ignore_eos: the tiny model's random weights may emit </s> early; with it, completion_tokens == max_tokens.
EXACT = {"ignore_eos": True}


def test_chat_non_stream_has_usage_and_deterministic_text(target: Target) -> None:
    with target.openai() as client:
        first = client.chat.completions.create(
            model=target.model, messages=CHAT, max_tokens=8, temperature=0, extra_body=EXACT
        )
        second = client.chat.completions.create(
            model=target.model, messages=CHAT, max_tokens=8, temperature=0, extra_body=EXACT
        )
    assert first.id.startswith("chatcmpl-")
    assert first.object == "chat.completion"
    assert first.model == target.model
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None
    assert first.usage.completion_tokens == 8
    assert first.usage.total_tokens == first.usage.prompt_tokens + 8
    assert first.choices[0].message.content == second.choices[0].message.content  # temperature 0


def test_completion_non_stream(target: Target) -> None:
    with target.openai() as client:
        resp = client.completions.create(
            model=target.model,
            prompt="def schedule(requests):",
            max_tokens=5,
            temperature=0,
            extra_body=EXACT,
        )
    assert resp.id.startswith("cmpl-")
    assert resp.object == "text_completion"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 5


@pytest.mark.parametrize(
    "include_usage",
    [False, True],
    ids=["client did not ask → no usage chunk", "include_usage → one usage chunk, choices []"],
)
def test_chat_stream_usage_only_when_asked(target: Target, include_usage: bool) -> None:
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    with target.openai() as client:
        stream = client.chat.completions.create(
            model=target.model,
            messages=CHAT,
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body=EXACT,
            **options,
        )
        chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunks = [c for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usage_chunks) == 1
        assert chunks[-1] is usage_chunks[0] and chunks[-1].choices == []
        assert usage_chunks[0].usage.completion_tokens == 6
    else:
        assert usage_chunks == []
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


def test_a_stream_names_its_server_on_its_last_chunk(target: Target) -> None:
    """vLLM puts `system_fingerprint` on the last choice chunk of a stream that asked for no usage; through
    Mosaic (which asks for usage upstream, where vLLM puts it on the usage chunk it then drops) the gateway
    puts the worker's on that chunk once it has learned it (the worker's first stream through it)."""
    with target.openai() as client:
        for _ in range(2):
            stream = client.chat.completions.create(
                model=target.model, messages=CHAT, max_tokens=3, temperature=0, stream=True, extra_body=EXACT
            )
            chunks = list(stream)
    named = [c for c in chunks if c.system_fingerprint]
    assert len(named) == 1 and named[0].system_fingerprint.startswith("vllm-")
    assert named[0] is chunks[-1] and chunks[-1].choices[0].finish_reason == "length"


def test_completion_stream_with_usage(target: Target) -> None:
    with target.openai() as client:
        stream = client.completions.create(
            model=target.model,
            prompt="import asyncio\n",
            max_tokens=7,
            temperature=0,
            stream=True,
            extra_body=EXACT,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert text  # seven tokens of (gibberish) text


def test_stream_framing_is_sse_ending_with_done(target: Target) -> None:
    body = {"model": target.model, "prompt": "hello", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with target.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
        raw = b"".join(resp.iter_bytes())
        ctype = resp.headers["content-type"]
    assert resp.status_code == 200
    assert ctype.startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert sum(1 for p in payloads for c in p["choices"] if c["finish_reason"] == "length") == 1


def test_unknown_model_is_404(target: Target) -> None:
    with target.openai() as client, pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert err.value.status_code == 404
    assert set(err.value.body) >= {"message", "type", "param", "code"}  # openai unwraps {"error": {...}}


# vLLM's own answers, kept from the first target that ran (vLLM's or the gateway's: they must be equal)
TOKENIZER_ANSWERS: dict[str, tuple[int, dict[str, object]]] = {}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "def schedule(requests):", "return_token_strs": True}),
        ("/tokenize", {"messages": CHAT}),
        ("/tokenize", {"prompt": ""}),
        ("/detokenize", {"tokens": [824, 329, 1976, 1308]}),
        ("/tokenize", {"prompt": 5}),  # vLLM's own 400: passed through unchanged
    ],
    ids=["prompt", "messages", "empty", "detokenize", "bad prompt"],
)
def test_tokenizer_endpoints_answer_as_vllm(target: Target, path: str, body: dict[str, object]) -> None:
    """POST /tokenize and /detokenize through Mosaic are vLLM's answers, byte for byte equal as JSON: the
    gateway forwards to a worker of the model and relays its answer. A tokenize count agrees with the
    prompt_tokens the same messages are charged."""
    with target.http() as http:
        resp = http.post(path, json={"model": target.model, **body})
        key = f"{path} {json.dumps(body)}"
        seen = TOKENIZER_ANSWERS.setdefault(key, (resp.status_code, resp.json()))
        assert (resp.status_code, resp.json()) == seen
        if "messages" in body:
            chat = http.post(
                "/v1/chat/completions", json={"model": target.model, "messages": CHAT, "max_tokens": 1}
            )
            assert chat.json()["usage"]["prompt_tokens"] == resp.json()["count"]
    assert resp.status_code == (400 if body.get("prompt") == 5 else 200)


# 200 CJK characters: 600 tokens for the tiny model's byte-level BPE (3 bytes each, no merges learnt from
# English), while Mosaic's estimate without a tokenizer is ceil(200 / 4) = 50: only vLLM can see it is too long.
CJK_600_TOKENS = "漢字テスト" * 40


def test_prompt_only_vllm_sees_too_long_streaming_is_passed_through_as_json_400(target: Target) -> None:
    """vLLM refuses before streaming starts, with a plain JSON 400 even for `stream: true`; Mosaic must relay
    that answer verbatim, not turn it into a 200 event stream carrying an error."""
    body = {"model": target.model, "prompt": CJK_600_TOKENS, "max_tokens": 4, "stream": True}
    with target.http() as http:
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["param"] == "input_tokens"
    assert error["code"] == 400
    assert "maximum context length is 512 tokens" in error["message"]
    assert "prompt contains at least 513 input tokens" in error["message"]


def test_prompt_anyone_sees_too_long_streaming_is_json_400(target: Target) -> None:
    """4,800 characters: over 512 tokens by Mosaic's estimate too, so Mosaic may refuse it itself (its own
    error; see docs/real_vllm.md, fidelity limits) — but as a plain JSON 400 either way."""
    body = {"model": target.model, "prompt": "hello world " * 400, "max_tokens": 4, "stream": True}
    with target.http() as http:
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param(
            ("\n" + " " * 16 + "return self\n") * 150, id="indented code: 4,350 characters, 451 tokens"
        ),
        pytest.param(("\n" + " " * 24) * 200, id="blank indented lines: 5,000 characters, 200 tokens"),
    ],
)
def test_whitespace_heavy_prompts_vllm_serves_are_not_refused(target: Target, prompt: str) -> None:
    """Over 8 characters a token (its tokenizer merges runs of spaces): Mosaic's context floor, which counts
    a whitespace run as one character, must not refuse what vLLM serves (it did: 400 'about 1088 tokens')."""
    with target.openai() as client:
        resp = client.completions.create(model=target.model, prompt=prompt, max_tokens=4, temperature=0)
    assert resp.usage is not None and resp.usage.prompt_tokens < 512
    assert resp.usage.completion_tokens == 4 or resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("path", "body", "prompt_tokens"),
    [
        pytest.param(
            "/v1/completions",
            {"prompt": list(range(100, 700)), "truncate_prompt_tokens": 40},
            40,
            id="600 token ids cut to their last 40",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": list(range(100, 700)), "truncate_prompt_tokens": -1},
            511,
            id="600 token ids cut to the context less the output token (-1)",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": list(range(100, 700)), "truncate_prompt_tokens": -1, "max_tokens": None},
            511,
            id="a null max_tokens is 16 to vLLM: -1 keeps one token back too",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": "hello world " * 400, "truncate_prompt_tokens": 100},
            100,
            id="4,800 characters of text cut to 100 tokens",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hello world " * 400}], "truncate_prompt_tokens": 64},
            64,
            id="a chat conversation over the context cut to 64 tokens",
        ),
    ],
)
def test_prompts_over_the_context_with_truncate_prompt_tokens_are_served(
    target: Target, path: str, body: dict[str, object], prompt_tokens: int
) -> None:
    """vLLM cuts each prompt to `truncate_prompt_tokens` before its context check, so these are served; the
    gateway refused every one with its context-length 400 before it read the field."""
    with target.http() as http:
        resp = http.post(path, json={"model": target.model, "max_tokens": 4, **body})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == prompt_tokens


def test_a_truncation_longer_than_the_context_is_a_400_naming_it(target: Target) -> None:
    with target.http() as http:
        resp = http.post(
            "/v1/completions",
            json={"model": target.model, "prompt": [1, 2, 3], "max_tokens": 4, "truncate_prompt_tokens": 513},
        )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "truncate_prompt_tokens"
    assert error["message"] == (
        "truncate_prompt_tokens=513 cannot be greater than max_model_len = 512. "
        "Please request a smaller truncation size. (parameter=truncate_prompt_tokens, value=513)"
    )


def test_prompt_fits_but_max_tokens_overflows_is_clamped_not_refused(target: Target) -> None:
    """vLLM answers 200 and stops at max-model-len when prompt + max_tokens exceeds it; Mosaic must not
    refuse what vLLM would serve. 20 token ids + 500 max_tokens (520 > 512): 492 come back (512 − 20).
    (max_tokens alone over max-model-len is a 400 in vLLM 0.32: "cannot be greater than max_model_len".)"""
    with target.openai() as client:
        resp = client.completions.create(
            model=target.model, prompt=list(range(100, 120)), max_tokens=500, temperature=0, extra_body=EXACT
        )
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == 20
    assert resp.usage.completion_tokens == 512 - 20
    assert resp.choices[0].finish_reason == "length"


def test_malformed_json_is_400(target: Target) -> None:
    with target.http() as http:
        resp = http.post(
            "/v1/chat/completions",
            content=b'{"model": "x", "messages": [',
            headers={"content-type": "application/json"},
        )
    assert resp.status_code == 400
    assert set(resp.json()["error"]) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        (None, 400),
        ("text/plain", 400),
        ("application/x-www-form-urlencoded", 400),  # curl -d without -H
        ("application/json-patch+json", 400),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
    ],
)
def test_only_a_json_media_type_is_served(target: Target, content_type: str | None, status: int) -> None:
    """vLLM refuses a body of any other media type (even valid JSON); through the gateway too."""
    body = json.dumps({"model": target.model, "prompt": "hi", "max_tokens": 2}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    with target.http() as http:
        resp = http.post("/v1/completions", content=body, headers=headers)
    assert resp.status_code == status, resp.text
    if status == 400:
        assert "Only 'application/json' is allowed" in resp.json()["error"]["message"]


def test_negative_max_tokens_is_400_naming_the_param(target: Target) -> None:
    with target.openai() as client, pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=target.model, prompt="hi", max_tokens=-1)
    assert err.value.status_code == 400
    assert err.value.body["param"] == "max_tokens"


def test_unknown_extra_fields_pass_through(target: Target) -> None:
    """vLLM accepts fields it does not know and vLLM extensions (`top_k`, `min_tokens`): both pass."""
    extra = {"top_k": 1, "min_tokens": 3, "ignore_eos": True, "mosaic_test_unknown_field": {"nested": [1, 2]}}
    with target.openai() as client:
        resp = client.completions.create(model=target.model, prompt="x = ", max_tokens=3, extra_body=extra)
    assert resp.usage is not None and resp.usage.completion_tokens == 3


def test_models_lists_the_served_name(target: Target) -> None:
    with target.openai() as client:
        ids = [m.id for m in client.models.list()]
    assert target.model in ids


def test_http_error_body_shape_direct(real_vllm: object) -> None:
    """Sanity on the raw server (no gateway): the error envelope has the four OpenAI fields and code = status."""
    url = real_vllm.url  # type: ignore[attr-defined]
    with httpx.Client(base_url=url, timeout=30) as http:
        resp = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": -1})
    assert resp.json()["error"]["code"] == resp.status_code == 400
