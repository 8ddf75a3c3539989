"""vLLM 0.32's score and rerank routes (`POST /score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`) as a
`vllm serve MODEL --runner pooling --convert embed` server answers them: the bi-encoder path, where every
query and every document is embedded on its own and a pair's score is the cosine of the two embeddings.
Request validation, the scores and the response bodies live here; `simulator.worker_app` runs the engine
requests.

Requests. /score validates the body against a union of four models (`queries`/`documents`,
`queries`/`items`, `data_1`/`data_2`, `text_1`/`text_2`), /rerank against one (`query`, `documents`,
`top_n` ≥ 0). Each side is a string, a `{"content": [parts]}` multimodal param, or a list of them. The
models have vLLM's fields, types, defaults and field order (ClassifyRequestMixin's `use_activation`, then
PoolingBasicRequestMixin's, then ScoringRequestMixin's, then the pair), so pydantic reports the same errors
in the same order. Checks, in vLLM's order (each measured against the CPU build):

1. `cache_salt` (empty, non-string, too long, forbidden characters) → 400 BadRequestError naming it;
2. the models → 400 "Bad Request" with pydantic's errors (as `simulator.embeddings` formats them);
3. a non-empty `mm_processor_kwargs` or `media_io_kwargs` (an extra field, read all the same) → 400 naming
   it (vLLM's server does not trust per-request multimodal kwargs by default);
4. the model: neither the served name nor an adapter → 404 NotFoundError;
5. `truncate_prompt_tokens` > max_model_len → 400;
6. the inputs: a multimodal param on either side (queries first) → "MultiModalParam is not supported for
   <architecture>" (the catalog models are text models); then the counts: N > 1 queries and M ≠ N
   documents → "Input lengths must be either 1:1, 1:N or N:N", no queries → "At least one text element
   must be given", no documents → "At least one text_pair element must be given";
7. `max_tokens_per_query`, then `max_tokens_per_doc` (0: unset): negative → "<name> must be a non-negative
   integer", ≥ max_model_len → "<name> (N) must be less than max_model_len (L)."; set ones cut each
   query/document text to that many tokens before tokenisation;
8. each text tokenised (queries, then documents), truncated to `truncate_prompt_tokens` and padded with
   `padding: "max_length"` as an embeddings input is, then its length against max_model_len;
9. the engine's: an empty prompt (`""`) → "The decoder prompt cannot be empty".

vLLM's pooling handlers do not pass `X-data-parallel-rank` to the engine, so the header is ignored here
(the balancer picks the engine). `instruction`, `chat_template_kwargs`, `use_activation` and `priority` are
accepted and change nothing (a bi-encoder renders no template; the vectors are unit vectors anyway).

Engine work and scores. Each query text and each document text is one prefill-only engine request
(queries once, not once per pair); usage `prompt_tokens` is the sum of their tokens. A single query is
paired with every document (1:N), else query i with document i (N:N); the score is the cosine of the two
texts' pseudo embeddings (`simulator.embeddings.embedding`), rounded to float32 as vLLM's tensor is.
Identical texts score exactly 1.0; unrelated ones near 0 (random vectors), unlike a real model's scores.

Responses. /score: ScoreResponse {id, object "list", created, model, data [{index, object "score", score}],
usage (UsageInfo's five keys)}. /rerank: RerankResponse {id, model, usage {prompt_tokens, total_tokens},
results [{index, document {text, multi_modal}, relevance_score}]}, sorted by score, highest first (ties
keep document order), cut to `top_n` when 0 < top_n < documents. Both ids are `score-<X-Request-Id, else
the body's request_id, else 16 random hex digits>`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Required

import numpy as np
from pydantic import Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from simulator.embeddings import (
    EMPTY_PROMPT,
    TRUNCATE_OVER_CONTEXT,
    OpenAIBaseModel,
    check_cache_salt,
    embedding,
    fit_prompt,
    union_error,
    usage_info,
)
from simulator.protocol import ApiError, EngineInputError, check_prompt_length, text_ids, vllm_error
from simulator.tokens import CHARS_PER_TOKEN

# HF architecture of each catalog model family (vLLM names it in its multimodal refusal); a name matching
# none (the tests' tiny Llama, a custom row) is read as a Llama
_ARCHITECTURES = (("qwen2", "Qwen2ForCausalLM"), ("mixtral", "MixtralForCausalLM"),
                  ("mistral", "MistralForCausalLM"), ("llama", "LlamaForCausalLM"))  # fmt: skip
UNTRUSTED_KWARGS = (
    "Per-request {kind} are disabled by default because they can change multimodal {what} resource usage. "
    "Start the server with --trust-request-mm-kwargs only when clients are trusted."
)
_KWARGS_WHAT = {"mm_processor_kwargs": "preprocessing", "media_io_kwargs": "media loading"}
LENGTHS = "Input lengths must be either 1:1, 1:N or N:N"
NO_QUERY = "At least one text element must be given"
NO_DOCUMENT = "At least one text_pair element must be given"


def architecture(model: str) -> str:
    """The HF architecture vLLM reports for a catalog model (`model_config.architecture`)."""
    name = model.lower()
    return next((arch for key, arch in _ARCHITECTURES if key in name), "LlamaForCausalLM")


# ---------------------------------------------------------------- the content parts (vLLM's four members)
class ImageURL(TypedDict, total=False):
    url: Required[str]
    detail: Literal["auto", "low", "high", "original"]


class PromptCacheBreakpoint(TypedDict, total=False):
    mode: Required[Literal["explicit"]]
    ttl: Literal["30m", "12h"]


class ChatCompletionContentPartImageParam(TypedDict, total=False):
    image_url: Required[ImageURL]
    type: Required[Literal["image_url"]]
    prompt_cache_breakpoint: PromptCacheBreakpoint


class ChatCompletionContentPartImageEmbedsParam(TypedDict, total=False):
    image_embeds: str | dict[str, str | list[int | float]] | None
    type: Required[Literal["image_embeds"]]
    uuid: str | None


class ChatCompletionContentPartTextParam(TypedDict, total=False):
    text: Required[str]
    type: Required[Literal["text"]]
    prompt_cache_breakpoint: PromptCacheBreakpoint


class VideoURL(TypedDict, total=False):
    url: Required[str]


class ChatCompletionContentPartVideoParam(TypedDict, total=False):
    video_url: Required[VideoURL]
    type: Required[Literal["video_url"]]


ScoreContentPartParam = (
    ChatCompletionContentPartImageParam
    | ChatCompletionContentPartImageEmbedsParam
    | ChatCompletionContentPartTextParam
    | ChatCompletionContentPartVideoParam
)


class ScoreMultiModalParam(TypedDict, total=False):
    content: Required[list[ScoreContentPartParam]]


ScoreInput = str | ScoreMultiModalParam
_Side = ScoreInput | list[ScoreInput]


# ---------------------------------------------------------------- the request models (vLLM's field order)
class ScoringRequestMixin(OpenAIBaseModel):
    """ClassifyRequestMixin's, PoolingBasicRequestMixin's and ScoringRequestMixin's fields, in the order
    pydantic collects them from vLLM's bases."""

    use_activation: bool | None = None
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's is `str` with a random default: an explicit null is a string_type error, absent is no id
    request_id: str = Field(default=None)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    mm_processor_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def pair(self) -> tuple[Any, Any]:
        """(queries, documents) as given: vLLM's `data_1`, `data_2`."""
        raise NotImplementedError


