"""A burst of KV-heavy requests through a Mosaic gateway in front of a real vLLM server, and the server's
preemption counter around it (`test_kv_pressure.py`, `test_data_parallel.py`).

Each request: 200 distinct prompt token ids + 300 output tokens (`ignore_eos`) = 500 tokens = 4 blocks of 128.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from conftest import RealServer
from gateway_harness import API_KEY, MosaicGateway, static_config
from prometheus_client.parser import text_string_to_metric_families

from server.scrape import WorkerStats, parse_vllm_metrics

BURST = 8
PROMPT_TOKENS = 200
MAX_TOKENS = 300


def server_stats(server: RealServer) -> WorkerStats:
    with httpx.Client(timeout=30) as http:
        return parse_vllm_metrics(http.get(f"{server.url}/metrics").text)


def preemptions(server: RealServer) -> float:
    total = server_stats(server).preemptions_total
    assert total is not None
    return total


def queue_depth(metrics_text: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "mosaic_admission_queue_depth":
            return sum(s.value for s in family.samples)
    return 0.0


async def burst(gateway: MosaicGateway, model: str) -> tuple[list[httpx.Response], float]:
    """Send BURST requests at once; sample Mosaic's admission queue depth while they run. → (responses, max depth)"""
    headers = {"authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=300) as client:

        async def one(i: int) -> httpx.Response:
            # Distinct prompts (no prefix-cache sharing between them): ids 10+i .. 209+i.
            body = {
                "model": model,
                "prompt": [10 + i + k for k in range(PROMPT_TOKENS)],
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
            }
            return await client.post("/v1/completions", json=body)

        tasks = [asyncio.create_task(one(i)) for i in range(BURST)]
        depth = 0.0
        while not all(t.done() for t in tasks):
            depth = max(depth, queue_depth((await client.get("/metrics")).text))
            await asyncio.sleep(0.05)
        return [t.result() for t in tasks], depth


def run_burst(
    kv: dict[str, Any], server: RealServer, workdir: Path, max_num_seqs: int = 2
) -> tuple[list[httpx.Response], float, float]:
    """The burst through a gateway with `kv` settings → (responses, preemptions during it, max queue depth)."""
    extra = {"kv": kv, "limits": {"queue_deadline_s": 240.0, "first_token_timeout_s": 240.0}}
    config = static_config(server.model, [server.url], pool="kv-pressure", extra=extra)
    config["pools"][0]["max_num_seqs"] = max_num_seqs  # what the server runs with
    with MosaicGateway(config, workdir) as gateway:
        gateway.wait_ready()
        gateway.wait_worker_scraped()  # capacity comes from cache_config_info, so scrape before the burst
        before = preemptions(server)
        responses, depth = asyncio.run(burst(gateway, server.model))
        after = preemptions(server)
    return responses, after - before, depth


def assert_all_served(responses: list[httpx.Response]) -> None:
    assert [r.status_code for r in responses] == [200] * BURST, [
        r.text for r in responses if r.status_code != 200
    ]
    for r in responses:
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (PROMPT_TOKENS, MAX_TOKENS)
