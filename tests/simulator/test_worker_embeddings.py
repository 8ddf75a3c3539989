"""The pooling runner (`WorkerConfig.runner="pooling"`, `mosaic worker --runner pooling`): an embedding server as
vLLM 0.32's `--runner pooling --convert embed` (measured in tests/real_vllm/test_embeddings_fidelity.py): its
routes, answers, vectors, errors, metrics and engine timing."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import time
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from server.cli import build_app
from simulator.embeddings import embedding, encode_vector
from simulator.engine import Engine, EngineConfig, run_offline
from simulator.requests import EngineRequest, FinishReason
from simulator.worker_app import RUNNERS, WorkerConfig, WorkerRuntime

pytestmark = pytest.mark.anyio
M = "llama-3-8b"
POOLING = WorkerConfig(gpu="H100", model=M, time_scale=1e4, runner="pooling")
GENERATE = WorkerConfig(gpu="H100", model=M, time_scale=1e4)
HIDDEN = 4096  # Llama-3-8B's hidden size in the catalog


async def embed(client: httpx.AsyncClient, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return await client.post("/v1/embeddings", json=body, **kwargs)


# ---------------------------------------------------------------- routes
UNKNOWN = {"detail": "Not Found"}
GENERATION_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
                     ("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel")]  # fmt: skip
SHARED_ROUTES = [("GET", "/health", None), ("GET", "/ping", None), ("GET", "/version", None),
                 ("GET", "/metrics", None), ("GET", "/v1/models", None),
                 ("POST", "/tokenize", {"model": M, "prompt": "hello"}),
                 ("POST", "/detokenize", {"model": M, "tokens": [1, 2]})]  # fmt: skip


async def test_a_pooling_worker_serves_embeddings_and_no_generation_routes(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        assert (await embed(client, {"model": M, "input": [1, 2]})).status_code == 200
        for method, path in GENERATION_ROUTES:
            r = await client.request(method, path, json={"model": M, "prompt": "hi"})
            assert (r.status_code, r.json()) == (404, UNKNOWN), path
        for method, path, body in SHARED_ROUTES:
            assert (await client.request(method, path, json=body)).status_code == 200, path


async def test_a_generate_worker_has_no_embeddings_route(asgi) -> None:
    async with asgi(GENERATE) as (client, _):
        r = await embed(client, {"model": M, "input": [1, 2]})
        assert (r.status_code, r.json()) == (404, UNKNOWN)
        for method, path, body in SHARED_ROUTES:
            assert (await client.request(method, path, json=body)).status_code == 200, path
        r = await client.post("/v1/completions", json={"model": M, "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200


# ---------------------------------------------------------------- answers
async def test_answer_shape_usage_and_vectors(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        r = await embed(client, {"model": M, "input": [[1, 2, 3], [4, 5]]})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert re.fullmatch(r"embd-[0-9a-f]{16}", body["id"])
    assert (body["object"], body["model"]) == ("list", M)
    assert abs(body["created"] - time.time()) < 60
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0,
                             "prompt_tokens_details": None, "completion_tokens_details": None}  # fmt: skip
    assert list(body["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens",
                                   "prompt_tokens_details", "completion_tokens_details"]  # fmt: skip
    assert [list(d) for d in body["data"]] == [["index", "object", "embedding"]] * 2
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "embedding"), (1, "embedding")]
    for d, ids in zip(body["data"], ([1, 2, 3], [4, 5]), strict=True):
        assert d["embedding"] == embedding(0, ids, HIDDEN).tolist()  # seed 0, the inputs' ids
        assert len(d["embedding"]) == HIDDEN
        assert math.isclose(math.fsum(x * x for x in d["embedding"]), 1.0, rel_tol=1e-6)


async def test_vectors_are_deterministic_per_seed_and_input(asgi) -> None:
    body = {"model": M, "input": [[7, 8, 9], [7, 8, 9], [9, 8, 7]]}
    async with asgi(POOLING) as (a, _), asgi(POOLING) as (b, _):
        first, again = (await embed(a, body)).json()["data"], (await embed(b, body)).json()["data"]
    async with asgi(WorkerConfig(gpu="H100", model=M, time_scale=1e4, runner="pooling", seed=1)) as (c, _):
        other_seed = (await embed(c, body)).json()["data"]
    vecs = [d["embedding"] for d in first]
    assert vecs == [d["embedding"] for d in again]  # another worker of the same seed
    assert vecs[0] == vecs[1] and vecs[0] != vecs[2]  # same ids, same vector; other ids, another
    assert other_seed[0]["embedding"] != vecs[0]
    assert abs(float(np.dot(vecs[0], vecs[2]))) < 0.1  # random unit vectors of 4096 floats: near orthogonal


async def test_dimension_is_the_catalog_models_hidden_size(asgi, tmp_path) -> None:
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(
        "gpus:\n  CPU-AVX2: {memory_gb: 2, hbm_gbps: 20, tflops: 0.2, cost_per_hour: 0.0, memory_kind: gddr}\n"
        "models:\n  tiny-llama: {layers: 2, hidden_size: 128, num_heads: 4, num_kv_heads: 2, head_dim: 32,\n"
        "               params_b: 0.00082, max_context: 2048, vocab_size: 2048}\n"
    )
    cfg = WorkerConfig(gpu="CPU-AVX2", model="tiny-llama", catalog_path=str(catalog), runner="pooling",
                       time_scale=1e4, engine=EngineConfig(max_model_len=512))  # fmt: skip
    async with asgi(cfg) as (client, _):
        r = await embed(client, {"input": [1, 2, 3]})
        oov = await embed(client, {"input": [1, 2048]})
    assert len(r.json()["data"][0]["embedding"]) == 128
    assert oov.json()["error"]["message"] == "Token id 2048 is out of vocabulary"  # the catalog's vocab_size


async def test_text_inputs_use_the_pseudo_tokenizer(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        one = await embed(client, {"input": "hello world"})  # 11 characters → 3 tokens
        batch = await embed(client, {"input": ["a", "abcde"]})  # 1 + 2
    assert one.json()["usage"]["prompt_tokens"] == 3
    assert batch.json()["usage"]["prompt_tokens"] == 3 and len(batch.json()["data"]) == 2


async def test_chat_inputs(asgi) -> None:
    """`messages`, a conversation in `input`, and a batch of conversations: one vector per conversation,
    rendered with the simulator's template and no generation prompt (the embedding requests' default)."""
    conv = [{"role": "user", "content": "hi"}]  # "<|user|>\nhi\n" = 12 characters → 3 tokens
    async with asgi(POOLING) as (client, _):
        msgs = (await embed(client, {"messages": conv})).json()
        in_input = (await embed(client, {"input": conv})).json()
        batch = (await embed(client, {"input": [conv, conv]})).json()
        with_prompt = (await embed(client, {"messages": conv, "add_generation_prompt": True})).json()
    assert msgs["usage"]["prompt_tokens"] == in_input["usage"]["prompt_tokens"] == 3
    assert msgs["data"] == in_input["data"]
    assert len(batch["data"]) == 2 and batch["usage"]["prompt_tokens"] == 6
    assert with_prompt["usage"]["prompt_tokens"] == 7  # + "<|assistant|>\n": 26 characters


async def test_base64_and_bytes_encodings_round_trip(asgi) -> None:
    ids = [3, 1, 4, 1, 5]
    expected = embedding(0, ids, HIDDEN)
    async with asgi(POOLING) as (client, _):
        b64 = (await embed(client, {"input": ids, "encoding_format": "base64"})).json()
        half = (
            await embed(client, {"input": ids, "encoding_format": "base64", "embed_dtype": "float16"})
        ).json()
        big = (await embed(client, {"input": ids, "encoding_format": "base64", "endianness": "big"})).json()
        raw = await embed(client, {"input": [ids, ids], "encoding_format": "bytes"})
        only = await embed(client, {"input": [ids], "encoding_format": "bytes_only"})
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == expected.tolist()  # little-endian float32, exactly the float answer
    assert np.frombuffer(base64.b64decode(half["data"][0]["embedding"]), "<f2").tolist() == (
        expected.astype(np.float16).tolist()
    )
    assert np.frombuffer(base64.b64decode(big["data"][0]["embedding"]), ">f4").tolist() == expected.tolist()
    assert raw.headers["content-type"] == "application/octet-stream" and len(raw.content) == 2 * HIDDEN * 4
    meta = json.loads(raw.headers["metadata"])
    assert list(meta) == ["id", "created", "model", "data", "usage"]
    assert meta["data"][1] == {"index": 1, "embed_dtype": "float32", "endianness": "native",
                               "start": HIDDEN * 4, "end": 2 * HIDDEN * 4, "shape": [HIDDEN]}  # fmt: skip
    assert meta["usage"] == {"prompt_tokens": 10, "total_tokens": 10}
    assert "metadata" not in only.headers and only.content == expected.astype("<f4").tobytes()


def test_binary_dtypes_round_as_torch_does() -> None:
    """bfloat16 and fp8 bit patterns, nearest value with ties to even (checked against torch's conversions)."""
    v = np.array([1.0, -0.5, 0.1, 1e-9, 500.0], dtype=np.float32)
    assert np.frombuffer(encode_vector(v, "bfloat16", "little"), "<u2").tolist() == [
        0x3F80, 0xBF00, 0x3DCD, 0x3089, 0x43FA,
    ]  # fmt: skip
    unit = np.array(
        [1.0, -0.5, 0.1, 1e-9, 0.3, 0.77, -0.0123, 0.0019], dtype=np.float32
    )  # embeddings are ≤ 1
    assert list(encode_vector(unit, "fp8_e4m3", "little")) == [56, 176, 29, 0, 42, 52, 134, 1]
    assert list(encode_vector(unit, "fp8_e5m2", "little")) == [60, 184, 46, 0, 53, 58, 162, 24]


async def test_request_ids(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        header = await embed(client, {"input": [1], "request_id": "body"}, headers={"X-Request-Id": "hdr"})
        body = await embed(client, {"input": [1], "request_id": "body"})
    assert header.json()["id"] == "embd-hdr" and body.json()["id"] == "embd-body"


async def test_truncation_and_padding(asgi) -> None:
    async with asgi(POOLING) as (client, rt):
        limit = rt.engine.max_model_len
        cut = (await embed(client, {"input": list(range(1, 20)), "truncate_prompt_tokens": 5})).json()
        cut_right = await embed(
            client, {"input": list(range(1, 20)), "truncate_prompt_tokens": 5, "truncation_side": "right"}
        )
        whole = (
            await embed(client, {"input": list(range(1, limit + 50)), "truncate_prompt_tokens": -1})
        ).json()
        full = (await embed(client, {"input": list(range(1, limit + 1))})).json()  # fills the context: fine
        padded = (await embed(client, {"input": [1, 2], "padding": "max_length"})).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["data"][0]["embedding"] == embedding(0, [15, 16, 17, 18, 19], HIDDEN).tolist()  # the last 5
    assert cut_right.json()["data"][0]["embedding"] == embedding(0, [1, 2, 3, 4, 5], HIDDEN).tolist()
    assert (
        whole["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"] == padded["usage"]["prompt_tokens"]
    )
    assert full["usage"]["prompt_tokens"] == limit


# ---------------------------------------------------------------- errors (vLLM 0.32's words)
def _error(message: str, status: int = 400, type_: str = "BadRequestError", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


MISSING = "<dict of 1 items>"
ERRORS: dict[str, tuple[dict[str, Any], int, dict[str, Any]]] = {
    "dimensions": ({"model": M, "input": "hi", "dimensions": 8}, 400, _error(
        f"Model '{M}' does not support Matryoshka embeddings; dimensions must be unset (received dimensions=8).")),
    "unknown model": ({"model": "nope", "input": "hi"}, 404,
                      _error("The model `nope` does not exist.", 404, "NotFoundError")),
    "empty string": ({"input": ""}, 400, _error("The decoder prompt cannot be empty")),
    "no prompt": ({"input": []}, 400, _error("You must pass at least one prompt")),
    "truncate over the context": ({"input": [1], "truncate_prompt_tokens": 9000}, 400, _error(
        "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation size.")),
    "over the context": ({"input": list(range(1, 8194))}, 400, _error(
        # vLLM says "at least" for one token past the limit, token ids too (measured: 513 ids at 512)
        "This model's maximum context length is 8192 tokens. However, your prompt contains at least 8193 input "
        "tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=8193)", param="input_tokens")),
    "negative token id": ({"input": [5, -1, -3]}, 400, _error("Token id -3 is out of vocabulary")),
    "normalize": ({"input": "hi", "normalize": True}, 400, _error(
        "Parameter `normalize` was removed; use `use_activation` instead. (parameter=normalize)", param="normalize")),
    "missing input": ({"model": M}, 400, _error(
        "7 validation errors:\n"
        + "\n".join(f"  {{'type': 'missing', 'loc': 'body.{f}', 'msg': 'Field required', 'input': '{MISSING}'}}"
                    for f in ("input", "messages", "messages", "messages", "input", "messages", "input")),
        type_="Bad Request", param="body.input")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ERRORS))
async def test_errors(asgi, case: str) -> None:
    body, status, answer = ERRORS[case]
    async with asgi(POOLING) as (client, rt):
        r = await embed(client, body)
        assert rt.engine.counters.prompt_tokens == 0  # refused before the engine
    assert (r.status_code, r.json()) == (status, answer)


async def test_many_validation_errors_are_cut_after_ten(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        r = await embed(client, {"input": ["a", 1]})
    message = r.json()["error"]["message"]
    assert message.startswith("27 validation errors:\n") and message.endswith("\n  ...and 17 more errors")
    assert len(message.splitlines()) == 12 and r.json()["error"]["param"] == "body.input.0"


async def test_injected_errors_apply(asgi) -> None:
    cfg = WorkerConfig(gpu="H100", model=M, time_scale=1e4, runner="pooling")
    async with asgi(cfg) as (client, rt):
        rt.faults.error_rate = 1.0
        r = await embed(client, {"input": [1, 2]})
    assert (r.status_code, r.json()["error"]["type"]) == (500, "InternalServerError")


# ---------------------------------------------------------------- metrics
def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (
            s.name,
            tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))),
        ): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.name.endswith("_created")
    }


