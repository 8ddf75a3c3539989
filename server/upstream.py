"""The transport under the gateway's `httpx.AsyncClient`: pooled keep-alive connections, sharded per worker,
on a plain-asyncio network backend.

Why not `httpx.AsyncHTTPTransport()` as it comes: profiling the gateway at 32 concurrent requests to one
worker showed over half its CPU inside httpcore's pool bookkeeping — each request scans every pooled
connection twice, with an `O(idle × connections)` keep-alive count and an anyio attribute lookup plus a
`poll()` per idle connection — and a plain httpx client reached ~100 req/s against a worker that serves
~600 req/s. Two changes, both through public extension points, keep httpx and httpcore doing the HTTP:

- **Sharding.** Each worker origin gets `shards` small httpcore pools (each ≤ ceil(limit / shards)
  connections), used round-robin, so the per-request scans are over a handful of connections.
- **Asyncio backend.** `AsyncioBackend` implements httpcore's `AsyncNetworkBackend` on asyncio streams;
  `is_readable` (httpcore's "did the server close this idle connection?") reads the stream's EOF flag and
  the socket's readability, without anyio's per-call attribute tables.

Connections stay keep-alive (`keepalive_expiry`), exceptions are httpcore's own, so httpx maps them to
`httpx.ConnectError`, `httpx.ReadTimeout`, ... exactly as with its default transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import select
import socket
import ssl
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx

# httpcore's socket option type (httpcore._backends.base.SOCKET_OPTION), spelled out: that module is private.
SOCKET_OPTION = tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]


def _readable(sock: socket.socket | None) -> bool:
    """True when `sock` has data or EOF pending (an idle keep-alive connection the server closed)."""
    if sock is None or sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class AsyncioStream(httpcore.AsyncNetworkStream):
    """httpcore stream on asyncio streams. Writes are corked until the next read (or 64 KiB), so a
    request's headers and body leave in one `send()` instead of two."""

    __slots__ = ("_pending", "_pending_bytes", "_reader", "_sock", "_writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._sock: socket.socket | None = writer.get_extra_info("socket")
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    async def _flush(self, timeout: float | None) -> None:
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        try:
            self._writer.write(data)
            if timeout is None:
                await self._writer.drain()
            else:
                async with asyncio.timeout(timeout):
                    await self._writer.drain()
        except TimeoutError:
            raise httpcore.WriteTimeout(f"could not write within {timeout} s") from None
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._pending:
            await self._flush(timeout)
        try:
            if timeout is None:
                return await self._reader.read(max_bytes)
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout(f"no data within {timeout} s") from None
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        self._pending.append(buffer)
        self._pending_bytes += len(buffer)
        if self._pending_bytes >= 65536:
            await self._flush(timeout)

    async def aclose(self) -> None:
        self._pending.clear()
        self._writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await self._writer.wait_closed()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        except TimeoutError:
            raise httpcore.ConnectTimeout("TLS handshake timed out") from None
        except (OSError, ssl.SSLError) as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        self._sock = self._writer.get_extra_info("socket")
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return self._reader.at_eof() or self._writer.is_closing() or _readable(self._sock)
        if info == "socket":
            return self._sock
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._writer.get_extra_info("sockname")
        if info == "server_addr":
            return self._writer.get_extra_info("peername")
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, local_addr=(local_address, 0) if local_address else None, limit=2**20
                )
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock = writer.get_extra_info("socket")
        for option in socket_options or ():
            sock.setsockopt(*option)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[SOCKET_OPTION] | None = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connect to {path} timed out") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _Shard(httpx.AsyncHTTPTransport):
    """httpx's own transport (request/response mapping, exception mapping) over a pool on our backend."""

    def __init__(
        self, limits: httpx.Limits, backend: httpcore.AsyncNetworkBackend, ssl_context: ssl.SSLContext
    ) -> None:
        super().__init__(limits=limits, verify=ssl_context)
        # httpx does not expose `network_backend`; its transport keeps the pool in `_pool`.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=backend,
        )


class ShardedTransport(httpx.AsyncBaseTransport):
    """Per-origin round-robin over `shards` small pools (module docstring). `max_per_origin` bounds the
    connections to one worker; requests beyond it wait for a connection (the client's pool timeout)."""

    def __init__(self, max_per_origin: int = 1024, shards: int = 8, keepalive_expiry: float = 60.0) -> None:
        self._shards = max(1, min(shards, max_per_origin))
        per = math.ceil(max_per_origin / self._shards)
        self._limits = httpx.Limits(
            max_connections=per, max_keepalive_connections=per, keepalive_expiry=keepalive_expiry
        )
        self._backend = AsyncioBackend()
        self._ssl = httpx.create_ssl_context()  # once: loading CA certificates costs ~60 ms each time
        self._origins: dict[tuple[bytes, bytes, int | None], tuple[list[_Shard], Iterator[_Shard]]] = {}

    def _for(self, url: httpx.URL) -> _Shard:
        key = (url.raw_scheme, url.raw_host, url.port)
        entry = self._origins.get(key)
        if entry is None:
            shards = [_Shard(self._limits, self._backend, self._ssl) for _ in range(self._shards)]
            entry = self._origins[key] = (shards, itertools.cycle(shards))
        return next(entry[1])

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._for(request.url).handle_async_request(request)

    async def aclose(self) -> None:
        for shards, _ in self._origins.values():
            for shard in shards:
                await shard.aclose()
        self._origins.clear()
