"""The simulated worker's stand-in for a tokenizer: prompt token estimates and deterministic pseudo-word output.

Text prompts. There is no real tokenizer, so a text is cut into pieces of `CHARS_PER_TOKEN` (4) characters,
OpenAI's rule of thumb for English (≈ 0.75 words per token); each piece becomes one pseudo token id (a
CRC-32 of the piece, modulo the vocabulary). So `count_text_tokens(text) = max(1, ceil(len(text) / 4))`,
identical texts give identical ids (prefix-caching and natural-length draws behave as with a real
tokenizer), and a gateway can reproduce the count exactly with the same formula. Token-id prompts (a list
of ints on /v1/completions) are used as they are, so their count is exact.

Chat prompts are rendered with a fixed template before counting, mimicking the framing tokens a real chat
template adds: `<|role|>\\n{content}\\n` per message, then `<|assistant|>\\n`.

Output text. Token i of a request is the pseudo-word `WORDS[h(seed, prompt fingerprint, i) % len(WORDS)]`
with a leading space: deterministic for a seed and prompt, one word per token.

Log-probabilities (`logprobs` requested). There is no model, so they are pseudo-values with the shape a
greedy decode has: token i is the most likely candidate at its step, its logprob a draw in (−4, −0.05], and
the alternatives are other pseudo-words, each less likely than the one before by a draw in [0.1, 2.1).
Deterministic for a seed, prompt and position, like the words themselves.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CHARS_PER_TOKEN = 4
VOCAB_SIZE = 128_256  # Llama-3's vocabulary size; ids only need to be stable, not meaningful

# fmt: off
WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not",
    "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you", "were", "her",
    "she", "there", "been", "one", "all", "we", "their", "has", "would", "when", "if", "so", "no", "will",
    "more", "can", "out", "up", "into", "its", "time", "only", "other", "new", "some", "could", "these", "two",
    "may", "then", "first", "any", "like", "now", "my", "such", "over", "our", "even", "most", "made", "after",
    "also", "did", "many", "well", "way", "down", "back", "should", "because", "each", "just", "those",
    "people", "how", "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men",
    "work", "long", "here", "get", "both", "between", "life", "being", "under", "never", "day", "same",
    "another", "know", "while", "last", "might", "great", "old", "year", "off", "come", "since", "against",
    "go", "came", "right", "used", "take", "three", "small", "large", "next", "early", "young", "important",
    "few", "public", "bad", "able", "model", "token", "cache", "page", "block", "batch", "prefill", "decode",
    "route", "worker", "queue", "stream", "latency", "kernel", "tensor", "memory", "bandwidth", "compute",
    "budget",
)
# fmt: on
_MASK64 = (1 << 64) - 1


def count_text_tokens(text: str) -> int:
    """max(1, ceil(len(text) / 4)): the documented estimate (see module docstring)."""
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def text_token_ids(text: str) -> list[int]:
    """One pseudo id per 4-character piece; an empty text is one id (like a BOS token)."""
    if not text:
        return [0]
    crc = zlib.crc32
    return [
        crc(text[i : i + CHARS_PER_TOKEN].encode()) % VOCAB_SIZE for i in range(0, len(text), CHARS_PER_TOKEN)
    ]


def message_text(content: Any) -> str:
    """The text of a chat message's `content`: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    raise TypeError("message content must be a string, a list of content parts or null")


def render_chat(messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The simulated chat template: `<|role|>\\n{content}\\n` per message, then (unless told not to, as
    vLLM's `add_generation_prompt: false`) the assistant header."""
    out = []
    for m in messages:
        out.append(f"<|{m.get('role', 'user')}|>\n{message_text(m.get('content'))}\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


def id_text(token_id: int) -> str:
    """The text the simulator gives a token id (`/detokenize`): a pseudo-word with its leading space."""
    return " " + WORDS[token_id % len(WORDS)]


def fingerprint(ids: Sequence[int]) -> int:
    """Stable 32-bit key of a token-id sequence (seeds the pseudo-words of the answer)."""
    return zlib.crc32(b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in ids))


def _answer_base(seed: int, fp: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + fp * 0xBF58476D1CE4E5B9) & _MASK64


def _mix(z: int) -> int:
    """SplitMix64's finaliser: one well-spread 64-bit draw per input."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _unit(z: int) -> float:
    """A draw in [0, 1) from the top 53 bits of `z`."""
    return (z >> 11) / 2**53


def _word_index(base: int, i: int) -> int:
    z = (base + i * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 31)) * 0xD6E8FEB86659FD93) & _MASK64
    return (z >> 32) % len(WORDS)


def pseudo_words(seed: int, fp: int, start: int, stop: int) -> list[str]:
    """Tokens start..stop−1 of the answer to a prompt with fingerprint `fp`, each ' word'."""
    base = _answer_base(seed, fp)
    return [" " + WORDS[_word_index(base, i)] for i in range(start, stop)]


def pseudo_top_logprobs(
    seed: int, fp: int, start: int, stop: int, count: int
) -> list[list[tuple[str, float]]]:
    """For tokens start..stop−1 of the answer (as `pseudo_words`), the `count` (≥ 1) most likely candidates
    at each step, most likely first: the token itself, then other pseudo-words (module docstring)."""
    n = len(WORDS)
    if not 1 <= count <= n:
        raise ValueError(f"count must be in [1, {n}], got {count}")
    base = _answer_base(seed, fp)
    out = []
    for i in range(start, stop):
        chosen = _word_index(base, i)
        z = _mix(((base ^ 0xA0761D6478BD642F) + i * 0xE7037ED1A0B428DB) & _MASK64)
        logprob = -0.05 - 3.95 * _unit(z)
        top = [(" " + WORDS[chosen], logprob)]
        # the alternatives walk the other words with a step coprime to n: count ≤ n never repeats one
        step = 1 + z % (n - 1)
        while math.gcd(step, n) != 1:
            step += 1
        for j in range(1, count):
            z = _mix(z + j)
            logprob -= 0.1 + 2.0 * _unit(z)
            top.append((" " + WORDS[(chosen + j * step) % n], logprob))
        out.append(top)
    return out
