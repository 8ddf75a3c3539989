"""Data-parallel vLLM workers through the gateway: KV booked per engine, each hop pinned with
`X-data-parallel-rank` (fake vLLM workers behind `httpx.MockTransport`, the app in-process).

Each fake DP worker has two engines of 500 blocks of 16 tokens, reported as vLLM 0.32 does: one
`cache_config_info` row per `engine` label, each carrying the server's total (1,000), and one usage series per
engine; the ledger may reserve floor(500 · 0.98) = 490 per engine. A request of 4,700 prompt tokens and 8 output tokens needs ceil(4708 / 16) = 295 blocks: one per
engine, two per worker, where the worker-wide sum (980) would admit three.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from server.app import create_app
from server.gateway import Gateway
from server.proxy import DP_RANK_HEADER
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool

RANK = DP_RANK_HEADER.decode()
BODY = {"model": "llama-3-8b", "prompt": [5] * 4700, "max_tokens": 8, "stream": True}


def two_engines(model: str = "llama-3-8b", total_blocks: int = 1000) -> str:
    lines = ["# TYPE vllm:cache_config_info gauge"]
    lines += [
        f'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="{total_blocks}"}} 1.0'
        for e in "01"
    ]
    for family, value in (
        ("num_requests_running", 0.0),
        ("num_requests_waiting", 0.0),
        ("kv_cache_usage_perc", 0.0),
    ):
        lines.append(f"# TYPE vllm:{family} gauge")
        lines += [f'vllm:{family}{{engine="{e}",model_name="{model}"}} {value}' for e in "01"]
    return "\n".join(lines) + "\n"


def dp_worker(name: str, **kw: Any) -> FakeWorker:
    return FakeWorker(name, metrics_text=two_engines(), **kw)


def peak_per_engine(gw: Gateway, peaks: dict[tuple[str, int | None], int]) -> None:
    """Record, after every reservation, the most concurrent reservations each (worker, engine) held."""
    ledger = gw.ledger
    assert ledger is not None
    reserve = ledger.reserve

    def watched(req: Any, worker: Any, now: float) -> Any:
        res = reserve(req, worker, now)
        counts: dict[tuple[str, int | None], int] = {}
        for r in ledger.active():
            counts[(r.worker_id, r.engine)] = counts.get((r.worker_id, r.engine), 0) + 1
        for key, n in counts.items():
            peaks[key] = max(peaks.get(key, 0), n)
        return res

    ledger.reserve = watched  # type: ignore[method-assign]


async def _three(cfg: Any, fleet: FakeFleet, peaks: dict[tuple[str, int | None], int]) -> list[int]:
    app = create_app(cfg, transport=fleet.transport)
    gw: Gateway = app.state.gateway
    peak_per_engine(gw, peaks)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30)
    async with app.router.lifespan_context(app), client as c:
        rs = await asyncio.gather(
            *(c.post("/v1/completions", json=BODY, headers={"X-Request-Id": f"r{i}"}) for i in range(3))
        )
        assert gw.ledger is not None and not gw.ledger.active()
        assert gw.ledger.stats.double_releases == 0
        [row, *_] = (await c.get("/admin/workers")).json()["workers"]  # JSON all the way down
        assert row["stats"]["engine_views"] == [
            {"rank": 0, "num_gpu_blocks": 500, "kv_usage": 0.0, "preemptions_total": None},
            {"rank": 1, "num_gpu_blocks": 500, "kv_usage": 0.0, "preemptions_total": None},
        ]
        return [r.status_code for r in rs]


def test_each_request_is_pinned_to_the_engine_it_was_booked_on() -> None:
    w = dp_worker("dp", chunk_delay_s=0.1)
    cfg = config(pool("p", "L4", "mixed", w), limits={"queue_deadline_s": 20})
    peaks: dict[tuple[str, int | None], int] = {}
    assert asyncio.run(asyncio.wait_for(_three(cfg, FakeFleet(w), peaks), 60)) == [200, 200, 200]
    ranks = [h.get(RANK) for h in w.headers_seen]
    assert sorted(ranks[:2]) == ["0", "1"]  # the first two: one on each engine
    assert ranks[2] in ("0", "1")  # the third waited for an engine to free, then went there
    assert peaks == {("p/dp:8000", 0): 1, ("p/dp:8000", 1): 1}  # never two 295-block requests on one engine


def test_pooled_books_the_sum_and_lets_vllm_pick() -> None:
    w = dp_worker("dp", chunk_delay_s=0.1)
    cfg = config(pool("p", "L4", "mixed", w), kv={"data_parallel": "pooled"}, limits={"queue_deadline_s": 20})
    peaks: dict[tuple[str, int | None], int] = {}
    assert asyncio.run(asyncio.wait_for(_three(cfg, FakeFleet(w), peaks), 60)) == [200, 200, 200]
    assert all(RANK not in h for h in w.headers_seen)  # no pin: vLLM's own balancer
    assert list(peaks.values()) == [3]  # all three at once on the 980-block sum (one engine must preempt)


def test_pd_pins_the_prefill_and_the_decode_hop_each_to_its_own_engine() -> None:
    p, d = dp_worker("pre"), dp_worker("dec")
    cfg = config(pool("prefill", "H100", "prefill", p), pool("decode", "L4", "decode", d))
    peaks: dict[tuple[str, int | None], int] = {}

    async def run() -> list[int]:
        return await _three(cfg, FakeFleet(p, d), peaks)

    assert asyncio.run(asyncio.wait_for(run(), 60)) == [200, 200, 200]
    assert len(p.headers_seen) == 3 and len(d.headers_seen) == 3
    assert all(h.get(RANK) in ("0", "1") for h in p.headers_seen + d.headers_seen)
    # each prefill hop carried max_tokens 1 and its own engine's rank; the decode hop the decode engine's
    assert all(b.get("kv_transfer_params", {}).get("do_remote_decode") for b in p.seen)
    assert max(peaks.values()) == 1


def test_a_dp_pool_is_booked_per_engine_and_pinned_before_any_scrape() -> None:
    """`dp: 2` on the pool: until a scrape shows the engines, the configured ones are booked (the perf model's
    blocks each) and each request is pinned to its engine. This worker's /metrics has no vLLM series, so no
    scrape shows its cache config; before `dp`, the worker was one pooled book and nothing was pinned."""
    w = FakeWorker("dp", chunk_delay_s=0.1, metrics_text="this is not an exposition {\n")
    cfg = config(pool("p", "L4", "mixed", w, dp=2), limits={"queue_deadline_s": 20})
    peaks: dict[tuple[str, int | None], int] = {}

    async def run() -> list[int]:
        app = create_app(cfg, transport=FakeFleet(w).transport)
        gw: Gateway = app.state.gateway
        peak_per_engine(gw, peaks)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30)
        async with app.router.lifespan_context(app), client as c:
            rs = await asyncio.gather(
                *(c.post("/v1/completions", json=BODY, headers={"X-Request-Id": f"r{i}"}) for i in range(2))
            )
            [row] = (await c.get("/admin/workers")).json()["workers"]
            assert row["stats"]["num_gpu_blocks"] is None  # no scrape showed a cache config
            assert row["capacity"]["engines"] == 2 and row["capacity"]["kv_blocks"] == 2 * 2183
            return [r.status_code for r in rs]

    assert asyncio.run(asyncio.wait_for(run(), 60)) == [200, 200]
    assert sorted(h.get(RANK) for h in w.headers_seen) == ["0", "1"]  # one on each engine, the roomiest
    assert peaks == {("p/dp:8000", 0): 1, ("p/dp:8000", 1): 1}
