"""The pooling runner's score and rerank routes (`/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`):
vLLM 0.32's bi-encoder path of a `--runner pooling --convert embed` server (measured in
tests/real_vllm/test_embeddings_scoring_fidelity.py): routes, scores against the worker's own embeddings, pairing,
rerank order, usage, ids, errors in vLLM's order and words, engine requests and metrics."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import numpy as np
import pytest

from simulator.scoring import architecture, cosine
from simulator.worker_app import WorkerConfig
from tests.simulator.test_worker_embeddings import _samples

pytestmark = pytest.mark.anyio
M = "llama-3-8b"
POOLING = WorkerConfig(gpu="H100", model=M, time_scale=1e4, runner="pooling")
GENERATE = WorkerConfig(gpu="H100", model=M, time_scale=1e4)
SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
              "completion_tokens_details"]  # fmt: skip


async def vectors(client: httpx.AsyncClient, texts: list[str]) -> list[np.ndarray]:
    """The worker's own /v1/embeddings vectors of `texts` (float32, as the JSON floats say)."""
    r = await client.post("/v1/embeddings", json={"input": texts})
    assert r.status_code == 200, r.text
    return [np.asarray(d["embedding"], dtype=np.float32) for d in r.json()["data"]]


def fsum_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """An independent cosine (exact sums of float64 products), for a tolerance check of `cosine`."""
    dot = float(np.sum(a.astype(np.float64) * b.astype(np.float64)))
    return dot / float(np.sqrt(np.sum(a.astype(np.float64) ** 2) * np.sum(b.astype(np.float64) ** 2)))


# ---------------------------------------------------------------- routes
@pytest.mark.parametrize("path", [*SCORE_PATHS, *RERANK_PATHS])
async def test_a_pooling_worker_serves_every_score_and_rerank_path(asgi, path: str) -> None:
    body = {"query": "q", "documents": ["a"]} if "rerank" in path else {"queries": "q", "documents": ["a"]}
    async with asgi(POOLING) as (client, _):
        r = await client.post(path, json=body)
        get = await client.get(path)
    assert r.status_code == 200, r.text
    assert r.json()["id"].startswith("score-")
    assert (get.status_code, get.json(), get.headers["allow"]) == (
        405,
        {"detail": "Method Not Allowed"},
        "POST",
    )


@pytest.mark.parametrize("path", [*SCORE_PATHS, *RERANK_PATHS])
async def test_a_generate_worker_does_not_know_the_paths(asgi, path: str) -> None:
    async with asgi(GENERATE) as (client, _):
        r = await client.post(path, json={"queries": "q", "query": "q", "documents": ["a"]})
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})


# ---------------------------------------------------------------- scores
async def test_one_query_is_paired_with_every_document_by_the_cosine_of_its_embeddings(asgi) -> None:
    docs = ["a cat", "the dog sat", "hello there"]
    async with asgi(POOLING) as (client, _):
        r = await client.post("/score", json={"queries": "hello there", "documents": docs})
        q, *d = await vectors(client, ["hello there", *docs])
    body = r.json()
    assert [x["score"] for x in body["data"]] == [cosine(q, v) for v in d]  # exactly the worker's vectors'
    for x, v in zip(body["data"], d, strict=True):
        assert x["score"] == pytest.approx(fsum_cosine(q, v), abs=1e-6)
    assert body["data"][2]["score"] == 1.0  # the same text: the same vector
    assert all(abs(x["score"]) < 0.2 for x in body["data"][:2])  # 4096 random floats: near orthogonal


async def test_n_queries_pair_element_wise(asgi) -> None:
    queries, docs = ["alpha", "beta", "gamma"], ["one", "two", "gamma"]
    async with asgi(POOLING) as (client, _):
        r = await client.post("/score", json={"queries": queries, "documents": docs})
        qv, dv = await vectors(client, queries), await vectors(client, docs)
    assert [x["score"] for x in r.json()["data"]] == [cosine(a, b) for a, b in zip(qv, dv, strict=True)]
    assert r.json()["data"][2]["score"] == 1.0


