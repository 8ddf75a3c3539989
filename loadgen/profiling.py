"""`mosaic profile`'s driver-independent half: buckets, their request mix, and the loop over the grid.

A profile has input edges e_0 < … < e_m and output edges f_0 < … < f_n; bucket (i, j) holds requests with
e_i ≤ input < e_{i+1} and f_j ≤ output < f_{j+1}. A measurement of bucket (i, j) at rate λ sends Poisson
arrivals at λ whose lengths are drawn **uniformly** (integers) within the bucket, restricted to pairs the
model can hold (input + output ≤ the model's max context): a request longer than that is served by no
GPU, so it is not part of any bucket's load. A GPU whose engine cannot hold the bucket's longest feasible
pair (its KV cache is too small: `max_model_len` below it) cannot serve the bucket: 0, without measuring.

Common random numbers: the lengths and the unit-rate inter-arrival gaps of a bucket's test depend only on
the seed and the bucket; probing rate λ divides the same gaps by λ. The measured curve is then smooth in
λ (the same requests, compressed), and the whole profile is deterministic for a seed.

Measurement window: arrivals span warm-up W/2, measured W, tail W/2 (W from the driver); only requests
arriving in the measured window count, so neither the empty start nor the draining end flatters the
latencies.

Sustainable load: besides the SLO, a probe must keep its queue bounded (`QueueBound`: p90 TTFT ≤
5 × the unloaded p90 TTFT + 1 s, the unloaded TTFT measured by sending the bucket's first 10 requests one
at a time) and not growing (`profile_search.queue_is_stable`).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from loadgen.profile_search import (
    Measurement,
    SearchConfig,
    SearchResult,
    SearchSlo,
    queue_is_stable,
    search_max_rate,
)


@dataclass(frozen=True, slots=True)
class Bucket:
    i: int
    j: int
    input_lo: int  # inclusive
    input_hi: int  # exclusive
    output_lo: int
    output_hi: int

    @property
    def label(self) -> str:
        return f"in [{self.input_lo},{self.input_hi}) × out [{self.output_lo},{self.output_hi})"

    def longest(self, max_context: int) -> int:
        """The longest input + output this bucket holds among pairs the model can serve."""
        return min(max_context, self.input_hi - 1 + self.output_hi - 1)

    def feasible(self, max_context: int) -> bool:
        return self.input_lo + self.output_lo <= max_context


def buckets(input_edges: Sequence[int], output_edges: Sequence[int]) -> list[Bucket]:
    """All buckets, row-major (input i, then output j)."""
    _check_edges("input", input_edges)
    _check_edges("output", output_edges)
    return [
        Bucket(i, j, input_edges[i], input_edges[i + 1], output_edges[j], output_edges[j + 1])
        for i in range(len(input_edges) - 1)
        for j in range(len(output_edges) - 1)
    ]


def _check_edges(name: str, edges: Sequence[int]) -> None:
    if len(edges) < 2 or edges[0] < 1 or any(b <= a for a, b in itertools.pairwise(edges)):
        raise ValueError(
            f"{name} edges must be ≥ 1 and strictly increasing (at least two), got {list(edges)}"
        )


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    offset: float  # arrival at rate 1 (seconds); at rate λ the request arrives at offset / λ
    input_tokens: int
    output_tokens: int


def bucket_requests(bucket: Bucket, max_context: int, seed: int) -> Iterator[ProbeRequest]:
    """The bucket's endless test stream (unit-rate Poisson offsets, uniform feasible lengths), seeded."""
    rng = random.Random(f"mosaic-profile-{seed}-{bucket.input_lo}-{bucket.output_lo}")
    t = 0.0
    while True:
        for _ in range(1000):
            inp = rng.randint(bucket.input_lo, bucket.input_hi - 1)
            out = rng.randint(bucket.output_lo, bucket.output_hi - 1)
            if inp + out <= max_context:
                break
        else:  # a sliver of the bucket fits: take its corner-most feasible pair
            out = bucket.output_lo
            inp = max(bucket.input_lo, min(bucket.input_hi - 1, max_context - out))
        yield ProbeRequest(t, inp, out)
        t += rng.expovariate(1.0)


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """How long one probe at `rate` runs: W = max(min_window_s, min_requests / rate, e2e_factor · e2e_est)."""

    min_window_s: float = 20.0
    min_requests: int = 300
    e2e_factor: float = 1.5
    max_requests: int = 60_000  # total per probe (warm-up + window + tail), a cost cap

    def window_s(self, rate: float, e2e_estimate_s: float) -> float:
        w = max(self.min_window_s, self.min_requests / rate, self.e2e_factor * e2e_estimate_s)
        return min(w, self.max_requests / (2.0 * rate))


def probe_requests(
    stream: Iterator[ProbeRequest], rate: float, window_s: float
) -> tuple[list[ProbeRequest], float, float]:
    """Requests of one probe (arrival offset/rate < 2·W) and the measured window [W/2, 3W/2)."""
    out: list[ProbeRequest] = []
    for r in stream:
        if r.offset / rate >= 2.0 * window_s:
            break
        out.append(r)
    return out, 0.5 * window_s, 1.5 * window_s


