"""A worker's HTTP/1.1 response as `server.upstream.ConnectionPool` reads it: head parsing and body framing.

    resp = await _read_head(conn, timeout)        # status line + headers from the connection's buffer
    resp.status_code, resp.headers["content-type"]
    await resp.aread()  /  async for chunk in resp.aiter_raw(): ...   /  resp.close()
    await read_at_most(resp, limit)               # the body, or AnswerTooLarge past `limit` bytes

Parsed from the connection's receive buffer as bytes arrive: the status line and headers (a 1xx interim
response is skipped; more than `MAX_HEAD_BYTES` is a protocol error), then the body delimited by
`Content-Length`, chunked transfer coding (decoded incrementally: a chunk may be split anywhere) or the
server closing the connection; 204/304 have none. No content decoding (the pool sends no
`Accept-Encoding`). When the body was read to the end on a keep-alive connection, the connection goes
back to its pool; otherwise it is closed — which is how an upstream request is aborted. Errors are
httpx's classes (`ReadError`, `ReadTimeout`, `RemoteProtocolError`), as the module `server.upstream` lists.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import httpx

try:  # llhttp, which uvicorn[standard] brings: chunked bodies decoded in C (`_Llhttp`)
    import httptools
except ImportError:  # pragma: no cover - uvicorn without [standard]: the Python decoder below
    httptools = None

if TYPE_CHECKING:
    from server.upstream import _Conn

MAX_HEAD_BYTES = 65536  # status line + headers; more is a protocol error
_WS = " \t\r\n\x0b\x0c"  # what bytes.strip() removes (str.strip() would also take latin-1's \xa0, \x85)


class UpstreamResponse(Protocol):
    """What the dispatcher uses of a worker's response (`httpx.Response` has it too, for injected transports)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def aread(self) -> bytes: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class AnswerTooLarge(Exception):
    """A worker's answer is longer than its reader's bound (`read_at_most`)."""


async def read_at_most(resp: UpstreamResponse, limit: int) -> bytes:
    """The whole body of `resp`, or AnswerTooLarge as soon as it is known to be longer than `limit` bytes:
    from its `Content-Length` before a byte is read, else once the bytes read pass it. For answers the
    gateway reads only to pick a field from, so a worker gone wrong cannot make it hold an unbounded body.
    The caller closes `resp`; a body not read to its end closes the connection with it."""
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise AnswerTooLarge(f"Content-Length {declared} is over the {limit}-byte bound")
    if isinstance(
        resp, httpx.Response
    ):  # an injected transport's (tests): a body it was given is read already
        body = await resp.aread()
        if len(body) > limit:
            raise AnswerTooLarge(f"the body is over the {limit}-byte bound")
        return body
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_raw():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"the body passed the {limit}-byte bound")
        parts.append(chunk)
    return b"".join(parts)


class _Reset(Exception):
    """A reused connection closed before any response byte: the request may be sent again."""


async def _read_head(conn: _Conn, timeout: float) -> H1Response | None:
    """Parse the status line and headers; None for a 1xx interim response (skipped)."""
    buf = conn.buf
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        if conn.closed:
            if not buf and conn.reused:
                raise _Reset  # the server closed the idle connection as the request went out
            if conn.error is not None:
                raise httpx.ReadError(str(conn.error) or type(conn.error).__name__)
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        if len(buf) > MAX_HEAD_BYTES:
            raise httpx.RemoteProtocolError("response headers too large")
        await conn.more(timeout)
    lines = buf[:end].decode("latin-1").split("\r\n")  # decoded once: header values are latin-1
    del buf[: end + 4]
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:80].encode('latin-1')!r}")
    status = int(code)
    if status < 100 or status > 599:  # no HTTP status (RFC 9110 §15): the gateway could not answer with it
        raise httpx.RemoteProtocolError(
            f"status {status} outside 100-599 in {lines[0][:80].encode('latin-1')!r}"
        )
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise httpx.RemoteProtocolError(f"malformed header line {line[:80].encode('latin-1')!r}")
        key = name.strip(_WS).lower()
        val = value.strip(_WS)
        headers[key] = f"{headers[key]}, {val}" if key in headers else val
    if 100 <= status < 200:
        return None  # interim (100 Continue, 103 Early Hints): the real response follows
    keep = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    if status in (204, 304):
        length: int | None = 0
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        length = None
    elif "content-length" in headers:
        cl = headers["content-length"].split(",")[0].strip()
        if not cl.isdigit():
            raise httpx.RemoteProtocolError(f"bad Content-Length {cl!r}")
        length = int(cl)
    else:
        length, keep = -1, False  # delimited by the server closing the connection
    return H1Response(conn, status, headers, length, keep, timeout)


_SIZE, _DATA, _CRLF, _TRAILER = range(4)  # chunked decoder states: size line, data, CRLF after data, trailers
_CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


