"""Non-stationary synthetic traces: a diurnal rate curve with bursts (for autoscaler evaluation).

rate(t) = mean · (1 + amplitude · sin(2π t / period − π/2)) · Π burst factors active at t

The curve starts at its trough (t = 0), peaks at period/2. Arrivals are a non-homogeneous Poisson process
drawn by thinning (Lewis & Shedler): candidates at the peak rate, each kept with probability rate(t)/peak.
Lengths are log-normal (median, σ of ln), clipped to [1, max]. Deterministic for a seed; streamed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from loadgen.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class Burst:
    start_s: float
    duration_s: float
    factor: float  # rate multiplier while active


@dataclass(frozen=True, slots=True)
class DiurnalSpec:
    duration_s: float
    mean_rate: float
    amplitude: float = 0.6  # 0 = flat; < 1 keeps the trough above zero
    period_s: float = 3600.0
    bursts: Sequence[Burst] = ()
    input_median: float = 1000.0
    input_sigma: float = 0.8
    output_median: float = 150.0
    output_sigma: float = 0.8
    max_input: int = 7000
    max_output: int = 1000

    def rate(self, t: float) -> float:
        base = self.mean_rate * (1 + self.amplitude * math.sin(2 * math.pi * t / self.period_s - math.pi / 2))
        return max(0.0, base * _burst_factor(self.bursts, t))

    @property
    def peak_rate(self) -> float:
        """An upper bound of rate(t) for thinning: the curve's peak times the largest product of burst
        factors active at one instant (overlapping bursts multiply). One burst: its factor (or 1)."""
        return self.mean_rate * (1 + abs(self.amplitude)) * _max_burst_factor(self.bursts)


def _burst_factor(bursts: Sequence[Burst], t: float) -> float:
    """The product of the factors of the bursts active at `t` (each over [start, start + duration))."""
    factor = 1.0
    for b in bursts:
        if b.start_s <= t < b.start_s + b.duration_s:
            factor *= b.factor
    return factor


def _max_burst_factor(bursts: Sequence[Burst]) -> float:
    """max(1, the largest burst product over time). The product only changes where a burst starts or ends,
    and each interval between those points starts at one, so the maximum is at one of them."""
    edges = [b.start_s for b in bursts] + [b.start_s + b.duration_s for b in bursts]
    return max([1.0, *(_burst_factor(bursts, t) for t in edges)])


def diurnal_trace(spec: DiurnalSpec, seed: int = 0) -> Iterator[TraceRequest]:
    if spec.duration_s <= 0 or spec.mean_rate <= 0 or not 0 <= spec.amplitude <= 1:
        raise ValueError("need duration_s > 0, mean_rate > 0 and 0 ≤ amplitude ≤ 1")
    rng = random.Random(seed)
    peak = spec.peak_rate
    t = 0.0
    line = 0
    while True:
        t += rng.expovariate(peak)
        if t >= spec.duration_s:
            return
        if rng.random() * peak > spec.rate(t):
            continue
        line += 1
        prompt = min(
            spec.max_input, max(1, round(spec.input_median * math.exp(rng.gauss(0, spec.input_sigma))))
        )
        output = min(
            spec.max_output, max(1, round(spec.output_median * math.exp(rng.gauss(0, spec.output_sigma))))
        )
        yield TraceRequest(t, prompt, output, line=line)
