"""LoRA adapters through the gateway: discovered from each worker's /v1/models, a request naming one routed as
its base model to the workers that serve it, listed on the gateway's /v1/models (fake workers)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from scheduler.fleet import NO_LORA, LoraState
from server.config import ConfigError
from tests.gateway.fakes import METRICS_TEXT, FakeFleet, FakeWorker, config, pool
from tests.gateway.test_faults import CHAT, chat, gateway, metric, run

MODEL = "llama-3-8b"


def lora_fleet(**pool_extra: Any) -> tuple[FakeWorker, FakeWorker, Any]:
    """Two mixed workers of one pool: `a` serves the adapters `sql` and `chat-v2`, `b` none."""
    a = FakeWorker("a", adapters={"sql": "/adapters/sql", "chat-v2": "/adapters/chat-v2"})
    b = FakeWorker("b")
    return a, b, config(pool("p", "H100", "mixed", a, b, **pool_extra))


def test_a_request_naming_an_adapter_goes_only_to_workers_serving_it() -> None:
    a, b, cfg = lora_fleet()

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            assert gw.registry.adapter_models() == {"sql": MODEL, "chat-v2": MODEL}
            for _ in range(6):
                r = await c.post(CHAT, json=chat() | {"model": "sql"})
                assert r.status_code == 200
            assert len(a.seen) == 6 and b.seen == []
            assert {s["model"] for s in a.seen} == {"sql"}  # forwarded as sent: the worker applies it
            for _ in range(6):  # the base model goes to both
                assert (await c.post(CHAT, json=chat())).status_code == 200
            assert len(b.seen) >= 1 and len(a.seen) + len(b.seen) == 12
            # routed, admitted and counted as its base model
            assert gw.dispatcher.outcomes == {"completed": 12}
            assert metric(gw, "mosaic_requests_total", model=MODEL, pool="p", status="200") == 12
            # per adapter too: the fake's usage is 7 prompt + 4 completion tokens an answer
            assert metric(gw, "mosaic_lora_requests_total", model=MODEL, adapter="sql", status="200") == 6
            assert metric(gw, "mosaic_lora_tokens_total", model=MODEL, adapter="sql", kind="prompt") == 42
            assert metric(gw, "mosaic_lora_tokens_total", model=MODEL, adapter="sql", kind="generation") == 24

    run(body)


def test_an_adapter_no_worker_lists_is_a_404_in_openais_shape() -> None:
    a, b, cfg = lora_fleet()

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, _gw):
            r = await c.post(CHAT, json=chat() | {"model": "nope"})
            assert r.status_code == 404
            assert r.json() == {
                "error": {
                    "message": "The model `nope` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": "model_not_found",
                }
            }
            assert a.seen == [] and b.seen == []

    run(body)


def test_the_gateways_models_list_the_adapters_with_their_base_model() -> None:
    a, b, cfg = lora_fleet()

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, _):
            data = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m["root"], m["parent"]) for m in data] == [
                (MODEL, MODEL, None),
                ("chat-v2", "/adapters/chat-v2", MODEL),
                ("sql", "/adapters/sql", MODEL),
            ]

    run(body)


def test_adapters_are_read_with_the_pools_key_and_a_refused_read_serves_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's --api-key guards /v1/models: the read carries the pool's key; a 401 (a wrong key) leaves the
    adapters unknown, so requests naming one are 404s, and says so in the worker's last error."""
    monkeypatch.setenv("POOL_KEY", "sk-worker")
    a, b, cfg = lora_fleet(api_key_env="POOL_KEY")

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (_c, gw):
            assert a.models_seen and all(h["authorization"] == "Bearer sk-worker" for h in a.models_seen)
            assert "sql" in gw.registry.adapter_models()

    run(body)
    a, b, cfg = lora_fleet()
    a.models_status = 401

    async def refused() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            assert gw.registry.adapter_models() == {}
            assert (await c.post(CHAT, json=chat() | {"model": "sql"})).status_code == 404
            rec = gw.registry.get("p/a:8000")
            assert rec is not None and rec.last_error == "models: HTTPStatusError"

    run(refused)


