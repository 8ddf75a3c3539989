"""`server.upstream.ConnectionPool` against a scripted raw HTTP/1.1 server on 127.0.0.1.

Each test server answers every request on a connection with the next scripted reply (raw bytes, sent in
the given pieces), and records what it received and how many connections it accepted."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server import h1_response
from server.h1_response import _SIZE, H1Response, _Llhttp
from server.upstream import ConnectionPool, SlotWait
from tests.gateway.fakes import read_raw_request

Reply = list[bytes] | Callable[[asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    def __init__(self, replies: list[Reply], close_after: bool = False) -> None:
        self.replies = list(replies)
        self.close_after = close_after  # close each connection after one reply
        self.requests: list[bytes] = []
        self.connections = 0
        self.eofs = 0  # connections the client closed
        self.server: asyncio.Server | None = None
        self.port = 0
        self._handlers: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head, body = await read_raw_request(reader)
                self.requests.append(head + body)
                reply = self.replies.pop(0)
                if callable(reply):
                    await reply(writer)
                else:
                    for piece in reply:
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.01)  # arrive as separate reads
                if self.close_after:
                    break
        except asyncio.IncompleteReadError:
            self.eofs += 1
        except (ConnectionError, IndexError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._handlers.discard(task)


def ok(body: bytes, extra: bytes = b"") -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra
            + b"content-length: %d\r\n\r\n" % len(body) + body]  # fmt: skip


def chunked(*pieces: bytes) -> list[bytes]:
    framed = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]
    wire = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"".join(framed)
        + b"0\r\n\r\n"
    )
    return [wire[i : i + 7] for i in range(0, len(wire), 7)]  # split at awkward places on purpose


HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"rid-1")]


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_content_length_body_and_keep_alive_reuse() -> None:
    async def go() -> None:
        async with RawServer([ok(b'{"a":1}'), ok(b'{"b":2}')]) as srv:
            pool = ConnectionPool()
            try:
                for expected in (b'{"a":1}', b'{"b":2}'):
                    resp = await pool.post(srv.url, b'{"x":1}', HEADERS)
                    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
                    assert await resp.aread() == expected
                    await resp.aclose()
                assert srv.connections == 1  # the second request reused the first connection
                first = srv.requests[0]
                assert first.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
                assert b"x-request-id: rid-1\r\n" in first and b"Content-Length: 7\r\n" in first
                assert first.endswith(b'\r\n\r\n{"x":1}') and b"accept-encoding" not in first.lower()
            finally:
                await pool.aclose()

    run(go())


def test_a_get_shares_the_origins_connections_and_leaves_posts_cached_request_line() -> None:
    """`method="GET"` (a stored response's retrieval): its own request line with the query, no body, on the
    origin's kept-alive connection; the POST after it still says POST."""

    async def go() -> None:
        async with RawServer([ok(b'{"a":1}'), ok(b'{"b":2}'), ok(b'{"c":3}')]) as srv:
            pool = ConnectionPool()
            base = srv.url.removesuffix("/v1/completions")
            try:
                for url, method in (
                    (srv.url, None),
                    (base + "/v1/responses/r1?stream=false", "GET"),
                    (srv.url, None),
                ):
                    resp = await pool.post(url, b"" if method else b"{}", HEADERS, method=method)
                    assert resp.status_code == 200
                    await resp.aread()
                    await resp.aclose()
                assert srv.connections == 1
                assert srv.requests[1].startswith(
                    b"GET /v1/responses/r1?stream=false HTTP/1.1\r\nHost: 127.0.0.1:"
                )
                assert srv.requests[1].endswith(b"Content-Length: 0\r\n\r\n")
                assert srv.requests[2].startswith(b"POST /v1/completions HTTP/1.1\r\n")
            finally:
                await pool.aclose()

    run(go())


def test_chunked_body_split_anywhere_is_decoded_in_order() -> None:
    async def go() -> None:
        events = [b'data: {"i": %d}\n\n' % i for i in range(5)]
        async with RawServer([chunked(*events), ok(b"{}")]) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                got = [c async for c in resp.aiter_raw()]
                assert b"".join(got) == b"".join(events)
                await resp.aclose()
                resp = await pool.post(srv.url, b"{}", HEADERS)  # connection reusable after the last chunk
                assert await resp.aread() == b"{}"
                assert srv.connections == 1
            finally:
                await pool.aclose()

    run(go())


@pytest.mark.parametrize(
    ("reply", "body", "reused"),
    [
        pytest.param(
            [b"HTTP/1.1 100 Continue\r\n\r\n", *ok(b"{}")], b"{}", True, id="1xx interim response is skipped"
        ),
        pytest.param(ok(b"{}", b"connection: close\r\n"), b"{}", False, id="connection close is honoured"),
        pytest.param(
            [b"HTTP/1.0 200 OK\r\n\r\nuntil-close"], b"until-close", False, id="body delimited by close"
        ),
        pytest.param([b"HTTP/1.1 204 No Content\r\n\r\n"], b"", True, id="204 has no body"),
    ],
)
def test_framing_variants(reply: list[bytes], body: bytes, reused: bool) -> None:
    async def go() -> None:
        close_after = not reused and b"content-length" not in reply[-1]
        async with RawServer([reply, ok(b"second")], close_after=close_after) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                assert await resp.aread() == body
                await resp.aclose()
                resp = await pool.post(srv.url, b"{}", HEADERS)
                assert await resp.aread() == b"second"
                await resp.aclose()
                assert srv.connections == (1 if reused else 2)
            finally:
                await pool.aclose()

    run(go())


def test_closing_an_unread_response_closes_the_connection() -> None:
    async def go() -> None:
        async def slow_stream(w: asyncio.StreamWriter) -> None:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await w.drain()
            await asyncio.sleep(0.5)

        async with RawServer([slow_stream]) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                assert await anext(resp.aiter_raw()) == b"hello"
                await resp.aclose()  # mid-body: the upstream request is aborted by closing the connection
                for _ in range(100):
                    if srv.eofs:
                        break
                    await asyncio.sleep(0.01)
                assert srv.eofs == 1
            finally:
                await pool.aclose()

    run(go())


def test_idle_connection_closed_by_server_is_replaced() -> None:
    async def go() -> None:
        async with RawServer([ok(b"one"), ok(b"two")], close_after=True) as srv:
            pool = ConnectionPool()
            try:
                for expected in (b"one", b"two"):
                    resp = await pool.post(srv.url, b"{}", HEADERS)
                    assert await resp.aread() == expected
                    await resp.aclose()
                    await asyncio.sleep(0.05)  # the server's close reaches the pool
                assert srv.connections == 2
            finally:
                await pool.aclose()

    run(go())


def test_reused_connection_that_dies_unanswered_is_retried_once_on_a_new_one() -> None:
    async def go() -> None:
        async def drop(w: asyncio.StreamWriter) -> None:
            w.transport.abort()  # the server went away with the request unanswered (an idle-timeout race)

        async with RawServer([ok(b"one"), drop, ok(b"two")]) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                assert await resp.aread() == b"one"
                resp = await pool.post(srv.url, b"{}", HEADERS)
                assert await resp.aread() == b"two"
                assert srv.connections == 2 and len(srv.requests) == 3
            finally:
                await pool.aclose()

    run(go())


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        pytest.param([b"garbage\r\n\r\n"], httpx.RemoteProtocolError, id="malformed status line → RemoteProtocolError"),
        pytest.param([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"], httpx.RemoteProtocolError,
                     id="closed mid-body → RemoteProtocolError"),
        pytest.param([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"], httpx.RemoteProtocolError,
                     id="bad chunk size → RemoteProtocolError"),
    ],
)  # fmt: skip
def test_protocol_errors(reply: list[bytes], error: type[Exception]) -> None:
    async def go() -> None:
        async with RawServer([reply], close_after=True) as srv:
            pool = ConnectionPool()
            try:
                with pytest.raises(error):
                    resp = await pool.post(srv.url, b"{}", HEADERS)
                    await resp.aread()
            finally:
                await pool.aclose()

    run(go())


def test_timeouts_and_refusals_raise_httpx_errors() -> None:
    async def go() -> None:
        async def stall(w: asyncio.StreamWriter) -> None:
            await asyncio.sleep(1)

        async with RawServer([stall, stall]) as srv:
            pool = ConnectionPool(max_per_origin=1, read_timeout_s=0.3, pool_timeout_s=0.05)
            try:
                with pytest.raises(httpx.ReadTimeout):
                    await pool.post(srv.url, b"{}", HEADERS)
                held = asyncio.ensure_future(pool.post(srv.url, b"{}", HEADERS))  # takes the only connection
                await asyncio.sleep(0.02)
                with pytest.raises(httpx.PoolTimeout):
                    await pool.post(srv.url, b"{}", HEADERS)
                with pytest.raises(httpx.ReadTimeout):
                    await held
            finally:
                await pool.aclose()
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1/completions"
        pool = ConnectionPool()
        try:
            with pytest.raises(httpx.ConnectError):
                await pool.post(dead, b"{}", HEADERS)
        finally:
            await pool.aclose()

    run(go())


def test_a_released_connection_goes_to_a_waiting_request() -> None:
    async def go() -> None:
        async with RawServer([ok(b"one"), ok(b"two")]) as srv:
            pool = ConnectionPool(max_per_origin=1, pool_timeout_s=2)
            try:
                first = await pool.post(srv.url, b"{}", HEADERS)
                waiting = asyncio.ensure_future(pool.post(srv.url, b"{}", HEADERS))
                await asyncio.sleep(0.02)
                assert not waiting.done()
                assert await first.aread() == b"one"  # read to the end: the connection is handed over
                second = await waiting
                assert await second.aread() == b"two" and srv.connections == 1
            finally:
                await pool.aclose()

    run(go())


def test_slot_wait_shows_a_post_that_failed_waiting_for_a_connection() -> None:
    """`SlotWait.waiting` stays True when the caller's own time-out (shorter than `pool_timeout_s`) or
    `httpx.PoolTimeout` ends the wait for a connection, and is False once a post got one."""

    async def go() -> None:
        async with RawServer([ok(b"one"), ok(b"two")]) as srv:
            pool = ConnectionPool(max_per_origin=1, pool_timeout_s=0.2)
            try:
                first = await pool.post(srv.url, b"{}", HEADERS, slot=(got := SlotWait()))
                assert not got.waiting  # a connection at once
                cut = SlotWait()
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await pool.post(srv.url, b"{}", HEADERS, slot=cut)
                pooled = SlotWait()
                with pytest.raises(httpx.PoolTimeout):
                    await pool.post(srv.url, b"{}", HEADERS, slot=pooled)
                assert cut.waiting and pooled.waiting
                waited = SlotWait()
                waiting = asyncio.ensure_future(pool.post(srv.url, b"{}", HEADERS, slot=waited))
                await asyncio.sleep(0.02)
                assert waited.waiting
                assert await first.aread() == b"one"  # the connection is handed over
                assert await (await waiting).aread() == b"two" and not waited.waiting
            finally:
                await pool.aclose()

    run(go())


def test_a_hand_over_in_the_same_loop_turn_as_the_pool_deadline_is_used_not_lost() -> None:
    """A waiter whose pool deadline fires in the loop turn that hands it a slot takes the slot: dropping it
    left the slot counted with no connection behind it, and at max_per_origin 1 the worker unreachable."""

    async def stall(writer: asyncio.StreamWriter) -> None:  # a stream that never ends
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(3600)

    async def go() -> None:
        async with RawServer([stall, ok(b"two"), ok(b"three")]) as srv:
            pool = ConnectionPool(max_per_origin=1, pool_timeout_s=0.5)
            loop = asyncio.get_running_loop()
            try:
                first = await pool.post(srv.url, b"{}", HEADERS)
                # the holder closes 0.45 s into the wait and the loop is blocked from 0.3 s to 0.7 s, so
                # the hand-over (0.45) and the waiter's deadline (0.5) run in one turn, in that order
                loop.call_later(0.45, first.close)
                loop.call_later(0.3, time.sleep, 0.4)
                second = await pool.post(srv.url, b"{}", HEADERS)
                assert await second.aread() == b"two"
                third = await pool.post(srv.url, b"{}", HEADERS)  # the slot is free again, and reused
                assert await third.aread() == b"three" and srv.connections == 2
            finally:
                await pool.aclose()

    run(go())


DECODERS = [pytest.param(True, id="llhttp"), pytest.param(False, id="python loop")]


def _bare_chunked(llhttp: bool) -> H1Response:
    resp = H1Response.__new__(H1Response)  # only the decoder state is used
    resp._state, resp._chunk_left, resp._done, resp._left = _SIZE, 0, False, None
    resp._llhttp = _Llhttp() if llhttp else None
    return resp


@pytest.mark.parametrize("llhttp", DECODERS)
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=6),
    st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=30),
    st.booleans(),
)
def test_chunked_decoder_is_split_invariant(
    llhttp: bool, pieces: list[bytes], cuts: list[int], ext: bool
) -> None:
    """Whatever way the wire bytes are split into reads, the decoder yields the chunk data in order."""
    line = b"%x;ext=1\r\n" if ext else b"%x\r\n"
    wire = b"".join(line % len(p) + p + b"\r\n" for p in pieces) + (
        b"0\r\nx-trailer: 1\r\n\r\n" if ext else b"0\r\n\r\n"
    )
    resp = _bare_chunked(llhttp)
    buf, got, at = bytearray(), [], 0
    for cut in [*cuts, len(wire)]:
        buf += wire[at : at + cut]
        at += cut
        got.append(resp._take(buf))
        if at >= len(wire):
            break
    assert b"".join(got) == b"".join(pieces) and resp._done and not buf


