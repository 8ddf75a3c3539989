"""How requests end when time or the worker's stream runs out (failure-semantics review findings): a whole
answer's total_timeout_s is the request's own limit, never a worker's fault; retries are counted when they
are dispatched; a stream always ends with `[DONE]`, and nothing follows its `[DONE]`; a whole answer's body
may not stall after its head for longer than stall_timeout_s. Fake workers at the HTTP seam, and scripted
workers over real sockets where the pooled upstream's read deadlines matter."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from server.runner import start_gateway_server
from tests.gateway.fakes import METRICS_TEXT, FakeFleet, FakeWorker, config, pool
from tests.gateway.scripted_http import EMPTY_200, SSE_HEAD, chunk, read_request
from tests.gateway.test_faults import CHAT, RR, chat, gateway, metric, run, sse_events


def failures(gw: Any) -> dict[str, int]:
    """Breaker failures by worker host."""
    return {r.url.split("//")[1].rsplit(":", 1)[0]: r.breaker.failures for r in gw.registry.records()}


def test_whole_answers_past_total_timeout_blame_no_worker_and_are_not_retried() -> None:
    """Three requests, each first sent to a worker that never answers: before, each was retried on the
    healthy worker with nothing left of its budget, which timed out at once and was charged — both workers
    were ejected after three requests."""
    hung, healthy = FakeWorker("hung", mode="stall"), FakeWorker("healthy", whole_delay_s=0.1)
    limits = {"total_timeout_s": 0.5, "first_token_timeout_s": 2.0, "retry_budget_s": 10.0}

    async def body() -> None:
        cfg = config(pool("p", "L4", "mixed", hung, healthy), limits=limits, **RR)
        async with gateway(cfg, FakeFleet(hung, healthy)) as (c, gw):
            statuses = [(await c.post(CHAT, json=chat(f"q{i}"))).status_code for i in range(4)]
            assert sorted(statuses) == [200, 200, 504, 504]  # round robin: each worker twice
            assert len(healthy.seen) == 2  # only its own turns: no retry was sent to it
            assert failures(gw) == {"hung": 0, "healthy": 0}
            assert gw.dispatcher.outcomes == {"timed_out": 2, "completed": 2}
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="timeout") == 0

    run(body)


def test_long_whole_answers_do_not_eject_a_healthy_worker() -> None:
    slow = FakeWorker("slow", whole_delay_s=1.0)
    limits = {"total_timeout_s": 0.3, "retry_budget_s": 0.1}

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", slow), limits=limits), FakeFleet(slow)) as (c, gw):
            rs = await asyncio.gather(*[c.post(CHAT, json=chat(f"q{i}")) for i in range(4)])
            assert [r.status_code for r in rs] == [504] * 4
            assert failures(gw) == {"slow": 0}
            # the gateway hung up on a worker serving them: released as hang-ups, as a stream it cuts (they
            # had been `failed_before_first_byte`, which takes back the prefix the worker did build)
            assert gw.ledger is not None and dict(gw.ledger.stats.released) == {"client_disconnected": 4}
            ok, body = gw.readiness()
            assert ok and body["ready_workers"] == {"llama-3-8b": 1}

    run(body)


def test_retries_are_counted_when_dispatched() -> None:
    only = FakeWorker("only", mode="status", status=503)
    a, b = FakeWorker("a", mode="status", status=503), FakeWorker("b")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", only)), FakeFleet(only)) as (c, gw):
            assert (await c.post(CHAT, json=chat())).status_code == 503
            assert len(only.seen) == 1  # nowhere else to go: no retry happened
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="status_503") == 0
        async with gateway(config(pool("p", "L4", "mixed", a, b), **RR), FakeFleet(a, b)) as (c, gw):
            assert (await c.post(CHAT, json=chat())).status_code == 200
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="status_503") == 1

    run(body)


class EndsEarly(FakeWorker):
    """A stream whose body ends cleanly after its second token, without `[DONE]` (and, with
    `error_first`, after an error event)."""

    error_first: bool = False

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        sent = 0
        async for piece in super()._stream(chat, n, usage):
            if sent == 2:
                if self.error_first:
                    yield self._error_event()
                return
            sent += 1
            yield piece


def _ended_early(error_first: bool) -> None:
    a = EndsEarly("a", tokens=4)
    a.error_first = error_first

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True))
            events = sse_events(r.text)
            assert r.status_code == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
            assert len(events) == 4  # two tokens, an error event, [DONE]
            error = json.loads(events[-2])["error"]
            if not error_first:
                assert error["type"] == "BadGatewayError" and "no [DONE]" in error["message"]
            assert gw.dispatcher.outcomes == {"worker_error": 1}
            kind = "stream_error_event" if error_first else "stream_truncated"
            assert metric(gw, "mosaic_upstream_errors_total", worker="p/a:8000", kind=kind) == 1

    run(body)


def test_a_stream_that_ends_without_done_gets_an_error_event_and_done() -> None:
    """Before, a body that ended early was `completed` and the client got neither an error nor `[DONE]`."""
    _ended_early(error_first=False)


def test_a_stream_that_ends_after_an_error_event_without_done_gets_done() -> None:
    _ended_early(error_first=True)


# ------------------------------------------------------------------------------------- real sockets
def _event(content: str, finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}
    return b"data: " + json.dumps({"id": "c", "choices": [choice]}).encode() + b"\n\n"


async def _with_worker(
    answer: Callable[[asyncio.StreamWriter, bool], Awaitable[None]],
    limits: dict[str, float],
    request: dict[str, Any],
) -> tuple[httpx.Response, float, Any]:
    """A scripted worker (`answer(writer, stream)` writes the response to a completion), a real gateway in
    front of it, one request; (response, seconds it took, the gateway)."""

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                path, body = await read_request(reader)
                if not path.startswith(b"/v1/"):
                    writer.write(EMPTY_200)
                    continue
                await answer(writer, bool(json.loads(body).get("stream")))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(worker, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    address = SimpleNamespace(url=f"http://127.0.0.1:{port}")  # what `pool` reads of a worker
    cfg = config(pool("p", "H100", "mixed", address), limits=limits)  # type: ignore[arg-type]
    running = await start_gateway_server(cfg, "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            started = time.monotonic()
            r = await client.post(running.url + CHAT, json=request)
            took = time.monotonic() - started
        await asyncio.sleep(0.1)  # accounted just after the last byte
        return r, took, running.gateway
    finally:
        await running.stop()
        server.close()


def test_nothing_follows_done_when_the_worker_stalls_after_it() -> None:
    """The worker sends its tokens and `[DONE]`, then keeps the chunked body open and sends more: before, the
    stall timeout appended an error event and a second `[DONE]` to a complete answer and charged the worker,
    and the client waited the whole stall timeout; the response now ends within AFTER_DONE_S (1 s) of
    `[DONE]`, and nothing after it is relayed."""

    async def answer(writer: asyncio.StreamWriter, stream: bool) -> None:
        writer.write(
            SSE_HEAD + chunk(_event("w0 ")) + chunk(_event("w1 ", "length")) + chunk(b"data: [DONE]\n\n")
        )
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(chunk(_event("after the end")))
        await writer.drain()
        await asyncio.sleep(10)  # never ends the chunked body

    body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r, took, gw = asyncio.run(_with_worker(answer, {"stall_timeout_s": 5}, body))
    assert took < 2.5
    assert sse_events(r.text) == [
        sse_events(_event("w0 ").decode())[0],
        sse_events(_event("w1 ", "length").decode())[0],
        "[DONE]",
    ]
    assert gw.dispatcher.outcomes == {"completed": 1}
    assert failures(gw) == {"127.0.0.1": 0}


def test_a_whole_answers_body_may_not_stall_longer_than_stall_timeout() -> None:
    """Headers and one byte of a 100-byte body, then nothing: the wait is bounded by stall_timeout_s (0.5 s),
    not by what is left of total_timeout_s (8 s), and the stalled worker is told."""

    async def answer(writer: asyncio.StreamWriter, stream: bool) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
        await writer.drain()
        await asyncio.sleep(10)

    body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}]}
    r, took, gw = asyncio.run(
        _with_worker(answer, {"stall_timeout_s": 0.5, "total_timeout_s": 8, "max_retries": 0}, body)
    )
    assert r.status_code == 504 and took < 2.5
    assert gw.dispatcher.outcomes == {"failed_before_first_byte": 1}
    assert failures(gw) == {"127.0.0.1": 1}


def _trickler(after: bytes, seconds: float) -> Callable[[asyncio.StreamWriter, bool], Awaitable[None]]:
    """A worker that sends `after` (its first events), then the next event one byte every 0.05 s for
    `seconds`, then the rest of it and `[DONE]`: the read deadline restarts with every byte."""
    trickled = _event("w1 ", "length")

    async def answer(writer: asyncio.StreamWriter, stream: bool) -> None:
        writer.write(SSE_HEAD + chunk(after))
        await writer.drain()
        sent, started = 0, time.monotonic()
        while time.monotonic() - started < seconds and sent < len(trickled) - 2:
            writer.write(chunk(trickled[sent : sent + 1]))
            await writer.drain()
            sent += 1
            await asyncio.sleep(0.05)
        writer.write(chunk(trickled[sent:]) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    return answer


STREAM_BODY = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_an_event_trickled_a_byte_at_a_time_is_bounded_by_the_stall_timeout() -> None:
    """After its first event the worker sends the next one a byte every 0.05 s for 3 s (every byte restarted
    the read deadline): before, the stream outlived stall_timeout_s (0.3 s) and ended `completed` after 3 s;
    now an event that stays incomplete for longer than the stall timeout is a stall."""
    r, took, gw = asyncio.run(
        _with_worker(
            _trickler(_event("w0 "), 3.0), {"stall_timeout_s": 0.3, "total_timeout_s": 8}, STREAM_BODY
        )
    )
    events = sse_events(r.text)
    assert took < 1.5, took
    assert events[0] == sse_events(_event("w0 ").decode())[0] and events[-1] == "[DONE]" and len(events) == 3
    assert json.loads(events[1])["error"]["type"] == "BadGatewayError"
    assert gw.dispatcher.outcomes == {"worker_error": 1}
    assert failures(gw) == {"127.0.0.1": 1}


def test_an_event_trickled_a_byte_at_a_time_is_bounded_by_the_total_timeout() -> None:
    """The same worker under a long stall timeout (5 s): total_timeout_s (0.6 s) ends the stream, with the
    gateway's time-out and no mark on the worker (before: `completed` after 3 s)."""
    r, took, gw = asyncio.run(
        _with_worker(
            _trickler(_event("w0 "), 3.0), {"stall_timeout_s": 5, "total_timeout_s": 0.6}, STREAM_BODY
        )
    )
    events = sse_events(r.text)
    assert took < 1.5, took
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert json.loads(events[1])["error"]["type"] == "GatewayTimeoutError"
    assert gw.dispatcher.outcomes == {"timed_out": 1}
    assert failures(gw) == {"127.0.0.1": 0}


