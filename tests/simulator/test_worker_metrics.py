"""`/metrics` parsed with prometheus_client's own parser and checked against the engine's state."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.engine import EngineConfig
from simulator.worker_app import WorkerConfig

pytestmark = pytest.mark.anyio
M = "llama-3-8b"


def parse(text: str) -> dict[str, dict]:
    """{family name: {"type": ..., "samples": [(sample name, labels, value)]}}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = {"type": fam.type, "samples": [(s.name, s.labels, s.value) for s in fam.samples]}
    return out


def value(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    for name, lab, val in fams[family]["samples"]:
        if name == (sample or family) and all(lab.get(k) == v for k, v in labels.items()):
            return val
    raise KeyError((family, sample, labels))


async def test_metric_families_types_and_labels(asgi) -> None:
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1e4)) as (client, _):
        resp = await client.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    fams = parse(resp.text)
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter",
        "vllm:request_success": "counter", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
        "vllm:iteration_tokens_total": "histogram",
    }  # fmt: skip
    assert {name: fams[name]["type"] for name in expected} == expected
    for name in expected:
        for _sample, labels, _ in fams[name]["samples"]:
            assert labels["engine"] == "0"
            if name != "vllm:cache_config_info":
                assert labels["model_name"] == M
    info = fams["vllm:cache_config_info"]["samples"][0][1]
    # H100, Llama-3-8B, utilisation 0.9: 25,148 blocks of 16 (tests/placement/test_perf_model.py)
    assert (info["block_size"], info["num_gpu_blocks"], info["gpu_memory_utilization"]) == (
        "16",
        "25148",
        "0.9",
    )
    assert value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 0


