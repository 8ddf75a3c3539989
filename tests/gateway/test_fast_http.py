"""The gateway's lean HTTP cycle for the proxy endpoints (`server.fast_http`) against uvicorn's own.

A target with a query string is not a fast route, so `/v1/completions?via=uvicorn` runs the same endpoint
through uvicorn's `RequestResponseCycle`: every answer must be byte-identical on both paths (the `date`
header aside). Raw HTTP/1.1 over real sockets to `start_gateway_server`, workers faked at the transport."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest

from server import fast_http, runner
from server.config import validate_config
from server.fast_http import FastCycle, GatewayHttpProtocol
from server.runner import RunningGateway, start_gateway_server
from tests.gateway.fakes import METRICS_TEXT, FakeFleet, FakeWorker, config, pool, read_raw_request

FAST, SLOW = b"/v1/completions", b"/v1/completions?via=uvicorn"


def completion(**extra: Any) -> bytes:
    return json.dumps({"model": "llama-3-8b", "prompt": "hello", "max_tokens": 3, **extra}).encode()


def request(target: bytes, body: bytes, *headers: bytes, version: bytes = b"1.1") -> bytes:
    head = [
        b"POST " + target + b" HTTP/" + version,
        b"Host: gw",
        b"Content-Type: application/json",
        b"X-Request-Id: fixed-id",
        b"Content-Length: %d" % len(body),
        *headers,
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head without the date line, body with chunked framing removed)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"date:")]
    low = head.lower()
    if b"content-length:" in low:
        size = int(low.split(b"content-length:")[1].split(b"\r\n")[0])
        return b"\r\n".join(lines), await reader.readexactly(size)
    parts = []
    while (size := int((await reader.readuntil(b"\r\n"))[:-2], 16)) > 0:
        parts.append((await reader.readexactly(size + 2))[:-2])
    await reader.readuntil(b"\r\n")
    return b"\r\n".join(lines), b"".join(parts)


@asynccontextmanager
async def serving(*workers: FakeWorker, **sections: Any) -> AsyncIterator[RunningGateway]:
    cfg = config(pool("p", "L4", "mixed", *workers), **sections)
    running = await start_gateway_server(cfg, "127.0.0.1", 0, transport=FakeFleet(*workers).transport)
    try:
        yield running
    finally:
        await running.stop()


async def exchange(running: RunningGateway, raw: bytes, answers: int = 1) -> list[tuple[bytes, bytes]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
    try:
        writer.write(raw)
        return [await read_response(reader) for _ in range(answers)]
    finally:
        writer.close()
        await writer.wait_closed()


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 30))


CASES = [
    ("a non-streaming completion", completion(), (), {}),
    ("a stream, usage stripped", completion(stream=True), (), {}),
    (
        "a stream with usage asked for",
        completion(stream=True, stream_options={"include_usage": True}),
        (),
        {},
    ),
    ("an unknown model (404 in OpenAI shape)", completion(model="nope"), (), {}),
    ("a body that is not JSON (400)", b"{not json", (), {}),
    ("an empty body (400)", b"", (), {}),
    ("a missing API key (401)", completion(), (), {"auth": {"api_keys": ["k1"]}}),
    ("a wrong API key (401)", completion(), (b"Authorization: Bearer nope",), {"auth": {"api_keys": ["k1"]}}),
    ("a body over the limit (413)", completion(prompt="x" * 3000), (), {"limits": {"max_body_bytes": 1024}}),
]


@pytest.mark.parametrize(("body", "headers", "sections"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fast_path_answers_byte_for_byte_as_uvicorns_cycle(
    body: bytes, headers: tuple[bytes, ...], sections: dict[str, Any]
) -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok"), **sections) as running:
            fast = await exchange(running, request(FAST, body, *headers))
            slow = await exchange(running, request(SLOW, body, *headers))
            assert fast == slow
            assert fast[0][0].startswith(b"HTTP/1.1 ")

    run(go)


def _unstamped(body: bytes) -> bytes:
    return re.sub(rb'"created_at":\s*\d+', b'"created_at":0', re.sub(rb"resp_[A-Za-z0-9_]+", b"ID", body))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_responses_api_answer_is_the_same_on_both_cycles(stream: bool) -> None:
    """`/v1/responses` is a fast route too: its answers (the Responses relay's events, no [DONE]) must be
    the ones uvicorn's cycle gives."""
    body = json.dumps(
        {"model": "llama-3-8b", "input": "hello", "max_output_tokens": 3, "stream": stream}
    ).encode()

    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok")) as running:
            fast = await exchange(running, request(b"/v1/responses", body))
            slow = await exchange(running, request(b"/v1/responses?via=uvicorn", body))
            # the fake numbers its responses and stamps them: the bodies may differ only there
            fast, slow = ([(h, _unstamped(b)) for h, b in answers] for answers in (fast, slow))
            assert fast == slow
            assert fast[0][0].startswith(b"HTTP/1.1 200")
            if stream:
                assert b"event: response.completed" in fast[0][1] and b"[DONE]" not in fast[0][1]

    run(go)


def test_the_proxy_paths_run_on_the_fast_cycle_and_others_on_uvicorns() -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok")) as running:
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            protocols = running.server.server_state.connections
            writer.write(request(FAST, completion()))
            await read_response(reader)
            (proto,) = protocols
            assert isinstance(proto, GatewayHttpProtocol) and isinstance(proto.cycle, FastCycle)
            writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")  # same connection, kept alive
            head, body = await read_response(reader)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"status": "ok"}
            assert not isinstance(proto.cycle, FastCycle)
            writer.close()
            await writer.wait_closed()

    run(go)


