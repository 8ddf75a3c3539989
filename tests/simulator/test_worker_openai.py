"""The simulated worker through the real `openai` client over a real socket: completions and chat, streaming
and not, usage and include_usage, token-id prompts, natural EOS and min_tokens, SSE framing, pacing."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from simulator.engine import EngineConfig
from simulator.requests import EngineRequest, prompt_fingerprint, sample_natural_output
from simulator.tokens import render_chat, text_token_ids
from simulator.worker_app import WorkerConfig

pytestmark = pytest.mark.anyio
FAST = WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=1000.0, seed=7)
PROMPT = "The quick brown fox jumps over the lazy dog."  # 44 characters → ceil(44 / 4) = 11 tokens


def natural_length(ids: list[int], seed: int = 7) -> int:
    cfg = EngineConfig()
    fp = prompt_fingerprint(EngineRequest("x", ids, 1))
    return sample_natural_output(seed, fp, cfg.natural_output_mean, cfg.natural_output_shape)


async def test_completion_non_stream_usage_and_text(served) -> None:
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        r = await client.completions.create(
            model="llama-3-8b", prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True}
        )
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", r.id)
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (11, 12, 23)
    assert r.choices[0].finish_reason == "length"
    assert len(r.choices[0].text.split()) == 12  # one pseudo-word per token


async def test_token_id_prompt_counts_exactly_and_natural_eos_stops(served) -> None:
    ids = list(range(100, 137))  # 37 token ids
    expected = natural_length(ids)
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        r = await client.completions.create(model="llama-3-8b", prompt=ids, max_tokens=4000)
        longer = await client.completions.create(
            model="llama-3-8b", prompt=ids, max_tokens=4000, extra_body={"min_tokens": expected + 5}
        )
    assert r.usage is not None and longer.usage is not None
    assert r.usage.prompt_tokens == 37
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (expected, "stop")
    assert (longer.usage.completion_tokens, longer.choices[0].finish_reason) == (expected + 5, "stop")


async def test_completion_stream_with_include_usage(served) -> None:
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        stream = await client.completions.create(
            model="llama-3-8b", prompt=PROMPT, max_tokens=9, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        plain = await client.completions.create(
            model="llama-3-8b", prompt=PROMPT, max_tokens=9, extra_body={"ignore_eos": True}
        )
    content, last = chunks[:-1], chunks[-1]
    assert len(content) == 9  # one chunk per token
    assert [c.choices[0].finish_reason for c in content] == [None] * 8 + ["length"]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (11, 9)
    assert "".join(c.choices[0].text for c in content) == plain.choices[0].text  # same prompt, same words


async def test_chat_non_stream_and_stream_agree(served) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    prompt_tokens = len(text_token_ids(render_chat(messages)))
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        r = await client.chat.completions.create(
            model="llama-3-8b", messages=messages, max_completion_tokens=6, extra_body={"ignore_eos": True}
        )
        stream = await client.chat.completions.create(
            model="llama-3-8b", messages=messages, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", r.id)
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 6)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    first, content, usage = chunks[0], chunks[1:-1], chunks[-1]
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert len(content) == 6 and content[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in content) == r.choices[0].message.content
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 6


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("include_usage", [True, False])
async def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk_only_with_include_usage(
    served, chat: bool, include_usage: bool
) -> None:
    """As vLLM: `continuous_usage_stats` adds each chunk's usage so far (the chat role chunk's with 0
    completion tokens), and only when `include_usage` is on too; the final usage chunk is unchanged."""
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    messages = [{"role": "user", "content": PROMPT}]
    prompt = len(text_token_ids(render_chat(messages))) if chat else 11
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        common = {"model": "llama-3-8b", "max_tokens": 4, "stream": True, "stream_options": options}
        extra = {"extra_body": {"ignore_eos": True}}
        if chat:
            stream = await client.chat.completions.create(messages=messages, **common, **extra)
        else:
            stream = await client.completions.create(prompt=PROMPT, **common, **extra)
        chunks = [c async for c in stream]
    with_choices = [c for c in chunks if c.choices]
    if not include_usage:
        assert all(c.usage is None for c in chunks) and len(with_choices) == len(chunks)
        return
    so_far = [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) for c in with_choices]
    expected = [(prompt, n, prompt + n) for n in range(1, 5)]
    assert so_far == ([(prompt, 0, prompt)] if chat else []) + expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


async def test_models_and_health(served) -> None:
    cfg = WorkerConfig(
        gpu="L4", model="llama-3-8b", served_model_name="meta-llama/Meta-Llama-3-8B", time_scale=1e3
    )
    async with served(cfg) as w:
        async with openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
            models = await client.models.list()
        async with httpx.AsyncClient() as h:
            health = await h.get(w.url + "/health")
    assert [m.id for m in models.data] == ["meta-llama/Meta-Llama-3-8B"]
    assert health.status_code == 200


async def test_sse_framing_raw(served) -> None:
    async with served(FAST) as w, httpx.AsyncClient() as h:
        body = {"model": "llama-3-8b", "prompt": "hi", "max_tokens": 3, "ignore_eos": True, "stream": True}
        async with h.stream("POST", w.url + "/v1/completions", json=body) as resp:
            ctype = resp.headers["content-type"]
            raw = b"".join([part async for part in resp.aiter_raw()]).decode()
    assert ctype == "text/event-stream; charset=utf-8"
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert len(events) == 3 + 2  # three token events, [DONE], and the empty tail after the last separator
    assert all(e.startswith("data: {") for e in events[:3])


async def test_stream_is_paced_by_engine_step_times(served) -> None:
    """At time scale 1, a stream lasts about as long as the engine's simulated steps (not faster)."""
    cfg = WorkerConfig(gpu="A100-80GB", model="llama-3-8b", time_scale=1.0)
    async with served(cfg) as w:
        async with httpx.AsyncClient(timeout=30) as h:
            body = {
                "model": "llama-3-8b",
                "prompt": "hi",
                "max_tokens": 25,
                "ignore_eos": True,
                "stream": True,
            }
            stamps = []
            async with h.stream("POST", w.url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.monotonic())
        busy = w.runtime.engine.counters.busy_s
    # 25 steps of an A100 decode ≈ 25 × 11.7 ms ≈ 0.29 s of simulated = wall time; chunks cannot come faster
    assert len(stamps) == 25
    assert stamps[-1] - stamps[0] >= 0.8 * busy * 24 / 25
    assert stamps[-1] - stamps[0] <= busy + 1.0  # generous: a loaded CI machine


