"""Runtime LoRA updating on the simulated worker, as vLLM 0.32 serves it with VLLM_ALLOW_RUNTIME_LORA_UPDATING:
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vllm/entrypoints/serve/lora/api_router.py and
`OpenAIServingModels.load_lora_adapter` / `unload_lora_adapter`), their exact bodies, and what a loaded or
unloaded adapter does to `/v1/models`, requests, `max_loras` and `vllm:lora_requests_info`."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from simulator.engine import EngineConfig
from simulator.lora import LoraModule, runtime_lora_updating
from simulator.worker_app import FaultConfig, WorkerConfig
from tests.simulator.test_worker_lora import blank_times_and_ids, card, lora_series, wait_until

pytestmark = pytest.mark.anyio
M = "llama-3-8b"
SQL = LoraModule("sql", "/adapters/sql")
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
RUNTIME = WorkerConfig(
    gpu="H100", model=M, time_scale=1000.0, seed=7, lora_modules=(SQL,), allow_runtime_lora_updating=True
)
HUB = "acme/tiny-lora"  # a Hugging Face id: vLLM would download it; the simulator accepts it unread


def error(status: int, message: str, type_: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def adapter_dir(tmp_path: Path, name: str) -> Path:
    """A directory vLLM's loader would find an adapter in: it opens `adapter_config.json` first."""
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return path


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(WorkerConfig(gpu="H100", model=M, lora_modules=(SQL,)), id="adapters"),
        pytest.param(WorkerConfig(gpu="H100", model=M, enable_lora=True), id="enable_lora"),
        pytest.param(WorkerConfig(gpu="H100", model=M), id="no LoRA"),
    ],
)
async def test_off_by_default_the_routes_are_unknown_paths(asgi, cfg: WorkerConfig) -> None:
    """vLLM's attach_router returns without adding them unless the variable is set: FastAPI's plain 404."""
    async with asgi(cfg) as (client, _):
        load = await client.post(LOAD, json={"lora_name": "x", "lora_path": HUB})
        unload = await client.post(UNLOAD, json={"lora_name": "sql"})
    assert (
        (load.status_code, load.json())
        == (unload.status_code, unload.json())
        == (404, {"detail": "Not Found"})
    )


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("TRUE", True), (" True\n", True), ("0", False), ("false", False),
     ("yes", False), ("on", False), ("", False), (None, False)],
)  # fmt: skip
def test_the_variable_is_read_as_vllm_reads_it(value: str | None, on: bool) -> None:
    environ = {} if value is None else {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}
    assert runtime_lora_updating(environ) is on


