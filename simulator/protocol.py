"""vLLM's OpenAI server surface, as the simulated worker speaks it: request parsing/validation and response JSON.

Validation follows vLLM 0.32 (its source — the request models in `entrypoints/openai/*/protocol.py`,
`renderers/params.py`, `sampling_params.py` — and the CPU build measured in `../shared/REAL_VLLM.md`), stage
by stage in vLLM's order, so a request with several faults gets vLLM's answer to the first one:

1. the request models' "before" validators, on the raw JSON values → 400 `BadRequestError` naming the param:
   chat `messages` that cannot be iterated (a number, null: no param), `continue_final_message` with
   `add_generation_prompt` (no param), `prompt` missing or `""`, `stream_options` without `stream`,
   `logprobs`/`top_logprobs`/`prompt_logprobs` not a number or below −1, `prompt_logprobs` with a stream,
   `top_logprobs` without `logprobs`, `response_format` json_schema without its schema, `tools` empty,
   `tool_choice` not a known value or given without `tools`, a message's `tool_calls` a number (no param);
2. chat `messages` as vLLM's message union types them (`_check_messages`: param
   `body.messages.<i>.ChatCompletionDeveloperMessageParam[.<field>]`), then the other field types, with the lax coercion of vLLM's pydantic models (`"true"`, `"yes"`, `1` are booleans, `"5"`
   and `5.0` integers; `stop: 5`, `top_k: 1.5`, `response_format: {"type": "nope"}` are refused) → 400
   `"type": "Bad Request"`, param the error's location (`body.<field>`); a body that is not JSON or not an
   object is refused the same way;
3. unknown model → 404 `NotFoundError`; then (completions) any `suffix` (no model the simulator serves renders
   fill-in-the-middle) and (chat) tool calls, which the simulator never makes, refused as by a
   vLLM without `--enable-auto-tool-choice`/`--tool-call-parser` (its default): `tools` with `tool_choice`
   auto (implied when absent), required or a named function → 400 in that server's words;
4. `max_tokens` (chat: `max_completion_tokens` when sent, else `max_tokens`) over max_model_len → 400 naming
   that field, then `truncate_prompt_tokens` over it; chat rendering: `continue_final_message` with the
   default `add_generation_prompt`, content parts (text only: a media part is refused by a text-only model,
   anything else fails validation; no param); no prompt at all (`prompt: []`, `messages: []`) → 400 with no
   param; prompts truncated to their last `truncate_prompt_tokens` tokens (first, with `truncation_side`
   "right"; -1: max_model_len, less one with `max_tokens` set);
5. a prompt over max_model_len → 400 `input_tokens` (plain JSON even for streams);
6. per prompt, `max_tokens` clamped to max_model_len − prompt (0 for a prompt that fills the context), then
   SamplingParams' checks: logit_bias keys that are no integers, n, penalties, temperature, top_p, top_k, min_p, max_tokens ≥ 1 (param
   `max_tokens`), min_tokens (no param), empty stop strings, n = 1 under greedy sampling (temperature 0);
7. the engine's checks (`EngineInputError`): at most 20 logprobs, then 20 prompt logprobs (echo asks for the
   sample's count), token ids of `logit_bias` and `stop_token_ids` in the vocabulary, `allowed_token_ids`
   not empty and in the vocabulary; an
   `X-data-parallel-rank` header's rank in [0, engines) (`data_parallel_rank 5 is out of range [0, 2).`,
   no param; `simulator.data_parallel`); then per prompt no
   empty prompt (`[[]]`, `[""]`: no param) and no token id outside the model's vocabulary (`Token id N is
   out of vocabulary`, N the prompt's largest; the catalog's `vocab_size`, else Llama-3's 128,256). vLLM
   runs these once a stream's response has begun: a stream gets them as HTTP 200 with one
   `data: {"error": ...}` event, then `data: [DONE]`.

Several sequences, as vLLM serves them: a completions batch of prompts (strings or token-id lists) and
`n` completions per prompt; choice `index` = prompt · n + completion, usage counts each prompt once and
every completion's tokens (`ApiRequest.sequences`). Refused (400, a clear message): `kv_transfer_params`
on a request of several sequences (vLLM's prefill answer carries one sequence's). Accepted, type-checked and
ignored: sampling parameters (temperature, top_p, seed, stop, stop_token_ids, …), response_format (by its
type only), echo, prompt_logprobs (answered null), skip_special_tokens, priority, use_beam_search and the
other vLLM fields of `_CompletionFields`/`_ChatFields`. `logprobs` (completions) and `logprobs`/`top_logprobs` (chat) are answered with
pseudo-values in vLLM's shape (`logprobs_body`, `tokens.pseudo_top_logprobs`), streamed and not. Typed as
vLLM types them and ignored: `tools` (with `tool_choice` none or null), `user`, `logit_bias`. Accepted and
ignored without a type check: a `json_schema` response format's schema.
"""

from __future__ import annotations

import email.message
import json
import math
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, Field, ValidationError

from simulator.tokens import VOCAB_SIZE, render_chat, text_token_ids

# vLLM's chat renderer on `messages: []` (chat, /tokenize) or a Responses `input: []` without instructions
EMPTY_CONVERSATION = "Cannot apply chat template to an empty conversation. Provide at least one message."

ModelT = TypeVar("ModelT", bound=BaseModel)


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


class EngineInputError(ApiError):
    """An error of vLLM's engine input checks (stage 7 of the module docstring: SamplingParams.verify, then
    the prompts' token ids). vLLM runs them when the request's output generator is first read, which for a
    stream is after its 200 response has started: a stream gets them as `data: {"error": ...}` then
    `data: [DONE]`, a plain request as its 400."""


