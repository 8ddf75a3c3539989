"""The context a worker serves (vLLM's --max-model-len, on its /v1/models card) over the pool's configured or
catalog one: a Llama-3.1 pool is 128k by the catalog and often served at 8k; a CPU vLLM here at 512. The
gateway advertised and routed on the catalog's context: its /v1/models said 8192 where vLLM said 512, and it
forwarded prompts only the worker then refused."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from server.config import validate_config
from server.runner import start_gateway_server
from simulator.engine_types import EngineConfig
from simulator.worker_app import WorkerConfig
from simulator.worker_server import start_worker_server


async def _run() -> dict[str, Any]:
    worker = await start_worker_server(WorkerConfig(time_scale=50.0, engine=EngineConfig(max_model_len=512)))
    try:
        pool = {"name": "p", "model": "llama-3-8b", "gpu": "H100", "endpoints": {"static": [worker.url]}}
        cfg = validate_config({"pools": [pool], "health": {"interval_s": 0.2}, "scrape": {"interval_s": 0.2}})
        running = await start_gateway_server(cfg, "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
                card = (await client.get("/v1/models")).json()["data"][0]
                (rec,) = running.gateway.registry.records()
                over = {"model": "llama-3-8b", "prompt": list(range(100, 700)), "max_tokens": 4}
                refused = await client.post("/v1/completions", json=over)
                fits = await client.post(
                    "/v1/completions", json={**over, "prompt": list(range(100, 400)), "max_tokens": 4}
                )
                chat = await client.post(
                    "/v1/chat/completions",
                    json={"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}]},
                )
            return {
                "card": card,
                "view": rec.cached_view(running.gateway.clock(), 60.0).capacity.max_model_len,
                "refused": (refused.status_code, refused.json()),
                "fits": fits.status_code,
                "chat": chat.status_code,
            }
        finally:
            await running.stop()
    finally:
        await worker.stop()


def test_the_gateway_routes_and_advertises_the_context_its_worker_serves() -> None:
    out = asyncio.run(_run())
    assert out["card"]["max_model_len"] == 512  # was the catalog's 8192
    assert out["view"] == 512
    status, body = out["refused"]
    # refused by the gateway itself, on the worker's own limit (a 600-token prompt; vLLM's words and param)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert body["error"]["param"] == "input_tokens"
    assert "512" in body["error"]["message"]
    assert out["fits"] == 200
    # chat without max_tokens: the default output is the rest of the worker's 512-token context, which
    # vLLM serves (reserved as such by the gateway), not the rest of 8192
    assert out["chat"] == 200
