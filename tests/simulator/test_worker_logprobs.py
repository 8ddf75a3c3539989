"""Log-probabilities from the simulated worker, through the real `openai` client: vLLM 0.32's shapes for
completions (`logprobs: k`) and chat (`logprobs` + `top_logprobs`), streamed and not, several sequences; the
pseudo-values are deterministic, consistent with the text, and ordered as a greedy decode's."""

from __future__ import annotations

import math

import openai
import pytest

from simulator.tokens import WORDS, pseudo_top_logprobs
from simulator.worker_app import WorkerConfig

pytestmark = pytest.mark.anyio
FAST = WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=1000.0, seed=7)
PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": "Say something."}]


def assert_greedy(top: list[tuple[str, float]]) -> None:
    """The sampled token leads, every candidate is a distinct pseudo-word, logprobs ≤ 0 and strictly falling."""
    words = [w for w, _ in top]
    assert len(set(words)) == len(words) and all(w.startswith(" ") and w[1:] in WORDS for w in words)
    lps = [lp for _, lp in top]
    assert all(-20 < lp < 0 for lp in lps) and lps == sorted(lps, reverse=True) and len(set(lps)) == len(lps)


@pytest.mark.parametrize("k", [0, 1, 3])
async def test_completion_logprobs_follow_the_text(served, k: int) -> None:
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        r = await client.completions.create(
            model="llama-3-8b", prompt=PROMPT, max_tokens=6, logprobs=k, extra_body={"ignore_eos": True}
        )
        again = await client.completions.create(
            model="llama-3-8b", prompt=PROMPT, max_tokens=6, logprobs=k, extra_body={"ignore_eos": True}
        )
    choice = r.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs or [], lp.top_logprobs, strict=True):
        assert len(top) == max(1, k)  # the sampled token and the top k: it is the top one, so k entries
        assert top[token] == logprob == max(top.values())
        assert_greedy(sorted(top.items(), key=lambda kv: -kv[1]))
    assert again.choices[0].logprobs == lp  # same seed, prompt and position: the same values


async def test_no_logprobs_unless_asked(served) -> None:
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        plain = await client.completions.create(model="llama-3-8b", prompt=PROMPT, max_tokens=3)
        chat_off = await client.chat.completions.create(
            model="llama-3-8b", messages=MESSAGES, max_tokens=3, logprobs=False, top_logprobs=0
        )
    assert plain.choices[0].logprobs is None and chat_off.choices[0].logprobs is None


@pytest.mark.parametrize("k", [None, 0, 2])
async def test_chat_logprobs_entries(served, k: int | None) -> None:
    extra = {} if k is None else {"top_logprobs": k}
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        r = await client.chat.completions.create(
            model="llama-3-8b", messages=MESSAGES, max_tokens=5, logprobs=True,
            extra_body={"ignore_eos": True}, **extra,
        )  # fmt: skip
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content and len(entries) == 5
    for e in entries:
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == (k or 0)  # vLLM lists the first k of the sampled-first candidates
        if e.top_logprobs:
            assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
            assert_greedy([(t.token, t.logprob) for t in e.top_logprobs])
            assert all(t.bytes == list(t.token.encode()) for t in e.top_logprobs)


async def test_streamed_logprobs_equal_the_whole_answer(served) -> None:
    """Each token's chunk carries that token's logprobs; completions' text_offset continues across chunks;
    chat's role event carries none. Concatenated, they are the non-streamed answer's."""
    body = {"model": "llama-3-8b", "max_tokens": 7, "extra_body": {"ignore_eos": True}}
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        whole = await client.completions.create(prompt=PROMPT, logprobs=2, **body)
        chunks = [
            c async for c in await client.completions.create(prompt=PROMPT, logprobs=2, stream=True, **body)
        ]
        chat_whole = await client.chat.completions.create(
            messages=MESSAGES, logprobs=True, top_logprobs=2, **body
        )
        chat_chunks = [
            c
            async for c in await client.chat.completions.create(
                messages=MESSAGES, logprobs=True, top_logprobs=2, stream=True, **body
            )
        ]
    parts = [c.choices[0].logprobs for c in chunks]
    assert all(p is not None and len(p.tokens or []) == 1 for p in parts)
    ref = whole.choices[0].logprobs
    assert ref is not None
    assert [p.tokens[0] for p in parts if p and p.tokens] == ref.tokens
    assert [p.text_offset[0] for p in parts if p and p.text_offset] == ref.text_offset
    assert [p.token_logprobs[0] for p in parts if p and p.token_logprobs] == ref.token_logprobs
    assert [p.top_logprobs[0] for p in parts if p and p.top_logprobs] == ref.top_logprobs
    assert chat_chunks[0].choices[0].delta.role == "assistant" and chat_chunks[0].choices[0].logprobs is None
    streamed = [e for c in chat_chunks[1:] for e in (c.choices[0].logprobs.content or [])]  # type: ignore[union-attr]
    assert chat_whole.choices[0].logprobs is not None
    assert streamed == chat_whole.choices[0].logprobs.content and len(streamed) == 7


async def test_several_sequences_each_carry_their_own(served) -> None:
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        r = await client.completions.create(
            model="llama-3-8b", prompt=[PROMPT, "Another prompt"], n=2, max_tokens=4, logprobs=1,
            temperature=1.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
    assert len(r.choices) == 4
    for choice in r.choices:
        assert choice.logprobs is not None and "".join(choice.logprobs.tokens or []) == choice.text
    assert len({tuple(c.logprobs.token_logprobs or []) for c in r.choices if c.logprobs}) == 4


def test_pseudo_top_logprobs_are_distinct_and_bounded() -> None:
    """Every count up to the vocabulary of pseudo-words gives distinct candidates (the walk's step is coprime
    to it); a count outside [1, len(WORDS)] is refused."""
    for count in (1, 2, 20, len(WORDS)):
        for top in pseudo_top_logprobs(3, 99, 0, 40, count):
            assert len(top) == count and len({w for w, _ in top}) == count
            assert all(math.isfinite(lp) and lp < 0 for _, lp in top)
    with pytest.raises(ValueError, match="count must be in"):
        pseudo_top_logprobs(3, 99, 0, 1, 0)
