"""Read what the gateway needs from an OpenAI request body, and size the request for the router.

The body is validated with small pydantic models that declare only the fields the gateway reads
(`extra="ignore"`): every other field — vLLM's many extensions included — is never touched, because the
original bytes are what gets forwarded (the body is rewritten only to add `stream_options` upstream or for
the P/D prefill hop).

**Prompt tokens** (no tokenizer is configured in the gateway):
- token-id prompts (`prompt: [int, ...]` or `[[int, ...], ...]`): exact, the number of ids;
- text: ceil(ASCII characters / 4 + UTF-8 bytes of the other characters / 3). ASCII text is OpenAI's
  rule of thumb for English (~4 characters per token); a CJK character (3 bytes) counts one token, which
  today's vocabularies (cl100k, o200k, Llama 3, Qwen) do not exceed on average; Cyrillic, Greek, Arabic
  (2 bytes) count 2/3 token a character, above what they average. Without that second term a Chinese
  prompt was counted 3–4× short and its KV under-reserved (docs/kv.md, "Text prompts");
- chat: Σ over messages of (text estimate of its text parts + 3) + 3, the per-message framing and reply
  priming of OpenAI's token-counting recipe. Non-text parts (images, audio) are not counted;
- responses (OpenAI's Responses API, `/v1/responses`): counted as chat, `instructions` as a system message
  and `input` as one user message (a string) or one message per item — a message's `content` (a string,
  or its parts' `text`), a tool call's `arguments`, a tool result's `output`. A continuation
  (`previous_response_id`) also carries the stored conversation, which the gateway knows only by the
  tokens its worker reported (`with_context`).
The estimate steers routing, KV reservations and rate limits; workers count exactly and their `usage` is
what is reported and metered. Context checks refuse an untokenized prompt only on its floor, ceil(c / 8)
for c characters (framing included), whatever the script (`MAX_CHARS_PER_TOKEN`), a run of whitespace
counting as one character (`_floor_basis`).

**Sequences.** A batch of k prompts (`/v1/completions`) with `n` completions each decodes k·n sequences;
each holds its own KV and has its own context. `prompt_tokens` is the sum over prompts, `prompt_lens` each
prompt's count (for k > 1), and the route request carries both with `n`, so the KV footprint and the
context check go per sequence (`RouteRequest.sequence_shape`, `scheduler.kv.footprint.request_need`).

**Truncation.** vLLM cuts each prompt of a request with `truncate_prompt_tokens` (completions, chat,
embeddings; a Responses request's `truncation: "auto"` is -1) to that many tokens before it checks the
context, so a prompt over the context with it is served, not refused: each prompt is counted at most that
many tokens (-1: the model's context, less the one output token a generation with `max_tokens` keeps back;
unknown context: not cut, the worker cuts to its own), and a larger value than the model's context is
refused in vLLM's words. Prefix hashing follows the cut: vLLM keeps a generation's last tokens (its tokenizer
truncates on the left) and a pooling request's first (`truncation_side` overrides either).

**Output tokens** reserved: chat's `max_completion_tokens` or `max_tokens`, completions' `max_tokens` (vLLM's
completions request has no `max_completion_tokens`: it ignores one and generates `max_tokens`, so charging it
let a client buy 2,000 tokens at the price of 1); absent, vLLM's defaults — 16 for
`/v1/completions`, and for chat the rest of the context, max_model_len − prompt. Responses: its
`max_output_tokens`, else the rest of the context as for chat (vLLM's default). `max_output_tokens` is
that bound times k·n (every sequence may reach it). `predicted_output_tokens`: the length predictor's
`predict` when one is given (a quantile of observed output lengths, fed by the gateway at completion; the
worst case, `max_output_tokens`, until it has `min_samples` observations, so a cold predictor never
overbooks); without a predictor, min(reserved, the routing config's `default_output_tokens` × k·n), a
routing estimate only.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scheduler.length_predictor import LengthPredictor
from scheduler.routing.framework import RouteRequest
from scheduler.routing.prefix import adapter_seed, block_hashes, text_block_hashes
from server.errors import Cause, GatewayError
from simulator.protocol import (  # vLLM's: the completions default and how its validation errors read
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    vllm_error,
)

CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb for English text (ASCII characters)
NON_ASCII_BYTES_PER_TOKEN = 3  # other characters: one token per CJK character (3 UTF-8 bytes)
# The most characters a token of a text prompt is assumed to average: a prompt of n characters has at least
# n / 8 tokens (today's BPE vocabularies average ~4 on English; repetitive or whitespace-heavy text more).
# Context checks refuse an untokenized prompt only on that floor.
MAX_CHARS_PER_TOKEN = 8
TOKENS_PER_MESSAGE = 3  # chat framing per message (OpenAI cookbook "How to count tokens")
REPLY_PRIMING_TOKENS = 3
DEFAULT_CONTEXT = 8192  # a model's context when the gateway knows no max_model_len for it
PREFIX_HASH_BLOCKS = 64  # hash at most this many leading blocks (affinity needs the prefix, not all of it)

Kind = Literal["chat", "completions", "responses", "embeddings", "classify", "score", "rerank"]
GENERATION_KINDS: frozenset[Kind] = frozenset({"chat", "completions", "responses"})
# vLLM's pooling runner serves them (each model those of its task: embeddings, or classify, score and rerank)
POOLING_KINDS: frozenset[Kind] = frozenset({"embeddings", "classify", "score", "rerank"})


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Message(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None


# vLLM 0.32's `truncate_prompt_tokens` (-1: the model's context) and `truncation_side`
TruncateTokens = Annotated[int, Field(ge=-1, lt=2**63)]
TruncationSide = Literal["left", "right"]
# a pooling request's `padding` (vLLM 0.32's PoolingBasicRequestMixin): "max_length" pads each prompt to the context
Padding = Literal["max_length", "do_not_pad"]


class _StreamOptions(_Lenient):
    """vLLM 0.32's StreamOptions, read as vLLM reads them (lax booleans: "false", "no", 0 are false)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(_Lenient):
    model: str | None = None  # absent, null or "": the only model served (as vLLM serves its one model)
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    kv_transfer_params: Any = None  # refused when set: only the gateway may steer a worker's KV transfer
    # what makes vLLM compute prompt logprobs (`wants_prompt_logprobs`), typed as vLLM 0.32 types them
    prompt_logprobs: int | None = None
    echo: bool | None = False
    truncate_prompt_tokens: TruncateTokens | None = None
    truncation_side: TruncationSide | None = None


