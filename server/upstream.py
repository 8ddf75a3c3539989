"""The gateway's HTTP/1.1 client to workers: pooled keep-alive connections on asyncio protocols.

    pool = ConnectionPool(max_per_origin=1024, connect_timeout_s=2, read_timeout_s=60, pool_timeout_s=60)
    resp = await pool.post(url, body, headers)    # returns once the status line and headers arrived
    resp.status_code, resp.headers.get("content-type")
    await resp.aread()                            # or: async for chunk in resp.aiter_raw(): ...
    await resp.aclose()                           # unread body → the connection is closed (aborts upstream)

Why not httpx/httpcore: at 32 concurrent requests they were two thirds of the gateway's CPU per request
(cProfile: connection-pool bookkeeping, anyio locks, h11's event machinery, request/response models),
for a client that only ever POSTs JSON to HTTP/1.1 servers it knows (vLLM and the simulated worker, both
uvicorn). This client does exactly that and nothing else: one `write()` per request, responses parsed
from the socket buffer as they arrive (status line, headers, then `Content-Length`, chunked or
close-delimited bodies), no content decoding (no `Accept-Encoding` is sent, so workers answer
identity). Errors are httpx's exception classes, so callers classify them as before:

| what | raised |
|---|---|
| cannot connect / connection refused | `httpx.ConnectError` / `httpx.ConnectTimeout` after `connect_timeout_s` |
| no connection free within `pool_timeout_s` (`max_per_origin` in use) | `httpx.PoolTimeout` |
| the caller's own time-out (a cancellation) while waiting for a free connection | what the caller raises; `post(slot=SlotWait())` tells the case apart: `slot.waiting` stays True |
| no byte for `read_timeout_s` (up to 1/8 more, at most 1 s) while waiting for the body, or for the headers beyond `post(head_timeout=)` | `httpx.ReadTimeout` |
| reset while reading | `httpx.ReadError` |
| closed before a complete response, malformed response | `httpx.RemoteProtocolError` |
| closed by the gateway: the worker fails its health checks and sent nothing on it (`sever_silent`) | `WorkerSevered` (an `httpx.ReadError`) |

Connections. Per origin (scheme, host, port): idle connections are reused last-in first-out; at most
`max_per_origin` exist at once, further requests wait for one to be released. An idle connection is
dropped when the server closed it (seen at once: the protocol gets the EOF) or after
`keepalive_expiry_s` idle. When a *reused* connection closes before any byte of the response arrived
(the server timed out the idle connection as the request was sent), the request is sent once more on a
new connection; any other failure is raised. A response whose body was not read to the end is closed
with its connection — that is how an upstream request is aborted.

Severing. `sever_silent(url, silent_s)` closes the connections to a worker that have waited `silent_s` or
longer for a byte, failing their reads with `WorkerSevered`, and its idle ones: the registry calls it for a
worker that fails its health checks (`health.sever_silent_requests`), so requests on a worker that went away
without closing its connections (a lost node, a partition, a frozen process) end now instead of at their
first-token or stall timeouts. A connection that still receives bytes is left alone. Only connections
waiting for bytes are looked at: their read deadline says since when (`_Deadlines`), at no cost per read.

Modules: this one holds the pool and its connections (`_Conn`, the asyncio protocol) and read deadlines;
`server.h1_response` parses responses (head, Content-Length/chunked/close-delimited bodies).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from server.h1_response import H1Response, UpstreamResponse, _read_head, _Reset

__all__ = ["ConnectionPool", "H1Response", "SlotWait", "UpstreamResponse", "WorkerSevered"]


# Bytes a connection buffers while nobody reads its response (a relay waiting for a slow client) before
# it stops reading the socket: the worker then blocks on its own send, as it would for a slow client of its own.
READ_HIGH_WATER = 256 * 1024


class WorkerSevered(httpx.ReadError):
    """The gateway closed the connection (`ConnectionPool.sever_silent`): its worker fails its health checks
    and sent nothing on it for a while."""


class SlotWait:
    """Whether a `post` is waiting for a connection slot: `waiting` is True from the moment it queues for
    one (`max_per_origin` connections in use) until it gets one. True once the post failed: it failed while
    waiting (`httpx.PoolTimeout`, or the caller's own time-out: the P/D prefill hop's bound is shorter than
    `pool_timeout_s`, and so may be what is left of a request's budget on the decode hop), so the gateway's own
    connection limit ended it and the worker never got the request."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting = False


class _Conn(asyncio.Protocol):
    """One keep-alive connection: a receive buffer, EOF/close flags, and one waiter for more bytes."""

    __slots__ = (
        "_waiter",
        "buf",
        "closed",
        "error",
        "idle_since",
        "on_data",
        "origin",
        "reading_paused",
        "reused",
        "transport",
    )

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.closed = False  # EOF or connection lost
        self.error: Exception | None = None
        self.idle_since = 0.0
        self.reused = False
        self.reading_paused = False
        self._waiter: asyncio.Future[None] | None = None
        # set while `H1Response.push` relays: called with the new bytes in `buf` instead of waking the reader
        self.on_data: Callable[[], None] | None = None

    # -------------------------------------------------------------- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        on_data = self.on_data
        if on_data is not None:
            on_data()
        elif self._waiter is not None:
            self.wake()
        elif len(self.buf) > READ_HIGH_WATER and self.transport is not None:
            # nobody is reading (the relay waits for its client): stop taking the worker's bytes until
            # someone asks for more (`more`), rather than buffer a whole generation in memory
            self.transport.pause_reading()
            self.reading_paused = True

    def eof_received(self) -> bool:
        self.closed = True
        self.wake()
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if exc is not None:
            self.error = exc
        self.wake()
        self.origin.forget(self)

    def wake(self) -> None:
        """End the current `more()` wait (new bytes, EOF, close, or a pusher's word)."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -------------------------------------------------------------- reading
    async def more(self, timeout: float) -> None:
        """Wait until new bytes, EOF or close (`httpx.ReadTimeout` after `timeout` seconds, see `_Deadlines`)."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        self.resume_reading()
        deadlines = self.origin.deadlines
        deadlines.add(self, time.monotonic() + timeout, timeout)
        try:
            await waiter
        finally:
            deadlines.discard(self)
            self._waiter = None

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def restart_deadline(self, timeout: float) -> None:
        """The current `more()` wait starts over (a pusher delivered bytes): `timeout` from now. The wait
        registered the connection and armed the sweep already: only its deadline moves (once per read)."""
        self.origin.deadlines.waiting[self] = (time.monotonic() + timeout, timeout)

    def expire(self, timeout: float) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(httpx.ReadTimeout(f"no data from the worker within {timeout:g} s"))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self.origin.forget(self)

    def sever(self, message: str) -> None:
        """Fail the current read with `WorkerSevered(message)` and drop the connection (a reset: nothing
        more is owed to a worker that stopped answering; the abort is how a request ends upstream)."""
        exc = WorkerSevered(message)
        self.error = exc
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)  # before the close: a reused connection closed with no byte would be resent
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()
        self.origin.forget(self)


