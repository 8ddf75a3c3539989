"""Failure handling primitives: the reservation lease, upstream failure classes, and the relay response.

**Lease.** One routing decision's reservations (the router's Reserve step, e.g. the KV ledger) and the
in-flight tickets of the hops dispatched under it. `release(outcome)` runs exactly once — later calls
are no-ops — and does everything the end of a request on those workers implies: the reservations'
`release(outcome)` (last made first), in-flight tickets done, the router's `on_complete` per worker, and
an admission wake-up for the model. As an async context manager it releases on exit with the outcome
its exception implies (none → completed; cancellation → client_disconnected; `UpstreamFailure` →
failed_before_first_byte; anything else → worker_error).

**UpstreamFailure.** A worker could not serve the request before any byte reached the client: connect
error, timeout, a protocol error, or a retryable status (429, 502, 503, 504). The dispatcher may retry
it on another worker. `hard` failures (connection refused) eject the worker at once (breaker).

**RelayResponse.** A streaming response that always runs its session's `close()` — also when the client
disconnects before the body iterator ever started, which a plain async generator's `finally` would miss.
Given a `push`, it hands the gateway's `FastCycle` to it instead of iterating the body (the relay then
writes each chunk from the worker's reads: `server.responses.StreamSession`).

**DisconnectWatch.** Watches the ASGI `receive` channel and cancels the serving task when the client goes
away (used before the response starts, and by `RelayResponse` while streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Any

import anyio
import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from scheduler.routing.framework import Decision, Router, RouteRequest
from scheduler.routing.reasons import Outcome
from server.errors import SHUTDOWN_MESSAGE, shutting_down, stream_error_event
from server.fast_http import ClientStalled, FastCycle
from server.registry import InflightTicket, Registry, SlotLike
from server.upstream import WorkerSevered

SHUTDOWN_EVENT = stream_error_event(SHUTDOWN_MESSAGE, 503, "ServiceUnavailableError")
SHUTDOWN_SEND_S = 0.25  # the longest a stream's last event waits on a full client socket at shutdown


class GatewayOutcome(StrEnum):
    """Terminal outcomes the gateway records beyond the router's `Outcome` (metrics, /admin, logs)."""

    TIMED_OUT = "timed_out"  # total_timeout_s ended the request: a stream, or the wait for a whole answer
    SHUT_DOWN = "shut_down"  # still running when the shutdown grace ran out: the gateway ended it (503)
    INTERNAL_ERROR = "internal_error"  # the gateway itself failed (a bug): no worker is to blame
    # a Responses request with `background: true`: the worker answered `queued` (or `in_progress`) and runs it
    # on its own; the gateway's part ended there, its tokens and KV unseen (docs/gateway.md)
    BACKGROUNDED = "backgrounded"


@dataclass(slots=True)
class UpstreamFailure(Exception):
    worker_id: str
    kind: str  # connect, connect_timeout, timeout, protocol, status_503, removed, ...
    hard: bool = False  # eject the worker now (connection refused)
    status: int | None = None  # the worker's status, when it answered
    body: bytes = b""  # the worker's error body, passed through if retries run out
    content_type: str = "application/json"
    retry_after: str | None = None  # the worker's Retry-After, kept if its 429/503 is passed through
    # the request's own total_timeout_s ran out while it waited (a non-streaming answer): not the worker's
    # fault, and no budget is left for a retry
    budget_spent: bool = False
    sent: bool = True  # False: the request never reached the worker (its budget was spent in the queue)

    def __str__(self) -> str:
        return f"{self.worker_id}: {self.kind}"

    @property
    def is_timeout(self) -> bool:
        return "timeout" in self.kind


def classify(exc: BaseException) -> tuple[str, bool]:
    """(kind, hard) for an exception raised while talking to a worker."""
    if isinstance(exc, WorkerSevered):  # the gateway cut it: the worker fails its health checks
        return "unhealthy", False
    if isinstance(exc, httpx.ConnectError):
        return "connect", True
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect_timeout", False
    if isinstance(exc, httpx.PoolTimeout):
        return "pool_timeout", False
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return "timeout", False
    return "protocol", False


def blame(registry: Registry, worker_id: str, exc: BaseException) -> str:
    """`classify(exc)`, told to the worker's breaker unless it is `pool_timeout` (no free connection of the
    gateway's own: the worker never saw the request). Returns the kind."""
    kind, hard = classify(exc)
    if kind != "pool_timeout":
        registry.report_failure(worker_id, kind, hard)
    return kind


def outcome_for(exc: BaseException | None) -> Outcome:
    if exc is None:
        return Outcome.COMPLETED
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return Outcome.CLIENT_DISCONNECTED
    if isinstance(exc, UpstreamFailure):
        return Outcome.FAILED_BEFORE_FIRST_BYTE
    return Outcome.WORKER_ERROR


