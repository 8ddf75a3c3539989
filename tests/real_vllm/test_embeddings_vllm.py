"""The gateway in front of a real vLLM embedding server (`--runner pooling --convert embed` of the tiny Llama):
a pool with `runner: pooling` answers `/v1/embeddings` as the server does (the `openai` SDK's base64 and plain
floats, byte for byte the same vectors), reserves and releases each request's KV, meters its usage, and
refuses the generation endpoints for that model with a 400 naming it, where vLLM answers a bare 404."""

from __future__ import annotations

import collections.abc
import concurrent.futures
from typing import Any

import httpx
import pytest
from conftest import RealServer, gateway_available
from gateway_harness import API_KEY, MosaicGateway, Target, static_config

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(300)]

TOKENS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture
def gateway(
    real_vllm_pooling: RealServer, tmp_path_factory: pytest.TempPathFactory
) -> collections.abc.Iterator[MosaicGateway]:
    reason = gateway_available()
    if reason is not None:
        pytest.skip(reason)
    config = static_config(real_vllm_pooling.model, [real_vllm_pooling.url])
    config["pools"][0]["runner"] = "pooling"
    with MosaicGateway(config, tmp_path_factory.mktemp("mosaic-embeddings")) as gw:
        gw.wait_ready()
        gw.wait_worker_scraped()  # its capacity from vLLM's cache_config_info, as for a generate server
        yield gw


def _metric(text: str, name: str, **labels: str) -> float:
    """A sample of the gateway's /metrics text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_embeddings_through_the_gateway_are_the_servers(
    gateway: MosaicGateway, real_vllm_pooling: RealServer
) -> None:
    model = real_vllm_pooling.model
    direct = Target("vllm", real_vllm_pooling.url, model)
    with direct.openai() as vllm, gateway.target(model).openai() as mosaic:
        theirs = vllm.embeddings.create(model=model, input=TOKENS)  # the SDK's default: base64
        ours = mosaic.embeddings.create(model=model, input=TOKENS)
        floats = mosaic.embeddings.create(model=model, input=TOKENS, encoding_format="float")
    assert [d.embedding for d in ours.data] == [d.embedding for d in theirs.data]
    for mine, server in zip(floats.data, theirs.data, strict=True):
        assert mine.embedding == pytest.approx(server.embedding, rel=1e-6)
    assert all(len(d.embedding) == 128 for d in ours.data)  # the tiny Llama's hidden size
    assert (ours.usage.prompt_tokens, ours.usage.total_tokens) == (7, 7)


def test_requests_are_reserved_released_and_metered(
    gateway: MosaicGateway, real_vllm_pooling: RealServer
) -> None:
    """Twelve at once: every one 200, each a KV reservation released with its answer, and the prompt tokens
    the server counted are the gateway's."""
    model = real_vllm_pooling.model
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
        before = http.get("/metrics").text

        def embed(i: int) -> httpx.Response:
            return http.post("/v1/embeddings", json={"model": model, "input": [[i + 1] * (i + 2)]})

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(embed, range(12)))
        after = http.get("/metrics").text
    assert [r.status_code for r in answers] == [200] * 12
    assert sum(r.json()["usage"]["prompt_tokens"] for r in answers) == sum(i + 2 for i in range(12))
    grew = _metric(after, "mosaic_prompt_tokens_total", model=model) - _metric(
        before, "mosaic_prompt_tokens_total", model=model
    )
    assert grew == sum(i + 2 for i in range(12))
    assert (
        _metric(after, "mosaic_kv_reservations_total") - _metric(before, "mosaic_kv_reservations_total") == 12
    )
    (worker,) = gateway.admin_get("/admin/workers")["workers"]
    assert _metric(after, "mosaic_kv_active_reservations", worker=worker["id"]) == 0
    assert _metric(after, "mosaic_kv_total_units", worker=worker["id"]) > 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_the_generation_endpoints_are_a_400_naming_the_model(
    gateway: MosaicGateway, real_vllm_pooling: RealServer, path: str, body: dict[str, Any]
) -> None:
    model = real_vllm_pooling.model
    bare = httpx.post(real_vllm_pooling.url + path, json={"model": model, **body}, timeout=60)
    assert (bare.status_code, bare.json()) == (404, {"detail": "Not Found"})  # what vLLM says of it
    with gateway.target(model).http() as http:
        ours = http.post(path, json={"model": model, **body})
    assert ours.status_code == 400
    assert ours.json()["error"] == {
        "message": f"The model `{model}` is a pooling model (runner: pooling) and does not serve {path}",
        "type": "BadRequestError",
        "param": "model",
        "code": 400,
    }


@pytest.mark.parametrize(("truncate", "prompt_tokens"), [(-1, 512), (10, 10)])
def test_inputs_over_the_context_with_truncate_prompt_tokens_are_embedded_as_the_server_does(
    gateway: MosaicGateway, real_vllm_pooling: RealServer, truncate: int, prompt_tokens: int
) -> None:
    """600 token ids on a 512-token model: vLLM keeps the first `truncate_prompt_tokens` (-1: the context) and
    embeds them; the gateway refused the input for its length before it read the field."""
    body = {
        "model": real_vllm_pooling.model,
        "input": list(range(5, 605)),
        "truncate_prompt_tokens": truncate,
    }
    theirs = httpx.post(real_vllm_pooling.url + "/v1/embeddings", json=body, timeout=60)
    ours = httpx.post(
        gateway.url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    assert theirs.status_code == ours.status_code == 200, ours.text
    assert ours.json()["usage"]["prompt_tokens"] == theirs.json()["usage"]["prompt_tokens"] == prompt_tokens
    assert ours.json()["data"][0]["embedding"] == pytest.approx(
        theirs.json()["data"][0]["embedding"], rel=1e-6
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/score", {"queries": "paged attention", "documents": ["a block table", "paged attention", "kv"]}),
        ("/v1/score", {"text_1": ["one", "two"], "text_2": ["three", "four"]}),
        (
            "/rerank",
            {"query": "paged attention", "documents": ["a block table", "paged attention"], "top_n": 1},
        ),
        ("/v2/rerank", {"query": "q", "documents": ["x", "y", "z"]}),
        ("/score", {"queries": "hi", "documents": ["a", "b"], "padding": "max_length"}),  # 3 × 512 tokens
    ],
)
def test_score_and_rerank_through_the_gateway_are_the_servers(
    gateway: MosaicGateway, real_vllm_pooling: RealServer, path: str, body: dict[str, Any]
) -> None:
    """vLLM's scoring routes on an embedding model (cosine of the two texts' embeddings): the gateway routes
    them to the pooling pool and passes the answer through; the scores and usage are the server's."""
    body = {"model": real_vllm_pooling.model, **body}
    theirs = httpx.post(real_vllm_pooling.url + path, json=body, timeout=60)
    ours = httpx.post(
        gateway.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    assert theirs.status_code == ours.status_code == 200, ours.text
    mine, server = ours.json(), theirs.json()
    assert mine["usage"] == server["usage"]
    key = "data" if "score" in path else "results"
    strip = ("id", "created")
    assert [{k: v for k, v in d.items() if k not in strip} for d in mine[key]] == [
        {k: v for k, v in d.items() if k not in strip} for d in server[key]
    ]


def test_a_score_request_for_an_unknown_model_is_a_404_naming_the_param(
    gateway: MosaicGateway, real_vllm_pooling: RealServer
) -> None:
    resp = httpx.post(
        gateway.url + "/rerank",
        json={"model": "nope", "query": "q", "documents": ["d"]},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
