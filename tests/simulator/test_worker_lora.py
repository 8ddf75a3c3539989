"""LoRA adapters on the simulated worker, in vLLM 0.32's shapes: `/v1/models`, requests naming an adapter,
unknown names, `vllm:lora_requests_info`, and the `max_loras` admission seen through HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.engine import EngineConfig
from simulator.lora import LoraModule
from simulator.requests import EngineRequest
from simulator.worker_app import WorkerConfig

pytestmark = pytest.mark.anyio
M = "llama-3-8b"
SQL, CHAT = LoraModule("sql", "/adapters/sql"), LoraModule("chat", "/adapters/chat", base_model_name="other")
FAST = WorkerConfig(gpu="H100", model=M, time_scale=1000.0, seed=7, lora_modules=(SQL, CHAT))


def permission() -> dict[str, Any]:
    """vLLM 0.32's `ModelPermission()` dumped, with its per-call `id` and `created` left to the caller."""
    return {
        "id": None, "object": "model_permission", "created": None, "allow_create_engine": False,
        "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
        "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False,
    }  # fmt: skip


def card(id: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
    return {
        "id": id, "object": "model", "created": None, "owned_by": "vllm", "root": root, "parent": parent,
        "max_model_len": max_model_len, "permission": [permission()],
    }  # fmt: skip


def blank_times_and_ids(body: dict[str, Any], before: int, after: int) -> dict[str, Any]:
    """Check the per-call fields (`created`: the call's time; permission ids: vLLM's "modelperm-" + 16 hex)
    and blank them, so the rest compares exactly."""
    for c in body["data"]:
        assert before <= c["created"] <= after
        c["created"] = None
        for p in c["permission"]:
            assert re.fullmatch(r"modelperm-[0-9a-f]{16}", p["id"]) and before <= p["created"] <= after
            p["id"] = p["created"] = None
    return body


async def test_models_lists_the_base_card_then_each_adapter_as_vllm_does(asgi) -> None:
    async with asgi(FAST) as (client, _):
        before = int(time.time())
        resp = await client.get("/v1/models")
        after = int(time.time())
    assert resp.status_code == 200
    body = blank_times_and_ids(resp.json(), before, after)
    # vLLM 0.32's show_available_models: ModelCard(id=served, root=model path, max_model_len, one permission),
    # then per adapter ModelCard(id=name, root=path, parent=the served base name — a JSON module's
    # base_model_name counts only when it is a served name —, permission), max_model_len left None;
    # H100 + Llama-3-8B: max_model_len = the model's 8,192 context (the KV cache holds more)
    assert body == {
        "object": "list",
        "data": [
            card(M, M, None, 8192),
            card("sql", "/adapters/sql", M, None),
            card("chat", "/adapters/chat", M, None),
        ],
    }
    # vLLM's field order (pydantic's model_dump follows the class)
    assert list(resp.json()["data"][1]) == list(card("x", "", None, None))
    assert list(resp.json()["data"][1]["permission"][0]) == list(permission())


async def test_models_without_adapters_is_the_base_card_alone(asgi) -> None:
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1000.0)) as (client, _):
        before = int(time.time())
        resp = await client.get("/v1/models")
        after = int(time.time())
    assert blank_times_and_ids(resp.json(), before, after) == {
        "object": "list",
        "data": [card(M, M, None, 8192)],
    }


