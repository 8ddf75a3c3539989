"""The simulator's arrivals are the load generator's schedule: `mosaic simulate` and `mosaic replay` send a
trace at the same instants."""

from __future__ import annotations

import pytest

from loadgen.schedule import ScheduleOptions, schedule
from loadgen.trace import TraceRequest
from simulator.trace_adapter import sim_requests

UNTIMED = [TraceRequest(None, 100 + i, 10) for i in range(20)]
TIMED = [TraceRequest(0.5 * i, 100, 10) for i in range(20)]


def test_a_rate_gives_replays_poisson_arrivals_from_zero() -> None:
    """It drew its own gaps (another seeding) and added one before the first request: ~1/rate of idle time
    counted in the goodput denominator and billed."""
    sim = [r.arrival_s for r in sim_requests(UNTIMED, rate=0.1, seed=3)]
    replay = [s.send_at_s for s in schedule(UNTIMED, ScheduleOptions(rate=0.1, seed=3))]
    assert sim == replay and sim[0] == 0.0


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_a_timed_trace_is_scaled_as_replay_scales_it(scale: float) -> None:
    assert [r.arrival_s for r in sim_requests(TIMED, rate_scale=scale, max_requests=7)] == [
        0.5 * i / scale for i in range(7)
    ]


def test_an_untimed_trace_needs_a_rate() -> None:
    with pytest.raises(ValueError, match="no arrival times: give a rate"):
        list(sim_requests(UNTIMED))
