"""The admission queue with the KV queue policy: an aged waiter's ledger hold ends with the waiter however
it leaves — admitted, deadline (429) or cancelled (client disconnect) — and a planned decision whose waiter
was cancelled is released, never leaked."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from scheduler.fleet import FleetView
from scheduler.kv.config import KvConfig
from scheduler.kv.ledger import KvLedger
from scheduler.routing.framework import Decision, RouteRequest
from scheduler.routing.reasons import Outcome
from server.admission import AdmissionQueue
from server.errors import GatewayError
from server.kv_admission import KvQueuePolicy
from tests.kv.kvkit import request, worker


@dataclass
class Busy:
    reason: str = "no worker fits: 1 kv_full"
    retry_after_s: float = 1.0
    retryable: bool = True


def setup(deadline_s: float, batch: bool = False) -> tuple[AdmissionQueue[Decision], KvLedger, KvQueuePolicy]:
    ledger = KvLedger()
    w = worker("w", blocks=100)  # capacity 98
    ledger.reserve(request("running", prompt=800, max_out=0), w, 0.0)  # 50 blocks: the big one waits
    view = FleetView((w,))
    kv = KvConfig(queue={"aging_s": 0.05}, batch_admission={"enabled": batch})  # type: ignore[arg-type]
    policy = KvQueuePolicy(
        kv, ledger, lambda: view, lambda req, exclude: Busy(), asyncio.get_running_loop().time
    )
    queue: AdmissionQueue[Decision] = AdmissionQueue(
        8, deadline_s, is_reject=lambda r: isinstance(r, Busy), poll_s=0.02, policy=policy
    )
    return queue, ledger, policy


BIG = request("big", prompt=1280, max_out=0)  # 80 blocks > 48 free


def holds(ledger: KvLedger) -> int:
    return sum(int(row["holds"] or 0) for row in ledger.snapshot().values())


def test_deadline_429_drops_the_hold() -> None:
    async def run() -> None:
        queue, ledger, policy = setup(deadline_s=0.3)
        waiting = asyncio.create_task(queue.admit("m", Busy, BIG))
        await asyncio.sleep(0.15)
        assert policy.held == {"big": "w"} and holds(ledger) == 80  # aged past 0.05 s: held
        with pytest.raises(GatewayError) as info:
            await waiting
        assert info.value.status == 429
        assert policy.held == {} and holds(ledger) == 0

    asyncio.run(run())


def test_cancelled_waiter_drops_the_hold() -> None:
    async def run() -> None:
        queue, ledger, policy = setup(deadline_s=5.0)
        waiting = asyncio.create_task(queue.admit("m", Busy, BIG))
        await asyncio.sleep(0.15)
        assert holds(ledger) == 80
        waiting.cancel()  # what a client disconnect does to the request's task
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert policy.held == {} and holds(ledger) == 0 and queue.depths() == {"m": 0}

    asyncio.run(run())


class Planned:
    """A stand-in decision: records its release."""

    def __init__(self) -> None:
        self.released: list[Outcome] = []

    def release(self, outcome: Outcome) -> None:
        self.released.append(outcome)


def test_planned_decision_of_a_cancelled_waiter_is_released() -> None:
    async def run() -> None:
        queue, _, policy = setup(deadline_s=5.0, batch=True)
        decision = Planned()
        gate = asyncio.Event()

        async def plan(model: str, reqs: list[RouteRequest]) -> dict[str, Decision]:
            await gate.wait()  # the solve is still running when the second waiter's client goes away
            return {r.request_id: decision for r in reqs if r.request_id == "second"}  # type: ignore[misc]

        policy.plan = plan  # type: ignore[method-assign]
        first = asyncio.create_task(queue.admit("m", Busy, request("first")))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(queue.admit("m", Busy, request("second")))
        await asyncio.sleep(0.05)  # the head is ticking, blocked in plan()
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        gate.set()
        await asyncio.sleep(0.05)
        assert decision.released == [Outcome.UNRESERVED]  # planned for a waiter that had left: released
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(run())