def test_bytes_trickled_after_done_do_not_hold_the_response_open() -> None:
    """`[DONE]`, then a byte every 0.05 s for 3 s inside the body: the response ended only with the body
    (each byte restarted the AFTER_DONE_S bound); now it ends within AFTER_DONE_S of `[DONE]`, completed."""
    done = _event("w0 ", "length") + b"data: [DONE]\n\n"
    r, took, gw = asyncio.run(
        _with_worker(_trickler(done, 3.0), {"stall_timeout_s": 5, "total_timeout_s": 8}, STREAM_BODY)
    )
    assert took < 2.0, took
    assert sse_events(r.text) == [sse_events(_event("w0 ", "length").decode())[0], "[DONE]"]
    assert gw.dispatcher.outcomes == {"completed": 1}
    assert failures(gw) == {"127.0.0.1": 0}


class Trickles(FakeWorker):
    """A stream (through an injected transport: the pulled relay, not the pushed one) whose second token
    event comes a byte every 0.05 s for `trickle_s`."""

    trickle_s: float = 3.0

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        sent = 0
        async for piece in super()._stream(chat, n, usage):
            if sent == 1:
                started = time.monotonic()
                while len(piece) > 1 and time.monotonic() - started < self.trickle_s:
                    yield piece[:1]
                    piece = piece[1:]
                    await asyncio.sleep(0.05)
            sent += 1
            yield piece


