"""POST /tokenize and /detokenize through the gateway (`server.tokenize_proxy`): forwarded unchanged to one
ready worker of the body's model, its answer relayed unchanged; the gateway's own checks (auth, rate limit,
body, model) first; a failing worker passed over for the next."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from server.app import create_app
from server.gateway import Gateway
from simulator.protocol import UNSUPPORTED_MEDIA_TYPE
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool


@asynccontextmanager
async def gateway(cfg: Any, fleet: FakeFleet) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    app = create_app(cfg, transport=fleet.transport)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10)
    async with app.router.lifespan_context(app), client as c:
        yield c, app.state.gateway


def count(gw: Gateway, path: str, model: str, status: int) -> float:
    labels = {"path": path, "model": model, "status": str(status)}
    return gw.metrics.registry.get_sample_value("mosaic_tokenizer_requests_total", labels) or 0.0


def test_forwarded_unchanged_to_the_least_busy_ready_worker_and_relayed() -> None:
    async def body() -> None:
        busy, idle = FakeWorker("busy-worker"), FakeWorker("idle")
        async with gateway(config(pool("p", "L4", "mixed", busy, idle)), FakeFleet(busy, idle)) as (c, gw):
            gw.registry.get("p/busy-worker:8000").inflight_requests = 3  # type: ignore[union-attr]
            raw = b'{"model": "llama-3-8b", "prompt": "hello world", "return_token_strs": true}'
            r = await c.post(
                "/tokenize",
                content=raw,
                headers={"content-type": "application/json", "x-request-id": "tok-1"},
            )
            assert r.status_code == 200
            assert r.json() == {"count": 1, "max_model_len": 8192, "tokens": [len("idle")]}
            assert r.headers["x-request-id"] == "tok-1"
            assert idle.raw_seen == [raw] and busy.raw_seen == []  # the body as sent, to the idle one
            assert idle.headers_seen[0]["x-request-id"] == "tok-1"
            assert "authorization" not in idle.headers_seen[0]
            r = await c.post("/detokenize", json={"tokens": [1, 2]})  # no model: the gateway's one model
            assert (r.status_code, r.json()) == (200, {"prompt": "idle"})
            assert idle.paths == ["/tokenize", "/detokenize"]
            assert (
                count(gw, "/tokenize", "llama-3-8b", 200) == count(gw, "/detokenize", "llama-3-8b", 200) == 1
            )
            # nothing was reserved or counted as a generation request
            assert gw.metrics.registry.get_sample_value(
                "mosaic_requests_received_total", {"model": "llama-3-8b"}
            ) in (
                None,
                0.0,
            )

    asyncio.run(asyncio.wait_for(body(), 30))


def test_worker_answers_pass_through_and_a_4xx_is_not_retried() -> None:
    async def body() -> None:
        a, b = FakeWorker("a", mode="status", status=400), FakeWorker("b")
        async with gateway(config(pool("p", "L4", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            r = await c.post("/tokenize", json={"model": "llama-3-8b", "prompt": "x"})
            assert r.status_code == 400 and r.json()["error"]["message"] == "worker a says 400"
            assert len(a.seen) == 1 and b.seen == []  # the body's fault: another worker would say the same
            assert count(gw, "/tokenize", "llama-3-8b", 400) == 1

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.parametrize(
    ("mode", "status", "kind"),
    [("refuse", 0, "connect"), ("status", 503, "status_503"), ("status", 500, "status_500")],
)
def test_a_failing_worker_is_passed_over_and_reported(mode: str, status: int, kind: str) -> None:
    async def body() -> None:
        a, b = FakeWorker("a"), FakeWorker("b")
        async with gateway(config(pool("p", "L4", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            a.mode, a.status = mode, status  # healthy when the gateway looked, failing now
            gw.registry.get("p/b:8000").inflight_requests = 1  # type: ignore[union-attr]  # `a` is tried first
            r = await c.post("/tokenize", json={"prompt": "x"})
            assert (r.status_code, r.json()["tokens"]) == (200, [len("b")])
            errors = {"worker": "p/a:8000", "kind": kind}
            assert gw.metrics.registry.get_sample_value("mosaic_upstream_errors_total", errors) == 1

    asyncio.run(asyncio.wait_for(body(), 30))


def test_every_worker_failing_gives_the_last_answer_or_502_and_none_ready_503() -> None:
    async def body() -> None:
        a, b = FakeWorker("a", mode="status", status=503), FakeWorker("b", mode="status", status=500)
        async with gateway(config(pool("p", "L4", "mixed", a, b)), FakeFleet(a, b)) as (c, _):
            r = await c.post("/tokenize", json={"prompt": "x"})
            assert r.status_code == 500 and r.json()["error"]["message"] == "worker b says 500"
        a, b = FakeWorker("a"), FakeWorker("b")
        async with gateway(config(pool("p", "L4", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            a.mode = b.mode = "refuse"
            r = await c.post("/tokenize", json={"prompt": "x"})
            assert r.status_code == 502 and r.json()["error"]["type"] == "BadGatewayError"
            # both ejected (connection refused opens the breaker at once): nobody is ready now
            r = await c.post("/tokenize", json={"prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
            assert r.headers["retry-after"] == "1"
            assert count(gw, "/tokenize", "llama-3-8b", 503) == 1

    asyncio.run(asyncio.wait_for(body(), 30))


def test_retries_are_bounded_by_max_retries() -> None:
    async def body() -> None:
        workers = [FakeWorker(f"w{i}", mode="status", status=503) for i in range(4)]
        cfg = config(pool("p", "L4", "mixed", *workers), limits={"max_retries": 1})
        async with gateway(cfg, FakeFleet(*workers)) as (c, _):
            r = await c.post("/tokenize", json={"prompt": "x"})
            assert r.status_code == 503
            assert sum(len(w.seen) for w in workers) == 2  # the first try and one retry

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.parametrize(
    ("raw", "headers", "status", "message", "param"),
    [
        pytest.param(b'{"model": "nope", "prompt": "x"}', {}, 404, "The model `nope` does not exist.", "model",
                     id="unknown model"),
        pytest.param(b'{"model": 5}', {}, 400, "'model' must be a string.", "model", id="model not a string"),
        pytest.param(b"[1]", {}, 400, "The request body must be a JSON object.", None, id="not an object"),
        pytest.param(
            b"{",
            {},
            400,
            "The request body is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
            "(char 1).",
            None,
            id="not JSON",
        ),
        pytest.param(b'{"prompt": "x"}', {"content-type": "text/plain"}, 400, UNSUPPORTED_MEDIA_TYPE, None,
                     id="not application/json"),
        pytest.param(b'{"prompt": "' + b"x" * 2000 + b'"}', {}, 413, "Request body exceeds the 1024-byte limit.",
                     None, id="over max_body_bytes"),
    ],
)  # fmt: skip
def test_the_gateway_checks_first(
    raw: bytes, headers: dict[str, str], status: int, message: str, param: str | None
) -> None:
    async def body() -> None:
        a = FakeWorker("a")
        cfg = config(pool("p", "L4", "mixed", a), limits={"max_body_bytes": 1024})
        async with gateway(cfg, FakeFleet(a)) as (c, _):
            sent = {"content-type": "application/json", **headers}

            async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies while reading
                yield raw

            r = await c.post("/tokenize", content=chunks(), headers=sent)
            err = r.json()["error"]
            assert (r.status_code, err["message"], err["param"]) == (status, message, param)
            assert a.seen == []

    asyncio.run(asyncio.wait_for(body(), 30))


def test_several_models_require_one() -> None:
    async def body() -> None:
        a, b = FakeWorker("a"), FakeWorker("b", model="mistral-7b")
        pools = (pool("p", "L4", "mixed", a), {**pool("q", "L4", "mixed", b), "model": "mistral-7b"})
        async with gateway(config(*pools), FakeFleet(a, b)) as (c, _):
            r = await c.post("/tokenize", json={"prompt": "x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            r = await c.post("/tokenize", json={"model": "mistral-7b", "prompt": "x"})
            assert r.json()["tokens"] == [len("b")] and a.seen == []

    asyncio.run(asyncio.wait_for(body(), 30))


def test_auth_rate_limit_and_worker_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy endpoints' API keys; one request off the key's requests/s bucket and nothing off its tokens;
    the pool's own key to the worker, never the client's."""
    monkeypatch.setenv("POOL_KEY", "sk-worker")

    async def body() -> None:
        a = FakeWorker("a")
        cfg = config(
            pool("p", "L4", "mixed", a, api_key_env="POOL_KEY"),
            auth={"api_keys": ["sk-client"]},
            limits={"rate_limit": {"requests_per_s": 1, "burst": 2, "tokens_per_min": 10}},
        )
        async with gateway(cfg, FakeFleet(a)) as (c, gw):
            r = await c.post("/tokenize", json={"prompt": "x"})
            assert r.status_code == 401
            auth = {"authorization": "Bearer sk-client"}
            big = {"prompt": "x " * 500}  # far more than 10 tokens: tokenizing is not generating
            assert (await c.post("/tokenize", json=big, headers=auth)).status_code == 200
            assert (await c.post("/tokenize", json=big, headers=auth)).status_code == 200
            r = await c.post("/tokenize", json=big, headers=auth)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert a.headers_seen[0]["authorization"] == "Bearer sk-worker"
            assert count(gw, "/tokenize", "llama-3-8b", 429) == 1

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_draining_gateway_refuses() -> None:
    async def body() -> None:
        a = FakeWorker("a")
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            gw.draining = True
            r = await c.post("/tokenize", json={"prompt": "x"})
            assert r.status_code == 503 and a.seen == []
            gw.draining = False

    asyncio.run(asyncio.wait_for(body(), 30))