class _Llhttp:
    """A chunked body decoded by llhttp (httptools' response parser, primed with a head that announces a
    chunked body), when httptools is installed: the framing is parsed in C and each chunk's data arrives
    by `on_body`. The Python loop (`H1Response._take_chunked`) cost ≈ 7k instructions per chunk — a
    relayed stream has one per token — this ≈ 1/4 of that.

    Same results on well-formed framing, chunk extensions and trailers included; on malformed framing
    both raise `RemoteProtocolError`, llhttp on a few more inputs than the loop (whitespace or a `0x`
    prefix around a chunk size, which int() tolerates; no HTTP server writes them). Bytes after the last
    chunk (none on a well-behaved keep-alive connection) set `extra`: the connection is then closed, not
    reused, as with the loop (which leaves them in the buffer)."""

    __slots__ = ("done", "end", "extra", "on_body", "parser", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        # llhttp hands each chunk's data to `on_body`: the list's own append (a C call, no Python frame per
        # chunk); what a second message after ours would add is cut off at `end` (see `take`)
        self.on_body = self.parts.append
        self.done = False
        self.end = 0  # len(parts) when the body ended
        self.extra = False
        self.parser = httptools.HttpResponseParser(self)
        self.parser.feed_data(_CHUNKED_HEAD)

    def on_message_begin(self) -> None:
        if self.done:  # a second message after ours
            self.extra = True

    def on_message_complete(self) -> None:
        if not self.done:
            self.done = True
            self.end = len(self.parts)

    def take(self, buf: bytearray) -> bytes:
        """Decode all of `buf` (emptied, unless bytes follow the last chunk); the data bytes."""
        try:
            self.parser.feed_data(buf)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not self.done:
                raise httpx.RemoteProtocolError(f"bad chunked body: {exc}") from None
            self.extra = True
        if not self.extra:
            buf.clear()
        parts = self.parts  # the list `on_body` appends to: emptied in place, never replaced
        if not parts:
            return b""
        if self.done:
            del parts[self.end :]
            self.end = 0
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return data


def _chunk_size(buf: bytearray, pos: int, eol: int) -> int:
    """The size on a chunk-size line with an extension (`1a;name=value`)."""
    semi = buf.find(b";", pos, eol)
    try:
        if semi >= 0:
            return int(buf[pos:semi], 16)
    except ValueError:
        pass
    raise httpx.RemoteProtocolError("bad chunk size")


class H1Response:
    """A worker's response: headers parsed, body read on demand (see module docstring)."""

    __slots__ = (
        "_chunk_left",
        "_conn",
        "_done",
        "_keep",
        "_left",
        "_llhttp",
        "_state",
        "_timeout",
        "headers",
        "status_code",
    )

    def __init__(
        self,
        conn: _Conn,
        status: int,
        headers: dict[str, str],
        length: int | None,
        keep: bool,
        timeout: float,
    ) -> None:
        self._conn: _Conn | None = conn
        self.status_code = status
        self.headers = headers
        self._left = length  # bytes of body left; None → chunked; -1 → until close
        self._keep = keep
        self._timeout = timeout
        self._state = _SIZE  # chunked decoder state (the Python loop's)
        self._chunk_left = 0
        self._llhttp = _Llhttp() if length is None and httptools is not None else None
        self._done = length == 0
        if self._done:
            self._finish()

    def bound_gaps(self, timeout: float) -> None:
        """Bound each later wait for body bytes by `timeout`. The head and a stream's first event wait with
        the request's budget (`ConnectionPool.post(head_timeout=)`), the gaps after it with the stall timeout."""
        self._timeout = timeout

    def aiter_raw(self) -> _BodyIter:
        """The body as it arrives (chunked framing removed, no content decoding)."""
        return _BodyIter(self)

    async def aread(self) -> bytes:
        parts: list[bytes] = []
        while True:
            data = await self._next()
            if not data:
                return b"".join(parts)
            parts.append(data)

    async def aclose(self) -> None:
        """Release the connection: kept for reuse when the body was read to the end, else closed."""
        self.close()

    def close(self) -> None:
        """`aclose()`, synchronously (nothing here waits)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # -------------------------------------------------------------- body
    async def _next(self) -> bytes:
        """The next body bytes available; b"" at the end of the body."""
        while not self._done:
            conn = self._conn
            if conn is None:
                raise httpx.ReadError("response closed")
            data = self._take(conn.buf)
            if data:
                return data
            if self._done:
                break
            if conn.closed:
                if self._left == -1:
                    self._done = True
                    break
                if conn.error is not None:
                    raise httpx.ReadError(str(conn.error) or type(conn.error).__name__)
                raise httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body"
                )
            await conn.more(self._timeout)
        self._finish()
        return b""

    @property
    def ended(self) -> bool:
        """The body was read to its end (the last piece read was the last)."""
        return self._done

    async def push(self, deliver: Callable[[bytes, bool], bool]) -> bool:
        """Hand the body to `deliver(data, last)` as it arrives (`last`: the body ends with it, so a relay
        can send it with the end of its own response), called from the connection's `data_received`: a relay
        writes each piece on without a task wake-up, a future and a coroutine-chain resume per read (the
        bulk of a relayed chunk's cost when `async for` pulls it). True at the end of the body; False when
        `deliver` returned False (a pause: e.g. the client's socket is full), after which `push` may be
        called again. Raises what `aread` raises, and what `deliver` raises (the read deadline restarts
        with every piece delivered, so `read_timeout_s` still bounds each gap between pieces)."""
        while not self._done:
            conn = self._conn
            if conn is None:
                raise httpx.ReadError("response closed")
            data = self._take(conn.buf)  # what arrived while nobody was listening
            if data and not deliver(data, self._done):
                return False
            if self._done:
                break
            if conn.closed:
                await self._next()  # the end of a close-delimited body, or the error a cut body raises
                return True
            pusher = _Pusher(self, conn, deliver)
            conn.on_data = pusher.on_data
            try:
                await conn.more(self._timeout)  # woken by the pusher (end, pause, error), EOF or close
            finally:
                conn.on_data = None
            if pusher.error is not None:
                raise pusher.error
            if pusher.paused:
                return False
        self._finish()
        return True

    def _take(self, buf: bytearray) -> bytes:
        if not buf:
            return b""
        left = self._left
        if left is None:
            dec = self._llhttp
            if dec is None:
                return self._take_chunked(buf)
            data = dec.take(buf)
            if dec.done:
                self._done = True
            return data
        if left == -1:
            data = bytes(buf)
            buf.clear()
            return data
        if len(buf) <= left:
            data = bytes(buf)
            buf.clear()
        else:
            data = bytes(buf[:left])
            del buf[:left]
        self._left = left - len(data)
        if self._left == 0:
            self._done = True
        return data

    def _take_chunked(self, buf: bytearray) -> bytes:
        """Decode what `buf` holds of a chunked body: the data bytes (framing removed) from every complete
        or partial chunk; keeps the decoder state across calls (a chunk may be split anywhere)."""
        out: list[bytearray] = []
        pos, n = 0, len(buf)
        state, left = self._state, self._chunk_left
        find = buf.find
        while pos < n:
            if state == _SIZE:
                eol = find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > 1024:
                        raise httpx.RemoteProtocolError("chunk size line too long")
                    break
                try:  # int() ignores surrounding whitespace
                    left = int(buf[pos:eol], 16)
                except ValueError:  # a chunk extension (";...") is dropped; looked for only here (rare)
                    left = _chunk_size(buf, pos, eol)
                pos = eol + 2
                if not left:
                    state = _TRAILER
                    continue
                end = pos + left
                if end + 2 <= n:  # the common case: the whole chunk and its CRLF are here, one step
                    if buf[end] != 13 or buf[end + 1] != 10:
                        raise httpx.RemoteProtocolError("chunk not followed by CRLF")
                    out.append(buf[pos:end])
                    pos, left = end + 2, 0
                    continue
                state = _DATA
            elif state == _DATA:
                take = left if left <= n - pos else n - pos
                out.append(buf[pos : pos + take])
                pos += take
                left -= take
                if left:
                    break
                state = _CRLF
            elif state == _CRLF:
                if n - pos < 2:
                    break
                if buf[pos] != 13 or buf[pos + 1] != 10:
                    raise httpx.RemoteProtocolError("chunk not followed by CRLF")
                pos += 2
                state = _SIZE
            else:  # trailer: header lines until an empty one
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                empty = eol == pos
                pos = eol + 2
                if empty:
                    self._done = True
                    break
        self._state, self._chunk_left = state, left
        del buf[:pos]
        return b"".join(out)

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._keep and not conn.closed and not conn.buf:
            conn.origin.release(conn)
        else:
            conn.close()


class _Pusher:
    """`H1Response.push`'s `data_received` hook for one wait: decodes what arrived and delivers it; wakes the
    waiting task (and unhooks itself) at the body's end, on a pause, or when decoding or `deliver` raised."""

    __slots__ = ("_conn", "_deliver", "_resp", "error", "paused")

    def __init__(self, resp: H1Response, conn: _Conn, deliver: Callable[[bytes, bool], bool]) -> None:
        self._resp, self._conn, self._deliver = resp, conn, deliver
        self.error: BaseException | None = None
        self.paused = False

    def on_data(self) -> None:
        conn, resp = self._conn, self._resp
        try:
            data = resp._take(conn.buf)
            if data and not self._deliver(data, resp._done):
                self.paused = True
            elif not resp._done:
                conn.restart_deadline(resp._timeout)
                return
        except Exception as exc:  # raised in the waiting task, as a pulled read would
            self.error = exc
        conn.on_data = None
        conn.wake()


class _BodyIter:
    """Async iterator over a response body (a class, not an async generator: nothing to finalise)."""

    __slots__ = ("_resp",)

    def __init__(self, resp: H1Response) -> None:
        self._resp = resp

    def __aiter__(self) -> _BodyIter:
        return self

    async def __anext__(self) -> bytes:
        data = await self._resp._next()
        if not data:
            raise StopAsyncIteration
        return data
