"""The gateway in front of a simulated data-parallel worker (a pool with `dp: 2`), end to end on
real sockets: the scrape finds two engines, the KV ledger books each, and a burst that preempts when the server
is booked as one pool runs without preemption when each engine is booked on its own.

Capacity: Llama-3-8B on an L4 at gpu_memory_utilization 0.75 leaves 467 blocks of 16 tokens per engine
(`kvkit.simulated_l4_pool`); `cache_config_info` reports the server's 934 on both rows. Each request is a
1,000-token prompt with 600 output tokens (ignore_eos): ceil(1600 / 16) = 100 blocks at its end.

- `per_engine` (the default): floor(467 · 0.98) = 457 per engine → 4 requests per engine, each pinned to its
  engine with `X-data-parallel-rank`; the other 2 of the 10 wait in the gateway: 4 · 100 = 400 ≤ 467, no
  preemption.
- `pooled`: floor(934 · 0.98) = 915 → 9 at once, sent without a rank; the worker's balancer (vLLM's rule)
  alternates them, 5 on one engine: their prompts fit (5 · 63 = 315 blocks) but they grow to 500 > 467 → that
  engine preempts.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from server.config import validate_config
from server.embedded import SimulatedPoolSource
from simulator.engine import Engine
from tests.gateway.serverkit import GatewayThread
from tests.kv.kvkit import simulated_l4_pool

MODEL = "llama-3-8b"
REQUESTS = 10
OUTPUT = 600


def config(kv: dict[str, Any]) -> Any:
    pool = simulated_l4_pool(MODEL)
    pool["dp"] = 2
    return validate_config(
        {
            "pools": [pool],
            "kv": kv,
            "health": {"interval_s": 60},
            "scrape": {"interval_s": 0.1},
            "limits": {"queue_deadline_s": 60},
        }
    )


def engines(gw: GatewayThread) -> list[Engine]:
    source = gw.gateway.sources["l4"]
    assert isinstance(source, SimulatedPoolSource)
    (worker,) = source.workers.values()
    return worker.runtime.engines


def wait_for_engines(gw: GatewayThread) -> None:
    """Until the scrape has shown the gateway both engines (before it, the worker is one pooled book)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        views = gw.gateway.registry.view().workers
        if views and all(len(w.engines) == 2 for w in views):
            return
        time.sleep(0.05)
    raise AssertionError("the scrape never showed two engines")


def record_placements(gw: GatewayThread) -> tuple[dict[str, int | None], dict[str, int]]:
    """(gateway request id → the engine the ledger booked, engine request id → the engine that ran it)."""
    ledger = gw.gateway.ledger
    assert ledger is not None
    booked: dict[str, int | None] = {}
    ran: dict[str, int] = {}
    reserve = ledger.reserve

    def reserving(req: Any, worker: Any, now: float) -> Any:
        res = reserve(req, worker, now)
        if res is not None:
            booked[res.request_id] = res.engine
        return res

    ledger.reserve = reserving  # type: ignore[method-assign]
    for rank, engine in enumerate(engines(gw)):
        add = engine.add_request

        def adding(req: Any, now: float, *a: Any, _add: Any = add, _rank: int = rank, **kw: Any) -> None:
            ran[req.request_id] = _rank
            _add(req, now, *a, **kw)

        engine.add_request = adding  # type: ignore[method-assign]
    return booked, ran


def fire(url: str) -> list[int]:
    body = {"model": MODEL, "prompt": [7] * 1000, "max_tokens": OUTPUT, "ignore_eos": True}

    def one(_: int) -> int:
        with httpx.Client(base_url=url, timeout=60) as http:
            return http.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(REQUESTS) as pool:
        return list(pool.map(one, range(REQUESTS)))


@pytest.mark.parametrize(
    ("data_parallel", "preempts"),
    [
        pytest.param(
            "per_engine", False, id="booked per engine and pinned → no preemption, both engines serve"
        ),
        pytest.param("pooled", True, id="booked as one pool, balanced by the worker → an engine preempts"),
    ],
)
def test_a_burst_on_a_simulated_data_parallel_worker(data_parallel: str, preempts: bool) -> None:
    with GatewayThread(config({"enabled": True, "mode": "worst_case", "data_parallel": data_parallel})) as gw:
        wait_for_engines(gw)
        (view,) = gw.gateway.registry.view().workers
        assert [(e.rank, e.num_gpu_blocks) for e in view.engines] == [(0, 467), (1, 467)]
        booked, ran = record_placements(gw)
        # Two requests one after the other, on idle engines: the ledger books both on engine 0 (ties → the
        # lower rank); the worker's balancer, left to itself, rotates its scan start and puts the second on 1.
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            for _ in range(2):
                small = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
                assert http.post("/v1/completions", json=small).status_code == 200
        assert list(ran.values()) == ([0, 0] if data_parallel == "per_engine" else [0, 1])
        assert fire(gw.url) == [200] * REQUESTS
        # the engine's request id is `cmpl-<X-Request-Id the gateway sent>-<8 hex>`
        placed = {rid.removeprefix("cmpl-").rsplit("-", 1)[0]: rank for rid, rank in ran.items()}
        assert len(booked) == len(placed) == REQUESTS + 2
        if data_parallel == "per_engine":  # pinned: each ran where the ledger booked it
            assert placed == booked
        else:
            assert set(booked.values()) == {None}
        e0, e1 = engines(gw)
        assert (e0.counters.preemptions + e1.counters.preemptions > 0) is preempts
        served = [e0.counters.generation_tokens, e1.counters.generation_tokens]
        assert sum(served) == REQUESTS * OUTPUT + 4 and min(served) >= OUTPUT, served  # both engines served
        ledger = gw.gateway.ledger
        assert ledger is not None
        assert ledger.stats.released == {"completed": REQUESTS + 2} and ledger.stats.double_releases == 0
        assert not ledger.active()
