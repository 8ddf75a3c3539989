"""The bin-packing solver on hand-checked instances: Mélange's example, degenerate and infeasible inputs,
GPU caps, P/D, several models, several windows, and the online capacity call."""

from __future__ import annotations

import math

import pytest

from placement.binpacking import (
    Demand,
    GpuOffer,
    InstanceOption,
    MixProblem,
    PlacementError,
    Status,
    Variant,
    fits,
    needed_instances,
)
from placement.planner import cheapest_capacity
from placement.profiles import Role
from placement.solver import InfeasibleError, UnservableError, best_single_type, single_type_fleets, solve_mix

A10G = GpuOffer("A10G", 1.01)
A100 = GpuOffer("A100-80GB", 3.67)


def melange_example(**caps: int) -> MixProblem:
    """Mélange's config/example.json: tputs A10G [[2, 1], [5, 2]], A100 [[20, 20], [40, 20]],
    distribution [[0.2, 0.1], [0.5, 0.2]], λ = 30 → bucket rates 6, 3, 15, 6 req/s."""
    gpus = {
        "A10G": GpuOffer("A10G", 1.01, 0, caps.get("A10G")),
        "A100-80GB": GpuOffer("A100-80GB", 3.67, 0, caps.get("A100")),
    }
    options = (InstanceOption("m", "A10G", (2, 1, 5, 2)), InstanceOption("m", "A100-80GB", (20, 20, 40, 20)))
    demand = Demand("m", tuple(f * 30.0 for f in (0.2, 0.1, 0.5, 0.2)))
    return MixProblem(gpus, options, ((demand,),))


@pytest.mark.parametrize("engine", ["cp-sat", "scip"])
def test_melange_example_slice_factor_1_is_three_a10g_and_one_a100(engine: str) -> None:
    # Loads per bucket (rate / tput): A10G 6/2 = 3, 3/1 = 3, 15/5 = 3, 6/2 = 3 (12 GPUs alone, $12.12);
    # A100 6/20 = 0.3, 3/20 = 0.15, 15/40 = 0.375, 6/20 = 0.3 (sum 1.125 → 2 GPUs alone, $7.34).
    # One A100 holds any three buckets but not all four (1.125 > 1); the fourth needs 3 A10G:
    # 3.67 + 3 · 1.01 = $6.70 < $7.34. No A100 costs $12.12; two cost ≥ $7.34. So {A10G: 3, A100: 1}, $6.70.
    sol = solve_mix(melange_example(), variant=Variant.SLICED, slice_factor=1, engine=engine)
    assert sol.status is Status.OPTIMAL
    assert sol.gpus == {"A10G": 3, "A100-80GB": 1}
    assert sol.cost_per_hour == pytest.approx(6.70)
    assert sol.gap == 0.0
    # slice factor 1: every bucket goes whole to one type, three of them to the A100
    shares = sol.fractions[0]
    assert all(list(s.values()) == [1.0] for s in shares.values())
    assert sum(1 for s in shares.values() if "m/A100-80GB" in s) == 3


