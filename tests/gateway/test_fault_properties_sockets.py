"""Property-based fault injection over real sockets: the production path of `test_fault_properties.py`.

`test_fault_properties.py` drives the app in-process with fake workers behind `httpx.MockTransport`. In
production the gateway runs under uvicorn with its own HTTP cycle for the proxy paths (`server/fast_http.py`),
talks to workers through its pooled HTTP/1.1 client (`server/upstream.py`, `server/h1_response.py`: real
sockets, read deadlines, keep-alive reuse, connections returned to the pool after a response) and relays
streams with `StreamSession.push`. Here all of that runs on 127.0.0.1: `start_gateway_server` (under the
standard asyncio loop or uvloop, as `mosaic serve` runs), fake vLLM workers as asyncio TCP servers writing raw
HTTP/1.1, and clients on raw sockets (so they can hang up at any byte).

Hypothesis draws 1-3 workers, each with a list of scripts it answers successive completion requests with
(cycling): chunked, Content-Length or close-delimited bodies; the response written in pieces split at random
byte offsets; a body that ends cleanly without `[DONE]`, or is cut by a close or a reset, or stalls past
`stall_timeout_s`; `[DONE]` followed by more bytes, or by a body held open; bytes after the end of the
message; a keep-alive connection closed right after a response (at once, or a moment later, as an idle
timeout does); a connection closed or reset right after the request arrived (on a reused connection that is
the idle-close race the pool resends for); no answer at all; 429/503/500/502/400 with and without a body;
garbage in the status line or headers. Requests (chat or completions, streaming or not, include_usage) start
at staggered times so later ones reuse pooled connections, from clients that read at once, slowly, pause,
or hang up before the first byte or mid-stream. The gateway's limits, retry count, routing policy and
upstream connection cap are drawn too.

Every event and whole answer a worker writes carries the request's own id (`x-request-id`), so an answer
delivered to the wrong request (a poisoned pooled connection) is seen. For every example:

1. every request gets a well-formed HTTP answer: a whole answer is 200 with an OpenAI completion or 4xx/5xx
   with an OpenAI error body (or a worker's own error body, passed through as documented), with
   `x-request-id` and a right framing; a stream ends with exactly one `data: [DONE]` and nothing after it,
   its events are JSON, its error events in OpenAI's shape, a usage event exactly when asked; nothing is sent
   after a response's end; a client's connection is dropped only when it stopped reading (`ClientStalled`);
2. each request ends in exactly one terminal outcome (spied `finish`, and the outcome/request metrics),
   `completed` exactly for an answer that completed, and an answer whose last attempt met a well-behaved
   worker completes (the worker's bytes after `[DONE]` change no outcome);
3. no answer carries another request's id;
4. nothing hangs: every client has its answer within a bound;
5. no request is dispatched more than `1 + max_retries` times, `mosaic_retries_total` counts the
   re-dispatches, none follows a 4xx/500 answer;
6. no failure is told to the breaker of a worker that only serves well (bytes after `[DONE]` or after the
   message, keep-alive closes included), refuses (4xx) or is busy (429);
7. afterwards: no in-flight ticket, KV reservation or open request is left; the upstream pool holds no
   connection still in use, its connection count matches its members and no one waits for a slot; and with
   every worker well again (breakers reset), a request on every idle pooled connection and a whole and a
   streaming request through the gateway succeed (no poisoned pooled connection).

**P/D** (`test_pd_requests_end_once_and_well_formed_under_socket_faults`): the decode pool's workers draw
the scripts above behind a prefill pool whose workers draw faults of their own on the prefill hop: statuses,
garbage, cut, reset and stalled answers, answers after the hop's bound (`late`), and 200 answers whose
`kv_transfer_params` is missing, null, a list, a string, empty, or whose body is no JSON object (HTML, a
list, or nested deeper than `json` parses); long prompts take two hops, short ones one. Beyond invariants
1-7 (`check_pd`): a decode hop carries `kv_transfer_params` only as its own request's prefill hop just
answered them whole; a prefill hop that failed in any way is followed by the decode hop alone (counted in
`mosaic_pd_fallbacks_total`, as `pool_timeout` only after a wait for a connection slot); no decode worker is charged for a prefill hop, no prefill worker for what it
answered well; both hops' tickets and KV reservations end exactly once; with the workers well again a long
request goes over both hops. MOSAIC_SOCKET_PD_EXAMPLES sets its example count (30; ≈ 30 s).

Real bugs it found are pinned below as plain failing reproducers (`test_found_...`); the property draws
around their triggers (see `KNOWN_BUG_TRIGGERS`) so it stays green otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import httptools
import pytest
import uvloop
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from server.prefill_hop import REQUEST_FAULTS
from server.runner import start_gateway_server
from tests.gateway.fakes import METRICS_TEXT, config, pool, read_raw_request
from tests.gateway.scripted_http import EMPTY_200, chunk
from tests.gateway.test_fault_properties import (
    LONG_PROMPT,
    MODEL,
    Spy,
    assert_released,
    install_spies,
    is_openai_error,
    metric_total,
)

STALL_S = 0.3
CLIENT_BOUND_S = 6.0  # invariant 4: an answer not there by then hangs
HOLD_CAP_S = 3.0  # the longest a worker holds a stalled connection open (the gateway closes it sooner)
FAT = 12_000  # bytes of text per event in a "fat" stream (backpressure on slow clients)

# -------------------------------------------------------------------------------------------- scripts
# Status lines / heads a worker may answer with that are no valid HTTP/1.1 response head.
GARBAGE = [
    b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n",
    b"garbage\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",
    b"HTTP/2 200\r\ncontent-length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 999 Odd\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
]
# Bytes a worker adds inside its body after `data: [DONE]`.
EXTRA = [
    b"data: [DONE]\n\n",
    b"junk without a line break",
    b"\n\n",
    None,
]  # None: an event naming the request
# Bytes after a complete message, in the write that ends it.
JUNK = [b"\r\n", b"xyz", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
# Interim responses a worker may send before its answer.
INTERIM = [
    b"",
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n",
]
PHRASES = {
    400: "Bad Request",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


@dataclass(frozen=True)
class Script:
    """How a worker answers one completion request."""

    kind: str = "ok"  # ok | status | garbage | stall_head | close_head | reset_head
    framing: str = "chunked"  # chunked | length | close
    # ok: done | done_extra | done_stall | junk_after | early_end | close_mid | reset_mid | stall_mid
    ending: str = "done"
    frac: float = 0.5  # where in the body a mid-body ending strikes (early_end: the share of events kept)
    split_seed: int = 0
    splits: int = 0  # extra write boundaries at random byte offsets
    gap_s: float = 0.0  # between writes
    status: int = 503
    with_body: bool = True
    retry_after: str | None = None
    garbage: int = 0
    extra: int = 0
    junk: int = 0
    # after a complete keep-alive response: keep | close | close_soon | header_close (`connection: close` sent)
    after: str = "keep"
    interim: int = 0  # an interim response first (INTERIM)
    fat: bool = False
    # a P/D prefill hop's answer (a 200 "ok" one): its `kv_transfer_params` (KV_SHAPES)
    kv: str = "ok"

    def blameless(self, stream: bool, prefill: bool = False) -> bool:
        """Its breaker must never hear of this answer: it is whole (whatever comes after `[DONE]` or after
        the message, or the keep-alive close after it), a refusal (4xx) or busy (429). A prefill hop's whole
        answer also when its `kv_transfer_params` are missing or null (a worker without a KV connector), not
        when they are malformed or its body is no JSON object (docs: a bad_response, a prefill fault)."""
        if self.kind == "status":
            return self.status < 500
        if prefill and self.kv not in ("ok", "missing", "null"):
            return False
        return self.whole_ok(stream)

    def kv_ok(self) -> bool:
        """A prefill hop answered by it hands the decode hop its `kv_transfer_params`."""
        return self.whole_ok(False) and self.kv == "ok"

    def whole_ok(self, stream: bool) -> bool:
        """A request whose last attempt got this answer completes (its client still there)."""
        if self.kind != "ok":
            return False
        if self.ending in ("done", "junk_after"):
            return True
        return (stream and self.ending in ("done_extra", "done_stall")) or (
            not stream and self.ending == "done_extra"
        )

    def final(self) -> bool:
        """An answer never retried (docs: 4xx and 500)."""
        return self.kind == "status" and self.status in (400, 404, 500)


OK = Script()


SEQ = itertools.count()  # orders worker visits and the gateway's hops (`Hop`) in one sequence


@dataclass(frozen=True)
class Hop:
    """A hop as the gateway sent it (`Upstream.post`)."""

    seq: int
    url: str
    prefill: bool
    kv: Any  # a decode hop's `kv_transfer_params`


@dataclass
class Visit:
    rid: str
    worker: str
    script: Script
    reused: bool  # not the first request on its connection
    stream: bool
    prefill: bool = False  # a P/D prefill hop (`kv_transfer_params.do_remote_decode`)
    kv_in: Any = None  # the `kv_transfer_params` the request carried (a decode hop: the prefill's answer)
    kv_out: Any = None  # a prefill hop: the `kv_transfer_params` it answered with (when it did)
    seq: int = field(default_factory=lambda: next(SEQ))
    done_written: bool = False  # a stream cut mid-body (close/reset/stall) after its `data: [DONE]` went out


# --------------------------------------------------------------------------------------------- worker
def _event(rid: str, chat: bool, i: int, n: int, fat: bool) -> bytes:
    obj = "chat.completion.chunk" if chat else "text_completion"
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
    text = f"w{i} " + ("x" * FAT if fat else "")
    choice |= {"delta": {"content": text}} if chat else {"text": text}
    payload = {"id": rid, "object": obj, "model": MODEL, "choices": [choice]}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def stream_events(rid: str, chat: bool, n: int, usage: bool, fat: bool) -> list[bytes]:
    out = [_event(rid, chat, i, n, fat) for i in range(n)]
    if usage:
        obj = "chat.completion.chunk" if chat else "text_completion"
        u = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        payload = {"id": rid, "object": obj, "model": MODEL, "choices": [], "usage": u}
        out.append(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def whole_answer(rid: str, chat: bool, n: int) -> bytes:
    text = " ".join(f"w{i}" for i in range(n))
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    payload = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "model": MODEL,
        "choices": [choice],
        "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n},
    }
    return json.dumps(payload, separators=(",", ":")).encode()


# How a prefill worker's 200 answer carries `kv_transfer_params` (vLLM: an object with
# `do_remote_prefill`, `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`).
# deep: nested past the JSON parser's recursion limit (valid JSON, which Python's `json` cannot parse)
KV_SHAPES = ["ok", "missing", "null", "list", "string", "empty", "not_json", "json_list", "deep"]
DEEP = b"[" * 100_000 + b"]" * 100_000
LATE_S = 0.5  # a `late` prefill answer comes this long after the request: past the hop's own bound


def kv_params(worker: str, rid: str) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill worker answers `rid` with: naming both, so a decode hop shows
    whose they are."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": f"{worker}:{rid}",
        "remote_block_ids": [1, 2, 3],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
    }


def prefill_answer(worker: str, rid: str, chat: bool, kv: str) -> tuple[bytes, Any]:
    """(body, the params it carries or None) of a prefill hop's 200 answer, `kv` as KV_SHAPES says."""
    if kv == "not_json":
        return b"<html><body>502 Bad Gateway</body></html>", None
    payload = json.loads(whole_answer(rid, chat, 1))
    params = kv_params(worker, rid)
    shaped: Any = {
        "ok": params,
        "null": None,
        "list": [params],
        "string": json.dumps(params),
        "empty": {},
    }.get(kv)
    if kv not in ("missing", "deep"):
        payload["kv_transfer_params"] = shaped
    body = json.dumps(payload, separators=(",", ":")).encode()
    if kv == "deep":
        body = body[:-1] + b',"kv_transfer_params":' + DEEP + b"}"
    if kv == "json_list":
        body = b"[" + body + b"]"
    return body, params if kv == "ok" else None


