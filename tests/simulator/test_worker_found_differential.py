"""Divergences from vLLM 0.32 found by the differential test (tests/real_vllm/test_differential.py), each
pinned in-process: what the real server answered to the request, which the simulated worker did not."""

from __future__ import annotations

import json
from typing import Any

import pytest

from simulator.engine import EngineConfig
from simulator.worker_app import WorkerConfig

pytestmark = pytest.mark.anyio
# the fixture catalog's tiny model (vocab_size 2048), as the real-vLLM tests serve it
CFG = WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=1e4, engine=EngineConfig(max_model_len=256))
C, CHAT = "/v1/completions", "/v1/chat/completions"
M = "llama-3-8b"
MSG = [{"role": "user", "content": "hi"}]
VOCAB = 128_256  # llama-3-8b's vocabulary (the catalog's vocab_size)


def _error(resp: Any) -> tuple[int, str, str | None]:
    err = resp.json()["error"]
    return resp.status_code, err["type"], err["param"]


def _sse(text: str) -> list[Any]:
    return [
        json.loads(e[len("data: ") :]) if e != "data: [DONE]" else "[DONE]" for e in text.split("\n\n") if e
    ]


ENGINE_ERRORS = [
    pytest.param(C, {"prompt": "hi", "logprobs": 21}, "logprobs", id="logprobs over 20"),
    pytest.param(CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "logprobs", id="chat top 21"),
    pytest.param(C, {"prompt": [VOCAB]}, None, id="token id out of vocabulary"),
    pytest.param(C, {"prompt": [[5], [VOCAB]]}, None, id="a batch, one prompt out of vocabulary"),
    pytest.param(C, {"prompt": [""]}, None, id="an empty prompt in a batch"),
    pytest.param(C, {"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, "logit_bias", id="logit_bias id"),
    pytest.param(C, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", id="stop_token_ids -1"),
    pytest.param(C, {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", id="prompt_logprobs 21"),
    pytest.param(
        C, {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", id="allowed_token_ids []"
    ),
    pytest.param(
        CHAT,
        {"messages": MSG, "allowed_token_ids": [5, VOCAB]},
        "allowed_token_ids",
        id="chat allowed_token_ids out of vocabulary",
    ),
]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        pytest.param({"prompt_embeds": "AAAA"}, "prompt_embeds",
                     "You must set `--enable-prompt-embeds` to input `prompt_embeds`. (parameter=prompt_embeds)",
                     id="prompt_embeds without a prompt"),
        pytest.param({"prompt": "hi", "prompt_embeds": ["AAAA"]}, "prompt_embeds",
                     "You must set `--enable-prompt-embeds` to input `prompt_embeds`. (parameter=prompt_embeds)",
                     id="prompt_embeds beside a prompt"),
        pytest.param({"prompt_embeds": []}, "prompt",
                     "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                     id="no prompt, empty prompt_embeds"),
    ],
)  # fmt: skip
async def test_found_prompt_embeds_refused_as_without_the_flag(
    asgi, extra: dict[str, Any], param: str, message: str
) -> None:
    """vLLM (without --enable-prompt-embeds, its default) refuses embeddings when its renderer loads them,
    naming prompt_embeds; the simulator answered that no prompt was given."""
    async with asgi(CFG) as (client, _):
        resp = await client.post(C, json={"model": M, "max_tokens": 2, **extra})
    assert _error(resp) == (400, "BadRequestError", param)
    assert resp.json()["error"]["message"] == message


@pytest.mark.parametrize(("path", "extra", "param"), ENGINE_ERRORS)
async def test_found_engine_errors_of_a_stream_are_an_error_event(
    asgi, path: str, extra: dict[str, Any], param: str | None
) -> None:
    """vLLM checks these in its engine's input processor, which a stream reaches only after its response has
    started: HTTP 200, `data: {"error": {...}}`, `data: [DONE]` (the simulator answered a plain JSON 400);
    without `stream` the same request is a 400 naming the same param. (prompt_logprobs is refused with a
    stream before that, so it is sent without one here.)"""
    body = {"model": M, "max_tokens": 2, **extra}
    async with asgi(CFG) as (client, _):
        plain = await client.post(path, json=body)
        assert _error(plain) == (400, "BadRequestError", param)
        if "prompt_logprobs" in extra:
            return
        resp = await client.post(path, json={**body, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = _sse(resp.text)
    assert events[-1] == "[DONE]" and len(events) == 2, events
    assert events[0]["error"] == plain.json()["error"]
    assert resp.text.startswith('data: {"error": {"message": ')  # json.dumps' spacing, as vLLM's


FIELD_ERRORS = [
    # fields vLLM's request models type (pydantic, lax) that the simulator accepted unchecked
    pytest.param(C, {"prompt": "hi", "priority": "x"}, ("Bad Request", "body.priority"), id="priority x"),
    pytest.param(C, {"prompt": "hi", "skip_special_tokens": "x"}, ("Bad Request", "body.skip_special_tokens"),
                 id="skip_special_tokens x"),
    pytest.param(C, {"prompt": "hi", "suffix": 5}, ("Bad Request", "body.suffix"), id="suffix 5"),
    pytest.param(C, {"prompt": "hi", "truncate_prompt_tokens": -2}, ("Bad Request", "body.truncate_prompt_tokens"),
                 id="truncate_prompt_tokens -2"),
    pytest.param(C, {"prompt": "hi", "stop_token_ids": "5"}, ("Bad Request", "body.stop_token_ids"),
                 id="stop_token_ids a string"),
    pytest.param(CHAT, {"messages": MSG, "stop_token_ids": [1.5]}, ("Bad Request", "body.stop_token_ids.0"),
                 id="chat stop_token_ids [1.5]"),
    pytest.param(CHAT, {"messages": MSG, "add_generation_prompt": "x"},
                 ("Bad Request", "body.add_generation_prompt"), id="chat add_generation_prompt x"),
    pytest.param(CHAT, {"messages": MSG, "chat_template_kwargs": "x"},
                 ("Bad Request", "body.chat_template_kwargs"), id="chat chat_template_kwargs x"),
    pytest.param(CHAT, {"messages": MSG, "parallel_tool_calls": "x", "top_k": 1.5},
                 ("Bad Request", "body.parallel_tool_calls"), id="chat parallel_tool_calls before top_k"),
    # vLLM's before-validators and renderer checks
    pytest.param(C, {"prompt": "hi", "prompt_logprobs": "x"}, ("BadRequestError", "prompt_logprobs"),
                 id="prompt_logprobs not a number"),
    pytest.param(C, {"prompt": "hi", "prompt_logprobs": -2}, ("BadRequestError", "prompt_logprobs"),
                 id="prompt_logprobs -2"),
    pytest.param(C, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, ("BadRequestError", "prompt_logprobs"),
                 id="prompt_logprobs with stream"),
    pytest.param(C, {"prompt": "hi", "prompt_logprobs": -1}, ("BadRequestError", "prompt_logprobs"),
                 id="prompt_logprobs -1: the vocabulary, over 20"),
    pytest.param(C, {"prompt": "hi", "echo": True, "logprobs": 21}, ("BadRequestError", "logprobs"),
                 id="echo with logprobs 21: the sample check first"),
    pytest.param(C, {"prompt": "hi", "logit_bias": {"a": 1}}, ("BadRequestError", "logit_bias"),
                 id="logit_bias key not a token id"),
    pytest.param(C, {"prompt": "hi", "suffix": "x"}, ("BadRequestError", "suffix"), id="suffix without FIM"),
    pytest.param(C, {"prompt": [[5]], "suffix": "x"}, ("BadRequestError", "suffix"), id="suffix, token ids"),
    pytest.param(C, {"prompt": "hi", "truncate_prompt_tokens": 300}, ("BadRequestError", "truncate_prompt_tokens"),
                 id="truncate_prompt_tokens over max_model_len"),
    pytest.param(C, {"prompt": "hi", "truncate_prompt_tokens": 0}, ("BadRequestError", None),
                 id="truncate_prompt_tokens 0 leaves an empty prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "extra", "expected"), FIELD_ERRORS)
async def test_found_fields_vllm_checks(
    asgi, path: str, extra: dict[str, Any], expected: tuple[str, str | None]
) -> None:
    """Request fields vLLM 0.32 types or checks, answered 400 (type, param) by it; the simulator served them."""
    async with asgi(CFG) as (client, _):
        resp = await client.post(path, json={"model": M, "max_tokens": 2, **extra})
    assert _error(resp) == (400, *expected), resp.text


async def test_found_completion_stream_usage_has_no_prompt_tokens_details(asgi) -> None:
    """vLLM's completions stream ends with a usage event of the three counts only; the simulator added
    `"prompt_tokens_details": null` (its chat stream already left it out)."""
    body = {
        "model": M,
        "prompt": "hi",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with asgi(CFG) as (client, _):
        resp = await client.post(C, json=body)
    usage = _sse(resp.text)[-2]["usage"]
    assert set(usage) == {"prompt_tokens", "total_tokens", "completion_tokens"}


async def test_found_truncate_prompt_tokens_keeps_the_last_tokens(asgi) -> None:
    """`truncate_prompt_tokens: k` serves (and charges) the prompt's last k tokens."""
    async with asgi(CFG) as (client, _):
        resp = await client.post(C, json={"model": M, "prompt": [5, 6, 7, 8], "max_tokens": 1,
                                          "truncate_prompt_tokens": 2})  # fmt: skip
    assert resp.json()["usage"]["prompt_tokens"] == 2


MESSAGE_ERRORS = [
    pytest.param({"messages": 5}, ("BadRequestError", None), id="messages a number: not iterable"),
    pytest.param({"messages": None}, ("BadRequestError", None), id="messages null: not iterable"),
    pytest.param({"messages": "hi", "top_logprobs": 1}, ("BadRequestError", "top_logprobs"),
                 id="a before-validator error wins over messages of the wrong type"),
    pytest.param({"messages": [{}]}, ("Bad Request", "body.messages.0.ChatCompletionDeveloperMessageParam.content"),
                 id="an empty message"),
    pytest.param({"messages": [*MSG, {"content": "hi"}]},
                 ("Bad Request", "body.messages.1.ChatCompletionDeveloperMessageParam.role"), id="no role"),
    pytest.param({"messages": [{"role": 5, "content": "hi"}]},
                 ("Bad Request", "body.messages.0.ChatCompletionDeveloperMessageParam.role"), id="role 5"),
    pytest.param({"messages": [{"role": "user", "content": None}]},
                 ("Bad Request", "body.messages.0.ChatCompletionDeveloperMessageParam.content"), id="content null"),
    pytest.param({"messages": [{"role": "user", "content": "hi", "name": 5}]},
                 ("Bad Request", "body.messages.0.ChatCompletionDeveloperMessageParam.role"), id="name 5"),
    pytest.param({"messages": [[]]}, ("Bad Request", "body.messages.0.ChatCompletionDeveloperMessageParam"),
                 id="a message not an object"),
    pytest.param({"messages": [{"role": "user", "content": "hi", "tool_calls": 5}]}, ("BadRequestError", None),
                 id="tool_calls a number"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "nope"}]}]}, ("BadRequestError", None),
                 id="a content part of an unknown type"),
    pytest.param({"messages": [{"role": "user", "content": ["hi"]}]}, ("BadRequestError", None),
                 id="a content part that is a string"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                 ("BadRequestError", None), id="an image to a text-only model"),
    pytest.param({"messages": MSG, "continue_final_message": True}, ("BadRequestError", None),
                 id="continue_final_message with the default add_generation_prompt"),
    pytest.param({"messages": MSG, "continue_final_message": True, "add_generation_prompt": True},
                 ("BadRequestError", None), id="continue_final_message and add_generation_prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "expected"), MESSAGE_ERRORS)
async def test_found_messages_vllm_refuses(
    asgi, extra: dict[str, Any], expected: tuple[str, str | None]
) -> None:
    """Chat `messages` vLLM 0.32 refuses (its before-validators, its message union, its renderer), with the
    type and param it names; the simulator served most of them, or named `body.messages` for all."""
    async with asgi(CFG) as (client, _):
        resp = await client.post(CHAT, json={"model": M, "max_tokens": 2, **extra})
    assert _error(resp) == (400, *expected), resp.text


@pytest.mark.parametrize(
    "messages",
    [[{"role": "user"}], [{"role": "bot", "content": "hi"}], [{"role": "user", "content": []}],
     [{"role": "user", "content": "hi", "tool_calls": "x"}], [{"role": "", "content": "hi"}]],
)  # fmt: skip
async def test_messages_vllm_serves_still_served(asgi, messages: list[Any]) -> None:
    """Messages vLLM's last message type (any string role, optional content) takes: served, as by vLLM."""
    async with asgi(CFG) as (client, _):
        resp = await client.post(CHAT, json={"model": M, "max_tokens": 2, "messages": messages})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_found_continuous_usage_of_a_chat_chunk_has_completion_tokens_details(asgi, chat: bool) -> None:
    """With `continuous_usage_stats`, each of vLLM's chat chunks carries `usage` with
    `"completion_tokens_details": null` beside the three counts (a completions chunk only the counts); the
    simulator sent the counts alone on both."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": M, "max_tokens": 2, "stream": True, "stream_options": options}
    body.update({"messages": MSG} if chat else {"prompt": "hi"})
    async with asgi(CFG) as (client, _):
        resp = await client.post(CHAT if chat else C, json=body)
    chunks = [e for e in _sse(resp.text)[:-1] if e["choices"]]
    counts = {"prompt_tokens", "total_tokens", "completion_tokens"}
    assert chunks and all(
        set(e["usage"]) == counts | ({"completion_tokens_details"} if chat else set()) for e in chunks
    )
    assert all(e["usage"].get("completion_tokens_details", None) is None for e in chunks)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param({"messages": [{"role": "bot", "content": [{"text": "hi"}]}]}, ("BadRequestError", "type"),
                     id="a part without type in a message of a role of its own"),
        pytest.param({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, ("BadRequestError", None),
                     id="a part without type in a user message"),
    ],
)  # fmt: skip
async def test_found_content_part_without_type(
    asgi, extra: dict[str, Any], expected: tuple[str, str | None]
) -> None:
    """vLLM parses the content parts of its custom message type (any role) itself and names the missing `type`;
    a standard message's parts fail pydantic's lazy validation, no param."""
    async with asgi(CFG) as (client, _):
        resp = await client.post(CHAT, json={"model": M, "max_tokens": 2, **extra})
    assert _error(resp) == (400, *expected), resp.text


async def test_suffix_with_no_prompt_is_the_empty_batch_error(asgi) -> None:
    """`prompt: []` with a `suffix`: vLLM renders no prompt (every one of none is text) and refuses the empty
    batch, no param (a first cut of the suffix check named `suffix`)."""
    async with asgi(CFG) as (client, _):
        resp = await client.post(C, json={"model": M, "prompt": [], "suffix": "x"})
    assert _error(resp) == (400, "BadRequestError", None)


async def test_found_message_with_tool_calls_not_a_list_and_no_content(asgi) -> None:
    """`{"role": "user", "tool_calls": "x"}`: vLLM's custom message type (the only one taking a message without
    content) types `tool_calls` as a list of tool calls, so none takes it: 400 naming the first type's
    `content`; with a content the user type takes it (served). The simulator served both."""
    bad = [{"role": "user", "tool_calls": "x"}]
    good = [{"role": "user", "content": "hi", "tool_calls": "x"}]
    async with asgi(CFG) as (client, _):
        refused = await client.post(CHAT, json={"model": M, "max_tokens": 2, "messages": bad})
        served = await client.post(CHAT, json={"model": M, "max_tokens": 2, "messages": good})
    assert _error(refused) == (
        400,
        "Bad Request",
        "body.messages.0.ChatCompletionDeveloperMessageParam.content",
    )
    assert served.status_code == 200


async def test_found_message_with_tool_call_id_not_a_string_and_no_content(asgi) -> None:
    """`{"role": "user", "tool_call_id": [1]}`: the custom message type types `tool_call_id` as a string, the
    user type needs a content: none takes it, 400 on the first type's `content` (the simulator served it)."""
    async with asgi(CFG) as (client, _):
        resp = await client.post(
            CHAT, json={"model": M, "max_tokens": 2, "messages": [{"role": "user", "tool_call_id": [1]}]}
        )
    assert _error(resp) == (400, "Bad Request", "body.messages.0.ChatCompletionDeveloperMessageParam.content")


async def test_found_echo_without_generation(asgi) -> None:
    """Completions' `echo` with `max_tokens: 0` is vLLM's echo without generation: 200, one token sampled
    (usage completion_tokens 1, finish_reason length), and streamed one event with the prompt's text and
    finish_reason length, then `data: [DONE]`; the simulator refused max_tokens 0 as without echo (chat's
    echo does not do this: 400 there too)."""
    body = {"model": M, "prompt": "hi", "max_tokens": 0, "echo": True}
    async with asgi(CFG) as (client, _):
        plain = await client.post(C, json=body)
        stream = await client.post(C, json={**body, "stream": True})
        chat = await client.post(CHAT, json={"model": M, "messages": MSG, "max_tokens": 0, "echo": True})
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["completion_tokens"] == 1
    assert plain.json()["choices"][0]["finish_reason"] == "length"
    assert stream.status_code == 200
    events = _sse(stream.text)
    assert events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["choices"][0]["text"] == "hi" and events[0]["choices"][0]["finish_reason"] == "length"
    assert _error(chat) == (400, "BadRequestError", "max_tokens")


@pytest.mark.parametrize(
    ("content", "role", "expected"),
    [
        pytest.param([{"type": "text", "text": "a"}, {"type": "text"}], "user", None, id="two parts, one without text"),
        pytest.param([{"text": "a"}, {"type": "text", "text": "b"}], "user", ("BadRequestError", "type"),
                     id="two parts, one without type"),
        pytest.param([{"type": "text", "text": "a"}, {"type": "nope"}], "user", ("BadRequestError", None),
                     id="two parts, one of an unknown type"),
        pytest.param(["hi"], "bot", None, id="a string part in a message of a role of its own"),
        pytest.param([{"type": "text"}], "bot", None, id="a text part without text, role of its own"),
        pytest.param([{"type": "text"}], "user", ("BadRequestError", None), id="one text part without text"),
        pytest.param(["hi", "ho"], "user", ("BadRequestError", None), id="string parts in a user message"),
        pytest.param([{"type": "text", "text": "hi"}, "hi"], "user", None, id="a string part beside a text part"),
        pytest.param([{"text": "hi"}, {"text": "hi"}], "user", ("BadRequestError", None), id="parts without type"),
    ],
)  # fmt: skip
async def test_found_content_parts_parsed_by_vllm_itself(
    asgi, content: list[Any], role: str, expected: tuple[str, str | None] | None
) -> None:
    """vLLM 0.32 (as measured) parses the content parts itself for a message with a valid text part or of a
    role of its own (a text part then needs no text, a string part is text, a part without `type` names
    `type`), else validates them as pydantic's part union (any invalid part: no param)."""
    async with asgi(CFG) as (client, _):
        resp = await client.post(
            CHAT, json={"model": M, "max_tokens": 2, "messages": [{"role": role, "content": content}]}
        )
    if expected is None:
        assert resp.status_code == 200, resp.text
    else:
        assert _error(resp) == (400, *expected), resp.text


async def test_found_assistant_message_needs_no_content(asgi) -> None:
    """An assistant message without content (a `tool_call_id` of the wrong type beside it is ignored) is
    vLLM's assistant type; the first message no type takes is the one reported."""
    messages = [
        {"role": "assistant", "tool_call_id": {"a": 1}},
        {"role": "user", "content": ""},
        {"role": "system", "name": {"a": 1}},
    ]
    async with asgi(CFG) as (client, _):
        resp = await client.post(CHAT, json={"model": M, "max_tokens": 2, "messages": messages})
    assert _error(resp) == (400, "Bad Request", "body.messages.2.ChatCompletionDeveloperMessageParam.content")


async def test_found_custom_message_content_is_no_mapping(asgi) -> None:
    """`{"role": "tool", "content": {"a": 1}, "name": "x"}`: the custom message type's content is a string or
    a list (an object is refused there, though iterable for the standard types) and the tool type needs a
    tool_call_id: no type takes it, 400 on the first type's `role` (the simulator failed it later, no param)."""
    messages = [{"role": "tool", "content": {"a": 1}, "name": "x"}]
    async with asgi(CFG) as (client, _):
        resp = await client.post(CHAT, json={"model": M, "max_tokens": 2, "messages": messages})
    assert _error(resp) == (400, "Bad Request", "body.messages.0.ChatCompletionDeveloperMessageParam.role")


async def test_found_assistant_content_null(asgi) -> None:
    """vLLM's assistant message type takes `content: null` (a tool-calling turn); the simulator refused it."""
    messages = [*MSG, {"role": "assistant", "content": None, "tool_call_id": {"a": 1}}]
    async with asgi(CFG) as (client, _):
        resp = await client.post(CHAT, json={"model": M, "max_tokens": 2, "messages": messages})
    assert resp.status_code == 200, resp.text
