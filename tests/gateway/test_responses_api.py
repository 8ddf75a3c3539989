"""OpenAI's Responses API through the gateway (`POST /v1/responses`, `GET /v1/responses/{id}`, cancel): fake
vLLM workers speaking vLLM 0.32's framing (`tests/gateway/fakes.py`, from a real server's bytes) behind
`httpx.MockTransport`, the gateway in-process; the `openai` SDK on top for the client's view. Every test
ends through `test_faults.gateway`, which asserts every in-flight ticket and KV reservation was released
exactly once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from server.footprint import parse_request, route_request, with_context
from server.response_store import ResponseAffinity
from server.responses_api import ResponsesRelay
from tests.gateway.fakes import FIXTURES, FakeFleet, FakeWorker, config, pd_config, pool
from tests.gateway.test_faults import LONG_PROMPT, RR, gateway, metric, run

RESPONSES = "/v1/responses"
MODEL = "llama-3-8b"


def ask(text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": text, "max_output_tokens": 4, **extra}


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(type, data) of each event of a Responses stream."""
    out = []
    for raw in text.split("\n\n"):
        if raw:
            head, data = raw.split("\n", 1)
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def mixed(*workers: FakeWorker, **sections: Any) -> Any:
    return config(pool("p", "L4", "mixed", *workers), **sections)


# ---------------------------------------------------------------------------------------------- whole


def test_a_whole_answer_passes_through_with_usage_metered_and_its_worker_remembered() -> None:
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            sent = json.dumps(ask(max_output_tokens=5)).encode()
            r = await c.post(RESPONSES, content=sent, headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.headers["x-request-id"]
            answer = r.json()
            assert answer["object"] == "response" and answer["usage"]["output_tokens"] == 5
            assert a.paths == [RESPONSES] and a.raw_seen[0] == sent
            # the worker's usage (input_tokens/output_tokens) in the gateway's token counters
            assert metric(gw, "mosaic_prompt_tokens_total", model=MODEL) == 7
            assert metric(gw, "mosaic_generation_tokens_total", model=MODEL) == 5
            assert gw.dispatcher.outcomes == {"completed": 1}
            entry = gw.dispatcher.affinity.lookup(answer["id"], gw.clock())
            assert entry is not None and entry.worker_id == "p/a:8000"
            assert entry.context_tokens == 7 + 5  # what a continuation carries again

    run(body)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        pytest.param(
            "incomplete", "completed", id="incomplete at max_output_tokens → completed (finish 'length')"
        ),
        pytest.param("cancelled", "worker_error", id="cancelled by the worker → not a completion"),
        pytest.param("failed", "worker_error", id="failed → not a completion"),
        # `background: true`: the worker stored it and runs it on; not a worker error (it had been)
        pytest.param("queued", "backgrounded", id="queued → backgrounded"),
        pytest.param("in_progress", "backgrounded", id="in_progress → backgrounded"),
    ],
)
def test_a_whole_answers_status_decides_its_outcome(status: str, outcome: str) -> None:
    a = FakeWorker("a", responses_status=status)

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            r = await c.post(RESPONSES, json=ask())
            assert r.status_code == 200 and r.json()["status"] == status
            assert gw.dispatcher.outcomes == {outcome: 1}
            assert metric(gw, "mosaic_request_outcomes_total", model="llama-3-8b", outcome=outcome) == 1
            # the breaker hears no fault, and the lease is released (its KV is the worker's own from here)
            assert [r.breaker.failures for r in gw.registry.records()] == [0]
            assert gw.ledger is not None and not gw.ledger.active()

    run(body)


