"""vLLM 0.32's `POST /v1/embeddings`, as a `vllm serve MODEL --runner pooling --convert embed` server answers it:
request validation, the pseudo embedding vectors and the response bodies (`simulator.worker_app` runs the
engine requests).

Requests. vLLM validates the body against a union of five request models (a completion-style `input`; one
chat conversation in `messages`; a batch of conversations in `messages`; one conversation or a batch of them
in `input`), with pydantic's smart-mode union. The models below have vLLM's fields, types, defaults and
field order, and the message union has vLLM's eight members, so pydantic picks the same member and reports
the same errors in the same order (vLLM's handler lists the first 10, then "...and N more errors"; `param`
is the first error's location). Checks, in vLLM's order (each measured against the CPU build):

1. the union's and the models' "before" validators: `normalize` (removed), `task` "encode"/"score"
   (removed), an empty or non-string `cache_salt` → 400 BadRequestError naming the param;
   `continue_final_message` with `add_generation_prompt` (no param; every member is tried, so also without
   `messages`);
2. the union → 400 "Bad Request" with pydantic's errors;
3. the model: neither the served name nor an adapter → 404 NotFoundError, param null (completions name
   `model`; the pooling handler does not);
4. `truncate_prompt_tokens` > max_model_len → 400, its own words, no param;
5. the prompts: none (`input: []`) → "You must pass at least one prompt"; an empty conversation → the chat
   renderer's error; each prompt truncated to `truncate_prompt_tokens` (`truncation_side` "right" keeps the
   first ones, else the last), padded to max_model_len with `padding: "max_length"`, then every prompt's
   length against max_model_len (`input_tokens`, as completions);
6. `dimensions` (any value, 0 and negatives included): the catalog models are not Matryoshka models →
   400 "Model '<name>' does not support Matryoshka embeddings; dimensions must be unset (received
   dimensions=N)." (no param);
7. per prompt: empty (`""`, `[]`) → "The decoder prompt cannot be empty", a token id outside the vocabulary
   → "Token id N is out of vocabulary". (An `X-data-parallel-rank` header is ignored: vLLM's pooling
   handlers never hand it to the engine, so even a rank outside the engines is answered.)

Text is tokenised with the simulator's pseudo-tokenizer (`simulator.tokens`: ceil(characters / 4) tokens,
no BOS), so text usage differs from a real tokenizer's; token-id inputs are counted exactly. Conversations
are rendered with the simulator's chat template (`render_chat`; embeddings default to no generation prompt,
as vLLM's embedding chat requests do).

Vectors. Each input's embedding is a pseudo-random unit vector of the model's `hidden_size` floats, drawn
from (worker seed, token ids): the same input gives the same vector on every worker of that seed, different
inputs (almost) orthogonal ones. vLLM normalises embeddings by default (`use_activation` null or true); with
`use_activation: false` the simulator answers the same unit vector (it has no unnormalised hidden state).
Values are float32, rendered as JSON floats (`float`) or as little/big-endian bytes of `embed_dtype`
(float32, float16, bfloat16, fp8_e4m3, fp8_e5m2) for `base64` and `bytes`/`bytes_only` (vLLM's binary
answer: the vectors back to back, `application/octet-stream`, and for `bytes` a `metadata` header of JSON
with each vector's byte range).
"""

from __future__ import annotations

import base64
import json
import sys
import zlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal, Required

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model, model_validator
from typing_extensions import TypedDict

from simulator.protocol import (
    _INTERNAL_LOC,
    EMPTY_CONVERSATION,
    ApiError,
    EngineInputError,
    bad_shape,
    check_prompt_length,
    error_input,
    sanitize_message,
    text_ids,
    vllm_error,
)
from simulator.tokens import render_chat

EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
MAX_REPORTED_ERRORS = 10  # vLLM's validation handler lists this many errors, then "...and N more errors"
_CACHE_SALT_MAX = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
_REMOVED_TASKS = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}
NO_PROMPT = "You must pass at least one prompt"
EMPTY_PROMPT = "The decoder prompt cannot be empty"
BOTH_CHAT_FLAGS = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
TRUNCATE_OVER_CONTEXT = (
    "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation size."
)


# ---------------------------------------------------------------- the message union (vLLM's eight members)
class ChatCompletionDeveloperMessageParam(TypedDict, total=False):
    content: Required[str | Iterable[Any]]  # an Iterable: pydantic checks its items lazily (never, here)
    role: Required[Literal["developer"]]
    name: str


