"""vLLM's `/tokenize` and `/detokenize`, as the simulated worker answers them (vLLM 0.32's serving_tokens).

`POST /tokenize` takes either a completion form `{model?, prompt: str, add_special_tokens?,
return_token_strs?}` or a chat form `{model?, messages: [...], add_generation_prompt?, return_token_strs?,
...}` (`messages` present → the chat form, as vLLM picks it) and answers `{count, max_model_len, tokens,
token_strs}`; `token_strs` is null unless `return_token_strs`. `POST /detokenize` takes `{model?, tokens:
[int]}` and answers `{prompt}`. Both serve an absent or empty `model` as the served model, take a LoRA
adapter's name as vLLM does, and answer an unknown one 404.

The simulator has no tokenizer: text is cut as `simulator.tokens` cuts it (one pseudo id per 4-character
piece, the chat form rendered with its template first), so `/tokenize` gives exactly the ids and count the
worker charges the same text in `/v1/completions` (an empty prompt is no token, as vLLM answers "").
`token_strs` are those 4-character pieces. Ids carry no text back (they are hashes), so `/detokenize` maps
each id inside the vocabulary to a pseudo-word (`tokens.id_text`) and drops the others, as vLLM's
tokenizer yields nothing for an id it does not have. So detokenize(tokenize(text)) is not text, unlike vLLM.

Errors follow vLLM's shapes: the body's type errors as FastAPI's 400 "Bad Request" naming `body.<field>`
(a body with neither `prompt` nor `messages` lists both missing fields, as vLLM's union of the two request
models does), an empty `messages` 400 in vLLM's words.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from simulator.protocol import (
    CONTINUE_WITH_GENERATION_PROMPT,
    EMPTY_CONVERSATION,
    ApiError,
    check_generation_prompt,
    text_ids,
    validated,
)
from simulator.tokens import CHARS_PER_TOKEN, id_text, render_chat


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]  # as vLLM's: a negative id is refused


def _check_model(model: str | None, served: str, adapters: Collection[str]) -> None:
    if model and model != served and model not in adapters:  # vLLM's _check_model: a LoRA adapter's name too
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def tokenize_body(
    body: Mapping[str, Any], served: str, max_model_len: int, adapters: Collection[str] = ()
) -> dict[str, Any]:
    """The `/tokenize` answer for a parsed JSON object body; raises ApiError."""
    if "messages" in body:
        try:
            check_generation_prompt(body)
            # vLLM's union lists the completion form first: its missing `prompt` leads the errors
            chat = validated(
                TokenizeChatRequest, body, None if "prompt" in body else "prompt", union_first=True
            )
        except ApiError:
            if "prompt" not in body:
                raise
            chat = None  # the union's completion form may still take the body
    else:
        chat = None
    if chat is not None:
        _check_model(chat.model, served, adapters)
        if not chat.messages:
            raise ApiError(400, EMPTY_CONVERSATION)
        if chat.continue_final_message and chat.add_generation_prompt:  # the default generation prompt
            raise ApiError(400, CONTINUE_WITH_GENERATION_PROMPT)
        try:
            text = render_chat(chat.messages, chat.add_generation_prompt)
        except TypeError as exc:
            raise ApiError(400, f"messages: {exc}", "Bad Request", "body.messages") from None
        strs = chat.return_token_strs
    else:
        req = validated(TokenizeCompletionRequest, body, "messages")
        _check_model(req.model, served, adapters)
        text, strs = req.prompt, req.return_token_strs
    ids = text_ids(text) if text else []
    pieces = [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]
    return {
        "count": len(ids),
        "max_model_len": max_model_len,
        "tokens": ids,
        "token_strs": pieces if strs else None,
    }


def detokenize_body(
    body: Mapping[str, Any], served: str, vocab_size: int, adapters: Collection[str] = ()
) -> dict[str, Any]:
    """The `/detokenize` answer for a parsed JSON object body; raises ApiError."""
    req = validated(DetokenizeRequest, body)
    _check_model(req.model, served, adapters)
    return {"prompt": "".join(id_text(t) for t in req.tokens if 0 <= t < vocab_size)}
