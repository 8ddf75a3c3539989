"""Fidelity diff: Mosaic's simulated worker beside the real vLLM server, as a client and a scraper see them.

Same requests to both; every difference in response fields, stream events, error (status, type, param) and
metric families/labels must be a listed one (`fidelity.KNOWN_*`, mirrored in docs/real_vllm.md), and every
listed one must still show (`assert_listed`): a difference the simulator no longer has is taken off the list,
so the list and the docs describe the simulator as it is. The framing
rules (one SSE event per HTTP chunk, `data: [DONE]` last, usage only when asked) must hold on both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from conftest import RealServer
from fidelity import (
    CORE_FAMILIES,
    KNOWN_BODY,
    KNOWN_ERRORS,
    KNOWN_METRIC_FAMILIES,
    KNOWN_METRIC_LABELS,
    KNOWN_STREAM,
    raw_chunks,
    shape_diff,
    token_keyed,
)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "Compare paged attention with a contiguous KV cache."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def assert_listed(observed: set[str], known: Mapping[str, str], prefix: str) -> None:
    """Every observed difference is listed, and every listed one starting with `prefix` was observed."""
    unexpected = observed - known.keys()
    stale = {k for k in known if k.startswith(prefix)} - observed
    assert not unexpected and not stale, (
        f"not listed: {sorted(unexpected)}; listed, not seen: {sorted(stale)}"
    )


def both(
    real: RealServer, sim: str, method: str, path: str, **kwargs: Any
) -> tuple[httpx.Response, httpx.Response]:
    with httpx.Client(timeout=60) as http:
        return http.request(method, real.url + path, **kwargs), http.request(method, sim + path, **kwargs)


BODIES = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4, "ignore_eos": True}),
    "completion": (
        "/v1/completions",
        {"model": MODEL, "prompt": "def route(request):", "max_tokens": 4, "ignore_eos": True},
    ),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_response_fields(real_vllm: RealServer, sim_url: str, case: str) -> None:
    path, body = BODIES[case]
    real, sim = both(real_vllm, sim_url, "POST", path, json=body)
    assert real.status_code == sim.status_code == 200
    assert real.json()["usage"]["completion_tokens"] == sim.json()["usage"]["completion_tokens"] == 4
    assert_listed(shape_diff(case, real.json(), sim.json()), KNOWN_BODY, f"{case} .")


DEFAULTS = {  # case → (completions body, completion tokens both must generate)
    "completions default max_tokens": ({"model": MODEL, "prompt": "hi"}, 16),
    "completions max_tokens null": ({"model": MODEL, "prompt": "hi", "max_tokens": None}, 16),
    "empty model name": ({"model": "", "prompt": "hi", "max_tokens": 3}, 3),
}


@pytest.mark.parametrize("case", list(DEFAULTS))
def test_defaults(real_vllm: RealServer, sim_url: str, case: str) -> None:
    """The simulated worker filled the context where vLLM generates 16 tokens, and answered 404 to an empty
    model name vLLM serves as its model."""
    body, tokens = DEFAULTS[case]
    real, sim = both(real_vllm, sim_url, "POST", "/v1/completions", json={**body, "ignore_eos": True})
    assert real.status_code == sim.status_code == 200, (real.text, sim.text)
    assert real.json()["usage"]["completion_tokens"] == sim.json()["usage"]["completion_tokens"] == tokens


def events_of(chunks: list[bytes]) -> list[dict[str, Any]]:
    """Framing rules both servers follow; returns the JSON events (without [DONE])."""
    assert chunks[-1] == b"data: [DONE]\n\n"
    for chunk in chunks:  # one event per HTTP chunk, no `event:`/`id:` lines
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n\n") == 1, chunk
    return [json.loads(c[len(b"data: ") :]) for c in chunks[:-1]]


def by_kind(case: str, events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Representative events: chat's opening role event, a content event, the finishing event, the usage event."""
    out: dict[str, dict[str, Any]] = {}
    for i, event in enumerate(events):
        if not event["choices"]:
            out["usage"] = event
        elif event["choices"][0].get("finish_reason"):
            out["last"] = event
        elif case == "chat-stream" and i == 0:
            out["first"] = event
        else:
            out.setdefault("content", event)
    return out


