"""P/D through the live gateway (real sockets, fake vLLM workers): the prefill worker's KV reservation is
released when the decode hop streams its first token (the decode side has pulled the KV) — for a
non-streaming answer, whose first token the gateway never sees, once the estimated TTFT has passed — not
when the request ends; the decode worker's stays until the end; every reservation ends exactly once."""

from __future__ import annotations

import asyncio

import httpx

from server.gateway import Gateway
from tests.gateway.fakes import FakeFleet, FakeWorker, pd_config
from tests.gateway.serverkit import GatewayThread

LONG_PROMPT = "word " * 400  # ≈ 500 estimated tokens: over the 256-token P/D threshold


def reserved_by_worker(gw: GatewayThread) -> dict[str, int]:
    """Reserved units per worker id, read on the gateway's own loop."""

    async def read(g: Gateway) -> dict[str, int]:
        assert g.ledger is not None
        return {wid: int(row["reserved_units"] or 0) for wid, row in g.ledger.snapshot().items()}

    return gw.call(read(gw.gateway))


def worker_ids(gw: GatewayThread) -> dict[str, str]:
    """Pool name → worker id."""
    return {rec.pool.name: rec.id for rec in gw.gateway.registry.records()}


def test_prefill_reservation_ends_at_the_decode_first_token() -> None:
    p = FakeWorker("p")
    d = FakeWorker("d", chunk_delay_s=0.4)  # 5 chunks: ≥ 1.6 s of stream after the first token
    fleet = FakeFleet(p, d)
    cfg = pd_config(p, d)
    body = {
        "model": "llama-3-8b",
        "messages": [{"role": "user", "content": LONG_PROMPT}],
        "max_tokens": 5,
        "stream": True,
    }
    with GatewayThread(cfg, transport=fleet.transport) as gw:
        ids = worker_ids(gw)
        with (
            httpx.Client(base_url=gw.url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            chunks = r.iter_raw()
            assert next(chunks).startswith(b"data: ")  # the decode hop's first token reached the client
            during = reserved_by_worker(gw)
            rest = b"".join(chunks)
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert p.seen and p.seen[0]["max_tokens"] == 1  # the prefill hop ran
        # mid-stream: the prefill worker holds nothing, the decode worker still holds the whole request
        assert during[ids["prefill"]] == 0
        assert during[ids["decode"]] > 0
        ledger = gw.gateway.ledger
        assert ledger is not None
        for _ in range(50):  # the stream is accounted just after its last byte
            if not ledger.active():
                break
            gw.call(asyncio.sleep(0.02))
        assert not ledger.active()
        assert ledger.stats.released == {"completed": 2}  # prefill (at first token) + decode (at the end)
        assert ledger.stats.double_releases == 0


def test_non_streaming_prefill_reservation_ends_at_the_estimated_first_token() -> None:
    """A non-streaming P/D answer arrives whole after 1.5 s of generation; the prefill worker's pages are
    released once the decode worker's estimated TTFT (well under 1 s here) has passed, at the next look at
    the fleet (the next routing decision), not held for the whole generation."""
    p = FakeWorker("p")
    d = FakeWorker("d", whole_delay_s=1.5)
    fleet = FakeFleet(p, d)
    cfg = pd_config(p, d)
    body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 5}

    async def during_generation(g: Gateway) -> dict[str, int]:
        await asyncio.sleep(0.8)
        g.registry.view()  # what the next routing decision does first
        assert g.ledger is not None
        return {wid: int(row["reserved_units"] or 0) for wid, row in g.ledger.snapshot().items()}

    with GatewayThread(cfg, transport=fleet.transport) as gw:
        ids = worker_ids(gw)
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            sent = asyncio.run_coroutine_threadsafe(during_generation(gw.gateway), gw.loop)
            r = http.post("/v1/chat/completions", json=body)
            during = sent.result(timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert p.seen and p.seen[0]["max_tokens"] == 1  # the prefill hop ran
        assert during[ids["prefill"]] == 0
        assert during[ids["decode"]] > 0
        ledger = gw.gateway.ledger
        assert ledger is not None
        for _ in range(50):
            if not ledger.active():
                break
            gw.call(asyncio.sleep(0.02))
        assert not ledger.active()
        assert ledger.stats.released == {"completed": 2}
        assert ledger.stats.double_releases == 0
