"""Trace requests (the load generator's readers) as cluster-simulator arrivals, timed by the load
generator's own schedule (`loadgen.schedule`), so `mosaic simulate` and `mosaic replay` send the same trace
at the same instants: the trace's times divided by the rate scale, or, with `rate`, Poisson arrivals from
t = 0 drawn with replay's seeding."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from loadgen.schedule import ScheduleOptions, schedule
from loadgen.trace import TraceRequest
from simulator.cluster import SimRequest

# The simulator's clock advances by its scrape and decision intervals (seconds): an arrival this late or
# later cannot be reached (t + interval == t in floating point), and the run would never end.
LATEST_ARRIVAL_S = 1e12


def sim_requests(
    trace: Iterable[TraceRequest],
    rate_scale: float = 1.0,
    rate: float | None = None,
    max_requests: int | None = None,
    seed: int = 0,
) -> Iterator[SimRequest]:
    """Arrivals at the trace's times divided by `rate_scale` (2 → twice as fast), or Poisson at `rate`
    requests/s (required when the trace has no times). Streams: nothing is held in memory. ValueError
    (loadgen's ScheduleError) for a rate, scale or trace the schedule refuses, or an arrival past
    `LATEST_ARRIVAL_S` (e.g. `rate_scale` 1e-300: the run never reached it)."""
    opts = ScheduleOptions(rate_scale=rate_scale, rate=rate, max_requests=max_requests, seed=seed)
    opts.validate(timed=True)  # the numbers; an untimed trace without a rate is caught per row below

    def timed_or_rated(rows: Iterable[TraceRequest]) -> Iterator[TraceRequest]:
        for req in rows:
            if rate is None and req.arrival_s is None:
                raise ValueError("this trace has no arrival times: give a rate")
            yield req

    for sent in schedule(timed_or_rated(trace), opts):
        if not sent.send_at_s < LATEST_ARRIVAL_S:
            raise ValueError(
                f"an arrival at {sent.send_at_s:g} s (request {sent.index}) is past what the simulator can "
                f"reach ({LATEST_ARRIVAL_S:g} s): use a larger rate scale or rate"
            )
        yield SimRequest(sent.send_at_s, sent.input_tokens, max(1, sent.output_tokens), sent.hash_ids)
