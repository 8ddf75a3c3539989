"""Stream timings over real sockets (the gateway's fast path pushes the stream from its pooled upstream):
a scripted worker opens a chat stream with vLLM's role event, waits (the prefill), then sends its tokens
one per read. TTFT is the first token's, ITL one gap per token after it; the role event is neither."""

from __future__ import annotations

import asyncio
import json

import httpx

from server.config import validate_config
from server.runner import start_gateway_server
from tests.gateway.scripted_http import chunk, serve_chat_streams

MODEL = "llama-3-8b"
LEAD_S, GAP_S, TOKENS = 0.3, 0.05, 4


def _event(delta: dict[str, str]) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": None}
    return b"data: " + json.dumps({"id": "c", "model": MODEL, "choices": [choice]}).encode() + b"\n\n"


async def _stream(writer: asyncio.StreamWriter) -> None:
    """The role event, LEAD_S, then TOKENS tokens GAP_S apart, the usage event and [DONE]."""
    writer.write(chunk(_event({"role": "assistant", "content": ""})))
    await writer.drain()
    await asyncio.sleep(LEAD_S)
    for i in range(TOKENS):
        if i:
            await asyncio.sleep(GAP_S)
        writer.write(chunk(_event({"content": f"w{i} "})))
        await writer.drain()
    usage = {"prompt_tokens": 3, "completion_tokens": TOKENS, "total_tokens": 3 + TOKENS}
    tail = b"data: " + json.dumps({"id": "c", "choices": [], "usage": usage}).encode() + b"\n\n"
    writer.write(chunk(tail) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


async def _worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await serve_chat_streams(reader, writer, _stream)


def test_ttft_and_itl_over_real_sockets_leave_the_role_event_out() -> None:
    async def main() -> dict[str, float]:
        server = await asyncio.start_server(_worker, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = {"name": "p", "model": MODEL, "gpu": "H100", "role": "mixed"}
        config = validate_config(
            {
                "pools": [pool | {"endpoints": {"static": [f"http://127.0.0.1:{port}"]}}],
                "health": {"interval_s": 60},
                "scrape": {"interval_s": 60},
            },
            "test",
        )
        running = await start_gateway_server(config, "127.0.0.1", 0)
        try:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(running.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.text.count("data: ") == 1 + TOKENS + 1  # role, tokens, [DONE]
            await asyncio.sleep(0.1)  # the stream is accounted just after its last byte
            registry, labels = running.gateway.metrics.registry, {"model": MODEL, "pool": "p"}
            names = ("time_to_first_token", "inter_token_latency", "time_per_output_token")
            return {
                f"{n}_{part}": registry.get_sample_value(f"mosaic_{n}_seconds_{part}", labels) or 0.0
                for n in names
                for part in ("count", "sum")
            }
        finally:
            await running.stop()
            server.close()

    m = asyncio.run(main())
    assert m["time_to_first_token_count"] == 1 and m["time_to_first_token_sum"] >= LEAD_S
    assert m["inter_token_latency_count"] == TOKENS - 1  # was TOKENS: the lead was one gap
    assert m["inter_token_latency_sum"] < (TOKENS - 1) * GAP_S + 0.15
    assert m["time_per_output_token_count"] == 1
    assert m["time_per_output_token_sum"] < GAP_S + 0.05  # (last − first token) / (n − 1)
