"""The planner: profiles + workload + GPU offers → plan, with SLO selection, P/D, several models,
time-varying windows, what-if rows, the JSON document, and the online `cheapest_mix` call."""

from __future__ import annotations

from pathlib import Path

import pytest

from placement.binpacking import GpuOffer, PlacementError, Status
from placement.plan_report import PLAN_SCHEMA, plan_to_dict
from placement.planner import PlanInput, cheapest_mix, load_gpu_offers, make_plan, select_profiles, what_if
from placement.profiles import Role, Slo, ThroughputProfile, load_profile, profile_from_dict
from placement.workload import ModelWorkload, Window, load_workload

FIXTURES = Path(__file__).parent / "fixtures"
A10G, A100, L4 = GpuOffer("A10G", 1.01), GpuOffer("A100-80GB", 3.67), GpuOffer("L4", 0.70)


def fixture_profiles(*names: str) -> tuple[ThroughputProfile, ...]:
    return tuple(load_profile(FIXTURES / n) for n in names)


TPOT40 = ("llama3-a100-tpot40.yaml", "llama3-a10g-tpot40.yaml", "llama3-l4-tpot40.json")


def one_bucket(
    gpu: str, rate: float, role: str = "mixed", model: str = "m", slo: float | None = None
) -> ThroughputProfile:
    return profile_from_dict(
        {
            "schema": "mosaic.profile/v1",
            "model": model,
            "gpu": gpu,
            "role": role,
            "slo": {"tpot_ms": slo},
            "input_edges": [1, 100],
            "output_edges": [1, 100],
            "max_rate": [[rate]],
        }
    )


_PREFILL = {
    "schema": "mosaic.profile/v1",
    "model": "m",
    "role": "prefill",
    "input_edges": [1, 100],
    "output_edges": [1, 100],
    "max_rate": [[8]],
}


def demand(rate: float, model: str = "m", *windows: float) -> ModelWorkload:
    rates = (rate, *windows)
    return ModelWorkload(model, (1, 100), (1, 100), tuple(Window(3600.0, (r,)) for r in rates))


def test_fixture_plan_beats_the_best_single_type_and_routes_every_bucket() -> None:
    inp = PlanInput(
        load_gpu_offers(FIXTURES / "gpus.yaml"),
        fixture_profiles(*TPOT40),
        load_workload(str(FIXTURES / "workload.yaml")),
        Slo(tpot_ms=40),
    )
    plan = make_plan(inp)
    assert plan.solution.status is Status.OPTIMAL
    # A100 alone: loads 8/12 + 4/6 + 1/2 + 3/6 + 2/3.5 + .6/1.5 + .8/1.5 + .4/1 + .2/.5 = 4.638 → 5 × 3.67 = $18.35
    best = plan.best_single
    assert best is not None and best.gpu == "A100-80GB" and best.solution is not None
    assert best.solution.cost_per_hour == pytest.approx(18.35)
    assert plan.solution.cost_per_hour < 18.35
    assert plan.savings is not None and 0 < plan.savings < 1
    # A10G and L4 cannot serve the 2k+ prompts (zeros in their profiles)
    reasons = {s.gpu: s.reason for s in plan.singles}
    assert "cannot serve 3 bucket(s)" in reasons["A10G"]
    for shares in plan.solution.fractions[0].values():
        assert sum(shares.values()) == pytest.approx(1.0)
    for key, load in plan.solution.loads.items():
        assert load <= plan.solution.counts[key] + 1e-9
    doc = plan_to_dict(plan)
    assert doc["schema"] == PLAN_SCHEMA and doc["savings"]["fraction"] == pytest.approx(
        plan.savings, abs=1e-6
    )
    assert {row["gpu"] for row in doc["instances"]} == {"A100-80GB", "A10G", "L4"}
    assert doc["assignment"][0]["input"] == [1, 512] and doc["assignment"][0]["output"] == [1, 128]


@pytest.mark.parametrize(
    ("target", "chosen", "note"),
    [
        pytest.param(Slo(tpot_ms=40), 40, "", id="exact SLO match → that profile"),
        pytest.param(
            Slo(tpot_ms=100), 40, "conservative", id="between → the tighter profile, noted as conservative"
        ),
        pytest.param(Slo(tpot_ms=150), 120, "conservative", id="looser than all → the loosest profile"),
    ],
)
def test_select_profiles_picks_the_loosest_safe_one(target: Slo, chosen: float, note: str) -> None:
    profiles = fixture_profiles("llama3-a100-tpot40.yaml", "llama3-a100-tpot120.yaml")
    picked, notes = select_profiles(profiles, target)
    assert [p.slo.tpot_ms for p in picked] == [chosen]
    assert (note in " ".join(notes)) if note else not notes