def test_adapters_loaded_or_unloaded_at_run_time_are_seen_at_the_next_read() -> None:
    """Read again after a good health check once `scrape.models_interval_s` has passed; an unloaded adapter
    is gone from the index and the models list."""
    a, b, _ = lora_fleet()
    cfg = config(pool("p", "H100", "mixed", a, b), scrape={"interval_s": 60, "models_interval_s": 0.01})

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            b.adapters = {"sql": "/adapters/sql"}
            del a.adapters["sql"]
            await asyncio.sleep(0.02)  # past models_interval_s
            await gw.registry.health_once()
            assert gw.registry.adapter_models() == {"sql": MODEL, "chat-v2": MODEL}
            r = await c.post(CHAT, json=chat() | {"model": "sql"})
            assert r.status_code == 200 and len(b.seen) == 1 and a.seen == []
            a.adapters.clear()
            await asyncio.sleep(0.02)
            await gw.registry.health_once()
            assert gw.registry.adapter_models() == {"sql": MODEL}
            assert (await c.post(CHAT, json=chat() | {"model": "chat-v2"})).status_code == 404

    run(body)


def test_a_request_running_when_its_adapter_is_unloaded_is_booked_under_its_name() -> None:
    """The adapter label is decided when the request is accepted: one that finishes after its adapter was
    unloaded (vLLM lets it finish) was booked under `(unlisted)`, lost to the adapter's chargeback."""
    a = FakeWorker("a", adapters={"sql": "/adapters/sql"}, whole_delay_s=0.3)
    cfg = config(pool("p", "H100", "mixed", a), scrape={"interval_s": 60, "models_interval_s": 0.01})

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a)) as (c, gw):
            running = asyncio.create_task(c.post(CHAT, json=chat() | {"model": "sql"}))
            await asyncio.sleep(0.1)
            a.adapters.clear()
            await gw.registry.health_once()
            assert gw.registry.adapter_models() == {}  # unloaded while the request runs
            assert (await running).status_code == 200
            assert metric(gw, "mosaic_lora_requests_total", model=MODEL, adapter="sql", status="200") == 1
            assert metric(gw, "mosaic_lora_tokens_total", model=MODEL, adapter="sql", kind="generation") == 4
            unlisted = metric(
                gw, "mosaic_lora_requests_total", model=MODEL, adapter="(unlisted)", status="200"
            )
            assert unlisted == 0

    run(body)


def test_a_configured_model_named_like_an_adapter_stays_the_model() -> None:
    a = FakeWorker("a", adapters={"qwen": "/adapters/qwen"})
    q = FakeWorker("q", model="qwen")
    cfg = config(
        pool("p", "H100", "mixed", a),
        {**pool("p2", "L4", "mixed", q), "model": "qwen"},
        models=[{"name": MODEL}, {"name": "qwen", "spec": "qwen2.5-7b"}],
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, q)) as (c, gw):
            assert gw.registry.adapter_models() == {}
            r = await c.post(CHAT, json=chat() | {"model": "qwen"})
            assert r.status_code == 200 and len(q.seen) == 1 and a.seen == []

    run(body)


def test_tokenizer_routes_take_an_adapter_to_a_worker_serving_it() -> None:
    a, b, cfg = lora_fleet()

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, _):
            for _ in range(3):
                r = await c.post("/tokenize", json={"model": "sql", "prompt": "hi"})
                assert r.status_code == 200 and r.json()["tokens"] == [len("a")]
            r = await c.post("/tokenize", json={"model": "nope", "prompt": "hi"})
            assert r.status_code == 404

    run(body)


def test_admin_workers_shows_each_workers_adapters_and_their_load() -> None:
    a, b, cfg = lora_fleet()
    a.metrics_text = METRICS_TEXT.format(model=MODEL, running=1, generated=0) + (
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="sql",waiting_lora_adapters="chat-v2"} 5.0\n'
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            rows = {w["id"]: w for w in (await c.get("/admin/workers")).json()["workers"]}
            assert rows["p/a:8000"]["lora_adapters"] == ["chat-v2", "sql"]
            stats = rows["p/a:8000"]["stats"]
            assert (stats["lora_running"], stats["lora_waiting"], stats["max_lora"]) == (
                ["sql"],
                ["chat-v2"],
                1,
            )
            assert (
                rows["p/b:8000"]["lora_adapters"] == [] and rows["p/b:8000"]["stats"]["lora_running"] is None
            )
            lora = {w.id: w.lora for w in gw.registry.view().workers}
            assert lora["p/a:8000"] == LoraState(
                frozenset({"sql", "chat-v2"}), frozenset({"sql"}), frozenset({"chat-v2"}), 1
            )
            assert lora["p/b:8000"] is NO_LORA

    run(body)