def summarize(
    rate: float, arrivals: Sequence[float], ttfts: Sequence[float], tpots: Sequence[float | None], failed: int
) -> Measurement:
    """A Measurement from the measured window's requests (TPOT None for 1-token outputs: excluded, as vLLM)."""
    if not ttfts:
        return Measurement(rate, 0, float("inf"), float("inf"), False, failed)
    tp = [t for t in tpots if t is not None]
    return Measurement(
        rate=rate,
        n=len(ttfts),
        ttft_p90_ms=float(np.percentile(ttfts, 90)) * 1000.0,
        tpot_p90_ms=float(np.percentile(tp, 90)) * 1000.0 if tp else 0.0,
        stable=queue_is_stable(arrivals, ttfts),
        failed=failed,
    )


@dataclass(frozen=True, slots=True)
class BucketMeasure:
    """How to measure one bucket: `measure(rate)`, and where the search should start (req/s, optional)."""

    measure: Callable[[float], Measurement]
    hint: float | None = None
    unloaded_ttft_ms: float | None = None  # p90 TTFT of the bucket's requests sent one at a time
    # The bucket one request at a time (`rate` 0; medians of TTFT and TPOT, failures counted): the best the
    # server does on it. When even this misses the SLO, no rate can meet it and the bucket is 0 at once
    # (`--url`: reaching 0 by probing down to min_rate took a day of real time). None: not measured.
    unloaded: Measurement | None = None


MeasureFactory = Callable[[Bucket], BucketMeasure | None]  # None: this GPU cannot serve the bucket


@dataclass(slots=True)
class ProfileGrid:
    """max_rate[i][j] and the measurement at it (None where 0) for every bucket."""

    max_rate: list[list[float]]
    measured: list[list[Measurement | None]]
    results: dict[tuple[int, int], SearchResult] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class QueueBound:
    """Sustainable means a bounded queue: p90 TTFT ≤ factor · unloaded p90 TTFT + slack_ms (factor 0: off).

    A stationary queue near 100% utilisation passes the growth test while requests wait minutes; with a
    TPOT-only SLO nothing else would stop the search there. The bound does not depend on the SLO.
    """

    factor: float = 5.0
    slack_ms: float = 1000.0

    def cap_ms(self, unloaded_ttft_ms: float | None) -> float | None:
        if self.factor <= 0 or unloaded_ttft_ms is None:
            return None
        return self.factor * unloaded_ttft_ms + self.slack_ms


def unloaded_requests(bucket: Bucket, max_context: int, seed: int, n: int = 10) -> list[ProbeRequest]:
    """The first `n` requests of the bucket's stream, for the one-at-a-time TTFT baseline."""
    return [r for _, r in zip(range(n), bucket_requests(bucket, max_context, seed), strict=False)]


def _search_bucket(
    b: Bucket, factory: MeasureFactory, slo: SearchSlo, config: SearchConfig, queue: QueueBound
) -> SearchResult | None:
    bm = factory(b)
    if bm is None:
        return None
    if bm.unloaded is not None and not slo.passes(bm.unloaded):
        return SearchResult(0.0, None, unloaded_miss=True)  # monotone in the SLO, as the search
    cfg = dataclasses.replace(config, hint=bm.hint)
    return search_max_rate(bm.measure, slo, cfg, queue.cap_ms(bm.unloaded_ttft_ms))


def profile_grid(
    input_edges: Sequence[int],
    output_edges: Sequence[int],
    factory: MeasureFactory,
    slo: SearchSlo,
    config: SearchConfig = SearchConfig(),
    on_bucket: Callable[[Bucket, SearchResult | None], None] | None = None,
    queue: QueueBound = QueueBound(),
    done: Mapping[tuple[int, int], SearchResult | None] | None = None,
) -> ProfileGrid:
    """Search every bucket; `factory(bucket)` gives its measure function, hint and unloaded TTFT, or None
    when it cannot be served (max rate 0). `config.hint` is replaced by each bucket's own hint. Buckets in
    `done` (an interrupted run's results, `loadgen.profile_checkpoint`) are taken as they are: not measured
    again, and not passed to `on_bucket`."""
    bs = buckets(input_edges, output_edges)
    rows, cols = len(input_edges) - 1, len(output_edges) - 1
    grid = ProfileGrid([[0.0] * cols for _ in range(rows)], [[None] * cols for _ in range(rows)])
    done = done or {}
    for b in bs:
        resumed = (b.i, b.j) in done
        res = done[(b.i, b.j)] if resumed else _search_bucket(b, factory, slo, config, queue)
        if res is not None:
            grid.max_rate[b.i][b.j] = res.max_rate
            grid.measured[b.i][b.j] = res.measurement
            grid.results[(b.i, b.j)] = res
        if on_bucket is not None and not resumed:
            on_bucket(b, res)
    return grid
