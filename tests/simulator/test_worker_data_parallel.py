"""The simulated worker with `data_parallel_size` N: N engines behind one API server, as vLLM 0.32's
`--data-parallel-size`: the rank header pins, the balancer spreads, /metrics has a series per engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.data_parallel import DpBalancer, EngineLoad, requested_rank
from simulator.engine import EngineConfig
from simulator.worker_app import WorkerConfig, WorkerRuntime

pytestmark = pytest.mark.anyio
M = "llama-3-8b"
DP2 = WorkerConfig(
    gpu="H100", model=M, time_scale=1e6, data_parallel_size=2, engine=EngineConfig(num_gpu_blocks=64)
)
BODY = {"model": M, "prompt": "hello there", "max_tokens": 5, "ignore_eos": True}


def generated(rt: WorkerRuntime) -> list[int]:
    return [e.counters.generation_tokens for e in rt.engines]


def series(text: str) -> dict[str, set[str]]:
    """vLLM family → the `engine` labels its samples carry."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            out[family.name] = {s.labels.get("engine", "?") for s in family.samples}
    return out


@pytest.mark.parametrize(
    ("value", "rank"),
    [
        pytest.param(None, None, id="no header → balanced"),
        pytest.param("1", 1, id="an integer → that rank"),
        pytest.param("-1", -1, id="a negative integer → that rank (refused later as out of range)"),
        pytest.param("abc", None, id="not an integer → balanced, as vLLM's int() fallback"),
        pytest.param("1.0", None, id="a float → balanced"),
    ],
)
def test_the_rank_header_is_read_as_vllm_reads_it(value: str | None, rank: int | None) -> None:
    assert requested_rank(value) == rank


def load(waiting: int = 0, running: int = 0, kv: float = 0.0, in_flight: int = 0) -> EngineLoad:
    return EngineLoad(waiting, running, kv, in_flight)


@pytest.mark.parametrize(
    ("loads", "picks"),
    [
        pytest.param([load(), load()], [0, 1, 0, 1], id="idle engines: the scan start rotates, so ties alternate"),
        pytest.param([load(running=3), load(running=1)], [1, 1, 1], id="fewer waiting + running wins"),
        pytest.param([load(in_flight=2), load(running=1)], [1, 1], id="the API server's in-flight count is a floor"),
        # engine 0: 2 + 2 · 6 · (0.9 − 0.5) = 6.8; engine 1: 4 (its queue is on a half-empty cache: no penalty)
        pytest.param([load(waiting=2, kv=0.9), load(waiting=2, running=2, kv=0.5)], [1, 1],
                     id="a queue on a nearly full cache is penalised"),
        # engine 0: 1 + 1 · 6 · (0.6 − 0.5) = 1.6 < engine 1: 0 + 2 = 2
        pytest.param([load(waiting=1, kv=0.6), load(running=2)], [0, 0], id="a small penalty does not flip a clear win"),
    ],
)  # fmt: skip
def test_balancer_scores_like_vllms(loads: list[EngineLoad], picks: list[int]) -> None:
    balancer = DpBalancer()
    assert [balancer.pick(loads) for _ in picks] == picks


def test_data_parallel_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be an integer ≥ 1, got 0"):
        WorkerRuntime(WorkerConfig(gpu="H100", model=M, data_parallel_size=0))


async def test_metrics_carry_every_family_per_engine_and_the_summed_cache_config(asgi) -> None:
    async with asgi(DP2) as (client, rt):
        text = (await client.get("/metrics")).text
    families = series(text)
    assert families and all(labels == {"0", "1"} for labels in families.values()), families
    rows = [
        s.labels
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:cache_config_info"
        for s in f.samples
    ]
    # each engine has 64 blocks; every row says the server's 128, the override is the engine's own
    assert [(r["engine"], r["num_gpu_blocks"], r["num_gpu_blocks_override"]) for r in rows] == [
        ("0", "128", "64"),
        ("1", "128", "64"),
    ]
    assert [e.num_gpu_blocks for e in rt.engines] == [64, 64]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_the_rank_header_pins_the_engine(asgi, chat: bool, stream: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": M, "max_tokens": 5, "ignore_eos": True, "stream": stream}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    async with asgi(DP2) as (client, rt):
        for _ in range(3):
            r = await client.post(path, json=body, headers={"X-data-parallel-rank": "1"})
            assert r.status_code == 200
        assert generated(rt) == [0, 15]
        r = await client.post(path, json=body, headers={"X-data-parallel-rank": "0"})
        assert generated(rt) == [5, 15]


@pytest.mark.parametrize(
    ("size", "rank"),
    [
        pytest.param(2, "5", id="rank 5 of 2 engines"),
        pytest.param(2, "2", id="rank 2 of 2 engines (ranks start at 0)"),
        pytest.param(2, "-1", id="a negative rank"),
        pytest.param(1, "1", id="rank 1 of a server without data parallelism (vLLM checks it too)"),
    ],
)
async def test_an_out_of_range_rank_is_refused_as_vllm_refuses_it(asgi, size: int, rank: str) -> None:
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1e6, data_parallel_size=size)
    message = f"data_parallel_rank {rank} is out of range [0, {size})."
    error = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    async with asgi(cfg) as (client, rt):
        plain = await client.post("/v1/completions", json=BODY, headers={"X-data-parallel-rank": rank})
        stream = await client.post(
            "/v1/completions", json=BODY | {"stream": True}, headers={"X-data-parallel-rank": rank}
        )
        assert generated(rt) == [0] * size  # nothing ran
    assert (plain.status_code, plain.json()) == (400, error)
    # vLLM's engine checks run once the stream has begun: 200, the error event, then [DONE] (measured bytes)
    assert stream.status_code == 200
    assert stream.text == (
        f'data: {{"error": {{"message": "{message}", "type": "BadRequestError", "param": null, "code": 400}}}}'
        "\n\ndata: [DONE]\n\n"
    )


