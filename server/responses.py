"""What the dispatcher answers with: a worker's whole response passed through, or a relayed stream.

`PassthroughResponse(body, status, request_id, content_type)`: a worker's non-streaming answer (or its
error body) as the client receives it — the worker's bytes, `content-type`, `content-length` and the
gateway's `x-request-id`. The same headers Starlette's `Response(body, status, {"x-request-id": ...},
media_type=...)` would build (a `text/*` type without a charset gets `; charset=utf-8`), without its
per-response header assembly (hot path).

`StreamSession`: one relayed stream (`SseRelay` over the worker's chunks): yields the bytes to send,
measures TTFT, ITL and per-request TPOT at the gateway, renews the request's KV lease per relayed event,
enforces `total_timeout_s` between chunks, ends a stream that fails after its first byte with an OpenAI
error event and `data: [DONE]`, and closes exactly once — the upstream response (unread → the connection
is dropped, which aborts the request in the worker), the lease, and the request's terminal outcome.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from scheduler.routing.reasons import Outcome
from server.errors import stream_error_event
from server.failure import Lease, classify
from server.footprint import ParsedRequest
from server.proxy import SseRelay
from server.upstream import H1Response, UpstreamResponse

if TYPE_CHECKING:
    from server.dispatch import Dispatcher, RequestRecord


def _media_type(content_type: str) -> bytes:
    if content_type.startswith("text/") and "charset=" not in content_type.lower():
        content_type += "; charset=utf-8"  # as Starlette's media_type handling
    return content_type.encode("latin-1")


class PassthroughResponse(Response):
    """A worker's whole answer with the gateway's request id (module docstring)."""

    def __init__(self, body: bytes, status: int, request_id: str, content_type: str) -> None:
        self.status_code = status
        self.body = body
        self.background = None
        headers = [(b"x-request-id", request_id.encode("latin-1"))]
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
    """One relayed stream: yields bytes, measures TTFT/ITL, and closes exactly once with an outcome."""

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
        self.relay = SseRelay(strip_usage=not parsed.client_wants_usage)
        self.closed = False

    async def body(self) -> AsyncIterator[bytes]:
        d, rec = self.d, self.rec
        clock = d.clock
        itl = d.child(d.metrics.itl, rec.model, rec.pool)
        deadline = rec.arrival + d.limits.total_timeout_s
        outcome = Outcome.WORKER_ERROR
        try:
            out = self.relay.feed(self.first)
            last = first_at = clock()
            d.child(d.metrics.ttft, rec.model, rec.pool).observe(last - rec.arrival)
            if out:
                yield out
            lease = self.lease
            generated = out.count(b"data: ")  # ≈ tokens: vLLM sends one event per step per sequence
            async for chunk in self.chunks:
                out = self.relay.feed(chunk)
                if not out:
                    continue
                now = clock()
                itl.observe(now - last)
                last = now
                generated += out.count(b"data: ")
                lease.on_tokens(generated, now)  # renews KV leases; grows `predicted` reservations
                yield out
                if now > deadline:
                    raise TimeoutError(f"total timeout {d.limits.total_timeout_s:g} s")
            tail = self.relay.flush()
            if tail:
                yield tail
            n = int((self.relay.usage or {}).get("completion_tokens") or 0)
            if n >= 2:  # per-request TPOT as vLLM and the load generator define it: (e2e − TTFT) / (n − 1)
                d.child(d.metrics.tpot, rec.model, rec.pool).observe((last - first_at) / (n - 1))
            outcome = Outcome.COMPLETED
        except (httpx.HTTPError, TimeoutError) as exc:
            kind, hard = classify(exc)
            d.registry.report_failure(self.lease.decision.decode.id, f"stream_{kind}", hard)
            yield stream_error_event(
                f"Upstream stream failed after it began ({kind}).", 502, "BadGatewayError"
            )
            outcome = Outcome.WORKER_ERROR
        except BaseException:
            outcome = Outcome.CLIENT_DISCONNECTED
            raise
        finally:
            await self._close(outcome)

    async def close(self) -> None:
        """Called by the response however it ends; a no-op after the body's own close."""
        await self._close(Outcome.CLIENT_DISCONNECTED)

    async def _close(self, outcome: Outcome) -> None:
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
            self.lease.release(outcome)
            self.d.finish(self.rec, 200, outcome, self.relay.usage)
