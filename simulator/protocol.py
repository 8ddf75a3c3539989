"""vLLM's OpenAI server surface, as the simulated worker speaks it: request parsing/validation and response JSON.

Validation follows vLLM 0.32 as observed (`../shared/REAL_VLLM.md`): unknown fields are accepted; a body
that is not JSON, not an object or has wrongly typed fields → 400 `"type": "Bad Request"`; semantic
errors → 400 `BadRequestError` naming the `param` (`max_tokens`, `min_tokens`, `n`, `prompt`,
`stream_options`); unknown model → 404 `NotFoundError`; a prompt that leaves no room for one output token
→ 400 `BadRequestError` with `param: "input_tokens"` (plain JSON even for streams). A prompt that fits but
whose `max_tokens` does not is accepted with `max_tokens` clamped to `max_model_len − prompt`.

Several sequences, as vLLM serves them: a completions batch of prompts (strings or token-id lists) and
`n` completions per prompt; choice `index` = prompt · n + completion, usage counts each prompt once and
every completion's tokens (`ApiRequest.sequences`). Refused (400, a clear message): `kv_transfer_params`
on a request of several sequences (vLLM's prefill answer carries one sequence's). Accepted and ignored:
sampling parameters (temperature, top_p, seed, stop, logprobs,
…; numeric ones are type- and range-checked as vLLM checks them, `_check_sampling`), tools,
response_format, echo. `max_tokens` > max_model_len → 400
(param `max_tokens`), as vLLM 0.32 answers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simulator.tokens import VOCAB_SIZE, render_chat, text_token_ids


class ApiError(Exception):
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}` with HTTP `status`."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


def bad_shape(message: str, param: str | None = None) -> ApiError:
    """Malformed JSON or a field of the wrong type: vLLM (FastAPI/pydantic) answers these with type "Bad Request"
    and the error location as param (`body.<field>`, or `body.<byte offset>` for JSON that does not parse)."""
    return ApiError(400, message, "Bad Request", param)


# Sampling parameters the simulator ignores but, like vLLM's pydantic models, type-checks.
_NUMBER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "seed")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    model: str
    prompts: list[list[int]]  # token ids per prompt: one, or a completions batch's several
    max_tokens: int | None  # None → up to max_model_len
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None
    # stream_options.continuous_usage_stats, honoured (as vLLM does) only together with include_usage:
    # every chunk then carries the usage so far
    continuous_usage: bool = False
    n: int = 1  # completions per prompt

    @property
    def sequences(self) -> int:
        """What vLLM decodes for it: prompts × n, each sequence its own engine request."""
        return len(self.prompts) * self.n


UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"  # vLLM's own words


def is_json_media_type(content_type: str | None) -> bool:
    """vLLM's check on its POST routes: the media type (before any `;` parameter) is exactly
    `application/json`, case-insensitively; no header, `text/plain` or a form encoding (curl `-d` without
    `-H`) are refused with 400, whatever the body holds."""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


def parse_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    if not is_json_media_type(content_type):
        raise bad_shape(UNSUPPORTED_MEDIA_TYPE)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = f"body.{exc.pos}" if isinstance(exc, json.JSONDecodeError) else None
        raise bad_shape(f"JSON decode error: {exc}", pos) from None
    if not isinstance(body, dict):
        raise bad_shape("Input should be a valid dictionary or object to extract fields from")
    return body


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad_shape(f"{name}: Input should be a valid integer", f"body.{name}")
    return value


def _bool_field(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_shape(f"{name}: Input should be a valid boolean", f"body.{name}")
    return value


def _prompts(body: Mapping[str, Any], chat: bool) -> list[list[int]]:
    """The request's prompts as token ids: chat's rendered messages; a completions prompt (a string, a
    list of token ids) or a batch of those (a list of strings or of token-id lists, not mixed)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise bad_shape("messages: Field required (a list of message objects)", "body.messages")
        if not messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        try:
            return [text_token_ids(render_chat(messages))]
        except TypeError as exc:
            raise bad_shape(f"messages: {exc}", "body.messages") from None
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_shape("prompt: Field required", "body.prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [_one_prompt(p) for p in prompt]  # a batch of strings
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [_one_prompt(p) for p in prompt]  # a batch of token-id lists
    return [_one_prompt(prompt)]


def _one_prompt(prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "Prompt cannot be empty", param="prompt")
        return text_token_ids(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if any(t < 0 for t in prompt):
            raise ApiError(400, "token ids must be non-negative", param="prompt")
        return list(prompt)
    raise bad_shape(
        "prompt: Input should be a string, a list of token ids or a batch of those", "body.prompt"
    )


MAX_LOGPROBS = 20  # vLLM's --max-logprobs default


def _check_sampling(body: Mapping[str, Any], chat: bool) -> None:
    """The ranges vLLM 0.32 checks on sampling parameters, in its order and with its messages and params
    (measured against the CPU build): the simulator ignores the values, but a request vLLM refuses must be
    refused here too. Types were checked before (`_NUMBER_FIELDS`)."""

    def number(name: str) -> float | None:
        value = body.get(name)
        return None if value is None else float(value)

    top_logprobs = _int_field(body, "top_logprobs") if chat else None
    wants_logprobs = _bool_field(body, "logprobs") if chat else False
    # vLLM's request model checks the count's sign first: -1 asks for the whole vocabulary, and is then
    # refused below as more than MAX_LOGPROBS; any other negative count is refused here.
    count_name = "top_logprobs" if chat else "logprobs"
    count = top_logprobs if chat else _int_field(body, "logprobs")
    if count is not None and count < -1:
        raise ApiError(
            400,
            f"`{count_name}` must be a positive value or -1. (parameter={count_name}, value={count})",
            param=count_name,
        )
    if top_logprobs and not wants_logprobs:
        raise ApiError(
            400, "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
            param="top_logprobs",
        )  # fmt: skip
    for name in ("presence_penalty", "frequency_penalty"):
        if (v := number(name)) is not None and not -2.0 <= v <= 2.0:
            raise ApiError(400, f"{name} must be in [-2, 2], got {v}.")
    if (v := number("repetition_penalty")) is not None and not v > 0.0:
        raise ApiError(400, f"repetition_penalty must be greater than zero, got {v}.")
    if (v := number("temperature")) is not None and not 0.0 <= v <= 2.0:
        what = "must be non-negative" if not v >= 0.0 else "must be in [0, 2]"
        raise ApiError(
            400, f"temperature {what}, got {v}. (parameter=temperature, value={v})", param="temperature"
        )
    if (v := number("top_p")) is not None and not 0.0 < v <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1], got {v}. (parameter=top_p, value={v})", param="top_p")
    if (k := body.get("top_k")) is not None and k < -1:  # -1 and 0 both disable
        raise ApiError(400, f"top_k must be 0 (disable), or at least 1, got {k}.")
    if (v := number("min_p")) is not None and not 0.0 <= v <= 1.0:
        raise ApiError(400, f"min_p must be in [0, 1], got {v}.")
    requested = (top_logprobs if wants_logprobs else None) if chat else count
    if requested == -1:
        requested = VOCAB_SIZE
    if requested is not None and requested > MAX_LOGPROBS:
        raise ApiError(
            400,
            f"Requested sample logprobs of {requested}, which is greater than max allowed: {MAX_LOGPROBS} "
            f"(parameter=logprobs, value={requested})",
            param="logprobs",
        )


# vLLM's CompletionRequest default (OpenAI's legacy API); the gateway's estimate uses it too
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def parse_request(body: Mapping[str, Any], chat: bool, served: str) -> ApiRequest:
    """Validate `body`; raises ApiError. The model check comes first, as in vLLM."""
    model = body.get("model", served)
    if model is None or model == "":  # vLLM serves an empty name as its (only) served model
        model = served
    if not isinstance(model, str):
        raise bad_shape("model: Input should be a valid string", "body.model")
    for name in _NUMBER_FIELDS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad_shape(f"{name}: Input should be a valid number", f"body.{name}")
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    prompts = _prompts(body, chat)
    max_tokens = _int_field(body, "max_tokens")
    if chat:
        max_tokens = _int_field(body, "max_completion_tokens") or max_tokens
    elif max_tokens is None:  # completions default to 16 tokens; chat fills the context
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    min_tokens = _int_field(body, "min_tokens") or 0
    if min_tokens < 0:
        raise ApiError(400, f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:  # vLLM names no param for either
        raise ApiError(
            400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    n = _int_field(body, "n")
    if n is not None and n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.")  # vLLM names no param here
    n = n or 1
    _check_sampling(body, chat)
    stream = _bool_field(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise bad_shape("stream_options: Input should be a valid dictionary", "body.stream_options")
    if opts and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    include_usage = bool(opts and _bool_field(opts, "include_usage"))
    continuous_usage = include_usage and bool(_bool_field(opts, "continuous_usage_stats"))
    kvp = body.get("kv_transfer_params")
    if kvp is not None and not isinstance(kvp, Mapping):
        raise bad_shape("kv_transfer_params: Input should be a valid dictionary", "body.kv_transfer_params")
    if kvp and len(prompts) * n > 1:
        raise ApiError(
            400,
            "kv_transfer_params applies to one sequence: the simulated worker refuses it with n > 1 or a batch "
            "of prompts (vLLM's prefill answer carries one sequence's blocks).",
            param="kv_transfer_params",
        )
    return ApiRequest(
        chat, model, prompts, max_tokens, min_tokens, _bool_field(body, "ignore_eos"), stream, include_usage,
        dict(kvp) if kvp else None, continuous_usage, n,
    )  # fmt: skip


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """max_tokens to run with: clamped to max_model_len − prompt. ApiError when no output token fits (param
    input_tokens) or when max_tokens alone exceeds max_model_len (param max_tokens), as vLLM 0.32 does."""
    room = max_model_len - prompt_tokens
    if room < 1:
        requested = max_tokens or 0
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {requested} "
            f"output tokens and your prompt contains {prompt_tokens} input tokens, for a total of "
            f"{prompt_tokens + requested} tokens. Please reduce the length of the input prompt or the number of "
            f"requested output tokens. (parameter=input_tokens, value={prompt_tokens})",
            param="input_tokens",
        )
    if max_tokens is not None and max_tokens > max_model_len:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens}).",
            param="max_tokens",
        )
    return room if max_tokens is None else min(max_tokens, room)