async def test_a_rank_in_range_is_served_on_a_server_without_data_parallelism(asgi) -> None:
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1e6)) as (client, rt):
        r = await client.post("/v1/completions", json=BODY, headers={"X-data-parallel-rank": "0"})
    assert r.status_code == 200 and rt.engine.counters.generation_tokens == 5


async def test_without_the_header_concurrent_requests_spread_over_both_engines(asgi) -> None:
    cfg = WorkerConfig(gpu="L4", model=M, time_scale=20.0, data_parallel_size=2)
    async with asgi(cfg) as (client, rt):
        body = BODY | {"max_tokens": 20}
        rs = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))
        assert [r.status_code for r in rs] == [200] * 6
        # each arrival sees the other engine less loaded (in flight 3 vs 2, …): three each
        assert generated(rt) == [60, 60]
        state = (await client.get("/sim/state")).json()
    assert state["data_parallel_size"] == 2 and state["num_gpu_blocks"] == 2 * rt.engine.num_gpu_blocks
    assert [e["counters"]["generation_tokens"] for e in state["engines"]] == [60, 60]
    assert state["counters"]["generation_tokens"] == 120 and state["counters"]["success"]["length"] == 6


async def test_state_of_one_engine_has_no_data_parallel_keys(asgi) -> None:
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1e6)) as (client, _):
        state = (await client.get("/sim/state")).json()
    assert "engines" not in state and "data_parallel_size" not in state


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream disconnect", "stream disconnect"])
async def test_a_disconnect_aborts_the_request_on_the_engine_running_it(served, stream: bool) -> None:
    cfg = WorkerConfig(gpu="L4", model=M, time_scale=1.0, data_parallel_size=2)  # ≈ 66 ms per token
    async with served(cfg) as w:
        other, pinned = w.runtime.engines
        body = {"model": M, "prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": stream}
        headers = {"X-data-parallel-rank": "1"}
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=0.3)) as h:
            if stream:
                async with h.stream("POST", w.url + "/v1/completions", json=body, headers=headers) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            break  # leave after the first token
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await h.post(w.url + "/v1/completions", json=body, headers=headers)
        assert pinned.counters.generation_tokens >= 1 and other.counters.steps == 0
        deadline = time.monotonic() + 5
        while pinned.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert pinned.num_running == 0 and pinned.kv.used == 0
        assert pinned.counters.success == {"stop": 0, "length": 0}  # an abort counts no success


async def test_prefill_on_a_pinned_engine_holds_there_and_is_released_there(served) -> None:
    cfg = WorkerConfig(
        gpu="H100", model=M, role="prefill", time_scale=100.0, engine_id="p", data_parallel_size=2
    )
    body = {
        "model": M, "prompt": "w" * 800, "max_tokens": 1,  # 200 tokens → 13 blocks
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }  # fmt: skip
    async with served(cfg) as p, httpx.AsyncClient(timeout=30) as h:
        e0, e1 = p.runtime.engines
        kvp = (
            await h.post(p.url + "/v1/completions", json=body, headers={"X-data-parallel-rank": "1"})
        ).json()["kv_transfer_params"]
        # vLLM suffixes each DP engine's KV-connector id with its rank; the release still goes to this server
        assert kvp["remote_engine_id"] == "p_dp1" and kvp["remote_port"] == p.port
        assert (e0.num_held, e1.num_held, e1.kv.used) == (0, 1, 13)
        released = await h.post(p.url + "/sim/kv/release", json={"remote_block_ids": kvp["remote_block_ids"]})
        assert released.json() == {"released_blocks": 13}
        assert (e1.num_held, e1.kv.used) == (0, 0)
