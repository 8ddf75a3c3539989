"""The gateway in front of a real vLLM reranker (a cross-encoder: `--runner pooling --convert classify` of the
tiny Llama, one label): `/score`, `/rerank` and `/classify` answer through the gateway as the server does, each request a
KV reservation sized by its (query, document) pairs — what a cross-encoder runs — released with the answer;
the server has no embeddings route, and its 404 is passed through."""

from __future__ import annotations

import collections.abc
from typing import Any

import httpx
import pytest
from conftest import RealServer, gateway_available
from gateway_harness import ADMIN_KEY, API_KEY, MosaicGateway, static_config

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(300)]

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def gateway(
    real_vllm_reranker: RealServer, tmp_path_factory: pytest.TempPathFactory
) -> collections.abc.Iterator[MosaicGateway]:
    reason = gateway_available()
    if reason is not None:
        pytest.skip(reason)
    config = static_config(real_vllm_reranker.model, [real_vllm_reranker.url])
    config["pools"][0]["runner"] = "pooling"
    with MosaicGateway(config, tmp_path_factory.mktemp("mosaic-reranker")) as gw:
        gw.wait_ready()
        gw.wait_worker_scraped()
        yield gw


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/rerank", {"query": "hello there", "documents": ["a cat", "the dog sat", "hello"], "top_n": 2}),
        ("/v2/rerank", {"query": "q", "documents": ["x", "y"]}),
        ("/score", {"queries": "hello there", "documents": ["a cat", "the dog sat"]}),
        ("/v1/score", {"text_1": ["one", "two"], "text_2": ["three", "four"]}),
        ("/classify", {"input": ["hello there", "the dog sat"]}),
    ],
)
def test_scores_through_the_gateway_are_the_servers(
    gateway: MosaicGateway, real_vllm_reranker: RealServer, path: str, body: dict[str, Any]
) -> None:
    body = {"model": real_vllm_reranker.model, **body}
    theirs = httpx.post(real_vllm_reranker.url + path, json=body, timeout=60)
    ours = httpx.post(gateway.url + path, json=body, headers=AUTH, timeout=60)
    assert theirs.status_code == ours.status_code == 200, ours.text
    mine, server = ours.json(), theirs.json()
    assert mine["usage"] == server["usage"]
    key = "results" if "rerank" in path else "data"  # (classify: one label distribution per input)
    assert mine[key] == server[key]


def test_each_request_is_reserved_by_its_pairs_and_released(gateway: MosaicGateway) -> None:
    """One reservation per request, released with the answer; and the server's usage shows why the gateway
    sizes a scoring request by its pairs: a cross-encoder ran the query once per document (four pairs hold
    at least four queries' tokens), where an embedding model would have encoded it once."""
    headers = {**AUTH}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
        before = http.get("/metrics").text
        query, documents = "what is paged attention " * 4, ["a block table maps tokens to blocks " * 3] * 4
        r = http.post("/rerank", json={"model": "tiny-llama", "query": query, "documents": documents})
        assert r.status_code == 200, r.text
        after = http.get("/metrics").text
    assert (
        _metric(after, "mosaic_kv_reservations_total") == _metric(before, "mosaic_kv_reservations_total") + 1
    )
    assert _metric(after, "mosaic_kv_active_reservations") == 0
    # the server ran four pairs: more than the query once and the documents (a bi-encoder's texts)
    used = r.json()["usage"]["prompt_tokens"]
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
        alone = http.post("/tokenize", json={"model": "tiny-llama", "prompt": query}).json()["count"]
    assert used >= 4 * alone


def test_the_reranker_has_no_embeddings_route_and_its_404_passes_through(
    gateway: MosaicGateway, real_vllm_reranker: RealServer
) -> None:
    r = httpx.post(
        gateway.url + "/v1/embeddings", json={"model": "tiny-llama", "input": "x"}, headers=AUTH, timeout=60
    )
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    workers = httpx.get(
        gateway.url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    )
    # a refusal before the engine: the worker stays in rotation, its breaker untouched
    assert [w["breaker"]["failures"] for w in workers.json()["workers"]] == [0], workers.text
