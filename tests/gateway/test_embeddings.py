"""End to end over real sockets: the `openai` SDK's embeddings → gateway → simulated pooling workers
(`runner: pooling`, vLLM's `--runner pooling`), beside a generative model on its own pool. Routed, KV-reserved
(the prompt only: an embedding ends at its prefill) and metered like any request; each model answers only
its own endpoints."""

from __future__ import annotations

import base64
import collections.abc
import json
import struct

import httpx
import openai
import pytest

from server.config import validate_config
from tests.gateway.pooling_fleet import CHAT, CONTEXT, EMBED, HIDDEN, pooling_fleet
from tests.gateway.serverkit import GatewayThread


@pytest.fixture(scope="module")
def gw() -> collections.abc.Iterator[GatewayThread]:
    with GatewayThread(pooling_fleet()) as thread:
        yield thread


@pytest.fixture
def client(gw: GatewayThread) -> collections.abc.Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_the_sdk_embeds_a_batch_through_the_gateway(client: openai.OpenAI, gw: GatewayThread) -> None:
    """The SDK asks for base64 by default and decodes it: the worker's bytes reach it untouched."""
    before = gw.metric("mosaic_prompt_tokens_total", model=EMBED)
    r = client.embeddings.create(model=EMBED, input=[[1, 2, 3], [4, 5, 6, 7]])
    assert [d.index for d in r.data] == [0, 1]
    assert all(len(d.embedding) == HIDDEN for d in r.data)
    norms = [sum(x * x for x in d.embedding) for d in r.data]
    assert all(abs(n - 1.0) < 1e-3 for n in norms)  # vLLM normalises embeddings
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (7, 7)
    assert gw.metric_reaches("mosaic_prompt_tokens_total", before + 7, model=EMBED) == before + 7
    assert gw.metric("mosaic_generation_tokens_total", model=EMBED) == 0
    again = client.embeddings.create(model=EMBED, input=[[1, 2, 3]])
    assert (
        again.data[0].embedding == r.data[0].embedding
    )  # the same tokens, the same vector, on either worker


