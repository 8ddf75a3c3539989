"""Bounded per-model admission queue with a deadline (the "Permit" step of the request path).

When the router answers `Reject(retryable=True)` (every candidate is at capacity or out of KV), the
request waits here instead of in a worker's queue. Order is FIFO per model: only the head waiter asks the
router again, so a burst cannot overtake requests already waiting. The head is woken when capacity
frees (a request on a worker of that model completes → `notify(model)`), when a scrape refreshes the
fleet view (`notify_all()`), and at least every `poll_s` as a safety net. When the head is admitted it
wakes the next waiter at once, so several freed slots are used in one go.

**With the KV ledger** (`QueuePolicy`, `server.kv_admission`): *backfill* — the first `1 + backfill`
waiters may each ask the router when it is their turn (a rejected one wakes the next), so small requests
use KV a large head cannot; *aging* — the head, once it has waited `kv.queue.aging_s`, gets a ledger hold
on its best worker so the backfill cannot take the pages it waits for; *batch* — instead of per-waiter
attempts, the head runs one CP-SAT/greedy plan over the first `max_head` waiters and hands each planned
waiter its decision (reserved on the planned worker; plans answer by `plan_keys`, the request id made unique
within the head, since clients choose ids). A waiter that leaves (admitted, deadline, client gone) drops its hold; a planned
decision whose waiter left, or that no waiter takes, is released.

Refusals: queue already holding `max_size` waiters → 429 `queue_full`; deadline passed → `queue_timeout`,
429 when the last reject was a full worker (kv_full, at_capacity), 503 when no worker was available
(unhealthy, starting, draining, a pool at zero); a non-retryable reject (nothing could ever serve it) → the router's own status and
body for its primary reason (`scheduler.routing.reasons.REJECT_TABLE`: e.g. 400 `context_length_exceeded`,
503 `no_worker_for_role`). Each carries
`Retry-After` from the router's `retry_after_s` (or the queue deadline when the router gave none).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from server.errors import Cause, GatewayError


class RejectLike(Protocol):
    @property
    def reason(self) -> str: ...

    @property
    def retry_after_s(self) -> float: ...

    @property
    def retryable(self) -> bool: ...

    @property
    def http_status(self) -> int: ...

    def error_body(self, model: str | None = None) -> dict[str, Any]: ...


D = TypeVar("D")


class QueuePolicy(Protocol[D]):
    """What the KV ledger adds to the queue (`server.kv_admission.KvQueuePolicy`); None → plain FIFO.

    `backfill`: waiters behind the head that may try the router too, in order, when it is their turn.
    `batch`: waiters are not routed one by one; the head runs `plan` over the first `max_head` waiters
    (one tick at a time per model) and each planned waiter is handed its decision.
    """

    backfill: int
    batch: bool
    max_head: int

    def before_attempt(self, req: Any, waited_s: float) -> None:
        """The head waiter is about to ask the router again (aging: hold pages for it)."""

    def leave(self, req: Any) -> None:
        """The waiter left the queue, admitted or not (drop its hold)."""

    async def plan(self, model: str, reqs: list[Any]) -> dict[str, D]:
        """Batch mode: decisions (reservations made) for some of `reqs`, by `plan_keys(reqs)` (the request
        id, made unique within the list: clients choose ids, and two waiters may share one)."""
        ...

    def discard(self, decision: D) -> None:
        """A planned decision whose waiter had already left: release it."""


def plan_keys(reqs: list[Any]) -> list[str]:
    """One key per request of a batch plan, in order: its `request_id`, or, when an earlier request of the
    list already took that key, `<request_id>#<n>` with the least n ≥ 1 still free. Deterministic, so the
    policy that plans and the queue that hands out the decisions agree on which waiter each one is for."""
    used: set[str] = set()
    out = []
    for r in reqs:
        key = r.request_id
        n = 0
        while key in used:
            n += 1
            key = f"{r.request_id}#{n}"
        used.add(key)
        out.append(key)
    return out


class _Waiter(Generic[D]):
    __slots__ = ("event", "has_result", "req", "result", "since")

    def __init__(self, req: Any, since: float) -> None:
        self.event = asyncio.Event()
        self.req = req
        self.since = since
        self.result: D | None = None
        self.has_result = False


class AdmissionQueue(Generic[D]):
    """FIFO waiters per model. `attempt()` returns a decision (admitted) or a reject-like object."""

    def __init__(
        self,
        max_size: int,
        deadline_s: float,
        is_reject: Callable[[object], bool],
        poll_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        policy: QueuePolicy[D] | None = None,
    ) -> None:
        self._max = max_size
        self._deadline_s = deadline_s
        self._is_reject = is_reject
        self._poll_s = poll_s
        self._clock = clock
        self.policy = policy
        self._queues: dict[str, deque[_Waiter[D]]] = {}
        # called with the model and the router's reject when a request starts waiting after one
        self.on_queued: Callable[[str, RejectLike], None] | None = None

    def depths(self) -> dict[str, int]:
        return {model: len(q) for model, q in self._queues.items()}

    def notify(self, model: str) -> None:
        q = self._queues.get(model)
        if q:
            q[0].event.set()

    def notify_all(self) -> None:
        for q in self._queues.values():
            if q:
                q[0].event.set()

    async def admit(self, model: str, attempt: Callable[[], D | RejectLike], req: Any = None) -> D:
        """A decision for the request, possibly after waiting; `GatewayError` (429/503) otherwise.

        `req` (the request's `RouteRequest`) lets the queue policy age and batch-plan it; without it the
        waiter is only ever routed through `attempt`."""
        q = self._queues.get(model)
        if q is None:  # not setdefault(model, deque()): that builds a deque per request
            q = self._queues[model] = deque()
        last: RejectLike | None = None
        if not q:  # nobody waiting: try at once (the common, uncontended path)
            result = attempt()
            if not self._is_reject(result):
                return result  # type: ignore[return-value]
            reject: RejectLike = result  # type: ignore[assignment]
            last = reject
            self._refuse_if_final(model, reject)
        elif self.policy is not None and (
            (self.policy.batch and req is not None) or len(q) >= 1 + self.policy.backfill
        ):
            # Batch mode plans waiters rather than routing them one by one, and per-request mode routes only
            # the first 1 + backfill waiters, so a request no worker can ever serve (a prompt over every
            # worker's context, a KV footprint over every worker's, …) would learn it only at its deadline or
            # when it reaches the window. Probe the router once: a final reject ends it now with the
            # router's status; a decision is released at once, and the request waits its turn.
            probe = attempt()
            if self._is_reject(probe):
                last = probe  # type: ignore[assignment]
                self._refuse_if_final(model, last)  # type: ignore[arg-type]
            else:
                self.policy.discard(probe)  # type: ignore[arg-type]
        if len(q) >= self._max:
            raise GatewayError(
                Cause.QUEUE_FULL,
                f"Too many requests waiting for model {model!r} ({len(q)} queued); try again later."
                + (f" Last routing result: {last.reason}" if last else ""),
                retry_after_s=last.retry_after_s if last and last.retry_after_s > 0 else self._deadline_s,
            )
        if last is not None and self.on_queued is not None:
            self.on_queued(model, last)
        return await self._wait(model, q, attempt, last, req)

    async def _wait(
        self,
        model: str,
        q: deque[_Waiter[D]],
        attempt: Callable[[], D | RejectLike],
        last: RejectLike | None,
        req: Any,
    ) -> D:
        waiter: _Waiter[D] = _Waiter(req, self._clock())
        q.append(waiter)
        deadline = waiter.since + self._deadline_s
        tried_just_now = last is not None  # admit() asked the router a moment ago: wait before asking again
        policy = self.policy
        batch = policy is not None and policy.batch and req is not None
        window = 1 + (policy.backfill if policy is not None else 0)
        returned = False
        try:
            while True:
                waiter.event.clear()
                if not waiter.has_result and not tried_just_now and batch and q and q[0] is waiter:
                    await self._tick(model, q)  # may hand this waiter (and others) a planned decision
                if waiter.has_result:
                    returned = True
                    return waiter.result  # type: ignore[return-value]
                pos = self._position(q, waiter, window) if not tried_just_now and not batch else -1
                if pos >= 0:
                    if pos == 0 and policy is not None and req is not None:
                        policy.before_attempt(req, self._clock() - waiter.since)
                    result = attempt()
                    if not self._is_reject(result):
                        q.remove(waiter)
                        self._wake(q, pos)  # the next waiter in line may fit too
                        returned = True
                        return result  # type: ignore[return-value]
                    reject: RejectLike = result  # type: ignore[assignment]
                    last = reject
                    self._refuse_if_final(model, reject)
                    if pos + 1 < window:
                        self._wake(q, pos + 1)  # backfill: the next waiter in the window tries too
                remaining = deadline - self._clock()
                if remaining <= 0:
                    # full (429: kv_full, at_capacity) or unavailable (503: every worker unhealthy, starting,
                    # draining, a pool at zero): a dead backend is not a rate limit to the client
                    unavailable = last is not None and getattr(last, "http_status", 429) == 503
                    raise GatewayError(
                        Cause.QUEUE_TIMEOUT,
                        f"No {'worker available' if unavailable else 'capacity'} for model {model!r} within "
                        f"{self._deadline_s:g} s" + (f": {last.reason}" if last else ""),
                        retry_after_s=last.retry_after_s
                        if last and last.retry_after_s > 0
                        else self._deadline_s,
                        status_override=503 if unavailable else None,
                    )
                tried_just_now = False
                # asyncio.timeout, not wait_for: on 3.11 wait_for returns the inner result and drops a
                # cancellation that lands while the event is being set (a notify on every lease release),
                # so a disconnect or the shutdown's cancel of a queued request was lost under load
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, self._poll_s)):
                        await waiter.event.wait()
        finally:
            if waiter in q:
                was_head = q[0] is waiter
                q.remove(waiter)
                if was_head:
                    self.notify(model)
            if policy is not None and req is not None:
                policy.leave(req)
                if waiter.has_result and not returned:  # planned, then cancelled before it resumed
                    policy.discard(waiter.result)  # type: ignore[arg-type]

    @staticmethod
    def _position(q: deque[_Waiter[D]], waiter: _Waiter[D], window: int) -> int:
        """The waiter's place in line if within the first `window`, else -1."""
        for i, w in enumerate(q):
            if i >= window:
                return -1
            if w is waiter:
                return i
        return -1

    @staticmethod
    def _wake(q: deque[_Waiter[D]], pos: int) -> None:
        if pos < len(q):
            q[pos].event.set()

    async def _tick(self, model: str, q: deque[_Waiter[D]]) -> None:
        """Batch mode, run by the head: plan the first `max_head` waiters, hand out the decisions."""
        policy = self.policy
        assert policy is not None
        head = [w for w in list(q)[: policy.max_head] if w.req is not None and not w.has_result]
        if not head:
            return
        # the oldest waiter's aging hold, as in per-request mode: the plan's age weight cannot help a request
        # that never fits, since every tick plans the freed pages into smaller ones (it starved to its 429)
        policy.before_attempt(head[0].req, self._clock() - head[0].since)
        reqs = [w.req for w in head]
        decided = await policy.plan(model, reqs)
        admitted = False
        for key, w in zip(plan_keys(reqs), head, strict=True):
            d = decided.pop(key, None)
            if d is None:
                continue
            if w in q:
                q.remove(w)  # admitted: out of the line now, so the next tick does not plan it again
                w.result, w.has_result = d, True
                w.event.set()
                admitted = True
            else:
                policy.discard(d)
        for d in decided.values():
            policy.discard(d)
        if admitted and q:
            q[0].event.set()  # the (possibly new) head plans again: waiters past `max_head` may fit too

    @staticmethod
    def _refuse_if_final(model: str, reject: RejectLike) -> None:
        """A non-retryable reject ends the request with the router's own status and body (REJECT_TABLE)."""
        if not reject.retryable:
            raise GatewayError(
                Cause.NO_WORKER,
                f"No worker can serve this request: {reject.reason}",
                retry_after_s=reject.retry_after_s if reject.retry_after_s > 0 else None,
                status_override=getattr(reject, "http_status", None),
                body_override=reject.error_body(model) if hasattr(reject, "error_body") else None,
                # labelled by what refused it (context_length_exceeded, model_not_found, ...): a client's
                # error is not a capacity shortage on a dashboard
                reason_override=reject.rule.code if hasattr(reject, "rule") else None,
            )