def test_pipelined_requests_are_answered_in_order() -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok")) as running:
            raw = (
                request(FAST, completion(max_tokens=2))
                + request(FAST, completion(model="nope"))
                + request(FAST, completion(stream=True))
            )
            answers = await exchange(running, raw, answers=3)
            assert [a[0].split(b"\r\n")[0] for a in answers] == [
                b"HTTP/1.1 200 OK",
                b"HTTP/1.1 404 Not Found",
                b"HTTP/1.1 200 OK",
            ]
            assert json.loads(answers[0][1])["object"] == "text_completion"
            assert answers[2][1].endswith(b"data: [DONE]\n\n")
            assert running.gateway.dispatcher.outcomes == {
                "completed": 2
            }  # the 404 was refused before dispatch

    run(go)


def test_http_1_0_gets_connection_close_and_the_connection_is_closed() -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok")) as running:
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            writer.write(request(FAST, completion(), version=b"1.0"))
            head, body = await read_response(reader)
            assert b"connection: close" in head and json.loads(body)["object"] == "text_completion"
            assert await reader.read() == b""  # closed by the gateway
            writer.close()
            await writer.wait_closed()

    run(go)


def test_a_body_sent_in_pieces_and_chunked_is_assembled() -> None:
    async def go() -> None:
        worker = FakeWorker("a", mode="ok")
        async with serving(worker) as running:
            body = completion(user="pieces")
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            for i in range(0, len(body), 7):
                piece = body[i : i + 7]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                await asyncio.sleep(0.002)
            writer.write(b"0\r\n\r\n")
            head, answer = await read_response(reader)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(answer)["object"] == "text_completion"
            assert worker.raw_seen[-1] == body  # forwarded byte for byte
            writer.close()
            await writer.wait_closed()

    run(go)


def test_a_client_gone_before_the_answer_cancels_the_upstream_call() -> None:
    async def go() -> None:
        worker = FakeWorker("a", mode="stall")
        async with serving(worker) as running:
            _reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            writer.write(request(FAST, completion()))
            await writer.drain()
            for _ in range(200):  # until the request reached the worker
                if worker.seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()
            await writer.wait_closed()
            dispatcher = running.gateway.dispatcher
            for _ in range(200):
                if dispatcher.outcomes:
                    break
                await asyncio.sleep(0.01)
            assert dispatcher.outcomes == {"client_disconnected": 1}
            assert all(r.inflight_requests == 0 for r in running.gateway.registry.records())

    run(go)