def test_an_event_trickled_through_the_pulled_relay_is_bounded_by_the_stall_timeout() -> None:
    a = Trickles("a", tokens=4)
    limits = {"stall_timeout_s": 0.3, "total_timeout_s": 8}

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a), limits=limits), FakeFleet(a)) as (c, gw):
            started = time.monotonic()
            r = await c.post(CHAT, json=chat(stream=True))
            assert time.monotonic() - started < 1.5
            events = sse_events(r.text)
            assert len(events) == 3 and events[-1] == "[DONE]"
            assert json.loads(events[1])["error"]["type"] == "BadGatewayError"
            assert gw.dispatcher.outcomes == {"worker_error": 1}
            assert metric(gw, "mosaic_upstream_errors_total", worker="p/a:8000", kind="stream_timeout") == 1

    run(body)


def test_tokens_per_stream_event_are_learnt_and_counted_as_tokens() -> None:
    """A worker whose stream events carry 4 tokens each (speculative decoding, vLLM's --stream-interval):
    after one stream the gateway counts 4 tokens per event for it, so the next stream's KV reservation grows
    and is bounded by tokens, not events (counted as events, the reconcile's bound on what a stream holds
    fell below it and withheld KV the gateway's own streams used: review finding)."""
    a = FakeWorker(
        "a", tokens=5, stream_usage={"prompt_tokens": 7, "completion_tokens": 20, "total_tokens": 27}
    )
    seen: list[int] = []

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            assert gw.registry.tokens_per_event("p/a:8000") == 1.0
            r = await c.post(CHAT, json=chat(stream=True, max_tokens=5))
            assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
            assert gw.registry.tokens_per_event("p/a:8000") == 4.0  # 20 tokens in 5 events
            ledger = gw.ledger
            assert ledger is not None
            grow = ledger._grow

            def spy(res: Any, generated: int, now: float) -> bool:  # what each reservation is told
                seen.append(generated)
                return grow(res, generated, now)

            ledger._grow = spy  # type: ignore[method-assign]
            assert (await c.post(CHAT, json=chat(stream=True, max_tokens=5))).status_code == 200

    run(body)
    assert seen[:3] == [8, 12, 16]  # after events 2, 3 and 4 (the first comes with the head), 4 tokens each


