"""Run-time LoRA adapters through the gateway (`server.lora_admin`): vLLM's load/unload relayed to every
worker of the base model, answered as vLLM answers, and loaded again on workers that come later (fake
workers speaking vLLM 0.32's endpoints)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from server.app import create_app
from server.config import validate_config
from server.discovery import Endpoint
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool
from tests.gateway.test_faults import CHAT, chat, gateway, metric, run

MODEL = "llama-3-8b"
LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
SQL = {"lora_name": "sql", "lora_path": "/adapters/sql"}


def workers(*names: str, **kw: Any) -> list[FakeWorker]:
    return [FakeWorker(n, lora_runtime=True, **kw) for n in names]


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for work the gateway spawned (a reconcile runs as its own task after a health check)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def loads(w: FakeWorker) -> list[dict[str, Any]]:
    return [body for path, body, _ in w.lora_calls if path == LOAD]


def test_a_load_goes_to_every_worker_of_the_model_prefill_ones_too_and_is_routable_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PREFILL_KEY", "sk-p")
    p1, d1, d2 = workers("p1", "d1", "d2")
    other = FakeWorker("o", model="qwen2.5-7b", lora_runtime=True)
    cfg = config(
        pool("prefill", "H100", "prefill", p1, api_key_env="PREFILL_KEY"),
        pool("decode", "A100", "decode", d1, d2),
        {**pool("q", "L4", "mixed", other), "model": "qwen2.5-7b"},
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p1, d1, d2, other)) as (c, gw):
            r = await c.post(LOAD, json=SQL | {"base_model_name": MODEL})
            assert r.status_code == 200
            assert r.text == "Success: LoRA adapter 'sql' added successfully."
            assert r.headers["x-request-id"]
            want = {
                "lora_name": "sql",
                "lora_path": "/adapters/sql",
                "load_inplace": False,
                "is_3d_lora_weight": False,
            }
            assert [loads(w) for w in (p1, d1, d2)] == [[want]] * 3
            assert other.lora_calls == []  # another model's workers are not asked
            assert p1.lora_calls[0][2]["authorization"] == "Bearer sk-p"  # the pool's key, as on /v1/models
            # read again right after: routable now, not at the next models read
            assert gw.registry.adapter_models() == {"sql": MODEL}
            assert (await c.post(CHAT, json=chat() | {"model": "sql"})).status_code == 200
            data = (await c.get("/v1/models")).json()["data"]
            assert ("sql", "/adapters/sql", MODEL) in [(m["id"], m["root"], m["parent"]) for m in data]
            assert metric(gw, "mosaic_lora_admin_calls_total", operation="load", outcome="ok") == 3
            assert gw.lora_admin.desired["sql"].path == "/adapters/sql"

    run(body)


def test_one_model_needs_no_base_model_name_and_several_do() -> None:
    a, b = workers("a", "b")
    q = FakeWorker("q", model="qwen2.5-7b", lora_runtime=True)
    one = config(pool("p", "H100", "mixed", a, b))
    two = config(pool("p", "H100", "mixed", a), {**pool("q", "L4", "mixed", q), "model": "qwen2.5-7b"})

    async def body() -> None:
        async with gateway(one, FakeFleet(a, b)) as (c, _):
            assert (await c.post(LOAD, json=SQL)).status_code == 200
        async with gateway(two, FakeFleet(a, q)) as (c, _):
            r = await c.post(LOAD, json={"lora_name": "chat", "lora_path": "/adapters/chat"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "base_model_name"
            r = await c.post(LOAD, json={"lora_name": "chat", "lora_path": "/x", "base_model_name": "nope"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            # an adapter some worker lists names its model: unload needs no base_model_name
            r = await c.post(UNLOAD, json={"lora_name": "sql"})
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
            assert "sql" not in a.adapters

    run(body)


@pytest.mark.parametrize(
    ("sent", "status", "message", "param"),
    [
        pytest.param(
            {"lora_name": "sql"},
            400,
            "Both 'lora_name' and 'lora_path' must be provided.",
            None,
            id="no path",
        ),
        pytest.param(
            {"lora_name": "", "lora_path": "/x"},
            400,
            "Both 'lora_name' and 'lora_path' must be provided.",
            None,
            id="empty name",
        ),
        pytest.param(
            {"lora_name": 3, "lora_path": "/x"},
            400,
            "'lora_name' must be a str.",
            "lora_name",
            id="name not a string",
        ),
        pytest.param(
            SQL | {"load_inplace": "maybe"},  # ("yes", "true", 1 are vLLM's pydantic's true)
            400,
            "'load_inplace' must be a boolean.",
            "load_inplace",
            id="inplace not a bool",
        ),
        pytest.param(
            {"lora_name": MODEL, "lora_path": "/x"},
            400,
            f"The lora adapter '{MODEL}' conflicts with a served base model.",
            "lora_name",
            id="the base model's name",
        ),
        pytest.param([1], 400, "The request body must be a JSON object.", None, id="not an object"),
    ],
)
def test_bad_load_bodies_are_refused_before_any_worker_is_asked(
    sent: Any, status: int, message: str, param: str | None
) -> None:
    a, b = workers("a", "b")

    async def body() -> None:
        async with gateway(config(pool("p", "H100", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            r = await c.post(LOAD, json=sent)
            assert r.status_code == status
            assert r.json() == {
                "error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}
            }
            assert a.lora_calls == [] and b.lora_calls == [] and gw.lora_admin.desired == {}
            r = await c.post(LOAD, content=b"{", headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"] == (
                "The request body is not valid JSON: Expecting property name enclosed in double quotes: line 1 "
                "column 2 (char 1)."
            )
            r = await c.post(LOAD, content=b"{}", headers={"content-type": "text/plain"})
            assert r.status_code == 400

    run(body)


def test_the_admin_key_guards_both_calls() -> None:
    a, b = workers("a", "b")
    cfg = config(pool("p", "H100", "mixed", a, b), auth={"api_keys": ["sk-user"], "admin_keys": ["sk-admin"]})

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, _):
            for path, sent in ((LOAD, SQL), (UNLOAD, {"lora_name": "sql"})):
                for headers in ({}, {"authorization": "Bearer sk-user"}):
                    r = await c.post(path, json=sent, headers=headers)
                    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            assert a.lora_calls == [] and b.lora_calls == []
            r = await c.post(LOAD, json=SQL, headers={"authorization": "Bearer sk-admin"})
            assert r.status_code == 200
            assert (await c.get("/admin/lora")).status_code == 401
            r = await c.get("/admin/lora", headers={"authorization": "Bearer sk-admin"})
            assert r.json()["adapters"][0]["serving"] == ["p/a:8000", "p/b:8000"]

    run(body)


def test_already_loaded_everywhere_is_vllms_400_and_somewhere_loads_on_the_rest() -> None:
    a, b = workers("a", "b")
    a.adapters["sql"] = "/adapters/sql"  # as from --lora-modules

    async def body() -> None:
        async with gateway(config(pool("p", "H100", "mixed", a, b)), FakeFleet(a, b)) as (c, _):
            r = await c.post(LOAD, json=SQL)
            assert r.status_code == 200 and loads(a) == [] and len(loads(b)) == 1
            r = await c.post(LOAD, json=SQL)
            assert r.status_code == 400
            assert r.json()["error"]["message"] == (
                "The lora adapter 'sql' has already been loaded. If you want to load the adapter in place, set "
                "'load_inplace' to True."
            )
            # another path is a conflict without load_inplace, and goes to every worker with it
            r = await c.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql-v2"})
            assert r.status_code == 400 and "/adapters/sql" in r.json()["error"]["message"]
            r = await c.post(
                LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql-v2", "load_inplace": True}
            )
            assert r.status_code == 200 and len(loads(a)) == 1 and len(loads(b)) == 2
            assert a.adapters["sql"] == b.adapters["sql"] == "/adapters/sql-v2"

    run(body)


def test_a_refusal_every_worker_gives_alike_passes_through_and_nothing_is_remembered() -> None:
    a, b = workers("a", "b", lora_refusal=(404, "Loading lora sql failed: No adapter found for /nope"))

    async def body() -> None:
        async with gateway(config(pool("p", "H100", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            r = await c.post(LOAD, json={"lora_name": "sql", "lora_path": "/nope"})
            assert r.status_code == 404
            assert r.json()["error"] == {
                "message": "Loading lora sql failed: No adapter found for /nope",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            }
            assert gw.lora_admin.desired == {} and gw.registry.adapter_models() == {}
            assert metric(gw, "mosaic_lora_admin_calls_total", operation="load", outcome="failed") == 2

    run(body)


def test_a_partial_load_is_a_502_naming_the_failed_worker_and_reconcile_finishes_it() -> None:
    a, b = workers("a", "b")
    b.lora_refusal = (500, "engine busy")
    cfg = config(pool("p", "H100", "mixed", a, b), scrape={"interval_s": 60, "models_interval_s": 0.01})

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            r = await c.post(LOAD, json=SQL)
            assert r.status_code == 502 and r.json()["error"]["type"] == "BadGatewayError"
            message = r.json()["error"]["message"]
            assert "loaded on 1 of 2 worker(s)" in message and "p/b:8000 (500: engine busy)" in message
            assert "after their next good health checks" in message
            # requests naming it go to the worker that has it
            assert gw.registry.adapter_models() == {"sql": MODEL}
            assert (await c.post(CHAT, json=chat() | {"model": "sql"})).status_code == 200
            assert b.seen == []
            b.lora_refusal = None
            await asyncio.sleep(0.02)  # past models_interval_s: the next health check reads /v1/models
            await gw.registry.health_once()
            await until(lambda: b.adapters.get("sql") == "/adapters/sql")
            await until(
                lambda: metric(gw, "mosaic_lora_admin_calls_total", operation="reconcile", outcome="ok") == 1
            )
            assert loads(a) == [SQL | {"load_inplace": False, "is_3d_lora_weight": False}]  # not sent again

    run(body)


def test_a_worker_that_comes_later_gets_the_remembered_adapters() -> None:
    a, new = workers("a", "new")
    cfg = config(pool("p", "H100", "mixed", a))

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, new)) as (c, gw):
            assert (await c.post(LOAD, json=SQL)).status_code == 200
            gw.registry.sync_pool("p", [Endpoint("a:8000", a.url), Endpoint("new:8000", new.url)])
            # a new worker is health-checked at once, its /v1/models read, then the adapter loaded
            await until(lambda: new.adapters.get("sql") == "/adapters/sql")
            await until(lambda: "sql" in gw.registry.get("p/new:8000").adapters)  # type: ignore[union-attr]
            described = (await c.get("/admin/lora")).json()
            assert described == {
                "reconcile": True,
                "adapters": [
                    {
                        "name": "sql",
                        "model": MODEL,
                        "path": "/adapters/sql",
                        "is_3d_lora_weight": False,
                        "serving": ["p/a:8000", "p/new:8000"],
                        "other_path": [],
                        "missing": [],
                    }
                ],
            }

    run(body)


def test_a_failing_reconcile_backs_off_doubling_to_retry_max_s() -> None:
    a, b = workers("a", "b")
    b.lora_refusal = (400, "rank 64 above --max-lora-rank 16")
    cfg = config(
        pool("p", "H100", "mixed", a, b),
        scrape={"interval_s": 60, "models_interval_s": 0.01},
        lora={"retry_max_s": 0.04},
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            assert (await c.post(LOAD, json=SQL)).status_code == 502
            delays = []
            for _ in range(4):
                await asyncio.sleep(0.05)  # past the longest wait
                calls = len(loads(b))
                await gw.registry.health_once()
                await until(lambda n=calls: len(loads(b)) == n + 1)
                await until(lambda: ("p/b:8000", "sql") not in gw.lora_admin._reconciling)
                delays.append(gw.lora_admin._retry[("p/b:8000", "sql")].delay_s)
            assert delays == [0.01, 0.02, 0.04, 0.04]
            missing = (await c.get("/admin/lora")).json()["adapters"][0]["missing"]
            assert [m["worker"] for m in missing] == ["p/b:8000"] and 0 <= missing[0]["next_try_in_s"] <= 0.04
            # ... and only there: it was listed as serving too
            assert (await c.get("/admin/lora")).json()["adapters"][0]["serving"] == ["p/a:8000"]
            # within the wait, a health check does not ask again
            calls = len(loads(b))
            await gw.registry.health_once()
            await asyncio.sleep(0.005)
            assert len(loads(b)) in (calls, calls + 1)  # the wait may just have run out (0.04 s)

    run(body)


def test_unload_forgets_first_asks_every_holder_and_a_new_worker_does_not_get_it_back() -> None:
    a, b, new = workers("a", "b", "new")
    cfg = config(pool("p", "H100", "mixed", a, b))

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b, new)) as (c, gw):
            assert (await c.post(LOAD, json=SQL)).status_code == 200
            del b.adapters["sql"]  # unloaded on b behind the gateway's back: its 404 counts as unloaded
            r = await c.post(UNLOAD, json={"lora_name": "sql"})
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' removed successfully."
            assert a.adapters == {} and gw.registry.adapter_models() == {} and gw.lora_admin.desired == {}
            assert (await c.post(CHAT, json=chat() | {"model": "sql"})).status_code == 404
            gw.registry.sync_pool("p", [Endpoint(n, w.url) for n, w in (("a:8000", a), ("new:8000", new))])
            await until(lambda: gw.registry.get("p/new:8000") is not None)
            await gw.registry.health_once()
            await asyncio.sleep(0.02)
            assert new.lora_calls == []
            r = await c.post(UNLOAD, json={"lora_name": "sql"})
            assert r.status_code == 404
            assert r.json() == {
                "error": {
                    "message": "The lora adapter 'sql' cannot be found.",
                    "type": "NotFoundError",
                    "param": "lora_name",
                    "code": 404,
                }
            }

    run(body)


def test_no_worker_up_is_a_503_and_draining_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = workers("a", "b", health_ok=False)

    async def body() -> None:
        async with gateway(config(pool("p", "H100", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            r = await c.post(LOAD, json=SQL)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert a.lora_calls == [] and gw.lora_admin.desired == {}
            gw.draining = True
            r = await c.post(LOAD, json=SQL)
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
            gw.draining = False

    run(body)


def test_without_reconcile_nothing_is_remembered() -> None:
    a, new = workers("a", "new")
    cfg = config(pool("p", "H100", "mixed", a), lora={"reconcile": False})

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, new)) as (c, gw):
            assert (await c.post(LOAD, json=SQL)).status_code == 200
            assert gw.lora_admin.desired == {}
            gw.registry.sync_pool("p", [Endpoint("a:8000", a.url), Endpoint("new:8000", new.url)])
            await until(
                lambda: (r := gw.registry.get("p/new:8000")) is not None and r.adapters_at is not None
            )
            await asyncio.sleep(0.02)
            assert new.lora_calls == []

    run(body)


def test_an_embedded_simulated_fleet_loads_through_the_gateway_and_a_new_replica_gets_it() -> None:
    """Simulated workers speaking vLLM's run-time LoRA endpoints (`allow_runtime_lora_updating`): a load through
    the gateway reaches both, requests naming the adapter are served, and a replica started later is given it."""
    cfg = validate_config(
        {
            "pools": [
                {
                    "name": "p",
                    "model": MODEL,
                    "gpu": "H100",
                    "endpoints": {
                        "simulated": {"replicas": 2, "time_scale": 1000, "allow_runtime_lora_updating": True}
                    },
                }
            ],
            "health": {"interval_s": 60},
            "scrape": {"interval_s": 60},
        },
        "test",
    )

    async def body() -> None:
        app = create_app(cfg)
        gw = app.state.gateway
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10)
        async with app.router.lifespan_context(app), client as c:
            hub_id = {
                "lora_name": "sql",
                "lora_path": "my-org/sql-lora",
            }  # a Hub id: the simulator reads nothing
            r = await c.post(LOAD, json=hub_id)
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
            assert sorted(r.id for r in gw.registry.records() if "sql" in r.adapters) == [
                "p/sim-0",
                "p/sim-1",
            ]
            for _ in range(3):
                r = await c.post(CHAT, json=chat() | {"model": "sql"})
                assert r.status_code == 200 and r.json()["model"] == "sql"
            await gw.sources["p"].start_replica()
            await gw.registry.resync("p")
            await until(lambda: "sql" in getattr(gw.registry.get("p/sim-2"), "adapters", {}))
            served = (await c.get("/admin/lora")).json()["adapters"][0]["serving"]
            assert served == ["p/sim-0", "p/sim-1", "p/sim-2"]

    run(body)


def test_workers_without_runtime_updating_are_a_502_not_their_bare_404_and_unload_is_no_false_success() -> (
    None
):
    """Workers started without VLLM_ALLOW_RUNTIME_LORA_UPDATING have no such route (FastAPI's 404
    `{"detail": "Not Found"}`): a load is not answered with that body (no OpenAI error object), and an unload
    of a static adapter (`--lora-modules`) every worker still lists is not reported removed."""
    a, b = FakeWorker("a"), FakeWorker("b")
    a.adapters["sql"] = b.adapters["sql"] = "/adapters/sql"  # as from --lora-modules

    async def body() -> None:
        async with gateway(config(pool("p", "H100", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            r = await c.post(LOAD, json={"lora_name": "chat", "lora_path": "/adapters/chat"})
            assert r.status_code == 502
            error = r.json()["error"]
            assert (
                error["type"] == "BadGatewayError" and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in error["message"]
            )
            r = await c.post(UNLOAD, json={"lora_name": "sql"})
            assert r.status_code == 502, r.text
            assert "unloaded from 0 of 2" in r.json()["error"]["message"]
            assert gw.registry.adapter_models() == {"sql": MODEL}
            assert metric(gw, "mosaic_lora_admin_calls_total", operation="unload", outcome="failed") == 2

    run(body)


def test_admin_lora_shows_a_worker_left_on_an_older_path_by_an_in_place_reload() -> None:
    """An in-place reload (new weights at a new path) reaches the workers up at the time; one that was down
    still lists the old path when it is back. Reconcile leaves it (another gateway replica may have put that
    path there: reloading would flap between replicas), and `GET /admin/lora` does not count it as serving."""
    a, b = workers("a", "b")
    cfg = config(pool("p", "H100", "mixed", a, b), scrape={"interval_s": 60, "models_interval_s": 0.01})

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            assert (await c.post(LOAD, json=SQL)).status_code == 200
            b.health_ok = False
            gw.registry.get("p/b:8000").health_ok = False  # type: ignore[union-attr]
            v2 = {"lora_name": "sql", "lora_path": "/adapters/sql-v2", "load_inplace": True}
            assert (await c.post(LOAD, json=v2)).status_code == 200
            assert a.adapters["sql"] == "/adapters/sql-v2" and b.adapters["sql"] == "/adapters/sql"
            described = (await c.get("/admin/lora")).json()["adapters"][0]
            assert described["serving"] == ["p/a:8000"] and described["missing"] == []
            assert described["other_path"] == [{"worker": "p/b:8000", "path": "/adapters/sql"}]

    run(body)


def test_reconciles_of_one_adapter_on_several_new_workers_run_at_once_and_an_unload_waits_for_them() -> None:
    """A scale-out's new workers each load a remembered adapter at once (not one after another behind one
    lock: a slow load times N), and an unload of it waits for those loads, then takes it off them too."""
    a, n1, n2 = workers("a", "n1", "n2")
    gate = asyncio.Event()

    async def body() -> None:
        async with gateway(config(pool("p", "H100", "mixed", a)), FakeFleet(a, n1, n2)) as (c, gw):
            assert (await c.post(LOAD, json=SQL)).status_code == 200
            n1.lora_gate = n2.lora_gate = gate
            gw.registry.sync_pool("p", [Endpoint(f"{w.name}:8000", w.url) for w in (a, n1, n2)])
            await until(lambda: n1.lora_loading == 1 and n2.lora_loading == 1)  # both in flight together
            unload = asyncio.create_task(c.post(UNLOAD, json={"lora_name": "sql"}))
            await asyncio.sleep(0.02)
            assert not unload.done() and [p for p, _, _ in a.lora_calls] == [LOAD]
            gate.set()
            r = await unload
            assert r.status_code == 200
            assert a.adapters == n1.adapters == n2.adapters == {}
            assert gw.lora_admin.desired == {}

    run(body)


def test_a_flag_reads_as_vllms_pydantic_reads_it() -> None:
    a, b = workers("a", "b")

    async def body() -> None:
        async with gateway(config(pool("p", "H100", "mixed", a, b)), FakeFleet(a, b)) as (c, _):
            assert (await c.post(LOAD, json=SQL | {"is_3d_lora_weight": "false"})).status_code == 200
            r = await c.post(LOAD, json=SQL | {"lora_path": "/adapters/sql-v2", "load_inplace": "yes"})
            assert r.status_code == 200 and loads(a)[-1]["load_inplace"] is True

    run(body)


def test_an_unload_through_another_replica_is_not_undone_and_a_restart_gets_it_back() -> None:
    """Replica A loaded it; the workers drop it without having been down (replica B's unload, or one by hand):
    A forgets it rather than loading it back. A worker that was down (a restart) and comes back without it
    gets it again."""
    a, b = workers("a", "b")
    cfg = config(pool("p", "H100", "mixed", a, b), scrape={"interval_s": 60, "models_interval_s": 0.01})

    async def body() -> None:
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            assert (await c.post(LOAD, json=SQL)).status_code == 200
            # a restart of b: down for a check, back without the adapter
            b.health_ok = False
            await gw.registry.health_once()
            b.health_ok, b.adapters = True, {}
            await asyncio.sleep(0.02)
            await gw.registry.health_once()
            await until(lambda: b.adapters.get("sql") == "/adapters/sql")
            assert len(loads(b)) == 2
            # another replica unloads it from both (they stay up): forgotten, not loaded back
            a.adapters.clear()
            b.adapters.clear()
            await asyncio.sleep(0.02)
            await gw.registry.health_once()
            await until(lambda: gw.lora_admin.desired == {})
            assert metric(gw, "mosaic_lora_admin_calls_total", operation="forget", outcome="ok") == 1
            await asyncio.sleep(0.02)
            await gw.registry.health_once()
            await asyncio.sleep(0.02)
            assert len(loads(a)) == 1 and len(loads(b)) == 2 and a.adapters == b.adapters == {}

    run(body)


def test_an_unload_reaches_a_worker_whose_last_list_did_not_show_the_adapter() -> None:
    a, b = workers("a", "b")
    a.adapters["sql"] = "/adapters/sql"

    async def body() -> None:
        async with gateway(config(pool("p", "H100", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            b.adapters["sql"] = "/adapters/sql"  # loaded there since its last /v1/models read (a resolver)
            assert "sql" not in gw.registry.get("p/b:8000").adapters  # type: ignore[union-attr]
            r = await c.post(UNLOAD, json={"lora_name": "sql"})
            assert r.status_code == 200 and a.adapters == {} and b.adapters == {}

    run(body)