class ScoreQueriesDocumentsRequest(ScoringRequestMixin):
    queries: _Side
    documents: _Side

    def pair(self) -> tuple[Any, Any]:
        return self.queries, self.documents


class ScoreQueriesItemsRequest(ScoringRequestMixin):
    queries: _Side
    items: _Side

    def pair(self) -> tuple[Any, Any]:
        return self.queries, self.items


class ScoreDataRequest(ScoringRequestMixin):
    data_1: _Side
    data_2: _Side

    def pair(self) -> tuple[Any, Any]:
        return self.data_1, self.data_2


class ScoreTextRequest(ScoringRequestMixin):
    text_1: _Side
    text_2: _Side

    def pair(self) -> tuple[Any, Any]:
        return self.text_1, self.text_2


class RerankRequest(ScoringRequestMixin):
    query: ScoreInput
    documents: _Side
    top_n: int = Field(default=0, ge=0)

    def pair(self) -> tuple[Any, Any]:
        return self.query, self.documents


_ScoreRequest: TypeAdapter[Any] = TypeAdapter(
    ScoreQueriesDocumentsRequest | ScoreQueriesItemsRequest | ScoreDataRequest | ScoreTextRequest
)
_RerankRequest: TypeAdapter[Any] = TypeAdapter(RerankRequest)


@dataclass(frozen=True, slots=True)
class ScoreJob:
    """A validated score or rerank request: its texts as token ids, one engine request each (queries, then
    documents: `prompts`)."""

    model: str  # the name answered: the served model's or an adapter's
    rerank: bool
    queries: list[list[int]]
    documents: list[list[int]]
    texts: list[str]  # the documents as given (rerank's `document.text`)
    top_n: int  # rerank's, 0: all
    request_id: str | None  # the body's `request_id` (the response id falls back to it)

    @property
    def prompts(self) -> list[list[int]]:
        return [*self.queries, *self.documents]


# ---------------------------------------------------------------- validation
def _check_mm_kwargs(req: ScoringRequestMixin) -> None:
    """Stage 3: vLLM's `validate_request_mm_kwargs` (getattr: `media_io_kwargs` is an extra field here)."""
    for name, what in _KWARGS_WHAT.items():
        if getattr(req, name, None):
            raise vllm_error(UNTRUSTED_KWARGS.format(kind=name, what=what), name)


