"""Talking to workers: one pooled keep-alive HTTP client, the body rewrites, and the SSE relay filter.

**Client.** One pooled keep-alive HTTP/1.1 client per gateway (`Upstream` over
`server.upstream.ConnectionPool`: at most `limits.max_upstream_connections` per worker), with
`limits.connect_timeout_s` to connect, `limits.stall_timeout_s` as the longest wait for any read (a stalled
stream fails instead of hanging) and the wait for a free connection bounded by `first_token_timeout_s`.
Tests inject an `httpx` transport instead (e.g. `httpx.MockTransport`); the errors are httpx's either way.

**Bodies.** The client's bytes are forwarded untouched unless something must change:
- streaming without `stream_options.include_usage`: usage is requested upstream (to count tokens) by
  splicing `"stream_options":{"include_usage":true}` into the JSON object (no re-serialisation; when the
  client sent other `stream_options`, the dict is merged and re-encoded instead) and the usage chunk is
  stripped from what the client receives;
- P/D prefill hop (vLLM's disaggregated-serving proxy protocol, NixlConnector): a copy with
  `kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
  "remote_block_ids": null, "remote_host": null, "remote_port": null}`, `stream: false`,
  `max_tokens: 1`, `max_completion_tokens: 1`, and `stream_options`, `min_tokens` removed;
- P/D decode hop: the original request plus the `kv_transfer_params` the prefill worker answered with.

**Relay.** `SseRelay` passes stream bytes through as they came, holding back only an incomplete event
at a chunk's end (events end with a blank line), and looks inside only chunks that mention `"usage"`:
there it reads the usage event (`choices: []` + `usage`) and drops it when the client did not ask. A
stream framed with CRLF (the SSE spec allows it; sse-starlette, behind llama-cpp-python's server, writes
it; vLLM writes LF) is relayed with LF framing: its JSON holds no raw CR or LF, so only the framing changes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from scheduler.routing.framework import booked_engine
from server.config import LimitsConfig
from server.errors import NOT_JSON
from server.upstream import ConnectionPool, SlotWait, UpstreamResponse

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Statuses that mean "this worker cannot take it now": safe to retry elsewhere before the first byte.
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


class Upstream:
    """Sends requests to workers: `server.upstream.ConnectionPool`, or an injected `httpx` transport (tests).

    The pool is a lean HTTP/1.1 client on asyncio protocols (why: `server.upstream`'s docstring). With an
    injected transport the request goes straight to it, with the same timeouts as an `httpx.Request`
    extension. Either way `post` returns once the response headers arrived, and raises httpx's transport
    exceptions (ConnectError, ReadTimeout, PoolTimeout, ...).
    """

    def __init__(self, limits: LimitsConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.transport = transport
        self.pool = ConnectionPool(
            limits.max_upstream_connections,
            connect_timeout_s=limits.connect_timeout_s,
            read_timeout_s=limits.stall_timeout_s,
            pool_timeout_s=limits.first_token_timeout_s,
        )
        self._timeouts = {
            "connect": limits.connect_timeout_s,
            "read": limits.stall_timeout_s,
            "write": limits.connect_timeout_s,
            "pool": limits.first_token_timeout_s,
        }

    async def post(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        head_timeout: float | None = None,
        slot: SlotWait | None = None,
    ) -> UpstreamResponse:
        """POST and return once the response headers arrived; the body is read (or streamed) by the caller,
        who must `aclose()` the response. `head_timeout` bounds the wait for the headers (default: the
        stall timeout); the caller passes the request's own budget, since a non-streaming vLLM answer
        sends nothing until generation ends. `slot`: see `server.upstream.SlotWait` (the pool's; an
        injected transport that has a pool of its own raises `httpx.PoolTimeout`)."""
        if self.transport is None:
            return await self.pool.post(base + path, body, headers, head_timeout, slot)
        timeouts = self._timeouts if head_timeout is None else {**self._timeouts, "read": head_timeout}
        request = httpx.Request(
            "POST", base + path, headers=headers, content=body, extensions={"timeout": timeouts}
        )
        response = await self.transport.handle_async_request(request)
        response.request = request
        return response

    async def request(
        self,
        method: str,
        base: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        head_timeout: float | None = None,
    ) -> UpstreamResponse:
        """A bodyless request of another method (GET of a stored response), else as `post`; `path` may
        carry a query string."""
        if self.transport is None:
            return await self.pool.post(base + path, b"", headers, head_timeout, method=method)
        timeouts = self._timeouts if head_timeout is None else {**self._timeouts, "read": head_timeout}
        request = httpx.Request(method, base + path, headers=headers, extensions={"timeout": timeouts})
        response = await self.transport.handle_async_request(request)
        response.request = request
        return response

    async def aclose(self) -> None:
        await self.pool.aclose()
        if self.transport is not None:
            await self.transport.aclose()


def upstream_headers(request_id: str) -> list[tuple[bytes, bytes]]:
    """Headers sent to a worker: never the client's Authorization (that is a gateway key)."""
    return [
        (b"content-type", b"application/json"),
        (b"accept", b"application/json, text/event-stream"),
        (b"x-request-id", request_id.encode()),
    ]


DP_RANK_HEADER = (
    b"x-data-parallel-rank"  # vLLM ≥ 0.9: run the request on this engine of a data-parallel server
)


def pinned_headers(
    headers: list[tuple[bytes, bytes]], reservations: Iterable[object], worker_id: str
) -> list[tuple[bytes, bytes]]:
    """`headers` for a hop to `worker_id`, with `X-data-parallel-rank` when the KV ledger booked the request
    on one engine of that data-parallel worker (`KvReservation.engine`): vLLM's own balancer would pick an
    engine without seeing the reservation, and the pages were set aside on this one."""
    engine = booked_engine(reservations, worker_id)
    if engine is None:
        return headers
    return [*headers, (DP_RANK_HEADER, str(engine).encode())]


def splice_usage_option(body: bytes) -> bytes | None:
    """`body` with `"stream_options":{"include_usage":true}` added as the last member, or None when
    the body does not end like a JSON object (the caller then re-encodes)."""
    end = body.rstrip()
    if not end.endswith(b"}"):
        return None
    head = end[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + b'"stream_options":{"include_usage":true}}'


def usage_body(body: bytes, data: Callable[[], dict[str, Any]], has_stream_options: bool) -> bytes:
    """The streaming body to send upstream so that the final usage chunk is produced (`data()` parses
    the body; called only when splicing is not possible)."""
    if not has_stream_options:
        spliced = splice_usage_option(body)
        if spliced is not None:
            return spliced
    parsed = data()
    out = dict(parsed)
    out["stream_options"] = forced_usage_options(parsed)
    return json.dumps(out, separators=(",", ":")).encode()


def forced_usage_options(data: dict[str, Any]) -> dict[str, Any]:
    """`stream_options` that make the worker send the final usage chunk for a client that did not ask for
    usage. Its `continuous_usage_stats` is dropped: vLLM honours it only together with `include_usage`,
    which the client left off, and with it every chunk would carry a usage the relay does not strip."""
    options = {k: v for k, v in (data.get("stream_options") or {}).items() if k != "continuous_usage_stats"}
    return {**options, "include_usage": True}


def prefill_body(data: dict[str, Any]) -> bytes:
    """The P/D prefill hop's body (module docstring)."""
    out = dict(data)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return json.dumps(out, separators=(",", ":")).encode()


def decode_body(data: dict[str, Any], kv_transfer_params: dict[str, Any], stream_needs_usage: bool) -> bytes:
    """The P/D decode hop's body: the original request with the prefill worker's `kv_transfer_params`."""
    out = dict(data)
    out["kv_transfer_params"] = kv_transfer_params
    if stream_needs_usage:
        out["stream_options"] = forced_usage_options(data)
    return json.dumps(out, separators=(",", ":")).encode()


class SseRelay:
    """Pass-through filter for an upstream SSE stream (see module docstring).

    `feed(chunk)` returns the bytes to send now; `flush()` the held-back remainder at the end.
    `usage` is the last usage object seen (a dict, else None); `usage_only_relayed` counts the usage-only
    events (`choices` empty: no token) relayed since the caller last reset it, and `role_only_relayed` the
    role-only ones (a chat stream's opening `delta: {"role": "assistant", "content": ""}` per choice, which
    vLLM sends with, not as, the first token), so a caller counting tokens per piece can tell both from
    token events without parsing the piece again. `error` is the first error event's `error` object relayed
    (`data: {"error": {...}}`: how vLLM fails a stream that has begun).
    """

    __slots__ = (
        "_abort",
        "_buf",
        "_cr_held",
        "_crlf",
        "_fingerprint",
        "_finish",
        "aborted",
        "done",
        "error",
        "finished",
        "role_only_relayed",
        "seen_fingerprint",
        "strip_usage",
        "usage",
        "usage_only_relayed",
        "watch_roles",
    )

    def __init__(self, strip_usage: bool, fingerprint: bytes | None = None) -> None:
        self.strip_usage = strip_usage
        # Asked for usage, vLLM names itself (`system_fingerprint`) on the usage-only event instead of the last
        # choice events, where it names itself for a client that asked for no usage: with the usage injected
        # and stripped, those events get `fingerprint` (the worker's, JSON-encoded, learned from an earlier
        # stream's dropped usage event: `seen_fingerprint`). Grafting this stream's own would mean holding its
        # last token until the usage event (vLLM sends each event as its own HTTP chunk).
        self._fingerprint = fingerprint if strip_usage else None
        self.seen_fingerprint: bytes | None = None
        self.usage: dict[str, Any] | None = None
        self.usage_only_relayed = 0
        self.role_only_relayed = 0
        # Role events open a stream: looked for at the start of each chunk until the caller's first token.
        self.watch_roles = True
        self.error: dict[str, Any] | None = None
        self.done = False  # `data: [DONE]` relayed: the stream ended as an OpenAI stream ends
        # An event carried a finish_reason (a string, not null): a sequence ended. vLLM stopped by SIGTERM may
        # end a stream with [DONE] and none at all (seen on 0.32 in CI): cut, not completed.
        self.finished = False
        self._finish = b'"finish_reason":"'  # a set finish_reason, in the worker's JSON style (`_lf_framed`)
        self._abort = b'"finish_reason":"abort"'
        self.aborted = False  # an event carried finish_reason "abort": the worker stopped it (vLLM's stop)
        self._buf = b""
        self._crlf: bool | None = None  # the worker frames with CRLF; None until its first line break
        self._cr_held = False  # a CRLF stream's chunk ended with a CR, dropped until the next chunk

    def feed(self, chunk: bytes) -> bytes:
        if self.done:  # the stream ended with [DONE]: whatever a worker sends after it is not relayed
            return b""
        if self._crlf is not False:
            chunk = self._lf_framed(chunk)
        if self._buf:
            chunk = self._buf + chunk
            self._buf = b""
        if not chunk.endswith(b"\n\n"):
            cut = chunk.rfind(b"\n\n")
            if cut < 0:
                self._buf = chunk
                return b""
            self._buf = chunk[cut + 2 :]
            chunk = chunk[: cut + 2]
        # the last event, `data: [DONE]` (vLLM's framing; `data:[DONE]` and extra newlines read the same),
        # anywhere in the chunk (a search of the whole chunk costs ~30 ns more than of its tail); a token's
        # text or a `"stop_reason":"[DONE]"` is no end: `_done_event_at` checks the framing. Whatever follows
        # it in the read is dropped, as what follows in later reads is.
        at = chunk.find(b"[DONE]")
        while at >= 0:
            if _done_event_at(chunk, at):
                self.done = True
                end = chunk.find(b"\n\n", at) + 2  # found: the chunk ends with a blank line
                if end < len(chunk):
                    chunk = chunk[:end]
                self._buf = b""
                break
            at = chunk.find(b"[DONE]", at + 6)
        # One search per chunk, in the worker's JSON style (`_lf_framed` reads it with the first line break):
        # a set finish_reason (token events carry `"finish_reason":null`, which the needle does not match)
        if not self.finished:
            at = chunk.find(self._finish)
            if at >= 0:
                self.finished = True
                self.aborted = chunk.find(self._abort, at) >= 0
        elif not self.aborted and chunk.find(self._abort) >= 0:
            self.aborted = True
        # find(), not `in`: `in` on bytes first tries the needle as an int and formats (then drops) a
        # TypeError, ≈ 4k instructions per call on a path taken per relayed chunk and event.
        # `{"error"` opens an error event's object; inside a token's JSON string its quote is escaped.
        if self.error is None and chunk.find(b'{"error"') >= 0:
            self._note_error(chunk)
        if self.watch_roles:
            self._note_roles(chunk)
        if self._fingerprint is not None and chunk.find(self._finish) >= 0:
            chunk = self._with_fingerprint(chunk, self._fingerprint)
        if chunk.find(b'"usage"') < 0:
            return chunk  # the fast path: nothing to look at
        return self._filter(chunk)

    def _lf_framed(self, chunk: bytes) -> bytes:
        """A CRLF-framed stream's chunk with LF framing (the first line break decides which a stream is).
        A CR at a chunk's end waits for the next chunk, where its LF may come. The chunk with the first line
        break also says how the worker writes JSON: vLLM's compact `"finish_reason":"`, or json.dumps'
        default spacing `"finish_reason": "` (other OpenAI-compatible servers)."""
        if self._crlf is None:
            at = chunk.find(b"\n")
            if at < 0:
                return chunk  # no line break yet: nothing to decide (`feed` holds it back whole)
            if chunk.find(b'"finish_reason": ') >= 0:
                self._finish, self._abort = b'"finish_reason": "', b'"finish_reason": "abort"'
            if at > 0:
                self._crlf = chunk[at - 1] == 13
            else:  # the CR, if any, ended the held-back bytes of the chunk before
                self._crlf = self._buf.endswith(b"\r")
                if self._crlf:
                    self._buf = self._buf[:-1]
            if not self._crlf:
                return chunk
        if self._cr_held:
            chunk = b"\r" + chunk
            self._cr_held = False
        chunk = chunk.replace(b"\r\n", b"\n")
        if chunk.endswith(b"\r"):
            self._cr_held = True
            chunk = chunk[:-1]
        return chunk

    def _filter(self, chunk: bytes) -> bytes:
        # Only the events that mention "usage" are looked at (one per stream, usually among many when a
        # read brings a whole stream), each found from the mention: the event runs from the blank line
        # before it to the one after. Those are exactly the boundaries `split(b"\n\n")` draws unless the
        # blank line before is part of a run of three or more newlines (split pairs a run's newlines from
        # its left end): then `_filter_split` decides, as it does for a chunk ending in such a run (its
        # last piece is then not empty). The chunk is rebuilt only when an event is dropped. Splitting the
        # chunk and scanning every event cost ≈ 8 µs per stream.
        if chunk.endswith(b"\n\n\n"):
            return self._filter_split(chunk)
        kept: list[bytes] = []
        kept_from = 0
        at = chunk.find(b'"usage"')
        while at >= 0:
            blank = chunk.rfind(b"\n\n", 0, at)  # the last before `at`: no newline follows it
            if blank > 0 and chunk[blank - 1] == 10:
                return self._filter_split(chunk)
            start = blank + 2 if blank >= 0 else 0
            end = chunk.find(b"\n\n", at)  # found: the chunk ends with a blank line
            if self._usage_event(chunk[start:end]):
                kept.append(chunk[kept_from:start])
                kept_from = end + 2
            at = chunk.find(b'"usage"', end)
        if not kept:
            return chunk
        kept.append(chunk[kept_from:])
        return b"".join(kept)

    def _with_fingerprint(self, chunk: bytes, fingerprint: bytes) -> bytes:
        """`chunk` with `"system_fingerprint"` on each event that ends a choice without one (a set
        finish_reason; inserted before the event object's closing brace)."""
        events = chunk.split(b"\n\n")
        for i, event in enumerate(events):
            if event.find(self._finish) >= 0 and event.find(b'"system_fingerprint"') < 0:
                close = event.rfind(b"}")
                if close > 0:
                    events[i] = event[:close] + b',"system_fingerprint":' + fingerprint + event[close:]
        return b"\n\n".join(events)

    def _note_error(self, chunk: bytes) -> None:
        for event in chunk.split(b"\n\n"):
            if event.startswith(b"data:"):
                payload = _json_or_none(event[5:])
                if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                    self.error = payload["error"]
                    return

    def _note_roles(self, chunk: bytes) -> None:
        """Count the role-only events at the start of `chunk` (a chunk starts at an event boundary). Only the
        start: role events open a chat stream, and a scan of a whole stream read at once (every `"` of its
        JSON a candidate) cost ~10k instructions per request."""
        at = 0
        while True:
            end = chunk.find(b"\n\n", at)
            if end < 0:
                return
            event = chunk[at:end]
            if not (
                event.startswith(b"data:")
                and event.find(b'"role"') >= 0
                and _role_only(_json_or_none(event[5:]))
            ):
                return
            self.role_only_relayed += 1
            at = end + 2

    def _usage_event(self, event: bytes) -> bool:
        """Reads the usage an event carries; True when the event is to be dropped (the injected usage-only
        chunk the client did not ask for)."""
        if event.startswith(b"data:"):
            payload = _json_or_none(event[5:])
            if isinstance(payload, dict) and payload.get("usage"):
                usage = payload["usage"]
                self.usage = usage if isinstance(usage, dict) else None  # a malformed one counts as none
                if payload.get("choices"):
                    return False
                if self.strip_usage:
                    fingerprint = payload.get("system_fingerprint")
                    if isinstance(fingerprint, str):
                        self.seen_fingerprint = json.dumps(fingerprint).encode()
                    return True
                self.usage_only_relayed += 1
        return False

    def _filter_split(self, chunk: bytes) -> bytes:
        # `chunk` ends with a blank line, so the split's last piece is empty.
        events = chunk.split(b"\n\n")
        dropped: list[int] = []
        for i in [i for i, event in enumerate(events) if event.find(b'"usage"') >= 0]:
            if self._usage_event(events[i]):
                dropped.append(i)
        if not dropped:
            return chunk
        kept = [event for i, event in enumerate(events[:-1]) if i not in dropped]
        return b"\n\n".join(kept) + b"\n\n" if kept else b""

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest


# Delta fields that carry generated tokens (content, tool-call arguments, reasoning models' thinking).
_TOKEN_DELTA_FIELDS = ("content", "tool_calls", "reasoning_content", "reasoning")


def _role_only(payload: Any) -> bool:
    """A chat chunk whose every choice only opens the message (role, empty content): no token yet."""
    if not isinstance(payload, dict):
        return False
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or any(delta.get(f) for f in _TOKEN_DELTA_FIELDS):
            return False
    return True


def _done_event_at(chunk: bytes, at: int) -> bool:
    """Whether the `[DONE]` at `at` is the event `data: [DONE]`: a `data:` field (one optional space) opening
    a line, and its line ending right after. A model stopped on the stop string `[DONE]` ends its last token
    event `"stop_reason":"[DONE]"}]}`, and a token's text may say `data: [DONE]` too."""
    if chunk[at + 6 : at + 7] != b"\n":
        return False
    start = at - 1 if at > 0 and chunk[at - 1] == 32 else at  # the one space after `data:`
    return start >= 5 and chunk[start - 5 : start] == b"data:" and (start == 5 or chunk[start - 6] == 10)


def usage_count(value: Any) -> int:
    """A usage count from a worker's answer: a non-negative int, else 0."""
    return value if type(value) is int and value > 0 else 0


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except NOT_JSON:
        return None


_DECODER = json.JSONDecoder()
_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def response_usage(body: bytes) -> dict[str, Any] | None:
    """`usage` of a non-streaming JSON response (None when absent or not JSON).

    Fast path: decode only the object after the last `"usage":` key (vLLM writes it after `choices`, so
    the generated text is never parsed); used when that key follows `,` or `{` (a key, not text: quotes
    inside JSON strings are escaped) and its value is an object whose token counts are integers. Anything
    else → the whole body is parsed."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    before = body[:at].rstrip()
    if before.endswith((b",", b"{")):
        tail = body[at + 7 :].lstrip()
        if tail.startswith(b":"):
            try:
                usage, _ = _DECODER.raw_decode(tail[1:].lstrip().decode())
            except NOT_JSON:
                usage = None
            if isinstance(usage, dict) and all(type(usage.get(k, 0)) is int for k in _USAGE_COUNTS):
                return usage
    payload = _json_or_none(body)
    usage = payload.get("usage") if isinstance(payload, dict) else None
    return usage if isinstance(usage, dict) else None
