"""Fidelity diff of the pooling runner: the simulated worker with `--runner pooling` beside a real vLLM 0.32
started with `--runner pooling --convert embed` (the tiny Llama: 128 hidden floats, max_model_len 512).

Same requests to both. Equal on both sides: status codes; for errors the whole OpenAI error (type, param and
message: vLLM's words, and pydantic's union errors as vLLM lists them); for answers the keys and their order,
`object`s, indices, the vector dimension, unit norm, usage for token-id inputs (text is tokenised
differently: the simulator has no tokenizer), `base64` and `bytes` sizes; the generation routes are unknown
paths; and the metric series an embedding request moves, with the same deltas where they are counts.
Reused machinery: `fidelity.shape_diff` for the body shapes and the conftest's servers.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import httpx
import pytest
from conftest import RealServer
from fidelity import shape_diff
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
DIM = 128  # the tiny model's hidden size (tests/real_vllm/build_model.py; its catalog row says the same)
LONG = list(range(1, 600))  # 599 token ids: over max_model_len


def both(
    real: RealServer, sim: str, path: str, body: Any, **kwargs: Any
) -> tuple[httpx.Response, httpx.Response]:
    with httpx.Client(timeout=120) as http:
        return (
            http.post(real.url + path, json=body, **kwargs),
            http.post(sim + path, json=body, **kwargs),
        )


ERRORS: dict[str, Any] = {
    "dimensions": {"model": MODEL, "input": "hi", "dimensions": 8},
    "dimensions 0": {"model": MODEL, "input": [1, 2], "dimensions": 0},
    "unknown model": {"model": "nope", "input": "hi"},
    "empty string": {"model": MODEL, "input": ""},
    "empty list": {"model": MODEL, "input": []},
    "empty prompt in batch": {"model": MODEL, "input": [[1, 2], []]},
    "missing input": {"model": MODEL},
    "input null": {"model": MODEL, "input": None},
    "input a number": {"model": MODEL, "input": 5},
    "input mixed": {"model": MODEL, "input": ["a", 1]},
    "messages a string": {"model": MODEL, "messages": "hi"},
    "messages of numbers": {"model": MODEL, "messages": [5]},
    "over max_model_len": {"model": MODEL, "input": LONG},
    "text over max_model_len": {"model": MODEL, "input": "hello " * 1000},
    "truncate over max_model_len": {"model": MODEL, "input": [1, 2], "truncate_prompt_tokens": 600},
    "truncate below -1": {"model": MODEL, "input": [1, 2], "truncate_prompt_tokens": -2},
    "truncate 0": {"model": MODEL, "input": [1, 2, 3], "truncate_prompt_tokens": 0},
    "bad encoding_format": {"model": MODEL, "input": "hi", "encoding_format": "nope"},
    "bad embed_dtype": {"model": MODEL, "input": "hi", "embed_dtype": "int8"},
    "user a number": {"model": MODEL, "input": "hi", "user": 5},
    "priority fractional": {"model": MODEL, "input": "hi", "priority": 1.5},
    "normalize": {"model": MODEL, "input": "hi", "normalize": True},
    "removed task": {"model": MODEL, "input": "hi", "task": "encode"},
    "empty cache_salt": {"model": MODEL, "input": "hi", "cache_salt": ""},
    "both chat flags": {
        "model": MODEL,
        "input": "hi",
        "add_generation_prompt": True,
        "continue_final_message": True,
    },
    "token out of vocabulary": {"model": MODEL, "input": [5, 99999]},
    "negative token": {"model": MODEL, "input": [5, -1, -3]},
    "long before empty": {"model": MODEL, "input": [[], LONG]},
    "dimensions before empty": {"model": MODEL, "input": "", "dimensions": 8},
    "unknown model before dimensions": {"model": "nope", "input": "hi", "dimensions": 8},
    "empty conversation": {"model": MODEL, "messages": []},
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_alike(real_vllm_pooling: RealServer, sim_pooling_url: str, case: str) -> None:
    real, sim = both(real_vllm_pooling, sim_pooling_url, "/v1/embeddings", ERRORS[case])
    assert real.status_code >= 400, real.text
    assert (sim.status_code, sim.json()) == (real.status_code, real.json())


def test_content_type_and_malformed_json_alike(real_vllm_pooling: RealServer, sim_pooling_url: str) -> None:
    for content, headers in (
        (b'{"input": "hi"}', {"content-type": "text/plain"}),
        (b'{"model":', {"content-type": "application/json"}),
        (b"", {"content-type": "application/json"}),
    ):
        with httpx.Client(timeout=60) as http:
            real = http.post(real_vllm_pooling.url + "/v1/embeddings", content=content, headers=headers)
            sim = http.post(sim_pooling_url + "/v1/embeddings", content=content, headers=headers)
        assert (sim.status_code, sim.json()) == (real.status_code, real.json())


ANSWERS: dict[str, Any] = {
    "token ids": {"model": MODEL, "input": [1, 2, 3, 4]},
    "batch of token ids": {"model": MODEL, "input": [[1, 2, 3], [4, 5]]},
    "no model": {"input": [7, 8]},
    "truncated": {"model": MODEL, "input": LONG[:20], "truncate_prompt_tokens": 5},
    "truncated to the context": {"model": MODEL, "input": LONG, "truncate_prompt_tokens": -1},
    "a prompt of max_model_len": {"model": MODEL, "input": LONG[:512]},
    "padded to the context": {"model": MODEL, "input": [1, 2], "padding": "max_length"},
    "extra fields": {"model": MODEL, "input": [3, 4], "stream": True, "foo": 1, "user": "u", "priority": 0},
    "text": {"model": MODEL, "input": "hello world"},
    "texts": {"model": MODEL, "input": ["a", "bc"]},
    "chat messages": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "chat in input": {"model": MODEL, "input": [{"role": "user", "content": "hi"}]},
    "chats in input": {
        "model": MODEL,
        "input": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello there"}]],
    },
}
TOKEN_ID_CASES = ("token ids", "batch of token ids", "no model", "truncated", "truncated to the context",
                  "a prompt of max_model_len", "padded to the context", "extra fields")  # fmt: skip


@pytest.mark.parametrize("case", list(ANSWERS))
def test_answers_alike(real_vllm_pooling: RealServer, sim_pooling_url: str, case: str) -> None:
    real, sim = both(real_vllm_pooling, sim_pooling_url, "/v1/embeddings", ANSWERS[case])
    assert real.status_code == sim.status_code == 200, (real.text[:300], sim.text[:300])
    r, s = real.json(), sim.json()
    assert list(s) == list(r) == ["id", "object", "created", "model", "data", "usage"]
    assert not shape_diff(case, r, s)
    assert list(s["usage"]) == list(r["usage"])
    assert s["object"] == r["object"] == "list" and s["model"] == r["model"] == MODEL
    assert s["id"].startswith("embd-") and r["id"].startswith("embd-")
    assert len(s["data"]) == len(r["data"])
    for rd, sd in zip(r["data"], s["data"], strict=True):
        assert list(sd) == list(rd) == ["index", "object", "embedding"]
        assert sd["index"] == rd["index"] and sd["object"] == rd["object"] == "embedding"
        assert len(sd["embedding"]) == len(rd["embedding"]) == DIM
        assert math.isclose(math.fsum(x * x for x in sd["embedding"]), 1.0, rel_tol=1e-5)
        assert math.isclose(math.fsum(x * x for x in rd["embedding"]), 1.0, rel_tol=1e-5)
    if case in TOKEN_ID_CASES:
        assert s["usage"] == r["usage"]
    assert s["usage"]["completion_tokens"] == r["usage"]["completion_tokens"] == 0


def test_request_ids_alike(real_vllm_pooling: RealServer, sim_pooling_url: str) -> None:
    body = {"model": MODEL, "input": [1, 2], "request_id": "from-body"}
    real, sim = both(real_vllm_pooling, sim_pooling_url, "/v1/embeddings", body)
    assert real.json()["id"] == sim.json()["id"] == "embd-from-body"
    real, sim = both(
        real_vllm_pooling, sim_pooling_url, "/v1/embeddings", body, headers={"x-request-id": "hdr"}
    )
    assert real.json()["id"] == sim.json()["id"] == "embd-hdr"


@pytest.mark.parametrize("dtype,size", [("float32", 4), ("float16", 2), ("bfloat16", 2), ("fp8_e4m3", 1)])
def test_binary_encodings_alike(
    real_vllm_pooling: RealServer, sim_pooling_url: str, dtype: str, size: int
) -> None:
    body = {"model": MODEL, "input": [[1, 2], [3]], "encoding_format": "base64", "embed_dtype": dtype}
    real, sim = both(real_vllm_pooling, sim_pooling_url, "/v1/embeddings", body)
    for answer in (real.json(), sim.json()):
        assert [len(base64.b64decode(d["embedding"])) for d in answer["data"]] == [DIM * size] * 2
    for fmt in ("bytes", "bytes_only"):
        real, sim = both(
            real_vllm_pooling, sim_pooling_url, "/v1/embeddings", {**body, "encoding_format": fmt}
        )
        assert real.status_code == sim.status_code == 200
        assert real.headers["content-type"] == sim.headers["content-type"] == "application/octet-stream"
        assert len(real.content) == len(sim.content) == 2 * DIM * size
        assert ("metadata" in real.headers) == ("metadata" in sim.headers) == (fmt == "bytes")
        if fmt == "bytes":
            rm, sm = json.loads(real.headers["metadata"]), json.loads(sim.headers["metadata"])
            assert list(sm) == list(rm)
            assert [{k: v for k, v in d.items()} for d in sm["data"]] == rm["data"]
            assert sm["usage"] == rm["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


@pytest.mark.parametrize(
    "method,path",
    [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
     ("GET", "/v1/responses/resp_x"), ("POST", "/v1/responses/resp_x/cancel")],
)  # fmt: skip
def test_generation_routes_are_unknown_on_both(
    real_vllm_pooling: RealServer, sim_pooling_url: str, method: str, path: str
) -> None:
    with httpx.Client(timeout=60) as http:
        for url in (real_vllm_pooling.url, sim_pooling_url):
            r = http.request(method, url + path, json={"model": MODEL, "prompt": "hi"})
            assert (r.status_code, r.json()) == (404, {"detail": "Not Found"}), url


def test_models_and_tokenize_answer_alike(real_vllm_pooling: RealServer, sim_pooling_url: str) -> None:
    with httpx.Client(timeout=60) as http:
        real, sim = (http.get(u + "/v1/models").json() for u in (real_vllm_pooling.url, sim_pooling_url))
        assert not shape_diff("models", real, sim)
        assert real["data"][0]["max_model_len"] == sim["data"][0]["max_model_len"] == 512
        # /tokenize stays: a text prompt (vLLM's /tokenize takes no token ids), counted by each tokenizer
        real_t, sim_t = (
            http.post(u + "/tokenize", json={"model": MODEL, "prompt": "hello world"})
            for u in (real_vllm_pooling.url, sim_pooling_url)
        )
        assert real_t.status_code == sim_t.status_code == 200
        assert list(real_t.json()) == list(sim_t.json())


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _moved(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


# vLLM 0.32 series the simulator does not export (docs/real_vllm.md): prefix-cache on by default there, per
# request histograms newer than the simulator's set
_NOT_EXPORTED = (
    "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_by_source_total",
    "vllm:request_max_num_generation_tokens", "vllm:request_num_preemptions", "vllm:request_params_n",
    "vllm:request_prefill_kv_computed_tokens", "vllm:request_time_per_output_token_seconds",
)  # fmt: skip
# counts that are equal on both sides (`_count` of the per-request histograms, the token counters)
_EXACT = (
    "vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum",
)  # fmt: skip


def test_metrics_move_alike(real_vllm_pooling: RealServer, sim_pooling_url: str) -> None:
    """Two inputs of 3 and 2 token ids: each is one engine request finished `stop` with 0 generated tokens; the
    same series move on both, by the same counts (latency sums differ: times are the perf model's)."""
    before = (_samples(real_vllm_pooling.url), _samples(sim_pooling_url))
    real, sim = both(
        real_vllm_pooling, sim_pooling_url, "/v1/embeddings", {"model": MODEL, "input": [[1, 2, 3], [4, 5]]}
    )
    assert real.status_code == sim.status_code == 200
    moved_real = _moved(before[0], _samples(real_vllm_pooling.url))
    moved_sim = _moved(before[1], _samples(sim_pooling_url))

    def counted(moved: dict[Any, float]) -> dict[Any, float]:
        return {k: v for k, v in moved.items() if not k[0].startswith(_NOT_EXPORTED)
                and (k[0].endswith("_count") or k[0].startswith(_EXACT))}  # fmt: skip

    # iteration_tokens_total counts engine steps: vLLM's two inputs may land in one step or two
    real_counts = {
        k: v for k, v in counted(moved_real).items() if not k[0].startswith("vllm:iteration_tokens")
    }
    sim_counts = {k: v for k, v in counted(moved_sim).items() if not k[0].startswith("vllm:iteration_tokens")}
    assert sim_counts == real_counts
    success = [v for k, v in moved_sim.items() if k[0] == "vllm:request_success_total"]
    assert success == [2.0] and ("vllm:request_success_total", (("engine", "0"), ("finished_reason", "stop"),
                                                                   ("model_name", MODEL))) in moved_sim  # fmt: skip
    assert not any(k[0] == "vllm:generation_tokens_total" for k in moved_sim)
    assert not any(k[0].startswith("vllm:inter_token_latency") for k in (*moved_real, *moved_sim))
    families = {
        k[0].rsplit("_", 1)[0] if k[0].endswith(("_count", "_sum", "_bucket")) else k[0] for k in moved_sim
    }
    real_families = {
        k[0].rsplit("_", 1)[0] if k[0].endswith(("_count", "_sum", "_bucket")) else k[0] for k in moved_real
    }
    assert families == {f for f in real_families if not f.startswith(_NOT_EXPORTED)}
