"""A simulated worker stopping with requests in flight ends them as vLLM does (its default
`--shutdown-timeout 0`): finish_reason "abort" — a whole answer as a 200, a stream with an empty last event and
`[DONE]`. Before, uvicorn's graceful-shutdown timeout cancelled the handlers: a plain-text 500 and a traceback
on the worker's stderr (CLI review)."""

from __future__ import annotations

import asyncio
import json

import httpx

from simulator.worker_app import WorkerConfig
from simulator.worker_server import start_worker_server

BODY = {"model": "llama-3-8b", "prompt": "hi", "max_tokens": 1500, "ignore_eos": True}


def test_requests_in_flight_end_with_finish_reason_abort() -> None:
    async def main() -> tuple[httpx.Response, list[str]]:
        worker = await start_worker_server(WorkerConfig(gpu="L4", model="llama-3-8b", time_scale=1.0))
        events: list[str] = []
        async with httpx.AsyncClient(base_url=worker.url, timeout=30) as client:

            async def stream() -> None:
                async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])

            whole = asyncio.create_task(client.post("/v1/completions", json=BODY))
            streamed = asyncio.create_task(stream())
            while worker.runtime.driver.inflight < 2 or not events:  # both running, the stream begun
                await asyncio.sleep(0.05)
            await worker.stop()
            await streamed
            return await whole, events

    whole, events = asyncio.run(asyncio.wait_for(main(), 60))
    assert whole.status_code == 200
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < whole.json()["usage"]["completion_tokens"] < 1500
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])["choices"][0]
    assert (last["text"], last["finish_reason"]) == ("", "abort")
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