async def test_gauges_follow_the_engine_while_streams_run(served) -> None:
    cfg = WorkerConfig(gpu="A100-80GB", model=M, time_scale=2.0, engine=EngineConfig(block_size=16))
    async with served(cfg) as w:
        eng = w.runtime.engine
        async with httpx.AsyncClient(timeout=30) as h:
            first_chunk = [asyncio.Event() for _ in range(3)]

            async def stream(i: int) -> None:
                body = {"model": M, "prompt": "y" * (40 * (i + 1)), "max_tokens": 60, "ignore_eos": True,
                        "stream": True}  # fmt: skip
                async with h.stream("POST", w.url + "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            first_chunk[i].set()

            tasks = [asyncio.create_task(stream(i)) for i in range(3)]
            await asyncio.gather(*(e.wait() for e in first_chunk))
            over_http = parse((await h.get(w.url + "/metrics")).text)
            # Rendered and compared with no await in between, so no engine step can run in the gap.
            scraped = parse(w.runtime.metrics.render().decode())
            running, used = eng.num_running, eng.kv.used
            await asyncio.gather(*tasks)
    assert value(over_http, "vllm:num_requests_running") == 3  # all three stream for ≈ 60 steps
    assert running == 3
    assert value(scraped, "vllm:num_requests_running") == 3
    assert value(scraped, "vllm:num_requests_waiting") == 0
    assert value(scraped, "vllm:kv_cache_usage_perc") == pytest.approx(
        used / (eng.num_gpu_blocks - 1)
    )  # less the null block
    assert used >= 1 + 1 + 1  # prompts of 10, 20, 30 tokens (+ outputs) hold at least a block each


async def test_counters_and_histograms_after_a_workload(asgi) -> None:
    # A small KV (12 blocks of 16 = 192 tokens) so that five 60-token prompts + 40 outputs must preempt.
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1e5,
                       engine=EngineConfig(num_gpu_blocks=13, block_size=16, max_model_len=192))  # fmt: skip
    async with asgi(cfg) as (client, rt):
        bodies = [
            {"model": M, "prompt": "z" * 240 + str(i), "max_tokens": 40, "ignore_eos": True} for i in range(5)
        ]
        results = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        fams = parse((await client.get("/metrics")).text)
        eng = rt.engine
    usages = [r.json()["usage"] for r in results]
    prompt_total = sum(u["prompt_tokens"] for u in usages)  # 241 chars → 61 tokens each
    gen_total = sum(u["completion_tokens"] for u in usages)
    assert prompt_total == 5 * 61 and gen_total == 5 * 40
    assert value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt_total
    assert value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == gen_total
    assert value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 5
    assert eng.counters.preemptions > 0
    assert value(fams, "vllm:num_preemptions", "vllm:num_preemptions_total") == eng.counters.preemptions
    assert value(fams, "vllm:kv_cache_usage_perc") == 0 and value(fams, "vllm:num_requests_running") == 0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_generation_tokens"):  # fmt: skip
        assert value(fams, name, name + "_count") == 5
    assert value(fams, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == gen_total
    # every token after a request's first is one inter-token gap: 5 × (40 − 1)
    assert value(fams, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 5 * 39
    # One observation per engine step (no prompt here is chunked, so every step emits a token); their sum is
    # as vLLM's: each prompt once plus every token generated, the KV that preemptions threw away and the
    # steps recomputed not counted.
    assert (
        value(fams, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") == eng.counters.steps
    )
    assert eng.counters.recomputed_tokens > 0
    iteration_sum = value(fams, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum")
    assert iteration_sum == prompt_total + gen_total
    le_inf = value(
        fams, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_bucket", le="+Inf"
    )
    assert le_inf == 5


async def test_iteration_tokens_count_a_chunked_prompt_whole_at_its_first_token(asgi) -> None:
    """vLLM observes an iteration only when it has outputs, and a prompt's computed tokens (less its prefix
    cache hit) at the step that emits its first token: a prompt prefilled in 64-token chunks is one
    observation of prompt + 1, and the same prompt again counts only the part the cache did not hold."""
    engine = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=64, block_size=16, enable_prefix_caching=True
    )
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1e5, engine=engine)
    body = {"model": M, "prompt": "z" * 800, "max_tokens": 3, "ignore_eos": True}
    async with asgi(cfg) as (client, rt):
        first = (await client.post("/v1/completions", json=body)).json()
        fams = parse((await client.get("/metrics")).text)
        steps = rt.engine.counters.steps
        prompt = first["usage"]["prompt_tokens"]
        assert prompt == 200 and steps == 4 + 2  # ceil(200 / 64) prefill chunks, then 2 decodes
        assert value(fams, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") == 3
        assert value(fams, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") == 201 + 1 + 1
        # the buckets stop at max_num_batched_tokens, as vLLM's: the whole prompt lands above them, as in vLLM
        assert (
            value(fams, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_bucket", le="64.0") == 2
        )
        assert (
            value(fams, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_bucket", le="+Inf") == 3
        )
        await client.post("/v1/completions", json=body)
        fams = parse((await client.get("/metrics")).text)
    hits = value(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert hits == 12 * 16  # every full block but the last: ≥ 1 prompt token is computed for the logits
    assert value(fams, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") == 6
    assert (
        value(fams, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum") == 203 + (200 - 192) + 3
    )


async def test_prefix_cache_counters_with_caching_on(asgi) -> None:
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1e5, engine=EngineConfig(enable_prefix_caching=True))
    async with asgi(cfg) as (client, _):
        body = {"model": M, "prompt": "q" * 200, "max_tokens": 2, "ignore_eos": True}  # 200 chars → 50 tokens
        for _ in range(2):
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        fams = parse((await client.get("/metrics")).text)
    # both look up 50 tokens; the second finds the first's 3 full blocks of 16 = 48 tokens
    assert value(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 100
    assert value(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 48
    info = fams["vllm:cache_config_info"]["samples"][0][1]
    assert info["enable_prefix_caching"] == "True"


async def test_request_success_has_every_finished_reason_of_vllm(asgi) -> None:
    """vLLM exports a `finished_reason` series per FinishReason (stop, length, abort, error, repetition), each
    from 0; the simulator never finishes with error or repetition, so those stay at 0."""
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1e4)) as (client, _):
        ok = await client.post("/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 2})
        fams = parse((await client.get("/metrics")).text)
    assert ok.status_code == 200
    series = {
        lab["finished_reason"]: val
        for name, lab, val in fams["vllm:request_success"]["samples"]
        if name == "vllm:request_success_total"
    }
    assert series == {"stop": 0, "length": 1, "abort": 0, "error": 0, "repetition": 0}
