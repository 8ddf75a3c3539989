"""vLLM's score and rerank routes (`/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`), and its
`/classify`, through the
gateway, for pooling models: sized as the pairs a cross-encoder runs, the context checked by the longest text
an embedding model encodes alone, routed, KV-reserved and released, metered, and refused for generative
models with a 400 naming the model. End to end over real sockets against simulated pooling workers, whose
scores are the cosine of their own embeddings (vLLM's bi-encoder scoring)."""

from __future__ import annotations

import collections.abc
import json
import math
from typing import Any

import httpx
import pytest

from server.errors import GatewayError
from server.footprint import estimate_text_tokens, parse_request, route_request
from tests.gateway.pooling_fleet import CHAT, CONTEXT, EMBED, pooling_fleet
from tests.gateway.serverkit import GatewayThread


def _parse(kind: str, limits: dict[str, int] | None = None, **body: Any) -> Any:
    return parse_request(
        kind, json.dumps({"model": "m", **body}).encode(), {"m": CONTEXT} if limits is None else limits
    )  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------- footprints
def test_one_query_is_paired_with_every_document() -> None:
    q, d = "what is paged attention?", ["a" * 40, "b" * 8, "c" * 100]
    parsed = _parse("rerank", query=q, documents=d)
    tq = estimate_text_tokens(q)
    assert parsed.prompt_lens == (tq + 10, tq + 2, tq + 25)  # each pair: the query and its document
    assert parsed.prompt_tokens == sum(parsed.prompt_lens)
    assert (parsed.sequences, parsed.max_output_tokens, parsed.prompt_text) == (3, 0, q)
    req = route_request(parsed, "r", 0.0, default_output_tokens=16)
    # the context must hold the longest text alone (an embedding model encodes each text on its own)
    assert req.longest_prompt == 25
    assert (req.single_hop, req.generates) == (True, False)


@pytest.mark.parametrize(
    ("first", "second"),
    [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")],
)
def test_every_score_shape_pairs_n_with_n(first: str, second: str) -> None:
    parsed = _parse("score", **{first: ["a" * 4, "b" * 8], second: ["c" * 12, "d" * 16]})
    assert parsed.prompt_lens == (1 + 3, 2 + 4)


def test_a_single_input_on_either_side_is_a_list_of_one() -> None:
    parsed = _parse("score", text_1="a" * 8, text_2="b" * 8)
    assert (parsed.prompt_tokens, parsed.prompt_lens, parsed.sequences) == (4, (), 1)


def test_multimodal_inputs_count_their_text_parts() -> None:
    doc = {"content": [{"type": "text", "text": "x" * 20}, {"type": "image_url", "image_url": {"url": "u"}}]}
    parsed = _parse(
        "rerank", query="q" * 4, documents=[doc, {"content": "not parts"}, {"content": [5, None]}]
    )
    assert parsed.prompt_lens == (1 + 5, 1 + 3, 1)  # a string content counts as text (vLLM refuses it)


def test_per_query_and_per_document_limits_cut_the_texts_first() -> None:
    parsed = _parse(
        "rerank", query="q" * 400, documents=["d" * 400, "e"], max_tokens_per_query=10, max_tokens_per_doc=20
    )
    assert parsed.prompt_lens == (30, 11)
    assert (
        route_request(parsed, "r", 0.0, default_output_tokens=16).longest_prompt == 20
    )  # the longest cut text


def test_truncate_prompt_tokens_cuts_every_prompt_and_the_context_check() -> None:
    parsed = _parse("score", queries="q" * 400, documents=["d" * 400, "e"], truncate_prompt_tokens=-1)
    assert parsed.prompt_lens == (CONTEXT, CONTEXT)  # each pair cut; a pooling model keeps its whole context
    assert route_request(parsed, "r", 0.0, default_output_tokens=16).longest_prompt == CONTEXT


def test_padding_to_max_length_makes_every_text_a_whole_context() -> None:
    """vLLM pads each prompt to the context with `padding: "max_length"` (measured: /score of a query and two
    documents on the 512-token embedding server uses 1,536 tokens): counted so, as every text of a
    bi-encoder (the most either kind holds); the reviewer found it counted as sent."""
    parsed = _parse("rerank", query="hi", documents=["a", "b"], padding="max_length")
    assert (parsed.prompt_lens, parsed.prompt_tokens) == ((CONTEXT,) * 3, 3 * CONTEXT)
    assert route_request(parsed, "r", 0.0, default_output_tokens=16).longest_prompt == CONTEXT
    embed = _parse("embeddings", input=[[1, 2], [3]], padding="max_length")
    assert (embed.prompt_lens, embed.prompt_tokens) == ((CONTEXT, CONTEXT), 2 * CONTEXT)
    assert _parse("embeddings", input=[1, 2], padding="do_not_pad").prompt_tokens == 2
    assert _parse("embeddings", {}, input=[1, 2], padding="max_length").prompt_tokens == 2  # context unknown


def test_counts_that_do_not_pair_up_and_empty_sides_are_left_to_the_worker() -> None:
    assert _parse("score", queries=["a", "b"], documents=["c", "d", "e"]).sequences == 2
    assert _parse("rerank", query="q", documents=[]).prompt_tokens == 0
    assert _parse("score", queries=[], documents=["a"]).prompt_tokens == 0


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("score", {"queries": "q"}, "queries"),
        ("score", {"documents": ["d"], "items": ["i"]}, "queries"),
        ("rerank", {"documents": ["d"]}, "query"),
        ("rerank", {"query": ["q"], "documents": ["d"]}, "query"),
        ("rerank", {"query": "q", "documents": [["d"]]}, "documents"),
        ("rerank", {"query": "q", "documents": ["d"], "kv_transfer_params": {}}, "kv_transfer_params"),
    ],
)
def test_a_body_without_its_pair_of_fields_is_a_400_naming_one(
    kind: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(GatewayError) as err:
        _parse(kind, **body)
    assert err.value.status == 400 and err.value.param == param


# -------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def gw() -> collections.abc.Iterator[GatewayThread]:
    with GatewayThread(pooling_fleet()) as thread:
        yield thread


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b)
    )


