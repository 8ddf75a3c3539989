"""End to end over real sockets: the `openai` SDK → gateway (uvicorn on 127.0.0.1) → embedded simulated fleet
(`server.embedded.default_config`: prefill H100, decode A100, mixed L4) at a large time scale."""

from __future__ import annotations

import collections.abc
import json
import re
from typing import Any

import httpx
import openai
import pytest

from server.embedded import default_config
from tests.gateway.serverkit import GatewayThread

MODEL = "llama-3-8b"
LONG = "lorem ipsum " * 200  # 2,400 chars → ceil(2400/4) + 3 + 3 = 606 estimated tokens ≥ 256: P/D path


@pytest.fixture(scope="module")
def gw() -> collections.abc.Iterator[GatewayThread]:
    cfg = default_config(time_scale=500.0, limits={"max_body_bytes": 65536, "queue_deadline_s": 2})
    with GatewayThread(cfg) as thread:
        yield thread


@pytest.fixture
def client(gw: GatewayThread) -> collections.abc.Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _ask(content: str = "Hello!") -> list[Any]:
    return [{"role": "user", "content": content}]


def test_models_lists_the_fleet(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_with_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=_ask(), max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=[1, 2, 3, 4], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, 5)
    assert len(r.choices[0].text.split()) == 5  # one pseudo-word per token


def test_streaming_chat_with_and_without_usage(client: openai.OpenAI, gw: GatewayThread) -> None:
    before = gw.metric("mosaic_generation_tokens_total", model=MODEL)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=_ask(), max_tokens=6, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert all(c.usage is None for c in chunks)  # injected upstream, stripped here
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 6
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=_ask(),
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    )
    # both streams' tokens were counted at the gateway: 6 + 6
    assert gw.metric_reaches("mosaic_generation_tokens_total", before + 12, model=MODEL) - before == 12


def test_streams_name_their_worker_once_the_gateway_has_learned_its_fingerprint(
    client: openai.OpenAI, gw: GatewayThread
) -> None:
    """The simulated workers name themselves as vLLM 0.32 does: on the usage event the gateway asks for and
    drops. The relay learns each worker's fingerprint from it and puts it on the last chunk of that worker's
    later streams, which a client that asked for no usage gets from vLLM direct (a worker's first stream
    through the gateway goes without)."""
    named_streams = 0
    for _ in range(6):
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=_ask("Who are you?"),
                max_tokens=3,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        named = [c for c in chunks if c.system_fingerprint]
        assert named in ([], [chunks[-1]]) and chunks[-1].choices[0].finish_reason == "length"
        named_streams += bool(named)
        learned = {
            json.loads(r.system_fingerprint) for r in gw.gateway.registry.records() if r.system_fingerprint
        }
        assert {c.system_fingerprint for c in named} <= learned
        assert all(re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", f) for f in learned)
    # at most one unnamed stream per worker that serves short prompts (2 L4, 2 A100)
    assert named_streams >= 6 - 4


def test_pd_path_end_to_end(client: openai.OpenAI, gw: GatewayThread) -> None:
    prefill = gw.gateway.registry.get("prefill-h100/sim-0")
    assert prefill is not None
    before = prefill.dispatched_total
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_ask(LONG),
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert prefill.dispatched_total == before + 1  # the prefill hop went to the H100
    assert (
        gw.metric_reaches("mosaic_time_to_first_token_seconds_count", 1, model=MODEL, pool="decode-a100") >= 1
    )


@pytest.mark.parametrize("content", ["Hello!", LONG], ids=["direct", "prefill-decode"])
def test_logprobs_reach_the_client_on_every_path(
    client: openai.OpenAI, gw: GatewayThread, content: str
) -> None:
    """Each streamed token carries its logprobs through the gateway, on one worker and across a P/D pair (the
    decode side answers), and the gateway still counts one token per event."""
    before = gw.metric("mosaic_generation_tokens_total", model=MODEL)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=_ask(content), max_tokens=5, stream=True, logprobs=True, top_logprobs=2,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    tokens = [c for c in chunks if c.choices and c.choices[0].delta.content]
    entries = [c.choices[0].logprobs.content[0] for c in tokens if c.choices[0].logprobs]  # type: ignore[index]
    assert [e.token for e in entries] == [c.choices[0].delta.content for c in tokens] and len(entries) == 5
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)
    assert gw.metric_reaches("mosaic_generation_tokens_total", before + 5, model=MODEL) == before + 5