def bad_shape(message: str, param: str | None = None) -> ApiError:
    """Malformed JSON or a field of the wrong type: vLLM (FastAPI/pydantic) answers these with type "Bad Request"
    and the error location as param (`body.<field>`, or `body.<byte offset>` for JSON that does not parse)."""
    return ApiError(400, message, "Bad Request", param)


def vllm_error(message: str, parameter: str | None = None, value: Any = None) -> ApiError:
    """A `VLLMValidationError` as vLLM's server answers it: 400 BadRequestError, `param` = its parameter, and
    `str()` of the exception as message, which appends ` (parameter=…, value=…)` for those that are set."""
    extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
    return ApiError(400, f"{message} ({', '.join(extras)})" if extras else message, param=parameter)


MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS
MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
MAX_COMPLETION_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
# vLLM's CompletionRequest default (OpenAI's legacy API); the gateway's estimate uses it too
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_SAMPLING_EPS = 1e-5  # SamplingParams: a temperature below it is greedy sampling

# ---------------------------------------------------------------- request fields
# The fields of vLLM 0.32's CompletionRequest / ChatCompletionRequest that the simulator reads or type-checks,
# with vLLM's annotations and defaults and in vLLM's field order (pydantic reports the first field's error
# first, and vLLM names that one as param). Validated in pydantic's default lax mode, as FastAPI validates
# vLLM's request bodies. Non-nullable fields (`ignore_eos`, `min_tokens`, completions' `n`, `request_id`)
# refuse `null` as vLLM does.
_TokenIds = list[Annotated[int, Field(ge=0)]]
_Stop = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None
_Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
_Seed = _Int64 | None
_Truncate = Annotated[int, Field(ge=-1, le=2**63 - 1)] | None


class _FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Tool(BaseModel):
    """vLLM's ChatCompletionToolsParam."""

    type: Literal["function"] = "function"
    function: _FunctionDefinition


class _NamedFunction(BaseModel):
    name: str


class _NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _NamedFunction


_ToolChoice = Literal["none", "auto", "required"] | _NamedToolChoice | None


class _StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _ResponseFormat(BaseModel):
    """vLLM's ResponseFormat (and its structural-tag variants, only by their type name)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]


class _CompletionFields(BaseModel):
    model: str | None = None
    prompt: _TokenIds | list[_TokenIds] | str | list[str] | None = None
    prompt_embeds: bytes | list[bytes] | None = None  # refused (as by a vLLM without --enable-prompt-embeds)
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    n: int = 1
    presence_penalty: float | None = None
    seed: _Seed = None
    stop: _Stop = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: _Truncate = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True
    response_format: _ResponseFormat | None = None
    priority: _Int64 = 0
    request_id: str = None  # type: ignore[assignment]  # absent → None (defaults are not validated); null refused
    kv_transfer_params: dict[str, Any] | None = None


class _ChatFields(BaseModel):
    # `messages` (vLLM's first field) is checked by `_check_messages`, before these
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, BeforeValidator(lambda v: 0 if v is None else v)] = 0  # null means absent
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    response_format: _ResponseFormat | None = None
    seed: _Seed = None
    stop: _Stop = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice = "none"
    parallel_tool_calls: bool | None = True
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: _Truncate = None
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    priority: _Int64 = 0
    request_id: str = None  # type: ignore[assignment]  # absent → None (defaults are not validated); null refused
    kv_transfer_params: dict[str, Any] | None = None


_Fields = _CompletionFields | _ChatFields

# pydantic-core's names for union branches and wrappers in an error's `loc`: vLLM drops them from the param
# (`clean_loc_for_param`), so `stop: 5` is `body.stop`, not `body.stop.str`.
_INTERNAL_LOC = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set",
    "frozenset", "complex", "none", "nonetype",
})  # fmt: skip


def _param_of(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in ("body", *loc)]
    return ".".join(p for p in parts if not any(c in p for c in "[]{}()") and p.lower() not in _INTERNAL_LOC)


def error_input(value: Any) -> str:
    """An error's `input` as vLLM's `_summarize_error_input` renders it: containers described, anything else
    as its string (`5` → `'5'`, null → `'None'`), cut after 200 characters."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def _validate_fields(body: Mapping[str, Any], chat: bool) -> _Fields:
    return validated(_ChatFields if chat else _CompletionFields, body)


