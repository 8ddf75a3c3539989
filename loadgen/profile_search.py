"""The highest request rate that meets an SLO, found with a bracketing search over a fixed rate grid.

`search_max_rate(measure, slo, config)` calls `measure(rate) -> Measurement` (a load test at that rate,
from the simulator or a live URL) and returns the largest grid rate whose measurement *passes*:

    passes(m) = m.stable and (slo.ttft_ms is None or m.ttft_p90_ms ≤ slo.ttft_ms)
                         and (slo.tpot_ms is None or m.tpot_p90_ms ≤ slo.tpot_ms)
                         and m.failed == 0 and m.ttft_p90_ms ≤ ttft_cap_ms (when given)

The grid is geometric, rate_k = min_rate · (1 + resolution)^k up to max_rate, so every answer is a grid
point and two searches can be compared exactly. Search: probe the hint (or the grid's start), gallop
(steps 1, 2, 4, … grid points) up while passing or down while failing until a pass and a fail bracket
the boundary, then bisect the bracket. **Stopping rule**: stop when the bracket is two adjacent grid
points (the answer is known to `resolution`, 5% by default), or after `max_probes` measurements (the
best pass so far is returned, `converged=False`). A fail at the grid's first rate gives 0 ("cannot").

Guarantees (tested): with a deterministic `measure`, the result is deterministic; and it is monotone in
the SLO — loosening the SLO never lowers the answer, *whatever* the shape of the measurements — because
every pass only raises the lower bound and every fail only lowers the upper bound: two searches behave
identically until the first rate where the looser SLO passes and the tighter fails, after which the
looser one's answer is ≥ that rate and the tighter one's is below it.

`stable` and `ttft_cap_ms` guard against an SLO that overload does not break: in vLLM v1 a saturated
engine keeps its batch (and TPOT) bounded and queues the rest, so with only a TPOT SLO an overloaded run
could pass. `queue_is_stable` refuses a run whose TTFT grows across it (arrivals outpace service); the
cap (`loadgen.profiling`: 5 × the unloaded TTFT + 1 s by default) refuses a queue that is stationary but
long, as near 100% utilisation. Neither depends on the SLO, so the monotonicity below holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Measurement:
    """One load test at `rate` req/s: p90 latencies of completed requests and whether the queue held."""

    rate: float
    n: int  # requests completed and measured
    ttft_p90_ms: float
    tpot_p90_ms: float
    stable: bool = True
    failed: int = 0

    def as_dict(self) -> dict[str, float | int | bool]:
        return {
            "rate": self.rate,
            "n": self.n,
            "ttft_p90_ms": self.ttft_p90_ms,
            "tpot_p90_ms": self.tpot_p90_ms,
            "stable": self.stable,
            "failed": self.failed,
        }


@dataclass(frozen=True, slots=True)
class SearchSlo:
    tpot_ms: float | None = None
    ttft_ms: float | None = None

    def passes(self, m: Measurement) -> bool:
        return (
            m.stable
            and m.failed == 0
            and m.n > 0
            and (self.ttft_ms is None or m.ttft_p90_ms <= self.ttft_ms)
            and (self.tpot_ms is None or m.tpot_p90_ms <= self.tpot_ms)
        )


# The grid is a list: this many rates (a few MB) is far finer than any search converges to in `max_probes`.
MAX_GRID_RATES = 100_000


def grid_size(min_rate: float, max_rate: float, resolution: float) -> int:
    """How many rates the geometric grid from `min_rate` to `max_rate` at `resolution` holds; past
    `MAX_GRID_RATES` only that it is more (a resolution of 1e-320 or rates 1e600 apart make it infinite)."""
    steps = math.log(max_rate / min_rate) / math.log1p(resolution) if resolution > 0 else math.inf
    if not math.isfinite(steps) or steps >= MAX_GRID_RATES:
        return MAX_GRID_RATES + 1
    return math.floor(steps + 1e-9) + 1


def finest_resolution(min_rate: float, max_rate: float) -> float:
    """About the smallest resolution whose grid between the two rates holds at most `MAX_GRID_RATES` rates,
    rounded *up* to 3 significant digits, so that the number a message prints is one that works."""
    exact = math.expm1(math.log(max_rate / min_rate) / (MAX_GRID_RATES - 1))
    if not math.isfinite(exact) or exact <= 0:
        return math.inf  # the rates are too far apart (or too close) for any grid: the caller says so
    scale = 10.0 ** (math.floor(math.log10(exact)) - 2)
    return float(f"{math.ceil(exact / scale) * scale:.3g}")


@dataclass(frozen=True, slots=True)
class SearchConfig:
    min_rate: float = 0.01  # req/s; a fail here means the bucket cannot be served within the SLO
    max_rate: float = 500.0  # req/s; a pass here is reported as max_rate (capped=True)
    resolution: float = 0.05  # relative step between grid rates: the answer's precision
    max_probes: int = 30
    hint: float | None = None  # a first guess (e.g. from the perf model); the grid point at or below it

    def grid(self) -> list[float]:
        if not (0 < self.min_rate < self.max_rate) or self.resolution <= 0:
            raise ValueError("need 0 < min_rate < max_rate and resolution > 0")
        n = grid_size(self.min_rate, self.max_rate, self.resolution)
        if n > MAX_GRID_RATES:  # a tiny resolution would build a list of billions of rates (MemoryError)
            raise ValueError(
                f"resolution {self.resolution:g} makes over {MAX_GRID_RATES:,} grid rates: "
                f"use ≥ {finest_resolution(self.min_rate, self.max_rate):g}"
            )
        return [self.min_rate * (1 + self.resolution) ** i for i in range(n)]


@dataclass(slots=True)
class SearchResult:
    max_rate: float  # 0.0 = not even min_rate passes
    measurement: Measurement | None  # at max_rate
    probes: list[tuple[float, Measurement, bool]] = field(default_factory=list)  # (rate, m, passed), in order
    converged: bool = True  # False when max_probes ran out before the bracket closed
    capped: bool = False  # True when max_rate itself passed (the real limit may be higher)
    unloaded_miss: bool = False  # 0 without probing: the bucket misses the SLO even one request at a time


def search_max_rate(
    measure: Callable[[float], Measurement],
    slo: SearchSlo,
    config: SearchConfig = SearchConfig(),
    ttft_cap_ms: float | None = None,
) -> SearchResult:
    """The largest grid rate that passes `slo` (and keeps p90 TTFT ≤ `ttft_cap_ms`, a sustainability bound
    that must not depend on the SLO); see the module docstring for the search and its guarantees."""
    grid = config.grid()
    cache: dict[int, Measurement] = {}
    result = SearchResult(0.0, None)
    lo, hi = -1, len(grid)  # invariant: grid[lo] passed (or lo = -1), grid[hi] failed (or hi = len)

    def probe(k: int) -> bool:
        if k not in cache:
            cache[k] = measure(grid[k])
        m = cache[k]
        ok = slo.passes(m) and (ttft_cap_ms is None or m.ttft_p90_ms <= ttft_cap_ms)
        result.probes.append((grid[k], m, ok))
        return ok

    start = 0 if config.hint is None else _index_at_or_below(grid, config.hint)
    step = 1
    k = start
    # gallop: from the start, double the step in the direction the first probe points to
    while hi - lo > 1 and len(result.probes) < config.max_probes:
        if probe(k):
            lo = k
            nxt = k + step if hi == len(grid) else (lo + hi) // 2
        else:
            hi = k
            nxt = k - step if lo == -1 else (lo + hi) // 2
        step *= 2
        nxt = min(max(nxt, lo + 1), hi - 1)
        if hi - lo <= 1:
            break
        k = nxt
    result.converged = hi - lo <= 1
    if lo >= 0:
        result.max_rate = grid[lo]
        result.measurement = cache[lo]
        result.capped = lo == len(grid) - 1
    return result


def _index_at_or_below(grid: Sequence[float], rate: float) -> int:
    return max(0, min(len(grid) - 1, int(np.searchsorted(grid, rate, side="right")) - 1))


def queue_is_stable(
    arrivals_s: Sequence[float], ttfts_s: Sequence[float], max_growth: float = 0.03, slack_s: float = 0.25
) -> bool:
    """False when TTFT grows across the run: arrivals outpace service and the queue diverges.

    Requests are ordered by arrival and cut in thirds; the TTFT growth rate is estimated robustly from the
    thirds' medians, g = (median TTFT(last third) − median TTFT(first third)) / (distance between the
    thirds' centres), in seconds of TTFT per second of arrivals. Stable iff, over the run's span,

        g · span ≤ max_growth · span + slack_s

    An overloaded engine (rate = ρ · capacity) makes each request wait about (1 − 1/ρ) s longer per second
    of arrivals, so `max_growth` = 0.03 refuses anything more than ~3% past capacity; `slack_s` absorbs the
    noise of a stationary queue. Judged on growth, never on level or on a ratio to the run's own TTFT: a run
    that was already overloaded during its warm-up has a high median, and only its growth gives it away.
    """
    n = len(arrivals_s)
    if n < 9:
        return True
    order = np.argsort(np.asarray(arrivals_s, dtype=float), kind="stable")
    a = np.asarray(arrivals_s, dtype=float)[order]
    t = np.asarray(ttfts_s, dtype=float)[order]
    k = n // 3
    distance = float(np.median(a[-k:]) - np.median(a[:k]))
    if distance <= 0:
        return True  # all sent at once: no time axis to grow along
    span = float(a[-1] - a[0])
    growth = float(np.median(t[-k:]) - np.median(t[:k])) / distance
    return growth * span <= max_growth * span + slack_s
