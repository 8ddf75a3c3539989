"""End to end: an H100 and an L4 behind the gateway split saturating load by capacity, not 50/50.

Perf model (docs/routing.md), Llama-3-8B, 512 prompt / 128 output tokens: service time per request
s = 512/prefill_rate + 128/decode_rate ≈ 0.045 s on the H100 and ≈ 0.47 s on the L4, so the L4's
proportional share is ≈ (1/0.47) / (1/0.045 + 1/0.47) ≈ 9%. Under saturation `mosaic` should send the
L4 about that (somewhat less: it prefers the GPU that finishes sooner), round-robin half. The router
engineer asserts the exact split at the policy level (tests/scheduler/routing/test_load_split.py); here
the whole path runs: real sockets, simulated workers (time_scale 2), in-flight accounting, scraping.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server.config import validate_config
from server.runner import start_gateway_server

CONCURRENCY = 48
SECONDS = 3.0


async def _split(policy: str) -> tuple[float, int]:
    pools = [
        {
            "name": name,
            "model": "llama-3-8b",
            "gpu": gpu,
            "role": "mixed",
            "endpoints": {"simulated": {"replicas": 1, "time_scale": 2.0}},
        }
        for name, gpu in (("h100", "H100"), ("l4", "L4"))
    ]
    gw = await start_gateway_server(
        validate_config({"pools": pools, "routing": {"policy": policy}}), "127.0.0.1", 0
    )
    stop = time.monotonic() + SECONDS
    statuses: list[int] = []
    try:
        async with httpx.AsyncClient(
            base_url=gw.url, timeout=60, limits=httpx.Limits(max_connections=CONCURRENCY)
        ) as http:

            async def client(i: int) -> None:
                n = 0
                while time.monotonic() < stop:
                    body = {
                        "model": "llama-3-8b",
                        "prompt": [i, n, *[3] * 510],
                        "max_tokens": 128,
                        "ignore_eos": True,
                    }
                    statuses.append((await http.post("/v1/completions", json=body)).status_code)
                    n += 1

            tasks = [asyncio.create_task(client(i)) for i in range(CONCURRENCY)]
            await asyncio.wait(tasks, timeout=SECONDS + 0.5)
            for t in tasks:  # requests still queued on the slow GPU are abandoned (client disconnect)
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        sent = {r.pool.gpu: r.dispatched_total for r in gw.gateway.registry.records()}
    finally:
        await gw.stop()
    assert set(statuses) == {200}
    return sent["L4"] / (sent["L4"] + sent["H100-SXM"]), len(statuses)  # share of dispatches; completions


@pytest.mark.timeout(60)
def test_h100_and_l4_split_by_capacity_not_evenly() -> None:
    """Completions are counted in wall time, so each policy runs twice, interleaved, and its better run counts:
    alone on the machine `mosaic` finishes about twice what round-robin does (89-99 vs 46-47), but one run of
    each in a full suite once measured 44 vs 45 (a stall of the machine during the `mosaic` run)."""
    runs = [asyncio.run(_split(policy)) for policy in ("mosaic", "round-robin", "mosaic", "round-robin")]
    for share, _ in runs[0::2]:
        assert 0.005 <= share <= 0.2  # ≈ 9% proportional; measured 4-5% here (it favours the faster GPU)
    for share, _ in runs[1::2]:
        assert 0.4 <= share <= 0.6  # round-robin: half to the L4
    # and more requests finish in the same time
    assert max(done for _, done in runs[0::2]) > max(done for _, done in runs[1::2])