def test_a_model_resolving_adapters_takes_any_unknown_name_as_its_adapter() -> None:
    """`models[].lora_resolver` (vLLM's resolver plugins load an adapter on its first request): an unknown name
    is routed as that model's adapter to any of its workers, a listed one preferably to a worker listing it;
    another configured model stays itself; unlisted names share one metric label."""
    a, b, _ = lora_fleet()
    q = FakeWorker("q", model="qwen")
    cfg = config(
        pool("p", "H100", "mixed", a, b),
        {**pool("p2", "L4", "mixed", q), "model": "qwen"},
        models=[{"name": MODEL, "lora_resolver": True}, {"name": "qwen", "spec": "qwen2.5-7b"}],
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b, q)) as (c, gw):
            for name in ("brand-new", "other-new"):
                r = await c.post(CHAT, json=chat() | {"model": name})
                assert r.status_code == 200
            assert [s["model"] for s in a.seen + b.seen] == ["brand-new", "other-new"]  # forwarded as sent
            assert q.seen == []
            assert metric(gw, "mosaic_requests_total", model=MODEL, pool="p", status="200") == 2
            assert (
                metric(gw, "mosaic_lora_requests_total", model=MODEL, adapter="(unlisted)", status="200") == 2
            )
            a.seen.clear()
            b.seen.clear()
            for _ in range(4):  # listed by `a` only: `b` would load it first
                assert (await c.post(CHAT, json=chat() | {"model": "sql"})).status_code == 200
            assert len(a.seen) == 4 and b.seen == []
            assert metric(gw, "mosaic_lora_requests_total", model=MODEL, adapter="sql", status="200") == 4
            assert (await c.post(CHAT, json=chat() | {"model": "qwen"})).status_code == 200
            assert len(q.seen) == 1
            r = await c.post("/tokenize", json={"model": "brand-new", "prompt": "hi"})
            assert r.status_code == 200

    run(body)


def test_two_models_resolving_adapters_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"models\.1\.lora_resolver: only one model may resolve"):
        config(
            pool("p", "H100", "mixed", FakeWorker("a")),
            {**pool("p2", "L4", "mixed", FakeWorker("q", model="qwen")), "model": "qwen"},
            models=[
                {"name": MODEL, "lora_resolver": True},
                {"name": "qwen", "spec": "qwen2.5-7b", "lora_resolver": True},
            ],
        )


def test_the_gateways_adapter_requests_in_flight_show_in_the_workers_lora_state() -> None:
    """vLLM's metric names an adapter only once its requests run; the gateway adds its own in flight (queued
    ones too) to the worker's `LoraState.pending` while they last, and /admin/workers shows them."""
    a = FakeWorker("a", adapters={"sql": "/adapters/sql"}, whole_delay_s=0.3)
    cfg = config(pool("p", "H100", "mixed", a))

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a)) as (c, gw):
            sent = [
                asyncio.create_task(c.post(CHAT, json=chat() | {"model": m})) for m in ("sql", "sql", MODEL)
            ]
            rec = gw.registry.get("p/a:8000")
            assert rec is not None
            for _ in range(200):
                if rec.inflight_requests == 3:
                    break
                await asyncio.sleep(0.005)
            assert rec.inflight_adapters == {"sql": 2}
            (view,) = gw.registry.view().workers
            assert view.lora.pending == frozenset({"sql"})
            rows = (await c.get("/admin/workers")).json()["workers"]
            assert rows[0]["lora_inflight"] == {"sql": 2}
            assert all(r.status_code == 200 for r in await asyncio.gather(*sent))
            assert rec.inflight_adapters == {}
            (view,) = gw.registry.view().workers
            assert view.lora.pending == frozenset()

    run(body)
