"""What the dispatcher answers with: a worker's whole response passed through, or a relayed stream.

`PassthroughResponse(body, status, request_id, content_type)`: a worker's non-streaming answer (or its
error body) as the client receives it — the worker's bytes, `content-type`, `content-length` and the
gateway's `x-request-id`. The same headers Starlette's `Response(body, status, {"x-request-id": ...},
media_type=...)` would build (a `text/*` type without a charset gets `; charset=utf-8`), without its
per-response header assembly (hot path).

`StreamSession`: one relayed stream (`SseRelay` over the worker's chunks): yields the bytes to send,
measures TTFT, ITL and per-request TPOT at the gateway, renews the request's KV lease per relayed event,
enforces `total_timeout_s` on every read and `stall_timeout_s` on an event that does not complete, ends a
stream that fails after its first byte with an OpenAI error event and `data: [DONE]`, and closes exactly
once — the upstream response (unread → the connection is dropped, which aborts the request in the worker),
the lease, and the request's terminal outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from scheduler.routing.reasons import Outcome
from server.errors import SHUTDOWN_MESSAGE, STREAM_DONE, is_error_event, stream_error_event
from server.failure import GatewayOutcome, Lease, classify
from server.fast_http import ClientStalled
from server.footprint import ParsedRequest
from server.proxy import SseRelay, usage_count
from server.upstream import H1Response, UpstreamResponse

if TYPE_CHECKING:
    from server.dispatch import Dispatcher, RequestRecord
    from server.fast_http import FastCycle


def _media_type(content_type: str) -> bytes:
    if content_type.startswith("text/") and "charset=" not in content_type.lower():
        content_type += "; charset=utf-8"  # as Starlette's media_type handling
    return content_type.encode("latin-1")


def _untimed(_: float) -> None:
    """The ITL observer of a stream of several sequences (`StreamSession._timed`)."""


AFTER_DONE_S = 1.0  # the longest the end of a worker's body may lag its `[DONE]` (vLLM: the same write)


class TotalTimeout(TimeoutError):
    """The gateway's own `limits.total_timeout_s` ended a stream that was still flowing."""


class PassthroughResponse(Response):
    """A worker's whole answer with the gateway's request id (module docstring)."""

    def __init__(
        self,
        body: bytes,
        status: int,
        request_id: str,
        content_type: str,
        retry_after: str | None = None,
        metadata: str | None = None,
    ) -> None:
        self.status_code = status
        self.body = body
        self.background = None
        headers = [(b"x-request-id", request_id.encode("latin-1"))]
        if retry_after is not None:  # a worker's 429/503 keeps its back-off hint
            headers.append((b"retry-after", retry_after.encode("latin-1")))
        if metadata is not None:  # vLLM's binary embeddings (`encoding_format: bytes`): what the bytes hold
            headers.append((b"metadata", metadata.encode("latin-1")))
        if status >= 200 and status not in (204, 304):  # statuses without a body carry no length
            headers.append((b"content-length", b"%d" % len(body)))
        headers.append((b"content-type", _media_type(content_type)))
        self.raw_headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette's, less what never applies here (a websocket denial wrapper, a background task)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})


def relay_headers(request_id: str, content_type: str) -> list[tuple[bytes, bytes]]:
    """A relayed stream's headers, as Starlette's `StreamingResponse(headers={"x-request-id": ...,
    "cache-control": "no-cache"}, media_type=content_type)` builds them (same names, values and order)."""
    return [
        (b"x-request-id", request_id.encode("latin-1")),
        (b"cache-control", b"no-cache"),
        (b"content-type", _media_type(content_type)),
    ]


