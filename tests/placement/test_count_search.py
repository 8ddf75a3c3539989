"""The LP branch and bound over instance counts (placement.count_search) and its fallback to CP-SAT."""

from __future__ import annotations

import math

import pytest

from placement import engine_pipeline
from placement.binpacking import (
    Demand,
    GpuOffer,
    InstanceOption,
    MixProblem,
    Status,
    Variant,
    load_coefficients,
    serving_paths,
)
from placement.count_search import Undecided, _without_point, cost_unit, lifted, search_counts
from placement.solver import solve_mix


def melange_example() -> MixProblem:
    """Mélange's example: A10G $1.01/h rates [[2, 1], [5, 2]], A100 $3.67/h [[20, 20], [40, 20]], λ = 30."""
    gpus = {"A10G": GpuOffer("A10G", 1.01), "A100-80GB": GpuOffer("A100-80GB", 3.67)}
    options = (
        InstanceOption("melange", "A10G", (2.0, 1.0, 5.0, 2.0)),
        InstanceOption("melange", "A100-80GB", (20.0, 20.0, 40.0, 20.0)),
    )
    return MixProblem(gpus, options, ((Demand("melange", (6.0, 3.0, 15.0, 6.0)),),))


@pytest.mark.parametrize(
    ("costs", "unit"),
    [
        pytest.param([1.01, 3.67], 0.01, id="prices in cents have a one-cent unit"),
        pytest.param([2.0, 3.0], 1.0, id="whole dollars have a one-dollar unit"),
        pytest.param([0.5, 1.25], 0.25, id="quarters have a quarter unit"),
        pytest.param([1.0, 1 / 3], 0.0, id="a price finer than a micro-dollar has no unit"),
    ],
)
def test_cost_unit_is_the_gcd_of_micro_dollar_prices(costs: list[float], unit: float) -> None:
    assert math.isclose(cost_unit(costs), unit, abs_tol=1e-12)


@pytest.mark.parametrize(
    ("bound", "unit", "expected"),
    [
        pytest.param(59.013, 0.01, 59.02, id="a bound between cents lifts to the next cent"),
        pytest.param(59.02 + 1e-9, 0.01, 59.02, id="LP noise above a cent does not lift past it"),
        pytest.param(59.02 - 1e-9, 0.01, 59.02, id="LP noise below a cent stays on it"),
    ],
)
def test_lifted_bound_is_the_least_achievable_cost(bound: float, unit: float, expected: float) -> None:
    assert math.isclose(lifted(bound, unit), expected, abs_tol=1e-9)


def test_lifted_bound_without_a_unit_only_subtracts_a_margin() -> None:
    assert 5.0 - 1e-6 < lifted(5.0, 0.0) < 5.0


def test_box_minus_a_point_is_covered_exactly() -> None:
    box = ((0, 2), (1, 3))
    pieces = _without_point(box, (1, 2))
    covered = [
        (a, b)
        for lo_hi in pieces
        for a in range(lo_hi[0][0], lo_hi[0][1] + 1)
        for b in range(lo_hi[1][0], lo_hi[1][1] + 1)
    ]
    everything = {(a, b) for a in range(3) for b in range(1, 4)}
    assert sorted(covered) == sorted(everything - {(1, 2)})  # disjoint (no repeats) and complete


def test_search_proves_the_melange_optimum_with_whole_slices() -> None:
    """Slice factor 1: 3 A10G + 1 A100 = 3 · 1.01 + 3.67 = $6.70 (docs/placement.md works it by hand)."""
    sol = solve_mix(melange_example(), variant=Variant.SLICED, slice_factor=1)
    assert sol.status == "optimal" and math.isclose(sol.cost_per_hour, 6.70)
    assert sol.engine == "lp-branch" and not sol.notes  # proved by the search itself: nothing to report


def test_search_with_a_leaf_that_accepts_any_fleet_is_the_continuous_optimum() -> None:
    """Real shares: one A100 (load 1) + one A10G carrying a third of the 15 req/s bucket = $4.68."""
    problem = melange_example()
    paths, _ = serving_paths(problem)
    coefs = load_coefficients(problem, paths, 1)

    def accept(counts, real, _left):  # type: ignore[no-untyped-def]
        cost = sum(problem.option_cost(o) * n for o, n in zip(problem.options, counts, strict=True))
        return engine_pipeline.EngineResult(Status.OPTIMAL, counts, tuple(real), cost, cost, 0.0, "t")

    found = search_counts(problem, paths, coefs, 1, 5.0, accept)
    assert found.status is Status.OPTIMAL and found.counts == (1, 1)
    assert math.isclose(found.objective or 0.0, 4.68) and found.bound == found.objective


