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


def test_workers_started_with_an_api_key_get_it_and_never_the_clients_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PREFILL_KEY", "sk-prefill")
    monkeypatch.setenv("DECODE_KEY", " sk-decode\n")  # as a mounted Secret file often has it
    prefill, decode, mixed = FakeWorker("p"), FakeWorker("d"), FakeWorker("m")
    cfg = config(
        pool("prefill-h100", "H100", "prefill", prefill, api_key_env="PREFILL_KEY"),
        pool("decode-a100", "A100-80GB", "decode", decode, api_key_env="DECODE_KEY"),
        pool("mixed-l4", "L4", "mixed", mixed),
        auth={"api_keys": ["gateway-key"]},
        routing={"policy": "round-robin", "pd_threshold_tokens": 16},
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(prefill, decode, mixed)) as (client, _gw):
            for _ in range(6):
                r = await client.post(
                    "/v1/chat/completions",
                    json=chat("word " * 50),
                    headers={"Authorization": "Bearer gateway-key"},
                )
                assert r.status_code == 200, r.text

    run(body)
    assert prefill.headers_seen and decode.headers_seen and mixed.headers_seen  # every pool was used
    assert {h.get("authorization") for h in prefill.headers_seen} == {"Bearer sk-prefill"}
    assert {h.get("authorization") for h in decode.headers_seen} == {"Bearer sk-decode"}
    assert {h.get("authorization") for h in mixed.headers_seen} == {None}


def test_a_pool_key_variable_that_is_unset_stops_the_gateway_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from server.app import create_app
    from server.config import ConfigError

    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    worker = FakeWorker("w")
    with pytest.raises(
        ConfigError, match=r"pools\[l4\]\.api_key_env: environment variable NO_SUCH_KEY is unset"
    ):
        create_app(
            config(pool("l4", "L4", "mixed", worker, api_key_env="NO_SUCH_KEY")),
            transport=FakeFleet(worker).transport,
        )