def test_a_whole_answer_that_is_no_json_is_retried_elsewhere() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")

    async def html(request: httpx.Request) -> httpx.Response:
        a.paths.append(request.url.path)
        return httpx.Response(200, text="<html>proxy</html>", headers={"content-type": "text/html"})

    a.handle = html  # type: ignore[method-assign]

    async def body() -> None:
        async with gateway(mixed(a, b, **RR), FakeFleet(a, b)) as (c, gw):
            for _ in range(2):
                r = await c.post(RESPONSES, json=ask())
                assert r.status_code == 200 and r.json()["object"] == "response"
            assert metric(gw, "mosaic_retries_total", model=MODEL, reason="not_json") >= 1

    run(body)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        pytest.param({"model": MODEL}, 400, "input", id="no input → 400 param input (vLLM: body.input)"),
        pytest.param({"model": MODEL, "input": 5}, 400, "input", id="input a number → 400 param input"),
        pytest.param(
            {"model": MODEL, "input": [1]},
            400,
            "input",
            id="input items that are no objects → 400 param input",
        ),
        pytest.param(
            {"model": MODEL, "input": "x", "max_output_tokens": "a"},
            400,
            "max_output_tokens",
            id="max_output_tokens a string → 400 param max_output_tokens",
        ),
        pytest.param(
            {"model": MODEL, "input": "x", "instructions": 3},
            400,
            "instructions",
            id="instructions a number → 400 param instructions",
        ),
        pytest.param(
            {"model": MODEL, "input": "x", "kv_transfer_params": {"do_remote_decode": True}},
            400,
            "kv_transfer_params",
            id="kv_transfer_params from a client → 400",
        ),
        pytest.param({"model": "gpt-x", "input": "x"}, 404, "model", id="unknown model → 404 param model"),
        pytest.param(
            {"model": MODEL, "input": "x", "previous_response_id": "resp_never"},
            404,
            "response_id",  # vLLM's param for an id it does not store
            id="previous_response_id the gateway never served → 404",
        ),
    ],
)
def test_bad_requests_are_refused_in_openai_shape(payload: dict[str, Any], status: int, param: str) -> None:
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, _):
            r = await c.post(RESPONSES, json=payload)
            assert r.status_code == status
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
            assert a.seen == []  # refused by the gateway, never sent

    run(body)


def test_a_worker_4xx_passes_through() -> None:
    a = FakeWorker("a", mode="status", status=400)

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            r = await c.post(RESPONSES, json=ask(stream=True))
            assert r.status_code == 400 and r.json()["error"]["code"] == 400
            assert gw.dispatcher.outcomes == {"worker_rejected": 1}

    run(body)


# ---------------------------------------------------------------------------------------------- streams


def test_a_stream_is_relayed_as_sent_and_measured_from_its_text_deltas() -> None:
    a = FakeWorker("a", chunk_delay_s=0.01)

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            sent = json.dumps(ask(stream=True, max_output_tokens=5)).encode()
            r = await c.post(RESPONSES, content=sent, headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            got = events(r.text)
            assert [k for k, _ in got] == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                *["response.output_text.delta"] * 5,
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
            assert "[DONE]" not in r.text  # Responses streams have none, and the gateway adds none
            assert a.raw_seen[0] == sent  # forwarded as sent: no stream_options added
            assert gw.dispatcher.outcomes == {"completed": 1}
            assert metric(gw, "mosaic_generation_tokens_total", model=MODEL) == 5
            assert metric(gw, "mosaic_prompt_tokens_total", model=MODEL) == 7
            labels = {"model": MODEL, "pool": "p"}
            assert metric(gw, "mosaic_time_to_first_token_seconds_count", **labels) == 1
            # one gap between consecutive text deltas: 5 deltas, 4 gaps (the other events are no tokens)
            assert metric(gw, "mosaic_inter_token_latency_seconds_count", **labels) == 4
            rid = got[0][1]["response"]["id"]
            entry = gw.dispatcher.affinity.lookup(rid, gw.clock())
            assert entry is not None and entry.worker_id == "p/a:8000" and entry.context_tokens == 12

    run(body)


def test_a_stream_cut_before_its_terminal_event_ends_with_an_error_event() -> None:
    a = FakeWorker("a", responses_terminal="")  # the body ends after output_item.done

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            r = await c.post(RESPONSES, json=ask(stream=True))
            kinds = [k for k, _ in events(r.text)]
            assert kinds[-2:] == ["response.output_item.done", "error"]
            error = events(r.text)[-1][1]
            assert (
                error["type"] == "error" and error["code"] == "502" and "terminal event" in error["message"]
            )
            assert error["sequence_number"] == len(kinds) - 1  # continues the worker's numbering
            assert gw.dispatcher.outcomes == {"worker_error": 1}
            assert gw.registry.get("p/a:8000").last_error == "stream_truncated"

    run(body)


def test_a_worker_dying_mid_stream_ends_it_with_an_error_event_and_no_retry() -> None:
    a = FakeWorker("a", mode="die_mid_stream", die_after=2)

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            r = await c.post(RESPONSES, json=ask(stream=True))
            got = events(r.text)
            assert [k for k, _ in got].count("response.output_text.delta") == 2
            assert got[-1][0] == "error" and got[-1][1]["error_type"] == "BadGatewayError"
            assert len(a.seen) == 1 and gw.dispatcher.outcomes == {"worker_error": 1}

    run(body)


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        pytest.param(500, "worker_error", id="a 5xx error event → worker_error"),
        pytest.param(400, "worker_rejected", id="a 4xx error event → worker_rejected"),
    ],
)
def test_a_workers_error_event_is_relayed_and_ends_the_stream(code: int, outcome: str) -> None:
    a = FakeWorker("a", mode="error_mid_stream", error_code=code, die_after=1)

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            r = await c.post(RESPONSES, json=ask(stream=True))
            got = events(r.text)
            assert got[-1] == (
                "error",
                {
                    "type": "error",
                    "code": str(code),
                    "message": "engine died",
                    "param": None,
                    "sequence_number": 5,
                },
            )
            assert sum(k == "error" for k, _ in got) == 1  # the worker's own, nothing added
            assert gw.dispatcher.outcomes == {outcome: 1}

    run(body)


