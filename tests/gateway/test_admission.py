"""The bounded per-model admission queue: FIFO, woken when capacity frees, deadline and size → 429 (a deadline
without any worker up → 503)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from server.admission import AdmissionQueue
from server.errors import Cause, GatewayError


@dataclass
class R:
    reason: str = "no worker fits: 2 at_capacity"
    retry_after_s: float = 1.0
    retryable: bool = True


def _queue(size: int = 4, deadline: float = 5.0, poll: float = 10.0) -> AdmissionQueue[str]:
    return AdmissionQueue(size, deadline, is_reject=lambda r: isinstance(r, R), poll_s=poll)


def test_uncontended_request_is_admitted_at_once() -> None:
    q = _queue()
    assert asyncio.run(q.admit("m", lambda: "worker-1")) == "worker-1"


def test_waiters_are_admitted_in_order_when_capacity_frees() -> None:
    async def run() -> list[str]:
        q = _queue()
        free = {"slots": 0}
        order: list[str] = []

        def attempt(name: str) -> object:
            def go() -> object:
                if free["slots"] > 0:
                    free["slots"] -= 1
                    return name
                return R()

            return go

        async def client(name: str) -> None:
            order.append(await q.admit("m", attempt(name)))

        tasks = [asyncio.create_task(client(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0.01)
        assert q.depths() == {"m": 3}
        free["slots"] = 2  # two completions free two slots; one notify admits the head, which wakes the next
        q.notify("m")
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and q.depths() == {"m": 1}
        free["slots"] = 1
        q.notify("m")
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == ["a", "b", "c"]


def test_full_queue_rejects_with_429_and_retry_after() -> None:
    async def run() -> None:
        q = _queue(size=1)
        waiting = asyncio.create_task(q.admit("m", R))
        await asyncio.sleep(0.01)
        with pytest.raises(GatewayError) as err:
            await q.admit("m", lambda: R(retry_after_s=2.5))
        # a newcomer does not ask the router while others wait (FIFO): Retry-After is the queue deadline
        assert (
            err.value.cause is Cause.QUEUE_FULL and err.value.status == 429 and err.value.retry_after_s == 5.0
        )
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert q.depths() == {"m": 0}  # a cancelled waiter leaves the queue

    asyncio.run(run())


def test_deadline_rejects_with_429() -> None:
    async def run() -> None:
        q = _queue(deadline=0.05, poll=0.01)
        with pytest.raises(GatewayError) as err:
            await q.admit("m", R)
        assert err.value.cause is Cause.QUEUE_TIMEOUT and err.value.status == 429
        assert "at_capacity" in err.value.message

    asyncio.run(run())


def test_deadline_with_no_worker_available_is_503_not_a_rate_limit() -> None:
    """The last try found no worker up (unhealthy, starting, a pool at zero: the router's 503 rows): a dead
    backend answered 429 RateLimitError, which sends clients and operators looking for a rate limit."""

    @dataclass
    class Down(R):
        reason: str = "no worker fits: 1 unhealthy"
        retry_after_s: float = 5.0
        http_status: int = 503

    async def run() -> None:
        q = _queue(deadline=0.05, poll=0.01)
        with pytest.raises(GatewayError) as err:
            await q.admit("m", Down)
        assert err.value.cause is Cause.QUEUE_TIMEOUT and err.value.status == 503
        assert err.value.body()["error"] == {
            "message": "No worker available for model 'm' within 0.05 s: no worker fits: 1 unhealthy",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": "queue_timeout",
        }
        assert err.value.retry_after_s == 5.0

    asyncio.run(run())


def test_non_retryable_reject_is_final() -> None:
    with pytest.raises(GatewayError) as err:
        asyncio.run(_queue().admit("m", lambda: R(reason="no worker fits: 1 wrong_role", retryable=False)))
    assert err.value.cause is Cause.NO_WORKER and err.value.status == 503


def test_zero_size_queue_rejects_at_once() -> None:
    with pytest.raises(GatewayError) as err:
        asyncio.run(_queue(size=0).admit("m", R))
    assert err.value.cause is Cause.QUEUE_FULL


@dataclass
class BatchPolicy:
    """A batch-mode queue policy whose plans admit nobody; records the decisions it is asked to discard."""

    batch: bool = True
    backfill: int = 0
    max_head: int = 8

    def __post_init__(self) -> None:
        self.discarded: list[object] = []

    def before_attempt(self, req: object, waited_s: float) -> None:
        return None

    def leave(self, req: object) -> None:
        return None

    async def plan(self, model: str, reqs: list[object]) -> dict[str, object]:
        return {}

    def discard(self, decision: object) -> None:
        self.discarded.append(decision)


@dataclass
class Req:
    request_id: str


def test_batch_mode_refuses_an_unservable_newcomer_at_once_and_queues_a_servable_one() -> None:
    # Behind a waiter, batch mode does not route newcomers; it probes the router once so a final reject
    # (e.g. a prompt over every worker's context) is answered now, not with a 429 at the deadline.
    async def run() -> None:
        policy = BatchPolicy()
        q: AdmissionQueue[object] = AdmissionQueue(
            4, 5.0, is_reject=lambda r: isinstance(r, R), poll_s=10.0, policy=policy
        )
        first = asyncio.create_task(q.admit("m", R, Req("r1")))
        await asyncio.sleep(0.01)
        assert q.depths() == {"m": 1}
        with pytest.raises(GatewayError) as err:
            await q.admit(
                "m", lambda: R(reason="no worker fits: 2 context_length", retryable=False), Req("r2")
            )
        assert err.value.cause is Cause.NO_WORKER and policy.discarded == []
        second = asyncio.create_task(q.admit("m", lambda: "decision-r3", Req("r3")))
        await asyncio.sleep(0.01)
        assert policy.discarded == ["decision-r3"]  # the probe's decision is released ...
        assert q.depths() == {"m": 2}  # ... and r3 waits behind r1 (FIFO)
        for t in (first, second):
            t.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        assert q.depths() == {"m": 0}

    asyncio.run(run())


@pytest.mark.parametrize(("backfill", "probed"), [(0, True), (1, False)])
def test_a_newcomer_outside_the_backfill_window_is_probed_for_a_final_reject(
    backfill: int, probed: bool
) -> None:
    """Per-request mode routes only the first 1 + backfill waiters: a newcomer outside that window that no
    worker can ever serve (a KV footprint over every worker's) waited until it reached the window (the head's
    remaining deadline) for its 400. It is probed once on arrival, as in batch mode; inside the window the
    queue routes it anyway."""

    async def run() -> None:
        policy = BatchPolicy(batch=False, backfill=backfill)
        q: AdmissionQueue[object] = AdmissionQueue(
            4, 5.0, is_reject=lambda r: isinstance(r, R), poll_s=10.0, policy=policy
        )
        first = asyncio.create_task(q.admit("m", R))
        await asyncio.sleep(0.01)
        final = R(reason="no worker fits: 1 kv_exceeds_capacity", retryable=False)
        if probed:  # at once: the head holds the window for its whole 5 s deadline
            with pytest.raises(GatewayError) as err:
                await asyncio.wait_for(q.admit("m", lambda: final), 1.0)
            assert err.value.cause is Cause.NO_WORKER
        else:  # inside the window the wait's own first attempt refuses it
            with pytest.raises(GatewayError):
                await asyncio.wait_for(q.admit("m", lambda: final), 1.0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)

    asyncio.run(run())
