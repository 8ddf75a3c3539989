"""P/D: the prefill→decode handshake between two simulated workers on real sockets (NixlConnector protocol)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from simulator.worker_app import WorkerConfig

pytestmark = pytest.mark.anyio
M = "llama-3-8b"
PROMPT = "w" * 800  # 800 chars → 200 tokens → ceil(200 / 16) = 13 blocks


def prefill_body(stream: bool = False) -> dict:
    """What a P/D proxy sends the prefill worker (REFERENCE.md: max_tokens 1, no stream, do_remote_decode)."""
    return {
        "model": M, "prompt": PROMPT, "max_tokens": 1, "max_completion_tokens": 1, "stream": stream,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None},
    }  # fmt: skip


async def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_prefill_then_decode_handshake(served) -> None:
    pcfg = WorkerConfig(gpu="H100", model=M, role="prefill", time_scale=100.0, engine_id="prefill-0")
    dcfg = WorkerConfig(gpu="L4", model=M, role="decode", time_scale=100.0, kv_link_gbps=10.0)
    async with served(pcfg) as p, served(dcfg) as d, httpx.AsyncClient(timeout=30) as h:
        first = (await h.post(p.url + "/v1/completions", json=prefill_body())).json()
        kvp = first["kv_transfer_params"]
        assert first["usage"]["completion_tokens"] == 1
        assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
        assert kvp["remote_engine_id"] == "prefill-0"
        assert (kvp["remote_host"], kvp["remote_port"]) == ("127.0.0.1", p.port)
        assert len(kvp["remote_block_ids"]) == 13
        pe = p.runtime.engine
        assert pe.num_held == 1 and pe.kv.used == 13  # held for the decode side

        body = {"model": M, "prompt": PROMPT, "max_tokens": 20, "ignore_eos": True, "kv_transfer_params": kvp}
        second = (await h.post(d.url + "/v1/completions", json=body)).json()
        assert second["usage"] == {"prompt_tokens": 200, "completion_tokens": 20, "total_tokens": 220,
                                   "prompt_tokens_details": None}  # fmt: skip
        assert second["kv_transfer_params"] is None
        # the decode side told the prefill side to free the blocks
        assert await wait_for(lambda: pe.num_held == 0)
        assert pe.kv.used == 0
        de = d.runtime.engine
        # The decode worker computed only the last prompt token, then 19 decodes: 20 steps, whose observed
        # tokens are (as vLLM's) that prompt token and the 20 generated.
        assert de.counters.steps == 20
        assert d.runtime.metrics.iteration_tokens.sum == 1 + 20
        # its TTFT includes pulling 200 · 128 KiB = 26.2 MB at 10 GB/s = 2.6 ms of simulated time
        ttft_sum = d.runtime.metrics.ttft.sum
        assert ttft_sum >= 200 * 131072 / 10e9


async def test_unfetched_kv_is_freed_after_the_hold_timeout(served) -> None:
    cfg = WorkerConfig(gpu="H100", model=M, role="prefill", time_scale=100.0, kv_hold_timeout_s=2.0)
    async with served(cfg) as p, httpx.AsyncClient(timeout=30) as h:
        first = (await h.post(p.url + "/v1/completions", json=prefill_body())).json()
        assert first["kv_transfer_params"]["remote_block_ids"]
        eng = p.runtime.engine
        assert eng.num_held == 1
        await asyncio.sleep(0.05)  # 2 s of simulated time at scale 100 = 20 ms of wall time
        text = (await h.get(p.url + "/metrics")).text  # a scrape expires stale holds first
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="llama-3-8b"} 0.0' in text
        assert eng.num_held == 0


async def test_a_mixed_worker_ignores_kv_transfer_params(asgi) -> None:
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1e4)) as (client, rt):
        resp = await client.post("/v1/completions", json=prefill_body())
    assert resp.status_code == 200 and resp.json()["kv_transfer_params"] is None
    assert rt.engine.num_held == 0 and rt.engine.kv.used == 0


async def test_release_endpoint_by_block_ids(asgi) -> None:
    async with asgi(WorkerConfig(gpu="H100", model=M, role="prefill", time_scale=1e4)) as (client, rt):
        kvp = (await client.post("/v1/completions", json=prefill_body())).json()["kv_transfer_params"]
        freed = await client.post("/sim/kv/release", json={"remote_block_ids": kvp["remote_block_ids"]})
        again = await client.post("/sim/kv/release", json={"remote_block_ids": kvp["remote_block_ids"]})
    assert freed.json() == {"released_blocks": 13} and again.json() == {"released_blocks": 0}
    assert rt.engine.kv.used == 0


@pytest.mark.parametrize("freed_by", ["release", "timeout"])
async def test_a_request_waiting_for_held_kv_is_served_when_the_hold_goes(asgi, freed_by: str) -> None:
    """A prefill worker whose KV is all held for decode sides: a new request waits. Freeing the hold (the
    decode side's release, or its timeout) admits it with no other traffic; before, the idle engine slept
    until the next arrival."""
    from simulator.engine import EngineConfig

    timeout = 1e6 if freed_by == "release" else 2.0  # simulated seconds; 2 s is 0.2 s of wall time here
    cfg = WorkerConfig(
        gpu="H100", model=M, role="prefill", time_scale=10.0, kv_hold_timeout_s=timeout,
        engine=EngineConfig(num_gpu_blocks=17, max_model_len=256),  # 16 usable
    )  # fmt: skip
    async with asgi(cfg) as (client, rt):
        kvp = (await client.post("/v1/completions", json=prefill_body())).json()["kv_transfer_params"]
        assert len(kvp["remote_block_ids"]) == 13 and rt.engine.kv.used == 13
        second = asyncio.ensure_future(client.post("/v1/completions", json=prefill_body()))
        assert await wait_for(lambda: rt.engine.num_waiting == 1)  # 13 more blocks do not fit in 16
        await asyncio.sleep(0.05)
        assert rt.engine.num_waiting == 1 and not second.done()
        if freed_by == "release":
            await client.post("/sim/kv/release", json={"remote_block_ids": kvp["remote_block_ids"]})
        answer = await asyncio.wait_for(second, 2.0)
    assert answer.status_code == 200 and answer.json()["kv_transfer_params"]["remote_block_ids"]


async def test_a_decode_request_aborted_before_its_kv_lands_frees_the_prefill_hold(served) -> None:
    """The decode side's client leaves while the KV is in flight: the prefill side is told to free its hold
    (vLLM's NIXL connector notifies it), not left holding it for kv_hold_timeout_s."""
    pcfg = WorkerConfig(gpu="H100", model=M, role="prefill", time_scale=10.0)
    dcfg = WorkerConfig(gpu="L4", model=M, role="decode", time_scale=10.0, kv_link_gbps=0.01)
    async with served(pcfg) as p, served(dcfg) as d, httpx.AsyncClient(timeout=30) as h:
        kvp = (await h.post(p.url + "/v1/completions", json=prefill_body())).json()["kv_transfer_params"]
        assert p.runtime.engine.num_held == 1
        body = {"model": M, "prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": kvp}
        # 200 tokens · 128 KiB at 0.01 GB/s ≈ 2.6 s simulated ≈ 0.26 s wall: leave after 0.1 s
        with pytest.raises(httpx.ReadTimeout):
            await h.post(d.url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.1))
        assert await wait_for(lambda: d.runtime.engine.num_waiting == 0 and d.runtime.engine.kv.used == 0)
        assert await wait_for(lambda: p.runtime.engine.num_held == 0, timeout=2.0)
        assert p.runtime.engine.kv.used == 0