STREAMS = {
    "chat-stream": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "completion-stream": (
        "/v1/completions",
        {"model": MODEL, "prompt": "import os\n", "max_tokens": 4, "ignore_eos": True, "stream": True},
    ),
}


@pytest.mark.parametrize("case", list(STREAMS))
def test_stream_framing_and_events(real_vllm: RealServer, sim_url: str, case: str) -> None:
    path, body = STREAMS[case]
    seen: dict[str, dict[str, dict[str, Any]]] = {}
    for side, url in (("real", real_vllm.url), ("sim", sim_url)):
        status, headers, chunks = raw_chunks(url, path, body)
        assert status == 200
        assert headers["content-type"] == "text/event-stream; charset=utf-8"
        events = events_of(chunks)
        kinds = by_kind(case, events)
        if case == "chat-stream":
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, side
            assert kinds["usage"]["usage"]["completion_tokens"] == 4, side
            assert "usage" not in kinds["last"] or kinds["last"]["usage"] is None
        else:
            assert "usage" not in kinds, side  # not asked for: no usage event
        seen[side] = kinds
    assert seen["real"].keys() == seen["sim"].keys()
    diffs: set[str] = set()
    for kind_ in seen["real"]:
        diffs |= shape_diff(f"{case} {kind_}", seen["real"][kind_], seen["sim"][kind_])
    assert_listed(diffs, KNOWN_STREAM, f"{case} ")