async def test_metrics_count_each_input_as_one_prefill_only_request(asgi) -> None:
    async with asgi(POOLING) as (client, _):
        before = _samples((await client.get("/metrics")).text)
        await embed(client, {"input": [[1, 2, 3], [4, 5]]})
        after = _samples((await client.get("/metrics")).text)
    moved = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}

    def delta(name: str, **labels: str) -> float:
        return moved.get((name, tuple(sorted(labels.items()))), 0.0)

    assert delta("vllm:request_success_total", finished_reason="stop") == 2
    assert delta("vllm:prompt_tokens_total") == 5 and delta("vllm:generation_tokens_total") == 0
    for family in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                   "request_inference_time_seconds", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert delta(f"vllm:{family}_count") == 2, family
    assert delta("vllm:request_prompt_tokens_sum") == 5
    assert (
        delta("vllm:request_generation_tokens_sum") == 0
        and delta("vllm:request_decode_time_seconds_sum") == 0
    )
    assert delta("vllm:request_generation_tokens_bucket", le="1.0") == 2  # observed as 0 tokens
    # both prefills in one step: one iteration of their 5 prompt tokens, no token generated
    assert delta("vllm:iteration_tokens_total_count") == 1 and delta("vllm:iteration_tokens_total_sum") == 5
    assert delta("vllm:inter_token_latency_seconds_count") == 0
    # a pooling request's TTFT is its whole latency, its prefill its whole inference time
    assert delta("vllm:time_to_first_token_seconds_sum") == pytest.approx(
        delta("vllm:e2e_request_latency_seconds_sum")
    )
    assert delta("vllm:request_prefill_time_seconds_sum") == pytest.approx(
        delta("vllm:request_inference_time_seconds_sum")
    )


