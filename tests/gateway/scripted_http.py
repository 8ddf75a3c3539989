"""A scripted HTTP/1.1 worker's building blocks for tests over real sockets: read one request, frame a chunk."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

EMPTY_200 = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"  # /health, /metrics: up, nothing to report
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The next request's path and body (raises asyncio.IncompleteReadError when the peer closed)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next((int(x.split(b":")[1]) for x in lines if x.lower().startswith(b"content-length:")), 0)
    body = await reader.readexactly(length) if length else b""
    return lines[0].split()[1], body


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked transfer encoding."""
    return b"%x\r\n%b\r\n" % (len(data), data)


async def serve_chat_streams(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    stream: Callable[[asyncio.StreamWriter], Awaitable[None]],
) -> None:
    """A connection's requests until the peer leaves: /health, /metrics and the like get an empty 200; a chat
    completion the SSE head, then `stream(writer)` writes its chunks (and the last-chunk marker)."""
    try:
        while True:
            path, _ = await read_request(reader)
            if path != b"/v1/chat/completions":
                writer.write(EMPTY_200)
                continue
            writer.write(SSE_HEAD)
            await stream(writer)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