def framed(parts: list[bytes], framing: str) -> bytes:
    if framing == "chunked":
        return b"".join(chunk(p) for p in parts if p)
    return b"".join(parts)


def head_for(s: Script, status: int, ctype: str, length: int, extra: list[str]) -> bytes:
    """A response head as `s` frames it (after an interim 1xx response, when it sends one)."""
    lines = [f"HTTP/1.1 {status} {PHRASES.get(status, 'OK')}", f"content-type: {ctype}", *extra]
    if s.framing == "chunked":
        lines.append("transfer-encoding: chunked")
    elif s.framing == "length":
        lines.append(f"content-length: {length}")
    if s.after == "header_close":
        lines.append("connection: close")
    return INTERIM[s.interim] + ("\r\n".join(lines) + "\r\n\r\n").encode()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0)."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def until_closed(reader: asyncio.StreamReader, cap: float = HOLD_CAP_S) -> None:
    """Hold the connection (reading and dropping what comes) until the gateway closes it, at most `cap`."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(cap):
            while await reader.read(65536):
                pass


class SocketWorker:
    """A fake vLLM worker on 127.0.0.1: /health and /metrics answer; completion requests get its scripts in
    turn (cycling), each visit recorded in the shared log."""

    def __init__(self, name: str, scripts: tuple[Script, ...], log: list[Visit]) -> None:
        self.name = name
        self.scripts = scripts
        self.log = log
        self.turn = 0
        self.well = True  # answers OK until the faults are switched on, and again for the after-checks
        self.tasks: set[asyncio.Task[Any]] = set()
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None
        self.port = 0
        # request id → set once its client has `data: [DONE]` (or is gone): bytes after `[DONE]` wait for it
        # (test_found_an_event_after_done_in_the_same_read_is_relayed and the one after it)
        self.done_seen: dict[str, asyncio.Event] = {}
        self.avoid_known_bugs = (
            False  # True: draw around the triggers of the bugs pinned at the end (all fixed)
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in list(self.writers):
            w.transport.abort()
        for t in list(self.tasks):
            t.cancel()
        for t in list(self.tasks):
            with contextlib.suppress(BaseException):
                await t

    def next_script(self) -> Script:
        if self.well:
            return OK
        script = self.scripts[self.turn % len(self.scripts)]
        self.turn += 1
        return script

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.writers.add(writer)
        served = 0
        try:
            while True:
                head, body = await read_raw_request(reader)
                lines = head.split(b"\r\n")
                path = lines[0].split(b" ")[1]
                if path == b"/health":
                    writer.write(EMPTY_200)
                    continue
                if path == b"/metrics":
                    text = METRICS_TEXT.format(model=MODEL, running=0, generated=0).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(text), text))
                    continue
                if not path.startswith(b"/v1/"):
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                rid = next(
                    (
                        x.split(b":", 1)[1].strip().decode()
                        for x in lines
                        if x.lower().startswith(b"x-request-id")
                    ),
                    "?",
                )
                script = self.next_script()
                req = json.loads(body)
                kv = req.get("kv_transfer_params")
                visit = Visit(rid, self.name, script, served > 0, bool(req.get("stream")), kv_in=kv)
                visit.prefill = isinstance(kv, dict) and kv.get("do_remote_decode") is True
                self.log.append(visit)
                served += 1
                if not await self._answer(script, path, req, rid, reader, writer, visit):
                    return
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            asyncio.LimitOverrunError,
            asyncio.CancelledError,
        ):
            pass
        finally:
            if not writer.transport.is_closing():
                writer.close()
            self.writers.discard(writer)
            self.tasks.discard(task)

    async def _write(self, writer: asyncio.StreamWriter, data: bytes, s: Script) -> None:
        """`data` in `s.splits + 1` writes cut at random offsets, `s.gap_s` apart."""
        rng = random.Random(s.split_seed)
        cuts = sorted(rng.sample(range(1, len(data)), min(s.splits, len(data) - 1))) if len(data) > 1 else []
        start = 0
        for cut in [*cuts, len(data)]:
            writer.write(data[start:cut])
            await writer.drain()
            if cut != len(data):
                await asyncio.sleep(s.gap_s)
            start = cut

    async def _answer(
        self,
        s: Script,
        path: bytes,
        req: dict[str, Any],
        rid: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        visit: Visit,
    ) -> bool:
        """Answer one request by `s`; False once the connection is done with."""
        chat = path.endswith(b"/chat/completions")
        stream = bool(req.get("stream"))
        n = req.get("max_tokens") or 3
        usage = bool((req.get("stream_options") or {}).get("include_usage"))
        if s.kind == "late":  # a well-formed answer, after the hop's bound
            await asyncio.sleep(LATE_S)
            s = replace(s, kind="ok")
        if s.kind == "stall_head":
            await until_closed(reader)
            return False
        if s.kind in ("close_head", "reset_head"):
            writer.close() if s.kind == "close_head" else reset(writer)
            return False
        if s.kind == "garbage":
            await self._write(writer, GARBAGE[s.garbage], s)
            writer.close()
            return False
        if s.kind == "status":
            error = {
                "error": {
                    "message": f"worker {self.name} says {s.status} to {rid}",
                    "type": "ServiceUnavailableError" if s.status >= 500 else "BadRequestError",
                    "param": None,
                    "code": s.status,
                }
            }
            parts = [json.dumps(error).encode()] if s.with_body else []
            extra = [f"retry-after: {s.retry_after}"] if s.retry_after is not None else []
            body = framed(parts, s.framing)
            data = head_for(s, s.status, "application/json", len(body), extra) + body
            return await self._end(s, writer, data, reader)

        # ------------------------------------------------------------- a 200 answer
        if stream:
            parts = stream_events(rid, chat, n, usage, s.fat)
            ctype = "text/event-stream; charset=utf-8"
        elif visit.prefill:
            body, visit.kv_out = prefill_answer(self.name, rid, chat, s.kv)
            parts = [body]
            ctype = "application/json"
        else:
            parts = [whole_answer(rid, chat, n)]
            ctype = "application/json"
        ending = s.ending
        extra = b""
        if ending == "done_extra":
            if stream:  # written once the client has `[DONE]`: never in the gateway's read of `[DONE]`
                extra = EXTRA[s.extra] or _event(f"{rid}-after", chat, 0, 2, False)
            else:
                parts = [parts[0] + b"\n"]  # a trailing line break: still one JSON object
        elif ending == "early_end":  # the body ends cleanly, short of its end
            if stream:
                parts = parts[: int(s.frac * (len(parts) - 1))]  # no [DONE]
            else:
                cut = max(1, int(s.frac * len(parts[0])))
                if (self.avoid_known_bugs or s.framing != "close") and parts[0][:cut].endswith(b"}"):
                    # close: test_found_a_truncated_whole_answer_ending_in_a_brace_is_a_completion; a body
                    # its framing proves whole is judged by its braces (docs/gateway.md, "Failure handling"):
                    # a worker that frames a cut answer ending in `}` gets it relayed as it sent it
                    cut -= 1
                parts = [parts[0][:cut]]
        body = framed(parts, s.framing)
        if ending == "done_stall":  # the body is never ended: no last chunk, a longer length, no close
            head = head_for(s, 200, ctype, len(body) + 10, [])
            await self._write(writer, head + body, s)
            await until_closed(reader)
            return False
        terminator = b"0\r\n\r\n" if s.framing == "chunked" else b""
        head = head_for(s, 200, ctype, len(body) + len(framed([extra], s.framing)), [])
        if ending in ("close_mid", "reset_mid", "stall_mid"):
            cut = len(head) + int(s.frac * len(body))
            if (
                self.avoid_known_bugs
                and not stream
                and s.framing == "close"
                and (head + body)[:cut].endswith(b"}")
            ):
                cut -= 1  # test_found_a_truncated_whole_answer_ending_in_a_brace_is_a_completion
            await self._write(writer, (head + body)[:cut], s)
            visit.done_written = stream and (head + body)[:cut].find(b"data: [DONE]\n\n") >= 0
            if ending == "close_mid":
                writer.close()
            elif ending == "reset_mid":
                reset(writer)
            else:
                await until_closed(reader)
            return False
        if extra:
            await self._write(writer, head + body, s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HOLD_CAP_S):
                    await self.done_seen.setdefault(rid, asyncio.Event()).wait()
            return await self._end(s, writer, framed([extra], s.framing), reader, whole=False)
        if ending == "junk_after" and s.framing != "close":
            await self._write(writer, head + body, s)
            writer.write(terminator + JUNK[s.junk])  # in the write that ends the message
            await writer.drain()
            return True  # the gateway must not reuse the connection: it closes it
        return await self._end(s, writer, head + body, reader)

    async def _end(
        self,
        s: Script,
        writer: asyncio.StreamWriter,
        data: bytes,
        reader: asyncio.StreamReader,
        whole: bool = True,
    ) -> bool:
        """Write the rest of a response (split as `s` says, unless not `whole`) and its end, then keep the
        connection, or close it (now or a moment later)."""
        if s.framing == "chunked":
            data += b"0\r\n\r\n"
        if whole:
            await self._write(writer, data, s)
        else:
            writer.write(data)
            await writer.drain()
        if s.framing == "close":
            writer.close()
            return False
        if s.after in ("close", "header_close"):
            writer.close()
            return False
        if s.after == "close_soon":  # an idle timeout: a request may be on its way meanwhile
            await asyncio.sleep(0.03)
            writer.close()
            return False
        return True


# ------------------------------------------------------------------------------------------ strategies
AVOID_KNOWN_BUGS = False  # the bugs pinned at the end are fixed: the property draws their triggers too


def avoid_known_bugs(s: Script) -> Script:
    """The script with the triggers of the real bugs pinned at the end of this file drawn around."""
    if AVOID_KNOWN_BUGS and s.kind == "garbage" and GARBAGE[s.garbage].startswith(b"HTTP/1.1 999"):
        # test_found_a_status_outside_100_599_leaves_the_client_without_an_answer
        return replace(s, garbage=0)
    return s


def scripts_strategy() -> st.SearchStrategy[Script]:
    return st.builds(
        Script,
        kind=st.sampled_from(
            ["ok"] * 6 + ["status"] * 2 + ["garbage", "stall_head", "close_head", "reset_head"]
        ),
        framing=st.sampled_from(["chunked", "chunked", "length", "close"]),
        ending=st.sampled_from(
            ["done"] * 8
            + ["done_extra"] * 3
            + ["junk_after", "early_end", "early_end", "close_mid", "close_mid", "reset_mid", "reset_mid"]
            + ["stall_mid", "done_stall"]  # each costs a stall timeout or AFTER_DONE_S (1 s)
        ),
        frac=st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.8, 0.95, 0.999]),
        split_seed=st.integers(0, 2**16),
        splits=st.sampled_from([0, 0, 1, 3, 8]),
        gap_s=st.sampled_from([0.0, 0.0, 0.002, 0.01]),
        status=st.sampled_from([400, 404, 429, 500, 502, 503]),
        with_body=st.booleans(),
        retry_after=st.sampled_from([None, "2"]),
        garbage=st.integers(0, len(GARBAGE) - 1),
        extra=st.integers(0, len(EXTRA) - 1),
        junk=st.integers(0, len(JUNK) - 1),
        after=st.sampled_from(["keep", "keep", "keep", "close", "close_soon", "header_close"]),
        interim=st.sampled_from([0, 0, 0, 0, 1, 2]),
        fat=st.sampled_from([False, False, False, True]),
    ).map(avoid_known_bugs)


@dataclass(frozen=True)
class RequestSpec:
    chat: bool
    stream: bool
    include_usage: bool | None
    max_tokens: int
    start_s: float  # after the batch starts
    # read | slow | pause | ("before", seconds, how) | ("mid", body bytes, how); how: close | reset
    client: Any
    # 0: its own connection; on the connection of the request before it: 1 sent after its response
    # (keep-alive), 2 right behind it (pipelined)
    follow: int = 0
    long: bool = False  # a prompt over the P/D threshold (two hops where there is a prefill pool)

    def body(self, rid: str) -> bytes:
        data: dict[str, Any] = {"model": MODEL, "max_tokens": self.max_tokens}
        prompt = (LONG_PROMPT if self.long else "hello ") + rid
        if self.chat:
            data["messages"] = [{"role": "user", "content": prompt}]
        else:
            data["prompt"] = prompt
        if self.stream:
            data["stream"] = True
            if self.include_usage is not None:
                data["stream_options"] = {"include_usage": self.include_usage}
        return json.dumps(data).encode()

    @property
    def hangs_up(self) -> bool:
        return isinstance(self.client, tuple)


@st.composite
def request_specs(draw: st.DrawFn, pd: bool = False) -> RequestSpec:
    stream = draw(st.sampled_from([True, True, False]))
    client = draw(
        st.one_of(
            st.just("read"),
            st.just("read"),
            st.just("read"),
            st.sampled_from(["slow", "pause"]),
            st.tuples(
                st.just("before"), st.sampled_from([0.0, 0.02, 0.1]), st.sampled_from(["close", "reset"])
            ),
            st.tuples(st.just("mid"), st.sampled_from([1, 60, 400]), st.sampled_from(["close", "reset"]))
            if stream
            else st.just("read"),
        )
    )
    return RequestSpec(
        chat=draw(st.booleans()),
        stream=stream,
        include_usage=draw(st.sampled_from([None, False, True])) if stream else None,
        max_tokens=draw(st.integers(1, 4)),
        start_s=draw(st.sampled_from([0.0, 0.0, 0.02, 0.06, 0.12, 0.2, 0.3])),
        client=client,
        follow=draw(st.sampled_from([0, 0, 0, 0, 1, 2])),
        long=draw(st.sampled_from([True, True, True, False])) if pd else False,
    )


@dataclass(frozen=True)
class Scenario:
    workers: tuple[tuple[Script, ...], ...]
    requests: tuple[RequestSpec, ...]
    max_retries: int
    first_token_timeout_s: float
    total_timeout_s: float
    policy: str | None
    max_connections: int
    loop: str  # asyncio | uvloop
    # P/D: the prefill pool's workers (`workers` are then the decode pool's); empty: one mixed pool
    prefill: tuple[tuple[Script, ...], ...] = ()


def script_lists(strategy: st.SearchStrategy[Script], lo: int, hi: int) -> Any:
    """lo..hi workers, each with 1..4 scripts drawn from `strategy` (taken in turn)."""
    return st.integers(lo, hi).flatmap(
        lambda k: st.lists(st.lists(strategy, min_size=1, max_size=4).map(tuple), min_size=k, max_size=k).map(
            tuple
        )
    )


def scenarios_of(workers: int, requests: int, pd: bool = False, **extra: Any) -> st.SearchStrategy[Scenario]:
    """Scenarios of 1..`workers` (decode or mixed) workers and 1..`requests` requests; `extra`: more fields."""
    return st.builds(
        Scenario,
        workers=script_lists(scripts_strategy(), 1, workers),
        requests=st.integers(1, requests).flatmap(
            lambda k: st.lists(request_specs(pd=pd), min_size=k, max_size=k).map(tuple)
        ),
        max_retries=st.integers(0, 2),
        first_token_timeout_s=st.sampled_from([0.4, 0.7]),
        total_timeout_s=st.sampled_from([0.6, 0.9]),
        policy=st.sampled_from([None, "round-robin"]),
        max_connections=st.sampled_from([1, 2, 1024, 1024]),
        loop=st.sampled_from(["asyncio", "uvloop"]),
        **extra,
    )


scenarios = scenarios_of(3, 6)


def prefill_scripts_strategy() -> st.SearchStrategy[Script]:
    """How a prefill worker answers a prefill hop (never a stream): well, with its `kv_transfer_params`
    missing or malformed, no JSON, a status, garbage, cut, reset, stalled, or after the hop's bound."""
    return st.builds(
        Script,
        kind=st.sampled_from(
            ["ok"] * 6 + ["status"] * 2 + ["garbage", "stall_head", "close_head", "reset_head", "late"]
        ),
        framing=st.sampled_from(["chunked", "chunked", "length", "close"]),
        ending=st.sampled_from(
            ["done"] * 8 + ["done_extra", "junk_after", "early_end", "close_mid", "reset_mid", "stall_mid"]
        ),
        frac=st.sampled_from([0.0, 0.3, 0.8, 0.999]),
        split_seed=st.integers(0, 2**16),
        splits=st.sampled_from([0, 0, 1, 3]),
        status=st.sampled_from([400, 404, 429, 500, 502, 503]),
        with_body=st.booleans(),
        garbage=st.integers(0, len(GARBAGE) - 1),
        junk=st.integers(0, len(JUNK) - 1),
        after=st.sampled_from(["keep", "keep", "keep", "close", "close_soon", "header_close"]),
        interim=st.sampled_from([0, 0, 0, 1]),
        kv=st.sampled_from(["ok"] * 6 + KV_SHAPES[1:]),
    )