async def test_a_request_naming_an_adapter_is_answered_with_its_name(asgi) -> None:
    ask = {"prompt": "hello there", "max_tokens": 3, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "ignore_eos": True}
    async with asgi(FAST) as (client, rt):
        completion = await client.post("/v1/completions", json={**ask, "model": "sql"})
        chatted = await client.post("/v1/chat/completions", json={**chat, "model": "chat"})
        streamed = await client.post("/v1/chat/completions", json={**chat, "model": "sql", "stream": True})
        echoed = await client.post(
            "/v1/completions", json={**ask, "model": "sql", "echo": True, "max_tokens": 0, "stream": True}
        )
        responses = await client.post(
            "/v1/responses", json={"model": "chat", "input": "hi", "max_output_tokens": 2}
        )
        tokenized = await client.post("/tokenize", json={"model": "sql", "prompt": "hello there"})
        detokenized = await client.post("/detokenize", json={"model": "chat", "tokens": [1, 2]})
        base = await client.post("/v1/completions", json={**ask, "model": M})
        unnamed = await client.post("/v1/completions", json=ask)
        success = sum(rt.engine.counters.success.values())
    assert completion.status_code == 200 and completion.json()["model"] == "sql"
    assert completion.json()["usage"]["completion_tokens"] == 3
    assert chatted.status_code == 200 and chatted.json()["model"] == "chat"
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"sql"}
    echo_chunks = [json.loads(line[6:]) for line in echoed.text.splitlines() if line.startswith("data: {")]
    assert echo_chunks and {c["model"] for c in echo_chunks} == {"sql"}
    assert responses.status_code == 200 and responses.json()["model"] == "chat"
    assert tokenized.status_code == 200 and tokenized.json()["count"] == 3  # ceil(11 / 4)
    assert detokenized.status_code == 200
    assert base.json()["model"] == M and unnamed.json()["model"] == M  # the base model, as before
    assert success == 7  # every generating request ran in the engine (the echo samples one token)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/completions", {"prompt": "hi"}, id="completions"),
        pytest.param("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, id="chat"),
        pytest.param("/v1/responses", {"input": "hi"}, id="responses"),
        pytest.param("/tokenize", {"prompt": "hi"}, id="tokenize"),
        pytest.param("/detokenize", {"tokens": [1]}, id="detokenize"),
    ],
)
async def test_an_unknown_adapter_is_vllms_404_beside_a_known_one(
    asgi, path: str, body: dict[str, Any]
) -> None:
    async with asgi(FAST) as (client, _):
        known = await client.post(path, json={**body, "model": "sql"})
        resp = await client.post(path, json={**body, "model": "nope"})
    assert known.status_code == 200, known.text
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("NotFoundError", "model", 404)
    assert err["message"].startswith("The model `nope` does not exist.")


def lora_series(text: str) -> list[tuple[dict[str, str], float]]:
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    fam = fams["vllm:lora_requests_info"]
    assert fam.type == "gauge" and fam.documentation == "Running stats on lora requests."
    return [(s.labels, s.value) for s in fam.samples]


async def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


async def test_max_loras_1_serves_two_adapters_one_after_the_other_and_lora_info_keeps_every_label_set(
    asgi,
) -> None:
    """max_loras 1: `sql` arrives while `chat` runs and waits for it; the base model's request does not.
    `vllm:lora_requests_info` gets a series per adapter list seen (vLLM removes none), the current one is
    the largest."""
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1.0, lora_modules=(SQL, CHAT))
    async with asgi(cfg) as (client, rt):
        assert lora_series((await client.get("/metrics")).text) == []  # the family, no step yet
        rt.metrics.lora.clock = itertools.count(1).__next__  # step k's value is k: later is larger
        long = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True}
        first = asyncio.create_task(client.post("/v1/completions", json={**long, "model": "chat"}))
        await wait_until(lambda: rt.inflight == 1)
        short = {"prompt": "hello", "max_tokens": 2, "ignore_eos": True}
        second = asyncio.create_task(client.post("/v1/completions", json={**short, "model": "sql"}))
        base = asyncio.create_task(client.post("/v1/completions", json={**short, "model": M}))
        # the base request runs beside `chat` (2 tokens, done long before chat's 40); `sql` waits (vLLM: skipped
        # for max_loras), still waiting when the base request is answered
        assert (await base).json()["model"] == M
        assert [v.state for v in rt.engine.requests()] in (["decoding", "waiting"], ["waiting", "decoding"])
        assert not first.done() and not second.done()
        assert (await first).json()["model"] == "chat" and (await second).json()["model"] == "sql"
        text = (await client.get("/metrics")).text
    series = lora_series(text)
    # first set order: `chat` from its first token; none once it finished (sql waiting, not yet started);
    # `sql` from its first token; none again after it (that last step updated the "" series)
    labels = [(s["max_lora"], s["waiting_lora_adapters"], s["running_lora_adapters"]) for s, _ in series]
    assert labels == [("1", "chat", "chat"), ("1", "", ""), ("1", "sql", "sql")]
    values = dict(zip([lab[1] for lab in labels], [v for _, v in series], strict=True))
    assert values["chat"] < values["sql"] < values[""]  # the current one, none running, is the largest
    assert re.search(
        r'^vllm:lora_requests_info\{max_lora="1",running_lora_adapters="sql",waiting_lora_adapters="sql"\} ',
        text,
        re.M,
    )