BAD_REQUESTS = [
    ("unknown model", "/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 2}),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}),
    (
        "prompt over max-model-len, streaming",
        "/v1/completions",
        {"model": MODEL, "prompt": "hello world " * 400, "max_tokens": 2, "stream": True},
    ),
    ("chat without messages", "/v1/chat/completions", {"model": MODEL}),
    ("prompt of the wrong type", "/v1/completions", {"model": MODEL, "prompt": 5}),
    (
        "temperature not a number",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 1, "temperature": "hot"},
    ),
    ("n = 0", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}),
    (
        "max_tokens over max-model-len",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 1000},
    ),
    (
        "min_tokens over max_tokens",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 5},
    ),
    *[
        (f"{name} {value}", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, name: value})
        for name, value in (
            ("temperature", -5),
            ("temperature", 2.5),
            ("temperature", 2),
            ("top_p", 0),
            ("top_k", -5),
            ("top_k", -1),
            ("min_p", 2),
            ("presence_penalty", 5),
            ("frequency_penalty", -3),
            ("repetition_penalty", 0),
            ("logprobs", 21),
            ("logprobs", 20),
            ("logprobs", -1),
            ("logprobs", -5),
        )
    ],
    (
        "chat top_logprobs without logprobs",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 2, "top_logprobs": 3},
    ),
    (
        "chat top_logprobs over 20",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 21},
    ),
    (
        "chat top_logprobs -1",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": -1},
    ),
    (
        "chat top_logprobs -5 without logprobs",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 2, "top_logprobs": -5},
    ),
    # max_completion_tokens counts when sent (0 included) and names itself when over max-model-len
    *[
        (f"chat {extra}", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, **extra})
        for extra in (
            {"max_completion_tokens": 0},
            {"max_completion_tokens": 0, "max_tokens": 5},
            {"max_completion_tokens": 600},
            {"n": 2, "temperature": 0},
        )
    ],
    # types vLLM's pydantic models refuse, and empty or context-filling prompts
    *[
        (
            f"completions {label}",
            "/v1/completions",
            {"model": MODEL, "max_tokens": 2, "prompt": "hi", **extra},
        )
        for label, extra in (
            ("n 2 at temperature 0", {"n": 2, "temperature": 0}),
            ("stop 5", {"stop": 5}),
            ("top_k 1.5", {"top_k": 1.5}),
            ("seed 1.5", {"seed": 1.5}),
            ("response_format of an unknown type", {"response_format": {"type": "nope"}}),
            ("stream maybe", {"stream": "maybe"}),
            ("prompt []", {"prompt": []}),
            ("prompt [[]]", {"prompt": [[]]}),
            ('prompt [""]', {"prompt": [""]}),
            # max_tokens clamped to 0
            ("prompt of exactly max-model-len token ids", {"prompt": list(range(5, 517))}),
            # max_tokens is checked before the prompt's length
            (
                "prompt and max_tokens both over max-model-len",
                {"prompt": list(range(5, 605)), "max_tokens": 600},
            ),
        )
    ],
    ("chat messages []", "/v1/chat/completions", {"model": MODEL, "messages": []}),
    # tools: the simulator answers as a vLLM without a tool-call parser (the default)
    *[
        (f"chat {name}", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra})
        for name, extra in (
            ("tools without tool_choice", {"tools": [TOOL]}),
            ("tool_choice auto", {"tools": [TOOL], "tool_choice": "auto"}),
            ("tool_choice required", {"tools": [TOOL], "tool_choice": "required"}),
            (
                "tool_choice named",
                {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            ),
            ("tool_choice none", {"tools": [TOOL], "tool_choice": "none"}),
            ("tool_choice null", {"tools": [TOOL], "tool_choice": None}),
            ("tool_choice without tools", {"tool_choice": "required"}),
            ("empty tools", {"tools": []}),
            ("tool without function", {"tools": [{"type": "function"}]}),
            ("tool_choice unknown", {"tools": [TOOL], "tool_choice": "sometimes"}),
            ("user not a string", {"user": 5}),
            ("logit_bias not numbers", {"logit_bias": {"a": "b"}}),
            ("logit_bias", {"logit_bias": {"5": 1.0}}),
            ("tools with max_tokens over the context", {"tools": [TOOL], "max_tokens": 100_000}),
        )
    ],
    (
        "completion user not a string",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": 5},
    ),
    # the tiny model's vocabulary is 2,048 ids (the fixture catalog's vocab_size)
    ("token id out of vocabulary", "/v1/completions", {"model": MODEL, "prompt": [5, 2048], "max_tokens": 2}),
    ("token id past 2^32", "/v1/completions", {"model": MODEL, "prompt": [2**32], "max_tokens": 2}),
    (
        "last token id of the vocabulary",
        "/v1/completions",
        {"model": MODEL, "prompt": [2047], "max_tokens": 2},
    ),
    (
        "lone surrogate in a message",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2},
    ),
    # vLLM's tokenizer endpoints (the union of a completion form and a chat form)
    *[
        (f"{path} {label}", path, body)
        for path, label, body in (
            ("/tokenize", "without prompt or messages", {"model": MODEL}),
            ("/tokenize", "prompt not a string", {"model": MODEL, "prompt": 5}),
            ("/tokenize", "prompt of token ids", {"model": MODEL, "prompt": [1, 2]}),
            ("/tokenize", "messages not a list", {"model": MODEL, "messages": 5}),
            ("/tokenize", "messages []", {"model": MODEL, "messages": []}),
            ("/tokenize", "unknown model", {"model": "nope", "prompt": "hi"}),
            ("/tokenize", "no model", {"prompt": "hi"}),
            ("/tokenize", "messages and prompt", {"model": MODEL, "messages": CHAT, "prompt": "hi"}),
            ("/detokenize", "tokens not a list", {"model": MODEL, "tokens": "abc"}),
            ("/detokenize", "without tokens", {"model": MODEL}),
            ("/detokenize", "unknown model", {"model": "nope", "tokens": [1]}),
            ("/detokenize", "id out of vocabulary", {"model": MODEL, "tokens": [99_999_999]}),
            ("/detokenize", "a negative id", {"model": MODEL, "tokens": [3, -1]}),
            ("/tokenize", "continue_final_message and add_generation_prompt",
             {"model": MODEL, "messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}),
            ("/tokenize", "continue_final_message with the default add_generation_prompt",
             {"model": MODEL, "messages": CHAT, "continue_final_message": True}),
        )
    ],
    ("allowed_token_ids []", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                 "allowed_token_ids": []}),
    ("allowed_token_ids out of vocabulary", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "max_tokens": 2, "allowed_token_ids": [5, 2048]}),
    ("allowed_token_ids in the vocabulary", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "max_tokens": 2, "allowed_token_ids": [5, 2047]}),
    ("prompt_embeds without the flag", "/v1/completions", {"model": MODEL, "prompt_embeds": "AAAA", "max_tokens": 2}),
]  # fmt: skip


def status_type_param(resp: httpx.Response) -> tuple[int, str | None, str | None]:
    if resp.status_code == 200:
        return (200, None, None)
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == resp.status_code
    return (resp.status_code, error["type"], error["param"])