@pytest.mark.parametrize("target", [FAST, SLOW])
def test_a_client_gone_with_a_request_pipelined_behind_cancels_the_running_stream(target: bytes) -> None:
    """uvicorn marks only its newest cycle disconnected, i.e. the pipelined request still queued: the stream
    being relayed never heard of the hang-up (its writes failed silently) and held its worker slot and KV to
    the end of the generation, then counted as completed. (With reading paused behind a pipelined request, a
    hang-up is seen when a write fails, so a response that writes nothing hears of it only at its end.)"""

    async def go() -> None:
        worker = FakeWorker("a", chunk_delay_s=0.25)  # 12 tokens: 3 s of stream
        async with serving(worker) as running:
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            writer.write(
                request(target, completion(stream=True, max_tokens=12)) + request(target, completion())
            )
            await writer.drain()
            await reader.readuntil(b"data: ")  # the stream has started
            writer.close()
            await writer.wait_closed()
            dispatcher = running.gateway.dispatcher
            for _ in range(150):  # 1.5 s, half the stream
                if not dispatcher.open and dispatcher.outcomes:
                    break
                await asyncio.sleep(0.01)
            assert not dispatcher.open and dispatcher.outcomes.get("client_disconnected", 0) >= 1
            assert "completed" not in dispatcher.outcomes
            assert all(r.inflight_requests == 0 for r in running.gateway.registry.records())

    run(go)