def test_scores_are_the_cosine_of_the_embeddings_the_pool_serves(gw: GatewayThread) -> None:
    query, documents = "paged attention", ["a block table", "paged attention", "ragged paging"]
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        vectors = http.post(
            "/v1/embeddings", json={"model": EMBED, "input": [query, *documents], "encoding_format": "float"}
        )
        scored = http.post("/score", json={"model": EMBED, "queries": query, "documents": documents})
    assert vectors.status_code == scored.status_code == 200, scored.text
    q, *ds = (d["embedding"] for d in vectors.json()["data"])
    assert [d["score"] for d in scored.json()["data"]] == pytest.approx([_cosine(q, d) for d in ds], abs=1e-5)
    assert scored.json()["data"][1]["score"] == pytest.approx(1.0, abs=1e-5)  # the same text


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_on_every_path_ranks_and_keeps_top_n(gw: GatewayThread, path: str) -> None:
    body = {
        "model": EMBED,
        "query": "paged attention",
        "documents": ["a block table", "paged attention", "x"],
        "top_n": 2,
    }
    r = httpx.post(gw.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert (
        len(results) == 2
        and results[0]["index"] == 1
        and results[0]["document"] == {"text": "paged attention", "multi_modal": None}
    )
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]


def test_scoring_requests_are_reserved_released_and_metered(gw: GatewayThread) -> None:
    done = gw.metric("mosaic_requests_total", model=EMBED, pool="embed-l4", status="200")
    reserved = gw.metric("mosaic_kv_reservations_total")
    tokens = gw.metric("mosaic_prompt_tokens_total", model=EMBED)
    used = 0
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        for i in range(6):
            path, body = (
                ("/score", {"queries": f"query {i}", "documents": ["one", "two"]})
                if i % 2
                else ("/rerank", {"query": f"query {i}", "documents": ["one", "two", "three"]})
            )
            r = http.post(path, json={"model": EMBED, **body})
            assert r.status_code == 200, r.text
            used += r.json()["usage"]["prompt_tokens"]
        workers = [w for w in http.get("/admin/workers").json()["workers"] if w["pool"] == "embed-l4"]
    assert gw.metric("mosaic_requests_total", model=EMBED, pool="embed-l4", status="200") == done + 6
    assert gw.metric("mosaic_kv_reservations_total") == reserved + 6
    assert gw.metric_reaches("mosaic_prompt_tokens_total", tokens + used, model=EMBED) == tokens + used
    assert gw.metric("mosaic_generation_tokens_total", model=EMBED) == 0
    for w in workers:
        assert gw.metric("mosaic_kv_active_reservations", worker=w["id"]) == 0


def test_the_workers_own_400s_pass_through(gw: GatewayThread) -> None:
    """What the gateway leaves to the worker (sides that do not pair up, an empty side) is vLLM's 400 in its
    words, passed through as the worker answered."""
    cases = [
        (
            {"queries": ["a", "b"], "documents": ["c", "d", "e"]},
            "Input lengths must be either 1:1, 1:N or N:N",
        ),
        ({"queries": "a", "documents": []}, "At least one text_pair element must be given"),
    ]
    for body, message in cases:
        r = httpx.post(gw.url + "/score", json={"model": EMBED, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"] == message


def test_a_text_over_the_context_is_the_gateways_400_before_any_worker(gw: GatewayThread) -> None:
    r = httpx.post(
        gw.url + "/rerank", json={"model": EMBED, "query": "q", "documents": ["word " * 600]}, timeout=30
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_classify_is_read_as_embeddings_are() -> None:
    parsed = _parse("classify", input=[[1, 2, 3], [4, 5]])
    assert (parsed.kind, parsed.prompt_lens, parsed.max_output_tokens) == ("classify", (3, 2), 0)
    chat = _parse("classify", messages=[{"role": "user", "content": "x" * 40}])
    assert chat.prompt_tokens == 10 + 3 + 3  # counted as a chat prompt
    req = route_request(parsed, "r", 0.0, default_output_tokens=16)
    assert (req.single_hop, req.generates) == (True, False)


def test_classify_reaches_the_pooling_workers(gw: GatewayThread) -> None:
    """Routed to the pooling pool; its (embedding) workers have no /classify, as vLLM's embedding runner has
    none: their 404 is passed through, and a generative model's request is the gateway's 400."""
    served = httpx.post(gw.url + "/classify", json={"model": EMBED, "input": "hi"}, timeout=30)
    assert served.status_code == 404 and served.json() == {"detail": "Not Found"}
    refused = httpx.post(gw.url + "/classify", json={"model": CHAT, "input": "hi"}, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        f"The model `{CHAT}` is a generative model (runner: generate) and does not serve /classify"
    )