@pytest.mark.parametrize(
    "stream", [False, True], ids=["non-stream disconnect aborts", "stream disconnect aborts"]
)
async def test_client_disconnect_aborts_the_request(served, stream: bool) -> None:
    cfg = WorkerConfig(gpu="L4", model="llama-3-8b", time_scale=1.0)  # L4 decode ≈ 66 ms per token
    async with served(cfg) as w:
        eng = w.runtime.engine
        body = {
            "model": "llama-3-8b",
            "prompt": "hi",
            "max_tokens": 500,
            "ignore_eos": True,
            "stream": stream,
        }
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=0.3)) as h:
            if stream:
                async with h.stream("POST", w.url + "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            break  # leave after the first token
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await h.post(w.url + "/v1/completions", json=body)
        deadline = time.monotonic() + 5
        while eng.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert eng.num_running == 0 and eng.kv.used == 0
        assert eng.counters.success == {"stop": 0, "length": 0}  # vLLM counts no success for an abort


async def test_a_batch_of_prompts_with_n_completions_each(served) -> None:
    """vLLM's batch semantics: choice index = prompt · n + completion, usage counts each prompt once and
    every completion's tokens; every completion its own sequence in the engine (own answer, own EOS)."""
    prompts = [list(range(100, 137)), list(range(200, 210))]  # 37 and 10 token ids
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        r = await client.completions.create(
            model="llama-3-8b", prompt=prompts, n=2, max_tokens=6, extra_body={"ignore_eos": True}
        )
        natural = await client.completions.create(model="llama-3-8b", prompt=prompts[0], n=3, max_tokens=4000)
        counters = w.runtime.engine.counters
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and len(c.text.split()) == 6 for c in r.choices)
    assert r.choices[0].text != r.choices[1].text  # two samples of one prompt differ
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (37 + 10, 4 * 6)
    # completion 0 of a prompt is what n = 1 gives (natural EOS from the prompt); the others draw their own
    assert natural.usage is not None and natural.usage.prompt_tokens == 37
    lengths = [len(c.text.split()) for c in natural.choices]
    assert lengths[0] == natural_length(prompts[0]) and natural.usage.completion_tokens == sum(lengths)
    assert len(set(lengths)) > 1
    assert sum(counters.success.values()) == 4 + 3  # one engine request per sequence, as vLLM's children