def test_continuous_split_recovers_what_the_coarse_slices_throw_away() -> None:
    # One A100 takes load ≤ 1 of the 1.125; 0.125 A100-load must move to A10G. Moving a fraction f of bucket b
    # costs A10G load f · (A10G load / A100 load) per unit freed: b10 has the best ratio 3 / 0.375 = 8, so
    # f = 0.125 / 0.375 = 1/3 of b10 → A10G load 1/3 · 3 = 1.0 → one A10G: 3.67 + 1.01 = $4.68 (vs $6.70).
    sol = solve_mix(melange_example(), variant=Variant.CONTINUOUS)
    assert sol.status is Status.OPTIMAL
    assert sol.gpus == {"A10G": 1, "A100-80GB": 1}
    assert sol.cost_per_hour == pytest.approx(4.68)
    assert sol.fractions[0][("m", 2)]["m/A10G"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("engine", ["cp-sat", "scip"])
def test_slice_factor_3_reaches_the_continuous_optimum(engine: str) -> None:
    # Thirds of b10 are 5 req/s: one on A10G is load 5/5 = 1, the A100 keeps 0.3 + 0.15 + 0.25 + 0.3 = 1.0.
    sol = solve_mix(melange_example(), variant=Variant.SLICED, slice_factor=3, engine=engine)
    assert sol.cost_per_hour == pytest.approx(4.68)
    assert sol.status is Status.OPTIMAL


def test_single_type_baselines_of_the_example() -> None:
    singles = {
        s.gpu: s for s in single_type_fleets(melange_example(), variant=Variant.SLICED, slice_factor=1)
    }
    assert singles["A10G"].solution is not None and singles["A10G"].solution.gpus == {"A10G": 12}  # 3+3+3+3
    assert singles["A100-80GB"].solution is not None and singles["A100-80GB"].solution.gpus == {
        "A100-80GB": 2
    }  # ⌈1.125⌉
    best = best_single_type(list(singles.values()))
    assert best is not None and best.gpu == "A100-80GB"


def test_availability_cap_forces_the_other_type() -> None:
    # No A100 allowed: all four buckets on A10G, load 12 → 12 × $1.01.
    sol = solve_mix(melange_example(A100=0), variant=Variant.SLICED, slice_factor=1)
    assert sol.gpus == {"A10G": 12}
    assert sol.cost_per_hour == pytest.approx(12.12)


def test_caps_too_small_explain_what_is_short() -> None:
    # A10G ≤ 2 and no A100, whole buckets (slice factor 1). Lifting the A10G cap: 12 A10G (load 3+3+3+3).
    # Lifting the A100 cap: no bucket fits 2 A10G (each is load 3), so all four go to A100: ⌈1.125⌉ = 2, $7.34.
    with pytest.raises(InfeasibleError) as info:
        solve_mix(melange_example(A100=0, A10G=2), variant=Variant.SLICED, slice_factor=1)
    message = str(info.value)
    assert "A100-80GB ≤ 0, A10G ≤ 2" in message
    assert "A10G to 12 ($12.12/h)" in message
    assert "A100-80GB to 2 ($7.34/h)" in message


def test_gpu_minimum_is_honoured_even_when_not_needed() -> None:
    problem = melange_example()
    problem = MixProblem(
        {**problem.gpus, "A100-80GB": GpuOffer("A100-80GB", 3.67, min_gpus=3)},
        problem.options,
        problem.windows,
    )
    sol = solve_mix(problem, variant=Variant.SLICED, slice_factor=1)
    assert sol.gpus == {"A100-80GB": 3}  # 3 A100 hold the whole 1.125 load; no A10G needed
    assert sol.cost_per_hour == pytest.approx(3 * 3.67)


@pytest.mark.parametrize(
    ("a10g", "a100", "match"),
    [
        pytest.param((2, 1, 5, 0), (20, 20, 40, 0), "1 bucket", id="a bucket no GPU type serves → reported"),
        pytest.param((2, 1, 5), (20, 20, 40, 20), "disagree", id="a profile missing a bucket → shape error"),
    ],
)
def test_degenerate_profiles_give_clear_errors(
    a10g: tuple[float, ...], a100: tuple[float, ...], match: str
) -> None:
    options = (InstanceOption("m", "A10G", a10g), InstanceOption("m", "A100-80GB", a100))
    problem = MixProblem({"A10G": A10G, "A100-80GB": A100}, options, ((Demand("m", (6.0, 3.0, 15.0, 6.0)),),))
    with pytest.raises(PlacementError, match=match):
        solve_mix(problem)


def test_unservable_bucket_error_lists_the_bucket() -> None:
    problem = MixProblem(
        {"A10G": A10G}, (InstanceOption("m", "A10G", (2.0, 0.0)),), ((Demand("m", (1.0, 0.5)),),)
    )
    with pytest.raises(UnservableError) as info:
        solve_mix(problem)
    assert [(u.model, u.bucket, u.rate) for u in info.value.buckets] == [("m", 1, 0.5)]
    # dropping it plans the rest: 1 req/s at 2 req/s per A10G → one A10G
    sol = solve_mix(problem, drop_unservable=True)
    assert sol.gpus == {"A10G": 1}
    assert sol.unservable[0].bucket == 1


def test_zero_demand_needs_no_gpus() -> None:
    problem = MixProblem({"A10G": A10G}, (InstanceOption("m", "A10G", (2.0,)),), ((Demand("m", (0.0,)),),))
    sol = solve_mix(problem)
    assert sol.gpus == {} and sol.cost_per_hour == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"engine": "gurobi"}, "unknown engine", id="unknown engine named"),
        pytest.param(
            {"slice_factor": 0, "variant": Variant.SLICED}, "slice factor", id="slice factor 0 refused"
        ),
        pytest.param({"time_limit_s": 0}, "time limit", id="no time limit refused"),
        pytest.param({"engine": "cp-sat"}, "continuous", id="CP-SAT cannot take the continuous variant"),
    ],
)
def test_bad_settings(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(PlacementError, match=match):
        solve_mix(melange_example(), **kwargs)  # type: ignore[arg-type]


def test_unknown_gpu_and_negative_rate_are_refused() -> None:
    with pytest.raises(PlacementError, match="not among the offered"):
        solve_mix(
            MixProblem({"A10G": A10G}, (InstanceOption("m", "H100", (1.0,)),), ((Demand("m", (1.0,)),),))
        )
    with pytest.raises(PlacementError, match="≥ 0"):
        solve_mix(
            MixProblem({"A10G": A10G}, (InstanceOption("m", "A10G", (1.0,)),), ((Demand("m", (-1.0,)),),))
        )
    with pytest.raises(PlacementError, match="cost_per_hour"):
        GpuOffer("X", -1.0)


def test_pd_pools_are_sized_together_and_beat_mixed_when_cheaper() -> None:
    # One bucket, 10 req/s. Mixed on A100: 4 req/s each → ⌈2.5⌉ = 3 × 3.67 = $11.01.
    # P/D: prefill on A100 at 20 req/s (load 0.5 → 1 × 3.67) + decode on A10G at 2.5 req/s (load 4 → 4 × 1.01)
    # = $7.71. What is prefilled must be decoded: decode shares equal prefill shares.
    options = (
        InstanceOption("m", "A100-80GB", (4.0,)),
        InstanceOption("m", "A100-80GB", (20.0,), role=Role.PREFILL),
        InstanceOption("m", "A10G", (2.5,), role=Role.DECODE),
    )
    problem = MixProblem({"A10G": A10G, "A100-80GB": A100}, options, ((Demand("m", (10.0,)),),))
    sol = solve_mix(problem, variant=Variant.SLICED, slice_factor=2)
    assert sol.counts == {"m/A100-80GB": 0, "m/A100-80GB/prefill": 1, "m/A10G/decode": 4}
    assert sol.cost_per_hour == pytest.approx(3.67 + 4 * 1.01)
    hint = sol.fractions[0][("m", 0)]
    assert hint["m/A100-80GB/prefill"] == pytest.approx(hint["m/A10G/decode"]) == pytest.approx(1.0)


def test_several_models_share_one_availability_cap() -> None:
    # Models a and b, 8 req/s each. A100: 4 req/s for $3.67 ($0.92 per req/s); A10G: 1 req/s for $1.01.
    # Uncapped: 2 A100 per model = 4 × 3.67 = $14.68. With 3 A100 in total, 12 req/s fit on A100 and the other
    # 4 req/s need 4 A10G: 3 × 3.67 + 4 × 1.01 = $15.05. An instance serves one model, so the A100s split 2 + 1.
    options = tuple(
        InstanceOption(m, g, (r,)) for m in ("a", "b") for g, r in (("A100-80GB", 4.0), ("A10G", 1.0))
    )
    demand = ((Demand("a", (8.0,)), Demand("b", (8.0,))),)
    free = solve_mix(MixProblem({"A10G": A10G, "A100-80GB": A100}, options, demand))
    assert free.gpus == {"A100-80GB": 4}
    capped = solve_mix(
        MixProblem({"A10G": A10G, "A100-80GB": GpuOffer("A100-80GB", 3.67, 0, 3)}, options, demand)
    )
    assert capped.gpus == {"A100-80GB": 3, "A10G": 4}
    assert capped.cost_per_hour == pytest.approx(15.05)
    assert sorted(n for k, n in capped.counts.items() if "A100" in k) == [1, 2]


def test_one_static_fleet_serves_every_window() -> None:
    # Window 1 wants bucket 0 heavy, window 2 bucket 1 heavy; one fleet must hold each peak separately.
    options = (InstanceOption("m", "A10G", (2.0, 1.0)),)
    windows = ((Demand("m", (4.0, 0.0)),), (Demand("m", (0.0, 3.0)),))
    sol = solve_mix(MixProblem({"A10G": A10G}, options, windows))
    assert sol.gpus == {"A10G": 3}  # max(4/2, 3/1) = 3, not 4/2 + 3/1 = 5
    assert len(sol.fractions) == 2


def test_cheapest_capacity_for_the_autoscaler() -> None:
    # Need 10,000 decode tokens/s; A100 gives 2,500 for $3.67, A10G 900 for $1.01. k A100 + ⌈(10,000 − 2,500k)/900⌉
    # A10G: k=0 → 12 A10G $12.12; k=1 → 9, $12.76; k=2 → 6, $13.40; k=3 → 3, $14.04; k=4 → $14.68. Best: 12 A10G.
    per = {"A100-80GB": 2_500.0, "A10G": 900.0}
    sol = cheapest_capacity(10_000, per, {"A10G": A10G, "A100-80GB": A100})
    assert sol.gpus == {"A10G": 12}
    assert sol.cost_per_hour == pytest.approx(12.12)
    # at most 8 A10G: k=0 and k=1 need 12 and 9 → out; k=2 with 6 A10G, $13.40, is the cheapest left
    capped = cheapest_capacity(10_000, per, {"A10G": GpuOffer("A10G", 1.01, 0, 8), "A100-80GB": A100})
    assert capped.gpus == {"A10G": 6, "A100-80GB": 2}
    assert capped.cost_per_hour == pytest.approx(13.40)
    with pytest.raises(PlacementError, match="finite"):
        cheapest_capacity(math.inf, {"A10G": 1.0}, {"A10G": A10G})


def test_a_floor_on_a_gpu_without_an_option_is_kept_or_refused_never_dropped() -> None:
    """2 A100 already running (min 2) with no capacity entry: they stay in the mix, costed (12 A10G + 2 A100,
    $19.46; it was 12 A10G, $12.12, the floor and its cost gone); solve_mix refuses such a problem, as the
    planner's own build_problem does."""
    floor = GpuOffer("A100-80GB", 3.67, min_gpus=2)
    sol = cheapest_capacity(10_000, {"A10G": 900.0}, {"A10G": A10G, "A100-80GB": floor})
    assert sol.gpus == {"A10G": 12, "A100-80GB": 2}
    assert sol.cost_per_hour == pytest.approx(19.46)
    problem = MixProblem(
        {"A10G": A10G, "A100-80GB": floor},
        (InstanceOption("m", "A10G", (900.0,)),),
        ((Demand("m", (10_000.0,)),),),
    )
    with pytest.raises(PlacementError, match="A100-80GB: min 2 GPU\\(s\\) must be paid for"):
        solve_mix(problem)


@pytest.mark.parametrize(
    ("load", "count", "ok"),
    [
        pytest.param(3.0000000000000004, 3, True, id="float dust above an integer fits (0.2·30/2)"),
        pytest.param(3.001, 3, False, id="a real excess does not fit"),
        pytest.param(0.0, 0, True, id="zero load fits zero instances"),
    ],
)
def test_load_tolerance(load: float, count: int, ok: bool) -> None:
    assert fits(load, count) is ok
    assert (needed_instances(load) <= count) is ok


def test_infeasible_when_no_single_cap_lift_suffices() -> None:
    # A10G serves only bucket 0, A100 only bucket 1, and neither may be used: lifting one cap leaves the other
    # bucket unserved, so the message falls back to the uncapped fleet: ⌈1/2⌉ A10G + ⌈1/20⌉ A100.
    gpus = {"A10G": GpuOffer("A10G", 1.01, 0, 0), "A100-80GB": GpuOffer("A100-80GB", 3.67, 0, 0)}
    options = (InstanceOption("m", "A10G", (2.0, 0.0)), InstanceOption("m", "A100-80GB", (0.0, 20.0)))
    problem = MixProblem(gpus, options, ((Demand("m", (1.0, 1.0)),),))
    with pytest.raises(
        InfeasibleError,
        match=r"nor with any one cap lifted; without caps: 1× A100-80GB, 1× A10G \(\$4.68/h\)",
    ):
        solve_mix(problem)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param((1e56,), "GPU A10G: cost_per_hour must be ≤ 1,000,000 $/h, got 1e+56", id="cost 1e56"),
        pytest.param(
            (1.0, 10**23), "GPU A10G: min_gpus must be ≤ 10,000,000, got " + str(10**23), id="min 1e23"
        ),
        pytest.param(
            (1.0, 0, 10**23), "GPU A10G: max_gpus must be ≤ 10,000,000, got " + str(10**23), id="max 1e23"
        ),
    ],
)
def test_offers_past_what_the_solvers_handle_are_refused(args: tuple[float, ...], message: str) -> None:
    """Callers building offers in Python meet the limits the file loaders apply (a min of 1e23 was planned
    below it in the float LP; a price of 1e56 made SCIP's objective infinite)."""
    with pytest.raises(PlacementError) as err:
        GpuOffer("A10G", *args)  # type: ignore[arg-type]
    assert str(err.value) == message
