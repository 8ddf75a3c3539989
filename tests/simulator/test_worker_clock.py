"""The simulated worker's clock: simulated time keeps pace with the engine through long busy periods."""

from __future__ import annotations

import asyncio

import pytest

import simulator.worker_runtime as runtime_module
from simulator.requests import EngineRequest
from simulator.worker_app import WorkerConfig, WorkerRuntime

pytestmark = pytest.mark.anyio


async def test_a_busy_period_longer_than_the_idle_cap_does_not_freeze_the_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The idle-gap cap (an hour of simulated time; 0.2 s here) bounds idle gaps only. It was measured from
    the last rebase, so after a cap's worth of on-time steps the clock stopped while the engine went on and
    a new arrival was stamped in the past (its TTFT inflated by the whole difference)."""
    monkeypatch.setattr(runtime_module, "IDLE_GAP_CAP_S", 0.2)
    rt = WorkerRuntime(WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=1.0, seed=1))
    try:
        busy = EngineRequest("long", list(range(100, 164)), 400, 0, True)
        await rt.driver.submit_all([busy], stream=False)
        await asyncio.sleep(0.6)  # ~0.6 simulated s of steps, three times the cap
        late = EngineRequest("late", list(range(200, 232)), 4, 0, True)
        (ticket,) = await rt.driver.submit_all([late], stream=False)
        record = await ticket.wait_done()
        # arrival within one step of the engine's time; before: stamped at the cap (0.2 s) while the
        # engine was at ~0.6 s, a TTFT of ~0.4 s
        assert record.arrival > 0.5
        assert record.first_token - record.arrival < 0.05
    finally:
        await rt.aclose()