class ChatCompletionSystemMessageParam(TypedDict, total=False):
    content: Required[str | Iterable[Any]]
    role: Required[Literal["system"]]
    name: str


class ChatCompletionUserMessageParam(TypedDict, total=False):
    content: Required[str | Iterable[Any]]
    role: Required[Literal["user"]]
    name: str


class _Audio(TypedDict, total=False):
    id: Required[str]


class _FunctionCall(TypedDict, total=False):
    arguments: Required[str]
    name: Required[str]


class ChatCompletionAssistantMessageParam(TypedDict, total=False):
    role: Required[Literal["assistant"]]
    audio: _Audio | None
    content: str | Iterable[Any] | None
    function_call: _FunctionCall | None
    name: str
    refusal: str | None
    tool_calls: Iterable[Any]


class ChatCompletionToolMessageParam(TypedDict, total=False):
    content: Required[str | Iterable[Any]]
    role: Required[Literal["tool"]]
    tool_call_id: Required[str]


class ChatCompletionFunctionMessageParam(TypedDict, total=False):
    content: Required[str | None]
    name: Required[str]
    role: Required[Literal["function"]]


class CustomChatCompletionMessageParam(TypedDict, total=False):
    """vLLM's own message type: any string role. Content parts, tool calls and tools are dicts here (vLLM
    types each part; a malformed part gets fewer errors from the simulator)."""

    role: Required[str]
    content: str | list[dict[str, Any]]
    name: str
    tool_call_id: str | None
    tool_calls: list[dict[str, Any]] | None
    reasoning: str | None
    tools: list[dict[str, Any]] | None
    task: str | None