@pytest.mark.parametrize("target", [FAST, SLOW])
def test_a_client_gone_while_sending_its_body_is_recorded_as_499_not_as_an_internal_error(
    target: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok")) as running:
            _reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            head = request(target, completion()).split(b"\r\n\r\n")[0]
            writer.write(head + b"\r\n\r\n" + completion()[:10])  # Content-Length promises more
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.close()
            await writer.wait_closed()
            registry = running.gateway.metrics.registry
            labels = {"model": "unknown", "pool": "none", "status": "499"}
            for _ in range(200):
                if registry.get_sample_value("mosaic_requests_total", labels):
                    break
                await asyncio.sleep(0.01)
            assert registry.get_sample_value("mosaic_requests_total", labels) == 1
            assert running.gateway.dispatcher.outcomes == {}  # never admitted, so no dispatch outcome

    with caplog.at_level("ERROR"):
        run(go)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_body_larger_than_the_read_buffer_is_forwarded_whole() -> None:
    """Over 64 KiB the cycle pauses reading until the endpoint takes what it holds (uvicorn's flow control)."""

    async def go() -> None:
        worker = FakeWorker("a", mode="ok")
        async with serving(worker) as running:
            body = completion(vllm_xargs={"blob": "x" * 300_000})  # ≈ 300 KB, an unknown field passed through
            (answer,) = await exchange(running, request(FAST, body))
            assert answer[0].startswith(b"HTTP/1.1 200")
            assert worker.raw_seen[-1] == body

    run(go)


def test_a_chunked_body_over_the_limit_is_refused_while_reading() -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok"), limits={"max_body_bytes": 1024}) as running:
            piece = b"x" * 600
            raw = (
                b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
                + (b"%x\r\n%s\r\n" % (len(piece), piece)) * 3
                + b"0\r\n\r\n"
            )
            ((head, body),) = await exchange(running, raw)
            assert head.startswith(b"HTTP/1.1 413")
            assert json.loads(body)["error"]["code"] == 413

    run(go)


def test_the_installed_uvicorn_has_the_internals_the_fast_cycle_extends() -> None:
    assert fast_http.compatible()
    assert runner.http_protocol() is GatewayHttpProtocol


def test_a_uvicorn_without_those_internals_serves_the_same_answers_on_its_own_protocol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As on uvicorn ≤ 0.40, which has no HttpToolsProtocol._start_asgi_task: here one internal it lacks.
    monkeypatch.setattr(fast_http, "_REQUIRED_INTERNALS", (*fast_http._REQUIRED_INTERNALS, "_not_in_uvicorn"))
    assert not fast_http.compatible()
    assert runner.http_protocol() == "auto"

    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok")) as running:
            ((head, body),) = await exchange(running, request(FAST, completion()))
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["choices"]
            assert not any(
                isinstance(p, GatewayHttpProtocol) for p in running.server.server_state.connections
            )

    run(go)


def test_a_stream_from_a_pooled_worker_is_pushed_on_the_fast_cycle_with_the_same_events_and_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the connection pool to a real (simulated) worker, the fast cycle's stream is written from
    the worker's reads (`StreamSession.push`); uvicorn's cycle iterates `body()`. Same events (the
    completion id and time aside), usage stripped, same token counts, one ITL observation per relayed
    piece besides the first, one outcome each."""
    from server.responses import StreamSession

    pushed: list[int] = []
    original = StreamSession.push

    async def counting_push(self: StreamSession, cycle: FastCycle) -> bytes:
        pushed.append(1)
        return await original(self, cycle)

    monkeypatch.setattr(StreamSession, "push", counting_push)
    finals: list[bytes] = []  # bodies of the fast cycle's last send per response
    original_send = FastCycle.send

    async def recording_send(self: FastCycle, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            finals.append(message.get("body", b""))
        await original_send(self, message)

    monkeypatch.setattr(FastCycle, "send", recording_send)

    def normalised(body: bytes) -> list[Any]:
        events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
        return [e if e == b"[DONE]" else {**json.loads(e), "id": "-", "created": 0} for e in events]

    def unnamed(events: list[Any]) -> list[Any]:  # the worker's first stream goes without its fingerprint
        return [
            e if e == b"[DONE]" else {k: v for k, v in e.items() if k != "system_fingerprint"} for e in events
        ]

    async def go() -> None:
        cfg = runner_config(time_scale=50)  # ≈ 1.3 ms per token: the stream arrives over several reads
        running = await start_gateway_server(cfg, "127.0.0.1", 0)
        try:
            metrics = running.gateway.metrics
            answers = {}
            for target in (FAST, SLOW):
                before = len(pushed)
                (answers[target],) = await exchange(
                    running, request(target, completion(stream=True, max_tokens=12))
                )
                assert len(pushed) == before + (target == FAST)
            assert answers[FAST][0] == answers[SLOW][0]
            # the stream's last piece goes with the end of the response (one write): [DONE] in the final send
            assert len(finals) == 1 and finals[0].endswith(b"data: [DONE]\n\n")  # the slow path is uvicorn's
            fast, slow = normalised(answers[FAST][1]), normalised(answers[SLOW][1])
            assert unnamed(fast) == unnamed(slow) and len(fast) == 13 and fast[-1] == b"[DONE]"
            # the first stream taught the gateway the worker's fingerprint (its dropped usage event), the second
            # carries it on its last event, as the worker puts it for a client that asked for no usage
            assert "system_fingerprint" not in fast[-2] and slow[-2]["system_fingerprint"].startswith("vllm-")
            assert all("usage" not in e for e in fast[:-1])
            assert running.gateway.dispatcher.outcomes == {"completed": 2}
            assert (
                metrics.generation_tokens.labels("llama-3-8b").value == 24
            )  # from the stripped usage chunks
            child = {
                name: getattr(metrics, name).labels("llama-3-8b", "sim")
                for name in ("ttft", "itl", "tpot", "e2e")
            }
            assert [sum(child[name].counts) for name in ("ttft", "tpot", "e2e")] == [2, 2, 2]
            assert 2 <= sum(child["itl"].counts) <= 22  # per relayed piece after the first (11 tokens each)
            # the gaps add up to first → last piece, which is TPOT × (n − 1) per stream
            assert child["itl"].sum == pytest.approx(child["tpot"].sum * 11, rel=1e-9)
        finally:
            await running.stop()

    run(go)


def runner_config(time_scale: float, **limits: float) -> Any:
    pool = {
        "name": "sim",
        "model": "llama-3-8b",
        "gpu": "L4",
        "role": "mixed",
        "endpoints": {"simulated": {"replicas": 1, "time_scale": time_scale}},
    }
    return validate_config({"pools": [pool], "limits": limits})


def test_a_pushed_stream_past_the_total_timeout_ends_with_an_error_event() -> None:
    """`total_timeout_s` is checked per relayed read on the pushed path too: the stream ends with
    OpenAI's error event (504, the gateway's limit) and [DONE], one timed_out outcome (it was counted a
    worker_error), the worker's request aborted and not counted against its breaker."""

    async def go() -> None:
        # L4 decode ≈ 66 ms per token; at time scale 5 ≈ 13 ms: 200 tokens would take ≈ 2.6 s
        running = await start_gateway_server(runner_config(time_scale=5, total_timeout_s=0.4), "127.0.0.1", 0)
        try:
            (answer,) = await exchange(
                running, request(FAST, completion(stream=True, max_tokens=200, ignore_eos=True))
            )
            events = [e for e in answer[1].split(b"\n\n") if e]
            assert 3 < len(events) < 100 and events[-1] == b"data: [DONE]"
            error = json.loads(events[-2].removeprefix(b"data: "))["error"]
            assert (error["code"], error["type"]) == (504, "GatewayTimeoutError")
            assert "total timeout of 0.4 s" in error["message"]
            assert running.gateway.dispatcher.outcomes == {"timed_out": 1}
            # the gateway's own limit, not the worker's failure: its breaker hears nothing
            assert all(r.last_error is None for r in running.gateway.registry.records())
        finally:
            await running.stop()

    run(go)


