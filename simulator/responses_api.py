"""POST /v1/responses (OpenAI's Responses API) on the simulated worker, in vLLM 0.32's shapes.

A Responses request is turned into a chat request (`instructions` → a system message, `input` → user or
given-role messages, `max_output_tokens` → max_tokens) and parsed by the chat path, so its prompt tokens,
checks and engine submission are chat's. The answer is rendered as vLLM renders it: one `message` output
item with one `output_text` part, `status` "incomplete" with reason `max_output_tokens` when the length
limit cut it; a stream is `event: <type>\\ndata: {json}\\n\\n` events numbered by `sequence_number`, with no
`[DONE]`. Shapes recorded from vLLM 0.32: tests/gateway/fixtures/vllm_responses_*.

Not simulated: the response store (vLLM's is off by default, `VLLM_ENABLE_RESPONSES_API_STORE`), so
`previous_response_id`, `GET /v1/responses/{id}` and `.../cancel` are vLLM's 404 for an unknown response
(`not_found`), and `background: true` is refused as vLLM refuses it without a store; tools, reasoning,
logprobs.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field

from simulator.protocol import ApiError, ApiRequest, parse_request, validated, vllm_error


class _InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class _MessageItem(BaseModel):
    # vLLM's input item union is far wider (tool calls, images, reasoning); the simulator serves text messages
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_InputText]


# `text`: OpenAI's ResponseTextConfig, whose `format` is a plain union (pydantic names each member in its
# errors, as vLLM's 400 does: `body.text.format.ResponseFormatText.type`, ...). The simulator echoes it and
# generates as without it (it ignores chat's response_format the same way).
class ResponseFormatText(BaseModel):
    type: Literal["text"]


class ResponseFormatTextJSONSchemaConfig(BaseModel):
    name: str
    schema_: dict[str, object] = Field(alias="schema")
    type: Literal["json_schema"]
    description: str | None = None
    strict: bool | None = None


class ResponseFormatJSONObject(BaseModel):
    type: Literal["json_object"]


class _TextConfig(BaseModel):
    format: ResponseFormatText | ResponseFormatTextJSONSchemaConfig | ResponseFormatJSONObject | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesFields(BaseModel):
    """The ResponsesRequest fields the simulator reads, with vLLM's annotations; unknown fields ignored."""

    background: bool | None = False
    input: str | list[_MessageItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    metadata: dict[str, str] | None = None
    request_id: str | None = None
    store: bool | None = True
    text: _TextConfig | None = None


def _messages(f: ResponsesFields) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if f.instructions is not None:
        msgs.append({"role": "system", "content": f.instructions})
    if isinstance(f.input, str):
        return [*msgs, {"role": "user", "content": f.input}]
    for item in f.input:
        # parts as chat's text parts: the chat renderer counts their text as chat counts it
        content = item.content if isinstance(item.content, str) else [
            {"type": "text", "text": p.text} for p in item.content
        ]  # fmt: skip
        msgs.append({"role": item.role, "content": content})
    return msgs


def parse_responses(
    body: Mapping[str, Any], served: str, max_model_len: int, adapters: Collection[str] = ()
) -> tuple[ResponsesFields, ApiRequest]:
    """The validated request and the chat request it runs as; raises ApiError (vLLM's 400 for a field of the
    wrong type, 404 for a `previous_response_id`: nothing is stored). `model` may name a LoRA adapter."""
    # vLLM's `mode="before"` validators, in the order pydantic runs them (the last defined first)
    if body.get("prompt") is not None:  # OpenAI's reusable prompt templates: not in vLLM
        raise vllm_error("prompt template is not supported", "prompt")
    if body.get("background") and not body.get("store", True):
        raise vllm_error("background can only be used when `store` is true", "background")
    f = validated(ResponsesFields, body)
    if f.store and f.background:  # vLLM with its store off (the default), as the simulator is
        raise ApiError(
            400,
            "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
            "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
            "launching the vLLM server.",
            "invalid_request_error",
            "background",
        )
    if f.previous_response_id is not None:
        raise not_found(f.previous_response_id)
    # vLLM's TokenizeParams check, as chat's but named max_output_tokens; within max_model_len, get_max_tokens
    # clamps it to the room the prompt leaves, which `check_request` does
    if f.max_output_tokens is not None and f.max_output_tokens > max_model_len:
        raise vllm_error(
            f"max_output_tokens={f.max_output_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            "max_output_tokens",
            f.max_output_tokens,
        )
    chat = {
        "model": f.model,
        "messages": _messages(f),
        "max_tokens": f.max_output_tokens,
        "stream": bool(f.stream),
    }
    if f.temperature is not None:
        chat["temperature"] = f.temperature
    if f.top_p is not None:
        chat["top_p"] = f.top_p
    return f, parse_request(chat, True, served, max_model_len, adapters)


def not_found(response_id: str) -> ApiError:
    """vLLM's answer for a response id it does not store (a continuation, `GET`, `cancel`)."""
    return ApiError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


def new_ids(f: ResponsesFields) -> tuple[str, str]:
    """The response id (the body's `request_id`, else vLLM's `resp_` + 16 hex digits) and the message id."""
    return f.request_id or f"resp_{secrets.token_hex(8)}", f"msg_{secrets.token_hex(8)}"


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [], "cached_tokens_per_turn": []
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + completion,
    }  # fmt: skip