def test_select_profiles_errors() -> None:
    profiles = fixture_profiles("llama3-a100-tpot40.yaml", "llama3-a100-tpot120.yaml")
    with pytest.raises(PlacementError, match="2 profiles for llama-3-8b/A100-80GB"):
        select_profiles(profiles, None)
    picked, notes = select_profiles(profiles, Slo(tpot_ms=30))
    assert not picked and "no profile at or under TPOT 30 ms" in notes[0]
    inp = PlanInput(
        {"A100-80GB": A100}, profiles, load_workload(str(FIXTURES / "workload.yaml")), Slo(tpot_ms=30)
    )
    with pytest.raises(PlacementError, match="no usable profile"):
        make_plan(inp)


def test_without_a_target_the_profiles_a_plan_uses_must_share_one_slo_which_it_names() -> None:
    """Before: a 120 ms profile beside 40 ms ones was planned without a word, and neither the table nor the
    JSON said at which SLO the plan holds. Profiles the plan cannot use (a GPU not offered, a model not in
    the workload) do not count."""
    offers = {"A100-80GB": A100, "L4": L4}
    mixed = (one_bucket("A100-80GB", 4, slo=40), one_bucket("L4", 2, slo=120))
    with pytest.raises(PlacementError) as caught:
        make_plan(PlanInput(offers, mixed, (demand(6.0),), None))
    assert str(caught.value) == (
        "the mixed profiles were measured at different SLOs (TPOT 120 ms; TPOT 40 ms): give the target SLO"
        " (--slo-tpot-ms, --slo-ttft-ms) to choose the ones that meet it"
    )
    # L4 not offered, another model's profile at 120 ms: neither is used, so the plan holds at 40 ms
    spare = (*mixed, one_bucket("A100-80GB", 4, model="other", slo=120))
    plan = make_plan(PlanInput({"A100-80GB": A100}, spare, (demand(6.0),), None))
    assert plan.notes == (
        "L4: profiled but not offered; its profiles are not used",
        "no target SLO given: the plan holds at the profiles' SLO (mixed TPOT 40 ms)",
    )
    # one SLO per role: prefill profiles are compared on TTFT, decode ones on TPOT
    pd = (
        one_bucket("A100-80GB", 4, "decode", slo=40),
        one_bucket("L4", 2, "decode", slo=40),
        profile_from_dict({**_PREFILL, "gpu": "L4", "slo": {"ttft_ms": 2000}}),
    )
    plan = make_plan(PlanInput(offers, pd, (demand(1.0),), None))
    assert plan.notes[-1] == (
        "no target SLO given: the plan holds at the profiles' SLO (decode TPOT 40 ms; prefill TTFT 2000 ms)"
    )


def test_the_reason_an_offered_gpu_has_no_profile_comes_first() -> None:
    """Before: the notes about profiles of GPUs not offered came first and cut the real reason (the offered
    GPU has none) out of the error's first three."""
    profiles = (one_bucket("L4", 2, slo=40), one_bucket("A10G", 1, slo=40), one_bucket("H100", 9, slo=40))
    with pytest.raises(PlacementError) as caught:
        make_plan(PlanInput({"A100-80GB": A100}, profiles, (demand(1.0),), None))
    assert str(caught.value).startswith(
        "no usable profile for the offered GPUs: A100-80GB: no usable profile, not considered; "
    )


def test_a_profile_for_a_gpu_nobody_offers_is_refused_or_noted() -> None:
    """Before: a profile of `gpu: H900` (a typo for H100) was dropped without a word and the plan went on
    without H100; a profile of a known GPU not offered was dropped silently too."""
    work = (demand(6.0),)
    typo = (one_bucket("H900", 4, slo=40), one_bucket("A100-80GB", 4, slo=40))
    with pytest.raises(PlacementError) as caught:
        make_plan(PlanInput({"A100-80GB": A100}, typo, work, Slo(tpot_ms=40)))
    assert str(caught.value) == (
        "profile m on GPU 'H900': that GPU is neither in the catalog nor offered (A100-80GB)"
    )
    known = (one_bucket("L4", 2, slo=40), one_bucket("A100-80GB", 4, slo=40))
    plan = make_plan(PlanInput({"A100-80GB": A100}, known, work, Slo(tpot_ms=40)))
    assert plan.notes == ("L4: profiled but not offered; its profiles are not used",)