def test_get_is_405() -> None:
    async def body() -> None:
        a = FakeWorker("a")
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, _):
            r = await c.get("/tokenize")
            assert r.status_code == 405 and json.loads(r.text)["error"]["type"] == "MethodNotAllowedError"

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_key_in_token_debt_may_still_tokenize() -> None:
    """A key whose tokens/min bucket is below zero (it used more than its requests were estimated at) is
    refused generation until it refills, not /tokenize, which costs no tokens."""

    async def body() -> None:
        a = FakeWorker("a")
        cfg = config(pool("p", "L4", "mixed", a), limits={"rate_limit": {"tokens_per_min": 100}})
        async with gateway(cfg, FakeFleet(a)) as (c, gw):
            gw.limiter.admit("anonymous", 1, gw.clock())
            gw.limiter.settle("anonymous", 1, 150, gw.clock())  # in debt: 100 − 150
            assert (await c.post("/tokenize", json={"prompt": "x"})).status_code == 200
            r = await c.post("/v1/completions", json={"model": "llama-3-8b", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 429

    asyncio.run(asyncio.wait_for(body(), 30))


def test_the_gateways_own_pool_timeout_is_not_the_workers_fault() -> None:
    async def body() -> None:
        a, b = FakeWorker("a"), FakeWorker("b")
        async with gateway(config(pool("p", "L4", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            gw.registry.get("p/b:8000").inflight_requests = 1  # type: ignore[union-attr]  # `a` first
            post = gw.dispatcher.upstream.post

            async def no_connection(base: str, *args: Any, **kwargs: Any) -> Any:
                if "//a:" in base:
                    raise httpx.PoolTimeout("no connection to the worker free")
                return await post(base, *args, **kwargs)

            gw.dispatcher.upstream.post = no_connection  # type: ignore[method-assign]
            for _ in range(4):
                assert (await c.post("/tokenize", json={"prompt": "x"})).status_code == 200
            assert gw.registry.get("p/a:8000").breaker.failures == 0  # type: ignore[union-attr]

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_body_nested_past_the_parsers_recursion_limit_is_a_400() -> None:
    """`json.loads` raises RecursionError, not ValueError, on 100,000 nested arrays: the tokenizer proxy let it
    through as a 500 InternalServerError (the completion endpoints' validation answered 400 already)."""

    async def body() -> None:
        a = FakeWorker("a")
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, _):
            deep = b"[" * 100_000 + b"]" * 100_000
            for path in ("/tokenize", "/detokenize"):
                r = await c.post(path, content=deep, headers={"content-type": "application/json"})
                assert r.status_code == 400, r.text
                assert (
                    r.json()["error"]["message"]
                    == "The request body is not valid JSON: it is nested too deeply."
                )
            assert a.seen == []

    asyncio.run(body())
