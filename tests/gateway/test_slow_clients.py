"""A streaming client that stays connected but reads slowly or not at all, over real sockets (the gateway's
fast path and pooled upstream, a scripted worker streaming ~1 KB events as fast as it may).

- The worker's bytes are not buffered without bound while the relay waits for the client: the upstream
  connection stops reading past `READ_HIGH_WATER` and resumes when the relay asks for more.
- A client that reads nothing for `stall_timeout_s` is dropped: the stream is closed upstream, its in-flight
  slot and KV reservation are released, the outcome is `client_disconnected`. Before, it held all of that
  (and the worker's whole stream in gateway memory: 44 MB after 10 s) for as long as it stayed connected.
- A client that pauses for less than that gets the whole stream; one that reads steadily, however far
  behind the worker, is never dropped (progress is the bytes the client's socket takes, not the time the
  gateway's buffer takes to drain: it was dropped after 1 s while reading 316 KiB/s); one still reading when
  `total_timeout_s` runs out ends as `timed_out`, as any stream that outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

from server.config import validate_config
from server.runner import start_gateway_server
from server.upstream import READ_HIGH_WATER
from tests.gateway.scripted_http import chunk, serve_chat_streams

MODEL = "llama-3-8b"
EVENTS = 20_000  # ~19 MB of events: far over what the kernel buffers for a localhost socket (≤ 4 MB sent)


class StreamingWorker:
    """Answers /health and /metrics; streams EVENTS chunks of ~0.9 KB to every POST, then [DONE]."""

    def __init__(self) -> None:
        self.finished = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_chat_streams(reader, writer, self._stream)

    async def _stream(self, writer: asyncio.StreamWriter) -> None:
        choice = {"index": 0, "delta": {"content": "x" * 900}, "finish_reason": None}
        event = b"data: " + json.dumps({"id": "c", "model": MODEL, "choices": [choice]}).encode() + b"\n\n"
        for _ in range(EVENTS):
            writer.write(chunk(event))
            await writer.drain()
        last = {"index": 0, "delta": {"content": ""}, "finish_reason": "length"}  # vLLM's last event
        ending = b"data: " + json.dumps({"id": "c", "model": MODEL, "choices": [last]}).encode() + b"\n\n"
        writer.write(chunk(ending) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        self.finished += 1


async def _gateway(
    worker: StreamingWorker, stall_s: float, total_s: float = 60.0
) -> tuple[Any, asyncio.Server]:
    server = await asyncio.start_server(worker.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = validate_config(
        {
            "pools": [
                {
                    "name": "p",
                    "model": MODEL,
                    "gpu": "H100",
                    "role": "mixed",
                    "endpoints": {"static": [f"http://127.0.0.1:{port}"]},
                }
            ],
            "health": {"interval_s": 60},
            "scrape": {"interval_s": 60},
            "limits": {"stall_timeout_s": stall_s, "first_token_timeout_s": 5.0, "total_timeout_s": total_s},
        },
        "test",
    )
    return await start_gateway_server(config, "127.0.0.1", 0), server


@contextlib.asynccontextmanager
async def _served(stall_s: float, total_s: float = 60.0) -> AsyncIterator[Any]:
    """The gateway in front of a fresh `StreamingWorker`, stopped (and the worker's server closed) after."""
    running, server = await _gateway(StreamingWorker(), stall_s, total_s)
    try:
        yield running
    finally:
        await running.stop()
        server.close()


async def _client(url: str, limit: int = 2**16) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client with a small receive buffer that has sent one streaming chat request."""
    host, port = url.split("//")[1].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    ).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )
    return reader, writer


def _upstream_buffered(running: Any) -> int:
    pool = running.gateway.upstream.pool
    return sum(len(c.buf) for origin in pool._origins.values() for c in origin._members)


def test_a_client_that_stops_reading_is_dropped_and_releases_its_worker() -> None:
    async def main() -> tuple[int, dict[str, int], int, int]:
        async with _served(stall_s=1.0) as running:
            reader, writer = await _client(running.url)
            await reader.read(200)  # the stream began; the client reads nothing more
            await asyncio.sleep(0.6)
            buffered = _upstream_buffered(running)  # the relay is waiting for the client by now
            # past the 1 s stall bound after its last byte taken (its reader buffers a little)
            await asyncio.sleep(2.4)
            gw = running.gateway
            inflight = sum(r.inflight_requests for r in gw.registry.records())
            writer.transport.abort()
            return buffered, dict(gw.dispatcher.outcomes), inflight, len(gw.dispatcher.open)

    buffered, outcomes, inflight, still_open = asyncio.run(main())
    # the high-water mark, plus at most one read (asyncio reads 256 KiB at a time); 17 MB before
    assert buffered <= READ_HIGH_WATER + 256 * 1024
    assert outcomes == {"client_disconnected": 1}
    assert inflight == 0 and still_open == 0


def test_a_client_that_pauses_within_the_stall_bound_gets_the_whole_stream() -> None:
    async def main() -> tuple[bytes, dict[str, int]]:
        async with _served(stall_s=3.0) as running:
            reader, writer = await _client(running.url, limit=2**20)
            data = await reader.read(200)
            await asyncio.sleep(1.0)  # the relay and the upstream connection pause meanwhile
            while not data.endswith(b"0\r\n\r\n"):
                more = await asyncio.wait_for(reader.read(2**16), 10)
                assert more, "connection closed before the stream ended"
                data += more
            writer.close()
            await asyncio.sleep(0.1)
            return data, dict(running.gateway.dispatcher.outcomes)

    data, outcomes = asyncio.run(main())
    assert data.count(b'"content": "' + b"x" * 900) == EVENTS
    assert b"data: [DONE]" in data
    assert outcomes == {"completed": 1}


async def _read_steadily(reader: asyncio.StreamReader, seconds: float, chunk: int) -> int:
    """Read `chunk` bytes every 50 ms for `seconds`; the bytes read."""
    got, loop = 0, asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        await asyncio.sleep(0.05)
        data = await reader.read(chunk)
        if not data:
            break
        got += len(data)
    return got


def test_a_client_reading_steadily_behind_the_worker_is_not_dropped() -> None:
    async def main() -> tuple[int, dict[str, int]]:
        async with _served(stall_s=1.0) as running:
            reader, writer = await _client(running.url)
            got = await _read_steadily(reader, 3.0, 16384)  # ~320 KiB/s, far behind a worker at full speed
            outcomes = dict(running.gateway.dispatcher.outcomes)
            writer.transport.abort()
            return got, outcomes

    got, outcomes = asyncio.run(main())
    assert got > 500_000 and outcomes == {}  # still streaming after 3 s: nothing recorded yet


def test_a_reading_client_past_the_total_timeout_ends_as_timed_out() -> None:
    async def main() -> dict[str, int]:
        async with _served(stall_s=30.0, total_s=2.0) as running:
            reader, writer = await _client(running.url)
            await _read_steadily(reader, 3.0, 4096)
            writer.transport.abort()
            return dict(running.gateway.dispatcher.outcomes)

    assert asyncio.run(main()) == {"timed_out": 1}


def test_a_stream_ended_for_a_client_reading_nothing_does_not_hold_its_connection() -> None:
    """total_timeout_s (1.5 s) runs out while the client reads nothing (stall bound 3 s): the stream ends
    as timed_out at once, and its last bytes wait at most the stall bound for a client that takes nothing,
    then the connection is dropped. (The final write waited on the client for as long as it stayed.)"""

    async def main() -> tuple[dict[str, int], bool]:
        async with _served(stall_s=3.0, total_s=1.5) as running:
            reader, writer = await _client(running.url)
            await reader.read(200)
            await asyncio.sleep(5.5)  # 1.5 s to the time-out, then 3 s of nothing taken, and some margin
            outcomes = dict(running.gateway.dispatcher.outcomes)
            closed = False
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(2.0):
                    while await reader.read(2**16):  # what was buffered, then the gateway's close
                        pass
                    closed = True
            writer.transport.abort()
            return outcomes, closed

    outcomes, closed = asyncio.run(main())
    assert outcomes == {"timed_out": 1}
    assert closed
