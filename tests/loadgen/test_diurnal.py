"""The diurnal + burst trace (`loadgen.diurnal`): thinning must draw from a rate that bounds the curve."""

from __future__ import annotations

import pytest

from loadgen.diurnal import Burst, DiurnalSpec, diurnal_trace


def test_overlapping_bursts_multiply_and_the_trace_follows() -> None:
    """Two overlapping ×3 bursts ask 10 · 3 · 3 = 90 req/s where they overlap; the thinning peak took the
    largest single factor (30 req/s), so at most 30 req/s came out there."""
    spec = DiurnalSpec(duration_s=40, mean_rate=10, amplitude=0, bursts=(Burst(10, 20, 3), Burst(20, 20, 3)))
    assert spec.rate(25) == pytest.approx(90) and spec.peak_rate >= 90
    overlap = sum(1 for r in diurnal_trace(spec, seed=1) if 20 <= r.arrival_s < 30)  # type: ignore[operator]
    assert 750 < overlap < 1050  # Poisson(900): ± 5 sigma


def test_a_dampening_burst_ending_inside_another_is_bounded_too() -> None:
    """A ×0.5 burst over the start of a ×4 one: the product is 4 only after the first ends."""
    spec = DiurnalSpec(duration_s=10, mean_rate=1, amplitude=0, bursts=(Burst(0, 5, 0.5), Burst(0, 10, 4)))
    assert spec.peak_rate == 4 and max(spec.rate(t / 10) for t in range(100)) == 4


@pytest.mark.parametrize("factor", [0.5, 1.8, 3.0])
def test_one_burst_keeps_its_peak_so_existing_traces_do_not_change(factor: float) -> None:
    """bench/autoscale_eval.py draws its day with one burst: same peak, so the same arrivals."""
    spec = DiurnalSpec(duration_s=3600, mean_rate=5, amplitude=0.6, bursts=(Burst(2232, 300, factor),))
    assert spec.peak_rate == 5 * 1.6 * max(1.0, factor)