def test_a_client_leaving_mid_stream_closes_the_upstream_and_releases_once() -> None:
    a = FakeWorker("a", chunk_delay_s=0.05, tokens=50)

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            app = c._transport.app  # type: ignore[attr-defined]  # the gateway's ASGI app, called directly
            gone = asyncio.Event()
            payload = json.dumps(ask(stream=True, max_output_tokens=50)).encode()
            messages = [{"type": "http.request", "body": payload, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                if b"response.output_text.delta" in message.get("body", b""):
                    gone.set()  # the client hangs up after its first token

            scope = {
                "type": "http",
                "method": "POST",
                "path": RESPONSES,
                "headers": [(b"content-type", b"application/json")],
                "query_string": b"",
            }
            started = gw.clock()
            await app(scope, receive, send)
            assert gw.clock() - started < 1.0  # cut at once, not relayed to its end (50 × 0.05 s)
            assert gw.dispatcher.outcomes == {"client_disconnected": 1}

    run(body)


def test_a_long_prompt_never_takes_the_pd_path() -> None:
    """vLLM's Responses request has no prefill handover: single hop, on the decode worker, body unchanged."""
    prefill, decode = FakeWorker("pf"), FakeWorker("dc")

    async def body() -> None:
        async with gateway(pd_config(prefill, decode), FakeFleet(prefill, decode)) as (c, gw):
            for stream in (False, True):
                r = await c.post(RESPONSES, json=ask(LONG_PROMPT, stream=stream))
                assert r.status_code == 200
            assert prefill.seen == [] and len(decode.seen) == 2
            assert all("kv_transfer_params" not in b for b in decode.seen)
            assert gw.dispatcher.outcomes == {"completed": 2}

    run(body)


# ---------------------------------------------------------------------------------------------- affinity


def test_a_continuation_goes_only_to_the_worker_that_stored_its_response() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")

    async def body() -> None:
        async with gateway(mixed(a, b, **RR), FakeFleet(a, b)) as (c, gw):
            first = (await c.post(RESPONSES, json=ask())).json()
            owner, other = (a, b) if first["id"] in a.stored else (b, a)
            previous = first["id"]
            for i in range(4):  # round-robin would alternate; the pin does not
                stream = i % 2 == 1
                r = await c.post(
                    RESPONSES, json=ask(f"more {i}", previous_response_id=previous, stream=stream)
                )
                assert r.status_code == 200
                previous = events(r.text)[0][1]["response"]["id"] if stream else r.json()["id"]
            assert len(owner.seen) == 5 and other.seen == []
            assert gw.dispatcher.outcomes == {"completed": 5}

    run(body)


def test_a_continuation_whose_worker_fails_is_not_served_elsewhere() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")

    async def body() -> None:
        async with gateway(mixed(a, b, **RR), FakeFleet(a, b)) as (c, gw):
            first = (await c.post(RESPONSES, json=ask())).json()
            owner, other = (a, b) if first["id"] in a.stored else (b, a)
            seen_before = len(other.seen)
            owner.mode = "refuse"
            r = await c.post(RESPONSES, json=ask("more", previous_response_id=first["id"]))
            assert r.status_code == 502 and set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert len(other.seen) == seen_before  # no other worker has the stored response
            assert gw.dispatcher.outcomes == {"completed": 1, "failed_before_first_byte": 1}

    run(body)


def test_a_response_whose_worker_left_the_fleet_is_not_found() -> None:
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            gw.dispatcher.affinity.remember("resp_gone", "p/gone:8000", MODEL, 10, gw.clock())
            r = await c.post(RESPONSES, json=ask(previous_response_id="resp_gone"))
            # vLLM's own body for an id it does not store: one shape, whether the gateway or the worker answers
            assert r.status_code == 404 and r.json() == {
                "error": {
                    "message": "Response with id 'resp_gone' not found.",
                    "type": "invalid_request_error",
                    "param": "response_id",
                    "code": 404,
                }
            }
            assert gw.dispatcher.affinity.lookup("resp_gone", gw.clock()) is None  # forgotten
            assert (await c.get("/v1/responses/resp_gone")).status_code == 404
            assert gw.dispatcher.outcomes == {"rejected_not_found": 1}

    run(body)


def test_retrieve_and_cancel_reach_the_worker_that_stored_it() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")

    async def body() -> None:
        async with gateway(mixed(a, b, **RR), FakeFleet(a, b)) as (c, _):
            ids = [(await c.post(RESPONSES, json=ask(f"q{i}"))).json()["id"] for i in range(2)]
            for rid in ids:
                owner = a if rid in a.stored else b
                r = await c.get(f"/v1/responses/{rid}?starting_after=0")
                assert r.status_code == 200 and r.json() == owner.stored[rid]
                assert r.headers["x-request-id"]
                r = await c.post(f"/v1/responses/{rid}/cancel")
                assert r.status_code == 400  # vLLM's own answer for a synchronous response, passed through
                assert r.json()["error"]["message"] == "Cannot cancel a synchronous response."
                assert owner.paths[-2:] == [f"GET /v1/responses/{rid}", f"POST /v1/responses/{rid}/cancel"]
            r = await c.get("/v1/responses/resp_unknown")
            assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
            assert (await c.post("/v1/responses/resp_unknown/cancel")).status_code == 404

    run(body)


def test_stored_response_routes_need_an_api_key() -> None:
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(mixed(a, auth={"api_keys": ["k1"]}), FakeFleet(a)) as (c, _):
            assert (await c.get("/v1/responses/resp_x")).status_code == 401
            assert (await c.post("/v1/responses/resp_x/cancel")).status_code == 401
            r = await c.get("/v1/responses/resp_x", headers={"authorization": "Bearer k1"})
            assert r.status_code == 404

    run(body)


# ---------------------------------------------------------------------------------------------- the SDK


def test_the_openai_sdk_creates_streams_continues_and_retrieves() -> None:
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(mixed(a), FakeFleet(a)) as (c, gw):
            transport = c._transport  # type: ignore[attr-defined]
            http = httpx.AsyncClient(transport=transport, base_url="http://gw/v1")
            async with openai.AsyncOpenAI(
                base_url="http://gw/v1", api_key="unused", http_client=http, max_retries=0
            ) as client:
                r = await client.responses.create(model=MODEL, input="Hello", max_output_tokens=3)
                assert r.output_text == "w0 w1 w2" and r.usage is not None and r.usage.output_tokens == 3
                stream = await client.responses.create(
                    model=MODEL, input="Hi", instructions="be brief", max_output_tokens=2, stream=True
                )
                kinds = [event.type async for event in stream]
                assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
                assert kinds.count("response.output_text.delta") == 2
                more = await client.responses.create(
                    model=MODEL, input="more", max_output_tokens=2, previous_response_id=r.id
                )
                assert more.previous_response_id == r.id
                again = await client.responses.retrieve(r.id)
                assert again.id == r.id and again.output_text == r.output_text
                with pytest.raises(openai.NotFoundError):
                    await client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
                with pytest.raises(openai.BadRequestError):
                    await client.responses.create(model=MODEL, input=[1])  # type: ignore[list-item]
            assert gw.dispatcher.outcomes["completed"] == 3

    run(body)


# ---------------------------------------------------------------------------------------------- units


def test_the_prompt_is_estimated_as_chat_messages() -> None:
    body = {
        "model": MODEL,
        "instructions": "be brief",  # 8 chars → 2 tokens + 3
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello world!"}]},  # 12 → 3 + 3
            {"type": "function_call_output", "call_id": "c", "output": "abcd"},  # 4 → 1 + 3
        ],
    }
    parsed = parse_request("responses", json.dumps(body).encode(), {MODEL: 1000})
    assert parsed.prompt_tokens == (2 + 3) + (3 + 3) + (1 + 3) + 3  # + reply priming = 18
    assert parsed.max_output_tokens == 1000 - 18  # no max_output_tokens: the rest of the context
    assert parsed.stream is False and parsed.client_wants_usage  # nothing rewritten upstream
    rreq = route_request(parsed, "r", 0.0, 256, pinned_worker="p/a:8000")
    assert rreq.single_hop and rreq.pinned_worker == "p/a:8000"
    with_context(parsed, 500, {MODEL: 1000})  # a continuation: the stored conversation comes again
    assert parsed.prompt_tokens == 518 and parsed.max_output_tokens == 1000 - 518
    bounded = parse_request("responses", json.dumps({**body, "max_output_tokens": 9}).encode(), {MODEL: 1000})
    with_context(bounded, 500, {MODEL: 1000})
    assert bounded.max_output_tokens == 9  # the client's bound stays


def test_the_affinity_store_is_bounded_by_size_and_age() -> None:
    store = ResponseAffinity(max_entries=2, ttl_s=10.0)
    store.remember("r1", "w1", MODEL, 1, now=0.0)
    store.remember("r2", "w2", MODEL, 2, now=1.0)
    assert store.lookup("r1", now=2.0) is not None  # r1 now the most recently used
    store.remember("r3", "w3", MODEL, 3, now=3.0)  # evicts the least recently used: r2
    assert store.lookup("r2", now=3.0) is None and len(store) == 2
    assert store.lookup("r1", now=10.0) is not None  # 10 s old: within the TTL
    assert store.lookup("r1", now=10.5) is None  # 10.5 s: past it, and forgotten
    assert len(store) == 1


def test_the_relay_reads_the_real_servers_stream_split_anywhere() -> None:
    """vLLM's bytes (`fixtures/vllm_responses_stream.sse`), fed in pieces of every size: relayed whole, one
    terminal event, its usage in the gateway's names, a token event per text delta (the real stream has three)."""
    raw = (FIXTURES / "vllm_responses_stream.sse").read_bytes()
    for size in (1, 2, 7, 64, len(raw)):
        created: list[str] = []
        relay = ResponsesRelay(on_created=created.append)
        out = b"".join(relay.feed(raw[i : i + size]) for i in range(0, len(raw), size)) + relay.flush()
        assert out == raw
        assert relay.done and relay.finished and not relay.aborted and relay.error is None
        assert relay.usage == {"prompt_tokens": 18, "completion_tokens": 3, "total_tokens": 21}
        assert relay.tokens == 3 and relay.events == 11 and relay.status == "incomplete"
        assert created == ["resp_" + raw.split(b'"id":"resp_')[1].split(b'"')[0].decode()]
    relay = ResponsesRelay()
    assert (
        relay.feed(raw + b"event: response.output_text.delta\ndata: {}\n\n") == raw
    )  # nothing after the end
    crlf = ResponsesRelay()
    assert crlf.feed(raw.replace(b"\n", b"\r\n")) == raw and crlf.done  # CRLF framing relayed as LF
