"""Bounded per-model admission queue with a deadline (the "Permit" step of the request path).

When the router answers `Reject(retryable=True)` (every candidate is at capacity or out of KV), the
request waits here instead of in a worker's queue. Order is FIFO per model: only the head waiter asks the
router again, so a burst cannot overtake requests already waiting. The head is woken when capacity
frees (a request on a worker of that model completes → `notify(model)`), when a scrape refreshes the
fleet view (`notify_all()`), and at least every `poll_s` as a safety net. When the head is admitted it
wakes the next waiter at once, so several freed slots are used in one go.

Refusals: queue already holding `max_size` waiters → 429 `queue_full`; deadline passed → 429
`queue_timeout`; a non-retryable reject (nothing could ever serve it) → the router's own status and
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


class _Waiter:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()


class AdmissionQueue(Generic[D]):
    """FIFO waiters per model. `attempt()` returns a decision (admitted) or a reject-like object."""

    def __init__(
        self,
        max_size: int,
        deadline_s: float,
        is_reject: Callable[[object], bool],
        poll_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max = max_size
        self._deadline_s = deadline_s
        self._is_reject = is_reject
        self._poll_s = poll_s
        self._clock = clock
        self._queues: dict[str, deque[_Waiter]] = {}

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

    async def admit(self, model: str, attempt: Callable[[], D | RejectLike]) -> D:
        """A decision for the request, possibly after waiting; `GatewayError` (429/503) otherwise."""
        q = self._queues.setdefault(model, deque())
        last: RejectLike | None = None
        if not q:  # nobody waiting: try at once (the common, uncontended path)
            result = attempt()
            if not self._is_reject(result):
                return result  # type: ignore[return-value]
            reject: RejectLike = result  # type: ignore[assignment]
            last = reject
            self._refuse_if_final(model, reject)
        if len(q) >= self._max:
            raise GatewayError(
                Cause.QUEUE_FULL,
                f"Too many requests waiting for model {model!r} ({len(q)} queued); try again later."
                + (f" Last routing result: {last.reason}" if last else ""),
                retry_after_s=last.retry_after_s if last and last.retry_after_s > 0 else self._deadline_s,
            )
        return await self._wait(model, q, attempt, last)

    async def _wait(
        self, model: str, q: deque[_Waiter], attempt: Callable[[], D | RejectLike], last: RejectLike | None
    ) -> D:
        waiter = _Waiter()
        q.append(waiter)
        deadline = self._clock() + self._deadline_s
        tried_just_now = last is not None  # admit() asked the router a moment ago: wait before asking again
        try:
            while True:
                if q and q[0] is waiter and not tried_just_now:
                    result = attempt()
                    if not self._is_reject(result):
                        q.popleft()
                        self.notify(model)  # the next waiter may fit too
                        return result  # type: ignore[return-value]
                    reject: RejectLike = result  # type: ignore[assignment]
                    last = reject
                    self._refuse_if_final(model, reject)
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise GatewayError(
                        Cause.QUEUE_TIMEOUT,
                        f"No capacity for model {model!r} within {self._deadline_s:g} s"
                        + (f": {last.reason}" if last else ""),
                        retry_after_s=last.retry_after_s
                        if last and last.retry_after_s > 0
                        else self._deadline_s,
                    )
                tried_just_now = False
                waiter.event.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.event.wait(), min(remaining, self._poll_s))
        finally:
            if waiter in q:
                was_head = q[0] is waiter
                q.remove(waiter)
                if was_head:
                    self.notify(model)

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
            )
