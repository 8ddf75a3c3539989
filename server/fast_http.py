"""The gateway's HTTP server protocol: uvicorn's httptools protocol, with the proxy endpoints served leanly.

`GatewayHttpProtocol` is `uvicorn.Config(http=...)` for `mosaic serve` (`server.runner`). Every request is
parsed by uvicorn's `HttpToolsProtocol` (llhttp) as usual. A POST whose raw target is exactly one of the
app's `fast_routes` (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`) is then served by a
`FastCycle` instead of uvicorn's `RequestResponseCycle`: the same ASGI endpoint runs (so behaviour is the
endpoint's, byte for byte), without the middleware stack and with a leaner ASGI channel:

- `send` writes a response's status line, headers and first body chunk in **one** `write()` (uvicorn
  writes headers and body separately: two system calls and two loopback segments per answer); header
  validation is skipped because the endpoint only sends headers it built itself;
- `receive` hands the body over as uvicorn does (pausing the socket above 64 KiB buffered) and
  afterwards reports `http.disconnect` once the connection is lost or the response is complete;
- disconnects are pushed: `on_disconnect(callback)` runs the callback from `connection_lost` (the
  gateway's `DisconnectWatch` subscribes instead of running a watcher task per request).

A lost connection is also reported to the response being written when a pipelined request behind it has
already been parsed (uvicorn tells only the newest cycle, which is the queued one).

Everything else — other paths and methods, query strings, upgrades, pipelining order, keep-alive timers,
graceful shutdown (the protocol's `shutdown()` sees `keep_alive` and `response_complete` as on a uvicorn
cycle), concurrency tracking in `server_state.tasks` — is uvicorn's own code path.

Measured (bench/gateway_overhead.py, docs/gateway.md "Performance"): CPU per proxied request and the
number of `send()` calls per non-streaming answer (2 → 1).
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import sys
import termios
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

ASGIApp = Callable[..., Any]
_CLOSE = b"connection: close\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"


class GatewayHttpProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` that serves the app's `fast_routes` (raw path bytes → ASGI app) with `FastCycle`."""

    def __init__(
        self, config: Any, server_state: ServerState, app_state: dict[str, Any], _loop: Any = None
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        routes: dict[str, ASGIApp] = getattr(config.app, "fast_routes", {})
        self.fast_routes = {path.encode(): app for path, app in routes.items()}
        self._running: Any = None  # the cycle whose ASGI task was started last (the one answering now)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn marks only `self.cycle` disconnected, which a pipelined request (parsed while the previous
        response still streams) has replaced: the response being written then never heard of the hang-up
        and kept its worker slot, in-flight ticket and KV reservation to the end of its generation."""
        running = self._running
        super().connection_lost(exc)
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True
            running.message_event.set()

    def on_headers_complete(self) -> None:
        app = self.fast_routes.get(self.url) if self.fast_routes else None
        parser = self.parser
        if app is None or parser.get_method() != b"POST" or parser.should_upgrade():
            super().on_headers_complete()
            return
        scope = self.scope
        scope["method"] = "POST"
        version = parser.get_http_version()
        if version != "1.1":
            scope["http_version"] = version
        path = self.url.decode("ascii")
        scope["path"], scope["raw_path"], scope["query_string"] = path, self.url, b""
        previous = self.cycle
        cycle = self.cycle = FastCycle(self, scope, version != "1.0" and parser.should_keep_alive())
        if previous is None or previous.response_complete:
            self._start_asgi_task(cycle, app)  # type: ignore[arg-type]
        else:  # pipelined behind an unfinished response: uvicorn's queue, in order
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, app))  # type: ignore[arg-type]

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if isinstance(cycle, FastCycle):
            if not cycle.response_complete:
                cycle.body += body
                if len(cycle.body) > HIGH_WATER_LIMIT:
                    self.flow.pause_reading()
                cycle.wake()
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if isinstance(cycle, FastCycle):
            if not cycle.response_complete:
                cycle.more_body = False
                cycle.wake()
        else:
            super().on_message_complete()


class _Event:
    """What uvicorn's protocol calls on a cycle's `message_event`: `set()` (new body bytes, or the
    connection lost). Forwarded to the cycle, which wakes its reader and reports a disconnect."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: FastCycle) -> None:
        self._cycle = cycle

    def set(self) -> None:
        self._cycle.wake()