def test_a_batch_with_n_completions_each_is_served_in_one_hop(
    client: openai.OpenAI, gw: GatewayThread
) -> None:
    """A completions batch of two long prompts with n = 2: four choices from one decode worker, no prefill
    hop (vLLM's prefill answer carries one sequence's KV)."""
    prefill = gw.gateway.registry.get("prefill-h100/sim-0")
    assert prefill is not None
    before = prefill.dispatched_total
    r = client.completions.create(
        model=MODEL, prompt=[LONG, LONG + " Again."], n=2, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage is not None and r.usage.completion_tokens == 4 * 3
    assert prefill.dispatched_total == before


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        pytest.param(
            {"model": "no-such-model", "messages": _ask()},
            openai.NotFoundError,
            id="unknown model → 404 NotFoundError",
        ),
        pytest.param(
            {"model": MODEL, "messages": []},
            openai.BadRequestError,
            id="empty messages → 400 BadRequestError",
        ),
        pytest.param(
            {"model": MODEL, "messages": _ask(), "max_tokens": -1},
            openai.BadRequestError,
            id="max_tokens -1 → the worker's 400 passes through",
        ),
        pytest.param(
            {"model": MODEL, "messages": _ask("x" * 70000)},
            openai.APIStatusError,
            id="body over max_body_bytes → 413",
        ),
    ],
)
def test_errors_map_to_client_exceptions(
    client: openai.OpenAI, kwargs: dict[str, Any], exc: type[Exception]
) -> None:
    with pytest.raises(exc) as err:
        client.chat.completions.create(**kwargs)
    assert isinstance(err.value, openai.APIStatusError)
    if exc is openai.APIStatusError:
        assert err.value.status_code == 413
    body = err.value.body
    assert isinstance(body, dict) and {"message", "type"} <= set(body)  # the SDK hands over body["error"]


@pytest.mark.parametrize("content", ["Hello!", LONG], ids=["single", "pd"])
def test_continuous_usage_reaches_the_client_only_with_include_usage(
    client: openai.OpenAI, gw: GatewayThread, content: str
) -> None:
    """With both options every chunk carries the usage so far, as from vLLM; with continuous_usage_stats
    alone none does (vLLM ignores it without include_usage), though the gateway asks for usage upstream."""
    before = gw.metric("mosaic_generation_tokens_total", model=MODEL)
    streams = {}
    for include in (True, False):
        streams[include] = list(
            client.chat.completions.create(
                model=MODEL,
                messages=_ask(content),
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": include, "continuous_usage_stats": True},
                extra_body={"ignore_eos": True},
            )
        )
    with_usage = [c.usage.completion_tokens for c in streams[True] if c.choices and c.usage]
    assert with_usage[-5:] == [1, 2, 3, 4, 5] and streams[True][-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in streams[False])
    assert gw.metric_reaches("mosaic_generation_tokens_total", before + 10, model=MODEL) - before == 10