async def test_one_to_one_and_every_form_of_the_union_answer_alike(asgi) -> None:
    forms = [{"queries": "a b", "documents": "c d"}, {"queries": ["a b"], "items": ["c d"]},
             {"data_1": "a b", "data_2": ["c d"]}, {"text_1": ["a b"], "text_2": "c d"}]  # fmt: skip
    async with asgi(POOLING) as (client, _):
        answers = [(await client.post("/v1/score", json=f)).json() for f in forms]
        a, b = await vectors(client, ["a b", "c d"])
    assert {len(x["data"]) for x in answers} == {1}
    assert {x["data"][0]["score"] for x in answers} == {cosine(a, b)}
    assert {x["usage"]["prompt_tokens"] for x in answers} == {2}  # 3 characters each → 1 token each


async def test_scores_depend_on_the_seed_and_on_nothing_else(asgi) -> None:
    body = {"queries": "q", "documents": ["x", "y"], "use_activation": False, "instruction": "be kind",
            "chat_template_kwargs": {"k": 1}, "priority": 5}  # fmt: skip
    async with asgi(POOLING) as (a, _), asgi(POOLING) as (b, _):
        first = (await a.post("/score", json=body)).json()["data"]
        plain = (await b.post("/score", json={"queries": "q", "documents": ["x", "y"]})).json()["data"]
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1e4, runner="pooling", seed=7)) as (c, _):
        other = (await c.post("/score", json=body)).json()["data"]
    assert first == plain and first != other


# ---------------------------------------------------------------- answers
async def test_score_answer_shape_usage_and_id(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        r = await client.post(
            "/score", json={"queries": "hello there", "documents": ["a cat", "the dog sat"]}
        )
    body = r.json()
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert re.fullmatch(r"score-[0-9a-f]{16}", body["id"])
    assert (body["object"], body["model"]) == ("list", M) and abs(body["created"] - time.time()) < 60
    assert [list(x) for x in body["data"]] == [["index", "object", "score"]] * 2
    assert [(x["index"], x["object"]) for x in body["data"]] == [(0, "score"), (1, "score")]
    # each text once: "hello there" 11 characters → 3 tokens, "a cat" 5 → 2, "the dog sat" 11 → 3
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8, "completion_tokens": 0,
                             "prompt_tokens_details": None, "completion_tokens_details": None}  # fmt: skip
    assert list(body["usage"]) == USAGE_KEYS


async def test_rerank_sorts_by_relevance_and_cuts_to_top_n(asgi) -> None:
    docs = ["a cat", "the dog sat", "hello", "birds", "hello"]
    async with asgi(POOLING) as (client, _):
        scored = (await client.post("/score", json={"queries": "hello", "documents": docs})).json()
        answers = {
            n: (await client.post("/rerank", json={"query": "hello", "documents": docs, "top_n": n})).json()
            for n in (0, 2, 5, 9)
        }
    scores = [x["score"] for x in scored["data"]]
    order = sorted(range(len(docs)), key=lambda i: -scores[i])  # stable: the two "hello" keep their order
    assert order[:2] == [2, 4]  # identical texts score 1.0
    whole = answers[0]
    assert list(whole) == ["id", "model", "usage", "results"] and whole["model"] == M
    # the query once: "hello" 5 characters → 2 tokens, then the documents 2 + 3 + 2 + 2 + 2
    assert whole["usage"] == {"prompt_tokens": 13, "total_tokens": 13}
    assert [r["index"] for r in whole["results"]] == order
    assert [r["relevance_score"] for r in whole["results"]] == [scores[i] for i in order]
    assert [list(r) for r in whole["results"]] == [["index", "document", "relevance_score"]] * 5
    assert [r["document"] for r in whole["results"]] == [
        {"text": docs[i], "multi_modal": None} for i in order
    ]
    assert answers[2]["results"] == whole["results"][:2]
    assert answers[5]["results"] == answers[9]["results"] == whole["results"]  # top_n ≥ documents: all