class _HarmonyRole(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    SYSTEM = "system"
    DEVELOPER = "developer"
    TOOL = "tool"


class _Author(BaseModel):
    role: _HarmonyRole
    name: str | None = None


class Message(BaseModel):
    """openai_harmony's Message, the last member of vLLM's message union (content items as dicts here)."""

    model_config = ConfigDict(from_attributes=True)  # as harmony's: a non-dict is "model_attributes_type"
    author: _Author
    content: list[dict[str, Any]] = Field(default_factory=list)
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None


_Message = (
    ChatCompletionDeveloperMessageParam
    | ChatCompletionSystemMessageParam
    | ChatCompletionUserMessageParam
    | ChatCompletionAssistantMessageParam
    | ChatCompletionToolMessageParam
    | ChatCompletionFunctionMessageParam
    | CustomChatCompletionMessageParam
    | Message
)
_Conversation = Annotated[list[_Message], Field(min_length=1)]


# ---------------------------------------------------------------- the request models (vLLM's field order)
class OpenAIBaseModel(BaseModel):
    """vLLM's OpenAIBaseModel: extra fields allowed, and a wrap validator, which makes each request model's
    union branch a bracketed segment of an error's `loc` (dropped from the reported location)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _branch(cls, data: Any, handler: Any) -> Any:
        return handler(data)


# The fields of vLLM 0.32's embedding requests, in its order (each request's own, then its mixins'): the
# validation errors of the request union come out in that order, so each model is built from these segments.
_ENCODING: dict[str, Any] = {
    "padding": (Literal["max_length", "do_not_pad"] | None, None),
    "encoding_format": (EncodingFormat, "float"),
    "embed_dtype": (EmbedDType, "float32"),
    "endianness": (Endianness, "native"),
    "dimensions": (int | None, None),
    "use_activation": (bool | None, None),
}
_CHAT_TEMPLATE: dict[str, Any] = {
    "add_generation_prompt": (bool, False),
    "continue_final_message": (bool, False),
    "chat_template": (str | None, None),
    "chat_template_kwargs": (dict[str, Any] | None, None),
    "media_io_kwargs": (dict[str, dict[str, Any]] | None, None),
}
_COMMON: dict[str, Any] = {
    "model": (str | None, None),
    "user": (str | None, None),
    "truncate_prompt_tokens": (Annotated[int, Field(ge=-1)] | None, None),
    "truncation_side": (Literal["left", "right"] | None, None),
    "request_id": (str | None, None),
    "priority": (int, Field(default=0, ge=-(2**63), le=2**63 - 1)),
    "mm_processor_kwargs": (dict[str, Any] | None, None),
    "cache_salt": (Annotated[str, Field(min_length=1, max_length=1024)] | None, None),
}

EmbeddingCompletionRequest: type[OpenAIBaseModel] = create_model(
    "EmbeddingCompletionRequest",
    __base__=OpenAIBaseModel,
    add_special_tokens=(bool, True),
    **_ENCODING,
    input=(list[int] | list[list[int]] | str | list[str], ...),
    **_COMMON,
)
EmbeddingChatRequest: type[OpenAIBaseModel] = create_model(
    "EmbeddingChatRequest",
    __base__=OpenAIBaseModel,
    add_special_tokens=(bool, False),
    **_ENCODING,
    **_CHAT_TEMPLATE,
    messages=(list[_Message], ...),
    **_COMMON,
)
EmbeddingBatchChatRequest: type[OpenAIBaseModel] = create_model(
    "EmbeddingBatchChatRequest",
    __base__=OpenAIBaseModel,
    add_special_tokens=(bool, False),
    **_ENCODING,
    **_CHAT_TEMPLATE,
    **_COMMON,
    messages=(Annotated[Sequence[_Conversation], Field(min_length=1)], ...),
)


def _is_message(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("role"), str)


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(map(_is_message, value))


def _input_as_messages(data: Any, fits: Any) -> Any:
    """vLLM's chat-in-`input` models: an `input` that holds chat messages (and no `messages`) is read as them."""
    if not isinstance(data, dict) or "messages" in data or "input" not in data or not fits(data["input"]):
        return data
    return {**data, "messages": data["input"]}


class EmbeddingChatInputRequest(EmbeddingChatRequest):
    input: list[_Message]

    @model_validator(mode="before")
    @classmethod
    def _input_messages(cls, data: Any) -> Any:
        return _input_as_messages(data, _is_conversation)


class EmbeddingBatchChatInputRequest(EmbeddingBatchChatRequest):
    input: Annotated[Sequence[_Conversation], Field(min_length=1)]

    @model_validator(mode="before")
    @classmethod
    def _input_messages(cls, data: Any) -> Any:
        return _input_as_messages(
            data, lambda v: isinstance(v, list) and bool(v) and all(map(_is_conversation, v))
        )


_EmbeddingRequest: TypeAdapter[Any] = TypeAdapter(
    EmbeddingCompletionRequest
    | EmbeddingChatRequest
    | EmbeddingBatchChatRequest
    | EmbeddingChatInputRequest
    | EmbeddingBatchChatInputRequest
)


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """A validated embeddings request: its inputs as token ids (one engine request each), in `data` order."""

    model: str  # the name answered: the served model's or an adapter's
    prompts: list[list[int]]
    from_text: tuple[bool, ...]  # which inputs were text (their pseudo ids are not checked against the vocab)
    encoding_format: str
    embed_dtype: str
    endianness: str
    request_id: str | None  # the body's `request_id` (vLLM's response id falls back to it)


# ---------------------------------------------------------------- validation
def _before_validators(body: Mapping[str, Any]) -> None:
    """Stage 1: vLLM's validators on the raw JSON, before any type check, in the order they run."""
    if "normalize" in body:
        raise vllm_error("Parameter `normalize` was removed; use `use_activation` instead.", "normalize")
    task = body.get("task")
    if isinstance(task, str) and task in _REMOVED_TASKS:
        raise vllm_error(_REMOVED_TASKS[task], "task")
    check_cache_salt(body)
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise ApiError(400, BOTH_CHAT_FLAGS)


def check_cache_salt(body: Mapping[str, Any]) -> None:
    """vLLM's `validate_cache_salt`, a "before" validator of every pooling request: it raises past pydantic, so
    a bad salt is a 400 BadRequestError naming the param, ahead of any type error."""
    salt = body.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise vllm_error("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(salt) > _CACHE_SALT_MAX or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        raise vllm_error(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
            "'\\\\', or NUL.",
            "cache_salt",
        )


def _param_of(loc: Sequence[Any]) -> str:
    """vLLM's `clean_loc_for_param`: the location without pydantic's bracketed or internal segments."""
    parts = [str(p) for p in ("body", *loc)]
    kept = [p for p in parts if not any(c in p for c in "[]{}()") and p.lower() not in _INTERNAL_LOC]
    return ".".join(kept or parts)


def union_error(exc: ValidationError) -> ApiError:
    """Stage 2: vLLM's answer to the union's validation errors (its `validation_exception_handler`)."""
    errors = []
    for e in exc.errors(include_url=False):
        error: dict[str, Any] = {
            "type": e["type"], "loc": _param_of(e["loc"]), "msg": e["msg"], "input": error_input(e["input"]),
        }  # fmt: skip
        if "ctx" in e:
            error["ctx"] = {k: str(v) if isinstance(v, Exception) else v for k, v in e["ctx"].items()}
        errors.append(error)
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:", *map(str, errors[:MAX_REPORTED_ERRORS])]
    if len(errors) > MAX_REPORTED_ERRORS:
        lines.append(f"...and {len(errors) - MAX_REPORTED_ERRORS} more {label}")
    return bad_shape(sanitize_message("\n  ".join(lines)), errors[0]["loc"])


def _prompts(req: Any) -> tuple[list[list[int]], tuple[bool, ...]]:
    """Stage 5's prompts: the inputs as token ids (text through the pseudo-tokenizer; `""` stays empty, for the
    engine's empty-prompt check), or the conversations rendered."""
    if isinstance(req, EmbeddingCompletionRequest):
        raw = req.input
        items: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not items:
            raise ApiError(400, NO_PROMPT)
        ids = [(text_ids(p) if p else []) if isinstance(p, str) else list(p) for p in items]
        return ids, tuple(isinstance(p, str) for p in items)
    conversations = [req.messages] if isinstance(req, EmbeddingChatRequest) else list(req.messages)
    out = []
    for conv in conversations:
        if not conv:
            raise ApiError(400, EMPTY_CONVERSATION)
        try:
            out.append(text_ids(render_chat(list(map(_plain_message, conv)), req.add_generation_prompt)))
        except TypeError as exc:
            raise ApiError(400, str(exc)) from None
    return out, tuple(True for _ in out)


def _plain_message(msg: Any) -> Mapping[str, Any]:
    """A validated message as the chat template reads it (a harmony Message: its author's role)."""
    if isinstance(msg, Message):
        text = "".join(str(part.get("text", "")) for part in msg.content)
        return {"role": msg.author.role.value, "content": text}
    return msg


def fit_prompt(ids: list[int], req: Any, max_model_len: int) -> list[int]:
    """`truncate_prompt_tokens` (-1: max_model_len) from the side vLLM's tokenizer cuts, then padding."""
    keep = req.truncate_prompt_tokens
    if keep is not None:
        keep = max_model_len if keep == -1 else keep
        ids = (ids[:keep] if req.truncation_side == "right" else ids[-keep:]) if keep else []
    if req.padding == "max_length" and ids and len(ids) < max_model_len:
        ids = ids + [0] * (max_model_len - len(ids))  # vLLM pads to the context with the pad id
    return ids


def parse_embeddings(
    body: Mapping[str, Any],
    served: str,
    max_model_len: int,
    vocab_size: int,
    adapters: Collection[str] = (),
) -> EmbedRequest:
    """Every check of the module docstring, in vLLM's order; raises ApiError (EngineInputError for stage 7)."""
    _before_validators(body)
    try:
        req = _EmbeddingRequest.validate_python(dict(body))
    except ValidationError as exc:
        raise union_error(exc) from None
    model = req.model or served
    if model != served and model not in adapters:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens > max_model_len:
        raise ApiError(400, TRUNCATE_OVER_CONTEXT)
    prompts, from_text = _prompts(req)
    prompts = [fit_prompt(ids, req, max_model_len) for ids in prompts]
    for ids, text in zip(prompts, from_text, strict=True):
        check_prompt_length(ids, text, max_model_len)
    if req.dimensions is not None:
        raise ApiError(
            400,
            f"Model '{served}' does not support Matryoshka embeddings; dimensions must be unset "
            f"(received dimensions={req.dimensions}).",
        )
    for ids, text in zip(prompts, from_text, strict=True):
        if not ids:
            raise EngineInputError(400, EMPTY_PROMPT)
        if not text:  # a text's pseudo ids are the simulator's own: only a client's ids are checked
            _check_vocabulary(ids, vocab_size)
    rid = getattr(req, "request_id", None)
    return EmbedRequest(model, prompts, from_text, req.encoding_format, req.embed_dtype, req.endianness, rid)


def _check_vocabulary(ids: Sequence[int], vocab_size: int) -> None:
    """vLLM's input processor: the most negative id if any (embedding ids are not refused below 0 by the
    request model, as completions' are), else the largest when it is past the vocabulary."""
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise EngineInputError(400, f"Token id {low if low < 0 else high} is out of vocabulary")


# ---------------------------------------------------------------- vectors
def embedding(seed: int, token_ids: Sequence[int], dim: int) -> np.ndarray:
    """The input's pseudo embedding: `dim` float32 standard-normal draws seeded by (seed, token ids), scaled
    to unit L2 norm (vLLM's default normalisation)."""
    key = zlib.crc32(np.asarray(token_ids, dtype="<i8").tobytes())
    rng = np.random.default_rng([seed & 0xFFFFFFFF, key, len(token_ids)])
    v = rng.standard_normal(dim)
    return (v / np.linalg.norm(v)).astype(np.float32)


def _fp8_table(exp_bits: int, man_bits: int, finite_only: bool) -> np.ndarray:
    """The value of every non-negative fp8 code (`bias` 2^(e−1) − 1); NaN where the code is NaN or infinity."""
    bias = (1 << (exp_bits - 1)) - 1
    codes = np.arange(1 << (exp_bits + man_bits), dtype=np.int64)
    exp, man = codes >> man_bits, codes & ((1 << man_bits) - 1)
    normal = (1 + man / (1 << man_bits)) * np.exp2(exp - bias)
    values = np.where(exp == 0, man / (1 << man_bits) * 2.0 ** (1 - bias), normal)
    top = exp == (1 << exp_bits) - 1
    special = (top & (man == (1 << man_bits) - 1)) if finite_only else top
    return np.where(special, np.nan, values)


_FP8 = {"fp8_e4m3": _fp8_table(4, 3, True), "fp8_e5m2": _fp8_table(5, 2, False)}


def _to_fp8(v: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Round to the nearest representable fp8 value (ties to the even code), saturating; one byte per value."""
    finite = np.nan_to_num(table, nan=np.inf)
    mag = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(finite, mag), 1, np.count_nonzero(np.isfinite(finite)) - 1)
    lo = hi - 1
    down, up = mag - finite[lo], finite[hi] - mag
    pick = np.where((down < up) | ((down == up) & (lo % 2 == 0)), lo, hi)
    pick = np.where(mag >= finite[np.isfinite(finite)].max(), np.count_nonzero(np.isfinite(finite)) - 1, pick)
    sign = (np.signbit(v).astype(np.int64)) << 7
    return (pick | sign).astype(np.uint8)


def _bfloat16_bits(v: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bit patterns, rounded to nearest even (torch's conversion)."""
    bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def encode_vector(v: np.ndarray, embed_dtype: str, endianness: str) -> bytes:
    """The vector's bytes as vLLM's binary encodings lay them out: `embed_dtype`, in `endianness` byte order."""
    if embed_dtype in _FP8:
        return _to_fp8(v, _FP8[embed_dtype]).tobytes()
    if embed_dtype == "bfloat16":
        raw = _bfloat16_bits(v)
    else:
        raw = v.astype(np.float16 if embed_dtype == "float16" else np.float32)
    order = sys.byteorder if endianness == "native" else endianness
    return raw.astype(raw.dtype.newbyteorder("<" if order == "little" else ">")).tobytes()


# ---------------------------------------------------------------- responses
def usage_info(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
        "prompt_tokens_details": None, "completion_tokens_details": None,
    }  # fmt: skip


def embeddings_body(
    rid: str, created: int, req: EmbedRequest, vectors: Sequence[np.ndarray], prompt_tokens: int
) -> dict[str, Any]:
    """vLLM's EmbeddingResponse (`float` or `base64`), keys in its order."""
    if req.encoding_format == "base64":
        data: list[Any] = [
            base64.b64encode(encode_vector(v, req.embed_dtype, req.endianness)).decode() for v in vectors
        ]
    else:
        data = [v.tolist() for v in vectors]
    return {
        "id": rid, "object": "list", "created": created, "model": req.model,
        "data": [{"index": i, "object": "embedding", "embedding": e} for i, e in enumerate(data)],
        "usage": usage_info(prompt_tokens),
    }  # fmt: skip


def embeddings_bytes(
    rid: str, created: int, req: EmbedRequest, vectors: Sequence[np.ndarray], prompt_tokens: int
) -> tuple[bytes, dict[str, str]]:
    """vLLM's binary answer (`bytes`, `bytes_only`): the vectors back to back, and for `bytes` the `metadata`
    header (JSON: id, created, model, each vector's dtype, byte order, byte range and shape, the usage)."""
    chunks = [encode_vector(v, req.embed_dtype, req.endianness) for v in vectors]
    if req.encoding_format == "bytes_only":
        return b"".join(chunks), {}
    items, start = [], 0
    for i, (chunk, v) in enumerate(zip(chunks, vectors, strict=True)):
        items.append({"index": i, "embed_dtype": req.embed_dtype, "endianness": req.endianness,
                      "start": start, "end": start + len(chunk), "shape": list(v.shape)})  # fmt: skip
        start += len(chunk)
    meta = {"id": rid, "created": created, "model": req.model, "data": items,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}  # fmt: skip
    return b"".join(chunks), {"metadata": json.dumps(meta)}