def test_prompt_over_context_is_400_even_when_streaming(gw: GatewayThread) -> None:
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        r = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": [7] * 9000, "max_tokens": 4, "stream": True}
        )
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("content", ["Hello!", LONG], ids=["mixed", "pd"])
def test_a_client_may_not_steer_kv_transfers(client: openai.OpenAI, content: str) -> None:
    """kv_transfer_params reached mixed and decode workers as sent: a client could make a worker hold KV
    blocks outside the ledger (do_remote_decode) or pull KV from any host (do_remote_prefill)."""
    params = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 5600}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=_ask(content), max_tokens=2, extra_body={"kv_transfer_params": params}
        )
    assert err.value.body == {
        "message": "'kv_transfer_params' is set by the gateway for prefill/decode disaggregation; "
        "clients may not send it",
        "type": "BadRequestError",
        "param": "kv_transfer_params",
        "code": 400,
    }


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        (None, 400),
        ("text/plain", 400),
        ("application/x-www-form-urlencoded", 400),
        ("application/json-patch+json", 400),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
    ],
)
def test_only_a_json_media_type_is_served_as_vllm_does(
    gw: GatewayThread, content_type: str | None, status: int
) -> None:
    """The gateway forwards bodies as JSON, so without this check a text/plain body vLLM refuses was served."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    refused_before = gw.metric_reaches("mosaic_rejections_total", 0.0, reason="bad_request")
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        r = http.post(
            "/v1/completions",
            content=body,
            headers={} if content_type is None else {"content-type": content_type},
        )
    assert r.status_code == status, r.text
    if status == 400:
        err = r.json()["error"]
        assert err == {
            "message": "Unsupported Media Type: Only 'application/json' is allowed",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        assert (
            gw.metric_reaches("mosaic_rejections_total", refused_before + 1, reason="bad_request")
            == refused_before + 1
        )
    else:
        assert r.json()["usage"]["completion_tokens"] == 2


def test_a_request_without_model_is_served_by_the_only_model(gw: GatewayThread) -> None:
    """vLLM serves its one model when the body names none (absent, null or ""); so does a one-model gateway,
    forwarding the client's bytes as they are."""
    for extra in ({}, {"model": None}, {"model": ""}):
        r = httpx.post(
            gw.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True, **extra}
        )
        assert (r.status_code, r.json()["model"], r.json()["usage"]["completion_tokens"]) == (200, MODEL, 2)


@pytest.mark.parametrize("stream", [False, True])
def test_a_body_with_a_utf8_byte_order_mark_is_served(gw: GatewayThread, stream: bool) -> None:
    """Some Windows clients prefix a BOM; vLLM's json.loads accepts it, and so does the gateway (it was a 400
    "not valid JSON"), forwarding the bytes as sent, or spliced for usage on a stream."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True, "stream": stream}
    r = httpx.post(
        gw.url + "/v1/completions",
        content=b"\xef\xbb\xbf" + json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.endswith("data: [DONE]\n\n") and r.text.count('"text"') == 3
    else:
        assert r.json()["usage"]["completion_tokens"] == 3


def test_unknown_path_is_404_in_openai_shape(gw: GatewayThread) -> None:
    with httpx.Client(base_url=gw.url) as http:
        r = http.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_wrong_method_is_405_in_openai_shape_with_its_own_code(gw: GatewayThread) -> None:
    with httpx.Client(base_url=gw.url) as http:
        r = http.get("/v1/chat/completions")
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "MethodNotAllowedError" and r.json()["error"]["code"] == 405


def test_health_ready_metrics_admin(gw: GatewayThread) -> None:
    with httpx.Client(base_url=gw.url) as http:
        assert http.get("/health").json() == {"status": "ok"}
        ready = http.get("/ready")
        assert ready.status_code == 200 and ready.json()["ready_workers"] == {MODEL: 5}
        text = http.get("/metrics").text
        for name in (
            "mosaic_requests_total",
            "mosaic_time_to_first_token_seconds_bucket",
            "mosaic_worker_inflight_requests",
            "mosaic_admission_queue_depth",
            "mosaic_worker_scrape_age_seconds",
        ):
            assert name in text
        workers = http.get("/admin/workers").json()["workers"]
        assert {w["gpu"] for w in workers} == {"H100-SXM", "A100-80GB", "L4"}
        assert all(
            w["stats"]["num_gpu_blocks"] == w["capacity"]["kv_blocks"] for w in workers
        )  # scraped = modelled
        assert http.get("/admin/routing").json()["router"]["policy"] == "mosaic"