async def test_a_disconnect_aborts_the_inputs(served) -> None:
    """A client gone while its inputs prefill (chunked over many steps): every engine request is aborted, its
    KV freed, no success counted."""
    cfg = WorkerConfig(gpu="L4", model=M, time_scale=0.2, runner="pooling",
                       engine=EngineConfig(max_num_batched_tokens=256, max_num_seqs=8))  # fmt: skip
    async with served(cfg) as w:
        eng = w.runtime.engine
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=0.3)) as h:
            with pytest.raises(httpx.ReadTimeout):
                await h.post(w.url + "/v1/embeddings", json={"input": [list(range(1, 4000))] * 2})
        deadline = time.monotonic() + 5
        while eng.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert (eng.num_running, eng.num_waiting, eng.kv.used) == (0, 0, 0)
        assert eng.counters.success == {"stop": 0, "length": 0} and eng.counters.prompt_tokens == 0


# ---------------------------------------------------------------- the engine
def _engine(**cfg: Any) -> Engine:
    cat = load_catalog()
    return Engine(PerfModel(cat.gpu("H100"), cat.model(M)), EngineConfig(**cfg), seed=0)


def test_a_pooling_request_finishes_when_its_prefill_does() -> None:
    """Same prompt, same engine settings: the pooling request ends exactly when the generating one emits its
    first token, with no token, reason stop, and its KV freed."""
    ids = list(range(1, 3001))
    (gen,) = run_offline(_engine(), [(0.0, EngineRequest("g", ids, 50, ignore_eos=True))])
    pool_engine = _engine()
    (pool,) = run_offline(pool_engine, [(0.0, EngineRequest("p", ids, 0, pooling=True))])
    assert pool.finished == pool.first_token == gen.first_token
    assert (pool.ttft, pool.e2e) == (gen.ttft, gen.ttft)
    assert (pool.output_tokens, pool.finish_reason, pool.decode_time) == (0, FinishReason.STOP, 0.0)
    assert pool_engine.kv.used == 0 and pool_engine.counters.generation_tokens == 0
    assert pool_engine.counters.prompt_tokens == 3000 and pool_engine.counters.success["stop"] == 1