pd_scenarios = scenarios_of(2, 5, pd=True, prefill=script_lists(prefill_scripts_strategy(), 1, 2))


# --------------------------------------------------------------------------------------------- client
class _Parsed:
    """httptools' callbacks: the responses on one connection, in order, strictly framed."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.parser = httptools.HttpResponseParser(self)

    @property
    def current(self) -> dict[str, Any]:
        return self.messages[-1]

    def on_message_begin(self) -> None:
        self.messages.append({"status": None, "headers": {}, "body": bytearray(), "complete": False})

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current["headers"][name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.current["status"] = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.current["body"] += body

    def on_message_complete(self) -> None:
        self.current["complete"] = True


@dataclass
class Answer:
    rid: str
    spec: RequestSpec
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False
    disconnected: bool = False  # the client hung up before the response was complete
    dropped: bool = False  # the gateway closed the connection before the response was complete
    malformed: str | None = None
    after_end: bool = False
    hung: bool = False
    elapsed: float = 0.0


def _request_bytes(a: Answer) -> bytes:
    body = a.spec.body(a.rid)
    path = b"/v1/chat/completions" if a.spec.chat else b"/v1/completions"
    return (
        b"POST %b HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"x-request-id: %b\r\n\r\n%b" % (path, len(body), a.rid.encode(), body)
    )


async def run_client(port: int, a: Answer, done_seen: dict[str, asyncio.Event] | None = None) -> None:
    await run_conn(port, [a], done_seen)


async def run_conn(port: int, group: list[Answer], done_seen: dict[str, asyncio.Event] | None = None) -> None:
    """Requests on one raw client connection: the first at its `start_s`, each later one sent after the
    response before it (`follow` 1: keep-alive) or right behind the request before it (`follow` 2: pipelined);
    each response read (or hung up on) as its `client` says. `done_seen[rid]` is set once that response's
    body holds `data: [DONE]` or the client is done with it."""
    done_seen = done_seen if done_seen is not None else {}
    await asyncio.sleep(group[0].spec.start_s)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    if any(a.spec.client in ("slow", "pause") for a in group):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2**20)
    p = _Parsed()
    sent = 0  # requests written

    def send_more() -> None:
        nonlocal sent
        writer.write(_request_bytes(group[sent]))
        sent += 1
        while sent < len(group) and group[sent].spec.follow == 2:
            writer.write(_request_bytes(group[sent]))
            sent += 1

    send_more()
    gone = False  # the connection is over (hung up, dropped, broken)
    for i, a in enumerate(group):
        if gone:
            a.disconnected = True  # never sent, or sent to a connection the client left
            done_seen.setdefault(a.rid, asyncio.Event()).set()
            continue
        if i == sent:
            send_more()
        gone = await _read_one(reader, writer, p, i, a, done_seen.setdefault(a.rid, asyncio.Event()))
    if len(p.messages) > sent:  # a response to no request
        group[-1].after_end = True
    if not writer.transport.is_closing():
        writer.close()


async def _read_one(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    p: _Parsed,
    index: int,
    a: Answer,
    seen: asyncio.Event,
) -> bool:
    """Read response `index` on the connection into `a`; True when the connection is over."""
    spec = a.spec
    loop = asyncio.get_running_loop()
    started = loop.time()
    hang_at = started + spec.client[1] if spec.hangs_up and spec.client[0] == "before" else None
    mid = spec.client[1] if spec.hangs_up and spec.client[0] == "mid" else None
    how = spec.client[2] if spec.hangs_up else None
    paused, over = False, False

    def mine() -> dict[str, Any] | None:
        return p.messages[index] if len(p.messages) > index else None

    def hang_up() -> None:
        nonlocal over
        a.disconnected = over = True
        reset(writer) if how == "reset" else writer.close()

    try:
        while not ((m := mine()) is not None and m["complete"]):
            now = loop.time()
            wait = started + CLIENT_BOUND_S - now
            if hang_at is not None:
                if now >= hang_at:
                    hang_up()
                    break
                wait = min(wait, hang_at - now)
            if wait <= 0:
                a.hung = over = True
                break
            if spec.client == "slow":
                await asyncio.sleep(0.003)
            try:
                async with asyncio.timeout(wait):
                    data = await reader.read(512 if spec.client == "slow" else 65536)
            except TimeoutError:
                continue
            except ConnectionError:
                a.dropped = over = True
                break
            if not data:
                a.dropped = over = True
                break
            try:
                p.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                a.malformed = f"{exc!r} after {data[-200:]!r}"
                over = True
                break
            m = mine()
            if m is None:
                continue
            if m["complete"]:
                break
            if not seen.is_set() and m["body"].find(b"data: [DONE]") >= 0:
                seen.set()
            if mid is not None and len(m["body"]) >= mid:
                hang_up()
                break
            if spec.client == "pause" and m["body"] and not paused:
                paused = True
                await asyncio.sleep(STALL_S + 0.25)
    finally:
        seen.set()
        a.elapsed = loop.time() - started
        m = mine()
        if m is not None:
            a.status, a.headers, a.body, a.complete = (
                m["status"],
                m["headers"],
                bytes(m["body"]),
                m["complete"],
            )
    if a.complete and a.headers.get("connection", "").lower() == "close":
        over = True
    return over


# -------------------------------------------------------------------------------------------- gateway
@dataclass
class SocketSpy(Spy):
    handled: set[str] = field(default_factory=set)  # request ids that reached `Dispatcher.handle`
    fresh: int = 0  # requests the pool sent again on a new connection (a reused one closed under it)
    slot_waits: int = 0  # waits for a connection slot (max_upstream_connections in use)
    posts: dict[str, list[Hop]] = field(default_factory=dict)  # request id → its hops as sent, in order


def spy_on(gw: Any) -> SocketSpy:
    """`install_spies`' records, and which requests reached `Dispatcher.handle` and how the upstream pool
    got their connections."""
    spy = SocketSpy()
    install_spies(gw, spy)
    d = gw.dispatcher
    handle = d.handle

    async def spy_handle(parsed: Any, path: str, rec: Any, receive: Any) -> Any:
        spy.handled.add(rec.request_id)
        return await handle(parsed, path, rec, receive)

    pool = gw.upstream.pool
    acquire, wait_for_slot = pool._acquire, pool._wait_for_slot

    async def spy_acquire(origin: Any, fresh: bool = False, slot: Any = None) -> Any:
        spy.fresh += fresh
        return await acquire(origin, fresh, slot)

    async def spy_wait_for_slot(origin: Any) -> Any:
        spy.slot_waits += 1
        return await wait_for_slot(origin)

    post = gw.upstream.post

    async def spy_post(
        base: str, path: str, body: bytes, headers: Any, head_timeout: Any = None, slot: Any = None
    ) -> Any:
        rid = next(v.decode() for k, v in headers if k == b"x-request-id")
        kv = json.loads(body).get("kv_transfer_params")
        prefill = isinstance(kv, dict) and kv.get("do_remote_decode") is True
        spy.posts.setdefault(rid, []).append(Hop(next(SEQ), base, prefill, None if prefill else kv))
        return await post(base, path, body, headers, head_timeout, slot=slot)

    pool._acquire, pool._wait_for_slot = spy_acquire, spy_wait_for_slot
    gw.upstream.post = spy_post
    d.handle = spy_handle
    return spy


def pool_state(gw: Any) -> dict[str, dict[str, int]]:
    """Per worker origin: connections in use (members not idle), members, the slot count, live waiters."""
    out = {}
    for (_, host, port), origin in gw.upstream.pool._origins.items():
        members = origin._members
        out[f"{host}:{port}"] = {
            "in_use": len([c for c in members if c not in origin.idle]),
            "members": len(members),
            "count": origin.count,
            "waiting": len([f for f in origin.waiters if not f.done()]),
        }
    return out


def pool_clean(state: dict[str, dict[str, int]]) -> bool:
    return all(s["in_use"] == 0 and s["count"] == s["members"] and s["waiting"] == 0 for s in state.values())


def gateway_config(
    workers: list[SocketWorker], prefill: list[SocketWorker] | None = None, **limits: Any
) -> Any:
    base = {
        "stall_timeout_s": STALL_S,
        "connect_timeout_s": 0.3,
        "queue_deadline_s": 0.2,
        "shutdown_grace_s": 1.0,
        "first_token_timeout_s": 0.7,
        "total_timeout_s": 0.9,
    }
    policy = limits.pop("policy", None)
    extra: dict[str, Any] = {"limits": {**base, **limits}}
    if policy is not None:
        extra["routing"] = {"policy": policy}
    addresses = [SimpleNamespace(url=w.url) for w in workers]
    if prefill:  # P/D: a prefill pool in front of a decode pool
        pre = [SimpleNamespace(url=w.url) for w in prefill]
        pools = [pool("prefill", "H100", "prefill", *pre), pool("decode", "A100", "decode", *addresses)]  # type: ignore[arg-type]
        return config(*pools, **extra)
    return config(pool("p", "L4", "mixed", *addresses), **extra)  # type: ignore[arg-type]


def run_loop(kind: str, main: Callable[[], Awaitable[Any]]) -> Any:
    factory = uvloop.new_event_loop if kind == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


# ----------------------------------------------------------------------------------------- invariants


def sse(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


def check_ids(a: Answer, payload: Any) -> None:
    """Invariant 3: what a worker wrote for this request names this request."""
    if isinstance(payload, dict) and "id" in payload:
        assert payload["id"] == a.rid, f"{a.rid}: got the answer to {payload['id']}: {a.body[:300]!r}"
    if is_openai_error(payload):
        msg = payload["error"]["message"]
        if msg.startswith("worker "):
            assert msg.endswith(f" to {a.rid}"), f"{a.rid}: got another request's error: {msg}"


def check_stream(a: Answer) -> bool:
    """Invariant 1 for a 200 stream; whether it completed cleanly ([DONE], no error event, a finish)."""
    raw = a.body
    assert raw.endswith(b"data: [DONE]\n\n"), f"{a.rid}: stream does not end with [DONE]: {raw[-300:]!r}"
    events = sse(raw)
    dones = [e for e in events if e.strip() in (b"data: [DONE]", b"data:[DONE]")]
    assert len(dones) == 1, f"{a.rid}: {len(dones)} [DONE] events: {raw[-600:]!r}"
    clean, finished, usage_events = True, False, 0
    for e in events[:-1]:
        assert e.startswith(b"data:"), f"{a.rid}: not an SSE data event: {e[:200]!r} in {raw[-600:]!r}"
        try:
            payload = json.loads(e[5:])
        except ValueError:
            raise AssertionError(
                f"{a.rid}: an event that is not JSON: {e[:200]!r} in {raw[-600:]!r}"
            ) from None
        check_ids(a, payload)
        if "error" in payload:
            assert is_openai_error(payload), f"{a.rid}: error event not in OpenAI's shape: {e!r}"
            clean = False
        finished = finished or any(c.get("finish_reason") for c in payload.get("choices") or [])
        usage_events += "usage" in payload
    if not a.spec.include_usage:
        assert usage_events == 0, f"{a.rid}: a usage event the client did not ask for: {raw[-600:]!r}"
    elif clean:
        assert usage_events == 1, f"{a.rid}: {usage_events} usage events, asked for one"
    return clean and finished


def check_answer(a: Answer, visits: list[Visit]) -> bool:
    """Invariant 1 for a complete response; whether it completed."""
    assert a.headers.get("x-request-id") == a.rid, f"{a.rid}: x-request-id {a.headers}"
    if a.status == 200 and a.headers.get("content-type", "").startswith("text/event-stream"):
        assert a.spec.stream, f"{a.rid}: a stream for a whole request"
        return check_stream(a)
    assert a.status is not None
    try:
        payload = json.loads(a.body)
    except ValueError:
        payload = None
    if a.status == 200:
        assert not a.spec.stream, f"{a.rid}: 200 without a stream to a stream request: {a.headers}"
        assert isinstance(payload, dict), f"{a.rid}: 200 answer is not JSON: {a.body[:300]!r}"
        check_ids(a, payload)
        assert payload.get("object") in ("chat.completion", "text_completion"), f"{a.rid}: {payload}"
        return True
    assert 400 <= a.status < 600, f"{a.rid}: status {a.status}"
    if not is_openai_error(payload):
        # a worker's own error body passes through unchanged (docs: "Failure handling"), an empty one too
        sent = [v for v in visits if v.script.kind == "status" and v.script.status == a.status]
        assert sent and any(not v.script.with_body for v in sent) and a.body == b"", (
            f"{a.rid}: {a.status} answer not in OpenAI's error shape: {a.body[:300]!r}"
        )
    else:
        check_ids(a, payload)
        msg = payload["error"]["message"]
        if a.status in (429, 503) and msg.startswith("worker "):
            # a worker's busy/unavailable answer passed through keeps its Retry-After
            sent = [
                v for v in visits if msg.startswith(f"worker {v.worker} ") and v.script.status == a.status
            ]
            assert sent, f"{a.rid}: passed through an answer no worker sent it: {msg}"
            assert a.headers.get("retry-after") == sent[-1].script.retry_after, f"{a.rid}: {a.headers}"
    return False


# --------------------------------------------------------------------------------------------- runner
KNOWN_BUG_TRIGGERS: list[Callable[[Scenario], bool]] = []  # real bugs pinned below: the property avoids them


async def run_scenario(scenario: Scenario) -> None:
    log: list[Visit] = []
    workers = [SocketWorker(f"w{i}", scripts, log) for i, scripts in enumerate(scenario.workers)]
    prefill = [SocketWorker(f"pw{i}", scripts, log) for i, scripts in enumerate(scenario.prefill)]
    for w in workers + prefill:
        await w.start()
    cfg = gateway_config(
        workers,
        prefill,
        max_retries=scenario.max_retries,
        first_token_timeout_s=scenario.first_token_timeout_s,
        total_timeout_s=scenario.total_timeout_s,
        max_upstream_connections=scenario.max_connections,
        policy=scenario.policy,
    )
    running = await start_gateway_server(cfg, "127.0.0.1", 0)
    gw = running.gateway
    try:
        spy = spy_on(gw)
        names = {f"{'decode' if prefill else 'p'}/127.0.0.1:{w.port}": w for w in workers}
        names |= {f"prefill/127.0.0.1:{w.port}": w for w in prefill}
        for w in workers + prefill:
            w.well = False
        answers = [Answer(f"req-{i}", spec) for i, spec in enumerate(scenario.requests)]
        done_seen: dict[str, asyncio.Event] = {}
        for w in workers + prefill:
            w.done_seen = done_seen
        groups: list[list[Answer]] = []
        for a in answers:
            if a.spec.follow and groups:
                groups[-1].append(a)
            else:
                groups.append([a])
        await asyncio.gather(*(run_conn(running.port, g, done_seen) for g in groups))
        for w in workers + prefill:
            w.well = True
        # outcomes are recorded just after a response's last byte
        loop = asyncio.get_running_loop()
        end = loop.time() + 2.0
        while (len(spy.finishes) < len(answers) or gw.dispatcher.open) and loop.time() < end:
            await asyncio.sleep(0.01)
        check_batch(scenario, gw, spy, answers, log, names)
        if prefill:
            check_pd(gw, spy, answers, log)
        end = loop.time() + 0.5
        while not pool_clean(pool_state(gw)) and loop.time() < end:
            await asyncio.sleep(0.01)
        state = pool_state(gw)
        assert pool_clean(state), f"upstream pool not settled after the batch: {state}"
        await check_well_again(running, workers, log if prefill else None)
        await running.stop()
        assert_released(gw, "after shutdown")
    finally:
        await running.stop()
        for w in workers + prefill:
            await w.stop()


def check_batch(
    scenario: Scenario,
    gw: Any,
    spy: SocketSpy,
    answers: list[Answer],
    log: list[Visit],
    names: dict[str, SocketWorker],
) -> None:
    by_rid: dict[str, list[tuple[int, str]]] = {}
    for rid, status, outcome in spy.finishes:
        by_rid.setdefault(rid, []).append((status, outcome))
    visits: dict[str, list[Visit]] = {}  # the hops that answer the client (a prefill hop's answer never does)
    for v in log:
        if not v.prefill:
            visits.setdefault(v.rid, []).append(v)
    for a in answers:
        mine = visits.get(a.rid, [])
        assert not a.hung, f"{a.rid}: no answer within {CLIENT_BOUND_S} s (visits {mine})"
        assert a.malformed is None, f"{a.rid}: malformed response: {a.malformed}"
        assert not a.after_end, f"{a.rid}: bytes after the response's end"
        if a.rid not in spy.handled:
            # a client that hung up at once (a reset can discard its request unread) was never served
            assert a.disconnected and not mine and a.rid not in by_rid, f"{a.rid}: never served ({a})"
            continue
        ends = by_rid.get(a.rid, [])
        assert len(ends) == 1, f"{a.rid}: terminal outcomes {ends} (visits {mine})"
        status, outcome = ends[0]
        if currently_in_test_context():
            event(f"outcome {outcome}")
        if a.dropped:
            # only a client that stopped reading past stall_timeout_s is dropped, as client_disconnected
            assert a.spec.client == "pause", f"{a.rid}: connection dropped by the gateway ({outcome}, {mine})"
            assert outcome == "client_disconnected", f"{a.rid}: dropped, outcome {outcome}"
            continue
        if a.disconnected:
            # nobody reads this answer; it may count completed only when the gateway had it whole (`[DONE]`
            # relayed before the hang-up was seen: the client need not have read it)
            if outcome == "completed":
                # (a stream cut after its `[DONE]` is whole: docs, "Failure handling")
                assert mine and (mine[-1].script.whole_ok(a.spec.stream) or mine[-1].done_written), (
                    f"{a.rid}: a hung-up answer counted completed, its worker's was not whole: {mine}"
                )
            continue
        assert a.complete, f"{a.rid}: no complete response"
        clean = check_answer(a, mine)
        if outcome == "completed":
            assert clean, f"{a.rid}: counted completed, but the answer did not complete: {a.body[-300:]!r}"
        else:
            assert not clean, f"{a.rid}: the answer completed, but its outcome is {outcome}"
        if not a.spec.stream or a.status != 200:
            assert status == a.status, f"{a.rid}: answered {a.status}, recorded {status}"
        # a request whose last attempt met a well-behaved worker completes (unless its time ran out)
        if mine and mine[-1].script.whole_ok(a.spec.stream) and a.spec.client in ("read", "slow"):
            late = a.elapsed > 0.8 * scenario.total_timeout_s
            assert clean or late, (
                f"{a.rid}: last attempt answered well ({mine[-1]}), but got {a.status} {outcome}: "
                f"{a.body[-400:]!r}; visits {mine}"
            )
    if currently_in_test_context():
        if any(n > 1 for n in spy.attempts.values()):
            event("retried")
        if any(v.reused for v in log):
            event("pooled connection reused")
        if spy.fresh:
            event("request sent again on a fresh connection (a reused one closed)")
        if spy.slot_waits:
            event("waited for a connection slot")
        if any(a.dropped for a in answers):
            event("a client that stopped reading was dropped")
        if any(a.spec.follow == 1 for a in answers[1:]):
            event("client keep-alive")
        if any(a.spec.follow == 2 for a in answers[1:]):
            event("client pipelining")
        for v in log:
            event(f"visit {v.script.kind}" + (f" {v.script.ending}" if v.script.kind == "ok" else ""))
    assert len(spy.finishes) == len(spy.handled), f"outcomes for unknown requests: {spy.finishes}"
    assert metric_total(gw, "mosaic_request_outcomes_total") == len(spy.handled)
    # a request whose client left before its body was read is counted (499) without an outcome
    unserved = len([a for a in answers if a.rid not in spy.handled])
    requests = metric_total(gw, "mosaic_requests_total")
    assert len(spy.handled) <= requests <= len(spy.handled) + unserved, f"{requests} requests counted"
    for rid, n in spy.attempts.items():
        assert n <= 1 + scenario.max_retries, (
            f"{rid}: dispatched {n} times (max_retries {scenario.max_retries})"
        )
    redispatches = sum(n - 1 for n in spy.attempts.values())
    retries = metric_total(gw, "mosaic_retries_total")
    assert retries == redispatches, f"mosaic_retries_total {retries}, re-dispatches {redispatches}"
    # no retry after an answer never retried (4xx, 500)
    for rid, mine in visits.items():
        for v in mine[:-1]:
            assert not v.script.final(), f"{rid}: retried after {v}: {mine}"
    # invariant 6: a worker that only serves well, refuses or is busy is never charged
    streams = {a.rid for a in answers if a.spec.stream}
    blameless = {
        wid
        for wid, w in names.items()
        if all(v.script.blameless(v.stream, v.prefill) for v in log if v.worker == w.name)
    }
    wrongly = [
        (wid, kind, rid)
        for wid, kind, rid in spy.blamed
        if wid in blameless and not (kind == "timeout" and rid in streams)
    ]
    assert not wrongly, f"breaker told of failures of a blameless worker: {wrongly}; visits {log}"
    assert_released(gw, "after the batch")


def refuses_the_request(v: Visit) -> bool:
    """A prefill hop its worker answered with a request fault (400, 422): decode-only, counted as the pool's
    `refused` fallback only if the decode worker then serves the request (docs, "P/D")."""
    return v.prefill and v.script.kind == "status" and v.script.status in REQUEST_FAULTS


def check_pd(gw: Any, spy: SocketSpy, answers: list[Answer], log: list[Visit]) -> None:
    """The P/D invariants (docs/gateway.md, "P/D: the two-hop path"):

    - a decode hop carries `kv_transfer_params` only as its request's own prefill hop just answered them
      (that hop whole and well-formed: never another request's, a stale or a cut answer's);
    - a prefill hop that answered them whole hands them on; one that failed in any way is followed by the
      decode hop alone (decode-only fallback, counted), unless the client left first;
    - no decode worker is charged for a prefill hop's failure.
    (Reservations and tickets of both hops released exactly once: `assert_released`; a prefill worker charged
    only for its own failures: `check_batch`'s blameless check.)"""
    gone = {a.rid for a in answers if a.disconnected or a.dropped or a.spec.client == "pause"}
    timed_out = {rid for rid, _, outcome in spy.finishes if outcome in ("timed_out", "shut_down")}
    fell_back = 0  # decode hops sent without params right after a prefill hop
    for a in answers:
        sent = spy.posts.get(a.rid, [])
        hops = [v for v in log if v.rid == a.rid]
        for i, hop in enumerate(sent):
            if not hop.prefill:
                assert hop.kv is None or (i > 0 and sent[i - 1].prefill), (
                    f"{a.rid}: a decode hop with params no prefill hop gave: {sent}"
                )
                continue
            # whatever the prefill hop did, the decode hop is sent next, unless the request ended meanwhile: its
            # client left, or its own time ran out (504; a loaded loop can sweep the hop's half of the
            # first-token budget together with the whole of it: docs, "P/D", charged to the prefill worker)
            if i + 1 == len(sent):
                assert a.rid in gone or a.rid in timed_out or a.status == 504, (
                    f"{a.rid}: the prefill hop was the last: {sent}"
                )
                continue
            after = sent[i + 1]
            assert not after.prefill, f"{a.rid}: two prefill hops in a row: {sent}"
            # what the prefill worker answered this hop (more than one visit: the pool sent it again)
            answered = [v for v in hops if v.prefill and hop.seq < v.seq < after.seq]
            well = bool(answered) and answered[-1].script.kv_ok()
            if after.kv is not None:
                assert well and after.kv == answered[-1].kv_out, (
                    f"{a.rid}: decode hop sent {after.kv!r}; its prefill hop was answered {answered}"
                )
            else:
                assert not well, (
                    f"{a.rid}: the prefill hop answered well ({answered}), the decode hop lost it"
                )
                # a request fault (400, 422) counts as a fallback only once the decode worker serves it: not
                # counted into this lower bound
                if not (answered and refuses_the_request(answered[-1])):
                    fell_back += 1
    fallbacks = metric_total(gw, "mosaic_pd_fallbacks_total")
    # (a prefill hop may fail before it reaches its worker: waiting for a connection slot past its bound)
    prefill_hops = sum(hop.prefill for sent in spy.posts.values() for hop in sent)
    assert fell_back <= fallbacks <= prefill_hops, (
        f"{fallbacks} fallbacks counted, {fell_back} seen, {prefill_hops} prefill hops sent"
    )
    # a fallback blamed on the gateway's own connection limit had a hop wait for a slot
    pool_timeouts = gw.metrics.registry.get_sample_value(
        "mosaic_pd_fallbacks_total", {"model": MODEL, "reason": "pool_timeout"}
    )
    assert (pool_timeouts or 0) <= spy.slot_waits, (
        f"{pool_timeouts} pool_timeout fallbacks, {spy.slot_waits} waits"
    )
    for wid, kind, rid in spy.blamed:
        assert not (wid.startswith("decode/") and kind.startswith("prefill_")), (
            f"{rid}: decode worker {wid} charged {kind}"
        )
    if currently_in_test_context():
        for v in log:
            if v.prefill:
                kind = v.script.kind + (f" {v.script.ending} {v.script.kv}" if v.script.kind == "ok" else "")
                event(f"prefill {kind}")
        if fell_back:
            event("decode-only fallback")
        if any(v.kv_in for v in log if not v.prefill):
            event("decode hop with kv_transfer_params")


async def check_well_again(
    running: Any, workers: list[SocketWorker], pd_log: list[Visit] | None = None
) -> None:
    """Invariant 7: every worker well again (breakers reset): a request on every idle pooled connection, and
    a whole and a streaming request through the gateway, succeed; with a prefill pool (`pd_log`: the visits)
    long ones too, each over both hops, the decode hop with its prefill hop's `kv_transfer_params`."""
    gw = running.gateway
    for rec in gw.registry.records():
        rec.breaker.record_success()
    if pd_log is not None:  # a long request takes two hops once the prefill workers' first health check came
        loop = asyncio.get_running_loop()
        end = loop.time() + 2.0
        while any(r.state() != "ready" for r in gw.registry.records()) and loop.time() < end:
            await asyncio.sleep(0.01)
    pool = gw.upstream.pool
    posts = []
    for (_, host, port), origin in pool._origins.items():
        for i in range(len(origin.idle)):
            rid = f"after-{port}-{i}"
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
            headers = [(b"content-type", b"application/json"), (b"x-request-id", rid.encode())]
            posts.append((rid, pool.post(f"http://{host}:{port}/v1/completions", body, headers)))

    async def one(rid: str, post: Awaitable[Any]) -> None:
        resp = await post
        content = await resp.aread()
        await resp.aclose()
        assert resp.status_code == 200, f"a pooled connection answered {resp.status_code}: {content[:200]!r}"
        assert json.loads(content)["id"] == rid, f"a pooled connection answered another request: {content!r}"

    async with asyncio.timeout(3):
        await asyncio.gather(*(one(rid, post) for rid, post in posts))
    for stream, long in [(False, False), (True, False)] + ([(False, True), (True, True)] if pd_log else []):
        spec = RequestSpec(
            chat=True, stream=stream, include_usage=None, max_tokens=2, start_s=0.0, client="read", long=long
        )
        a = Answer(f"well-{int(stream)}-{int(long)}", spec)
        await run_client(running.port, a)
        assert a.complete and a.status == 200, f"after the faults, a request to a well worker got {a}"
        assert check_answer(a, []), f"after the faults, a request to a well worker did not complete: {a}"
        if long and pd_log is not None:
            hops = [v for v in pd_log if v.rid == a.rid]
            states = {r.id: r.state().value for r in gw.registry.records()}
            assert [v.prefill for v in hops] == [True, False], f"{a.rid}: not P/D: {hops}; workers {states}"
            assert hops[1].kv_in == hops[0].kv_out, f"{a.rid}: decode hop's kv_transfer_params: {hops}"


@settings(
    max_examples=int(os.environ.get("MOSAIC_SOCKET_EXAMPLES", "80")),
    deadline=None,
    derandomize=not os.environ.get("MOSAIC_SOCKET_RANDOM"),  # set: a fresh random run (hunting)
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # MOSAIC_SOCKET_NOSHRINK=1: report the first failing example as drawn (shrinking takes ~1 s a try)
    phases=[p for p in Phase if p is not Phase.shrink or not os.environ.get("MOSAIC_SOCKET_NOSHRINK")],
)
@given(scenarios)
def test_every_request_ends_once_and_well_formed_under_socket_faults(scenario: Scenario) -> None:
    for trigger in KNOWN_BUG_TRIGGERS:
        if trigger(scenario):
            event("skipped: a known bug's trigger")
            return
    started = time.monotonic()
    run_loop(scenario.loop, lambda: run_scenario(scenario))
    if os.environ.get("MOSAIC_SOCKET_TRACE"):
        with open(os.environ["MOSAIC_SOCKET_TRACE"], "a") as f:
            f.write(
                f"{time.monotonic() - started:.2f}s {len(scenario.workers)}w {len(scenario.requests)}r {scenario}\n"
            )


@settings(
    max_examples=int(os.environ.get("MOSAIC_SOCKET_PD_EXAMPLES", "30")),
    deadline=None,
    derandomize=not os.environ.get("MOSAIC_SOCKET_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[p for p in Phase if p is not Phase.shrink or not os.environ.get("MOSAIC_SOCKET_NOSHRINK")],
)
@given(pd_scenarios)
def test_pd_requests_end_once_and_well_formed_under_socket_faults(scenario: Scenario) -> None:
    """The same invariants over a prefill pool in front of a decode pool, the prefill workers drawing faults
    of their own (`prefill_scripts_strategy`), plus `check_pd`'s. MOSAIC_SOCKET_PD_EXAMPLES: how many."""
    started = time.monotonic()
    run_loop(scenario.loop, lambda: run_scenario(scenario))
    if os.environ.get("MOSAIC_SOCKET_TRACE"):
        with open(os.environ["MOSAIC_SOCKET_TRACE"], "a") as f:
            f.write(f"{time.monotonic() - started:.2f}s pd {scenario}\n")


# ------------------------------------------------------------------------------ reproducers of real bugs
Scripted = Callable[[asyncio.StreamReader, asyncio.StreamWriter, str, bool], Awaitable[bool]]


async def _serve_scripted(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: Scripted
) -> None:
    """A worker connection: /health and the like get an empty 200; a completion `answer(reader, writer, rid,
    stream)`, which returns False once it is done with the connection."""
    try:
        while True:
            head, body = await read_raw_request(reader)
            lines = head.split(b"\r\n")
            path = lines[0].split(b" ")[1]
            if not path.startswith(b"/v1/"):
                writer.write(EMPTY_200)
                continue
            rid = next(
                x.split(b":", 1)[1].strip().decode() for x in lines if x.lower().startswith(b"x-request-id")
            )
            if not await answer(reader, writer, rid, bool(json.loads(body).get("stream"))):
                return
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass
    finally:
        if not writer.transport.is_closing():
            writer.close()


async def _scripted(
    answer: Scripted,
    spec: RequestSpec,
    limits: dict[str, Any] | None = None,
    requests: int = 1,
) -> tuple[list[Answer], dict[str, int], dict[str, int], dict[str, dict[str, int]]]:
    """One scripted worker (`answer(reader, writer, rid, stream)` writes the whole response to a completion
    request; False once it is done with the connection) behind a real gateway; `requests` requests one after
    the other from raw clients. (answers, outcomes, breaker failures by worker, the upstream pool's state)."""

    server = await asyncio.start_server(lambda r, w: _serve_scripted(r, w, answer), "127.0.0.1", 0)
    worker = SimpleNamespace(url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    running = await start_gateway_server(gateway_config([worker], **(limits or {})), "127.0.0.1", 0)  # type: ignore[list-item]
    try:
        answers = []
        for i in range(requests):
            a = Answer(f"req-{i}", spec)
            await run_client(running.port, a)
            answers.append(a)
        await asyncio.sleep(0.1)  # outcomes are recorded just after the last byte
        gw = running.gateway
        breaker = {r.id: r.breaker.failures for r in gw.registry.records()}
        return answers, dict(gw.dispatcher.outcomes), breaker, pool_state(gw)
    finally:
        await running.stop()
        server.close()


STREAM = RequestSpec(chat=True, stream=True, include_usage=None, max_tokens=1, start_s=0.0, client="read")
WHOLE = RequestSpec(chat=True, stream=False, include_usage=None, max_tokens=1, start_s=0.0, client="read")
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _after_done(extra: bytes) -> Callable[..., Awaitable[bool]]:
    """A stream of one token and `[DONE]`, followed by `extra` inside the body, all in one write."""

    async def answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rid: str, stream: bool
    ) -> bool:
        events = b"".join(stream_events(rid, True, 1, True, False))  # token, usage, [DONE]
        writer.write(SSE_HEAD + chunk(events + extra) + b"0\r\n\r\n")
        await writer.drain()
        return True

    return answer


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_found_an_event_after_done_in_the_same_read_is_relayed(loop: str) -> None:
    """docs/gateway.md: "Once `[DONE]` is relayed the answer is whole: anything the worker does after it (more
    events, ...) is not relayed and changes no outcome". The relay looks for `[DONE]` only in a read's last 16
    bytes (`SseRelay.feed`): when more bytes follow `[DONE]` in the same read, the `[DONE]` is not seen, what
    follows is relayed, and at the body's end the stream is taken for cut short: an error event and a second
    `[DONE]` are appended, the outcome is worker_error and the worker's breaker is told `stream_truncated`."""
    extra = _event("extra", True, 0, 2, False)  # a token event naming another request, after [DONE]
    answers, outcomes, breaker, _ = run_loop(loop, lambda: _scripted(_after_done(extra), STREAM))
    a = answers[0]
    assert a.complete and a.status == 200
    assert a.body.endswith(b"data: [DONE]\n\n") and a.body.count(b"[DONE]") == 1, a.body
    assert outcomes == {"completed": 1}
    assert set(breaker.values()) == {0}


@pytest.mark.parametrize("extra", [b"data: [DONE]\n\n", b"junk without a line break"])
def test_found_bytes_after_done_in_the_same_read_reach_the_client(extra: bytes) -> None:
    """The same read as above with a second `data: [DONE]` (relayed: two `[DONE]`s), or bytes that end no
    event (held back by the relay as an incomplete event, then sent after `[DONE]` at the body's end:
    `StreamSession._end` returns the relay's held-back tail even once `[DONE]` was relayed)."""
    answers, outcomes, breaker, _ = run_loop("asyncio", lambda: _scripted(_after_done(extra), STREAM))
    a = answers[0]
    assert a.complete and a.status == 200
    assert a.body.endswith(b"data: [DONE]\n\n") and a.body.count(b"[DONE]") == 1, a.body
    assert outcomes == {"completed": 1}
    assert set(breaker.values()) == {0}


@pytest.mark.parametrize("spec", [WHOLE, STREAM], ids=["whole", "stream"])
def test_found_a_status_outside_100_599_leaves_the_client_without_an_answer(spec: RequestSpec) -> None:
    """A worker's status line `HTTP/1.1 999 Odd` (no valid HTTP status: RFC 9110 §15 says to treat it as a
    5xx). `_read_head` takes any three digits, the dispatcher passes the 999 answer through, and the fast
    cycle's `send` raises KeyError looking the status line up (uvicorn's table covers 100-599) after it set
    `response_started`: `run_asgi` then closes the connection. The client gets no response at all (the
    contract: a failure before the first byte is a 502/504 in OpenAI's shape, a gateway bug a 500), while
    the outcome is recorded as if the 999 had been answered."""

    async def answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rid: str, stream: bool
    ) -> bool:
        writer.write(GARBAGE[7])
        await writer.drain()
        return True

    answers, _, _, _ = run_loop("asyncio", lambda: _scripted(answer, spec, {"max_retries": 0}))
    a = answers[0]
    assert not a.dropped and a.complete, f"no answer: the gateway closed the connection ({a})"
    assert a.status is not None and 500 <= a.status < 600
    assert is_openai_error(json.loads(a.body))


def test_found_a_truncated_whole_answer_ending_in_a_brace_is_a_completion() -> None:
    """A non-streaming 200 whose close-delimited body was cut by the worker's death one byte short (its last
    `}`): docs/gateway.md says a 200 whose body is no JSON object is retried (`not_json`), and 502 when no
    worker is left. `Dispatcher._whole` decides with `_json_object_shaped` (opens with `{`, ends with `}`),
    whose docstring says "a truncated body is already httpx's error" — not so for a close-delimited body
    (the close is its end), and the cut body still ends with the `usage` object's `}`. The client gets the
    broken JSON as a 200, counted completed (and its usage is learnt by the length predictor)."""

    async def answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rid: str, stream: bool
    ) -> bool:
        body = whole_answer(rid, True, 1)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + body[:-1])
        await writer.drain()
        writer.close()  # the worker died one byte short of its answer's end
        return False

    answers, outcomes, _, _ = run_loop("asyncio", lambda: _scripted(answer, WHOLE, {"max_retries": 0}))
    a = answers[0]
    assert a.complete
    try:
        json.loads(a.body)
        parsed = True
    except ValueError:
        parsed = False
    assert parsed or a.status != 200, f"a 200 whose body is no JSON: {a.body!r}"
    assert outcomes != {"completed": 1}