class Lease:
    """See module docstring. `track()` adds a hop's in-flight ticket; `first_token()` marks prefill done."""

    __slots__ = (
        "__weakref__",  # the registry's prefill-end heap holds non-streaming leases weakly
        "_growable",
        "_notify",
        "_per_event",
        "_released",
        "_router",
        "_tickets",
        "clock",
        "decision",
        "prefill_outcome",
        "registry",
        "req",
    )

    def __init__(
        self,
        decision: Decision,
        req: RouteRequest,
        registry: Registry,
        router: Router,
        notify: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.decision = decision
        self.req = req
        self.registry = registry
        self._router = router
        self._notify = notify
        self.clock = clock
        self._per_event = 1.0  # tokens per stream event on the decode worker, read at the first `on_tokens`
        self._tickets: list[InflightTicket] = []
        self._released: Outcome | None = None
        # the prefill worker's own outcome for the routing plugins when its hop fell back having built nothing
        # there (`prefill_hop.PREFILL_BUILT_NOTHING`); None: the request's
        self.prefill_outcome: Outcome | None = None
        # reservations on the worker that streams (decode side) with an `on_tokens(generated, now)` hook;
        # found on the first `on_tokens` (only streams call it)
        self._growable: list[Any] | None = None
        router.on_dispatch(decision, req, clock())

    @property
    def outcome(self) -> Outcome | None:
        """The outcome it was released with (None while held)."""
        return self._released

    def track(
        self,
        worker_id: str,
        prompt_tokens: int,
        prefilled_remotely: bool = False,
        slot: SlotLike | None = None,
    ) -> InflightTicket:
        try:
            ticket = self.registry.track(worker_id, prompt_tokens, prefilled_remotely, self.req.adapter, slot)
        except KeyError:
            raise UpstreamFailure(worker_id, "removed") from None
        self._tickets.append(ticket)
        return ticket

    def first_token(self) -> None:
        """Prefill is over: in-flight prompt tokens leave the backlog; KV reservations drop their
        transient prefill pages (reservations that have a `first_token(now)` hook, like the KV ledger's)."""
        for t in self._tickets:
            t.first_token()
        now = self.clock()
        for r in self.decision.reservations:
            hook = getattr(r, "first_token", None)
            if hook is not None:
                hook(now)

    def answered(self) -> None:
        """The stream's first event came: its worker's engine took the request (`InflightTicket.answered`)."""
        for t in self._tickets:
            t.answered()

    def on_tokens(self, events: int, now: float) -> None:
        """`events` token events streamed so far: renews leases and lets reservations grow, by the tokens they
        carry — events times the decode worker's tokens per event (`Registry.tokens_per_event`: more than
        one with speculative decoding or vLLM's --stream-interval), so KV growth and the reconcile's bound on
        what a stream holds count tokens, not events."""
        growable = self._growable
        if growable is None:
            decode_id = self.decision.decode.id
            growable = self._growable = [
                r for r in self.decision.reservations if r.worker_id == decode_id and hasattr(r, "on_tokens")
            ]
            self._per_event = self.registry.tokens_per_event(decode_id)
        generated = events if self._per_event == 1.0 else math.ceil(events * self._per_event)
        for r in growable:
            r.on_tokens(generated, now)

    def release(self, outcome: Outcome) -> bool:
        """Release everything once; True if this call did it."""
        if self._released is not None:
            return False
        self._released = outcome
        try:
            self.decision.release(outcome)
        finally:
            for t in self._tickets:
                t.done()
            now = self.clock()
            decision, router = self.decision, self._router
            router.on_complete(decision.decode.id, self.req, outcome, now)
            if decision.prefill is not None:
                router.on_complete(decision.prefill.id, self.req, self.prefill_outcome or outcome, now)
            self._notify(self.req.model)
        return True

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release(outcome_for(exc))


class RelayResponse(StreamingResponse):
    """A streaming response for relayed streams, lighter than Starlette's and leak-proof.

    Starlette's `StreamingResponse` (ASGI spec < 2.4, as uvicorn speaks) runs the body and a disconnect
    listener as two tasks in an anyio task group per response. Here the body is relayed in the calling
    task and a `DisconnectWatch` cancels it if the client goes away. However the response ends, the
    body iterator is closed and `on_close()` awaited (shielded from cancellation) — also when the client
    left before the first chunk, which a plain async generator's `finally` would miss.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        raw_headers: list[tuple[bytes, bytes]],
        status_code: int = 200,
        push: Callable[[FastCycle], Awaitable[bytes]] | None = None,
        stopped: Callable[[asyncio.Task[Any]], bool] | None = None,
        stall_s: float | None = None,
        shutdown_event: Callable[[], bytes] = lambda: SHUTDOWN_EVENT,
    ) -> None:
        # Headers come ready-made (`server.responses.relay_headers`): Starlette's `init_headers` would
        # encode and scan a header dict per stream.
        self.body_iterator = content
        self.status_code = status_code
        self.background = None
        self.raw_headers = raw_headers
        self._on_close = on_close
        self._push = push
        self._stopped = stopped  # the gateway ended this task for shutdown (`Dispatcher.stop_requests`)
        self._stall_s = (
            stall_s  # a pushed stream's last bytes wait at most this long for a client taking nothing
        )
        self._shutdown_event = shutdown_event  # in the stream's framing (a Responses stream has no [DONE])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = DisconnectWatch(receive, task)
        watch.start()
        exhausted = False  # the body iterator ran to its end (and ran its own clean-up)
        started = False  # the start message went out: a stream's error must be an event, not a status
        last: bytes | None = None  # the pushed stream's last bytes, once it ended (outcome recorded)
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            started = True
            cycle = getattr(send, "__self__", None)
            if self._push is not None and isinstance(cycle, FastCycle):
                # the body written from the worker's reads (`StreamSession.push`), but its last bytes
                last = await self._push(cycle)
                if self._stall_s is not None:  # the outcome is recorded: a client taking nothing is dropped
                    exhausted = True
                    await cycle.drain_within(self._stall_s, math.inf)
            else:
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            exhausted = True
            await send({"type": "http.response.body", "body": last or b"", "more_body": False})
        except ClientStalled:
            # connected but reading nothing past the stall bound: the stream was closed upstream (its slot
            # and KV released), and the connection is dropped, as nothing more can reach that client
            cycle.abort()
        except asyncio.CancelledError:
            if watch.disconnected:
                task.uncancel()  # the client left: nothing to send, nothing to propagate
            elif self._stopped is not None and self._stopped(task):
                # the shutdown grace ran out: end the stream as vLLM ends a failed one, not cut mid-way;
                # bounded, so a client that stopped reading cannot hold the task until uvicorn's own cancel
                task.uncancel()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(SHUTDOWN_SEND_S):
                        await self._send_shutdown(scope, receive, send, started, last)
            else:
                raise
        finally:
            watch.done = True
            watch.stop()
            if exhausted:  # nothing left to finalise: no cancel scope needed (they cost ~10 µs)
                await self._on_close()
            else:
                with anyio.CancelScope(shield=True):
                    aclose = getattr(self.body_iterator, "aclose", None)
                    if aclose is not None:
                        await aclose()  # finalises a generator left suspended at a yield
                    await self._on_close()

    async def _send_shutdown(
        self, scope: Scope, receive: Receive, send: Send, started: bool, last: bytes | None
    ) -> None:
        """The shutdown's end of the answer: the 503 before it began; a stream that had ended (pushed, its
        last bytes held while the client drained) gets those bytes, not an error after its end; else the
        session's shutdown event (nothing after a relayed `[DONE]`)."""
        if not started:  # cancelled while the start message waited: the whole answer is the 503
            await shutting_down().to_response()(scope, receive, send)
        else:
            body = last if last is not None else self._shutdown_event()
            await send({"type": "http.response.body", "body": body, "more_body": False})


