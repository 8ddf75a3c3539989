"""Trace requests (the load generator's readers) as cluster-simulator arrivals."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

from loadgen.trace import TraceRequest
from simulator.cluster import SimRequest


def sim_requests(
    trace: Iterable[TraceRequest],
    rate_scale: float = 1.0,
    rate: float | None = None,
    max_requests: int | None = None,
    seed: int = 0,
) -> Iterator[SimRequest]:
    """Arrivals at the trace's times divided by `rate_scale` (2 → twice as fast), or Poisson at `rate`
    requests/s when the trace has no times (or `rate` is given). Streams: nothing is held in memory."""
    if rate_scale <= 0 or (rate is not None and rate <= 0):
        raise ValueError("rate_scale and rate must be > 0")
    rng = random.Random(seed)
    t = 0.0
    for i, req in enumerate(trace):
        if max_requests is not None and i >= max_requests:
            return
        if rate is not None or req.arrival_s is None:
            if rate is None:
                raise ValueError("this trace has no arrival times: give a rate")
            t += rng.expovariate(rate)
            arrival = t
        else:
            arrival = req.arrival_s / rate_scale
        yield SimRequest(arrival, req.input_tokens, max(1, req.output_tokens), req.hash_ids)