def test_unservable_buckets_are_named_or_dropped() -> None:
    workload = load_workload(str(FIXTURES / "workload.yaml"))
    inp = PlanInput({"A10G": A10G}, fixture_profiles("llama3-a10g-tpot40.yaml"), workload, Slo(tpot_ms=40))
    with pytest.raises(
        PlacementError, match=r"no GPU type serves llama-3-8b in \[2048,8193\) out \[1,128\) \(0.8 req/s\)"
    ):
        make_plan(inp)
    plan = make_plan(PlanInput(inp.offers, inp.profiles, workload, inp.slo, drop_unservable=True))
    # the three 2k+ buckets carry 20 · (4 + 2 + 1)/100 = 1.4 req/s
    assert sum(d.rate for d in plan.dropped) == pytest.approx(1.4)
    assert plan.solution.gpus.keys() == {"A10G"}


def test_workload_edges_must_match_the_profiles() -> None:
    wl = ModelWorkload("llama-3-8b", (1, 1024, 8193), (1, 2049), (Window(3600.0, (1.0, 1.0)),))
    with pytest.raises(PlacementError, match="bucket edges"):
        make_plan(
            PlanInput(
                {"A100-80GB": A100}, fixture_profiles("llama3-a100-tpot40.yaml"), (wl,), Slo(tpot_ms=40)
            )
        )


def test_pd_profiles_are_sized_with_mixed_ones() -> None:
    # 10 req/s. Mixed A100 at 4 req/s → 3 × 3.67 = $11.01. P/D: prefill A100 at 20 req/s (1 × 3.67) and decode
    # A10G at 2.5 req/s (4 × 1.01) = $7.71 → P/D wins; with --mode mixed only the mixed option remains.
    profiles = (
        one_bucket("A100-80GB", 4.0),
        one_bucket("A100-80GB", 20.0, "prefill"),
        one_bucket("A10G", 2.5, "decode"),
    )
    offers = {"A10G": A10G, "A100-80GB": A100}
    plan = make_plan(PlanInput(offers, profiles, (demand(10.0),)))
    assert plan.solution.counts == {"m/A100-80GB": 0, "m/A100-80GB/prefill": 1, "m/A10G/decode": 4}
    mixed = make_plan(PlanInput(offers, profiles, (demand(10.0),), mode="mixed"))
    assert mixed.solution.cost_per_hour == pytest.approx(3 * 3.67)
    roles = {row["role"] for row in plan_to_dict(plan)["instances"] if row["count"]}
    assert roles == {Role.PREFILL.value, Role.DECODE.value}


def test_several_models_at_once() -> None:
    # a: 6 req/s on A10G at 2 → 3 A10G; b: 8 req/s on A100 at 4 → 2 A100 (b has no A10G profile)
    profiles = (one_bucket("A10G", 2.0, model="a"), one_bucket("A100-80GB", 4.0, model="b"))
    plan = make_plan(
        PlanInput({"A10G": A10G, "A100-80GB": A100}, profiles, (demand(6.0, "a"), demand(8.0, "b")))
    )
    assert plan.solution.gpus == {"A10G": 3, "A100-80GB": 2}
    assert plan.best_single is None  # no one type serves both models


def test_time_varying_plan_against_one_static_fleet() -> None:
    # Two 1 h windows at 10 and 2 req/s on A100 (4 req/s each): per window ⌈2.5⌉ = 3 then 1 A100 → 4 GPU-h,
    # $14.68; one static fleet for the peak: 3 A100 × 2 h = 6 GPU-h, $22.02; saving 1 − 14.68/22.02 = 1/3.
    plan = make_plan(
        PlanInput({"A100-80GB": A100}, (one_bucket("A100-80GB", 4.0),), (demand(10.0, "m", 2.0),))
    )
    assert [s.gpus for s in plan.per_window] == [{"A100-80GB": 3}, {"A100-80GB": 1}]
    tv = plan_to_dict(plan)["time_varying"]
    assert tv["dynamic"] == {"gpu_hours": 4.0, "cost": pytest.approx(14.68)}
    assert tv["static"]["gpu_hours"] == 6.0 and tv["static"]["cost"] == pytest.approx(22.02)
    assert tv["savings_fraction"] == pytest.approx(1 / 3, abs=1e-6)


