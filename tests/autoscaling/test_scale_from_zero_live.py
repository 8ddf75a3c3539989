"""Scale from zero in a live gateway (real HTTP on 127.0.0.1, simulated workers): with the decode pool at
zero, P/D requests wait in the admission queue for it (the router's `empty_pool` reject is retryable), the
embedded autoscaler brings decode back from their arrivals, and every request is served. Without an
autoscaler nothing can bring it back, so the same requests are refused at once (503); behind a source the
gateway does not own (Kubernetes) they are held and end at the queue deadline, in one 503 each — none hangs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from server.config import validate_config
from server.runner import start_gateway_server

MODEL = "llama-3-8b"
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 60  # ≈ 540 tokens: over the P/D threshold
SHORT_PROMPT = "hello there"  # under it: the mixed profile, i.e. a decode worker alone


def pd_config(autoscaler: dict[str, Any] | None, queue_deadline_s: float) -> Any:
    def pool(name: str, gpu: str, role: str, replicas: int, seed: int) -> dict[str, Any]:
        return {
            "name": name,
            "model": MODEL,
            "gpu": gpu,
            "role": role,
            "min_replicas": replicas,
            "max_replicas": 2,
            "endpoints": {"simulated": {"replicas": replicas, "seed": seed, "time_scale": 20}},
        }

    return validate_config(
        {
            "pools": [pool("prefill", "H100-SXM", "prefill", 1, 0), pool("decode", "L4", "decode", 0, 10)],
            "scrape": {"interval_s": 0.2, "stale_after_s": 2},
            "limits": {"queue_deadline_s": queue_deadline_s},
            **({"autoscaler": autoscaler} if autoscaler else {}),
        }
    )


async def _send(client: httpx.AsyncClient, prompt: str) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    return resp.status_code, resp.json(), time.monotonic() - started


async def _run(
    cfg: Any, prompts: tuple[str, ...] = (LONG_PROMPT,) * 4 + (SHORT_PROMPT,) * 2
) -> dict[str, Any]:
    running = await start_gateway_server(cfg, "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
            results = await asyncio.gather(*(_send(client, p) for p in prompts))
        decode = sorted(r.id for r in running.gateway.registry.records() if r.pool.name == "decode")
        return {"results": results, "decode_workers": decode}
    finally:
        await running.stop()


def test_requests_wait_for_the_decode_pool_the_autoscaler_brings_back() -> None:
    autoscaler = {
        "enabled": True,
        "actuator": "embedded",
        "interval_s": 0.5,
        "cold_start_s": 0.5,
        "context_tokens": 128,
    }
    out = asyncio.run(_run(pd_config(autoscaler, queue_deadline_s=30)))
    statuses = [status for status, _, _ in out["results"]]
    assert statuses == [200] * 6, out["results"]
    assert all(body["usage"]["completion_tokens"] == 8 for _, body, _ in out["results"])
    # each waited for a decision (0.5 s) and the new worker's cold start (0.5 s): held, not refused at once
    assert min(elapsed for _, _, elapsed in out["results"]) >= 0.5
    assert len(out["decode_workers"]) >= 1


def test_without_an_autoscaler_they_are_refused_at_once() -> None:
    """Nothing can bring a simulated pool started at zero back without the embedded autoscaler: its requests
    are refused at once (as with `max_replicas: 0`, and as `mosaic simulate` without a policy), not held
    for the queue deadline and then answered 429, which clients would retry for ever."""
    out = asyncio.run(_run(pd_config(None, queue_deadline_s=10.0)))
    for status, body, elapsed in out["results"]:
        assert status == 503, body
        assert body["error"]["code"] == "no_worker_for_role"
        assert (
            body["error"]["message"]
            == "no worker fits: 1 wrong_role, 1 pool_stays_empty (model 'llama-3-8b')"
        )
        assert elapsed < 2.0
    assert out["decode_workers"] == []


def test_a_model_whose_every_pool_stays_empty_is_refused_at_once_not_404() -> None:
    """Its only pool empty for good: a 503 at once, also beside another model's workers (which made it a 404
    `model_not_found` for a model /v1/models lists) and alone (a retryable `no_workers`, 429 at the deadline)."""

    def pool(name: str, model: str, endpoints: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "model": model, "gpu": "L4", "endpoints": endpoints}

    async def run(pools: list[dict[str, Any]]) -> tuple[int, dict[str, Any], float]:
        cfg = validate_config({"pools": pools, "limits": {"queue_deadline_s": 10}})
        running = await start_gateway_server(cfg, "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
                listed = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
                assert MODEL in listed
                return await _send(client, SHORT_PROMPT)
        finally:
            await running.stop()

    served = pool("other", "qwen2.5-7b", {"simulated": {"replicas": 1, "time_scale": 20}})
    for pools in (
        [pool("empty", MODEL, {"static": []}), served],
        [pool("empty", MODEL, {"simulated": {"replicas": 0}}), served],
        [pool("empty", MODEL, {"static": []})],
    ):
        status, body, elapsed = asyncio.run(run(pools))
        assert status == 503, (pools, body)
        assert body["error"]["code"] == "no_worker_for_role"
        assert body["error"]["message"] == f"no worker fits: 1 pool_stays_empty (model '{MODEL}')"
        assert elapsed < 2.0


def test_a_pool_something_else_may_fill_is_still_waited_for() -> None:
    """The same empty decode pool behind a source the gateway does not own (as a Kubernetes Deployment that
    KEDA or `mosaic autoscale` scales): requests wait for it and end at the queue deadline, 503."""
    from server.discovery import StaticSource

    async def run() -> list[tuple[int, dict[str, Any], float]]:
        cfg = pd_config(None, queue_deadline_s=1.0)
        running = await start_gateway_server(cfg, "127.0.0.1", 0, sources={"decode": StaticSource([])})
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
                return await asyncio.gather(*(_send(client, LONG_PROMPT) for _ in range(3)))
        finally:
            await running.stop()

    for status, body, elapsed in asyncio.run(run()):
        assert status == 503, body  # no worker available, not a rate limit
        assert body["error"]["type"] == "ServiceUnavailableError"
        assert body["error"]["code"] == "queue_timeout"
        assert "empty_pool" in body["error"]["message"]
        assert 1.0 <= elapsed < 5.0


def test_stays_empty_only_where_nothing_can_add_a_worker() -> None:
    from server.gateway import stays_empty

    def pool_cfg(endpoints: dict[str, Any], autoscaler: dict[str, Any] | None = None) -> Any:
        pool = {"name": "p", "model": MODEL, "gpu": "L4", "endpoints": endpoints}
        return validate_config({"pools": [pool], **({"autoscaler": autoscaler} if autoscaler else {})})

    embedded = {"enabled": True, "actuator": "embedded"}
    dry_run = {"enabled": True, "actuator": "dry-run"}
    cases = [
        ({"static": []}, None, True),
        ({"static": ["http://127.0.0.1:9"]}, None, False),
        ({"simulated": {"replicas": 0}}, None, True),
        ({"simulated": {"replicas": 0}}, dry_run, True),
        ({"simulated": {"replicas": 0}}, embedded, False),
        ({"simulated": {"replicas": 1}}, None, False),
        ({"launch": {"replicas": 0}}, None, True),
        ({"launch": {"replicas": 0}}, embedded, False),
        ({"kubernetes": {"label_selector": "app=vllm"}}, None, False),
    ]
    for endpoints, autoscaler, expected in cases:
        cfg = pool_cfg(endpoints, autoscaler)
        assert stays_empty(cfg.pools[0], cfg) is expected, (endpoints, autoscaler)


def test_a_held_request_wakes_the_autoscaler_before_its_interval_ends() -> None:
    """A 30 s decision interval: the held requests trigger a decision at once (as Knative's activator pokes
    its autoscaler), so they are served within seconds, not after the interval plus the cold start."""
    autoscaler = {
        "enabled": True,
        "actuator": "embedded",
        "interval_s": 30.0,
        "cold_start_s": 0.5,
        "context_tokens": 128,
    }
    out = asyncio.run(_run(pd_config(autoscaler, queue_deadline_s=60)))
    assert [status for status, _, _ in out["results"]] == [200] * 6, out["results"]
    assert max(elapsed for _, _, elapsed in out["results"]) < 10.0


def test_one_request_right_after_start_buys_one_worker() -> None:
    """The first woken cycle ran at once after the controller's baseline: one request over a few ms read as
    ~26 req/s and bought 4 workers for it. A woken cycle now comes at least 1 s after the baseline."""
    cfg = validate_config(
        {
            "pools": [
                {
                    "name": "decode",
                    "model": MODEL,
                    "gpu": "L4",
                    "role": "mixed",
                    "min_replicas": 0,
                    "max_replicas": 8,
                    "endpoints": {"simulated": {"replicas": 0, "seed": 1}},
                }
            ],
            "slo": {"tpot_ms": 100},
            "limits": {"queue_deadline_s": 30},
            "autoscaler": {"enabled": True, "actuator": "embedded", "interval_s": 15, "cold_start_s": 0.5},
        }
    )
    out = asyncio.run(_run(cfg, (SHORT_PROMPT,)))
    assert [status for status, _, _ in out["results"]] == [200], out["results"]
    assert out["decode_workers"] == ["decode/sim-0"]
