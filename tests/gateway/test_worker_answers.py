"""What the gateway does with odd but possible worker answers: usage counts that are not counts, and a
busy worker's 429 with a Retry-After."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool
from tests.gateway.test_faults import chat, gateway, metric, run


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 7, "completion_tokens": -5, "total_tokens": 2},
        {"prompt_tokens": "7", "completion_tokens": "many", "total_tokens": None},
        {"prompt_tokens": 7.5, "completion_tokens": True},
    ],
    ids=["negative", "strings", "float-and-bool"],
)
def test_a_usage_that_is_not_a_count_is_served_and_counted_as_zero(usage: dict[str, Any]) -> None:
    worker = FakeWorker("w", usage=usage)

    async def body() -> None:
        async with gateway(config(pool("l4", "L4", "mixed", worker)), FakeFleet(worker)) as (client, gw):
            r = await client.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200, r.text
            assert r.json()["usage"] == usage  # the worker's body passes through untouched
            assert gw.dispatcher.outcomes == {"completed": 1}
            assert metric(gw, "mosaic_generation_tokens_total", model="llama-3-8b") == 0
            assert metric(gw, "mosaic_prompt_tokens_total", model="llama-3-8b") == (
                7 if usage["prompt_tokens"] == 7 else 0
            )

    run(body)


def test_a_busy_workers_429_keeps_its_retry_after_and_does_not_eject_it() -> None:
    busy = FakeWorker("busy", mode="status", status=429, retry_after="7")
    cfg = config(
        pool("l4", "L4", "mixed", busy),
        limits={"max_retries": 0},
        health={"interval_s": 60, "failure_threshold": 2},
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(busy)) as (client, gw):
            for _ in range(4):  # twice the breaker's threshold
                r = await client.post("/v1/chat/completions", json=chat())
                assert r.status_code == 429
                assert r.headers["retry-after"] == "7"
                assert r.json()["error"]["message"] == "worker busy says 429"  # its body, unchanged
            assert len(busy.seen) == 4  # never ejected: every request reached it
            (record,) = gw.registry.records()
            assert (record.breaker.trips, record.breaker.failures) == (0, 0)

    run(body)


def test_a_workers_503_still_counts_against_its_breaker() -> None:
    down = FakeWorker("down", mode="status", status=503)
    cfg = config(
        pool("l4", "L4", "mixed", down),
        limits={"max_retries": 0},
        health={"interval_s": 60, "failure_threshold": 2},
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(down)) as (client, gw):
            statuses = [
                (await client.post("/v1/chat/completions", json=chat())).status_code for _ in range(2)
            ]
            assert statuses == [503, 503]
            (record,) = gw.registry.records()
            assert record.breaker.trips == 1  # two failures at threshold 2: ejected

    run(body)