def _answer_get(head: bytes, writer: asyncio.StreamWriter) -> bool:
    """A raw vLLM-like worker's GETs: /metrics, /v1/models, and 200 to the rest (/health). False for a POST."""
    if head.startswith(b"GET /metrics"):
        text = METRICS_TEXT.format(model="llama-3-8b", running=0, generated=0).encode()
    elif head.startswith(b"GET /v1/models"):
        text = json.dumps({"object": "list", "data": [{"id": "llama-3-8b", "object": "model"}]}).encode()
    elif head.startswith(b"GET "):
        text = b""
    else:
        return False
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
    return True


async def _gateway_before(worker: asyncio.Server, **limits: float) -> RunningGateway:
    """A gateway whose one pool is the raw `worker`, once it has found it healthy."""
    url = f"http://127.0.0.1:{worker.sockets[0].getsockname()[1]}"
    pool_cfg = {
        "name": "raw",
        "model": "llama-3-8b",
        "gpu": "L4",
        "role": "mixed",
        "endpoints": {"static": [url]},
    }
    running = await start_gateway_server(
        validate_config({"pools": [pool_cfg], "limits": limits}), "127.0.0.1", 0
    )
    for _ in range(200):
        if running.gateway.readiness()[1]["ready_workers"]["llama-3-8b"]:
            break
        await asyncio.sleep(0.05)
    return running


