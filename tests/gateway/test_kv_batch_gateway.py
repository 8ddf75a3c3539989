"""Batch admission (`kv.batch_admission.enabled`) in the gateway's admission queue, through the HTTP seam
(fake vLLM workers behind `httpx.MockTransport`, the app in-process): queued requests are planned as a
multi-knapsack (CP-SAT or greedy), each planned request is dispatched to its planned worker, and the ledger
never holds more than a worker's capacity.

Capacity: each fake worker reports 1,000 blocks of 16 tokens; the ledger may reserve floor(1000 · 0.98) =
980. Each request: 4,700 prompt tokens + 8 output tokens → ceil(4708 / 16) = 295 blocks, so 3 fit per
worker (885 ≤ 980 < 1180). Twelve requests at once on two workers: six are routed at once, six wait and
are admitted by the batch ticks as streams end (each stream: 8 chunks, 0.1 s apart).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from scheduler.kv.ledger import KvLedger
from scheduler.routing.framework import Decision, RouteRequest
from server.app import create_app
from server.gateway import Gateway
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool

REQUESTS = 12
NEED = 295  # ceil((4700 + 8) / 16)


def watch_ledger(ledger: KvLedger, violations: list[str]) -> None:
    """Check reserved ≤ capacity on the worker after every reservation the router makes."""
    reserve = ledger.reserve

    def checked(req: RouteRequest, worker: Any, now: float) -> Any:
        res = reserve(req, worker, now)
        if ledger.reserved(worker.id) > ledger.capacity(worker):
            violations.append(f"{worker.id}: {ledger.reserved(worker.id)} > {ledger.capacity(worker)}")
        return res

    ledger.reserve = checked  # type: ignore[method-assign]


def record_plans(gw: Gateway, planned: dict[str, str]) -> None:
    """Request id → the worker each batch plan admitted it on."""
    kvq = gw.kv_queue
    assert kvq is not None
    plan = kvq.plan

    async def recorded(model: str, reqs: list[RouteRequest]) -> dict[str, Decision]:
        out = await plan(model, reqs)
        planned.update({rid: d.decode.id for rid, d in out.items()})
        return out

    kvq.plan = recorded  # type: ignore[method-assign]


@pytest.mark.parametrize("solver", ["cp-sat", "greedy"])
def test_batch_admission_dispatches_to_the_planned_worker_within_capacity(solver: str) -> None:
    a, b = FakeWorker("a", chunk_delay_s=0.1), FakeWorker("b", chunk_delay_s=0.1)
    fleet = FakeFleet(a, b)
    cfg = config(
        pool("p", "L4", "mixed", a, b),
        kv={"batch_admission": {"enabled": True, "solver": solver, "time_limit_ms": 20}},
        limits={"queue_deadline_s": 20},
    )
    body = {"model": "llama-3-8b", "prompt": [5] * 4700, "max_tokens": 8, "stream": True}
    violations: list[str] = []
    planned: dict[str, str] = {}
    urls: dict[str, str] = {}  # worker id → url

    async def run() -> list[int]:
        app = create_app(cfg, transport=fleet.transport)
        gw: Gateway = app.state.gateway
        assert gw.ledger is not None and gw.kv_queue is not None and gw.kv_queue.batch
        watch_ledger(gw.ledger, violations)
        record_plans(gw, planned)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30)
        async with app.router.lifespan_context(app), client as c:
            rs = await asyncio.gather(
                *(
                    c.post("/v1/completions", json=body, headers={"X-Request-Id": f"r{i}"})
                    for i in range(REQUESTS)
                )
            )
            assert not gw.ledger.active()
            assert gw.ledger.stats.double_releases == 0
            urls.update({rec.id: rec.url for rec in gw.registry.records()})
            stats = gw.kv_queue.stats
            assert stats.ticks >= 1 and stats.admitted == len(planned)
            assert set(stats.methods) <= {"cp-sat", "greedy"}
            if solver == "greedy":
                assert set(stats.methods) == {"greedy"}
            # the same counters on /metrics (exported at scrape time)
            text = (await c.get("/metrics")).text
            assert f"mosaic_kv_batch_ticks_total {float(stats.ticks)}" in text
            assert f"mosaic_kv_batch_admitted_total {float(len(planned))}" in text
            for method, n in stats.methods.items():
                assert f'mosaic_kv_batch_plans_total{{solver="{method}"}} {float(n)}' in text
            return [r.status_code for r in rs]

    statuses = asyncio.run(asyncio.wait_for(run(), 60))
    assert statuses == [200] * REQUESTS
    assert not violations
    # the six that could not be routed at once were all admitted by batch plans …
    assert len(planned) == REQUESTS - 6
    # … and each went to the worker its plan chose
    seen = {h["x-request-id"]: w.url for w in (a, b) for h in w.headers_seen}
    assert {rid: urls[wid] for rid, wid in planned.items()} == {rid: seen[rid] for rid in planned}
    assert len(a.seen) + len(b.seen) == REQUESTS