class _Deadlines:
    """Read deadlines of the connections waiting for bytes, checked by one timer every `period` seconds
    instead of a timer per wait (a stream waits once per chunk). A wait times out between `timeout` and
    `timeout + period` seconds; the pool uses period = min(1 s, timeout / 8)."""

    __slots__ = ("_handle", "period", "waiting")

    def __init__(self, period: float) -> None:
        self.period = period
        self.waiting: dict[_Conn, tuple[float, float]] = {}  # conn → (deadline, timeout)
        self._handle: asyncio.TimerHandle | None = None

    def add(self, conn: _Conn, deadline: float, timeout: float) -> None:
        self.waiting[conn] = (deadline, timeout)
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(self.period, self._sweep)

    def discard(self, conn: _Conn) -> None:
        self.waiting.pop(conn, None)

    def _sweep(self) -> None:
        self._handle = None
        now = time.monotonic()
        for conn, (deadline, timeout) in list(self.waiting.items()):
            if now >= deadline:
                del self.waiting[conn]
                conn.expire(timeout)
        if self.waiting:
            self._handle = asyncio.get_running_loop().call_later(self.period, self._sweep)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class _Origin:
    """The connections to one (scheme, host, port): idle ones (LIFO), a count, and waiters for a slot."""

    __slots__ = ("_members", "count", "deadlines", "host", "idle", "port", "ssl", "waiters")

    def __init__(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None, deadlines: _Deadlines
    ) -> None:
        self.host, self.port, self.ssl = host, port, ssl_context
        self.deadlines = deadlines
        self.idle: dict[_Conn, None] = {}  # insertion-ordered: popitem() takes the most recent (LIFO)
        self.count = 0  # connections open or being opened
        self.waiters: deque[asyncio.Future[_Conn | None]] = deque()
        self._members: set[_Conn] = set()

    def forget(self, conn: _Conn) -> None:
        """`conn` is closed: it leaves the idle list and frees its slot (idempotent)."""
        if conn not in self._members:
            return
        self._members.discard(conn)
        self.idle.pop(conn, None)
        self.free_slot()

    def free_slot(self) -> None:
        """One connection fewer: its slot goes to the first waiter (who then connects), else back to the pool."""
        if not self._hand_over(None):
            self.count -= 1

    def release(self, conn: _Conn) -> None:
        """`conn` finished a response and may be reused."""
        conn.reused = True
        conn.resume_reading()  # its idle close (EOF) must be seen, and the next response read
        if not self._hand_over(conn):
            conn.idle_since = time.monotonic()
            self.idle[conn] = None

    def retire(self, conn: _Conn) -> None:
        """Close `conn` keeping its slot for the caller's new connection (its later `forget` is a no-op)."""
        self._members.discard(conn)
        self.idle.pop(conn, None)
        conn.close()

    def _hand_over(self, conn: _Conn | None) -> bool:
        """Give `conn` (or a free slot, None) to the first live waiter; False when nobody waits."""
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(conn)
                return True
        return False

    def adopt(self, conn: _Conn) -> None:
        self._members.add(conn)


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections per worker origin (module docstring)."""

    def __init__(
        self,
        max_per_origin: int = 1024,
        *,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 60.0,
        pool_timeout_s: float = 60.0,
        keepalive_expiry_s: float = 60.0,
    ) -> None:
        self.max_per_origin = max_per_origin
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.pool_timeout_s = pool_timeout_s
        self.keepalive_expiry_s = keepalive_expiry_s
        self._origins: dict[tuple[str, str, int], _Origin] = {}
        self._targets: dict[
            str, tuple[_Origin, bytes]
        ] = {}  # url → (origin, "POST <path> HTTP/1.1\r\nHost: …\r\n")
        self._ssl: ssl.SSLContext | None = None
        self._deadlines = _Deadlines(min(1.0, read_timeout_s / 8))

    def _target(self, url: str) -> tuple[_Origin, bytes]:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = self._request_line("POST", url)
        return target

    @staticmethod
    def origin_key(url: str) -> tuple[str, str, int]:
        """(scheme, host, port) of `url`: the connections it shares (httpx.UnsupportedProtocol if none)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"cannot send to {url!r}")
        return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)

    def _request_line(self, method: str, url: str) -> tuple[_Origin, bytes]:
        """(the origin's connections, the request line and Host header) for `method` on `url`."""
        key = self.origin_key(url)
        parts = urlsplit(url)
        https = parts.scheme == "https"
        origin = self._origins.get(key)
        if origin is None:
            if https and self._ssl is None:
                self._ssl = httpx.create_ssl_context()  # once: loading CA certificates is slow
            ssl_context = self._ssl if https else None
            origin = self._origins[key] = _Origin(key[1], key[2], ssl_context, self._deadlines)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode()
        return origin, head

    async def post(
        self,
        url: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        head_timeout: float | None = None,
        slot: SlotWait | None = None,
        method: str | None = None,
    ) -> H1Response:
        """POST `body` to `url`; returns once the response's headers arrived (module docstring).

        `head_timeout` bounds the wait for the headers (default `read_timeout_s`): a non-streaming answer
        sends its first byte only when generation ends, so the caller gives the request's own budget.
        `slot`, when given, shows whether the post is (or failed while) waiting for a connection slot.
        `method`: another method than POST (a stored response's GET), its request line built per call (rare)."""
        head_timeout = self.read_timeout_s if head_timeout is None else head_timeout
        origin, head = self._target(url) if method is None else self._request_line(method, url)
        parts = [head]  # one join of a list (a generator unpacked into a tuple costs a frame per header)
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        parts += (b"Content-Length: %d\r\n\r\n" % len(body), body)
        request = b"".join(parts)
        conn = await self._acquire(origin, slot=slot)
        try:
            return await self._exchange(conn, request, head_timeout)
        except _Reset:
            conn = await self._acquire(origin, fresh=True, slot=slot)
            try:
                return await self._exchange(conn, request, head_timeout)
            except _Reset:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.") from None

    async def _exchange(self, conn: _Conn, request: bytes, head_timeout: float) -> H1Response:
        try:
            assert conn.transport is not None
            conn.transport.write(request)
            while True:
                resp = await _read_head(conn, head_timeout)
                if resp is not None:
                    return resp
        except BaseException:
            conn.close()
            raise

    async def _acquire(self, origin: _Origin, fresh: bool = False, slot: SlotWait | None = None) -> _Conn:
        now = time.monotonic()
        while origin.idle and not fresh:
            conn, _ = origin.idle.popitem()
            if not conn.closed and not conn.buf and now - conn.idle_since < self.keepalive_expiry_s:
                return conn
            conn.close()
        if origin.count >= self.max_per_origin:
            if slot is not None:
                slot.waiting = True
            got = await self._wait_for_slot(origin)
            if slot is not None:
                slot.waiting = False
            if got is not None:
                if not fresh:
                    return got  # a released connection, handed over
                # the resend after an idle close needs a new connection, not another reused one (which the
                # worker may close the same way): this one is closed, its slot kept for the new one
                origin.retire(got)
            # else: a slot, handed over with its count already taken
        else:
            origin.count += 1
        try:
            return await self._connect(origin)
        except BaseException:
            origin.free_slot()
            raise

    async def _wait_for_slot(self, origin: _Origin) -> _Conn | None:
        fut: asyncio.Future[_Conn | None] = asyncio.get_running_loop().create_future()
        origin.waiters.append(fut)
        try:
            async with asyncio.timeout(self.pool_timeout_s):
                return await fut
        except TimeoutError:
            # The deadline and a hand-over can land in one loop turn: what was handed over is ours (dropping
            # it lost the slot for good, and with it, at max_per_origin 1, the worker)
            if fut.done() and not fut.cancelled():
                return fut.result()
            raise httpx.PoolTimeout(
                f"no connection to the worker free within {self.pool_timeout_s:g} s"
            ) from None
        except BaseException:
            if fut.done() and not fut.cancelled():  # handed a connection or slot we will not use: pass it on
                passed = fut.result()
                if passed is not None:
                    origin.release(passed)
                else:
                    origin.free_slot()
            raise

    async def _connect(self, origin: _Origin) -> _Conn:
        loop = asyncio.get_running_loop()
        conn = _Conn(origin)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(
                    lambda: conn,
                    origin.host,
                    origin.port,
                    ssl=origin.ssl,
                    server_hostname=origin.host if origin.ssl else None,
                )
        except BaseException as exc:
            if conn.transport is not None:  # connected just as the timeout or a cancellation hit
                conn.transport.close()
            if isinstance(exc, TimeoutError):
                raise httpx.ConnectTimeout(f"connect to {origin.host}:{origin.port} timed out") from None
            if isinstance(exc, OSError | ssl.SSLError):
                raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
            raise
        origin.adopt(conn)
        return conn

    def sever_silent(self, url: str, silent_s: float, message: str) -> int:
        """Close the connections to `url`'s origin that have waited `silent_s` or longer for a byte (each
        read fails with `WorkerSevered(message)`) and its idle ones (module docstring). Returns how many
        waiting connections were closed."""
        try:
            origin = self._origins.get(self.origin_key(url))
        except httpx.UnsupportedProtocol:
            return 0
        if origin is None:
            return 0
        for conn in list(origin.idle):
            conn.close()
        now = time.monotonic()
        waiting = self._deadlines.waiting
        silent = [
            c
            for c, (deadline, timeout) in waiting.items()
            if c.origin is origin and now - (deadline - timeout) >= silent_s
        ]
        for conn in silent:
            waiting.pop(conn, None)
            conn.sever(message)
        return len(silent)

    async def aclose(self) -> None:
        self._deadlines.close()
        for origin in self._origins.values():
            for conn in list(origin._members):
                conn.close()
        self._origins.clear()
        self._targets.clear()