def _text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(mid: str, text: str | None) -> dict[str, Any]:
    """The answer's output item; `text` None: the item as a stream opens it (no content yet)."""
    return {
        "id": mid,
        "content": [] if text is None else [_text_part(text)],
        "role": "assistant",
        "status": "in_progress" if text is None else "completed",
        "type": "message",
        "phase": None,
    }


def response_body(
    f: ResponsesFields,
    rid: str,
    model: str,
    created: int,
    done: tuple[dict[str, Any], str, int, int] | None,
) -> dict[str, Any]:
    """vLLM's response object, in its key order. `done`: (output item, finish reason, prompt tokens, output
    tokens) of a finished answer; None: the in-progress object a stream opens with."""
    incomplete = done is not None and done[1] == "length"
    status = "in_progress" if done is None else "incomplete" if incomplete else "completed"
    return {
        "id": rid,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": f.instructions,
        "metadata": f.metadata,
        "model": model,
        "object": "response",
        "output": [] if done is None else [done[0]],
        "parallel_tool_calls": f.parallel_tool_calls,
        "temperature": 1.0 if f.temperature is None else f.temperature,  # vLLM's default sampling params
        "tool_choice": "none",  # what vLLM 0.32 answered for a request without tools (the fixtures)
        "tools": [],
        "top_p": 1.0 if f.top_p is None else f.top_p,
        "background": False,
        "max_output_tokens": f.max_output_tokens,
        "max_tool_calls": None,
        "previous_response_id": None,
        "prompt": None,
        "reasoning": None,
        "service_tier": f.service_tier,
        "status": status,
        "text": None if f.text is None else f.text.model_dump(by_alias=True),
        "top_logprobs": None,
        "truncation": f.truncation,
        "usage": None if done is None else _usage(done[2], done[3]),
        "user": f.user,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


class EventWriter:
    """One stream's events, numbered from 0 in the order written (vLLM's `sequence_number`)."""

    __slots__ = ("_seq", "item_id")

    def __init__(self, item_id: str) -> None:
        self._seq = 0
        self.item_id = item_id

    def event(self, type_: str, fields: dict[str, Any]) -> str:
        data = {**fields, "sequence_number": self._seq, "type": type_}
        self._seq += 1
        return f"event: {type_}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def _at(self) -> dict[str, Any]:
        return {"content_index": 0, "item_id": self.item_id}

    def opening(self, response: dict[str, Any]) -> list[str]:
        """created, in_progress, the output item and its text part added."""
        return [
            self.event("response.created", {"response": response}),
            self.event("response.in_progress", {"response": response}),
            self.event("response.output_item.added", {"item": message_item(self.item_id, None), "output_index": 0}),
            self.event(
                "response.content_part.added", {**self._at(), "output_index": 0, "part": _text_part("", [])}
            ),
        ]  # fmt: skip

    def delta(self, text: str) -> str:
        return self.event(
            "response.output_text.delta", {**self._at(), "delta": text, "logprobs": [], "output_index": 0}
        )

    def closing(self, text: str, response: dict[str, Any]) -> list[str]:
        """The text, its part and item done, then response.completed (also for an incomplete answer)."""
        item = response["output"][0]
        return [
            self.event("response.output_text.done", {**self._at(), "logprobs": [], "output_index": 0, "text": text}),
            self.event("response.content_part.done", {**self._at(), "output_index": 0, "part": _text_part(text)}),
            self.event("response.output_item.done", {"item": item, "output_index": 0}),
            self.event("response.completed", {"response": response}),
        ]  # fmt: skip