async def test_rerank_of_one_document_string(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        r = (await client.post("/v2/rerank", json={"query": "q", "documents": "one doc"})).json()
        q, d = await vectors(client, ["q", "one doc"])
    assert r["results"] == [{"index": 0, "document": {"text": "one doc", "multi_modal": None},
                             "relevance_score": cosine(q, d)}]  # fmt: skip
    assert r["usage"] == {"prompt_tokens": 1 + 2, "total_tokens": 3}


async def test_request_ids(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        hdr = await client.post("/score", json={"queries": "q", "documents": "d", "request_id": "b"},
                                headers={"X-Request-Id": "hdr"})  # fmt: skip
        body = await client.post("/rerank", json={"query": "q", "documents": "d", "request_id": "b"})
    assert hdr.json()["id"] == "score-hdr" and body.json()["id"] == "score-b"  # rerank's prefix is score- too


async def test_truncation_padding_and_token_limits(asgi) -> None:
    long = "abcd" * 20  # 80 characters → 20 tokens
    async with asgi(POOLING) as (client, rt):
        limit = rt.engine.max_model_len

        async def usage(**extra: Any) -> int:
            r = await client.post("/score", json={"queries": long, "documents": [long, "ab"], **extra})
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["prompt_tokens"])

        assert await usage() == 20 + 20 + 1
        assert await usage(truncate_prompt_tokens=5) == 5 + 5 + 1
        assert await usage(max_tokens_per_query=3) == 3 + 20 + 1
        assert await usage(max_tokens_per_doc=4, max_tokens_per_query=2) == 2 + 4 + 1
        assert await usage(padding="max_length") == 3 * limit
        assert await usage(truncate_prompt_tokens=-1) == 41
        cut = await client.post("/score", json={"queries": long, "documents": long, "max_tokens_per_doc": 1})
        q, d = await vectors(client, [long, "abcd"])  # the document's first token: its first 4 characters
    assert cut.json()["data"][0]["score"] == cosine(q, d)


def test_architecture_names_the_catalog_models_families() -> None:
    assert [architecture(m) for m in ("llama-3-8b", "tiny-llama", "mistral-7b", "qwen2.5-7b", "custom")] == [
        "LlamaForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM",
    ]  # fmt: skip


# ---------------------------------------------------------------- errors (vLLM 0.32's words and order)
def _error(message: str, status: int = 400, type_: str = "BadRequestError", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def _missing(fields: tuple[str, ...], items: int) -> str:
    head = f"{len(fields)} validation error{'s' if len(fields) > 1 else ''}:\n"
    return head + "\n".join(
        f"  {{'type': 'missing', 'loc': 'body.{f}', 'msg': 'Field required', 'input': '<dict of {items} items>'}}"
        for f in fields
    )


MM = {"content": [{"type": "text", "text": "x"}]}
TRUNCATE = (
    "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation size."
)
UNTRUSTED = ("Per-request mm_processor_kwargs are disabled by default because they can change multimodal "
             "preprocessing resource usage. Start the server with --trust-request-mm-kwargs only when clients are "
             "trusted. (parameter=mm_processor_kwargs)")  # fmt: skip
ERRORS: list[Any] = [
    pytest.param("/score", {"queries": "a"}, 400, _error(
        _missing(("documents", "items", "data_1", "data_2", "text_1", "text_2"), 1), type_="Bad Request",
        param="body.documents"), id="one side only → every member's missing fields, first member's first"),
    pytest.param("/rerank", {"query": "q"}, 400, _error(
        _missing(("documents",), 1), type_="Bad Request", param="body.documents"), id="rerank without documents"),
    pytest.param("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, 400, _error(
        "1 validation error:\n  {'type': 'greater_than_equal', 'loc': 'body.top_n', 'msg': 'Input should be "
        "greater than or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}", type_="Bad Request", param="body.top_n"),
        id="negative top_n"),
    pytest.param("/rerank", {"query": "q", "documents": ["a"], "request_id": None}, 400, _error(
        "1 validation error:\n  {'type': 'string_type', 'loc': 'body.request_id', 'msg': 'Input should be a "
        "valid string', 'input': 'None'}", type_="Bad Request", param="body.request_id"),
        id="request_id null → a string is required (vLLM's default is a random one)"),
    pytest.param("/score", {"queries": "q", "documents": "d", "cache_salt": "", "model": "nope"}, 400, _error(
        "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)",
        param="cache_salt"), id="empty cache_salt, before the model"),
    pytest.param("/score", {"queries": "q", "documents": "d", "mm_processor_kwargs": {"a": 1}, "model": "nope"},
                 400, _error(UNTRUSTED, param="mm_processor_kwargs"),
                 id="mm_processor_kwargs are untrusted, before the model"),
    pytest.param("/score", {"queries": "q", "documents": [], "model": "nope", "truncate_prompt_tokens": 9000},
                 404, _error("The model `nope` does not exist.", 404, "NotFoundError"),
                 id="unknown model before truncate and inputs"),
    pytest.param("/score", {"queries": "q", "documents": [], "truncate_prompt_tokens": 8193}, 400,
                 _error(TRUNCATE), id="truncate over max_model_len before the inputs"),
    pytest.param("/score", {"queries": "q", "documents": [MM], "max_tokens_per_doc": -1}, 400,
                 _error("MultiModalParam is not supported for LlamaForCausalLM"),
                 id="a multimodal document on a text model, before the token limits"),
    pytest.param("/rerank", {"query": MM, "documents": []}, 400,
                 _error("MultiModalParam is not supported for LlamaForCausalLM"),
                 id="a multimodal query, before the counts"),
    pytest.param("/score", {"queries": ["a", "b"], "documents": [], "max_tokens_per_query": -1}, 400,
                 _error("Input lengths must be either 1:1, 1:N or N:N"), id="2 queries, 0 documents → lengths"),
    pytest.param("/score", {"queries": ["a", "b", "c"], "documents": ["x", "y"]}, 400,
                 _error("Input lengths must be either 1:1, 1:N or N:N"), id="3:2"),
    pytest.param("/score", {"queries": [], "documents": []}, 400,
                 _error("At least one text element must be given"), id="no queries"),
    pytest.param("/v2/rerank", {"query": "q", "documents": []}, 400,
                 _error("At least one text_pair element must be given"), id="no documents"),
    pytest.param("/score", {"queries": "q", "documents": "d", "max_tokens_per_query": -1,
                            "max_tokens_per_doc": -1}, 400,
                 _error("max_tokens_per_query must be a non-negative integer"), id="negative query limit first"),
    pytest.param("/score", {"queries": "q", "documents": "d", "max_tokens_per_doc": 8192}, 400,
                 _error("max_tokens_per_doc (8192) must be less than max_model_len (8192)."),
                 id="document limit of max_model_len"),
    pytest.param("/score", {"queries": "q", "documents": ["d", "x" * 40000]}, 400, _error(
        "This model's maximum context length is 8192 tokens. However, your prompt contains at least 8193 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=8193)", param="input_tokens"), id="text over the context"),
    pytest.param("/score", {"queries": "", "documents": "d"}, 400,
                 _error("The decoder prompt cannot be empty"), id="an empty query"),
    pytest.param("/score", {"queries": "q", "documents": "hello", "truncate_prompt_tokens": 0}, 400,
                 _error("The decoder prompt cannot be empty"), id="truncated to nothing"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "answer"), ERRORS)
async def test_errors(asgi, path: str, body: dict[str, Any], status: int, answer: dict[str, Any]) -> None:
    async with asgi(POOLING) as (client, rt):
        r = await client.post(path, json=body)
        assert rt.engine.counters.prompt_tokens == 0  # refused before the engine
    assert (r.status_code, r.json()) == (status, answer)


async def test_a_body_that_is_no_object_is_refused_by_every_member(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        score = await client.post("/score", content=b"[1]", headers={"content-type": "application/json"})
        rerank = await client.post("/rerank", content=b"5", headers={"content-type": "application/json"})
    line = ("{'type': 'model_attributes_type', 'loc': 'body', 'msg': 'Input should be a valid dictionary or "
            "object to extract fields from', 'input': '%s'}")  # fmt: skip
    assert score.json() == _error("4 validation errors:\n" + "\n".join(["  " + line % "<list of 1 items>"] * 4),
                                  type_="Bad Request", param="body")  # fmt: skip
    assert rerank.json() == _error("1 validation error:\n  " + line % "5", type_="Bad Request", param="body")


async def test_a_wrong_type_lists_each_members_errors(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        r = await client.post("/score", json={"queries": 5, "documents": "b"})
    message, param = r.json()["error"]["message"], r.json()["error"]["param"]
    # queries/documents and queries/items: str, ScoreMultiModalParam, list (3 each) + items missing + 4 missing
    assert message.startswith("11 validation errors:\n") and message.endswith(
        "\n  ...and 1 more errors"
    )  # vLLM's plural
    assert "'loc': 'body.queries.ScoreMultiModalParam'" in message and param == "body.queries"


async def test_the_data_parallel_rank_header_is_ignored(asgi) -> None:
    """vLLM's pooling handlers do not hand the header to the engine: rank 3 of one engine is no error."""
    async with asgi(POOLING) as (client, _):
        r = await client.post(
            "/score", json={"queries": "q", "documents": "d"}, headers={"X-data-parallel-rank": "3"}
        )
    assert r.status_code == 200


async def test_injected_errors_apply(asgi) -> None:
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1e4, runner="pooling")) as (client, rt):
        rt.faults.error_rate = 1.0
        r = await client.post("/rerank", json={"query": "q", "documents": ["d"]})
    assert (r.status_code, r.json()["error"]["type"]) == (500, "InternalServerError")


# ---------------------------------------------------------------- engine requests and metrics
@pytest.mark.parametrize(
    ("path", "body", "requests", "tokens"),
    [pytest.param("/score", {"queries": "hello there", "documents": ["a cat", "the dog sat"]}, 3, 8,
                  id="1:2 → the query once and two documents: 3 requests of 3 + 2 + 3 tokens"),
     pytest.param("/score", {"queries": ["ab", "abcde"], "documents": ["abc", "abcdefghi"]}, 4, 1 + 2 + 1 + 3,
                  id="2:2 → 4 requests"),
     pytest.param("/rerank", {"query": "q", "documents": ["a", "b", "c"]}, 4, 4, id="rerank 1:3 → 4 requests")],
)  # fmt: skip
async def test_each_text_is_one_prefill_only_engine_request(
    asgi, path: str, body: dict[str, Any], requests: int, tokens: int
) -> None:
    async with asgi(POOLING) as (client, rt):
        before = _samples((await client.get("/metrics")).text)
        r = await client.post(path, json=body)
        after = _samples((await client.get("/metrics")).text)
        counters = rt.engine.counters
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == tokens
    moved = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}

    def delta(name: str, **labels: str) -> float:
        return moved.get((name, tuple(sorted(labels.items()))), 0.0)

    assert counters.success["stop"] == requests and counters.prompt_tokens == tokens
    assert delta("vllm:request_success_total", finished_reason="stop") == requests
    assert delta("vllm:prompt_tokens_total") == tokens and delta("vllm:generation_tokens_total") == 0
    assert (
        delta("vllm:request_prompt_tokens_count") == requests
        and delta("vllm:request_prompt_tokens_sum") == tokens
    )
    assert delta("vllm:e2e_request_latency_seconds_count") == requests
    assert delta("vllm:inter_token_latency_seconds_count") == 0