class StreamSession:
    """One relayed stream: yields bytes, measures TTFT/ITL, and closes exactly once with an outcome.

    Two ways to relay, the same bytes and metrics: `body()` (an async iterator for any ASGI `send`), and
    `push(cycle)` when the client is on the gateway's `FastCycle` and the worker's response is the pool's
    `H1Response`: each read from the worker is decoded, measured and written to the client from the
    upstream connection's `data_received` callback, so a relayed chunk costs no task wake-up, future or
    resume of the coroutine chain (endpoint → response → body iterator → response reader) — which was most
    of its cost."""

    def __init__(
        self,
        d: Dispatcher,
        resp: UpstreamResponse,
        chunks: AsyncIterator[bytes],
        first: bytes,
        parsed: ParsedRequest,
        rec: RequestRecord,
        lease: Lease,
    ) -> None:
        self.d = d
        self.resp = resp
        self.chunks = chunks
        self.first = first
        self.rec = rec
        self.lease = lease
        self.relay = self._new_relay(parsed)
        self.closed = False
        self._clock = d.clock
        # Per-token timings need one sequence: a batch's or n > 1's choices interleave their tokens (two
        # events of one engine step are no gap), and usage sums their tokens (TPOT's n − 1 would be theirs)
        self._timed = parsed.sequences == 1
        self._itl = d.child(d.metrics.itl, rec.model, rec.pool)
        self._deadline = rec.arrival + d.limits.total_timeout_s
        self._last = self._first_at = 0.0  # the last relayed piece; the first token's
        self._last_token = 0.0  # the last relayed piece that carried a token event
        self._resumed = 0.0  # when reading the worker resumed after the client's socket drained (`push`)
        self._generated = 0  # ≈ tokens: vLLM sends one event per step per sequence
        # The first piece carried no token (a chat stream's role event alone, or half an event): TTFT is
        # timed at the first piece that does, and that piece is no inter-token gap.
        self._ttft_pending = False

    def _new_relay(self, parsed: ParsedRequest) -> SseRelay:
        """The stream's framing (chat and completions: `SseRelay`); a subclass relays another API's."""
        rec = self.d.registry.get(self.lease.decision.decode.id)
        return SseRelay(not parsed.client_wants_usage, rec.system_fingerprint if rec is not None else None)

    # ------------------------------------------------------------------ steps shared by both ways
    def _begin(self) -> bytes:
        """The first chunk: the bytes to send, TTFT observed if it carries a token."""
        out = self.relay.feed(self.first)
        self._last = self._first_at = self._last_token = now = self._clock()
        self._generated = self._token_events(out)
        if self.relay.done:  # the whole stream came in the first read
            self._after_done()
        if is_error_event(self.first):  # a stream that fails at once has no first token to time
            return out
        if self._generated > 0:
            self._first_token(now)
        else:
            self._ttft_pending = True
        return out

    def _first_token(self, now: float) -> None:
        """TTFT as the client sees it: the first relayed piece with a token event. Prefill is over then: the
        prompt leaves the worker's backlog and KV reservations drop their transient prefill pages (at the
        first event, a Responses stream's `response.created`, they dropped them before prefill ran)."""
        d, rec = self.d, self.rec
        d.child(d.metrics.ttft, rec.model, rec.pool).observe(now - rec.arrival)
        self._first_at = self._last_token = now
        self._ttft_pending = self.relay.watch_roles = False
        self.lease.first_token()

    def _first_token_unless_error(self, now: float) -> None:
        """The first piece with an event after a role-only opening: TTFT, unless that event is the worker's
        error (vLLM failing the request before its first token: there is no first token to time)."""
        if self.relay.error is None:
            self._first_token(now)

    def _token_events(self, out: bytes) -> int:
        """Events in a relayed piece that carry tokens: all but `data: [DONE]`, the usage-only event
        (`choices: []`), which end a stream in the same step as its last token (timing them as token gaps
        put a ~0 s sample per stream into ITL, and the end of the stream into TPOT), and a chat stream's
        role-only opening events (vLLM sends them just before the first token: counted, they made one more
        near-0 gap per stream; sent early, as the simulated worker once did, the whole prefill)."""
        relay = self.relay
        events = out.count(b"data: ") - out.endswith(STREAM_DONE)
        if relay.usage_only_relayed:
            events -= relay.usage_only_relayed
            relay.usage_only_relayed = 0
        if relay.role_only_relayed:
            events -= relay.role_only_relayed
            relay.role_only_relayed = 0
        return events

    def _step(self, chunk: bytes) -> bytes:
        """A later chunk from the worker → the bytes to send now (b"" while an event is incomplete); per
        relayed piece with a token event an ITL observation and the KV lease renewal."""
        out = self.relay.feed(chunk)
        if not out:
            self._check_no_event(self._clock())
        else:
            now = self._last = self._clock()
            tokens = self._token_events(out)
            if tokens > 0:
                if self._ttft_pending:
                    self._first_token_unless_error(now)
                elif self._timed:
                    self._itl.observe(now - self._last_token)
                self._last_token = now
                self._generated += tokens
                self.lease.on_tokens(self._generated, now)  # renews KV leases; grows `predicted` reservations
            if self.relay.done:
                self._after_done()
        return out

    def _after_done(self) -> None:
        """`[DONE]` relayed: the body's end (vLLM writes it with `[DONE]`) is waited for at most
        `AFTER_DONE_S`, not a stall timeout (a worker holding its body open kept the client waiting 60 s)."""
        if isinstance(self.resp, H1Response):
            self.resp.bound_gaps(AFTER_DONE_S)

    def _check_no_event(self, now: float) -> None:
        """A read that relayed nothing (a piece of an event, or bytes after `[DONE]`): every byte restarts the
        worker's read deadline, so a worker trickling an event that never completes outlived both time-outs
        (one byte every 0.1 s kept a stream 3 s past total 0.6 s and stall 0.3 s, then `completed`). The
        time since the last relayed piece is bounded as a silent worker's is: `stall_timeout_s` (a stall: the
        breaker hears of it), `AFTER_DONE_S` once `[DONE]` was relayed, and `total_timeout_s` since arrival."""
        if now > self._deadline:
            raise TotalTimeout(f"total timeout {self.d.limits.total_timeout_s:g} s")
        bound = AFTER_DONE_S if self.relay.done else self.d.limits.stall_timeout_s
        if now - max(self._last, self._resumed) > bound:  # (not the client's slowness: `_drain_client`)
            raise httpx.ReadTimeout(f"no whole event within {bound:g} s")

    def _check_total(self, out: bytes) -> None:
        """After a piece `out` was sent: `total_timeout_s` since arrival ends the stream, unless that piece
        ended it (`[DONE]` sent: appending an error and a second `[DONE]` failed a completed stream)."""
        if self._last > self._deadline and not self.relay.done:
            raise TotalTimeout(f"total timeout {self.d.limits.total_timeout_s:g} s")

    def _end(self) -> bytes:
        """The worker's body ended: the held-back remainder to send; per-request TPOT observed. A body that
        ended without `data: [DONE]` (a worker that died with a close-delimited body, or ended its chunked
        one early) is ended as a failed stream is: an error event (unless the worker sent one) and `[DONE]`,
        the incomplete event it was in the middle of dropped — the client is never left without `[DONE]`."""
        tail = self.relay.flush()
        seen = self.relay.seen_fingerprint
        if seen is not None and (rec := self.d.registry.get(self.lease.decision.decode.id)) is not None:
            rec.system_fingerprint = seen  # the next streams from this worker carry it
        if not self.relay.done:
            return self._cut_tail()
        n = usage_count((self.relay.usage or {}).get("completion_tokens"))
        self.d.registry.note_stream(self.lease.decision.decode.id, self._generated, n)
        # per-request TPOT as vLLM and the load generator define it: (e2e − TTFT) / (n − 1), to the last token
        if n >= 2 and self._timed and self.relay.error is None:
            d, rec = self.d, self.rec
            d.child(d.metrics.tpot, rec.model, rec.pool).observe(
                (self._last_token - self._first_at) / (n - 1)
            )
        return tail

    def _cut_tail(self) -> bytes:
        """What ends a body that ended before `[DONE]`: `[DONE]` after the worker's own error event, else an
        error event and `[DONE]`."""
        if self.relay.error is not None:
            return STREAM_DONE
        return stream_error_event(
            "Upstream stream ended before it was complete (no [DONE]).", 502, "BadGatewayError"
        )

    def _error_event(self, message: str, status: int, err_type: str) -> bytes:
        """The gateway's own error event ending a stream, in the stream's framing (`[DONE]` after it)."""
        return stream_error_event(message, status, err_type)

    def shutdown_event(self) -> bytes:
        """What ends this stream when the gateway shuts down before its body ended (`RelayResponse`): the
        gateway's 503 event, built when sent (a Responses stream's carries the next sequence number). Once the
        stream's end was relayed, only what its framing still lacks: nothing after `[DONE]` (the answer is
        whole and counted so, `_cancelled_outcome`), `_cut_tail` after the worker's own error event."""
        if self.relay.done:
            return b""
        if self.relay.error is not None:
            return self._cut_tail()
        return self._error_event(SHUTDOWN_MESSAGE, 503, "ServiceUnavailableError")

    def _failed(self, exc: BaseException) -> bytes:
        """The stream failed after the first byte: the error event to send. The worker's breaker hears of
        it unless it was the gateway's own `total_timeout_s` (a long generation streaming steadily is not a
        broken worker; a silent one is caught by `stall_timeout_s`)."""
        if self.relay.done:  # `[DONE]` was relayed: the answer is whole, whatever the worker does after it
            return b""
        if isinstance(exc, TotalTimeout):
            return self._error_event(
                f"The request exceeded the gateway's total timeout of {self.d.limits.total_timeout_s:g} s.",
                504,
                "GatewayTimeoutError",
            )
        kind, hard = classify(exc)
        self.d.registry.report_failure(self.lease.decision.decode.id, f"stream_{kind}", hard)
        return self._error_event(f"Upstream stream failed after it began ({kind}).", 502, "BadGatewayError")

    def _ended_outcome(self) -> Outcome | GatewayOutcome:
        """A stream that ran to its end: completed, unless the worker failed it with an error event (vLLM's
        way once a stream has begun): a 4xx one is the worker refusing the request (healthy), any other a
        worker error its breaker hears of."""
        error = self.relay.error
        if error is None:
            if not self.relay.done:  # cut short without an error event: `_end` sent one
                self.d.registry.report_failure(self.lease.decision.decode.id, "stream_truncated")
                return Outcome.WORKER_ERROR
            # The worker stopped it (shutting down: finish_reason "abort", or vLLM's [DONE] with no finish_reason
            # at all): relayed as sent, not completed, and no mark on its breaker (a stop is not a fault)
            if self.relay.aborted or not self.relay.finished:
                return Outcome.WORKER_ERROR
            return Outcome.COMPLETED
        code = error.get("code")
        if type(code) is int and 400 <= code < 500:
            return Outcome.WORKER_REJECTED
        self.d.registry.report_failure(self.lease.decision.decode.id, "stream_error_event")
        return Outcome.WORKER_ERROR

    def _failure_outcome(self, exc: BaseException) -> Outcome | GatewayOutcome:
        """The gateway's own total_timeout_s is `timed_out`, not a worker error (`_failed` spares the breaker);
        a stream whose `[DONE]` was relayed ended as it ended, whatever failed after it."""
        if self.relay.done:
            return self._ended_outcome()
        return GatewayOutcome.TIMED_OUT if isinstance(exc, TotalTimeout) else Outcome.WORKER_ERROR

    # ------------------------------------------------------------------ the two ways
    async def body(self) -> AsyncIterator[bytes]:
        outcome: Outcome | GatewayOutcome = Outcome.WORKER_ERROR
        ended = False  # the outcome is settled before the last bytes go out: a client hanging up on them
        try:  # (the gateway's own error event, say) does not make it a disconnect
            out = self._begin()
            if out:
                yield out
            async for chunk in self.chunks:
                out = self._step(chunk)
                if out:
                    yield out
                    self._check_total(out)
            tail = self._end()
            outcome, ended = self._ended_outcome(), True
            if tail:
                yield tail
        except (httpx.HTTPError, TimeoutError) as exc:
            last = self._failed(exc)
            outcome, ended = self._failure_outcome(exc), True
            yield last
        except BaseException:
            if not ended:
                outcome = self._cancelled_outcome()
            raise
        finally:
            await self._close(outcome)

    def can_push(self) -> bool:
        return isinstance(self.resp, H1Response)

    async def push(self, cycle: FastCycle) -> bytes:
        """`body()`'s relay written straight to `cycle` (class docstring); returns, when the stream ended,
        the last bytes to send with the end of the response (the caller's final `send`: one write, where
        `body()`'s consumer writes the last piece and the response's end apart). Pauses reading the worker
        while the client's socket is full, where `body()`'s consumer would wait in `send`."""
        resp = self.resp
        assert isinstance(resp, H1Response)
        write, feed, clock, observe, on_tokens, token_events = (
            cycle.write,
            self.relay.feed,
            self._clock,
            self._itl.observe if self._timed else _untimed,
            self.lease.on_tokens,
            self._token_events,
        )
        deadline = self._deadline
        pending = b""  # the stream's last piece, held for the final write

        def deliver(chunk: bytes, last: bool) -> bool:
            # `_step` and `_check_total` written out: this runs once per read from the worker
            nonlocal pending
            if cycle.disconnected:  # the watch cancels the task: nothing is relayed or measured from here
                return True
            out = feed(chunk)
            if not out:
                if not last:  # (the body's end ends the stream anyway)
                    self._check_no_event(clock())
                return True
            now = self._last = clock()
            tokens = token_events(out)
            if tokens > 0:
                if self._ttft_pending:
                    self._first_token_unless_error(now)
                else:
                    observe(now - self._last_token)
                self._last_token = now
                self._generated += tokens
                on_tokens(self._generated, now)
            if last:
                pending = out
                more = True
            else:
                more = write(out)
            if now > deadline and not last:  # the last piece ends the stream anyway
                self._check_total(out)
            if self.relay.done and not last:  # the read deadline restarts with `_after_done`'s bound
                self._after_done()
            return more

        outcome: Outcome | GatewayOutcome = Outcome.WORKER_ERROR
        try:
            out = self._begin()
            if resp.ended:  # the whole stream came with the first read
                pending = out
            elif out and not write(out):
                await self._drain_client(cycle)
            while not await resp.push(deliver):
                await self._drain_client(cycle)  # the worker's socket is not read meanwhile (upstream)
            last = pending + self._end()
            outcome = self._ended_outcome()
        except ClientStalled:  # the caller drops the client's connection: it is gone for the metrics too
            outcome = Outcome.CLIENT_DISCONNECTED
            raise
        except (httpx.HTTPError, TimeoutError) as exc:
            write(pending)
            last = self._failed(exc)
            outcome = self._failure_outcome(exc)
        except BaseException:
            outcome = self._cancelled_outcome()
            raise
        finally:
            await self._close(outcome)
        return last

    async def _drain_client(self, cycle: FastCycle) -> None:
        """Wait for the client's socket to take writes again: a client reading nothing for `stall_timeout_s`
        (the longest gap the gateway allows the worker too) is dropped (`ClientStalled`); one still reading
        when `total_timeout_s` runs out gets the gateway's time-out, as a stream that outlives it does."""
        try:
            await cycle.drain_within(self.d.limits.stall_timeout_s, self._deadline - self._clock())
        except TimeoutError:
            raise TotalTimeout(f"total timeout {self.d.limits.total_timeout_s:g} s") from None
        self._resumed = self._clock()

    async def close(self) -> None:
        """Called by the response however it ends; a no-op after the body's own close (checked first: the
        outcome of an ended stream tells the worker's breaker)."""
        if not self.closed:
            await self._close(self._cancelled_outcome())

    def _cancelled_outcome(self) -> Outcome | GatewayOutcome:
        """A stream cut short by cancellation: the gateway's shutdown (`Dispatcher.stop_requests`, the
        response then sends the error event) or the client leaving. One whose end was already relayed (its
        `[DONE]`, or the worker's error event) ended as that end says: vLLM writes `[DONE]` and the body's end
        apart, and clients hang up on `[DONE]` (the openai SDK on an error event), so those were counted
        disconnects, and a worker's error event never reached its breaker."""
        if self.relay.done or self.relay.error is not None:
            return self._ended_outcome()
        task = asyncio.current_task()
        stopped = task is not None and self.d.stopped(task)
        return GatewayOutcome.SHUT_DOWN if stopped else Outcome.CLIENT_DISCONNECTED

    async def _close(self, outcome: Outcome | GatewayOutcome) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            # Unread → the connection is dropped, which aborts the request upstream. The pool's responses
            # close synchronously; others (injected httpx transports) are awaited shielded from cancellation.
            resp = self.resp
            if isinstance(resp, H1Response):
                resp.close()
            else:
                with anyio.CancelScope(shield=True):
                    await resp.aclose()
        finally:
            # The router hears a stream the gateway cut (time-out, shutdown) as a hang-up: the worker built
            # the prompt's KV, as for a client that left mid-stream (prefix affinity keeps it).
            cut = outcome in (GatewayOutcome.TIMED_OUT, GatewayOutcome.SHUT_DOWN)
            if cut:
                self.lease.release(Outcome.CLIENT_DISCONNECTED)
            elif outcome is Outcome.WORKER_REJECTED:
                # a 4xx error event after the stream began: the request ran there (its prompt's KV was built),
                # so not the router's `worker_rejected`, which takes back the prefix record of a refused one
                self.lease.release(Outcome.WORKER_ERROR)
            else:
                self.lease.release(outcome)  # type: ignore[arg-type]
            if outcome in (
                Outcome.COMPLETED,
                Outcome.WORKER_REJECTED,
            ):  # the worker served or judged it whole
                self.d.registry.report_success(self.lease.decision.decode.id)
            self.d.finish(self.rec, 200, outcome, self.relay.usage)