def test_what_if_over_slos_and_rates() -> None:
    profiles = fixture_profiles(
        "llama3-a100-tpot40.yaml",
        "llama3-a100-tpot120.yaml",
        "llama3-a10g-tpot40.yaml",
        "llama3-a10g-tpot120.yaml",
    )
    inp = PlanInput(
        {"A10G": A10G, "A100-80GB": A100},
        profiles,
        load_workload(str(FIXTURES / "workload.yaml")),
        Slo(tpot_ms=40),
    )
    rows = what_if(inp, [Slo(tpot_ms=40), Slo(tpot_ms=120), Slo(tpot_ms=20)], [1.0, 2.0])
    cost = {
        (r.slo.tpot_ms if r.slo else None, r.rate_scale): r.plan.solution.cost_per_hour
        for r in rows
        if r.plan
    }
    assert cost[(120, 1.0)] < cost[(40, 1.0)]  # a looser SLO → higher per-GPU rates → cheaper
    assert cost[(40, 2.0)] > cost[(40, 1.0)]
    failed = [r for r in rows if r.plan is None]  # nothing was profiled at 20 ms
    assert len(failed) == 2
    assert all("no usable profile" in r.error for r in failed)
    assert rows[1].rate == pytest.approx(40.0)  # 20 req/s × 2


def test_gpu_offers_from_list_string_and_file(tmp_path: Path) -> None:
    assert load_gpu_offers(["A10G", "a100"])["A100-80GB"].cost_per_hour == 3.67  # alias → catalog price
    assert set(load_gpu_offers("L4, H100")) == {"L4", "H100-SXM"}
    offers = load_gpu_offers(FIXTURES / "gpus.yaml")
    assert offers["A100-80GB"].max_gpus == 8 and offers["L4"].cost_per_hour == 0.70
    bad = tmp_path / "g.yaml"
    bad.write_text("gpus:\n  MyGPU: {}\n")
    with pytest.raises(PlacementError, match="MyGPU is not in the catalog: give cost_per_hour"):
        load_gpu_offers(bad)
    bad.write_text("gpus:\n  A10G: {price: 1}\n")
    with pytest.raises(PlacementError, match="allowed keys"):
        load_gpu_offers(bad)


def test_cheapest_mix_online_call() -> None:
    # The autoscaler's view: 9 req/s; A10G at 2 req/s ($0.505 per req/s) beats A100 at 4 ($0.92): 5 A10G = $5.05.
    profiles = (one_bucket("A10G", 2.0), one_bucket("A100-80GB", 4.0))
    sol = cheapest_mix({"m": [9.0]}, profiles, {"A10G": A10G, "A100-80GB": A100})
    assert sol.gpus == {"A10G": 5}
    # only adding: 2 A100 already run (min 2) → they carry 8 req/s, 1 more req/s needs 1 A10G
    sol = cheapest_mix(
        {"m": [9.0]}, profiles, {"A10G": A10G, "A100-80GB": GpuOffer("A100-80GB", 3.67, min_gpus=2)}
    )
    assert sol.gpus == {"A100-80GB": 2, "A10G": 1}
    with pytest.raises(PlacementError, match="no profile for model"):
        cheapest_mix({"other": [1.0]}, profiles, {"A10G": A10G})


def test_single_type_over_its_cap_says_how_many_it_would_need() -> None:
    # A100 alone needs 5 (load 4.638, see above) but only 2 are available; the mix still has A10G/L4 for the
    # short buckets and 2 A100 for the long ones.
    offers = load_gpu_offers({"A10G": {}, "L4": {}, "A100-80GB": {"max": 2}})
    inp = PlanInput(
        offers, fixture_profiles(*TPOT40), load_workload(str(FIXTURES / "workload.yaml")), Slo(tpot_ms=40)
    )
    reasons = {s.gpu: s.reason for s in make_plan(inp).singles}
    assert reasons["A100-80GB"] == "needs 5 GPUs, 2 available ($18.35/h uncapped)"


