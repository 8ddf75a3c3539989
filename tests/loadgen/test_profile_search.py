"""The max-rate search: exact on known curves, deterministic, monotone in the SLO whatever the curve."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadgen.profile_search import (
    MAX_GRID_RATES,
    Measurement,
    SearchConfig,
    SearchSlo,
    finest_resolution,
    grid_size,
    queue_is_stable,
    search_max_rate,
)

CFG = SearchConfig(min_rate=0.1, max_rate=200.0, resolution=0.05)
GRID = CFG.grid()


def linear_tpot(rate: float) -> Measurement:
    """TPOT p90 = 10 + rate ms, TTFT p90 = 50 + 2·rate ms: a smooth, monotone engine."""
    return Measurement(rate, 100, 50 + 2 * rate, 10 + rate)


def test_grid_is_geometric_within_bounds() -> None:
    assert GRID[0] == 0.1 and GRID[-1] <= 200.0 < GRID[-1] * 1.05
    assert all(b / a == pytest.approx(1.05) for a, b in itertools.pairwise(GRID))


@pytest.mark.parametrize(("lo", "hi"), [(0.01, 2000.0), (5.0, 40.0), (1e-6, 1e6), (1.0, 1.0001)])
def test_a_grid_too_fine_is_refused_with_a_resolution_that_works(lo: float, hi: float) -> None:
    """`--resolution 1e-9` built a list of 12 billion rates (MemoryError): refused, naming one that works."""
    with pytest.raises(ValueError, match=r"resolution 1e-12 makes over 100,000 grid rates: use ≥"):
        SearchConfig(lo, hi, 1e-12).grid()
    finest = finest_resolution(lo, hi)
    assert grid_size(lo, hi, finest) <= MAX_GRID_RATES < grid_size(lo, hi, finest * 0.98)
    assert len(SearchConfig(lo, hi, finest).grid()) == grid_size(lo, hi, finest)


@pytest.mark.parametrize(
    ("slo", "limit"),
    [
        pytest.param(SearchSlo(tpot_ms=40), 30.0, id="TPOT ≤ 40 → 10 + r ≤ 40 → r ≤ 30"),
        pytest.param(SearchSlo(ttft_ms=250), 100.0, id="TTFT ≤ 250 → 50 + 2r ≤ 250 → r ≤ 100"),
        pytest.param(SearchSlo(tpot_ms=40, ttft_ms=90), 20.0, id="both: TTFT binds first at r ≤ 20"),
    ],
)
def test_finds_the_largest_grid_rate_within_the_slo(slo: SearchSlo, limit: float) -> None:
    res = search_max_rate(linear_tpot, slo, CFG)
    assert res.max_rate == max(g for g in GRID if g <= limit + 1e-9)
    assert res.converged and not res.capped
    assert res.measurement is not None and slo.passes(res.measurement)
    assert len(res.probes) <= 2 * 8 + 2  # gallop + bisect over ~200 grid points: ≤ 2·log2(200) + 2


def test_hint_near_the_answer_saves_probes() -> None:
    cold = search_max_rate(linear_tpot, SearchSlo(tpot_ms=40), CFG)
    warm = search_max_rate(linear_tpot, SearchSlo(tpot_ms=40), SearchConfig(0.1, 200.0, 0.05, hint=28.0))
    assert warm.max_rate == cold.max_rate and len(warm.probes) < len(cold.probes)


def test_cannot_and_capped() -> None:
    never = search_max_rate(lambda r: Measurement(r, 10, 1e6, 1e6), SearchSlo(tpot_ms=40), CFG)
    assert never.max_rate == 0.0 and never.measurement is None and len(never.probes) == 1
    always = search_max_rate(lambda r: Measurement(r, 10, 1.0, 1.0), SearchSlo(tpot_ms=40), CFG)
    assert always.max_rate == GRID[-1] and always.capped


def test_unstable_or_failing_runs_do_not_pass() -> None:
    # TPOT always fine, but the queue diverges above 20 req/s (TPOT-only SLOs cannot see overload)
    res = search_max_rate(
        lambda r: Measurement(r, 100, 10.0, 10.0, stable=r <= 20), SearchSlo(tpot_ms=40), CFG
    )
    assert res.max_rate == max(g for g in GRID if g <= 20)
    res = search_max_rate(
        lambda r: Measurement(r, 100, 1.0, 1.0, failed=int(r > 5)), SearchSlo(tpot_ms=40), CFG
    )
    assert res.max_rate == max(g for g in GRID if g <= 5)


def test_probe_budget_is_the_stopping_rule_of_last_resort() -> None:
    res = search_max_rate(linear_tpot, SearchSlo(tpot_ms=40), SearchConfig(0.1, 200.0, 0.05, max_probes=4))
    assert len(res.probes) == 4 and not res.converged and 0 < res.max_rate <= 30


def test_deterministic_measure_gives_a_deterministic_search() -> None:
    a = search_max_rate(linear_tpot, SearchSlo(tpot_ms=33), CFG)
    b = search_max_rate(linear_tpot, SearchSlo(tpot_ms=33), CFG)
    assert a.max_rate == b.max_rate and [p[0] for p in a.probes] == [p[0] for p in b.probes]


@settings(max_examples=150, deadline=None)
@given(
    curve=st.lists(st.floats(1, 100), min_size=len(GRID), max_size=len(GRID)),
    slos=st.tuples(st.floats(1, 100), st.floats(1, 100)),
    hint=st.one_of(st.none(), st.floats(0.1, 200)),
)
def test_monotone_in_the_slo_for_any_curve(
    curve: list[float], slos: tuple[float, float], hint: float | None
) -> None:
    """Even for a non-monotone (noisy) curve, a looser SLO never yields a lower max rate."""
    tight, loose = sorted(slos)
    table = dict(zip(GRID, curve, strict=True))
    measure: Callable[[float], Measurement] = lambda r: Measurement(r, 10, 0.0, table[r])  # noqa: E731
    cfg = SearchConfig(0.1, 200.0, 0.05, hint=hint)
    assert (
        search_max_rate(measure, SearchSlo(tpot_ms=loose), cfg).max_rate
        >= search_max_rate(measure, SearchSlo(tpot_ms=tight), cfg).max_rate
    )


# arrivals 0, 1, …, 59 s: thirds' centres 40 s apart, span 59 s → stable iff Δmedian · 59/40 ≤ 0.03 · 59 + 0.25 = 2.02
@pytest.mark.parametrize(
    ("ttfts", "stable"),
    [
        pytest.param([0.05] * 60, True, id="flat TTFT → stable"),
        pytest.param([0.05 + 0.01 * (i % 3) for i in range(60)], True, id="noisy but stationary → stable"),
        pytest.param([0.05 + 0.1 * i for i in range(60)], False, id="+0.1 s per s: Δ 4 → 5.9 > 2.02 → unstable"),
        pytest.param([30 + 0.1 * i for i in range(60)], False, id="same growth from a 30 s level (overloaded since warm-up) → unstable"),
        pytest.param([30 + 0.02 * i for i in range(60)], True, id="+0.02 s per s: Δ 0.8 → 1.18 ≤ 2.02 → stable"),
        pytest.param([0.2] * 20 + [1.0] * 20 + [1.8] * 20, False, id="thirds 0.2/1.0/1.8: Δ 1.6 → 2.36 > 2.02 → unstable"),
        pytest.param([0.2] * 20 + [0.9] * 20 + [1.5] * 20, True, id="thirds 0.2/0.9/1.5: Δ 1.3 → 1.92 ≤ 2.02 → stable"),
        pytest.param([0.05] * 8, True, id="fewer than 9 requests: too few to judge → stable"),
    ],
)  # fmt: skip
def test_queue_stability(ttfts: list[float], stable: bool) -> None:
    assert queue_is_stable([float(i) for i in range(len(ttfts))], ttfts) is stable


def test_ttft_cap_bounds_the_queue() -> None:
    # TTFT p90 = 50 + 2r ms: a cap of 150 ms stops the search at r ≤ 50 even though TPOT allows r ≤ 190
    res = search_max_rate(linear_tpot, SearchSlo(tpot_ms=200), CFG, ttft_cap_ms=150)
    assert res.max_rate == max(g for g in GRID if g <= 50 + 1e-9)