async def _late_done_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A raw vLLM-like worker: /health, /metrics, and a stream whose `[DONE]` (with the terminating chunk,
    one read) comes 0.6 s after its two tokens."""
    try:
        while True:
            head, body = await read_raw_request(reader)
            if not _answer_get(head, writer):
                assert json.loads(body)["stream"] is True
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                for i, reason in enumerate((b"null", b'"length"')):  # vLLM's last token event carries it
                    event = (
                        b'data: {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "w%d ", '
                        b'"finish_reason": %s}]}\n\n' % (i, reason)
                    )
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                await asyncio.sleep(0.6)
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def test_a_pushed_stream_whose_done_comes_past_the_total_timeout_is_completed_not_failed_twice() -> None:
    """The read that ends the stream ([DONE]) is the first past `total_timeout_s`: the stream completed, so
    it is relayed as it is (one [DONE], no error event appended) and counted completed."""

    async def go() -> None:
        worker = await asyncio.start_server(_late_done_worker, "127.0.0.1", 0)
        running = await _gateway_before(worker, total_timeout_s=0.3)
        try:
            (answer,) = await exchange(running, request(FAST, completion(stream=True, max_tokens=2)))
            assert answer[0].startswith(b"HTTP/1.1 200")
            events = [e for e in answer[1].split(b"\n\n") if e]
            assert len(events) == 3 and events[-1] == b"data: [DONE]" and b'"error"' not in answer[1]
            assert running.gateway.dispatcher.outcomes == {"completed": 1}
        finally:
            await running.stop()
            worker.close()

    run(go)


_TOKEN = b'data: {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "w", "finish_reason": %s}]}\n\n'
_WORKER_ERROR = b'data: {"error": {"message": "engine died", "type": "InternalServerError", "param": null, "code": 500}}\n\n'


def _ends_apart_worker(
    last: bytes, ended: asyncio.Event
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]:
    """A raw vLLM-like worker whose stream's last events (`last`, ending in `[DONE]`) and the body's end
    (the terminating chunk) are two writes 0.5 s apart, as Starlette writes them; `ended` is set after the
    second."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head, _ = await read_raw_request(reader)
                if not _answer_get(head, writer):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                    for event in (_TOKEN % b"null", last):
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                        await writer.drain()
                    await asyncio.sleep(0.5)
                    writer.write(b"0\r\n\r\n")
                    ended.set()
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return serve


@asynccontextmanager
async def _streamed_to_done(
    last: bytes, target: bytes
) -> AsyncIterator[tuple[RunningGateway, asyncio.StreamReader, asyncio.StreamWriter, bytes]]:
    """A stream from `_ends_apart_worker(last)` read up to its `[DONE]`, the worker's body end still 0.5 s
    away: (gateway, reader, writer, what was read). On exit the worker's handler is let finish (not cut
    mid-sleep) and everything is stopped."""
    ended = asyncio.Event()
    worker = await asyncio.start_server(_ends_apart_worker(last, ended), "127.0.0.1", 0)
    running = await _gateway_before(worker)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
        writer.write(request(target, completion(stream=True)))
        yield running, reader, writer, await reader.readuntil(b"data: [DONE]")
        await asyncio.wait_for(ended.wait(), 5)
    finally:
        await running.stop()
        worker.close()


@pytest.mark.parametrize("target", [FAST, SLOW], ids=["fast cycle", "uvicorn's cycle"])
@pytest.mark.parametrize(
    ("last", "outcome", "breaker"),
    [
        pytest.param(_TOKEN % b'"length"' + b"data: [DONE]\n\n", "completed", None, id="[DONE]"),
        pytest.param(
            _WORKER_ERROR + b"data: [DONE]\n\n", "worker_error", "stream_error_event", id="error event"
        ),
    ],
)
def test_a_client_that_hangs_up_on_the_streams_end_gets_the_outcome_of_that_end(
    target: bytes, last: bytes, outcome: str, breaker: str | None
) -> None:
    """Before: a client closing as soon as it read `[DONE]` (the usual loop) or the worker's error event (the
    openai SDK raises on it) while the worker's body had not ended was counted `client_disconnected`: a
    whole answer lost to the completed count and the latency histograms, a worker error to its breaker."""

    async def go() -> None:
        async with _streamed_to_done(last, target) as (running, _, writer, seen):
            assert (b'"error"' in seen) is (breaker is not None)
            writer.close()  # before the body's end, which comes 0.5 s later
            dispatcher = running.gateway.dispatcher
            for _ in range(100):
                if dispatcher.outcomes:
                    break
                await asyncio.sleep(0.02)
            assert dispatcher.outcomes == {outcome: 1} and not dispatcher.open
            assert [r.last_error for r in running.gateway.registry.records()] == [breaker]

    run(go)