class _Chat(_Common):
    messages: list[_Message] = Field(min_length=1)
    top_logprobs: int | None = 0


# A token id: no model's vocabulary is negative or anywhere near 2^63 (vLLM refuses ids outside its own
# vocabulary with a 400; past int64 the router's prefix hashing cannot even hold one)
TokenId = Annotated[int, Field(ge=0, lt=2**63)]


class _Completion(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = None


def wants_prompt_logprobs(req: _Chat | _Completion) -> bool:
    """Whether vLLM 0.32 computes this request's prompt logprobs (its `to_sampling_params`): `prompt_logprobs`
    when set, else with `echo` the request's logprobs count — chat's `top_logprobs` (0 unless set, so a chat
    `echo` alone asks for them), completions' `logprobs` (none unless set)."""
    if req.prompt_logprobs is not None:
        return True
    if not req.echo:
        return False
    return (req.top_logprobs if isinstance(req, _Chat) else req.logprobs) is not None


class _Responses(_Lenient):
    """The fields of an OpenAI Responses request the gateway reads (vLLM 0.32's `ResponsesRequest`: `input`
    required, a string or a list of items)."""

    model: str | None = None
    stream: bool | None = False
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"  # "auto": vLLM's truncate_prompt_tokens -1
    kv_transfer_params: Any = None  # refused when set, as on chat: only the gateway may steer KV transfers


class _Embeddings(_Lenient):
    """The fields of an embeddings request the gateway reads (vLLM 0.32's `EmbeddingRequest`: `input` as
    OpenAI's, or chat conversations rendered by the model's template, one vector each: a conversation or a
    batch of them in `messages`, or in `input`; no stream, no output)."""

    model: str | None = None
    input: (
        str | list[TokenId] | list[str] | list[list[TokenId]] | list[_Message] | list[list[_Message]] | None
    ) = None
    messages: list[_Message] | list[list[_Message]] | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    truncation_side: TruncationSide | None = None
    padding: Padding | None = None
    kv_transfer_params: Any = None  # refused when set, as on chat: only the gateway may steer KV transfers


# vLLM 0.32's `ScoreInput`: a text, or `{"content": [parts]}` (a multimodal model's text, image or video parts)
_ScoreInput = str | dict[str, Any]
_ScoreInputs = _ScoreInput | list[_ScoreInput]


class _Scoring(_Lenient):
    """The fields of a score or rerank request the gateway reads (vLLM 0.32's `ScoringRequestMixin`)."""

    model: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    truncation_side: TruncationSide | None = None
    padding: Padding | None = None
    max_tokens_per_query: int | None = 0  # each query cut to this many tokens before it is encoded (0: not)
    max_tokens_per_doc: int | None = 0
    kv_transfer_params: Any = None  # refused when set, as on chat: only the gateway may steer KV transfers


class _Score(_Scoring):
    """`/score`: vLLM's union of four request shapes, the first whose two fields are present (its order)."""

    queries: _ScoreInputs | None = None
    documents: _ScoreInputs | None = None
    items: _ScoreInputs | None = None
    data_1: _ScoreInputs | None = None
    data_2: _ScoreInputs | None = None
    text_1: _ScoreInputs | None = None
    text_2: _ScoreInputs | None = None

    def sides(self) -> tuple[_ScoreInputs, _ScoreInputs]:
        for first, second in (
            (self.queries, self.documents),
            (self.queries, self.items),
            (self.data_1, self.data_2),
            (self.text_1, self.text_2),
        ):
            if first is not None and second is not None:
                return first, second
        raise GatewayError(
            Cause.BAD_REQUEST,
            "a score request needs 'queries' and 'documents' (or 'queries' and 'items', 'data_1' and 'data_2', "
            "'text_1' and 'text_2')",
            param="queries",
        )


class _Rerank(_Scoring):
    """`/rerank`: one query, its documents."""

    query: _ScoreInput
    documents: _ScoreInputs


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    body: bytes  # the client's bytes, forwarded as they are when nothing must change
    model: str
    stream: bool
    client_wants_usage: bool  # stream_options.include_usage was set by the client
    has_stream_options: bool
    prompt_tokens: int  # over all prompts (each once)
    prompt_exact: bool
    sequences: int  # prompts × n
    max_output_tokens: int  # over all sequences
    token_ids: list[int] | None  # first prompt's ids, when given as ids (exact prefix hashing)
    prompt_text: str | None  # the text prefix hashing uses otherwise
    _data: dict[str, Any] | None = None
    n: int = 1  # completions per prompt
    prompt_lens: tuple[int, ...] = ()  # each prompt's tokens when there are several, else ()
    # an estimated prompt: the fewest tokens its longest prompt can have (None: use the legacy formula)
    prompt_floor: int | None = None
    previous_response_id: str | None = None  # a Responses continuation: served where that response is stored
    output_defaulted: bool = False  # no output bound in the body: the rest of the context (`with_context`)
    # vLLM computes its prompt logprobs (`wants_prompt_logprobs`): only a worker that runs the prompt forward
    # has them, so a vLLM 0.32 decode worker loads no KV for such a request (`skip_reading_prefix_cache`) and
    # recomputes its whole prompt — a prefill hop would be paid for twice (a vLLM without that guard fails the
    # engine instead: vLLM issue #50792). Such a request never takes the two-hop path
    prompt_logprobs: bool = False
    adapter: str | None = None  # the LoRA adapter `model` named (`model` is then its base model)
    prompt_cap: int | None = None  # vLLM cuts each prompt to this many tokens (`Truncation`)
    # the longest prompt one sequence's context must hold, when not the longest of `prompt_lens` (a score
    # request's: `parse_scoring`)
    context_tokens: int | None = None

    def data(self) -> dict[str, Any]:
        """The body as a dict (parsed once, lazily: only the rewriting paths need it)."""
        if self._data is None:
            self._data = json.loads(self.body)
        return self._data


def estimate_text_tokens(text: str) -> int:
    """ceil(ASCII characters / 4 + UTF-8 bytes of the others / 3) (module docstring); ceil(len / 4) for ASCII."""
    if text.isascii():
        return math.ceil(len(text) / CHARS_PER_TOKEN)
    ascii_chars = len(text.encode("ascii", "ignore"))
    other_bytes = len(text.encode("utf-8", "surrogatepass")) - ascii_chars
    # in integer twelfths of a token: 3 per ASCII character, 4 per other byte
    return -(-(3 * ascii_chars + 4 * other_bytes) // (CHARS_PER_TOKEN * NON_ASCII_BYTES_PER_TOKEN))


def _floor_basis(text: str) -> int:
    """ceil(len / 4) whatever the script: the floor (÷ 2 → len / 8 characters a token) is taken on this.

    A run of whitespace counts as one character: BPE vocabularies hold tokens of many spaces or newlines, so
    indented code or pretty-printed JSON of 451 tokens (Llama's tokenizer) has over 8 characters a token
    (4,350), and its plain floor refused it on a 512-token context that vLLM served. Only texts over
    `_WHITESPACE_SCAN_CHARS` are scanned (the scan costs ~6 µs per 1,000 characters): a shorter one's floor
    is at most 256 tokens, under any context a model is served with."""
    n = len(text)
    if n > _WHITESPACE_SCAN_CHARS:
        words = text.split()
        n = min(n, sum(map(len, words)) + len(words) + 1)  # each word, one character per run between
    return math.ceil(n / CHARS_PER_TOKEN)


_WHITESPACE_SCAN_CHARS = 2048


def _floor(basis: int) -> int:
    return math.ceil(basis * CHARS_PER_TOKEN / MAX_CHARS_PER_TOKEN)


def _text_parts(content: str | list[dict[str, Any]] | None) -> list[str]:
    if isinstance(content, str):
        return [content]
    if content is None:
        return []
    return [str(p.get("text", "")) for p in content if p.get("type") == "text"]


def _message_tokens(msg: _Message) -> int:
    return sum(estimate_text_tokens(t) for t in _text_parts(msg.content)) + TOKENS_PER_MESSAGE


def _message_floor_basis(msg: _Message) -> int:
    return sum(_floor_basis(t) for t in _text_parts(msg.content)) + TOKENS_PER_MESSAGE


def _chat_text(messages: list[_Message]) -> str:
    parts = []
    for m in messages:
        c = m.content
        text = (
            c
            if isinstance(c, str)
            else "".join(str(p.get("text", "")) for p in c or [] if p.get("type") == "text")
        )
        parts.append(f"{m.role}\n{text}\n")
    return "".join(parts)


def _item_texts(item: dict[str, Any]) -> list[str]:
    """The text of one Responses input item: a message's content (a string or its parts' `text`), a tool
    call's `arguments`, a tool result's `output` (what the chat template renders of it)."""
    texts: list[str] = []
    content = item.get("content")
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        texts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    for key in ("arguments", "output"):
        if isinstance(item.get(key), str):
            texts.append(item[key])
    return texts


def _responses_prompt(req: _Responses) -> tuple[int, int, str]:
    """(estimated tokens, floor, text for prefix hashing) of a Responses request, counted as chat messages."""
    messages: list[tuple[str, list[str]]] = []
    if req.instructions:
        messages.append(("system", [req.instructions]))
    if isinstance(req.input, str):
        messages.append(("user", [req.input]))
    else:
        messages.extend(
            (str(item.get("role", item.get("type", ""))), _item_texts(item)) for item in req.input
        )
    tokens = floor_basis = REPLY_PRIMING_TOKENS
    for _, texts in messages:
        tokens += sum(estimate_text_tokens(t) for t in texts) + TOKENS_PER_MESSAGE
        floor_basis += sum(_floor_basis(t) for t in texts) + TOKENS_PER_MESSAGE
    text = "".join(f"{role}\n{''.join(texts)}\n" for role, texts in messages)
    return tokens, _floor(floor_basis), text


def parse_responses(
    body: bytes,
    text: bytes,
    max_model_len: Mapping[str, int] | None,
    default_model: str | None,
    adapters: Mapping[str, str] | None = None,
    resolver: AdapterResolver | None = None,
) -> ParsedRequest:
    """`parse_request` for a Responses body (`text`: the body without a byte-order mark). One sequence; the
    stream carries its usage in its last event whatever the client asks, so nothing is rewritten upstream."""
    req, model, adapter = _validated(_Responses, text, default_model, adapters, resolver)
    tokens, floor, prompt_text = _responses_prompt(req)
    cut = _truncation(
        -1 if req.truncation != "disabled" else None,  # vLLM reads a null `truncation` as "auto"
        None,
        _context_of(max_model_len, model),
        pooling=False,
        bounds_output=bool(req.max_output_tokens),
    )
    prompt, _, _, floor, _, prompt_text = _cut(_Prompts(tokens, False, (), floor, None, prompt_text), cut)
    limit = req.max_output_tokens
    if limit is None:
        limit = _rest_of_context(max_model_len, model, prompt)
    return ParsedRequest(
        kind="responses",
        body=body,
        model=model,
        stream=bool(req.stream),
        client_wants_usage=True,  # (no stream_options to add: vLLM always sends usage with the last event)
        has_stream_options=False,
        prompt_tokens=prompt,
        prompt_exact=False,
        sequences=1,
        max_output_tokens=max(0, limit),
        token_ids=None,
        prompt_text=prompt_text,
        prompt_floor=floor,
        previous_response_id=req.previous_response_id,
        output_defaulted=req.max_output_tokens is None,
        adapter=adapter,
        prompt_cap=cut.cap if cut else None,
    )


def parse_embeddings(
    body: bytes,
    text: bytes,
    max_model_len: Mapping[str, int] | None,
    default_model: str | None,
    adapters: Mapping[str, str] | None = None,
    resolver: AdapterResolver | None = None,
    kind: Literal["embeddings", "classify"] = "embeddings",
) -> ParsedRequest:
    """`parse_request` for an embeddings body: each input is one sequence that ends at its prefill (no
    output tokens), so its footprint is its prompt. The worker checks what the gateway does not read (an
    empty input, `dimensions` on a model without Matryoshka embeddings, `encoding_format`) in its own words.
    A classify body (vLLM's `/classify`: `input` as a completion's, or one chat conversation in `messages`,
    one label distribution each) is read the same way, as `kind` "classify"."""
    req, model, adapter = _validated(_Embeddings, text, default_model, adapters, resolver)
    if req.input is None and req.messages is None:
        raise GatewayError(Cause.BAD_REQUEST, "'input' is required (or chat 'messages')", param="input")
    conversations = _conversations(req.messages) or _conversations(req.input)
    if conversations is not None:  # each conversation one sequence, counted as a chat prompt
        lens = tuple(sum(_message_tokens(m) for m in c) + REPLY_PRIMING_TOKENS for c in conversations)
        floor = _floor(
            max(sum(_message_floor_basis(m) for m in c) + REPLY_PRIMING_TOKENS for c in conversations)
        )
        prompts = _Prompts(sum(lens), False, lens, floor, None, _chat_text(conversations[0]))
    else:
        # an empty list is the worker's 400 ("You must pass at least one prompt"): counted as one empty prompt
        prompts = _completion_prompt(req.input) if req.input else _Prompts(0, True, (0,), None, None, None)
    return _pooled(kind, body, model, adapter, prompts, req, max_model_len)


def _conversations(value: Any) -> list[list[_Message]] | None:
    """The chat conversations an embeddings body holds (one, or a batch), None when it holds prompts."""
    if not value or not isinstance(value, list):
        return None
    if all(isinstance(m, _Message) for m in value):
        return [value]
    # a batch: an empty conversation among them is one (the worker refuses it in its words), but a batch of
    # empty lists alone is a batch of empty token-id prompts
    if any(value) and all(isinstance(c, list) and all(isinstance(m, _Message) for m in c) for c in value):
        return value
    return None


def parse_scoring(
    kind: Literal["score", "rerank"],
    body: bytes,
    text: bytes,
    max_model_len: Mapping[str, int] | None,
    default_model: str | None,
    adapters: Mapping[str, str] | None = None,
    resolver: AdapterResolver | None = None,
) -> ParsedRequest:
    """`parse_request` for a score or rerank body: queries scored against documents, 1:1, 1:N or N:N. How a
    pooling worker encodes them depends on its model, which the gateway does not know: a cross-encoder (a
    reranker: vLLM's classify task) runs each (query, document) pair as one prompt, a bi-encoder (an
    embedding model) each text alone. So the KV is counted by pairs, the most either holds (each sequence a
    pair, no output), and the context by the longest text, the least either needs (a pair over a
    cross-encoder's context is its worker's 400); `max_tokens_per_query`/`_doc` cut the texts first and
    `truncate_prompt_tokens` each prompt. Prefix affinity is the first query's text, where every pair of a
    cross-encoder begins. Lengths that do not pair up, and empty sides, are the worker's 400 in its words."""
    req: _Score | _Rerank
    req, model, adapter = _validated(
        _Score if kind == "score" else _Rerank, text, default_model, adapters, resolver
    )
    first, second = req.sides() if isinstance(req, _Score) else (req.query, req.documents)
    queries = _score_texts(first, req.max_tokens_per_query)
    documents = _score_texts(second, req.max_tokens_per_doc)
    # a single query goes with every document; N queries with N documents (other counts: the worker's 400)
    pairs = list(zip(queries * len(documents) if len(queries) == 1 else queries, documents, strict=False))
    lens = tuple(q[0] + d[0] for q, d in pairs) or (0,)
    texts = queries + documents
    longest = max((n for n, _, _ in texts), default=0)
    prompts = _Prompts(
        sum(lens),
        False,
        lens,
        max((f for _, f, _ in texts), default=0),
        None,
        queries[0][2] if queries else None,
    )
    # padded, a bi-encoder's every text is a whole context, more than a cross-encoder's pairs
    return _pooled(kind, body, model, adapter, prompts, req, max_model_len, longest, len(texts))


def _pooled(
    kind: Kind,
    body: bytes,
    model: str,
    adapter: str | None,
    prompts: _Prompts,
    req: _Embeddings | _Scoring,
    max_model_len: Mapping[str, int] | None,
    longest: int | None = None,
    padded_sequences: int | None = None,
) -> ParsedRequest:
    """A pooling request: one sequence a prompt, each ending at its prefill (no output), its prompts as the
    request's `truncate_prompt_tokens` leaves them; `longest`: the text the context must hold, when it is
    not the longest prompt (`ParsedRequest.context_tokens`). `padding: "max_length"` makes each of its
    `padded_sequences` (default: its prompts) a whole context, as vLLM pads them (with the context unknown,
    the prompts are counted as sent)."""
    context = _context_of(max_model_len, model)
    cut = _truncation(
        req.truncate_prompt_tokens,
        req.truncation_side,
        context,
        pooling=True,
        bounds_output=False,
    )
    prompts = _cut(prompts, cut)
    if req.padding == "max_length" and context:
        count = padded_sequences or len(prompts.lens) or 1
        prompts = prompts._replace(tokens=count * context, lens=(context,) * count, floor=context)
        longest = None if longest is None else context
    prompt, exact, lens, floor, token_ids, prompt_text = prompts
    return ParsedRequest(
        kind=kind,
        body=body,
        model=model,
        stream=False,
        client_wants_usage=False,
        has_stream_options=False,
        prompt_tokens=prompt,
        prompt_exact=exact,
        sequences=max(1, len(lens)),
        max_output_tokens=0,
        token_ids=token_ids,
        prompt_text=prompt_text,
        prompt_lens=lens if len(lens) > 1 else (),
        prompt_floor=None if exact else floor,
        adapter=adapter,
        prompt_cap=cut.cap if cut else None,
        context_tokens=longest if longest is None or cut is None else min(longest, cut.cap),
    )


def _score_texts(value: _ScoreInputs, cap: int | None) -> list[tuple[int, int, str]]:
    """(estimated tokens, floor, text) of each input of a score side: a text, or a multimodal input's text
    parts (its other parts are not counted, as in chat), each at most `cap` tokens when `cap` > 0."""
    out = []
    for item in value if isinstance(value, list) else [value]:
        content = item if isinstance(item, str) else item.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):  # any JSON: the worker validates the parts
            text = "".join(
                p["text"]
                for p in content
                if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            )
        else:
            text = ""
        tokens, floor = estimate_text_tokens(text), _floor(_floor_basis(text))
        if cap is not None and cap > 0:
            tokens, floor = min(tokens, cap), min(floor, cap)
        out.append((tokens, floor, text))
    return out


def with_context(parsed: ParsedRequest, tokens: int, max_model_len: Mapping[str, int] | None) -> None:
    """Add a continuation's stored conversation (`tokens`: its last turn's input + output, as its worker
    reported them, exact) to the prompt; an output left to the context shrinks by as much."""
    parsed.prompt_tokens += tokens
    if parsed.prompt_floor is not None:
        parsed.prompt_floor += tokens
    if parsed.prompt_cap is not None:  # `truncation: "auto"` cuts the whole conversation
        parsed.prompt_tokens = min(parsed.prompt_tokens, parsed.prompt_cap)
        if parsed.prompt_floor is not None:
            parsed.prompt_floor = min(parsed.prompt_floor, parsed.prompt_cap)
    if parsed.output_defaulted:
        parsed.max_output_tokens = _rest_of_context(max_model_len, parsed.model, parsed.prompt_tokens)


def _rest_of_context(max_model_len: Mapping[str, int] | None, model: str, prompt: int) -> int:
    """vLLM's default output bound: what the model's context leaves after the prompt (at least 1); a model
    the gateway has no limit for is taken as 8,192."""
    return max(1, ((max_model_len or {}).get(model) or DEFAULT_CONTEXT) - prompt)


@dataclass(frozen=True, slots=True)
class AdapterResolver:
    """`models[].lora_resolver`: the workers of `model` load adapters on demand, so any name that is not a
    configured model is an adapter of `model` (its workers answer vLLM's 404 for one they cannot find)."""

    model: str
    configured: frozenset[str]

    def base_of(self, name: str) -> str | None:
        return None if name in self.configured else self.model


def _model_of(
    model: str | None,
    default_model: str | None,
    adapters: Mapping[str, str] | None,
    resolver: AdapterResolver | None = None,
) -> tuple[str, str | None]:
    """(the model to route as, the LoRA adapter named or None): a name in `adapters` is that adapter, routed
    as its base model; with a `resolver`, so is any other name that is not a configured model."""
    model = model or default_model
    if not model:
        raise GatewayError(
            Cause.BAD_REQUEST,
            "'model' is required: this gateway serves several models (GET /v1/models lists them)",
            param="model",
        )
    base = adapters.get(model) if adapters else None
    if base is None and resolver is not None:
        base = resolver.base_of(model)
    return (model, None) if base is None else (base, model)


_Body = TypeVar("_Body", _Chat, _Completion, _Responses, _Embeddings, _Score, _Rerank)


def _validated(
    cls: type[_Body],
    text: bytes,
    default_model: str | None,
    adapters: Mapping[str, str] | None,
    resolver: AdapterResolver | None,
) -> tuple[_Body, str, str | None]:
    """The body validated as `cls` (400 naming the field), the model to route as and the adapter it names;
    a client's `kv_transfer_params` refused."""
    try:
        req = cls.model_validate_json(text)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    model, adapter = _model_of(req.model, default_model, adapters, resolver)
    _refuse_kv_params(req.kv_transfer_params)
    return req, model, adapter


def _refuse_kv_params(kv_transfer_params: Any) -> None:
    if kv_transfer_params is not None:
        # vLLM's connector fields (do_remote_decode holds KV blocks until an abort timeout, outside the KV
        # ledger; do_remote_prefill makes the worker pull KV from any remote_host): the gateway sets them
        # on its own P/D hops and a client's would reach mixed and decode workers as they are.
        raise GatewayError(
            Cause.BAD_REQUEST,
            "'kv_transfer_params' is set by the gateway for prefill/decode disaggregation; clients may not send it",
            param="kv_transfer_params",
        )


def parse_request(
    kind: Kind,
    body: bytes,
    max_model_len: Mapping[str, int] | None = None,
    default_model: str | None = None,
    adapters: Mapping[str, str] | None = None,
    resolver: AdapterResolver | None = None,
) -> ParsedRequest:
    """Validate the fields the gateway reads; `GatewayError(bad_request)` naming the field otherwise.

    `max_model_len` (model → context limit) sizes the chat default output; unknown models assume 8,192.
    `default_model`: what a request without a model (absent, null or "") asks for — the gateway's one model,
    as vLLM serves its only model then; None (several models) refuses such a request. `adapters` (LoRA
    adapter → base model): a request naming one is parsed as its base model, `adapter` set; `resolver`: so is any
    unknown name (`AdapterResolver`)."""
    # A UTF-8 byte-order mark (some Windows clients send one) is accepted, as vLLM's json.loads accepts it;
    # the body is still forwarded as sent
    text = body[3:] if body.startswith(codecs.BOM_UTF8) else body
    if kind == "responses":
        return parse_responses(body, text, max_model_len, default_model, adapters, resolver)
    if kind == "embeddings" or kind == "classify":
        return parse_embeddings(body, text, max_model_len, default_model, adapters, resolver, kind)
    if kind == "score" or kind == "rerank":
        return parse_scoring(kind, body, text, max_model_len, default_model, adapters, resolver)
    req, model, adapter = _validated(
        _Chat if kind == "chat" else _Completion, text, default_model, adapters, resolver
    )
    n = req.n if req.n and req.n > 0 else 1
    if isinstance(req, _Chat):
        counted = _Prompts(
            sum(_message_tokens(m) for m in req.messages) + REPLY_PRIMING_TOKENS,
            False,
            (),
            _floor(sum(_message_floor_basis(m) for m in req.messages) + REPLY_PRIMING_TOKENS),
            None,
            _chat_text(req.messages),
        )
        default_out = None
    else:
        counted = _completion_prompt(req.prompt)
        default_out = COMPLETIONS_DEFAULT_MAX_TOKENS
    # vLLM's chat requests take max_completion_tokens over max_tokens; its completions requests have no
    # max_completion_tokens at all (ignored, so max_tokens decides what is generated, and what is charged)
    limit = req.max_tokens
    if isinstance(req, _Chat) and req.max_completion_tokens is not None:
        limit = req.max_completion_tokens
    cut = _truncation(
        req.truncate_prompt_tokens,
        req.truncation_side,
        _context_of(max_model_len, model),
        pooling=False,
        # completions: absent or null is 16 before vLLM sizes the truncation (its before-validator)
        bounds_output=bool(limit if limit is not None else default_out),
    )
    prompt, exact, lens, floor, token_ids, text = _cut(counted, cut)
    prompts = max(1, len(lens))
    per_seq_prompt = math.ceil(prompt / prompts)
    if limit is None:
        limit = (
            default_out if default_out is not None else _rest_of_context(max_model_len, model, per_seq_prompt)
        )
    return ParsedRequest(
        kind=kind,
        body=body,
        model=model,
        stream=bool(req.stream),
        client_wants_usage=bool(req.stream_options and req.stream_options.include_usage),
        has_stream_options=req.stream_options is not None,
        prompt_tokens=prompt,
        prompt_exact=exact,
        sequences=prompts * n,
        max_output_tokens=max(0, limit) * prompts * n,
        token_ids=token_ids,
        prompt_text=text,
        n=n,
        prompt_lens=lens if len(lens) > 1 else (),
        prompt_floor=None if exact else floor,
        prompt_logprobs=wants_prompt_logprobs(req),
        adapter=adapter,
        prompt_cap=cut.cap if cut else None,
    )


def _validation_error(exc: ValidationError) -> GatewayError:
    """The first error, named by its field path (`messages.0.content`). A union field (`prompt`, a message's
    `content`) fails once per member, each with the member's type in its location (`prompt.list[int]`):
    those tags are left out of the path and the message lists the types the field accepts."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    if err["type"] == "json_invalid":
        return GatewayError(Cause.BAD_REQUEST, f"The request body is not valid JSON: {err['msg']}")
    if err["type"] == "model_type" and not err["loc"]:
        return GatewayError(Cause.BAD_REQUEST, "Request body must be a JSON object")
    path, tag = _split_union_tag(err["loc"])
    param = ".".join(str(p) for p in path) or None
    if tag is None:
        return GatewayError(Cause.BAD_REQUEST, f"Invalid value for '{param}': {err['msg']}", param=param)
    mine = [e for e in errors if _split_union_tag(e["loc"])[0] == path]
    accepted = dict.fromkeys(
        t.replace("constrained-int", "int") for e in mine if (t := _split_union_tag(e["loc"])[1])
    )
    message = f"Invalid value for '{param}': expected one of {', '.join(accepted)}"
    if any(e["type"] in ("greater_than_equal", "less_than") for e in mine):  # a `TokenId` out of range
        message += "; token ids are integers from 0 to 2^63 - 1"
    return GatewayError(Cause.BAD_REQUEST, message, param=param)


def _split_union_tag(loc: tuple[int | str, ...]) -> tuple[tuple[int | str, ...], str | None]:
    """(the location up to a union member's tag, the tag) — (loc, None) when it has none. Pydantic tags a
    union member by its type (`str`, `list[int]`); no field of these models is named like a type."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):
            return loc[:i], part
    return loc, None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


class _Prompts(NamedTuple):
    """A request's prompts as the gateway counts them."""

    tokens: int  # over all prompts
    exact: bool  # counted from token ids
    lens: tuple[int, ...]  # each prompt's tokens (() for one rendered chat conversation)
    floor: int | None  # the fewest tokens the longest prompt can have (estimated text only)
    token_ids: list[int] | None  # the first prompt's ids, when given as ids
    text: str | None  # the first prompt's text otherwise (prefix hashing)


def _completion_prompt(prompt: Any) -> _Prompts:
    if isinstance(prompt, str):
        tokens = estimate_text_tokens(prompt)
        return _Prompts(tokens, False, (tokens,), _floor(_floor_basis(prompt)), None, prompt)
    if not prompt:
        raise GatewayError(Cause.BAD_REQUEST, "'prompt' must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return _Prompts(len(prompt), True, (len(prompt),), None, list(prompt), None)
    if isinstance(prompt[0], str):
        lens = tuple(estimate_text_tokens(p) for p in prompt)
        floor = _floor(max(_floor_basis(p) for p in prompt))
        return _Prompts(sum(lens), False, lens, floor, None, prompt[0])
    lens = tuple(len(p) for p in prompt)
    return _Prompts(sum(lens), True, lens, None, list(prompt[0]), None)


@dataclass(frozen=True, slots=True)
class Truncation:
    """How vLLM 0.32 cuts each prompt of a request (its `TokenizeParams`): to `cap` tokens, keeping the last
    ones (`side` "left") or the first ("right")."""

    cap: int
    side: TruncationSide


# vLLM 0.32's words for a truncation longer than the context: a generation's (TokenizeParams) names the
# field, a pooling request's (its own check, before the renderer's) does not
_POOLING_TRUNCATION_TOO_LONG = (
    "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation size."
)


def _truncation(
    truncate: int | None,
    side: TruncationSide | None,
    context: int | None,
    *,
    pooling: bool,
    bounds_output: bool,
) -> Truncation | None:
    """The cut a request asks for, None when none. -1 is the context, less the output token a generation with
    an output bound keeps back (`max_truncation_tokens`); with the context unknown the worker cuts to its own,
    and the gateway counts the whole prompt. More than the context is refused as vLLM refuses it. The side is
    vLLM's tokenizer's unless given: left for generation, right for pooling."""
    if truncate is None:
        return None
    if context and truncate > context:
        if pooling:
            raise GatewayError(Cause.BAD_REQUEST, _POOLING_TRUNCATION_TOO_LONG)
        refusal = vllm_error(
            f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = {context}. "
            "Please request a smaller truncation size.",
            "truncate_prompt_tokens",
            truncate,
        )
        raise GatewayError(Cause.BAD_REQUEST, refusal.message, param=refusal.param)
    if truncate < 0:
        if not context:
            return None
        truncate = context - 1 if bounds_output and not pooling else context
    return Truncation(truncate, side or ("right" if pooling else "left"))


def _cut(prompts: _Prompts, cut: Truncation | None) -> _Prompts:
    """`prompts` as the worker will hold them after `cut`: each at most `cut.cap` tokens, the first prompt's ids
    cut as vLLM cuts them (its cached prefix is theirs); the text of one cut on the left is dropped (where the
    kept tail begins is not known without a tokenizer), so it is routed without prefix affinity."""
    if cut is None:
        return prompts
    cap = cut.cap
    first = prompts.lens[0] if prompts.lens else prompts.tokens
    lens = tuple(min(n, cap) for n in prompts.lens)
    token_ids, text = prompts.token_ids, prompts.text
    if first > cap:
        if token_ids is not None:
            token_ids = token_ids[len(token_ids) - cap :] if cut.side == "left" else token_ids[:cap]
        elif cut.side == "left":
            text = None
    return prompts._replace(
        tokens=sum(lens) if lens else min(prompts.tokens, cap),
        lens=lens,
        floor=None if prompts.floor is None else min(prompts.floor, cap),
        token_ids=token_ids,
        text=text,
    )


def _context_of(max_model_len: Mapping[str, int] | None, model: str) -> int | None:
    return (max_model_len or {}).get(model) or None


def route_request(
    parsed: ParsedRequest,
    request_id: str,
    arrival_s: float,
    default_output_tokens: int,
    block_size: int = 16,
    predictor: LengthPredictor | None = None,
    ticket: int = 0,
    pinned_worker: str | None = None,
) -> RouteRequest:
    """The router's view of the request: footprint and prefix hashes, never the body.

    predicted output = `predictor.predict` when a predictor is given: its quantile for this model and input
    bucket once it has `min_samples` observations, the worst case (reserved output) before, so a cold
    predictor never overbooks a `predicted` ledger. Without a predictor (no ledger), a routing estimate:
    min(reserved output, default_output_tokens × sequences)."""
    seed = adapter_seed(parsed.adapter)
    if parsed.token_ids is not None:
        hashes = block_hashes(parsed.token_ids, block_size, PREFIX_HASH_BLOCKS, seed)
    elif parsed.prompt_text:
        hashes = text_block_hashes(parsed.prompt_text, block_size * CHARS_PER_TOKEN, PREFIX_HASH_BLOCKS, seed)
    else:
        hashes = ()
    if predictor is not None:
        predicted = predictor.predict(parsed.model, parsed.prompt_tokens, parsed.max_output_tokens)
    else:
        predicted = min(parsed.max_output_tokens, default_output_tokens * parsed.sequences)
    if parsed.prompt_exact:
        floor = None
    elif parsed.prompt_floor is not None:
        floor = parsed.prompt_floor
    else:
        floor = _floor(parsed.prompt_tokens)
    return RouteRequest(
        request_id=request_id,
        model=parsed.model,
        prompt_tokens=parsed.prompt_tokens,
        max_output_tokens=parsed.max_output_tokens,
        predicted_output_tokens=predicted,
        prefix_hashes=hashes,
        arrival_s=arrival_s,
        prompt_tokens_floor=floor,
        n=parsed.n,
        prompt_lens=parsed.prompt_lens,
        ticket=ticket,
        # vLLM's Responses request has no P/D handover; prompt logprobs need the prompt run where they are asked
        # pooling requests end at their prefill, so there is nothing to hand over
        single_hop=parsed.kind == "responses" or parsed.kind in POOLING_KINDS or parsed.prompt_logprobs,
        pinned_worker=pinned_worker,
        adapter=parsed.adapter,
        generates=parsed.kind in GENERATION_KINDS,
        context_tokens=parsed.context_tokens,
    )
