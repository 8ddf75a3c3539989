"""A streamed response whose consumer is slow (the socket's buffer full: uvicorn's send waits to drain) must
still carry every token: the engine keeps producing while the stream generator is paused at a yield."""

from __future__ import annotations

import asyncio
import json

import pytest

from simulator.protocol import parse_request
from simulator.worker_app import WorkerConfig, WorkerRuntime

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("n", [1, 3], ids=["one sequence", "n = 3"])
async def test_a_slow_consumer_gets_every_token_and_finish(n: int) -> None:
    runtime = WorkerRuntime(WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=20.0, seed=7))
    body = {
        "model": "llama-3-8b",
        "prompt": list(range(100, 140)),
        "n": n,
        "max_tokens": 20,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    api = parse_request(body, False, runtime.served)
    seqs = runtime._sequences(api, "cmpl-test", [20])
    tickets = await runtime.driver.submit_all([s.request for s in seqs], stream=True)
    tokens: dict[int, int] = {}
    finished: list[int] = []
    usage = None
    try:
        async for event in runtime._stream(api, "cmpl-test", seqs, tickets, cut=False):
            await asyncio.sleep(0.005)  # ≈ 1.3 engine steps at this time scale pass per event read
            if not event.startswith("data: {"):
                continue
            payload = json.loads(event.removeprefix("data: "))
            for choice in payload["choices"]:
                tokens[choice["index"]] = tokens.get(choice["index"], 0) + 1
                if choice["finish_reason"] is not None:
                    finished.append(choice["index"])
            if payload.get("usage"):
                usage = payload["usage"]["completion_tokens"]
    finally:
        await runtime.aclose()
    assert tokens == {i: 20 for i in range(n)}  # dropped 18 of 20 before
    assert sorted(finished) == list(range(n)) and usage == 20 * n