@pytest.mark.parametrize(("case", "path", "body"), BAD_REQUESTS, ids=[c for c, _, _ in BAD_REQUESTS])
def test_error_status_type_param(
    real_vllm: RealServer, sim_url: str, case: str, path: str, body: dict[str, Any]
) -> None:
    # json.dumps escapes a lone surrogate as \ud800 (httpx's json= would fail to encode it)
    real, sim = both(
        real_vllm,
        sim_url,
        "POST",
        path,
        content=json.dumps(body),
        headers={"content-type": "application/json"},
    )
    a, b = status_type_param(real), status_type_param(sim)
    assert_listed(set() if a == b else {f"{case}: {a} vs {b}"}, KNOWN_ERRORS, f"{case}: ")


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("malformed JSON", {"content": b'{"model": ', "headers": {"content-type": "application/json"}}),
        (
            "no JSON content type",
            {
                "content": json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                "headers": {"content-type": "text/plain"},
            },
        ),
        ("no body", {"content": b"", "headers": {"content-type": "application/json"}}),
        ("JSON null", {"content": b"null", "headers": {"content-type": "application/json"}}),
        ("a JSON list", {"content": b"[1, 2]", "headers": {"content-type": "application/json"}}),
        (
            "a space before the media type's parameter",
            {
                "content": json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                "headers": {"content-type": "application/json ;charset=utf-8"},
            },
        ),
    ],
)
def test_unparseable_bodies(real_vllm: RealServer, sim_url: str, case: str, kwargs: dict[str, Any]) -> None:
    """FastAPI's reading of the body, before any field: the same status, type, param and message."""
    real, sim = both(real_vllm, sim_url, "POST", "/v1/completions", **kwargs)
    a, b = status_type_param(real), status_type_param(sim)
    assert a[0] == 400 and a[1] == "Bad Request"
    assert_listed(set() if a == b else {f"{case}: {a} vs {b}"}, KNOWN_ERRORS, f"{case}: ")
    assert real.json()["error"]["message"] == sim.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"model": MODEL, "prompt": "def route(request):"}),
        ("/tokenize", {"model": MODEL, "prompt": "def route(request):", "return_token_strs": True}),
        ("/tokenize", {"model": MODEL, "prompt": ""}),
        ("/tokenize", {"model": MODEL, "messages": CHAT}),
        ("/tokenize", {"model": MODEL, "messages": CHAT, "add_generation_prompt": False}),
        ("/detokenize", {"model": MODEL, "tokens": []}),
        ("/detokenize", {"model": MODEL, "tokens": [99_999_999]}),
    ],
)
def test_tokenizer_answers(real_vllm: RealServer, sim_url: str, path: str, body: dict[str, Any]) -> None:
    """The same fields with the same types (the ids differ: the simulator has no tokenizer); no token for an
    empty prompt; the chat form's count is the prompt_tokens its chat completion is charged, on both; an id
    outside the vocabulary detokenizes to nothing."""
    real, sim = both(real_vllm, sim_url, "POST", path, json=body)
    assert real.status_code == sim.status_code == 200
    a, b = real.json(), sim.json()
    assert {k: type(v) for k, v in a.items()} == {k: type(v) for k, v in b.items()}
    if path == "/detokenize":
        assert a == b == {"prompt": ""}
        return
    assert a["max_model_len"] == b["max_model_len"] == 512
    for answer in (a, b):
        assert answer["count"] == len(answer["tokens"])
        if body.get("return_token_strs"):
            assert len(answer["token_strs"]) == answer["count"]
    if body.get("prompt") == "":
        assert a["count"] == b["count"] == 0
    if "messages" in body and body.get("add_generation_prompt", True):
        for url, answer in ((real_vllm.url, a), (sim_url, b)):
            chat = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60)
            assert chat.json()["usage"]["prompt_tokens"] == answer["count"]


def test_unknown_path_is_plain_404(real_vllm: RealServer, sim_url: str) -> None:
    real, sim = both(real_vllm, sim_url, "GET", "/v1/no-such-path")
    assert (real.status_code, real.json()) == (sim.status_code, sim.json()) == (404, {"detail": "Not Found"})