def test_found_a_request_resent_after_an_idle_close_gets_another_reused_connection() -> None:
    """server/upstream.py: "When a *reused* connection closes before any byte of the response arrived (the
    server timed out the idle connection as the request was sent), the request is sent once more on a new
    connection". At `max_upstream_connections` that second try (`_acquire(fresh=True)`) waits for a slot
    and takes whatever `_wait_for_slot` hands it: a connection another request just released, reused — which
    the worker closes as well. The pool then raises RemoteProtocolError: the request fails (502 here, a
    retry elsewhere with more workers) and the healthy worker's breaker is charged `protocol`.

    A worker that closes each keep-alive connection 20 ms after its response (an idle timeout), one
    connection allowed, three requests at once."""

    async def answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rid: str, stream: bool
    ) -> bool:
        body = whole_answer(rid, True, 1)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(body), body)
        )
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.close()
        return False

    async def main() -> tuple[list[Answer], dict[str, int], dict[str, int]]:
        server = await asyncio.start_server(lambda r, w: _serve_scripted(r, w, answer), "127.0.0.1", 0)
        worker = SimpleNamespace(url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        limits = {"max_upstream_connections": 1, "max_retries": 0}
        running = await start_gateway_server(gateway_config([worker], **limits), "127.0.0.1", 0)  # type: ignore[list-item]
        try:
            answers = [Answer(f"req-{i}", WHOLE) for i in range(3)]
            await asyncio.gather(*(run_client(running.port, a) for a in answers))
            await asyncio.sleep(0.1)
            gw = running.gateway
            return (
                answers,
                dict(gw.dispatcher.outcomes),
                {r.id: r.breaker.failures for r in gw.registry.records()},
            )
        finally:
            await running.stop()
            server.close()

    answers, outcomes, breaker = run_loop("asyncio", main)
    assert [a.status for a in answers] == [200, 200, 200], [(a.status, a.body[:120]) for a in answers]
    assert outcomes == {"completed": 3}
    assert set(breaker.values()) == {0}, f"a healthy worker charged: {breaker}"


async def _pd_once(prefill: Script, decode: Script, spec: RequestSpec, **limits: Any) -> dict[str, Any]:
    """One request through a P/D gateway: one prefill and one decode `SocketWorker` answering by `prefill`
    and `decode`. What happened: the answer, the outcomes, breaker failures by pool, the fallbacks, the
    visits."""
    log: list[Visit] = []
    pre, dec = SocketWorker("pw0", (prefill,), log), SocketWorker("w0", (decode,), log)
    for w in (pre, dec):
        await w.start()
    running = await start_gateway_server(gateway_config([dec], [pre], **limits), "127.0.0.1", 0)
    try:
        pre.well = dec.well = False
        a = Answer("req-0", spec)
        await run_client(running.port, a)
        await asyncio.sleep(0.1)  # outcomes are recorded just after the last byte
        gw = running.gateway
        return {
            "answer": a,
            "outcomes": dict(gw.dispatcher.outcomes),
            "breaker": {r.pool.name: r.breaker.failures for r in gw.registry.records()},
            "fallbacks": metric_total(gw, "mosaic_pd_fallbacks_total"),
            "visits": log,
        }
    finally:
        await running.stop()
        for w in (pre, dec):
            await w.stop()


@pytest.mark.parametrize(
    "spec", [replace(WHOLE, long=True), replace(STREAM, long=True)], ids=["whole", "stream"]
)
def test_found_a_prefill_answer_nested_too_deep_for_the_parser_is_an_internal_error(
    spec: RequestSpec,
) -> None:
    """docs/gateway.md: "If the prefill hop fails in any way (...) the decode worker serves the request
    alone". A prefill worker's 200 whose JSON nests deeper than Python's `json` can parse (valid JSON, as
    a broken or hostile worker may send: here `kv_transfer_params` is 100,000 nested lists) raises
    `RecursionError` in `Dispatcher._prefill`, which catches only ValueError/AttributeError from the body:
    it escaped the dispatcher, and the client got a 500 `InternalServerError` (outcome internal_error, a
    gateway bug) without the decode worker ever being asked."""
    seen = run_loop("asyncio", lambda: _pd_once(Script(kv="deep"), OK, spec))
    a = seen["answer"]
    assert a.complete and a.status == 200, (a.status, a.body[:200])
    assert check_answer(a, []), a.body[-300:]
    assert seen["outcomes"] == {"completed": 1}
    assert [(v.prefill, v.kv_in) for v in seen["visits"]][1:] == [(False, None)]  # decode-only
    assert seen["fallbacks"] == 1
    assert seen["breaker"] == {"prefill": 1, "decode": 0}  # a body that is no JSON, as `not_json`


def _deep_answer(kind: str) -> Callable[..., Awaitable[bool]]:
    """A worker answering with JSON nested deeper than Python's `json` parses (valid JSON): a whole answer
    closed by the worker (`close`), a whole answer whose `usage` is nested (`usage`), or a stream whose
    usage event is (`stream`)."""

    async def answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rid: str, stream: bool
    ) -> bool:
        if kind == "stream":
            events = stream_events(rid, True, 1, False, False)
            deep = b'data: {"id":"%b","choices":[],"usage":%b}\n\n' % (rid.encode(), DEEP)
            writer.write(SSE_HEAD + chunk(b"".join(events[:-1]) + deep + events[-1]) + b"0\r\n\r\n")
        else:
            body = whole_answer(rid, True, 1)
            if kind == "usage":
                body = body[: body.rindex(b'"usage"')] + b'"usage":' + DEEP + b"}"
                head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                writer.write(head % len(body) + body)
            else:
                body = body[:-1] + b',"x":' + DEEP + b"}"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + body)
                await writer.drain()
                writer.close()
                return False
        await writer.drain()
        return True

    return answer