@pytest.mark.parametrize("llhttp", DECODERS)
@pytest.mark.parametrize(
    "wire",
    [b"zz\r\n", b"3\r\nabcd\r\n", b"3\r\nabc\r\n;x\r\n"],
    ids=["not hex", "longer than its size", "an extension without a size"],
)
def test_chunked_decoders_refuse_malformed_framing(llhttp: bool, wire: bytes) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        _bare_chunked(llhttp)._take(bytearray(wire))


@pytest.mark.parametrize("llhttp", DECODERS)
@pytest.mark.parametrize(
    "extra",
    [b"HTTP/1.1 junk", b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nbad"],
    ids=["junk", "a whole response"],
)
def test_bytes_after_the_last_chunk_close_the_connection(
    llhttp: bool, extra: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that writes past its chunked body cannot have the connection back: the next request
    opens a new one (with either decoder), and nothing after the body's end is taken as its data."""
    if not llhttp:
        monkeypatch.setattr(h1_response, "httptools", None)

    async def go() -> None:
        reply = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n" + extra]
        async with RawServer([reply, ok(b"second")]) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                assert (resp._llhttp is not None) is llhttp
                assert await resp.aread() == b"hi"
                resp = await pool.post(srv.url, b"{}", HEADERS)
                assert await resp.aread() == b"second" and srv.connections == 2
            finally:
                await pool.aclose()

    run(go())


# ---------------------------------------------------------------------------------------------- push
def _collector(pause_on: set[int] | None = None) -> tuple[list[bytes], Callable[[bytes, bool], bool]]:
    """A `deliver` for `H1Response.push` that records what it gets (and that only the last piece is
    marked last); False (pause) on the given calls."""
    got: list[bytes] = []
    lasts: list[bool] = []

    def deliver(data: bytes, last: bool) -> bool:
        assert not any(lasts), "a piece after the last"
        got.append(data)
        lasts.append(last)
        return len(got) not in (pause_on or set())

    return got, deliver


def test_push_delivers_a_body_split_anywhere_and_keeps_the_connection() -> None:
    async def go() -> None:
        events = [b'data: {"i": %d}\n\n' % i for i in range(5)]
        async with RawServer([chunked(*events), ok(b"{}")]) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                first = await anext(resp.aiter_raw())  # the dispatcher pulls the first piece, then pushes
                got, deliver = _collector()
                assert await resp.push(deliver) is True
                assert first + b"".join(got) == b"".join(events)
                assert len(got) > 3  # 7-byte reads 10 ms apart: delivered read by read, not at the end
                resp = await pool.post(srv.url, b"{}", HEADERS)  # the connection went back to the pool
                assert await resp.aread() == b"{}" and srv.connections == 1
            finally:
                await pool.aclose()

    run(go())


def test_push_returns_false_on_a_pause_and_resumes_where_it_stopped() -> None:
    async def go() -> None:
        events = [b"data: %d\n\n" % i for i in range(6)]
        async with RawServer([chunked(*events)]) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                got, deliver = _collector(pause_on={2, 4})
                rounds = 1
                while not await resp.push(deliver):
                    rounds += 1
                    await asyncio.sleep(0.03)  # bytes arriving meanwhile wait in the buffer
                assert rounds == 3 and b"".join(got) == b"".join(events)
            finally:
                await pool.aclose()

    run(go())


def test_push_restarts_the_read_deadline_with_every_piece() -> None:
    """`read_timeout_s` bounds each gap between pieces, not the whole stream."""

    async def go() -> None:
        async def steady(w: asyncio.StreamWriter) -> None:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(8):  # 0.08 s gaps, 0.64 s in all: over the 0.3 s read timeout
                w.write(b"2\r\n%02d\r\n" % i)
                await w.drain()
                await asyncio.sleep(0.08)
            w.write(b"0\r\n\r\n")

        async def stall(w: asyncio.StreamWriter) -> None:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n")
            await w.drain()
            await asyncio.sleep(1)

        async with RawServer([steady, stall]) as srv:
            pool = ConnectionPool(read_timeout_s=0.3)
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                got, deliver = _collector()
                assert await resp.push(deliver) is True
                assert b"".join(got) == b"".join(b"%02d" % i for i in range(8))
                resp = await pool.post(srv.url, b"{}", HEADERS)
                got, deliver = _collector()
                with pytest.raises(httpx.ReadTimeout):
                    await resp.push(deliver)
                assert got == [b"ok"]
            finally:
                await pool.aclose()

    run(go())


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        pytest.param([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", b"3\r\nabc\r\n", b"zz\r\n"],
                     httpx.RemoteProtocolError, id="bad chunk size in a later read"),
        pytest.param([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", b"3\r\nabc\r\n", b"5\r\nab"],
                     httpx.RemoteProtocolError, id="closed mid-chunk"),
        pytest.param([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n", b"abc"], httpx.RemoteProtocolError,
                     id="closed mid-body"),
    ],
)  # fmt: skip
def test_push_raises_what_a_pulled_read_raises(reply: list[bytes], error: type[Exception]) -> None:
    async def go() -> None:
        async with RawServer([reply], close_after=True) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                _got, deliver = _collector()
                with pytest.raises(error):
                    await resp.push(deliver)
            finally:
                await pool.aclose()

    run(go())


def test_push_raises_what_deliver_raises_in_the_waiting_task() -> None:
    async def go() -> None:
        async with RawServer([chunked(b"data: 1\n\n", b"data: 2\n\n")]) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)

                def deliver(data: bytes, last: bool) -> bool:
                    raise TimeoutError("total timeout")  # what the relay raises past total_timeout_s

                with pytest.raises(TimeoutError, match="total timeout"):
                    await resp.push(deliver)
                resp.close()
            finally:
                await pool.aclose()

    run(go())


def test_read_at_most_stops_past_its_bound_and_closes_the_connection() -> None:
    """`read_at_most`: a Content-Length over the bound is refused before a body byte is read; a chunked body
    once the bytes read pass it, without waiting for the rest (here: 2 s away, and an endless stream would
    never end). A body of exactly the bound is read whole and its connection kept."""

    async def endless(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(3):
            w.write(b"8\r\n01234567\r\n")
            await w.drain()
            await asyncio.sleep(0.01)
        await asyncio.sleep(2)

    async def go() -> None:
        async with RawServer([ok(b"x" * 17), ok(b"y" * 16), endless]) as srv:
            pool = ConnectionPool()
            try:
                resp = await pool.post(srv.url, b"{}", HEADERS)
                with pytest.raises(h1_response.AnswerTooLarge, match="Content-Length 17"):
                    await h1_response.read_at_most(resp, 16)
                await resp.aclose()
                resp = await pool.post(srv.url, b"{}", HEADERS)
                assert await h1_response.read_at_most(resp, 16) == b"y" * 16
                await resp.aclose()
                assert srv.connections == 2  # the first closed unread; the second's kept
                for _ in range(100):
                    if srv.eofs:
                        break
                    await asyncio.sleep(0.01)
                assert srv.eofs == 1  # the first connection's
                resp = await pool.post(srv.url, b"{}", HEADERS)
                start = time.monotonic()
                with pytest.raises(h1_response.AnswerTooLarge, match="passed the 20-byte bound"):
                    await h1_response.read_at_most(resp, 20)
                assert time.monotonic() - start < 1.0
                await resp.aclose()  # closes the connection (`test_closing_an_unread_response_closes_...`)
                assert srv.connections == 2  # the third request reused the second's connection
            finally:
                await pool.aclose()

    run(go())