async def test_lora_info_lists_adapters_in_the_order_vllm_started_tracking_them(asgi) -> None:
    """Both adapters run in one step (max_loras 2); the names are joined in the order their requests' first
    tokens were processed (the admission order), not sorted."""
    cfg = WorkerConfig(
        gpu="H100", model=M, time_scale=1e4, lora_modules=(SQL, CHAT), engine=EngineConfig(max_loras=2)
    )
    async with asgi(cfg) as (client, rt):
        tickets = []
        # submitted with no suspension in between (at this scale the API overhead is under 1 ms: no sleep),
        # so the first step admits both, chat first
        for rid, lora in (("r-chat", "chat"), ("r-sql", "sql")):
            tickets += await rt.driver.submit_all(
                [EngineRequest(rid, 8, 3, ignore_eos=True, lora=lora)], False
            )
        for tk in tickets:
            await tk.wait_done()
        text = (await client.get("/metrics")).text
    labels = [(s["max_lora"], s["running_lora_adapters"]) for s, _ in lora_series(text)]
    assert labels == [("2", "chat,sql"), ("2", "")]


async def test_an_aborted_request_stops_counting_for_its_adapter(asgi) -> None:
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1.0, lora_modules=(SQL,))
    async with asgi(cfg) as (_, rt):
        (tk,) = await rt.driver.submit_all([EngineRequest("r", 8, 500, ignore_eos=True, lora="sql")], True)
        await wait_until(lambda: tk.produced > 0)
        assert list(rt.metrics.lora.requests) == ["sql"]
        rt.driver.abort(tk)
        assert rt.metrics.lora.requests == {}


async def test_no_lora_info_without_adapters(asgi) -> None:
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1e4)) as (client, _):
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        text = (await client.get("/metrics")).text
    assert "lora" not in text


@pytest.mark.parametrize(
    ("modules", "message"),
    [
        pytest.param((SQL, LoraModule("sql", "/elsewhere")), "The lora adapter 'sql' has already been loaded.",
                     id="a name twice"),
        pytest.param((LoraModule(M, "/p"),), f"The lora adapter '{M}' conflicts with a served base model.",
                     id="the base model's name"),
        pytest.param((LoraModule("", "/p"),), "Both 'lora_name' and 'lora_path' must be provided.", id="no name"),
        pytest.param((LoraModule("x", ""),), "Both 'lora_name' and 'lora_path' must be provided.", id="no path"),
    ],
)  # fmt: skip
async def test_vllms_startup_refusals(asgi, modules: tuple[LoraModule, ...], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        async with asgi(WorkerConfig(gpu="H100", model=M, lora_modules=modules)):
            pass


async def test_the_served_name_is_what_an_adapter_may_not_take(asgi) -> None:
    taken = WorkerConfig(
        gpu="H100", model=M, served_model_name="base", lora_modules=(LoraModule("base", "/p"),)
    )
    with pytest.raises(ValueError, match="conflicts with a served base model"):
        async with asgi(taken):
            pass
    # served as "base", the catalog name is no served name: an adapter may take it (vLLM's is_base_model)
    free = WorkerConfig(gpu="H100", model=M, served_model_name="base", lora_modules=(LoraModule(M, "/p"),))
    async with asgi(free) as (client, _):
        resp = await client.post("/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 1})
    assert resp.json()["model"] == M


async def test_a_real_socket_openai_client_names_the_adapter(served) -> None:
    async with served(FAST) as w, openai.AsyncOpenAI(base_url=w.url + "/v1", api_key="none") as client:
        models = [m.id async for m in client.models.list()]
        r = await client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert models == [M, "sql", "chat"]
    assert r.model == "sql"


async def test_data_parallel_engines_share_one_lora_info_gauge(asgi) -> None:
    """vLLM's gauge is the API server's (no `engine` label): an adapter running on engine 1 shows in it."""
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1e4, data_parallel_size=2, lora_modules=(SQL,))
    async with asgi(cfg) as (client, _):
        body = {"model": "sql", "prompt": "hi", "max_tokens": 2}
        resp = await client.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "1"})
        text = (await client.get("/metrics")).text
    assert resp.json()["model"] == "sql"
    assert [s for s, _ in lora_series(text)] == [
        {"max_lora": "1", "waiting_lora_adapters": "sql", "running_lora_adapters": "sql"},
        {"max_lora": "1", "waiting_lora_adapters": "", "running_lora_adapters": ""},
    ]