@pytest.mark.parametrize("kind", ["close", "usage", "stream"])
def test_found_a_worker_answer_nested_too_deep_for_the_parser_is_an_internal_error(kind: str) -> None:
    """The decode side of the bug above: `_json_object` (a close-delimited whole answer is parsed),
    `response_usage` (a whole answer's usage) and `SseRelay`'s event reads (`_json_or_none`) caught only
    ValueError, and `json` raises RecursionError on valid JSON nested past its limit. A whole answer got a
    500 `InternalServerError` (outcome internal_error) instead of the documented not-JSON failure (502 here,
    no retries left) or its answer passed through; a stream whose usage event nests so was cut after its
    first event (no `[DONE]`), the connection dropped and the outcome recorded as client_disconnected."""
    spec = STREAM if kind == "stream" else WHOLE
    answers, outcomes, _, _ = run_loop(
        "asyncio", lambda: _scripted(_deep_answer(kind), spec, {"max_retries": 0})
    )
    a = answers[0]
    assert a.complete and not a.dropped, a
    if kind == "close":
        assert a.status == 502 and outcomes == {"failed_before_first_byte": 1}, (a.status, a.body[:200])
    elif kind == "usage":
        assert a.status == 200 and outcomes == {"completed": 1}, (a.status, outcomes)
    else:  # the event the relay cannot read passes through as sent
        assert a.status == 200 and a.body.endswith(b"data: [DONE]\n\n"), a.body[-200:]
        assert outcomes == {"completed": 1}, outcomes