def test_float_and_base64_answers_carry_the_same_vector(gw: GatewayThread) -> None:
    body = {"model": EMBED, "input": [9, 8, 7]}
    floats = httpx.post(gw.url + "/v1/embeddings", json={**body, "encoding_format": "float"}, timeout=30)
    packed = httpx.post(gw.url + "/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=30)
    assert floats.status_code == packed.status_code == 200
    assert floats.headers["x-request-id"]
    vector = floats.json()["data"][0]["embedding"]
    raw = base64.b64decode(packed.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vector, rel=1e-6)


def _successes(metrics: str) -> float:
    """A worker's `vllm:request_success_total`, summed over its labels."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


def test_embeddings_are_routed_over_the_pool_and_their_kv_released(gw: GatewayThread) -> None:
    """Every request ends completed on the pooling pool, spread over both workers (the router's load
    scorers), each one a KV reservation in the ledger, none left open after."""
    done = gw.metric("mosaic_requests_total", model=EMBED, pool="embed-l4", status="200")
    reserved = gw.metric("mosaic_kv_reservations_total")
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        pooling = [w for w in http.get("/admin/workers").json()["workers"] if w["pool"] == "embed-l4"]
        served = [_successes(http.get(w["url"] + "/metrics").text) for w in pooling]
        for i in range(12):
            r = http.post("/v1/embeddings", json={"model": EMBED, "input": f"sentence number {i} " * 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0
        after = [_successes(http.get(w["url"] + "/metrics").text) for w in pooling]
    assert gw.metric("mosaic_requests_total", model=EMBED, pool="embed-l4", status="200") == done + 12
    assert sum(after) - sum(served) == 12 and all(a > s for a, s in zip(after, served, strict=True))
    assert gw.metric("mosaic_kv_reservations_total") == reserved + 12
    for w in pooling:
        assert gw.metric("mosaic_kv_total_units", worker=w["id"]) > 0  # the ledger books this worker
        assert gw.metric("mosaic_kv_active_reservations", worker=w["id"]) == 0


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/v1/chat/completions",
            {"model": EMBED, "messages": [{"role": "user", "content": "hi"}]},
            f"The model `{EMBED}` is a pooling model (runner: pooling) and does not serve /v1/chat/completions",
        ),
        (
            "/v1/completions",
            {"model": EMBED, "prompt": "hi"},
            f"The model `{EMBED}` is a pooling model (runner: pooling) and does not serve /v1/completions",
        ),
        (
            "/v1/embeddings",
            {"model": CHAT, "input": "hi"},
            f"The model `{CHAT}` is a generative model (runner: generate) and does not serve /v1/embeddings",
        ),
        (
            "/rerank",
            {"model": CHAT, "query": "q", "documents": ["d"]},
            f"The model `{CHAT}` is a generative model (runner: generate) and does not serve /rerank",
        ),
        (
            "/v1/score",
            {"model": CHAT, "text_1": "q", "text_2": "d"},
            f"The model `{CHAT}` is a generative model (runner: generate) and does not serve /v1/score",
        ),
    ],
)
def test_a_model_answers_only_its_runners_endpoints(
    gw: GatewayThread, path: str, body: dict[str, object], message: str
) -> None:
    r = httpx.post(gw.url + path, json=body, timeout=30)
    assert r.status_code == 400
    assert r.json() == {
        "error": {"message": message, "type": "BadRequestError", "param": "model", "code": 400}
    }


def test_the_workers_own_400s_pass_through(gw: GatewayThread) -> None:
    """What the gateway does not read (an empty input, `dimensions` on a model without Matryoshka embeddings)
    the worker refuses in vLLM's words, passed through as it answered."""
    empty = httpx.post(gw.url + "/v1/embeddings", json={"model": EMBED, "input": []}, timeout=30)
    assert empty.status_code == 400
    assert empty.json()["error"]["message"] == "You must pass at least one prompt"
    dims = httpx.post(
        gw.url + "/v1/embeddings", json={"model": EMBED, "input": "x", "dimensions": 8}, timeout=30
    )
    assert dims.status_code == 400 and "Matryoshka" in dims.json()["error"]["message"]
    missing = httpx.post(gw.url + "/v1/embeddings", json={"model": EMBED}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"
    unknown = httpx.post(gw.url + "/v1/embeddings", json={"model": "nope", "input": "x"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_models_lists_both(client: openai.OpenAI) -> None:
    assert sorted(m.id for m in client.models.list().data) == sorted([CHAT, EMBED])


def test_a_prompt_that_fills_the_context_is_embedded(gw: GatewayThread) -> None:
    """vLLM's pooling runner takes a prompt of max_model_len tokens (nothing is generated after it): the
    router's context check asks no room for an output token of an embedding. One more token is the
    gateway's 400, before any worker."""
    full = httpx.post(
        gw.url + "/v1/embeddings", json={"model": EMBED, "input": list(range(CONTEXT))}, timeout=30
    )
    assert full.status_code == 200 and full.json()["usage"]["prompt_tokens"] == CONTEXT
    over = httpx.post(
        gw.url + "/v1/embeddings", json={"model": EMBED, "input": list(range(CONTEXT + 1))}, timeout=30
    )
    assert over.status_code == 400
    assert over.json()["error"] == {
        "message": f"The maximum context length of model '{EMBED}' is {CONTEXT} tokens. However, your prompt "
        f"contains {CONTEXT + 1} input tokens, which exceeds this limit even without any output tokens. Please "
        "reduce the length of the input prompt.",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": "context_length_exceeded",
    }


@pytest.mark.parametrize("encoding", ["bytes", "bytes_only"])
def test_binary_answers_pass_through_as_completions(gw: GatewayThread, encoding: str) -> None:
    """vLLM's binary embeddings (`application/octet-stream`, no JSON; `bytes` adds a `metadata` header) are
    answers, not a broken worker: passed on with the header, metered from it, no breaker failure (the first
    version retried them as `not_json` and ejected the workers that answered them)."""
    body = {"model": EMBED, "input": [[1, 2, 3], [4, 5]], "encoding_format": encoding}
    tokens = gw.metric("mosaic_prompt_tokens_total", model=EMBED)
    for _ in range(4):  # more than failure_threshold (3): a miscounted answer would have opened a breaker
        r = httpx.post(gw.url + "/v1/embeddings", json=body, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        assert len(r.content) == 2 * HIDDEN * 4  # two float32 vectors back to back
    if encoding == "bytes":
        meta = json.loads(r.headers["metadata"])
        assert [(d["start"], d["end"]) for d in meta["data"]] == [
            (0, HIDDEN * 4),
            (HIDDEN * 4, 2 * HIDDEN * 4),
        ]
        assert meta["usage"]["prompt_tokens"] == 5
        assert gw.metric_reaches("mosaic_prompt_tokens_total", tokens + 20, model=EMBED) == tokens + 20
    else:
        assert "metadata" not in r.headers
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        pooling = [w for w in http.get("/admin/workers").json()["workers"] if w["pool"] == "embed-l4"]
    assert [(w["breaker"]["trips"], w["breaker"]["failures"], w["last_error"]) for w in pooling] == [
        (0, 0, None)
    ] * 2
    after = sum(
        gw.metric("mosaic_upstream_errors_total", worker=w["id"], kind=kind)
        for w in pooling
        for kind in ("not_json", "status_502")
    )
    assert after == 0


@pytest.mark.parametrize("field", ["input", "messages"])
def test_conversations_are_embedded_one_vector_each(gw: GatewayThread, field: str) -> None:
    """Chat conversations, one or a batch, in `messages` or in `input`, as vLLM takes them (the first version
    refused all but one conversation in `messages` with a 400 of its own)."""
    one = [{"role": "user", "content": "hello there"}]
    two = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for conversations, vectors in ((one, 1), ([one, two], 2)):
        r = httpx.post(gw.url + "/v1/embeddings", json={"model": EMBED, field: conversations}, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == vectors


def test_a_name_a_lora_resolver_takes_is_named_as_the_client_sent_it() -> None:
    """With `lora_resolver` on the generative model every unknown name is an adapter of it: an embeddings
    request naming one (a typo of the embedding model's name) is refused naming that name, then the model."""
    cfg = validate_config(
        {
            "models": [{"name": CHAT, "lora_resolver": True}, {"name": EMBED, "spec": "mistral-7b"}],
            "pools": [
                {
                    "name": "chat-l4",
                    "model": CHAT,
                    "gpu": "L4",
                    "endpoints": {"simulated": {"time_scale": 200.0}},
                },
                {
                    "name": "embed-l4",
                    "model": EMBED,
                    "gpu": "L4",
                    "runner": "pooling",
                    "endpoints": {"simulated": {"time_scale": 200.0}},
                },
            ],
        },
        "test",
    )
    with GatewayThread(cfg) as thread:
        r = httpx.post(
            thread.url + "/v1/embeddings", json={"model": "embed-mistrl", "input": "x"}, timeout=30
        )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"The model `embed-mistrl` (an adapter of `{CHAT}`) is a generative model (runner: generate) and does "
        "not serve /v1/embeddings"
    )


def test_an_empty_conversation_in_a_batch_is_the_workers_400(gw: GatewayThread) -> None:
    message = {"role": "user", "content": "hi"}
    r = httpx.post(
        gw.url + "/v1/embeddings", json={"model": EMBED, "input": [[message] * 20, []]}, timeout=30
    )
    # the worker's validation error (vLLM's conversation needs a message), passed through as it answered
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