class AbortsWhole(FakeWorker):
    """Answers a whole request as vLLM does when it stops with it running: 200, finish_reason abort."""

    def _whole(self, chat: bool, n: int) -> dict[str, Any]:
        answer = super()._whole(chat, n)
        answer["choices"][0]["finish_reason"] = "abort"
        return answer


def test_a_whole_answer_the_worker_aborted_is_no_completion() -> None:
    a = AbortsWhole("a")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            r = await c.post(CHAT, json=chat())
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"
            assert gw.dispatcher.outcomes == {"worker_error": 1}
            assert failures(gw) == {"a": 0}  # a stop is not a fault
            assert gw.predictor is not None and gw.predictor.count("llama-3-8b", 7) == 0  # not learnt from

    run(body)


class Progressing(FakeWorker):
    """A slow worker that is generating: its generation counter moves at every scrape."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            self.generated += 100
        return await super().handle(request)


class Prefilling(FakeWorker):
    """A slow pooling worker (embeddings): its prompt counter moves at every scrape, its generation one never."""

    prompted = 0.0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            self.prompted += 1000
            text = METRICS_TEXT.format(model=self.model, running=1, generated=0.0)
            return httpx.Response(
                200, text=text + f'vllm:prompt_tokens_total{{engine="0"}} {self.prompted}\n'
            )
        return await super().handle(request)


def test_a_hung_worker_is_told_by_whole_answers_a_slow_one_is_not() -> None:
    """All time out every whole answer (total_timeout_s 0.3 s). The hung one's token counters never move
    while it holds them: its breaker opens after failure_threshold of them, as before 2026-12-05 (the review
    found non-streaming traffic could no longer eject it); the one generating for others is not told, nor one
    that only prefills for them (a pooling worker's embeddings generate nothing: its first version was told)."""
    limits = {"total_timeout_s": 0.3, "retry_budget_s": 0.0}
    scrape = {"interval_s": 0.05}
    for worker, hung in (
        (FakeWorker("w", mode="stall"), True),
        (Progressing("w", whole_delay_s=5.0), False),
        (Prefilling("w", whole_delay_s=5.0), False),
    ):

        async def body(worker: FakeWorker = worker, hung: bool = hung) -> None:
            cfg = config(pool("p", "L4", "mixed", worker), limits=limits, scrape=scrape)
            async with gateway(cfg, FakeFleet(worker)) as (c, gw):
                await asyncio.sleep(0.2)  # scraped
                for _ in range(3):
                    assert (await c.post(CHAT, json=chat())).status_code in (503, 504)
                record = gw.registry.get("p/w:8000")
                assert record is not None
                assert record.breaker.is_open(gw.clock()) is hung
                kind = {"worker": "p/w:8000", "kind": "timeout_no_progress"}
                assert metric(gw, "mosaic_upstream_errors_total", **kind) == (3 if hung else 0)

        run(body)


def _stream_ending(*events: bytes) -> Callable[[asyncio.StreamWriter, bool], Awaitable[None]]:
    async def answer(writer: asyncio.StreamWriter, stream: bool) -> None:
        writer.write(
            SSE_HEAD + b"".join(chunk(e) for e in events) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        )
        await writer.drain()

    return answer


STREAM_REQUEST = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_a_stream_ending_with_done_and_no_finish_reason_is_no_completion() -> None:
    """vLLM 0.32 stopped by SIGTERM may end a running stream with [DONE] and no finish_reason at all (seen
    in CI): relayed as sent, but cut short, so a worker error (it was counted completed and its cut length
    taught the length predictor), and no mark on the breaker (a stop is not a fault)."""
    answer = _stream_ending(_event("w0 "), _event("w1 "))
    r, _, gw = asyncio.run(_with_worker(answer, {}, STREAM_REQUEST))
    assert sse_events(r.text) == [sse_events(_event(w).decode())[0] for w in ("w0 ", "w1 ")] + ["[DONE]"]
    assert gw.dispatcher.outcomes == {"worker_error": 1}
    assert failures(gw) == {"127.0.0.1": 0}
    assert gw.predictor is not None and gw.predictor.count("llama-3-8b", 7) == 0


def test_a_stream_finished_in_json_dumps_spacing_is_read_as_finished() -> None:
    """Another OpenAI-compatible server's `"finish_reason": "stop"` (json.dumps' spacing) ends a stream as
    vLLM's compact `"finish_reason":"stop"` does, and `"finish_reason": "abort"` as vLLM's abort."""
    finished = _stream_ending(_event("w0 "), _event("w1 ", "stop"))
    r, _, gw = asyncio.run(_with_worker(finished, {}, STREAM_REQUEST))
    assert r.status_code == 200 and gw.dispatcher.outcomes == {"completed": 1}
    aborted = _stream_ending(_event("w0 "), _event("", "abort"))
    r, _, gw = asyncio.run(_with_worker(aborted, {}, STREAM_REQUEST))
    assert r.status_code == 200 and gw.dispatcher.outcomes == {"worker_error": 1}
    assert failures(gw) == {"127.0.0.1": 0}


class AnswersHtml(FakeWorker):
    """A 200 whose body is no JSON (a proxy's HTML page in front of the worker, a URL of another server)."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/"):
            self.paths.append(request.url.path)
            return httpx.Response(
                200, text="<html><body>Sign in</body></html>", headers={"content-type": "text/html"}
            )
        return await super().handle(request)


def test_a_whole_answer_that_is_no_json_is_retried_elsewhere() -> None:
    """Before, the HTML page was relayed to the client as a 200 and counted completed."""
    bad, good = AnswersHtml("bad"), FakeWorker("good")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", bad, good), **RR), FakeFleet(bad, good)) as (
            c,
            gw,
        ):
            answers = [await c.post(CHAT, json=chat(f"q{i}")) for i in range(4)]
            assert [r.status_code for r in answers] == [200] * 4
            assert all(r.json()["object"] == "chat.completion" for r in answers)
            assert len(bad.paths) >= 1 and len(good.seen) == 4 and gw.dispatcher.outcomes == {"completed": 4}
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="not_json") == len(
                [p for p in bad.paths if p.endswith("/completions")]
            )
            assert failures(gw)["good"] == 0

    run(body)


def test_a_whole_answer_that_is_no_json_from_the_only_worker_is_a_502() -> None:
    bad = AnswersHtml("bad")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", bad)), FakeFleet(bad)) as (c, gw):
            r = await c.post(CHAT, json=chat())
            assert r.status_code == 502
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("BadGatewayError", 502)
            assert set(error) == {"message", "type", "param", "code"}
            assert gw.dispatcher.outcomes == {"failed_before_first_byte": 1}

    run(body)


class DiesWithinTheFirstEvent(FakeWorker):
    """Sends the opening bytes of its first event, then the connection drops."""

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        yield b'data: {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"con'
        await asyncio.sleep(0.01)
        raise httpx.ReadError("connection reset by peer")


def test_a_stream_that_dies_within_its_first_event_is_retried_elsewhere() -> None:
    """Nothing reached the client: before, the half event committed the request to that worker, and the
    client got the fragment, an error event and [DONE] (worker_error) where another worker could serve it."""
    bad, good = DiesWithinTheFirstEvent("bad"), FakeWorker("good")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", bad, good), **RR), FakeFleet(bad, good)) as (
            c,
            gw,
        ):
            answers = [await c.post(CHAT, json=chat(f"q{i}", stream=True)) for i in range(4)]
            assert [r.status_code for r in answers] == [200] * 4
            assert all(sse_events(r.text)[-1] == "[DONE]" and '"error"' not in r.text for r in answers)
            assert len(bad.seen) >= 1 and len(good.seen) == 4 and gw.dispatcher.outcomes == {"completed": 4}
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="protocol") == len(bad.seen)

    run(body)


class CrlfFramed(FakeWorker):
    """An SSE stream framed with CRLF (allowed by the SSE spec; vLLM uses LF), one token every 0.2 s."""

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        for i in range(n):
            reason = '"length"' if i == n - 1 else "null"
            event = (
                '{"id": "x", "choices": [{"index": 0, "delta": {"content": "w%d "}, "finish_reason": %s}]}'
            )
            yield b"data: " + (event % (i, reason)).encode() + b"\r\n\r\n"
            await asyncio.sleep(0.2)
        yield b"data: [DONE]\r\n\r\n"


def test_a_crlf_framed_stream_is_relayed_lf_framed_from_its_first_event() -> None:
    """The wait for the first whole event knows CRLF's blank line (a CRLF stream longer than the first-token
    timeout is relayed, not held to its end and timed out), and the relay frames it with LF (before, no
    event was ever complete: the client got only an error event and [DONE])."""
    w = CrlfFramed("w", tokens=5)

    async def body() -> None:
        cfg = config(pool("p", "L4", "mixed", w), limits={"first_token_timeout_s": 0.5})
        async with gateway(cfg, FakeFleet(w)) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True, max_tokens=5))
            events = sse_events(r.text)
            assert r.status_code == 200 and "\r" not in r.text and len(events) == 6 and events[-1] == "[DONE]"
            contents = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]]
            assert contents == [f"w{i} " for i in range(5)]
            assert gw.dispatcher.outcomes == {"completed": 1}

    run(body)


class SplitReads(FakeWorker):
    """FakeWorker's stream re-cut into reads of `cut` bytes (TCP or the pool's reads split events anywhere)."""

    cut = 40

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        data = b"".join([piece async for piece in super()._stream(chat, n, usage)])
        for at in range(0, len(data), self.cut):
            yield data[at : at + self.cut]


def split_reads(name: str, cut: int, **kw: Any) -> SplitReads:
    worker = SplitReads(name, **kw)
    worker.cut = cut
    return worker


def test_a_first_error_event_read_in_pieces_passes_through_whole() -> None:
    """Found by the fault property test: the gateway decided on the first read, `data: {"error": {"message":
    "engine di`, and passed that fragment and [DONE] to the client (an event that is no JSON)."""
    a = split_reads("a", 40, mode="error_event", error_code=500)

    async def body() -> None:
        cfg = config(pool("p", "L4", "mixed", a), limits={"max_retries": 0})
        async with gateway(cfg, FakeFleet(a)) as (c, gw):
            events = sse_events((await c.post(CHAT, json=chat(stream=True))).text)
            assert events[-1] == "[DONE]"
            error = json.loads(events[0])["error"]
            assert (error["code"], error["message"]) == (500, "engine died")
            assert gw.dispatcher.outcomes == {"failed_before_first_byte": 1}

    run(body)


@pytest.mark.parametrize("cut", [7, 40])
@pytest.mark.parametrize("code", [400, 500])
def test_a_first_error_event_read_in_pieces_is_judged_whole(cut: int, code: int) -> None:
    """A 4xx error event read in pieces is the worker refusing (relayed, worker_rejected, not retried, no
    breaker mark), a 5xx one a failure retried elsewhere; read as `data: {` (7 bytes) the 5xx event was
    relayed, read 40 bytes at a time the 4xx one was retried and blamed."""
    a, b = split_reads("a", cut, mode="error_event", error_code=code), FakeWorker("b")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a, b), **RR), FakeFleet(a, b)) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True))
            assert len(a.seen) == 1  # round robin starts with `a`
            if code == 400:
                assert json.loads(sse_events(r.text)[0])["error"]["code"] == 400 and not b.seen
                assert gw.dispatcher.outcomes == {"worker_rejected": 1}
                assert failures(gw)["a"] == 0
            else:
                assert '"error"' not in r.text and len(b.seen) == 1
                assert gw.dispatcher.outcomes == {"completed": 1}

    run(body)


class StopsOnDoneString(FakeWorker):
    """A chat stream as vLLM writes it for a request that stopped on the stop string `[DONE]`: the matched
    string is the final token event's `stop_reason`, its last member."""

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        head = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"llama-3-8b",'
        yield (
            head
            + b'"choices":[{"index":0,"delta":{"content":"All"},"logprobs":null,"finish_reason":null}]}\n\n'
        )
        yield (
            head
            + b'"choices":[{"index":0,"delta":{"content":" set"},"logprobs":null,"finish_reason":null}]}\n\n'
        )
        yield head + (
            b'"choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop",'
            b'"stop_reason":"[DONE]"}]}\n\n'
        )
        if usage:
            yield (
                head + b'"choices":[],"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2}}\n\n'
            )
        yield b"data: [DONE]\n\n"