def test_search_that_gives_up_returns_a_proven_bound_and_cp_sat_finishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    problem = melange_example()
    paths, _ = serving_paths(problem)
    coefs = load_coefficients(problem, paths, 1)
    fit = engine_pipeline._slices_fit(problem, paths, coefs, 1)
    partial = search_counts(problem, paths, coefs, 1, 5.0, fit, max_nodes=1)
    assert partial.status is Status.UNKNOWN and partial.bound is not None
    assert partial.bound <= 6.70 + 1e-9  # a lower bound on the optimum, never above it
    monkeypatch.setattr(engine_pipeline, "SEARCH_NODES", 1)
    sol = solve_mix(problem, variant=Variant.SLICED, slice_factor=1)
    assert sol.status == "optimal" and math.isclose(sol.cost_per_hour, 6.70) and sol.engine == "cp-sat"


def test_search_reports_infeasible_caps() -> None:
    """At most one A100 and two A10G: the cheapest whole-slice fleet needs 3 A10G or 2 A100."""
    problem = melange_example()
    capped = MixProblem(
        {"A10G": GpuOffer("A10G", 1.01, 0, 2), "A100-80GB": GpuOffer("A100-80GB", 3.67, 0, 1)},
        problem.options,
        problem.windows,
    )
    paths, _ = serving_paths(capped)
    coefs = load_coefficients(capped, paths, 1)
    fit = engine_pipeline._slices_fit(capped, paths, coefs, 1)
    assert search_counts(capped, paths, coefs, 1, 5.0, fit).status is Status.INFEASIBLE


@pytest.mark.parametrize(
    ("engine", "nodes", "expected_engine"),
    [
        pytest.param("auto", None, "lp-branch", id="auto solves the continuous model by the count search"),
        pytest.param("auto", 1, "scip", id="a count search out of nodes hands over to SCIP with its bound"),
        pytest.param("scip", None, "scip", id="engine scip is SCIP alone"),
    ],
)
def test_continuous_engines_agree_on_the_melange_optimum(
    engine: str, nodes: int | None, expected_engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One A100 (load 1) + one A10G carrying 5 of the 15 req/s bucket: 3.67 + 1.01 = $4.68."""
    if nodes is not None:
        monkeypatch.setattr(engine_pipeline, "SEARCH_NODES", nodes)
    sol = solve_mix(melange_example(), variant=Variant.CONTINUOUS, engine=engine)
    assert sol.status == "optimal" and math.isclose(sol.cost_per_hour, 4.68) and sol.engine == expected_engine
    assert sol.gpus == {"A10G": 1, "A100-80GB": 1}


@pytest.mark.parametrize("slice_factor", [1000, 100_000])
def test_fine_slices_are_placed_without_recursion(slice_factor: int) -> None:
    """Thousands of slices per bucket are placed depth-first by a loop (recursion overflowed at ~1000).

    1 A100 + 2 A10G = $5.69 holds 15 req/s split as finely as one likes; 8 slices find the same mix.
    """
    sol = solve_mix(melange_example(), variant=Variant.SLICED, slice_factor=slice_factor)
    assert sol.status == "optimal" and math.isclose(sol.cost_per_hour, 5.69)
    assert sol.engine == "lp-branch"


@pytest.mark.parametrize(("slice_factor", "optimum"), [(1, 6.70), (2, 5.69)])
def test_a_leaf_left_undecided_does_not_overstate_the_bound(
    slice_factor: int, optimum: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node whose leaf check gave up had the lowest bound: it must count in the bound handed to CP-SAT.

    Left out, the bound was 7.34 (two A100s, the next node on the heap), which cut off the optimum and
    "proved" $7.34 optimal with gap 0.
    """
    problem = melange_example()
    paths, _ = serving_paths(problem)
    coefs = load_coefficients(problem, paths, slice_factor)
    fit = engine_pipeline._slices_fit(problem, paths, coefs, slice_factor)
    calls = []

    def undecided_once(counts, real, left):  # type: ignore[no-untyped-def]
        calls.append(counts)
        if len(calls) == 1:
            raise Undecided("a whole-slice fit check ran out of time")
        return fit(counts, real, left)

    partial = search_counts(problem, paths, coefs, slice_factor, 5.0, undecided_once)
    assert partial.status is Status.UNKNOWN and partial.bound is not None
    assert partial.bound <= optimum + 1e-9

    # end to end: the first whole-slice fit check times out (as at a small --time-limit)
    real_fit = engine_pipeline.fit_slices
    checks = []

    def times_out_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        checks.append(1)
        if len(checks) == 1:
            return engine_pipeline.EngineResult(Status.UNKNOWN, (), (), None, None, 0.0, "cp-sat")
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(engine_pipeline, "fit_slices", times_out_once)
    monkeypatch.setattr(engine_pipeline, "_slices_near", lambda *a, **k: None)
    sol = solve_mix(problem, variant=Variant.SLICED, slice_factor=slice_factor)
    assert sol.status == "optimal" and math.isclose(sol.cost_per_hour, optimum)
    assert sol.gpus == {"A10G": 3 if slice_factor == 1 else 2, "A100-80GB": 1}