class DisconnectWatch:
    """Cancels `task` when the client disconnects while the work is running (`done` False).

    When `receive` belongs to a channel that pushes disconnects (`receive.__self__.on_disconnect(cb)`,
    the gateway's `server.fast_http.FastCycle`), it subscribes: nothing runs per request. Otherwise it
    reads the ASGI `receive` channel in a watcher task until `http.disconnect` (before the response
    starts nothing else reads it: the body was read already). `arm(delay)` subscribes at once, or starts
    the watcher task only after `delay` seconds (requests answered sooner never create one)."""

    __slots__ = ("_receive", "_task", "_timer", "_unsubscribe", "_watcher", "disconnected", "done")

    def __init__(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        self._receive = receive
        self._task = task
        self._watcher: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self.disconnected = False
        self.done = False

    def arm(self, delay: float) -> None:
        if self._subscribe():
            return
        self._timer = asyncio.get_running_loop().call_later(delay, self.start)

    def start(self) -> None:
        if self.done or self._watcher is not None or self._unsubscribe is not None:
            return
        if not self._subscribe():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def _subscribe(self) -> bool:
        subscribe = getattr(getattr(self._receive, "__self__", None), "on_disconnect", None)
        if subscribe is None:
            return False
        self._unsubscribe = subscribe(self._fire)
        return True

    def _fire(self) -> None:
        if not self.done:
            self.disconnected = True
            self._task.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._fire()
                return
