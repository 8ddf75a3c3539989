"""KV pressure on a real vLLM server: without Mosaic's reservation it preempts; with it, it does not.

Server: `--max-num-seqs 2 --num-gpu-blocks-override 8` → `cache_config_info` says 8 blocks of 128 tokens.
vLLM keeps one block as its null block, so 7 hold sequences. Burst: 8 concurrent requests of 200 prompt token
ids + 300 output tokens (`ignore_eos`), 500 tokens = ceil(500 / 128) = 4 blocks each.

- Without reservation (`kv: {enabled: false}`): the burst reaches vLLM; two sequences run, growing to 4 + 4 =
  8 blocks > 7 → vLLM preempts (`vllm:num_preemptions_total` rises; measured 1 preemption per pair).
- With reservation (`kv: {enabled: true, mode: worst_case}`, uniform footprint, capacity from
  `cache_config_info`): capacity = floor(8 · (1 − 0.02 watermark)) = 7 blocks, so one 4-block request is
  admitted at a time and the rest wait in Mosaic's admission queue: zero preemptions, all 8 succeed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RealServer
from gateway_harness import API_KEY, MosaicGateway, static_config
from prometheus_client.parser import text_string_to_metric_families

from server.scrape import parse_vllm_metrics

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

BURST = 8
PROMPT_TOKENS = 200
MAX_TOKENS = 300


def preemptions(server: RealServer) -> float:
    with httpx.Client(timeout=30) as http:
        total = parse_vllm_metrics(http.get(f"{server.url}/metrics").text).preemptions_total
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
    kv: dict[str, Any], server: RealServer, workdir: Path
) -> tuple[list[httpx.Response], float, float]:
    extra = {"kv": kv, "limits": {"queue_deadline_s": 240.0, "first_token_timeout_s": 240.0}}
    config = static_config(server.model, [server.url], pool="kv-pressure", extra=extra)
    config["pools"][0]["max_num_seqs"] = 2  # what the server runs with
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


def test_without_reservation_the_server_preempts(real_vllm_kv: RealServer, tmp_path: Path) -> None:
    responses, preempted, _ = run_burst({"enabled": False}, real_vllm_kv, tmp_path)
    assert_all_served(responses)  # vLLM recomputes preempted requests: they still finish, only later
    assert preempted >= 1


def test_with_reservation_no_preemption_and_requests_wait_in_mosaic(
    real_vllm_kv: RealServer, tmp_path: Path
) -> None:
    responses, preempted, depth = run_burst({"enabled": True, "mode": "worst_case"}, real_vllm_kv, tmp_path)
    assert_all_served(responses)
    assert preempted == 0
    # One request at a time fits (4 of 7 blocks): the other 7 arrive together and wait in Mosaic's queue.
    assert depth >= 3