# ------------------------------------------------------------------ responses
def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }


def completion_body(
    rid: str, model: str, created: int, choices: list[tuple[str, str]], prompt: int, completion: int, kvp: Any
) -> dict[str, Any]:
    """`choices`: (text, finish reason) per sequence, in index order."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
             "prompt_logprobs": None}
            for i, (text, finish) in enumerate(choices)
        ],
        "usage": usage(prompt, completion),
        "system_fingerprint": None,
        "kv_transfer_params": kvp,
    }  # fmt: skip


def chat_body(
    rid: str, model: str, created: int, choices: list[tuple[str, str]], prompt: int, completion: int, kvp: Any
) -> dict[str, Any]:
    """`choices`: (text, finish reason) per sequence, in index order."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            for i, (text, finish) in enumerate(choices)
        ],
        "usage": usage(prompt, completion),
        "prompt_logprobs": None,
        "kv_transfer_params": kvp,
    }


def _continuous_usage(so_far: tuple[int, int] | None) -> str:
    """`,"usage":{...}` for a chunk of a stream with continuous usage (vLLM sets only the three counts)."""
    if so_far is None:
        return ""
    prompt, completion = so_far
    return f',"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},"completion_tokens":{completion}}}'


class ChunkWriter:
    """Server-sent-event lines of one stream: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""

    __slots__ = ("_head", "_tail", "chat", "created", "model", "rid")

    def __init__(self, rid: str, model: str, chat: bool) -> None:
        self.rid, self.model, self.chat = rid, model, chat
        self.created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        # The constant head of every chunk, serialised once: a stream writes one chunk per token.
        self._head = f'data: {{"id":{json.dumps(rid)},"object":"{obj}","created":{self.created},"model":{json.dumps(model)},'
        self._tail = "}\n\n"

    def role(self, usage_so_far: tuple[int, int] | None = None, index: int = 0) -> str:
        return (
            self._head
            + f'"choices":[{{"index":{index},"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]'
            + _continuous_usage(usage_so_far)
            + self._tail
        )

    def token(
        self,
        text: str,
        finish: str | None = None,
        usage_so_far: tuple[int, int] | None = None,
        index: int = 0,
    ) -> str:
        """One token's chunk of choice `index`; `usage_so_far` (prompt, completion tokens so far) with
        continuous usage."""
        fr = "null" if finish is None else json.dumps(finish)
        t = json.dumps(text)
        if self.chat:  # vLLM puts stop_reason on a chat stream's final event only
            stop = "" if finish is None else ',"stop_reason":null'
            choice = (
                f'{{"index":{index},"delta":{{"content":{t}}},"logprobs":null,"finish_reason":{fr}{stop}}}'
            )
        else:
            choice = f'{{"index":{index},"text":{t},"logprobs":null,"finish_reason":{fr},"stop_reason":null}}'
        return f'{self._head}"choices":[{choice}]{_continuous_usage(usage_so_far)}{self._tail}'

    def usage(self, prompt: int, completion: int) -> str:
        u = usage(prompt, completion)
        if self.chat:
            del u["prompt_tokens_details"]  # vLLM's chat usage event omits it
        return f'{self._head}"choices":[],"usage":{json.dumps(u, separators=(",", ":"))}{self._tail}'

    @staticmethod
    def error(err: ApiError) -> str:
        return f"data: {json.dumps(err.body())}\n\n"

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