def families(url: str) -> dict[str, tuple[str, frozenset[str], tuple[str, ...]]]:
    """vllm:* family → (type, label names, histogram bucket bounds)."""
    with httpx.Client(timeout=30) as http:
        resp = http.get(f"{url}/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(resp.text):
        if not fam.name.startswith("vllm:") or fam.name.endswith("_created"):
            continue
        labels = frozenset(k for s in fam.samples for k in s.labels if k != "le")
        buckets = tuple(dict.fromkeys(s.labels["le"] for s in fam.samples if "le" in s.labels))
        out[fam.name] = (fam.type, labels, buckets)
    return out


def test_metric_families_and_labels(real_vllm: RealServer, sim_url: str) -> None:
    real, sim = families(real_vllm.url), families(sim_url)
    diffs: set[str] = set()
    for name in CORE_FAMILIES:
        assert name in real and name in sim, name
        (rtype, rlabels, rbuckets), (stype, slabels, sbuckets) = real[name], sim[name]
        assert rtype == stype, name
        if name == "vllm:cache_config_info":  # the labels the gateway reads capacity from
            assert {"engine", "block_size", "num_gpu_blocks"} <= rlabels & slabels
            if slabels - rlabels:
                diffs.add(f"{name} extra label {','.join(sorted(slabels - rlabels))}")
            if rlabels - slabels:
                diffs.add(f"{name} missing labels")
            continue
        assert rlabels == slabels, name
        if rbuckets != sbuckets:
            diffs.add(f"{name} buckets")
    assert_listed(diffs, KNOWN_METRIC_LABELS, "")
    family_diffs = {f"{n}: present vs absent" for n in real.keys() - sim.keys()}
    family_diffs |= {f"{n}: absent vs present" for n in sim.keys() - real.keys()}
    assert_listed(family_diffs, KNOWN_METRIC_FAMILIES, "")


def iteration_tokens(url: str) -> tuple[float, float]:
    """(sum, count) of `vllm:iteration_tokens_total`."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:iteration_tokens_total"]
    values = {s.name: s.value for s in fam.samples}
    return values["vllm:iteration_tokens_total_sum"], values["vllm:iteration_tokens_total_count"]


def test_iteration_tokens_and_metrics_by_post(real_vllm: RealServer, sim_url: str) -> None:
    """`vllm:iteration_tokens_total` observes each step with outputs: the prompt computed at its first token
    plus the tokens generated (10 + 1, then 1 per decode), on both; and /metrics answers POST as GET."""
    body = {"model": MODEL, "prompt": list(range(300, 310)), "max_tokens": 5, "ignore_eos": True}
    deltas = []
    for url in (real_vllm.url, sim_url):
        before = iteration_tokens(url)
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        after = iteration_tokens(url)
        deltas.append((after[0] - before[0], after[1] - before[1]))
    assert deltas[0] == deltas[1] == (10 + 5, 5)
    real, sim = both(real_vllm, sim_url, "POST", "/metrics")
    assert real.status_code == sim.status_code == 200
    assert "vllm:iteration_tokens_total" in real.text and "vllm:iteration_tokens_total" in sim.text


MULTI = {  # case → (path, body, shape case); token-id prompts: both count the same prompt tokens
    "completions batch of 2 × n 2": (
        "/v1/completions",
        {"model": MODEL, "prompt": [[5, 6, 7, 8], [9, 10, 11]], "n": 2, "max_tokens": 3, "ignore_eos": True},
        "completion",
    ),
    "chat n 3": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "n": 3, "max_tokens": 3, "ignore_eos": True},
        "chat",
    ),
}


def event_kind(event: dict[str, Any]) -> tuple[int, str]:
    if not event["choices"]:
        return (-1, "usage")
    (choice,) = event["choices"]  # one choice per event on both
    if (choice.get("delta") or {}).get("role"):
        return (choice["index"], "role")
    return (choice["index"], "last" if choice.get("finish_reason") else "token")


LOGPROBS = {  # greedy on both, so vLLM's sampled token is its top one, as the simulator's always is
    "completion": ("/v1/completions", {"prompt": "def route(request):", "logprobs": 3}),
    "completion k=0": ("/v1/completions", {"prompt": "def route(request):", "logprobs": 0}),
    "chat": ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 3}),
    "chat no top": ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}),
}


def logprob_counts(body: dict[str, Any]) -> list[int]:
    """Candidates listed per token of the first choice."""
    lp = body["choices"][0]["logprobs"]
    return (
        [len(e["top_logprobs"]) for e in lp["content"]]
        if "content" in lp
        else list(map(len, lp["top_logprobs"]))
    )


@pytest.mark.parametrize("case", list(LOGPROBS))
def test_logprobs_shape(real_vllm: RealServer, sim_url: str, case: str) -> None:
    """The `logprobs` objects, whole and per streamed token: the same fields and kinds, the same number of
    candidates per token (the sampled token and the top k; chat lists the first k), tokens that spell the
    text and (completions) offsets into it."""
    path, extra = LOGPROBS[case]
    body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "temperature": 0, **extra}
    real, sim = both(real_vllm, sim_url, "POST", path, json=body)
    assert real.status_code == sim.status_code == 200, (real.text, sim.text)
    diffs = shape_diff(case, token_keyed(real.json()), token_keyed(sim.json()))
    assert not {d for d in diffs if ".logprobs" in d}, diffs
    assert logprob_counts(real.json()) == logprob_counts(sim.json())
    for side in (real.json(), sim.json()):
        choice, lp = side["choices"][0], side["choices"][0]["logprobs"]
        tokens = [e["token"] for e in lp["content"]] if "content" in lp else lp["tokens"]
        assert "".join(tokens) == (choice["message"]["content"] if "message" in choice else choice["text"])
        if "text_offset" in lp:
            assert lp["text_offset"] == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    events = {}
    for side, url in (("real", real_vllm.url), ("sim", sim_url)):
        status, _, chunks = raw_chunks(url, path, {**body, "stream": True})
        assert status == 200
        token_events = [e for e in events_of(chunks) if e["choices"] and e["choices"][0]["logprobs"]]
        # 4 tokens' logprobs; a loaded vLLM may send two tokens in one event (its output processor behind the
        # engine: seen in CI, 3 events for 4 tokens), each event then listing both tokens' entries
        assert sum(logprob_counts_of_event(e) for e in token_events) == 4, side
        assert 2 <= len(token_events) <= 4, side
        events[side] = token_events[1]  # a middle event: completions' text_offset continues the text
        if "text_offset" in token_events[1]["choices"][0]["logprobs"]:
            offsets = [e["choices"][0]["logprobs"]["text_offset"][0] for e in token_events]
            texts = [e["choices"][0]["text"] for e in token_events]
            assert offsets == [sum(map(len, texts[:i])) for i in range(len(texts))], side
    diffs = shape_diff(case, token_keyed(events["real"]), token_keyed(events["sim"]))
    assert not {d for d in diffs if ".logprobs" in d}, diffs


def logprob_counts_of_event(event: dict[str, Any]) -> int:
    """Tokens whose logprobs one streamed event carries (chat: `content` entries; completions: `tokens`)."""
    lp = event["choices"][0]["logprobs"]
    return len(lp["content"]) if "content" in lp else len(lp["tokens"])


@pytest.mark.parametrize("case", list(MULTI))
def test_several_sequences(real_vllm: RealServer, sim_url: str, case: str) -> None:
    """A batch of prompts and n > 1, whole and streamed: the same choices (index, finish reason), the same
    usage (each prompt once, every completion's tokens), one choice per event, chat's role events first."""
    path, body, shape = MULTI[case]
    real, sim = both(real_vllm, sim_url, "POST", path, json=body)
    assert real.status_code == sim.status_code == 200, (real.text, sim.text)
    for side in (real.json(), sim.json()):
        assert [(c["index"], c["finish_reason"]) for c in side["choices"]] == [
            (i, "length") for i in range(len(side["choices"]))
        ]
    assert len(real.json()["choices"]) == len(sim.json()["choices"])
    usage = {
        k: real.json()["usage"][k] == sim.json()["usage"][k] for k in ("completion_tokens", "prompt_tokens")
    }
    assert usage == {"completion_tokens": True, "prompt_tokens": True} or (
        shape == "chat" and usage["completion_tokens"]  # chat templates tokenise differently
    )
    assert shape_diff(shape, real.json(), sim.json()) <= KNOWN_BODY.keys()
    streamed = {}
    for side, url in (("real", real_vllm.url), ("sim", sim_url)):
        status, _, chunks = raw_chunks(
            url, path, {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert status == 200
        kinds = [event_kind(e) for e in events_of(chunks)]
        if shape == "chat":
            assert kinds[: body["n"]] == [(i, "role") for i in range(body["n"])], side
        usage_event = events_of(chunks)[-1]["usage"]
        streamed[side] = (sorted(kinds), usage_event["completion_tokens"])
    assert streamed["real"] == streamed["sim"]


def test_request_id_header_and_head(real_vllm: RealServer, sim_url: str) -> None:
    """The response id is `cmpl-` + X-Request-Id, a stream's chunks carry it too, a lax boolean (`stream:
    "true"`) streams; HEAD /health is 405 on both."""
    headers = {"X-Request-Id": "fidelity-1"}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    real, sim = both(real_vllm, sim_url, "POST", "/v1/completions", json=body, headers=headers)
    assert real.json()["id"] == sim.json()["id"] == "cmpl-fidelity-1"
    real, sim = both(
        real_vllm, sim_url, "POST", "/v1/completions", json={**body, "stream": "true"}, headers=headers
    )
    for resp in (real, sim):
        events = [json.loads(e[len("data: ") :]) for e in resp.text.split("\n\n") if e.startswith("data: {")]
        assert len(events) == 2 and {e["id"] for e in events} == {"cmpl-fidelity-1"}
    real, sim = both(real_vllm, sim_url, "HEAD", "/health")
    assert real.status_code == sim.status_code == 405


def test_cors_preflight_and_answer_headers(real_vllm: RealServer, sim_url: str) -> None:
    """vLLM always runs Starlette's CORS middleware, by default with no origin allowed (0.32: cross-origin
    browser access off), every method and header: a browser's preflight is refused (400) and a cross-origin
    answer carries no Access-Control-Allow-Origin, on the simulator as on vLLM."""
    preflight = {
        "Origin": "https://chat.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    cors = ("access-control-allow-origin", "access-control-allow-methods", "access-control-allow-headers",
            "access-control-allow-credentials", "access-control-max-age", "vary")  # fmt: skip
    real, sim = both(real_vllm, sim_url, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert real.status_code == sim.status_code == 400
    assert real.text == sim.text == "Disallowed CORS origin"
    assert {h: real.headers.get(h) for h in cors} == {h: sim.headers.get(h) for h in cors}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    real, sim = both(
        real_vllm, sim_url, "POST", "/v1/completions", json=body, headers={"Origin": "https://a.b"}
    )
    assert real.status_code == sim.status_code == 200
    assert {h: real.headers.get(h) for h in cors} == {h: sim.headers.get(h) for h in cors}
    assert "access-control-allow-origin" not in sim.headers


RESPONSES_REFUSED = {
    "empty input": {"input": [], "max_output_tokens": 4},
    "unknown text format": {"input": "hi", "max_output_tokens": 4, "text": {"format": {"type": "bogus"}}},
    "json_schema format without its schema": {
        "input": "hi",
        "max_output_tokens": 4,
        "text": {"format": {"type": "json_schema"}},
    },
}


@pytest.mark.parametrize("case", list(RESPONSES_REFUSED))
def test_responses_refusals_are_vllms_byte_for_byte(real_vllm: RealServer, sim_url: str, case: str) -> None:
    """The simulated worker answered `input: []` with its own message and accepted any `text.format`."""
    real, sim = both(
        real_vllm, sim_url, "POST", "/v1/responses", json={"model": MODEL, **RESPONSES_REFUSED[case]}
    )
    assert real.status_code == sim.status_code == 400
    assert sim.json() == real.json()


@pytest.mark.parametrize(
    "text",
    [
        {"format": {"type": "text"}},
        {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
        {"format": {"type": "json_object"}},
        {"verbosity": "low"},
    ],
)
def test_responses_echo_the_text_config_as_vllm(
    real_vllm: RealServer, sim_url: str, text: dict[str, Any]
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "text": text}
    real, sim = both(real_vllm, sim_url, "POST", "/v1/responses", json=body)
    assert real.status_code == sim.status_code == 200
    assert sim.json()["text"] == real.json()["text"]
