"""`server.deadlines.TaskTimeouts`: asyncio.timeout's semantics on one sweeping timer."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.deadlines import TaskTimeouts


def test_a_block_running_past_its_deadline_raises_timeout_error_within_one_period() -> None:
    async def go() -> float:
        timeouts = TaskTimeouts(period=0.02)
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            async with timeouts.timeout(0.1):
                await asyncio.sleep(5)
        assert timeouts._handle is None and not timeouts._open  # nothing left open, no timer armed
        return time.monotonic() - start

    elapsed = asyncio.run(go())
    assert 0.1 <= elapsed < 0.1 + 0.02 + 0.2  # deadline + one period (+ scheduling slack on a busy machine)


def test_a_block_finishing_in_time_returns_normally_and_disarms() -> None:
    async def go() -> None:
        timeouts = TaskTimeouts(period=0.01)
        async with timeouts.timeout(1.0):
            await asyncio.sleep(0.02)
        assert not timeouts._open
        await asyncio.sleep(0.05)  # the sweep ran once more, found nothing and stopped
        assert timeouts._handle is None

    asyncio.run(go())


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def go() -> None:
        timeouts = TaskTimeouts(period=0.01)

        async def victim() -> None:
            async with timeouts.timeout(10):
                await asyncio.sleep(5)

        task = asyncio.create_task(victim())
        await asyncio.sleep(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not timeouts._open

    asyncio.run(go())


def test_nested_blocks_each_time_out_on_their_own_deadline() -> None:
    async def go() -> list[str]:
        timeouts = TaskTimeouts(period=0.01)
        seen: list[str] = []
        async with timeouts.timeout(5):
            try:
                async with timeouts.timeout(0.05):
                    await asyncio.sleep(5)
            except TimeoutError:
                seen.append("inner")
            await asyncio.sleep(0.02)  # the outer block is still alive and not cancelled
            seen.append("outer alive")
        return seen

    assert asyncio.run(go()) == ["inner", "outer alive"]