async def test_n_completions_stream_one_choice_per_event(served) -> None:
    """Chat with n = 3, streamed: a role event per choice first, then each event one choice's token, every
    choice finished once, usage summed (the prompt once)."""
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        stream = await client.chat.completions.create(
            model="llama-3-8b",
            messages=[{"role": "user", "content": PROMPT}],
            n=3,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        one = await client.chat.completions.create(
            model="llama-3-8b", messages=[{"role": "user", "content": PROMPT}], max_tokens=1
        )
    assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
    assert all(c.choices[0].delta.role == "assistant" for c in chunks[:3])
    tokens = [c.choices[0] for c in chunks[3:-1]]
    assert all(len(c.choices) == 1 for c in chunks[3:-1])
    assert sorted(t.index for t in tokens) == [0] * 5 + [1] * 5 + [2] * 5
    assert sorted(t.index for t in tokens if t.finish_reason == "length") == [0, 1, 2]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and one.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (one.usage.prompt_tokens, 15)


async def test_a_chat_stream_opens_with_its_first_token_not_on_acceptance(served) -> None:
    """vLLM sends a chat stream's role event on the engine's first output (chat_completion serving's first
    iteration), so a client timing the first event (vLLM's benchmark, the gateway) sees the prefill. The
    worker sent it on acceptance: chat TTFT read ~0 and the prefill became one inter-token gap."""
    cfg = WorkerConfig(gpu="L4", model="llama-3-8b", time_scale=1.0)
    messages = [{"role": "user", "content": "word " * 1600}]  # ≈ 2,000 tokens: an L4 prefill of ~0.5 s
    body = {"model": "llama-3-8b", "messages": messages, "max_tokens": 2, "stream": True}
    events: list[tuple[float, dict]] = []
    async with served(cfg) as w, httpx.AsyncClient(timeout=30) as h:
        start = time.monotonic()
        async with h.stream("POST", w.url + "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    events.append((time.monotonic() - start, json.loads(line[6:])["choices"][0]["delta"]))
    (role_at, role), (token_at, token) = events[0], events[1]
    assert (role, set(token)) == ({"role": "assistant", "content": ""}, {"content"})
    assert token_at >= 0.2  # the prefill
    assert role_at >= 0.9 * token_at  # sent with the first token (was ~0.01 s)


async def test_x_request_id_header_names_the_response_and_may_repeat(served) -> None:
    """vLLM's response id is `cmpl-`/`chatcmpl-` + the X-Request-Id header (else the body's `request_id`, else
    random), on the body and on every chunk of a stream. Clients may repeat an id: two concurrent requests
    with the same header are both served (the engine gets its own unique id for each)."""
    hdr = {"X-Request-Id": "trace-42"}
    body = {"model": "llama-3-8b", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
    chat = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with served(FAST) as w, httpx.AsyncClient(base_url=w.url) as h:
        same = await asyncio.gather(*(h.post("/v1/completions", json=body, headers=hdr) for _ in range(2)))
        chatted = await h.post("/v1/chat/completions", json=chat, headers=hdr)
        by_body = await h.post("/v1/completions", json={**body, "request_id": "from-body"})
        streamed = await h.post("/v1/chat/completions", json={**chat, "stream": True}, headers=hdr)
        assert w.runtime.engine.num_running == 0
    assert [r.status_code for r in same] == [200, 200]
    assert [r.json()["id"] for r in same] == ["cmpl-trace-42", "cmpl-trace-42"]
    assert [r.json()["usage"]["completion_tokens"] for r in same] == [5, 5]
    assert chatted.json()["id"] == "chatcmpl-trace-42"
    assert by_body.json()["id"] == "cmpl-from-body"
    events = [json.loads(e[len("data: ") :]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
    assert len(events) == 1 + 3 and {e["id"] for e in events} == {"chatcmpl-trace-42"}


async def test_head_is_not_allowed_on_health_and_models(served) -> None:
    """vLLM's /health and /v1/models are FastAPI GET routes: HEAD → 405 (`Allow: GET`). Its /metrics is a
    mounted Prometheus app, which answers HEAD, and POST with the metrics as GET does."""
    async with served(FAST) as w, httpx.AsyncClient(base_url=w.url) as h:
        head_health, head_models, head_metrics = [
            await h.head(p) for p in ("/health", "/v1/models", "/metrics")
        ]
        get_health = await h.get("/health")
        post_metrics = await h.post("/metrics")
    assert (head_health.status_code, head_health.headers["allow"]) == (405, "GET")
    assert (head_models.status_code, head_models.headers["allow"]) == (405, "GET")
    assert head_metrics.status_code == get_health.status_code == 200
    assert post_metrics.status_code == 200 and "vllm:num_requests_running" in post_metrics.text
