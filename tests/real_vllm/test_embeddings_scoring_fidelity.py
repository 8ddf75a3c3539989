"""Fidelity diff of the pooling runner's score and rerank routes: the simulated worker with `--runner pooling`
beside a real vLLM 0.32 started with `--runner pooling --convert embed` (the tiny Llama, max_model_len 512),
which scores as a bi-encoder (each text embedded on its own, a pair's score the cosine of its two vectors).

Same requests to both. Equal on both sides: status codes; for errors the whole OpenAI error (type, param and
message: vLLM's words, pydantic's union errors as vLLM lists them, and which check comes first); for answers
the keys and their order, `object`s, indices, the number of scores or results, rerank's documents and its
order (by score, highest first; `top_n`); usage where the two tokenisers agree (one-letter texts are one token
on both; `padding: "max_length"` makes every text max_model_len tokens); identical texts scoring 1.0;
response ids; and the metric series a score request moves, with the same deltas where they are counts.
Scores themselves differ (pseudo-random vectors), as does usage for longer text (the simulator counts
ceil(characters / 4)). Reused machinery: `fidelity.shape_diff`, the embeddings diff's metric helpers and the
conftest's servers.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import RealServer
from fidelity import shape_diff
from test_embeddings_fidelity import _EXACT, _NOT_EXPORTED, _moved, _samples, both

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
MM = {"content": [{"type": "text", "text": "x"}]}
LONG_TEXT = "hello " * 600  # over 512 tokens for both tokenisers


ERRORS: dict[str, tuple[str, Any]] = {
    "no body fields": ("/score", {}),
    "one side only": ("/score", {"queries": "a"}),
    "queries a number": ("/score", {"queries": 5, "documents": "b"}),
    "queries a bad dict": ("/score", {"queries": {"foo": 1}, "documents": "b"}),
    "bad content part": ("/score", {"queries": "a", "documents": [{"content": [{"type": "image_url"}]}]}),
    "bad text part": ("/score", {"queries": "a", "documents": [{"content": [{"type": "text", "text": 5}]}]}),
    "bad video and embeds parts": (
        "/score",
        {
            "queries": "a",
            "documents": [
                {"content": [{"type": "video_url", "video_url": {}}, {"type": "image_embeds", "uuid": 5}]}
            ],
        },
    ),
    "many bad fields": (
        "/score",
        {
            "queries": "q",
            "documents": ["a"],
            "request_id": 5,
            "priority": 1.5,
            "user": 3,
            "padding": "x",
            "truncation_side": "mid",
            "max_tokens_per_doc": "a",
            "instruction": 4,
            "use_activation": "maybe",
        },
    ),
    "truncate below -1": ("/score", {"queries": "a", "documents": "b", "truncate_prompt_tokens": -2}),
    "rerank without documents": ("/rerank", {"query": "q"}),
    "rerank query a list": ("/rerank", {"query": ["q"], "documents": ["a"]}),
    "rerank documents of numbers": ("/v1/rerank", {"query": "q", "documents": [5]}),
    "negative top_n": ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}),
    "fractional top_n": ("/rerank", {"query": "q", "documents": ["a"], "top_n": 1.5}),
    "request_id null": ("/rerank", {"query": "q", "documents": ["a"], "request_id": None}),
    "empty cache_salt": ("/score", {"queries": "q", "documents": ["a"], "cache_salt": ""}),
    "forbidden cache_salt": ("/score", {"queries": "q", "documents": ["a"], "cache_salt": "a/b"}),
    "mm_processor_kwargs": ("/score", {"queries": "q", "documents": ["a"], "mm_processor_kwargs": {"a": 1}}),
    "media_io_kwargs": ("/score", {"queries": "q", "documents": ["a"], "media_io_kwargs": {"a": {}}}),
    "mm kwargs before the model": (
        "/score",
        {"queries": "q", "documents": ["a"], "mm_processor_kwargs": {"a": 1}, "model": "nope"},
    ),
    "unknown model": ("/score", {"model": "nope", "queries": "a", "documents": "b"}),
    "unknown model on rerank": ("/v2/rerank", {"model": "nope", "query": "a", "documents": "b"}),
    "unknown model before truncate": (
        "/score",
        {"queries": "q", "documents": [], "truncate_prompt_tokens": 600, "model": "nope"},
    ),
    "truncate over max_model_len": (
        "/score",
        {"queries": "a", "documents": [], "truncate_prompt_tokens": 513},
    ),
    "multimodal query": ("/score", {"queries": MM, "documents": "b"}),
    "multimodal document before the counts": ("/rerank", {"query": "q", "documents": ["a", {"content": []}]}),
    "multimodal before the token limits": (
        "/score",
        {"queries": MM, "documents": [], "max_tokens_per_doc": -1},
    ),
    "3:2": ("/score", {"queries": ["a", "b", "c"], "documents": ["c", "d"]}),
    "2:0": ("/score", {"queries": ["a", "b"], "documents": []}),
    "0:2": ("/v1/score", {"queries": [], "documents": ["c", "d"]}),
    "0:0": ("/score", {"text_1": [], "text_2": []}),
    "1:0": ("/score", {"data_1": ["a"], "data_2": []}),
    "rerank of no documents": ("/v2/rerank", {"query": "q", "documents": []}),
    "negative query limit": ("/score", {"queries": "a", "documents": "b", "max_tokens_per_query": -1}),
    "query limit before document limit": (
        "/score",
        {"queries": "a", "documents": "b", "max_tokens_per_query": -1, "max_tokens_per_doc": -1},
    ),
    "document limit of max_model_len": (
        "/score",
        {"queries": "a", "documents": "b", "max_tokens_per_doc": 512},
    ),
    "text over max_model_len": ("/score", {"queries": LONG_TEXT, "documents": ["a", "b"]}),
    "document over max_model_len": ("/rerank", {"query": "q", "documents": ["a", LONG_TEXT]}),
    "empty query": ("/score", {"queries": "", "documents": "b"}),
    "empty document": ("/rerank", {"query": "q", "documents": ["b", ""]}),
    "truncated to nothing": ("/score", {"queries": "a", "documents": "hello", "truncate_prompt_tokens": 0}),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_alike(real_vllm_pooling: RealServer, sim_pooling_url: str, case: str) -> None:
    path, body = ERRORS[case]
    real, sim = both(real_vllm_pooling, sim_pooling_url, path, body)
    assert real.status_code >= 400, real.text
    assert (sim.status_code, sim.json()) == (real.status_code, real.json())


@pytest.mark.parametrize("path", ["/score", "/rerank"])
def test_bodies_that_are_no_json_object_alike(
    real_vllm_pooling: RealServer, sim_pooling_url: str, path: str
) -> None:
    for content, headers in (
        (b"[1]", {"content-type": "application/json"}),
        (b"5", {"content-type": "application/json"}),
        (b'{"query":', {"content-type": "application/json"}),
        (b"", {"content-type": "application/json"}),
        (b'{"query": "q", "documents": "d"}', {"content-type": "text/plain"}),
    ):
        with httpx.Client(timeout=60) as http:
            real = http.post(real_vllm_pooling.url + path, content=content, headers=headers)
            sim = http.post(sim_pooling_url + path, content=content, headers=headers)
        assert (sim.status_code, sim.json()) == (real.status_code, real.json()), content


SCORES: dict[str, tuple[str, Any]] = {
    "1:2": ("/score", {"model": MODEL, "queries": "hello there", "documents": ["a cat", "the dog sat"]}),
    "1:1 strings": ("/v1/score", {"queries": "a", "documents": "b"}),
    "queries and items": ("/score", {"queries": "a", "items": ["b", "c"]}),
    "data_1 and data_2": ("/score", {"data_1": ["a", "b"], "data_2": ["c", "d"]}),
    "text_1 and text_2": ("/v1/score", {"text_1": ["a", "b", "c"], "text_2": ["d", "e", "f"]}),
    "extra and ignored fields": (
        "/score",
        {
            "queries": "q",
            "documents": ["a"],
            "use_activation": False,
            "instruction": "x",
            "priority": 3,
            "chat_template_kwargs": {"a": 1},
            "normalize": True,
            "task": "encode",
            "mm_processor_kwargs": {},
        },
    ),
    "token limits": ("/score", {"queries": "a b c", "documents": ["a b c d e f"], "max_tokens_per_doc": 511}),
    "padded to the context": ("/score", {"queries": "a", "documents": ["b", "c"], "padding": "max_length"}),
    "truncated and padded": (
        "/score",
        {
            "queries": "a",
            "documents": ["bcd efg"],
            "truncate_prompt_tokens": -1,
            "padding": "max_length",
            "max_tokens_per_doc": 1,
        },
    ),
}
# one-letter texts (one token for both tokenisers) and padded prompts: the usage is the same number
SAME_USAGE = ("1:1 strings", "queries and items", "data_1 and data_2", "text_1 and text_2",
              "extra and ignored fields", "padded to the context", "truncated and padded")  # fmt: skip


@pytest.mark.parametrize("case", list(SCORES))
def test_score_answers_alike(real_vllm_pooling: RealServer, sim_pooling_url: str, case: str) -> None:
    path, body = SCORES[case]
    real, sim = both(real_vllm_pooling, sim_pooling_url, path, body)
    assert real.status_code == sim.status_code == 200, (real.text[:300], sim.text[:300])
    r, s = real.json(), sim.json()
    assert list(s) == list(r) == ["id", "object", "created", "model", "data", "usage"]
    assert not shape_diff(case, r, s)
    assert s["object"] == r["object"] == "list" and s["model"] == r["model"] == MODEL
    assert s["id"].startswith("score-") and r["id"].startswith("score-") and len(s["id"]) == len(r["id"])
    assert [(d["index"], d["object"]) for d in s["data"]] == [(d["index"], d["object"]) for d in r["data"]]
    assert list(s["usage"]) == list(r["usage"])
    if case in SAME_USAGE:
        assert s["usage"] == r["usage"]


def test_identical_texts_score_one_on_both(real_vllm_pooling: RealServer, sim_pooling_url: str) -> None:
    body = {"queries": "hello", "documents": ["hello", "a cat"]}
    real, sim = both(real_vllm_pooling, sim_pooling_url, "/score", body)
    assert real.json()["data"][0]["score"] == sim.json()["data"][0]["score"] == 1.0


RERANKS: dict[str, tuple[str, Any]] = {
    "all": ("/rerank", {"query": "hello", "documents": ["a cat", "the dog sat", "hello"]}),
    "top 2": (
        "/v1/rerank",
        {"model": MODEL, "query": "hello", "documents": ["a cat", "the dog sat", "hello"], "top_n": 2},
    ),
    "top_n past the documents": ("/v2/rerank", {"query": "q", "documents": ["a", "b"], "top_n": 5}),
    "one document string": ("/rerank", {"query": "q", "documents": "one doc"}),
}


@pytest.mark.parametrize("case", list(RERANKS))
def test_rerank_answers_alike(real_vllm_pooling: RealServer, sim_pooling_url: str, case: str) -> None:
    path, body = RERANKS[case]
    real, sim = both(real_vllm_pooling, sim_pooling_url, path, body)
    assert real.status_code == sim.status_code == 200, (real.text[:300], sim.text[:300])
    r, s = real.json(), sim.json()
    assert list(s) == list(r) == ["id", "model", "usage", "results"]
    assert not shape_diff(case, r, s)
    assert s["model"] == r["model"] == MODEL and s["id"].startswith("score-") and r["id"].startswith("score-")
    assert list(s["usage"]) == list(r["usage"]) == ["prompt_tokens", "total_tokens"]
    assert len(s["results"]) == len(r["results"])
    for answer in (r, s):
        scores = [x["relevance_score"] for x in answer["results"]]
        assert scores == sorted(scores, reverse=True)
        for x in answer["results"]:
            assert list(x) == ["index", "document", "relevance_score"]
            docs = body["documents"] if isinstance(body["documents"], list) else [body["documents"]]
            assert x["document"] == {"text": docs[x["index"]], "multi_modal": None}
    if "hello" in body["documents"]:  # the query itself: first on both
        assert r["results"][0]["index"] == s["results"][0]["index"] == 2


def test_request_ids_alike(real_vllm_pooling: RealServer, sim_pooling_url: str) -> None:
    for path, body in (
        ("/score", {"queries": "a", "documents": "b"}),
        ("/rerank", {"query": "a", "documents": "b"}),
    ):
        real, sim = both(real_vllm_pooling, sim_pooling_url, path, {**body, "request_id": "from-body"})
        assert real.json()["id"] == sim.json()["id"] == "score-from-body"
        real, sim = both(real_vllm_pooling, sim_pooling_url, path, body, headers={"x-request-id": "hdr"})
        assert real.json()["id"] == sim.json()["id"] == "score-hdr"


@pytest.mark.parametrize(
    ("path", "body"), [("/score", {"queries": "a", "documents": "b"}), ("/v1/embeddings", {"input": [1, 2]})]
)
def test_the_data_parallel_rank_header_is_ignored_on_both(
    real_vllm_pooling: RealServer, sim_pooling_url: str, path: str, body: dict[str, Any]
) -> None:
    """vLLM's pooling handlers never hand the rank to the engine: rank 3 of one engine is answered (the
    simulated embeddings route refused it, as the generation routes do)."""
    real, sim = both(real_vllm_pooling, sim_pooling_url, path, body, headers={"X-data-parallel-rank": "3"})
    assert real.status_code == sim.status_code == 200


def test_methods_alike(real_vllm_pooling: RealServer, sim_pooling_url: str) -> None:
    with httpx.Client(timeout=60) as http:
        for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
            real, sim = (http.get(u + path) for u in (real_vllm_pooling.url, sim_pooling_url))
            assert (sim.status_code, sim.json()) == (real.status_code, real.json()) == (
                405, {"detail": "Method Not Allowed"}
            )  # fmt: skip


def test_metrics_move_alike(real_vllm_pooling: RealServer, sim_pooling_url: str) -> None:
    """One query and two documents of one token each: three engine requests finished `stop` with 0 generated
    tokens; the same series move on both, by the same counts (latency sums differ: times are the perf model's)."""
    before = (_samples(real_vllm_pooling.url), _samples(sim_pooling_url))
    real, sim = both(real_vllm_pooling, sim_pooling_url, "/score", {"queries": "q", "documents": ["a", "b"]})
    assert real.status_code == sim.status_code == 200
    moved_real = _moved(before[0], _samples(real_vllm_pooling.url))
    moved_sim = _moved(before[1], _samples(sim_pooling_url))

    def counted(moved: dict[Any, float]) -> dict[Any, float]:
        # iteration_tokens_total counts engine steps: vLLM's three inputs may land in one step or more
        return {k: v for k, v in moved.items() if not k[0].startswith(_NOT_EXPORTED)
                and (k[0].endswith("_count") or k[0].startswith(_EXACT))
                and not k[0].startswith("vllm:iteration_tokens")}  # fmt: skip

    assert counted(moved_sim) == counted(moved_real)
    assert [v for k, v in moved_sim.items() if k[0] == "vllm:request_success_total"] == [3.0]
    assert [v for k, v in moved_sim.items() if k[0] == "vllm:prompt_tokens_total"] == [3.0]