@pytest.mark.parametrize(
    ("workload", "profile", "message"),
    [
        pytest.param(
            demand(6.0),
            one_bucket("A10G", 0.0),
            "all 6 req/s fall outside the profiles/SLO; nothing left to plan",
            id="the only bucket no GPU serves → error, not a $0 optimal plan",
        ),
        pytest.param(
            ModelWorkload("m", (1, 100), (1, 100), (Window(3600.0, (0.0,), 5.0),)),
            one_bucket("A10G", 2.0),
            "all 5 req/s fall outside the profiles/SLO; nothing left to plan",
            id="every request outside the profiled lengths → error",
        ),
    ],
)
def test_dropping_everything_is_an_error(
    workload: ModelWorkload, profile: ThroughputProfile, message: str
) -> None:
    with pytest.raises(PlacementError, match=f"^{message}$"):
        make_plan(PlanInput({"A10G": A10G}, (profile,), (workload,), drop_unservable=True))


def test_a_floor_without_a_usable_profile_is_an_error() -> None:
    # L4 must be paid for (min 2) but nothing was profiled on it: its $1.40/h cannot silently vanish.
    offers = {"A10G": A10G, "L4": GpuOffer("L4", 0.70, min_gpus=2)}
    with pytest.raises(PlacementError, match=r"^L4: min 2 GPU\(s\) must be paid for, but it has no usable"):
        make_plan(PlanInput(offers, (one_bucket("A10G", 2.0),), (demand(9.0),)))
    # without a floor it is only a note
    plan = make_plan(
        PlanInput({**offers, "L4": GpuOffer("L4", 0.70)}, (one_bucket("A10G", 2.0),), (demand(9.0),))
    )
    assert "L4: no usable profile, not considered" in plan.notes


def test_single_type_baselines_keep_the_other_types_floors() -> None:
    # 9 req/s; A10G at 2 req/s, A100 at 4 req/s with a floor of 2 A100 (8 req/s) → mix 2 A100 + 1 A10G = $8.35.
    # A10G "alone" used to be 5 A10G = $5.05, cheaper than the mix (savings −65%). With the floor held:
    # A10G baseline = 2 A100 + 1 A10G = $8.35 (savings 0); A100 alone = ⌈9/4⌉ = 3 A100 = $11.01.
    offers = {"A10G": A10G, "A100-80GB": GpuOffer("A100-80GB", 3.67, min_gpus=2)}
    plan = make_plan(
        PlanInput(offers, (one_bucket("A10G", 2.0), one_bucket("A100-80GB", 4.0)), (demand(9.0),))
    )
    assert plan.solution.gpus == {"A100-80GB": 2, "A10G": 1}
    singles = {s.gpu: s.solution for s in plan.singles}
    assert singles["A10G"] is not None and singles["A10G"].gpus == {"A100-80GB": 2, "A10G": 1}
    assert singles["A100-80GB"] is not None and singles["A100-80GB"].cost_per_hour == pytest.approx(11.01)
    assert plan.savings == pytest.approx(0.0)
    assert "single-type baselines keep the GPU floors (A100-80GB ≥ 2), as the mix does" in plan.notes


@pytest.mark.parametrize(
    ("role", "chosen_rate"),
    [
        pytest.param("prefill", 9.0, id="prefill: by TTFT only, not by an unset TPOT"),
        pytest.param("decode", 5.0, id="decode: by TPOT only"),
    ],
)
def test_select_profiles_ranks_by_the_limits_that_bind_the_role(role: str, chosen_rate: float) -> None:
    # Two profiles of one key. For prefill only TTFT binds: the one at the target's TTFT (2,000 ms, 9 req/s)
    # is the loosest safe one; the one at TTFT 1,000 ms and no TPOT limit had won on TPOT = ∞ (5 req/s).
    # For decode only TPOT binds: the one with no TPOT limit does not fit a TPOT target at all.
    from placement.profiles import Role, ThroughputProfile

    base = {
        "model": "llama-3-8b",
        "gpu": "A100-80GB",
        "role": Role(role),
        "input_edges": (1, 512),
        "output_edges": (1, 128),
    }
    tight_ttft = ThroughputProfile(**base, slo=Slo(ttft_ms=1000, tpot_ms=30), max_rate=((5.0,),))
    unset_tpot = ThroughputProfile(**base, slo=Slo(ttft_ms=1000), max_rate=((5.0,),))
    exact = ThroughputProfile(**base, slo=Slo(tpot_ms=50, ttft_ms=2000), max_rate=((9.0,),))
    group = [unset_tpot, exact] if role == "prefill" else [tight_ttft, unset_tpot]
    picked, notes = select_profiles(group, Slo(tpot_ms=200, ttft_ms=2000))
    assert [p.max_rate[0][0] for p in picked] == [chosen_rate]
    assert not notes if role == "prefill" else "conservative" in notes[0]