@pytest.mark.parametrize("target", [FAST, SLOW], ids=["fast cycle", "uvicorn's cycle"])
@pytest.mark.parametrize(
    ("last", "outcome"),
    [
        pytest.param(_TOKEN % b'"length"' + b"data: [DONE]\n\n", "completed", id="[DONE]"),
        pytest.param(_WORKER_ERROR + b"data: [DONE]\n\n", "worker_error", id="error event"),
    ],
)
def test_a_stream_whose_end_was_relayed_gets_nothing_more_at_shutdown(
    target: bytes, last: bytes, outcome: str
) -> None:
    """The grace runs out while the worker's body end is still on its way, after `[DONE]` was relayed.
    Before, the client got a 503 error event and a second `[DONE]` after its whole answer (and, with the
    hang-up rule, the metrics said completed while the client saw an error)."""

    async def go() -> None:
        async with _streamed_to_done(last, target) as (running, reader, writer, _):
            running.gateway.begin_shutdown(0.1)  # runs out while the body's end is 0.5 s away
            rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
            assert rest == b"\n\n\r\n0\r\n\r\n"  # the [DONE] event's end, then the body's: nothing after
            writer.close()
            assert running.gateway.dispatcher.outcomes == {outcome: 1}

    run(go)


def test_a_pushed_stream_waits_for_a_slow_client_and_arrives_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that stops reading fills the gateway's socket buffer: the pushed relay stops reading the
    worker (`FastCycle.write` → False, `drain()`), then resumes; every event arrives, in order, once."""
    drains: list[bool] = []
    original_drain = FastCycle.drain

    async def counting_drain(self: FastCycle) -> None:
        drains.append(self.protocol.flow.write_paused)
        await original_drain(self)

    monkeypatch.setattr(FastCycle, "drain", counting_drain)

    async def go() -> None:
        running = await start_gateway_server(runner_config(time_scale=1e9), "127.0.0.1", 0)
        try:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # small windows both ways: the
            sock.setblocking(False)  # gateway's own buffer fills while the client does not read
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", running.port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
            writer.write(request(FAST, completion(stream=True, max_tokens=1500, ignore_eos=True)))
            await writer.drain()
            for proto in running.server.server_state.connections:
                proto.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
            reader._transport.pause_reading()  # type: ignore[attr-defined]  # stop reading for a while
            await asyncio.sleep(0.5)
            reader._transport.resume_reading()  # type: ignore[attr-defined]
            head, body = await read_response(reader)
            writer.close()
            await writer.wait_closed()
            events = [e for e in body.split(b"\n\n") if e]
            assert head.startswith(b"HTTP/1.1 200") and len(events) == 1501 and events[-1] == b"data: [DONE]"
            assert any(drains), "the relay never found the client's socket full"
            assert running.gateway.dispatcher.outcomes == {"completed": 1}
        finally:
            await running.stop()

    run(go)


@pytest.mark.parametrize("target", [FAST, SLOW], ids=["fast cycle", "uvicorn's cycle"])
def test_expect_100_continue_gets_the_interim_answer_before_the_body(target: bytes) -> None:
    # curl sends `Expect: 100-continue` for bodies over 1 KiB and waits up to 1 s for the interim answer
    async def go() -> None:
        worker = FakeWorker("a", mode="ok")
        async with serving(worker) as running:
            body = completion(prompt="x" * 2000)
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            head = request(target, body, b"Expect: 100-continue").split(b"\r\n\r\n")[0] + b"\r\n\r\n"
            writer.write(head)  # headers only: the body follows the 100
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(body)
            answer_head, answer = await read_response(reader)
            assert (
                answer_head.startswith(b"HTTP/1.1 200") and json.loads(answer)["object"] == "text_completion"
            )
            assert worker.raw_seen[-1] == body
            writer.close()
            await writer.wait_closed()

    run(go)


def test_expect_100_continue_with_a_declared_body_over_the_limit_gets_413_and_no_interim_answer() -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok"), limits={"max_body_bytes": 1024}) as running:
            body = completion(prompt="x" * 3000)
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            writer.write(request(FAST, body, b"Expect: 100-continue").split(b"\r\n\r\n")[0] + b"\r\n\r\n")
            head, answer = await asyncio.wait_for(read_response(reader), 2)
            assert head.startswith(b"HTTP/1.1 413")  # the body was never needed: no 100 before it
            assert json.loads(answer)["error"]["code"] == 413
            writer.close()
            await writer.wait_closed()

    run(go)