def _texts(side: Any, arch: str) -> list[str]:
    """One side as a list; a multimodal param is refused (stage 6: the catalog models read text only)."""
    items = side if isinstance(side, list) else [side]
    if any(not isinstance(x, str) for x in items):
        raise vllm_error(f"MultiModalParam is not supported for {arch}")
    return items


def _check_lengths(n_queries: int, n_documents: int) -> None:
    """vLLM's `_validate_score_input_lens`, its three checks in its order."""
    if n_queries > 1 and n_queries != n_documents:
        raise vllm_error(LENGTHS)
    if n_queries == 0:
        raise vllm_error(NO_QUERY)
    if n_documents == 0:
        raise vllm_error(NO_DOCUMENT)


def _token_limit(value: int, name: str, max_model_len: int) -> None:
    if value < 0:
        raise ApiError(400, f"{name} must be a non-negative integer")
    if value >= max_model_len:
        raise ApiError(400, f"{name} ({value}) must be less than max_model_len ({max_model_len}).")


def _cut(texts: list[str], max_tokens: int) -> list[str]:
    """vLLM's `truncate_text_to_tokens` with the pseudo-tokenizer: the longest prefix of ≤ max_tokens tokens."""
    return [t[: max_tokens * CHARS_PER_TOKEN] for t in texts] if max_tokens > 0 else texts


def _prompt(text: str, req: ScoringRequestMixin, max_model_len: int) -> list[int]:
    """Stage 8 for one text: `""` stays empty (for the engine's empty-prompt check, as embeddings')."""
    ids = fit_prompt(text_ids(text) if text else [], req, max_model_len)
    check_prompt_length(ids, True, max_model_len)
    return ids


def parse_scoring(
    body: Any,
    rerank: bool,
    served: str,
    arch: str,
    max_model_len: int,
    adapters: Collection[str] = (),
) -> ScoreJob:
    """Every check of the module docstring on the body's JSON value, in vLLM's order; raises ApiError
    (EngineInputError for stage 9)."""
    if isinstance(body, Mapping):
        check_cache_salt(body)
    try:
        # the JSON value as sent, as FastAPI validates it (from attributes: a non-object is
        # "model_attributes_type", once per member of the union)
        req = (_RerankRequest if rerank else _ScoreRequest).validate_python(body, from_attributes=True)
    except ValidationError as exc:
        raise union_error(exc) from None
    _check_mm_kwargs(req)
    model = req.model or served
    if model != served and model not in adapters:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens > max_model_len:
        raise ApiError(400, TRUNCATE_OVER_CONTEXT)
    side_1, side_2 = req.pair()
    queries, documents = _texts(side_1, arch), _texts(side_2, arch)
    _check_lengths(len(queries), len(documents))
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        if getattr(req, name):
            _token_limit(getattr(req, name), name, max_model_len)
    query_ids = [_prompt(t, req, max_model_len) for t in _cut(queries, req.max_tokens_per_query)]
    doc_ids = [_prompt(t, req, max_model_len) for t in _cut(documents, req.max_tokens_per_doc)]
    if any(not ids for ids in (*query_ids, *doc_ids)):
        raise EngineInputError(400, EMPTY_PROMPT)
    top_n = req.top_n if rerank else 0
    return ScoreJob(model, rerank, query_ids, doc_ids, documents, top_n, req.request_id)


# ---------------------------------------------------------------- scores
def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """a·b / (|a| |b|) in float64, rounded to float32 (vLLM's `F.cosine_similarity` on float32 tensors)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.float32(np.dot(a64, b64) / (np.linalg.norm(a64) * np.linalg.norm(b64))))


def pair_scores(job: ScoreJob, seed: int, dim: int) -> list[float]:
    """One score per document: against the single query (1:N) or against query i (N:N)."""
    queries = [embedding(seed, ids, dim) for ids in job.queries]
    if len(queries) == 1:
        queries = queries * len(job.documents)
    return [cosine(q, embedding(seed, ids, dim)) for q, ids in zip(queries, job.documents, strict=True)]


# ---------------------------------------------------------------- responses
def score_body(rid: str, created: int, job: ScoreJob, scores: Iterable[float], tokens: int) -> dict[str, Any]:
    """vLLM's ScoreResponse, keys in its order."""
    return {
        "id": rid, "object": "list", "created": created, "model": job.model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": usage_info(tokens),
    }  # fmt: skip


def rerank_body(rid: str, job: ScoreJob, scores: Sequence[float], tokens: int) -> dict[str, Any]:
    """vLLM's RerankResponse: results by score, highest first (a stable sort: ties keep document order), the
    first `top_n` when 0 < top_n < documents."""
    results = [
        {"index": i, "document": {"text": text, "multi_modal": None}, "relevance_score": s}
        for i, (text, s) in enumerate(zip(job.texts, scores, strict=True))
    ]
    results.sort(key=lambda r: r["relevance_score"], reverse=True)
    if 0 < job.top_n < len(results):
        results = results[: job.top_n]
    return {
        "id": rid, "model": job.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }  # fmt: skip