async def test_load_serve_list_and_unload_an_adapter(asgi) -> None:
    ask = {"prompt": "hello there", "max_tokens": 3, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with asgi(RUNTIME) as (client, rt):
        loaded = await client.post(LOAD, json={"lora_name": "math", "lora_path": HUB})
        before = int(time.time())
        models = (await client.get("/v1/models")).json()
        after = int(time.time())
        completion = await client.post("/v1/completions", json={**ask, "model": "math"})
        chatted = await client.post("/v1/chat/completions", json={**chat, "model": "math", "stream": True})
        responses = await client.post(
            "/v1/responses", json={"model": "math", "input": "hi", "max_output_tokens": 2}
        )
        tokenized = await client.post("/tokenize", json={"model": "math", "prompt": "hello there"})
        text = (await client.get("/metrics")).text
        unloaded = await client.post(
            UNLOAD, json={"lora_name": "math", "lora_int_id": 99}
        )  # the id is ignored
        gone = await client.post("/v1/completions", json={**ask, "model": "math"})
        gone_tokenize = await client.post("/tokenize", json={"model": "math", "prompt": "hi"})
        models_after = [c["id"] for c in (await client.get("/v1/models")).json()["data"]]
        again = await client.post(LOAD, json={"lora_name": "math", "lora_path": HUB})  # a fresh load after
        assert rt.loras["math"] == LoraModule("math", HUB)
    # vLLM: `Response(status_code=200, content=text)`: a plain body and no media type, so no content-type
    for resp, verb in ((loaded, "added"), (unloaded, "removed"), (again, "added")):
        assert resp.status_code == 200
        assert resp.text == f"Success: LoRA adapter 'math' {verb} successfully."
        assert "content-type" not in resp.headers
    # listed after the static adapters, as vLLM's lora_requests (in load order): root the path, parent the base
    assert blank_times_and_ids(models, before, after)["data"] == [
        card(M, M, None, 8192), card("sql", "/adapters/sql", M, None), card("math", HUB, M, None)
    ]  # fmt: skip
    assert completion.status_code == 200 and completion.json()["model"] == "math"
    chunks = [json.loads(line[6:]) for line in chatted.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"math"}
    assert responses.status_code == 200 and responses.json()["model"] == "math"
    assert tokenized.status_code == 200
    assert any(labels["running_lora_adapters"] == "math" for labels, _ in lora_series(text))
    not_found = error(404, "The model `math` does not exist.", "NotFoundError", "model")
    assert (
        (gone.status_code, gone.json())
        == (gone_tokenize.status_code, gone_tokenize.json())
        == (404, not_found)
    )
    assert models_after == [M, "sql"]


async def test_a_static_adapter_unloads_and_reloads_in_place_keeping_its_place(asgi, tmp_path: Path) -> None:
    """vLLM's static adapters are in the same `lora_requests`: unloadable; `load_inplace` replaces the entry
    (same name, new path) where it is, so `/v1/models` keeps the order."""
    cfg = WorkerConfig(
        gpu="H100", model=M, lora_modules=(SQL, LoraModule("chat", "/adapters/chat")),
        allow_runtime_lora_updating=True,
    )  # fmt: skip
    new_path = str(adapter_dir(tmp_path, "sql-v2"))
    async with asgi(cfg) as (client, _):
        replaced = await client.post(
            LOAD, json={"lora_name": "sql", "lora_path": new_path, "load_inplace": True}
        )
        cards = [(c["id"], c["root"]) for c in (await client.get("/v1/models")).json()["data"]]
        removed = await client.post(UNLOAD, json={"lora_name": "chat"})
        ids = [c["id"] for c in (await client.get("/v1/models")).json()["data"]]
        fresh = await client.post(LOAD, json={"lora_name": "new", "lora_path": HUB, "load_inplace": True})
    assert replaced.text == "Success: LoRA adapter 'sql' added successfully."
    assert cards == [(M, M), ("sql", new_path), ("chat", "/adapters/chat")]
    assert removed.text == "Success: LoRA adapter 'chat' removed successfully."
    assert ids == [M, "sql"]
    assert fresh.status_code == 200  # load_inplace of a name not loaded is a plain load


@pytest.mark.parametrize(
    ("path", "body", "status", "expected"),
    [
        pytest.param(LOAD, {"lora_name": "", "lora_path": HUB}, 400,
                     error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"),
                     id="load: empty name"),
        pytest.param(LOAD, {"lora_name": "x", "lora_path": ""}, 400,
                     error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"),
                     id="load: empty path"),
        pytest.param(LOAD, {"lora_name": M, "lora_path": HUB}, 400,
                     error(400, f"The lora adapter '{M}' conflicts with a served base model.", "InvalidUserInput"),
                     id="load: the served base model's name"),
        pytest.param(LOAD, {"lora_name": "sql", "lora_path": HUB}, 400,
                     error(400, "The lora adapter 'sql' has already been loaded. If you want to load the adapter "
                           "in place, set 'load_inplace' to True.", "InvalidUserInput"),
                     id="load: a loaded name without load_inplace"),
        pytest.param(LOAD, {"lora_name": "sql", "lora_path": HUB, "load_inplace": "false"}, 400,
                     error(400, "The lora adapter 'sql' has already been loaded. If you want to load the adapter "
                           "in place, set 'load_inplace' to True.", "InvalidUserInput"),
                     id="load: load_inplace 'false' (pydantic's lax bool)"),
        # vLLM's LoRAAdapterNotFoundError through create_error_response, its message through sanitize_message
        pytest.param(LOAD, {"lora_name": "y", "lora_path": "/tmp/no/such/adapter"}, 404,
                     error(404, "Loading lora y failed: No adapter found for <path>", "NotFoundError"),
                     id="load: an absolute path with no adapter (sanitized: under /tmp)"),
        pytest.param(LOAD, {"lora_name": "y", "lora_path": "/adapters/y"}, 404,
                     error(404, "Loading lora y failed: No adapter found for /adapters/y", "NotFoundError"),
                     id="load: an absolute path with no adapter (not a path vLLM hides)"),
        pytest.param(UNLOAD, {"lora_name": "nope"}, 404,
                     error(404, "The lora adapter 'nope' cannot be found.", "NotFoundError"),
                     id="unload: a name not loaded"),
        pytest.param(UNLOAD, {"lora_name": M}, 404,
                     error(404, f"The lora adapter '{M}' cannot be found.", "NotFoundError"),
                     id="unload: the base model"),
        pytest.param(UNLOAD, {"lora_name": ""}, 400,
                     error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"),
                     id="unload: empty name"),
        # FastAPI's validation of vLLM's request models, answered by vLLM's validation_exception_handler
        pytest.param(LOAD, {"lora_name": "x"}, 400,
                     error(400, "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', "
                           "'msg': 'Field required', 'input': '<dict of 1 items>'}", "Bad Request", "body.lora_path"),
                     id="load: no path"),
        pytest.param(LOAD, {"lora_name": 5, "lora_path": HUB, "load_inplace": "maybe"}, 400,
                     error(400, "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.lora_name', "
                           "'msg': 'Input should be a valid string', 'input': '5'}\n  {'type': 'bool_parsing', "
                           "'loc': 'body.load_inplace', 'msg': 'Input should be a valid boolean, unable to "
                           "interpret input', 'input': 'maybe'}", "Bad Request", "body.lora_name"),
                     id="load: wrong types"),
        pytest.param(LOAD, {"lora_name": "x", "lora_path": HUB, "is_3d_lora_weight": "/tmp/a.b"}, 400,
                     error(400, "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'body.is_3d_lora_weight', "
                           "'msg': 'Input should be a valid boolean, unable to interpret input', 'input': "
                           "'<path>'}", "Bad Request", "body.is_3d_lora_weight"),
                     id="load: a path-like value in the message is sanitized"),
        pytest.param(UNLOAD, {"lora_name": "sql", "lora_int_id": 1.5}, 400,
                     error(400, "1 validation error:\n  {'type': 'int_from_float', 'loc': 'body.lora_int_id', "
                           "'msg': 'Input should be a valid integer, got a number with a fractional part', "
                           "'input': '1.5'}", "Bad Request", "body.lora_int_id"),
                     id="unload: a fractional id"),
        pytest.param(UNLOAD, {}, 400,
                     error(400, "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_name', "
                           "'msg': 'Field required', 'input': '<dict of 0 items>'}", "Bad Request", "body.lora_name"),
                     id="unload: no name"),
        pytest.param(UNLOAD, [1, 2], 400,
                     error(400, "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': "
                           "'Input should be a valid dictionary or object to extract fields from', 'input': "
                           "'<list of 2 items>'}", "Bad Request", "body"),
                     id="unload: a JSON list"),
        pytest.param(LOAD, None, 400,
                     error(400, "1 validation error:\n  {'type': 'missing', 'loc': 'body', 'msg': 'Field required', "
                           "'input': 'None'}", "Bad Request", "body"),
                     id="load: JSON null"),
    ],
)  # fmt: skip
async def test_vllms_error_bodies(asgi, path: str, body: Any, status: int, expected: dict[str, Any]) -> None:
    async with asgi(RUNTIME) as (client, rt):
        resp = await client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert list(rt.loras) == ["sql"]  # nothing loaded or removed
    assert resp.status_code == status
    assert resp.json() == expected


@pytest.mark.parametrize(
    ("content", "content_type", "expected"),
    [
        pytest.param(b'{"lora_name": ', "application/json",
                     error(400, "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.14', 'msg': 'JSON "
                           "decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}",
                           "Bad Request", "body.14"),
                     id="malformed JSON: FastAPI parses first"),
        pytest.param(b'{"lora_name": "x", "lora_path": "p"}', "text/plain",
                     error(400, "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                           "Bad Request"),
                     id="not JSON: vLLM's validate_json_request"),
        pytest.param(b'{"lora_name": "x", "lora_path": "p"}', None,
                     error(400, "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                           "Bad Request"),
                     id="no content type"),
        pytest.param(b'{"lora_name": ', "application/vnd.api+json",
                     error(400, "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.14', 'msg': 'JSON "
                           "decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}",
                           "Bad Request", "body.14"),
                     id="+json is parsed by FastAPI before vLLM refuses its media type"),
        pytest.param(b"", "application/json",
                     error(400, "1 validation error:\n  {'type': 'missing', 'loc': 'body', 'msg': 'Field required', "
                           "'input': 'None'}", "Bad Request", "body"),
                     id="empty body"),
        pytest.param(b"\xff\xfe\xff", "application/json",
                     error(400, "There was an error parsing the body", "Bad Request"), id="bytes that are no text"),
    ],
)  # fmt: skip
async def test_bodies_fastapi_refuses(asgi, content: bytes, content_type: str | None, expected: Any) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    async with asgi(RUNTIME) as (client, _):
        resp = await client.post(LOAD, content=content, headers=headers)
    assert (resp.status_code, resp.json()) == (400, expected)


async def test_a_load_without_lora_enabled_is_the_engines_500(asgi) -> None:
    """vLLM attaches the routes on the variable alone; its engine's add_lora then fails ("LoRA is not
    enabled", EngineCoreProc's "Call to add_lora method failed: ..."), which load_lora_adapter answers 500.
    Its checks come first: an unload of anything is its 404."""
    cfg = WorkerConfig(gpu="H100", model=M, allow_runtime_lora_updating=True)
    async with asgi(cfg) as (client, rt):
        load = await client.post(LOAD, json={"lora_name": "x", "lora_path": HUB})
        conflict = await client.post(LOAD, json={"lora_name": M, "lora_path": HUB})
        unload = await client.post(UNLOAD, json={"lora_name": "x"})
        completion = await client.post(
            "/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 1}
        )
        text = (await client.get("/metrics")).text
        assert rt.loras == {}
    assert (load.status_code, load.json()) == (500, error(
        500, "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable LoRA.",
        "InternalServerError",
    ))  # fmt: skip
    assert conflict.status_code == 400
    assert unload.status_code == 404
    assert completion.status_code == 404
    assert "lora" not in text  # no LoRA config: no vllm:lora_requests_info, as in vLLM


async def test_an_existing_adapter_directory_loads(asgi, tmp_path: Path) -> None:
    path = str(adapter_dir(tmp_path, "real"))
    async with asgi(RUNTIME) as (client, _):
        resp = await client.post(LOAD, json={"lora_name": "real", "lora_path": path})
        served = await client.post("/v1/completions", json={"model": "real", "prompt": "hi", "max_tokens": 1})
    assert resp.text == "Success: LoRA adapter 'real' added successfully."
    assert served.json()["model"] == "real"


async def test_a_runtime_adapter_counts_toward_max_loras(asgi) -> None:
    """max_loras 1: a request for the runtime-loaded adapter sent while the static one's runs waits for it,
    and vllm:lora_requests_info lists it once it runs."""
    cfg = WorkerConfig(
        gpu="H100", model=M, time_scale=1.0, lora_modules=(SQL,), allow_runtime_lora_updating=True
    )
    async with asgi(cfg) as (client, rt):
        assert (await client.post(LOAD, json={"lora_name": "math", "lora_path": HUB})).status_code == 200
        # ~1.6 s of decoding at this scale: the second request reaches the engine long before it ends
        long = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True}
        first = asyncio.create_task(client.post("/v1/completions", json={**long, "model": "sql"}))
        await wait_until(lambda: rt.engine.num_running == 1)
        short = {"prompt": "hello", "max_tokens": 2, "ignore_eos": True, "model": "math"}
        second = asyncio.create_task(client.post("/v1/completions", json=short))
        await wait_until(lambda: rt.engine.num_waiting == 1)
        assert rt.engine.num_running == 1 and not first.done()
        assert (await first).json()["model"] == "sql"
        assert (await second).json()["model"] == "math"
        text = (await client.get("/metrics")).text
    running = [labels["running_lora_adapters"] for labels, _ in lora_series(text)]
    assert running.index("sql") < running.index("math")


async def test_unloading_an_adapter_with_a_request_running_lets_it_finish(asgi) -> None:
    """vLLM's unload only drops the name from the API server's list: the engine keeps the adapter and the
    requests already running with it finish, answered under its name; new requests naming it are its 404."""
    cfg = WorkerConfig(
        gpu="H100", model=M, time_scale=1.0, enable_lora=True, allow_runtime_lora_updating=True
    )
    async with asgi(cfg) as (client, rt):
        await client.post(LOAD, json={"lora_name": "math", "lora_path": HUB})
        body = {"model": "math", "prompt": "hello", "max_tokens": 200, "ignore_eos": True}  # ~1.6 s
        plain = asyncio.create_task(client.post("/v1/completions", json=body))
        streamed = asyncio.create_task(client.post("/v1/chat/completions", json={
            "model": "math", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True,
        }))  # fmt: skip
        await wait_until(lambda: len(rt.metrics.lora.requests.get("math", ())) == 2)
        unloaded = await client.post(UNLOAD, json={"lora_name": "math"})
        refused = await client.post("/v1/completions", json=body)
        # still running with the adapter: both tracked under it (from their first tokens) after the unload
        assert len(rt.metrics.lora.requests["math"]) == 2 and rt.engine.num_running == 2
        done, chunks = (await plain), (await streamed)
        assert rt.metrics.lora.requests == {}  # both stopped counting for it when they finished
    assert unloaded.status_code == 200 and refused.status_code == 404
    assert done.status_code == 200 and done.json()["model"] == "math"
    assert done.json()["usage"]["completion_tokens"] == 200
    events = [json.loads(line[6:]) for line in chunks.text.splitlines() if line.startswith("data: {")]
    assert {e["model"] for e in events} == {"math"} and chunks.text.rstrip().endswith("data: [DONE]")


async def test_a_request_past_its_model_check_keeps_its_adapter_through_an_unload(asgi) -> None:
    """The adapter is resolved with the model check, before the request's first wait (here a stall): vLLM
    resolves its LoRARequest in the handler, so an unload in between does not make it a base-model request."""
    cfg = WorkerConfig(
        gpu="H100", model=M, time_scale=1000.0, enable_lora=True, allow_runtime_lora_updating=True,
        faults=FaultConfig(stall_rate=1.0, stall_s=1.0),
    )  # fmt: skip
    async with asgi(cfg) as (client, _):
        await client.post(LOAD, json={"lora_name": "math", "lora_path": HUB})
        task = asyncio.create_task(
            client.post("/v1/completions", json={"model": "math", "prompt": "hi", "max_tokens": 2})
        )
        await asyncio.sleep(0.3)  # the request is stalled, its model checked
        assert (await client.post(UNLOAD, json={"lora_name": "math"})).status_code == 200
        resp = await task
        text = (await client.get("/metrics")).text
    assert resp.status_code == 200 and resp.json()["model"] == "math"
    assert any(labels["running_lora_adapters"] == "math" for labels, _ in lora_series(text))


async def test_data_parallel_engines_serve_a_runtime_adapter(asgi) -> None:
    cfg = WorkerConfig(
        gpu="H100",
        model=M,
        time_scale=1e4,
        data_parallel_size=2,
        enable_lora=True,
        allow_runtime_lora_updating=True,
    )
    async with asgi(cfg) as (client, _):
        await client.post(LOAD, json={"lora_name": "math", "lora_path": HUB})
        body = {"model": "math", "prompt": "hi", "max_tokens": 2}
        ranks = [
            await client.post("/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)})
            for rank in (0, 1)
        ]
    assert [r.json()["model"] for r in ranks] == ["math", "math"]


async def test_max_loras_above_one_batches_a_runtime_and_a_static_adapter(asgi) -> None:
    cfg = WorkerConfig(
        gpu="H100", model=M, time_scale=1.0, lora_modules=(SQL,), allow_runtime_lora_updating=True,
        engine=EngineConfig(max_loras=2),
    )  # fmt: skip
    async with asgi(cfg) as (client, rt):
        await client.post(LOAD, json={"lora_name": "math", "lora_path": HUB})
        long = {"prompt": "hello", "max_tokens": 100, "ignore_eos": True}
        tasks = [
            asyncio.create_task(client.post("/v1/completions", json={**long, "model": m}))
            for m in ("sql", "math")
        ]
        await wait_until(lambda: rt.engine.num_running == 2)  # both adapters in one batch
        assert [(await t).json()["model"] for t in tasks] == ["sql", "math"]