def test_a_pooling_request_is_chunked_like_any_prefill() -> None:
    eng = _engine(max_num_batched_tokens=1024)
    eng.add_request(EngineRequest("p", list(range(1, 3001)), 0, pooling=True), 0.0)
    steps, now = [], 0.0
    while eng.has_work():
        res = eng.step(now)
        steps.append((res.num_prefill_tokens, res.num_pooled, len(res.finished), eng.kv.used))
        now = res.end
    assert [s[:3] for s in steps] == [(1024, 0, 0), (1024, 0, 0), (952, 1, 1)]
    assert [s[3] for s in steps] == [64, 128, 0]  # blocks of 16 held while prefilling, freed at the end


def test_pooling_request_checks() -> None:
    eng = _engine(max_model_len=512)
    eng.add_request(EngineRequest("full", list(range(1, 513)), 0, pooling=True), 0.0)  # fills the context
    with pytest.raises(ValueError, match="exceeds max_model_len 512"):
        eng.add_request(EngineRequest("long", list(range(1, 514)), 0, pooling=True), 0.0)
    with pytest.raises(ValueError, match="max_tokens and min_tokens must be 0"):
        eng.add_request(EngineRequest("gen", [1, 2], 5, pooling=True), 0.0)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        eng.add_request(EngineRequest("zero", [1, 2], 0), 0.0)  # only a pooling request generates nothing


# ---------------------------------------------------------------- configuration and CLI
def test_runner_validation() -> None:
    assert RUNNERS == ("generate", "pooling") and WorkerConfig().runner == "generate"
    with pytest.raises(ValueError, match=r"runner must be one of generate, pooling, got 'embed'"):
        WorkerRuntime(WorkerConfig(runner="embed"))
    with pytest.raises(ValueError, match=r"runner 'pooling' needs role 'mixed', got 'prefill'"):
        WorkerRuntime(WorkerConfig(runner="pooling", role="prefill"))


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--runner", "bad"], "--runner must be one of generate, pooling, got 'bad'"),
     (["--runner", "pooling", "--role", "decode"], "--runner pooling needs --role mixed, got 'decode'")],
)  # fmt: skip
def test_cli_refuses_a_bad_runner_with_one_line(args: list[str], message: str) -> None:
    res = CliRunner().invoke(build_app(), ["worker", "--gpu", "H100", "--model", M, *args])
    assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1, (
        res.output
    )