class FastCycle:
    """One request on the fast path: the attributes uvicorn's protocol reads on a cycle, plus a lean ASGI
    `receive`/`send` (module docstring)."""

    __slots__ = (
        "_body_delivered",
        "_disconnect_callbacks",
        "_head",
        "_waiter",
        "body",
        "chunked",
        "disconnected",
        "keep_alive",
        "message_event",
        "more_body",
        "protocol",
        "response_complete",
        "response_started",
        "scope",
        "waiting_for_100_continue",
    )

    def __init__(self, protocol: GatewayHttpProtocol, scope: dict[str, Any], keep_alive: bool) -> None:
        self.protocol = protocol
        self.scope = scope
        self.keep_alive = keep_alive
        # `Expect: 100-continue` (uvicorn's protocol notes the header): the client sends the body only
        # after an interim 100, which the first read of the body writes, as uvicorn's own cycle does
        self.waiting_for_100_continue: bool = protocol.expect_100_continue
        self.message_event = _Event(self)
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self._head: list[bytes] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._disconnect_callbacks: list[Callable[[], None]] | None = None
        self._body_delivered = False  # the message with more_body=False was returned by receive()

    # ------------------------------------------------------------------ protocol side
    def wake(self) -> None:
        """New body bytes, the body's end, or (when `disconnected`) the connection lost."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self.disconnected and self._disconnect_callbacks:
            callbacks, self._disconnect_callbacks = self._disconnect_callbacks, None
            for callback in callbacks:
                callback()

    def on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run `callback` once when the client disconnects before the response completed (at once if it
        already has). Returns an unsubscribe function."""
        if self.disconnected:
            callback()
            return _noop
        if self._disconnect_callbacks is None:
            self._disconnect_callbacks = []
        callbacks = self._disconnect_callbacks
        callbacks.append(callback)

        def unsubscribe() -> None:
            if callback in callbacks:
                callbacks.remove(callback)

        return unsubscribe

    async def run_asgi(self, app: ASGIApp) -> None:
        """Run the endpoint (uvicorn's protocol starts this as the request's task). The endpoint answers
        its own errors; anything escaping it is answered 500 (or the connection closed) as uvicorn does."""
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            self.protocol.logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started and not self.disconnected:
                self.keep_alive = False
                await self.send(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [
                            (b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", b"21"),
                        ],
                    }
                )
                await self.send({"type": "http.response.body", "body": b"Internal Server Error"})
            else:
                self.protocol.transport.close()
        else:
            if not self.response_complete and not self.disconnected:
                self.protocol.logger.error("ASGI callable returned without completing response.")
                self.protocol.transport.close()

    # ------------------------------------------------------------------ ASGI channel
    async def receive(self) -> dict[str, Any]:
        protocol = self.protocol
        if not self.disconnected and not self.response_complete and self.more_body and not self.body:
            if self.waiting_for_100_continue and not protocol.transport.is_closing():
                protocol.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.waiting_for_100_continue = False
            protocol.flow.resume_reading()
            await self._wait()
        elif not self.disconnected and not self.response_complete and self._body_delivered:
            await self._wait()  # the body was handed over: the next event is the disconnect
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body, self.body = bytes(self.body), bytearray()
        if self.more_body:
            protocol.flow.resume_reading()
        else:
            # an empty body is complete before the first read: that read must still get its (empty) last
            # message, not wait for a disconnect that a client waiting for its answer never sends
            self._body_delivered = True
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    async def send(self, message: dict[str, Any]) -> None:
        protocol = self.protocol
        if protocol.flow.write_paused and not self.disconnected:
            await protocol.flow.drain()
        if self.disconnected or self.response_complete:
            return
        if message["type"] == "http.response.start":
            if self.response_started:
                raise RuntimeError("http.response.start sent twice")
            self.response_started = True
            self.waiting_for_100_continue = False  # answered without the body (e.g. 413): no interim 100
            status = message["status"]
            chunked = status >= 200 and status not in (204, 304)  # unless a content-length is sent
            head = [STATUS_LINE[status], _default_headers(protocol.server_state.default_headers)]
            if _DEFAULTS[2]:
                chunked = False
            for name, value in message.get("headers", ()):
                head += (name, b": ", value, b"\r\n")
                if name == b"content-length":
                    chunked = False
            if chunked:
                head.append(_CHUNKED)
            if not self.keep_alive:
                head.append(_CLOSE)
            head.append(b"\r\n")
            self.chunked = chunked
            self._head = head  # written with the first body chunk
            return
        if message["type"] != "http.response.body" or not self.response_started:
            raise RuntimeError(f"unexpected ASGI message {message['type']!r}")
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        out = self._head or []
        self._head = None
        if self.chunked:
            if body:
                out += (b"%x\r\n" % len(body), body, b"\r\n")
            if not more:
                out.append(b"0\r\n\r\n")
        elif body:
            out.append(body)
        if out:
            protocol.transport.write(b"".join(out))
        if not more:
            self.response_complete = True
            self.wake()  # a disconnect watcher waiting on receive() gets http.disconnect
            if not self.keep_alive:
                protocol.transport.close()
            protocol.on_response_complete()

    # ------------------------------------------------------------------ direct writes (relays)
    def write(self, body: bytes) -> bool:
        """`send({"type": "http.response.body", "body": body, "more_body": True})` without the message and
        the await, for a relay writing from a protocol callback (`server.responses.StreamSession.push`):
        same bytes on the wire. False when the client's socket is over its high-water mark: `await
        drain()` before writing more (where `send` would wait before its write). A no-op once the client
        disconnected or the response completed, as `send` is."""
        if self.disconnected or self.response_complete or not body:
            return True
        if not self.response_started:
            raise RuntimeError("http.response.body before http.response.start")
        head = self._head
        if head is not None:
            self._head = None
            head += (b"%x\r\n" % len(body), body, b"\r\n") if self.chunked else (body,)
            data = b"".join(head)
        elif self.chunked:
            data = b"%x\r\n%b\r\n" % (len(body), body)
        else:
            data = body
        protocol = self.protocol
        protocol.transport.write(data)
        return not protocol.flow.write_paused

    async def drain(self) -> None:
        """Wait until the client's socket takes writes again (`write` returned False); at once if it does."""
        flow = self.protocol.flow
        if flow.write_paused and not self.disconnected:
            await flow.drain()

    async def drain_within(self, stall_s: float, budget_s: float) -> None:
        """`drain()`, for at most `budget_s` (then `TimeoutError`). A client connected but reading nothing for
        `stall_s` raises `ClientStalled` (a relay would otherwise hold its worker slot and KV reservation for
        as long as it stays connected); one that reads, however slowly, is waited for: each `stall_s` in
        which the write buffer shrank starts the next."""
        loop = asyncio.get_running_loop()
        end = loop.time() + budget_s
        while True:
            before = self._unread()
            wait = min(stall_s, end - loop.time())
            if wait <= 0:
                raise TimeoutError
            try:
                async with asyncio.timeout(wait):
                    await self.drain()
                return
            except TimeoutError:
                if self.disconnected:
                    return
                if wait < stall_s:  # the budget ran out, not the client's patience
                    raise
                if self._unread() >= before:
                    raise ClientStalled(f"the client read nothing for {stall_s:g} s") from None

    def _unread(self) -> int:
        """Bytes written to the client and not yet taken: the transport's buffer plus, where the platform
        tells (Linux's SIOCOUTQ), the socket's send queue not yet acknowledged. The transport's buffer alone
        does not move while a large kernel send buffer waits to become writable again, so a client reading
        slowly but steadily looked stalled."""
        transport = self.protocol.transport
        size = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if _OUTQ is None or sock is None:
            return size
        try:
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            return size
        return size + queued

    def abort(self) -> None:
        """Drop the client's connection at once (one that stopped reading): nothing more is sent."""
        self.disconnected = True
        self.keep_alive = False
        self.protocol.transport.abort()


_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None  # = SIOCOUTQ


class ClientStalled(Exception):
    """The client stopped reading a response it is still connected for (`FastCycle.drain_within`)."""


def _noop() -> None:
    return None


# uvicorn replaces `server_state.default_headers` (date, server) with a new list once a second: encode each
# list once, not per response. [the list, its bytes, whether it carries a content-length]
_DEFAULTS: list[Any] = [None, b"", False]


def _default_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    if headers is not _DEFAULTS[0]:
        _DEFAULTS[:] = [
            headers,
            b"".join(name + b": " + value + b"\r\n" for name, value in headers),
            any(name == b"content-length" for name, _ in headers),
        ]
    return _DEFAULTS[1]  # type: ignore[no-any-return]


# uvicorn internals `GatewayHttpProtocol` builds on. They are not public API (`_start_asgi_task` appeared
# after uvicorn 0.40), so the runner checks them before choosing this protocol instead of assuming them.
_REQUIRED_INTERNALS = (
    "_start_asgi_task",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "connection_lost",
)


def compatible() -> bool:
    """True when the installed uvicorn's httptools protocol has every internal this module extends."""
    return all(callable(getattr(HttpToolsProtocol, name, None)) for name in _REQUIRED_INTERNALS)