def validated(
    model: type[ModelT], body: Mapping[str, Any], union_missing: str | None = None, union_first: bool = False
) -> ModelT:
    """`body` validated as `model`, or vLLM's 400 for FastAPI's validation errors: "<n> validation
    error(s):" then one line per error (at most 10), param the first error's location. `union_missing`: the
    required field of the union's other request model (vLLM's /tokenize), reported missing beside this
    model's errors — before them when that model comes first in the union (`union_first`) — as pydantic
    reports a union none of whose members validated."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = []
        for e in exc.errors(include_url=False):
            error = {
                "type": e["type"],
                "loc": _param_of(e["loc"]),
                "msg": e["msg"],
                "input": error_input(e["input"]),
            }
            if (
                "ctx" in e
            ):  # FastAPI keeps pydantic's context (a literal's expected values, a bound); text of an error
                error["ctx"] = {k: str(v) if isinstance(v, Exception) else v for k, v in e["ctx"].items()}
            errors.append(error)
    if union_missing is not None:
        missing = {"type": "missing", "loc": f"body.{union_missing}", "msg": "Field required"}
        missing["input"] = error_input(dict(body))
        errors = [missing, *errors] if union_first else [*errors, missing]
    head = f"{len(errors)} validation {'error' if len(errors) == 1 else 'errors'}:"
    raise bad_shape("\n  ".join([head, *map(str, errors[:10])]), errors[0]["loc"])


def _before_validators(body: Mapping[str, Any], chat: bool) -> None:
    """vLLM's request models' `mode="before"` validators, on the raw JSON values: they run before any field is
    type-checked (so they win over a type error), in the order pydantic runs them (the last defined first),
    and they raise VLLMValidationError, which vLLM answers as BadRequestError naming the param."""
    if chat:
        _check_logprobs(body, "top_logprobs")
        _check_tools(body)
    else:
        prompt = body.get("prompt")
        if (
            isinstance(prompt, list)
            and prompt
            and not isinstance(prompt[0], int)  # vLLM's is_list_of looks at the first item only
            and len(prompt) > MAX_COMPLETION_PROMPTS
        ):
            raise vllm_error(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_COMPLETION_PROMPTS}. "
                "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
                "prompt",
            )
        embeds = body.get("prompt_embeds")
        if (prompt is None or prompt == "") and (embeds is None or embeds == []):
            raise vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    # The raw values' truthiness, as vLLM tests them: `stream: "false"` passes here (a non-empty string) and
    # is then coerced to False; `stream: 0` does not pass.
    if body.get("stream_options") and not body.get("stream"):
        raise vllm_error("Stream options can only be defined when `stream=True`.", "stream_options")
    if not chat:
        _check_logprobs(body, "logprobs")
    rf = body.get("response_format")
    if isinstance(rf, Mapping) and rf.get("type") == "json_schema" and rf.get("json_schema") is None:
        raise vllm_error(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            "response_format",
        )


def _check_tools(body: Mapping[str, Any]) -> None:
    """vLLM 0.32's checks of `tools` / `tool_choice` on the raw values (its request model's validators)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise vllm_error(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are '
            "supported.",
            "tool_choice",
        )
    if isinstance(tools, list) and not tools:
        raise vllm_error(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    if tools is None and choice is not None and choice != "none":
        raise vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice")


def _refuse_tool_calls(body: Mapping[str, Any], f: _ChatFields) -> None:
    """The simulator makes no tool calls, as a vLLM started without `--enable-auto-tool-choice` and
    `--tool-call-parser` (its default): tools with `tool_choice` auto (also implied by tools sent without a
    choice), required or a named function are refused with that server's words; `none` (or null) is served
    as plain text."""
    if not f.tools:
        return
    choice = f.tool_choice if "tool_choice" in body else "auto"
    if choice == "auto":
        raise ApiError(
            400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
    if choice == "required":
        raise ApiError(400, 'tool_choice="required" requires --tool-call-parser to be set')
    if isinstance(choice, _NamedToolChoice):
        raise ApiError(
            400, f'tool_choice=function "{choice.function.name}" requires --tool-call-parser to be set'
        )


def _refuse_suffix(f: _CompletionFields) -> None:
    """vLLM renders `suffix` only for a model with fill-in-the-middle rendering (none that the simulator
    serves): any suffix is refused, in the words of vLLM's completion renderer."""
    if f.suffix is None or f.prompt == []:  # no prompt: vLLM renders none, then refuses the empty batch
        return
    if f.echo:
        message = "Echo is unsupported with suffix."
    elif f.truncate_prompt_tokens is not None:
        message = "suffix is not supported with truncate_prompt_tokens"
    elif isinstance(f.prompt, str) or (
        isinstance(f.prompt, list) and all(isinstance(p, str) for p in f.prompt)
    ):
        message = "suffix is only supported for models with FIM completion rendering"
    else:
        message = "suffix requires text prompt input for FIM completion rendering"
    raise ApiError(400, message, param="suffix")


def _check_logprobs(body: Mapping[str, Any], name: str) -> None:
    """vLLM's `check_logprobs` for `prompt_logprobs` and the count field (`logprobs` of completions,
    `top_logprobs` of chat), in its order: both types, then prompt_logprobs (not with a stream; at least
    −1), then the count."""
    for field in ("prompt_logprobs", name):
        value = body.get(field)
        # vLLM's guard: a string would fail the comparisons below
        if value is not None and not isinstance(value, (int, float)):
            raise vllm_error(f"`{field}` must be an integer.", field, value)
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if body.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            raise vllm_error("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt_logprobs < 0 and prompt_logprobs != -1:
            raise vllm_error(
                "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", prompt_logprobs
            )
    count = body.get(name)
    if count is None:
        return
    # −1 asks for the whole vocabulary (then refused by the engine as more than MAX_LOGPROBS)
    if count < 0 and count != -1:
        raise vllm_error(f"`{name}` must be a positive value or -1.", name, count)
    if name == "top_logprobs" and (count == -1 or count > 0) and not body.get("logprobs"):
        raise vllm_error("when using `top_logprobs`, `logprobs` must be set to true.", name)


# ---------------------------------------------------------------- the request
@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    model: str  # the served name, or the LoRA adapter's the request names: the answer's `model`
    prompts: list[list[int]]  # token ids per prompt: one, or a completions batch's several ([] for "")
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
    from_text: tuple[bool, ...] = ()  # per prompt: given as text (chat, a string), not token ids
    request_id: str | None = None  # the body's `request_id`, vLLM's response id when no X-Request-Id header
    params: _Fields | None = None  # every validated field, for the sampling checks (`check_request`)
    echo_only: bool = False  # completions' echo with max_tokens 0: one token sampled, a stream of no event

    @property
    def sequences(self) -> int:
        """What vLLM decodes for it: prompts × n, each sequence its own engine request."""
        return len(self.prompts) * self.n

    @property
    def logprobs(self) -> int | None:
        """Top log-probabilities per output token the answer carries; None: no `logprobs` object. Chat's
        `top_logprobs` when `logprobs` is true; completions' `logprobs` (0: the sampled token's alone)."""
        f = self.params
        if isinstance(f, _ChatFields):
            return f.top_logprobs if f.logprobs else None
        return f.logprobs if f is not None else None


UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"  # vLLM's own words


def is_json_media_type(content_type: str | None) -> bool:
    """vLLM's check on its POST routes: the media type (before any `;` parameter) is exactly
    `application/json`, case-insensitively; no header, `text/plain` or a form encoding (curl `-d` without
    `-H`) are refused with 400, whatever the body holds. (The gateway's check, which also takes
    `application/json ;charset=utf-8`; vLLM's own does not strip: `parse_body`.)"""
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


_PATHS = (
    re.compile(r" at 0x[0-9a-fA-F]+>"),
    re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'),
    re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"),
    re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"),
)


def sanitize_message(message: str) -> str:
    """vLLM's `sanitize_message` (entrypoints/serve/exception_handling/utils.py), which every error body's
    message goes through: object addresses, traceback lines and file paths under /home, /tmp, ... (or any
    path ending in a file extension) become `>`, nothing and `<path>`."""
    message = _PATHS[0].sub(">", message)
    message = _PATHS[1].sub("", message)
    message = _PATHS[2].sub("<path>", message)
    message = _PATHS[3].sub("<path>", message)
    return message.strip()


def _validation_error(errors: Sequence[dict[str, Any] | str], param: str | None) -> ApiError:
    """vLLM's answer to FastAPI's RequestValidationError (`validation_exception_handler`)."""
    head = f"{len(errors)} validation {'error' if len(errors) == 1 else 'errors'}:"
    return bad_shape(sanitize_message("\n  ".join([head, *map(str, errors)])), param)


def parse_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """A POST body as vLLM's FastAPI routes read it (`Depends(validate_json_request)` and a pydantic body),
    in FastAPI's order, up to the JSON object the request model is validated from; or the ApiError vLLM
    answers (400 "Bad Request", param the error's location): `parse_json_body`'s checks, then a JSON value
    that is no object cannot give fields."""
    body = parse_json_body(raw, content_type)
    if not isinstance(body, dict):
        err = {"type": "model_attributes_type", "loc": "body",
               "msg": "Input should be a valid dictionary or object to extract fields from",
               "input": error_input(body)}  # fmt: skip
        raise _validation_error([err], "body")
    return body


def parse_json_body(raw: bytes, content_type: str | None) -> Any:
    """The JSON value of a POST body, in FastAPI's order, for a route whose body model is a union (each member
    then refuses a value that is no object on its own: one error per member):
    1. a non-empty body with a JSON content type (application/json or */*+json) is parsed: malformed JSON
       is a `json_invalid` error at `body.<byte offset>`, undecodable bytes FastAPI's "There was an error
       parsing the body";
    2. `validate_json_request`: a media type (before any `;`, not stripped) other than `application/json`;
    3. no body (or `null`) is `body` missing."""
    body: Any = None
    if raw and content_type:
        msg = email.message.Message()
        msg["content-type"] = content_type
        subtype = msg.get_content_subtype()
        if msg.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json")):
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as exc:
                err = {"type": "json_invalid", "loc": f"body.{exc.pos}", "msg": "JSON decode error",
                       "input": error_input({}), "ctx": {"error": exc.msg}}  # fmt: skip
                raise _validation_error([err], err["loc"]) from None
            except ValueError:  # bytes that are no UTF-8/16/32: FastAPI's HTTPException, its phrase as type
                raise bad_shape("There was an error parsing the body") from None
    if (content_type or "").lower().split(";", 1)[0] != "application/json":
        raise _validation_error([UNSUPPORTED_MEDIA_TYPE], None)
    if body is None:
        raise _validation_error([{"type": "missing", "loc": "body", "msg": "Field required",
                                  "input": error_input(None)}], "body")  # fmt: skip
    return body


# vLLM's answer (its tokenizer's words) to text that cannot be encoded as UTF-8: a lone surrogate (`"\ud800"`)
UNENCODABLE_TEXT = "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"


def text_ids(text: str) -> list[int]:
    try:
        return text_token_ids(text)
    except UnicodeEncodeError:
        raise ApiError(400, UNENCODABLE_TEXT) from None


# vLLM's renderer, on continue_final_message with add_generation_prompt left at its default (true)
CONTINUE_WITH_GENERATION_PROMPT = (
    "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you "
    "want the model to continue the final message, and add_generation_prompt when you want to add a header "
    "that will prompt it to start a new assistant message instead."
)


def check_generation_prompt(body: Mapping[str, Any]) -> None:
    """vLLM's `check_generation_prompt` before-validator (chat and /tokenize's chat form), on the raw values."""
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def _messages_before(body: Mapping[str, Any]) -> None:
    """vLLM's chat before-validators that touch `messages`, first of all (the last defined): its system-message
    check iterates `messages` (a number or null fails there, as Python's TypeError), then the generation-prompt
    check on the raw values."""
    messages = body.get("messages", [])
    if messages is None or isinstance(messages, (int, float)):  # bool is an int
        raise ApiError(400, f"'{type(messages).__name__}' object is not iterable")
    check_generation_prompt(body)


def _messages_after(body: Mapping[str, Any]) -> None:
    """vLLM's last chat before-validator (`_normalize_messages_before`): a message's `tool_calls` that is not
    a list is made one with `list()`, which fails on a number (a string becomes its characters)."""
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        calls = msg.get("tool_calls") if isinstance(msg, Mapping) else None
        if calls is not None and isinstance(calls, (int, float)):
            raise ApiError(400, f"'{type(calls).__name__}' object is not iterable")


_FIRST_MESSAGE_TYPE = "ChatCompletionDeveloperMessageParam"  # the first of vLLM's message union


def _check_messages(body: Mapping[str, Any]) -> None:
    """`messages` as pydantic validates vLLM's first field: a list, each item one of the message types of its
    union; the last of which takes any string role, an optional string or iterable content and an optional
    string name. The first message that none fits is reported with the first type's first error (its fields:
    content, role, name), as vLLM names it: `body.messages.<i>.ChatCompletionDeveloperMessageParam[.<field>]`.
    Content parts are validated lazily, when the messages are rendered (`_check_content_parts`)."""
    if "messages" not in body:
        raise bad_shape("1 validation error: messages: Field required", "body.messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise bad_shape("1 validation error: messages: Input should be a valid list", "body.messages")
    for i, msg in enumerate(messages):
        where = f"body.messages.{i}.{_FIRST_MESSAGE_TYPE}"
        if not isinstance(msg, Mapping):
            raise bad_shape("messages: Input should be a valid dictionary", where)
        content, role, name = msg.get("content"), msg.get("role"), msg.get("name")
        content_ok = "content" not in msg or isinstance(content, (str, list, dict))
        name_ok = name is None or isinstance(name, str)
        call_id = msg.get("tool_call_id")
        calls = msg.get("tool_calls")
        if isinstance(
            calls, (str, dict)
        ):  # `_normalize_messages_before` made it a list (its characters, keys)
            calls = list(calls)
        calls_ok = calls is None or (
            isinstance(calls, list)
            and all(isinstance(c, Mapping) and isinstance(c.get("function"), Mapping) for c in calls)
        )
        custom_content_ok = "content" not in msg or isinstance(
            content, (str, list)
        )  # an object is refused there
        if (
            custom_content_ok
            and isinstance(role, str)
            and name_ok
            and calls_ok
            and (call_id is None or isinstance(call_id, str))
        ):
            continue  # vLLM's custom message type takes it
        if role in ("developer", "system", "user") and "content" in msg and content_ok and name_ok:
            continue  # its own type takes it (other fields ignored)
        if role == "assistant" and (content_ok or content is None) and name_ok and calls_ok:
            continue  # the assistant type: content optional and nullable, tool_call_id ignored
        if not ("content" in msg and content_ok):
            raise bad_shape(
                "messages: content: Field required or not a string or iterable", f"{where}.content"
            )
        if role != "developer":
            raise bad_shape("messages: role: Input should be 'developer'", f"{where}.role")
        raise bad_shape("messages: name: Input should be a valid string", f"{where}.name")


_STANDARD_ROLES = ("developer", "system", "user", "assistant", "tool", "function")
_MEDIA_PARTS = ("image_url", "input_audio", "audio_url", "video_url", "image_embeds", "image_pil", "file")


def _check_content_parts(messages: Sequence[Mapping[str, Any]], model: str) -> None:
    """Content parts, validated as vLLM renders the messages (after the max_tokens check; as measured on
    0.32). vLLM parses the parts itself for a message of a role of its own, or with a valid text part:
    a string part is text, a part without `type` is refused naming `type`, `text` parts need no text, an
    unknown type is refused. Otherwise (one part, or a part that is no object) pydantic's lazy validation of
    the part union checks them: text parts need their text, anything else fails. Either way a media part is
    refused by a text-only model (all the simulator serves). No param but `type`."""
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, (list, dict)):
            continue
        parts = list(content)
        own = msg.get("role") not in _STANDARD_ROLES or any(
            isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in parts
        )
        for part in parts:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in _MEDIA_PARTS and (own or part.get(kind)):
                raise ApiError(400, f"{model} is not a multimodal model")
            if own:
                if isinstance(part, str) or kind == "text":
                    continue
                if kind is None:
                    raise vllm_error("Missing 'type' field in multimodal part.", "type")
                raise ApiError(400, f"Unsupported chat content part type: {kind!r}.")
            if kind == "text" and isinstance(part.get("text"), str):
                continue
            raise ApiError(400, "validation errors for ValidatorIterator: a content part of no known type")


def _chat_prompt(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> list[int] | None:
    """The rendered messages' token ids; None for an empty list (refused after the max_tokens check, where
    vLLM's renderer fails on it)."""
    if not messages:
        return None
    try:
        return text_ids(render_chat(messages, add_generation_prompt))
    except TypeError as exc:
        raise bad_shape(f"messages: {exc}", "body.messages") from None


def _completion_prompts(prompt: Any) -> tuple[list[list[int]], tuple[bool, ...]]:
    """A validated completions prompt (a string, token ids, or a batch of either) as token ids per prompt,
    and which were text. An empty string or token list is kept as [] for the engine check (vLLM tokenises
    "" to nothing and refuses the empty prompt in its input processor, after the sampling checks)."""
    if isinstance(prompt, str):
        return [text_ids(prompt)], (True,)
    if not prompt:  # `prompt: []`: vLLM's renderer gets no prompt at all
        raise ApiError(400, "You must pass at least one prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)], (False,)
    return (
        [(text_ids(p) if p else []) if isinstance(p, str) else list(p) for p in prompt],
        tuple(isinstance(p, str) for p in prompt),
    )


def parse_request(
    body: Mapping[str, Any],
    chat: bool,
    served: str,
    max_model_len: int | None = None,
    adapters: Collection[str] = (),
) -> ApiRequest:
    """Stages 1–4 of the module docstring (the checks before any prompt's length); raises ApiError. Without
    `max_model_len` the max_tokens-over-context check is left out. `check_request` does the rest. `model` may
    also name one of the LoRA `adapters` (`ApiRequest.model` is then its name, the answer's `model`)."""
    if chat:
        _messages_before(body)
    _before_validators(body, chat)
    if chat:
        _messages_after(body)
        _check_messages(body)  # `messages` is the chat model's first field
    f = _validate_fields(body, chat)
    model = f.model or served  # vLLM serves an empty or absent name as its (only) served model
    if model != served and model not in adapters:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    if isinstance(f, _ChatFields):
        _refuse_tool_calls(body, f)
    else:
        _refuse_suffix(f)
    # vLLM's TokenizeParams check, named after the field the client sent (`is not None`: 0 counts as sent)
    if isinstance(f, _ChatFields) and f.max_completion_tokens is not None:
        max_tokens, field = f.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field = f.max_tokens, "max_tokens"
    if not chat and max_tokens is None:  # completions: null means the default, 16 (vLLM's before-validator)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    bounded = bool(max_tokens)  # TokenizeParams' max_output_tokens (chat: the bound sent, else 0)
    # vLLM's "echo without generation": completions' echo with max_tokens 0 samples one token (counted in the
    # usage, finish_reason length) and a stream of it sends no event, only [DONE]
    echo_only = isinstance(f, _CompletionFields) and bool(f.echo) and max_tokens == 0
    if max_model_len is not None and max_tokens is not None and max_tokens > max_model_len:
        raise vllm_error(
            f"{field}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            field,
            max_tokens,
        )
    truncate = f.truncate_prompt_tokens
    if max_model_len is not None and truncate is not None and truncate > max_model_len:
        raise vllm_error(
            f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = {max_model_len}. "
            "Please request a smaller truncation size.",
            "truncate_prompt_tokens",
            truncate,
        )
    if isinstance(f, _ChatFields):  # vLLM's renderer
        if f.continue_final_message and f.add_generation_prompt:
            raise ApiError(400, CONTINUE_WITH_GENERATION_PROMPT)
        _check_content_parts(body["messages"], served)  # vLLM names the base model, adapter or not
        chat_ids = _chat_prompt(body["messages"], f.add_generation_prompt)
        if chat_ids is None:
            raise ApiError(400, EMPTY_CONVERSATION)  # vLLM names no param
        prompts, from_text = [chat_ids], (True,)
    else:
        if f.prompt_embeds:  # vLLM's renderer loads them before the prompt, and only with the flag
            raise vllm_error(
                "You must set `--enable-prompt-embeds` to input `prompt_embeds`.", "prompt_embeds"
            )
        prompts, from_text = _completion_prompts(f.prompt)
    if truncate is not None and (truncate >= 0 or max_model_len is not None):
        # vLLM's TokenizeParams: -1 is max_model_len, less the token a request with an output bound keeps back
        # for it; a generation's tokenizer keeps the last tokens unless `truncation_side` is "right"; 0 none
        keep = truncate if truncate >= 0 else max_model_len - bounded  # type: ignore[operator]
        right = f.truncation_side == "right"
        prompts = [ids[:keep] if right else ids[len(ids) - keep :] for ids in prompts]
    n = 1 if f.n is None else f.n
    kvp = f.kv_transfer_params
    if kvp and len(prompts) * max(n, 1) > 1:
        raise ApiError(
            400,
            "kv_transfer_params applies to one sequence: the simulated worker refuses it with n > 1 or a batch "
            "of prompts (vLLM's prefill answer carries one sequence's blocks).",
            param="kv_transfer_params",
        )
    opts = f.stream_options
    include_usage = bool(opts and opts.include_usage)
    return ApiRequest(
        chat, model, prompts, max_tokens, f.min_tokens, f.ignore_eos, bool(f.stream), include_usage,
        dict(kvp) if kvp else None, include_usage and bool(opts and opts.continuous_usage_stats), n, from_text,
        f.request_id, f, echo_only,
    )  # fmt: skip


def check_prompt_length(ids: list[int], text: bool, max_model_len: int) -> None:
    """vLLM's refusal of a prompt over the context (`input_tokens`), for completions, chat and embeddings.
    It tokenises text with max_length = max_model_len + 1, so it counts at most that many ("at least")."""
    count = min(len(ids), max_model_len + 1) if text else len(ids)
    if count > max_model_len:
        at_least = "at least " if count == max_model_len + 1 else ""
        raise vllm_error(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{at_least}{count} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.",
            "input_tokens",
            count,
        )


def check_request(
    api: ApiRequest,
    max_model_len: int,
    vocab_size: int = VOCAB_SIZE,
    data_parallel_rank: int | None = None,
    data_parallel_size: int = 1,
) -> list[int]:
    """Stages 5–7 of the module docstring: each prompt's length, then per prompt vLLM's SamplingParams checks
    with max_tokens clamped to the room the prompt leaves, then the engine's (the `X-data-parallel-rank`
    header's rank against the server's engines, token ids from 0 to `vocab_size` − 1). Returns max_tokens
    per prompt."""
    for ids, text in zip(api.prompts, api.from_text or [False] * len(api.prompts), strict=True):
        check_prompt_length(ids, text, max_model_len)
    out = []
    for ids in api.prompts:
        room = max_model_len - len(ids)  # vLLM's get_max_tokens: 0 when the prompt fills the context
        max_tokens = room if api.max_tokens is None else min(room, api.max_tokens)
        if api.echo_only:
            max_tokens = 1
        if api.params is not None:
            _check_sampling(api, api.params, max_tokens)
        out.append(max_tokens)
    if api.params is not None:
        _check_engine(api.params, vocab_size)
    check_data_parallel_rank(data_parallel_rank, data_parallel_size)
    # vLLM's input processor, prompt by prompt: empty, then out of the vocabulary (a text's pseudo ids are the
    # simulator's own, from Llama-3's vocabulary whatever the model: only a client's ids are checked)
    for ids, text in zip(api.prompts, api.from_text or [False] * len(api.prompts), strict=True):
        if not ids:
            raise EngineInputError(400, "The decoder prompt cannot be empty")
        if not text and max(ids) >= vocab_size:
            raise EngineInputError(400, f"Token id {max(ids)} is out of vocabulary")
    return out


def check_data_parallel_rank(rank: int | None, size: int) -> None:
    """vLLM's input processor, after the sampling parameters and before the prompt: a rank named by
    `X-data-parallel-rank` must be one of the server's engines, also on a server of one engine (no param)."""
    if rank is not None and not 0 <= rank < size:
        raise EngineInputError(400, f"data_parallel_rank {rank} is out of range [0, {size}).")


def _check_sampling(api: ApiRequest, f: _Fields, max_tokens: int) -> None:
    """SamplingParams' `_verify_args` then its greedy check, in vLLM 0.32's order, messages and params
    (most name none). The simulator ignores the values, but a request vLLM refuses is refused here too."""
    _logit_bias_ids(f)  # SamplingParams.from_optional converts its keys before any check
    n = api.n
    if n < 1:
        raise vllm_error(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise vllm_error(
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable."
        )
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(f, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise vllm_error(f"{name} must be in [-2, 2], got {v}.")
    if (v := f.repetition_penalty) is not None:
        if not math.isfinite(v):
            raise vllm_error(f"repetition_penalty must be a finite number, got {v}.")
        if v <= 0.0:
            raise vllm_error(f"repetition_penalty must be greater than zero, got {v}.")
    temperature = 1.0 if f.temperature is None else f.temperature  # vLLM's default
    if not math.isfinite(temperature):
        raise vllm_error(
            f"temperature must be a finite number, got {temperature}.", "temperature", temperature
        )
    if temperature < 0.0:
        raise vllm_error(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if temperature > 2.0:
        raise vllm_error(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    if (v := f.top_p) is not None and not 0.0 < v <= 1.0:
        raise vllm_error(f"top_p must be in (0, 1], got {v}.", "top_p", v)
    if (k := f.top_k) is not None and k < -1:  # -1 and 0 both disable
        raise vllm_error(f"top_k must be 0 (disable), or at least 1, got {k}.")
    if (v := f.min_p) is not None and not 0.0 <= v <= 1.0:
        raise vllm_error(f"min_p must be in [0, 1], got {v}.")
    if max_tokens < 1:
        raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if api.min_tokens < 0:
        raise vllm_error(f"min_tokens must be greater than or equal to 0, got {api.min_tokens}.")
    if api.min_tokens > max_tokens:
        raise vllm_error(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {api.min_tokens}."
        )
    stop = [f.stop] if isinstance(f.stop, str) else f.stop or []
    if any(not s for s in stop):
        raise vllm_error("stop cannot contain an empty string.")
    if temperature < _SAMPLING_EPS and n > 1:  # greedy sampling would give n copies of one answer
        raise vllm_error(f"n must be 1 when using greedy sampling, got {n}.")


def _engine_error(message: str, parameter: str, value: Any) -> EngineInputError:
    err = vllm_error(message, parameter, value)
    return EngineInputError(err.status, err.message, err.type, err.param)


def _check_engine(f: _Fields, vocab_size: int) -> None:
    """SamplingParams.verify, the engine's first input check, after every prompt's SamplingParams: the
    logprobs counts (sample, then prompt: echo asks for the prompt's as many as the sample's), then the
    token ids of logit_bias and stop_token_ids, each within the vocabulary, then allowed_token_ids (not
    empty, each within the vocabulary)."""
    if isinstance(f, _ChatFields):  # chat asks for top_logprobs only with logprobs true
        sample, prompt = (f.top_logprobs if f.logprobs else None), f.prompt_logprobs
        if prompt is None and f.echo:
            prompt = f.top_logprobs
    else:  # completions' logprobs is the count itself
        sample, prompt = f.logprobs, f.prompt_logprobs
        if prompt is None and f.echo:
            prompt = f.logprobs
    for requested, param, what in ((sample, "logprobs", "sample"), (prompt, "prompt_logprobs", "prompt")):
        if requested:
            if requested == -1:
                requested = vocab_size
            if requested > MAX_LOGPROBS:
                raise _engine_error(
                    f"Requested {what} logprobs of {requested}, which is greater than max allowed: {MAX_LOGPROBS}",
                    param,
                    requested,
                )
    for param, ids in (("logit_bias", _logit_bias_ids(f)), ("stop_token_ids", f.stop_token_ids or [])):
        invalid = [i for i in ids if i < 0 or i >= vocab_size]
        if invalid:
            raise _engine_error(
                f"token_id(s) {invalid} in {param} contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
                param,
                invalid,
            )
    allowed = f.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise _engine_error("allowed_token_ids is not None and empty!", "allowed_token_ids", allowed)
        invalid = [i for i in allowed if i < 0 or i >= vocab_size]
        if invalid:
            raise _engine_error(
                "allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids", invalid
            )


def _logit_bias_ids(f: _Fields) -> list[int]:
    """logit_bias's keys as token ids, as SamplingParams converts them (before its own checks); a key `int()`
    refuses is a 400 naming logit_bias."""
    if not f.logit_bias:
        return []
    ids, invalid = [], []
    for key in f.logit_bias:
        try:
            ids.append(int(key))
        except ValueError:
            invalid.append(key)
    if invalid:
        raise vllm_error(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}",
            "logit_bias",
            invalid,
        )
    return ids


# ------------------------------------------------------------------ responses
def logprobs_body(
    chat: bool, tops: Sequence[Sequence[tuple[str, float]]], k: int, offset: int = 0
) -> dict[str, Any]:
    """A choice's `logprobs` object for its tokens, in vLLM's shape. `tops`: per token its most likely
    candidates, the sampled token first (`tokens.pseudo_top_logprobs`, max(1, k) of them); `offset`: the
    characters of the choice's text before these tokens (a stream's chunks continue it).

    Completions: parallel lists, `top_logprobs` a dict of the sampled token and the top k (the sampled one
    alone for k = 0). Chat: one entry per token with UTF-8 `bytes`; its `top_logprobs` are the first k of
    the sampled-first candidates, as vLLM 0.32 lists them ([] for k = 0)."""
    if chat:
        return {
            "content": [
                {
                    "token": top[0][0],
                    "logprob": top[0][1],
                    "bytes": list(top[0][0].encode()),
                    "top_logprobs": [
                        {"token": w, "logprob": lp, "bytes": list(w.encode())} for w, lp in top[:k]
                    ],
                }
                for top in tops
            ]
        }
    offsets = []
    for top in tops:
        offsets.append(offset)
        offset += len(top[0][0])
    return {
        "text_offset": offsets,
        "token_logprobs": [top[0][1] for top in tops],
        "tokens": [top[0][0] for top in tops],
        "top_logprobs": [dict(top) for top in tops],
    }


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }


Choice = tuple[str, str, dict[str, Any] | None]  # text, finish reason, `logprobs` object (None: not asked)


def completion_body(
    rid: str,
    model: str,
    created: int,
    choices: list[Choice],
    prompt: int,
    completion: int,
    kvp: Any,
    fingerprint: str | None,
) -> dict[str, Any]:
    """`choices`: one per sequence, in index order; `fingerprint`: the server's `system_fingerprint`."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": None,
             "prompt_logprobs": None}
            for i, (text, finish, lp) in enumerate(choices)
        ],
        "system_fingerprint": fingerprint,
        "usage": usage(prompt, completion),
        "kv_transfer_params": kvp,
    }  # fmt: skip


def chat_body(
    rid: str,
    model: str,
    created: int,
    choices: list[Choice],
    prompt: int,
    completion: int,
    kvp: Any,
    fingerprint: str | None,
) -> dict[str, Any]:
    """`choices`: one per sequence, in index order; `fingerprint`: the server's `system_fingerprint`."""
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
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": None,
            }
            for i, (text, finish, lp) in enumerate(choices)
        ],
        "system_fingerprint": fingerprint,
        "usage": usage(prompt, completion),
        "prompt_logprobs": None,
        "kv_transfer_params": kvp,
    }


def _continuous_usage(so_far: tuple[int, int] | None, chat: bool = False) -> str:
    """`,"usage":{...}` for a chunk of a stream with continuous usage: vLLM sets the three counts, and a chat
    chunk's usage also carries `"completion_tokens_details": null` (a completions chunk's does not)."""
    if so_far is None:
        return ""
    prompt, completion = so_far
    details = ',"completion_tokens_details":null' if chat else ""
    return (
        f',"usage":{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
        f'"completion_tokens":{completion}{details}}}'
    )


class ChunkWriter:
    """Server-sent-event lines of one stream: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`.

    `fingerprint` (the server's `system_fingerprint`) goes where vLLM 0.32 puts it: on the usage event when
    the client asked for usage (`include_usage`), else on each choice's last event (its finish_reason's)."""

    __slots__ = (
        "_fingerprint_on_finish",
        "_fingerprint_on_usage",
        "_head",
        "_tail",
        "chat",
        "created",
        "model",
        "rid",
    )

    def __init__(
        self, rid: str, model: str, chat: bool, fingerprint: str | None, include_usage: bool
    ) -> None:
        self.rid, self.model, self.chat = rid, model, chat
        named = "" if fingerprint is None else f',"system_fingerprint":{json.dumps(fingerprint)}'
        self._fingerprint_on_usage = named if include_usage else ""
        self._fingerprint_on_finish = "" if include_usage else named
        self.created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        # The constant head of every chunk, serialised once: a stream writes one chunk per token.
        self._head = f'data: {{"id":{json.dumps(rid)},"object":"{obj}","created":{self.created},"model":{json.dumps(model)},'
        self._tail = "}\n\n"

    def role(self, usage_so_far: tuple[int, int] | None = None, index: int = 0) -> str:
        return (
            self._head
            + f'"choices":[{{"index":{index},"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]'
            + _continuous_usage(usage_so_far, self.chat)
            + self._tail
        )

    def token(
        self,
        text: str,
        finish: str | None = None,
        usage_so_far: tuple[int, int] | None = None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> str:
        """One token's chunk of choice `index`; `usage_so_far` (prompt, completion tokens so far) with
        continuous usage; `logprobs` the token's object (`logprobs_body`) when asked for."""
        fr = "null" if finish is None else json.dumps(finish)
        t = json.dumps(text)
        lp = "null" if logprobs is None else json.dumps(logprobs, separators=(",", ":"))
        if self.chat:  # vLLM puts stop_reason on a chat stream's final event only
            stop = "" if finish is None else ',"stop_reason":null'
            choice = (
                f'{{"index":{index},"delta":{{"content":{t}}},"logprobs":{lp},"finish_reason":{fr}{stop}}}'
            )
        else:
            choice = f'{{"index":{index},"text":{t},"logprobs":{lp},"finish_reason":{fr},"stop_reason":null}}'
        named = "" if finish is None else self._fingerprint_on_finish
        return (
            f'{self._head}"choices":[{choice}]{_continuous_usage(usage_so_far, self.chat)}{named}{self._tail}'
        )

    def usage(self, prompt: int, completion: int) -> str:
        u = usage(prompt, completion)
        del u["prompt_tokens_details"]  # vLLM's usage event (chat and completions) omits it
        u_json = json.dumps(u, separators=(",", ":"))
        return f'{self._head}"choices":[],"usage":{u_json}{self._fingerprint_on_usage}{self._tail}'

    @staticmethod
    def error(err: ApiError) -> str:
        return f"data: {json.dumps(err.body())}\n\n"

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
