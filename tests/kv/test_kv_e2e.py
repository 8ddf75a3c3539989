"""End to end through the live gateway (real sockets, one simulated L4 worker with a small KV cache):
without reservation the worker preempts; with the KV ledger it never does, and every reservation is released.

Capacity: Llama-3-8B on an L4 at gpu_memory_utilization 0.75 leaves 467 blocks of 16 tokens. Each request
is a 1,000-token prompt with 600 output tokens (ignore_eos): ceil(1600/16) = 100 blocks at its end, so the
8 requests sent at once need 800 > 467. Without reservation the worker admits 7 prompts (63 blocks each)
and preempts as they decode; with it, floor(467 · 0.98) = 457 admits 4 at a time and the rest wait in the
gateway's admission queue.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from server.config import validate_config
from server.embedded import SimulatedPoolSource
from tests.gateway.serverkit import GatewayThread
from tests.kv.kvkit import simulated_l4_pool

MODEL = "llama-3-8b"
REQUESTS = 8


def config(kv: dict[str, Any]) -> Any:
    pool = simulated_l4_pool(MODEL)
    return validate_config(
        {"pools": [pool], "kv": kv, "health": {"interval_s": 60}, "limits": {"queue_deadline_s": 60}}
    )


def fire(url: str) -> list[int]:
    body = {"model": MODEL, "prompt": [7] * 1000, "max_tokens": 600, "ignore_eos": True}

    def one(_: int) -> int:
        with httpx.Client(base_url=url, timeout=60) as http:
            return http.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(REQUESTS) as pool:
        return list(pool.map(one, range(REQUESTS)))


def engine_preemptions(gw: GatewayThread) -> int:
    source = gw.gateway.sources["l4"]
    assert isinstance(source, SimulatedPoolSource)
    (worker,) = source.workers.values()
    return worker.runtime.engine.counters.preemptions


@pytest.mark.parametrize(
    ("kv", "preempts"),
    [
        pytest.param({"enabled": False}, True, id="no reservation → the worker preempts"),
        pytest.param(
            {"enabled": True, "mode": "worst_case"}, False, id="KV ledger, worst case → no preemption"
        ),
    ],
)
def test_reservation_prevents_preemption(kv: dict[str, Any], preempts: bool) -> None:
    with GatewayThread(config(kv)) as gw:
        assert fire(gw.url) == [200] * REQUESTS
        assert (engine_preemptions(gw) > 0) is preempts
        ledger = gw.gateway.ledger
        if ledger is not None:
            assert ledger.stats.reserved == REQUESTS
            assert ledger.stats.released == {"completed": REQUESTS}  # each released exactly once
            assert ledger.stats.double_releases == 0
            assert not ledger.active()
