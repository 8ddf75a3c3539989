"""The gateway's per-request TPOT histogram on a known stream: (e2e − TTFT) / (n − 1), as vLLM and the load
generator define it, observed once per completed stream of ≥ 2 tokens, never for 1-token streams."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

import server.app
from server.app import create_app
from server.gateway import Gateway
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool

STEP_S = 0.045  # each token event arrives this long after the previous one (the gateway's clock)


class ManualClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class TickingWorker(FakeWorker):
    """Advances the gateway's clock by STEP_S before each token event it sends (none for usage / [DONE])."""

    clock: ManualClock = field(default_factory=ManualClock)

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        async for chunk in super()._stream(chat, n, usage):
            if b'"text"' in chunk:
                self.clock.t += STEP_S
            yield chunk


async def _streams(clock: ManualClock, lengths: list[int]) -> dict[str, float]:
    worker = TickingWorker("w", clock=clock)
    app = create_app(config(pool("p", "L4", "mixed", worker)), transport=FakeFleet(worker).transport)
    gw: Gateway = app.state.gateway
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10) as client,
    ):
        for n in lengths:
            body = {"model": "llama-3-8b", "prompt": "hi", "max_tokens": n, "stream": True}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    value = gw.metrics.registry.get_sample_value
    labels = {"model": "llama-3-8b", "pool": "p"}
    name = "mosaic_time_per_output_token_seconds"
    return {
        "count": value(f"{name}_count", labels) or 0.0,
        "sum": value(f"{name}_sum", labels) or 0.0,
        "le_0.04": value(f"{name}_bucket", {**labels, "le": "0.04"}) or 0.0,
        "le_0.05": value(f"{name}_bucket", {**labels, "le": "0.05"}) or 0.0,
        "ttft_sum": value("mosaic_time_to_first_token_seconds_sum", labels) or 0.0,
    }


def test_tpot_of_a_known_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ManualClock()
    monkeypatch.setattr(server.app, "Gateway", functools.partial(Gateway, clock=clock))
    out = asyncio.run(_streams(clock, [5, 1, 9]))
    # n = 5: first token at arrival + 0.045 (TTFT), last at arrival + 5 · 0.045 (e2e):
    # (5 · 0.045 − 0.045) / (5 − 1) = 0.045; n = 9 likewise 0.045; the 1-token stream has no TPOT
    assert out["count"] == 2
    assert out["sum"] == pytest.approx(2 * STEP_S)
    assert (out["le_0.04"], out["le_0.05"]) == (0.0, 2.0)  # both in the (0.04, 0.05] bucket
    assert out["ttft_sum"] == pytest.approx(3 * STEP_S)  # every stream's first token one step after arrival
