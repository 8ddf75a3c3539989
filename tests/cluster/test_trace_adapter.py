"""The simulator's arrivals are the load generator's schedule: `mosaic simulate` and `mosaic replay` send a
trace at the same instants."""

from __future__ import annotations

import pytest

from loadgen.schedule import ScheduleOptions, schedule
from loadgen.trace import TraceRequest
from simulator.trace_adapter import sim_requests

UNTIMED = [TraceRequest(None, 100 + i, 10) for i in range(20)]
TIMED = [TraceRequest(0.5 * i, 100, 10) for i in range(20)]


def test_a_rate_gives_replays_poisson_arrivals() -> None:
    """The same instants as replay's (it once drew its own gaps, with another seeding): vLLM's spacing, the
    first after a gap and the 20th at exactly 20 / rate."""
    sim = [r.arrival_s for r in sim_requests(UNTIMED, rate=0.1, seed=3)]
    replay = [s.send_at_s for s in schedule(UNTIMED, ScheduleOptions(rate=0.1, seed=3))]
    assert sim == replay and sim[0] > 0.0 and sim[-1] == pytest.approx(20 / 0.1, rel=1e-12)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_a_timed_trace_is_scaled_as_replay_scales_it(scale: float) -> None:
    assert [r.arrival_s for r in sim_requests(TIMED, rate_scale=scale, max_requests=7)] == [
        0.5 * i / scale for i in range(7)
    ]


def test_an_untimed_trace_needs_a_rate() -> None:
    with pytest.raises(ValueError, match="no arrival times: give a rate"):
        list(sim_requests(UNTIMED))