def test_a_stream_stopped_on_the_stop_string_done_keeps_its_end() -> None:
    """Found by the fault property test: the relay took the `[DONE]` in the last token event's
    `"stop_reason":"[DONE]"}]}` for the stream's end and dropped the usage event and the real `[DONE]`."""
    a = StopsOnDoneString("a")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            body = chat(stream=True, stop=["[DONE]"], stream_options={"include_usage": True})
            events = sse_events((await c.post(CHAT, json=body)).text)
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 2
            assert gw.dispatcher.outcomes == {"completed": 1}
            assert metric(gw, "mosaic_generation_tokens_total", model="llama-3-8b") == 2

    run(body)


WHOLE_REQUEST = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
WHOLE_ANSWER = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "llama-3-8b",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "a b"}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
    }
).encode()


@pytest.mark.parametrize("request_body", [WHOLE_REQUEST, STREAM_REQUEST], ids=["whole", "stream"])
def test_a_status_outside_100_599_is_a_protocol_failure(request_body: dict[str, Any]) -> None:
    """Found by the socket-level fault property test: `HTTP/1.1 999 Odd` was passed through, and the fast
    HTTP cycle could not write a 999 status line: the client's connection closed with no answer at all."""

    async def answer(writer: asyncio.StreamWriter, stream: bool) -> None:
        writer.write(b"HTTP/1.1 999 Odd\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()

    r, _, gw = asyncio.run(_with_worker(answer, {"max_retries": 0}, request_body))
    assert r.status_code == 502 and r.json()["error"]["type"] == "BadGatewayError"
    assert gw.dispatcher.outcomes == {"failed_before_first_byte": 1}


def test_a_close_delimited_whole_answer_cut_after_a_brace_is_no_completion() -> None:
    """Found by the socket-level fault property test: a body delimited by the worker closing its connection,
    cut one byte short by the worker's death, still ends with its usage object's `}`; the shape check took it
    for JSON and relayed the broken answer as a completed 200. Such a body is parsed now."""

    async def answer(writer: asyncio.StreamWriter, stream: bool) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + WHOLE_ANSWER[:-1])
        await writer.drain()
        writer.close()

    r, _, gw = asyncio.run(_with_worker(answer, {"max_retries": 0}, WHOLE_REQUEST))
    assert r.status_code == 502 and r.json()["error"]["type"] == "BadGatewayError"
    assert gw.dispatcher.outcomes == {"failed_before_first_byte": 1}

    async def whole(writer: asyncio.StreamWriter, stream: bool) -> None:  # the same answer, all of it
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + WHOLE_ANSWER)
        await writer.drain()
        writer.close()

    r, _, gw = asyncio.run(_with_worker(whole, {"max_retries": 0}, WHOLE_REQUEST))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert gw.dispatcher.outcomes == {"completed": 1}
