"""Prompts of an exact length, and the OpenAI request bodies that carry them.

Completions (`/v1/completions`): the prompt is a list of token ids, so the server sees exactly
`input_tokens` tokens without a tokenizer on our side (vLLM accepts token-id prompts). Ids are drawn from
[1000, 30000): inside every supported vocabulary (Llama-2/Mistral 32k, Llama-3 128k, Qwen 152k) and above
the byte/special tokens.

Chat (`/v1/chat/completions`): the user message is text of `input_tokens` words from `WORDS`, common
three-letter English words that are each one token (with their leading space) in both the Llama-2
SentencePiece and the Llama-3 tiktoken vocabularies. With the separating spaces the text is
4·input_tokens − 1 characters, so tokenizer-free estimates of ceil(characters / 4) (the simulated
worker's, OpenAI's rule of thumb) count exactly `input_tokens` too. The server's chat template adds its
own few tokens around the message (the simulated worker's adds 6); exact input lengths need the
completions endpoint.

Prefix reproduction: a Mooncake hash id is one block of 512 tokens. Block `h` is drawn from an RNG seeded
by (seed, h), so the same id yields the same 512 ids (or words) in every request and every run with that
seed; requests sharing leading hash ids share their leading tokens exactly, as in the trace. Tokens past
the last hash id, and whole prompts of traces without hash ids, come from an RNG seeded by
(seed, request index): unique per request, so nothing is shared by accident.

Rerank (`/rerank`, vLLM's scoring API of a reranker or embedding model): the chat text's words split into a
query (its first `RERANK_QUERY_TOKENS` words, at most a fifth of them) and `documents` documents of nearly
equal length from the rest, every word sent once; nothing is generated, so the output length does not apply.

Output length: `max_tokens` = the trace's output length with `ignore_eos: true` (vLLM's sampling
extension), so the server generates exactly that many tokens; `stream_options.include_usage` asks for
the usage chunk that the metrics take token counts from.
"""

from __future__ import annotations

import itertools
import json
from functools import lru_cache

import numpy as np

from loadgen.schedule import ScheduledRequest

BLOCK_TOKENS = 512  # tokens per hash id (Mooncake FAST'25 traces)
RERANK_QUERY_TOKENS = 16  # a search query's length in words (one token each)
RERANK_DOCUMENTS = 4  # documents a rerank request scores, unless the replay says otherwise
TOKEN_ID_LOW, TOKEN_ID_HIGH = 1000, 30000

# fmt: off
# 64 three-letter words: one token each (with the leading space) in Llama-2/3 vocabularies, and 4 characters
# each with the separating space, so the 4-characters-per-token estimate (simulator, gateway) counts them exactly.
WORDS: tuple[str, ...] = (
    "the", "and", "for", "was", "not", "are", "his", "but", "had", "you", "one", "all", "can", "her", "has",
    "who", "she", "its", "may", "new", "two", "any", "now", "our", "man", "did", "way", "how", "too", "own",
    "see", "men", "get", "day", "use", "old", "off", "out", "end", "set", "put", "say", "why", "let", "big",
    "few", "far", "run", "yes", "top", "air", "car", "war", "law", "eye", "job", "art", "act", "age", "boy",
    "sea", "sun", "red", "low",
)
# fmt: on
_WORDS = np.array(WORDS)


def _rng(seed: int, kind: int, key: int, salt: int = 0) -> np.random.Generator:
    # SeedSequence mixes the integers into independent streams: (seed, block h) ≠ (seed, request h); a salt
    # (a later probe of the same requests) draws other ids, and salt 0 the ids it always drew.
    # a negative seed maps past every seed below 2**64 (seeds were cut to 32 bits: 0 and 2**32 drew the same)
    entropy = [seed if seed >= 0 else (1 << 64) - seed, kind, key & (2**63 - 1)] + (
        [salt & (2**63 - 1)] if salt else []
    )
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


class PromptBuilder:
    """Token ids and texts for scheduled requests, deterministic for `seed` and `salt` (salt > 0: other ids
    for the same requests, so a server's prefix cache cannot serve a repeated run from the last one)."""

    def __init__(self, seed: int = 0, salt: int = 0) -> None:
        self.seed = seed
        self.salt = salt
        self._block = lru_cache(maxsize=4096)(self._make_block)

    def _make_block(self, hash_id: int) -> np.ndarray:
        rng = _rng(self.seed, 1, hash_id, self.salt)
        return rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, BLOCK_TOKENS, dtype=np.int64)

    def _ids(self, req: ScheduledRequest) -> np.ndarray:
        """Symbol indices: the hash-id blocks first, then request-unique symbols up to input_tokens."""
        n = req.input_tokens
        parts = [self._block(h) for h in req.hash_ids[: -(-n // BLOCK_TOKENS)]]
        have = len(parts) * BLOCK_TOKENS
        if have < n:
            parts.append(
                _rng(self.seed, 2, req.index, self.salt).integers(
                    TOKEN_ID_LOW, TOKEN_ID_HIGH, n - have, dtype=np.int64
                )
            )
        return np.concatenate(parts)[:n] if parts else np.zeros(0, dtype=np.int64)

    def token_ids(self, req: ScheduledRequest) -> list[int]:
        """Exactly `req.input_tokens` token ids."""
        return self._ids(req).tolist()

    def text(self, req: ScheduledRequest) -> str:
        """Exactly `req.input_tokens` single-token words, space separated (same block → same words)."""
        return " ".join(_WORDS[self._ids(req) % len(WORDS)].tolist())


def rerank_split(words: list[str], documents: int) -> tuple[str, list[str]]:
    """(query, documents): the first `RERANK_QUERY_TOKENS` words (at most a fifth, at least one) and the rest
    cut into `documents` nearly equal documents (fewer when there are fewer words; a one-word input is its
    own document)."""
    q = max(1, min(RERANK_QUERY_TOKENS, len(words) // 5))
    rest = words[q:] or words[:q]
    k = max(1, min(documents, len(rest)))
    bounds = [len(rest) * i // k for i in range(k + 1)]
    return " ".join(words[:q]), [" ".join(rest[a:b]) for a, b in itertools.pairwise(bounds)]


def build_body(
    req: ScheduledRequest,
    endpoint: str,
    model: str,
    prompts: PromptBuilder,
    documents: int = RERANK_DOCUMENTS,
) -> bytes:
    """The JSON body of one request for `endpoint`: a streaming "completions" or "chat" request, an
    "embeddings" one (the trace's input as token ids) or a "rerank" one (its words as a query and
    `documents` documents); the output length does not apply to the last two."""
    body: dict[str, object] = {"model": model}
    if endpoint == "embeddings":
        body["input"] = prompts.token_ids(req)
        return json.dumps(body, separators=(",", ":")).encode()
    if endpoint == "rerank":
        body["query"], body["documents"] = rerank_split(prompts.text(req).split(), documents)
        return json.dumps(body, separators=(",", ":")).encode()
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompts.text(req)}]
    else:
        body["prompt"] = prompts.token_ids(req)
    body.update(
        max_tokens=req.output_tokens,
        ignore_eos=True,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    return json.dumps(body, separators=(",", ":")).encode()
