"""The P/D-coordinated autoscaler and its baselines, as pure policies over observations."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.autoscaler.baselines import DynamoPlanner, HpaPolicy, StaticPolicy
from scheduler.autoscaler.buying import rebalance
from scheduler.autoscaler.policy import AutoscalerConfig, MosaicAutoscaler
from scheduler.autoscaler.signals import ModelObservation, Observation, PoolObservation, PoolSpec


def decode_pool(
    name: str = "d-a100",
    gpu: str = "A100-80GB",
    cost: float = 3.67,
    tps: float = 1000.0,
    lo: int = 1,
    hi: int = 32,
) -> PoolSpec:
    return PoolSpec(name, "llama-3-8b", "decode", gpu, cost, lo, hi, decode_tps_capacity=tps)


def prefill_pool(
    name: str = "p-h100", cost: float = 4.25, tps: float = 20000.0, lo: int = 1, hi: int = 32
) -> PoolSpec:
    return PoolSpec(name, "llama-3-8b", "prefill", "H100-SXM", cost, lo, hi, prefill_tps_capacity=tps)


def obs(now: float, **pools: PoolObservation) -> Observation:
    return Observation(now=now, pools=pools)


def po(ready: int, decode_tps: float = 0.0, starting: int = 0, waiting: int = 0) -> PoolObservation:
    return PoolObservation(
        ready=ready, starting=starting, decode_tokens_per_s=decode_tps, num_waiting=waiting
    )


# The tests below pin the sizing arithmetic on the raw signal (smoothing=1.0: the newest sample only);
# the smoothing itself is tested on its own.
CFG = AutoscalerConfig(smoothing=1.0, utilization_target=0.8, pd_ratio=0.5, scale_down_window_s=300)


def test_decode_sized_from_tokens_per_second_and_prefill_follows_ratio() -> None:
    policy = MosaicAutoscaler([decode_pool(), prefill_pool()], CFG)
    # 6,000 tok/s / (1,000 tok/s · 0.8) = 7.5 → 8 decode; but one step may add max(4, 2·2) = 4 → 6
    decision = policy.decide(obs(0, **{"d-a100": po(2, 6000), "p-h100": po(1)}))
    assert decision.targets["d-a100"] == 6
    # prefill follows in the same decision, from the unrounded decode need: ceil(7.5 · 0.5) = ceil(3.75) = 4
    assert decision.targets["p-h100"] == 4
    # next cycle (instances starting count as arriving capacity): 8 decode, prefill stays 4
    decision = policy.decide(obs(15, **{"d-a100": po(2, 6000, starting=4), "p-h100": po(1, starting=2)}))
    assert decision.targets == {"d-a100": 8, "p-h100": 4}


def test_pending_instances_count_as_arriving_capacity() -> None:
    policy = MosaicAutoscaler([decode_pool()], CFG)
    # need 4,000/(800) = 5; 2 ready + 3 starting = 5 provisioned → no change
    decision = policy.decide(obs(0, **{"d-a100": po(2, 4000, starting=3)}))
    assert decision.targets["d-a100"] == 5
    assert decision.changes(obs(0, **{"d-a100": po(2, 4000, starting=3)})) == {}


def test_flat_load_within_tolerance_never_oscillates() -> None:
    policy = MosaicAutoscaler([decode_pool()], CFG)
    targets = []
    for i in range(100):
        # 5 instances provide 5 · 800 = 4,000 at target; load jitters between 91% and 99% of it
        # (covered, with less than the 10% tolerance to spare)
        load = 4000 * (0.99 if i % 2 else 0.91)
        targets.append(policy.decide(obs(i * 15.0, **{"d-a100": po(5, load)})).targets["d-a100"])
    assert set(targets) == {5}


def test_scale_down_waits_for_the_stabilisation_window_and_is_damped() -> None:
    policy = MosaicAutoscaler([decode_pool()], CFG)
    assert policy.decide(obs(0, **{"d-a100": po(8, 6400)})).targets["d-a100"] == 8  # 6,400/800 = 8
    # load halves: the recommendation (4) is below the window's max (8) → hold
    assert policy.decide(obs(100, **{"d-a100": po(8, 3200)})).targets["d-a100"] == 8
    assert policy.decide(obs(299, **{"d-a100": po(8, 3200)})).targets["d-a100"] == 8
    # after 300 s the high recommendation has left the window; at most 25% (2 of 8) removed per cycle
    assert policy.decide(obs(301, **{"d-a100": po(8, 3200)})).targets["d-a100"] == 6
    assert policy.decide(obs(316, **{"d-a100": po(6, 3200)})).targets["d-a100"] == 5
    assert policy.decide(obs(331, **{"d-a100": po(5, 3200)})).targets["d-a100"] == 4


def test_latency_safety_net_only_adds() -> None:
    cfg = AutoscalerConfig(smoothing=1.0, utilization_target=0.8, tpot_slo_s=0.05, scale_down_window_s=0)
    policy = MosaicAutoscaler([decode_pool()], cfg)
    # light load would scale 8 → 6 (2,000/800 = 2.5 → 3, damped to 8 − 2), but TPOT breaches: hold at 8
    breached = Observation(now=0, pools={"d-a100": po(8, 2000)}, tpot_p90_s=0.06)
    assert policy.decide(breached).targets["d-a100"] == 8
    # moderate breach (≤ 1.5× SLO) adds 10%: 4,000 · 1.1 / 800 = 5.5 → 6 from 5
    moderate = Observation(now=15, pools={"d-a100": po(5, 4000)}, tpot_p90_s=0.06)
    assert policy.decide(moderate).targets["d-a100"] == 6
    # severe breach (> 1.5× SLO) adds 20%: 4,000 · 1.2 / 800 = 6 exactly
    severe = Observation(now=30, pools={"d-a100": po(5, 4000)}, tpot_p90_s=0.08)
    assert policy.decide(severe).targets["d-a100"] == 6


def test_queueing_is_seen_as_demand() -> None:
    cfg = AutoscalerConfig(smoothing=1.0, utilization_target=0.8, queue_drain_s=30, default_output_tokens=200)
    policy = MosaicAutoscaler([decode_pool()], cfg)
    # backpressure: decode tokens/s capped at what 2 instances do (1,600), but 300 requests wait
    # demand = 1,600 + 300 · 200 / 30 = 3,600 → 3,600 / 800 = 4.5 → 5 (within the +4 step from 2)
    queued = Observation(
        now=0, pools={"d-a100": po(2, 1600, waiting=100)}, admission_queue={"llama-3-8b": 200}
    )
    assert policy.decide(queued).targets["d-a100"] == 5


def test_consolidation_check_before_scale_in() -> None:
    cfg = AutoscalerConfig(smoothing=1.0, utilization_target=0.8, tolerance=0.0, scale_down_window_s=0)
    policy = MosaicAutoscaler([decode_pool()], cfg)
    # 4 instances at 2,500 tok/s: removing one gives 2,500/3 = 833 per instance > 800 target → keep 4
    assert policy.decide(obs(0, **{"d-a100": po(4, 2500)})).targets["d-a100"] == 4
    # at 2,300 tok/s: 2,300/3 = 767 < 800 → remove one
    assert policy.decide(obs(15, **{"d-a100": po(4, 2300)})).targets["d-a100"] == 3


def test_buys_cheapest_capacity_first_and_sells_priciest_first() -> None:
    l4 = decode_pool("d-l4", "L4", cost=0.70, tps=300.0, lo=0)  # $2.33 per 1,000 tok/s
    h100 = decode_pool("d-h100", "H100-SXM", cost=4.25, tps=2500.0, lo=0)  # $1.70 per 1,000 tok/s
    # need 5,000: H100s are cheaper per token/s → 2 H100s, no L4
    assert rebalance([l4, h100], {"d-l4": 0, "d-h100": 0}, 5000, lambda p: p.decode_tps_capacity) == {
        "d-l4": 0,
        "d-h100": 2,
    }
    # too much capacity: sell the L4s (priciest per unit) first
    assert rebalance([l4, h100], {"d-l4": 3, "d-h100": 2}, 5000, lambda p: p.decode_tps_capacity) == {
        "d-l4": 0,
        "d-h100": 2,
    }


def test_min_and_max_replicas_are_respected() -> None:
    policy = MosaicAutoscaler(
        [decode_pool(lo=2, hi=5)], AutoscalerConfig(smoothing=1.0, scale_down_window_s=0)
    )
    assert policy.decide(obs(0, **{"d-a100": po(4, 100_000)})).targets["d-a100"] == 5
    assert policy.decide(obs(15, **{"d-a100": po(2, 0)})).targets["d-a100"] == 2


def test_prompt_token_mode_sizes_prefill_by_prompt_demand() -> None:
    cfg = AutoscalerConfig(smoothing=1.0, utilization_target=0.8, prefill_mode="prompt_tokens")
    policy = MosaicAutoscaler([decode_pool(), prefill_pool(tps=10_000)], cfg)
    o = Observation(
        now=0, pools={"d-a100": po(1, 800), "p-h100": PoolObservation(ready=1, prompt_tokens_per_s=20_000)}
    )
    # 20,000 / (10,000 · 0.8) = 2.5 → 3
    assert policy.decide(o).targets["p-h100"] == 3


@pytest.mark.parametrize(
    ("utilization", "current", "expected"),
    [
        pytest.param(0.95, 4, 6, id="busy: ceil(4 · 0.95/0.75) = ceil(5.07) = 6"),
        pytest.param(0.80, 4, 4, id="0.80/0.75 = 1.067 is within the 0.1 tolerance → 4"),
        pytest.param(1.50, 3, 6, id="twice the target doubles: ceil(3 · 2) = 6"),
    ],
)
def test_hpa_formula(utilization: float, current: int, expected: int) -> None:
    policy = HpaPolicy([decode_pool()], "gpu_utilization", target=0.75)
    o = Observation(now=0, pools={"d-a100": PoolObservation(ready=current, gpu_utilization=utilization)})
    assert policy.decide(o).targets["d-a100"] == expected


def test_hpa_tolerance_and_scale_down_window() -> None:
    policy = HpaPolicy([decode_pool()], "num_requests_waiting", target=2.0)
    # 4 instances, 9 waiting → 2.25 per instance: ratio 1.125 > 1.1 → ceil(4 · 1.125) = 5
    assert policy.decide(Observation(0, {"d-a100": po(4, waiting=9)})).targets["d-a100"] == 5
    # 8.5 waiting / 4 = 2.125: ratio 1.0625 within tolerance → 4
    assert policy.decide(Observation(15, {"d-a100": po(4, waiting=8)})).targets["d-a100"] == 4
    # no waiting: recommendation 0 → held by the window at the max recent recommendation (5 > 4 → 4)
    assert policy.decide(Observation(30, {"d-a100": po(4, waiting=0)})).targets["d-a100"] == 4
    assert policy.decide(Observation(400, {"d-a100": po(4, waiting=0)})).targets["d-a100"] == 1


def test_static_policy_holds() -> None:
    assert StaticPolicy({"d-a100": 7}).decide(Observation(0, {"d-a100": po(1)})).targets == {"d-a100": 7}


def dyn_obs(now: float, d: int, p: int, rate: float, isl: float = 0.0, osl: float = 0.0) -> Observation:
    return Observation(
        now,
        {"d-a100": po(d), "p-h100": po(p)},
        request_rate=rate,
        mean_input_tokens=isl,
        mean_output_tokens=osl,
    )


def test_dynamo_planner_plans_once_per_interval_on_the_interval_means() -> None:
    """Like Dynamo, it observes a whole adjustment interval (180 s) before its first plan, then plans at
    the end of each interval on that interval's means: rate averaged over the decisions, lengths weighted
    by each decision's rate."""
    planner = DynamoPlanner([decode_pool(), prefill_pool()], interval_s=180)
    # decisions every 60 s: 0, 60, 120 observe only (nothing changes before one interval has passed)
    for t, rate in ((0, 5), (60, 10), (120, 15)):
        assert planner.decide(dyn_obs(t, 2, 2, rate, 3000, 250)).targets == {"d-a100": 2, "p-h100": 2}
    # at 180: the interval's rate is (5 + 10 + 15 + 10) / 4 = 10 req/s; lengths 3,000 / 250 everywhere
    # decode: 10 · 250 = 2,500 tok/s / 1,000 → 3; prefill: 10 · 3,000 = 30,000 / 20,000 → 2
    assert planner.decide(dyn_obs(180, 2, 2, 10, 3000, 250)).targets == {"d-a100": 3, "p-h100": 2}
    # a surge at 240 is not acted on before the next interval ends (360)
    assert planner.decide(dyn_obs(240, 3, 2, 40, 3000, 250)).targets == {"d-a100": 3, "p-h100": 2}
    # lengths weighted by rate: input (10·1,000 + 30·3,000) / 40 = 2,500, output (10·100 + 30·300) / 40 = 250
    planner = DynamoPlanner([decode_pool(), prefill_pool()], interval_s=180)
    planner.decide(dyn_obs(0, 2, 2, 10, 1000, 100))
    decision = planner.decide(dyn_obs(180, 2, 2, 30, 3000, 300))
    # rate (10 + 30) / 2 = 20: decode 20 · 250 = 5,000 / 1,000 = 5; prefill 20 · 2,500 = 50,000 / 20,000 → 3
    assert decision.targets == {"d-a100": 5, "p-h100": 3}


def test_dynamo_planner_skips_an_interval_without_lengths() -> None:
    """No request finished in the interval (lengths 0.0, the gateway's "not observed"): Dynamo skips the
    adjustment on NaN metrics instead of sizing for zero tokens; the next interval with lengths plans."""
    planner = DynamoPlanner([decode_pool(), prefill_pool()], interval_s=180)
    planner.decide(dyn_obs(0, 2, 2, 10))
    assert planner.decide(dyn_obs(180, 2, 2, 10)).targets == {"d-a100": 2, "p-h100": 2}
    planner.decide(dyn_obs(240, 2, 2, 10, 3000, 250))
    assert planner.decide(dyn_obs(360, 2, 2, 10, 3000, 250)).targets == {"d-a100": 3, "p-h100": 2}


def test_arrivals_bound_decode_demand_from_below() -> None:
    policy = MosaicAutoscaler([decode_pool()], CFG)
    # a saturated pool decodes only 1,600 tok/s, but 20 req/s · 200 tokens = 4,000 tok/s arrive
    # → 4,000 / (1,000 · 0.8) = 5 instances (within the +4 step from 2)
    o = Observation(now=0, pools={"d-a100": po(2, 1600)}, request_rate=20, mean_output_tokens=200)
    assert policy.decide(o).targets["d-a100"] == 5


def test_prompt_demand_is_a_floor_under_the_ratio() -> None:
    policy = MosaicAutoscaler([decode_pool(), prefill_pool(tps=10_000)], CFG)
    # decode: 800 tok/s / 800 = 1 instance → ratio 0.5 → 1 prefill; but 10 req/s · 2,000 prompt tokens
    # = 20,000 tok/s / (10,000 · 0.8) = 2.5 → 3 prefill instances
    o = Observation(
        now=0,
        pools={"d-a100": po(1, 800), "p-h100": po(1)},
        request_rate=10,
        mean_input_tokens=2000,
        mean_output_tokens=80,
    )
    assert policy.decide(o).targets == {"d-a100": 1, "p-h100": 3}


def test_any_shortfall_scales_up_at_once_but_a_small_surplus_is_kept() -> None:
    policy = MosaicAutoscaler(
        [decode_pool()], AutoscalerConfig(smoothing=1.0, utilization_target=0.8, scale_down_window_s=0)
    )
    # 4,040 tok/s needs 4,040 / 0.8 = 5,050 of capacity; 5 instances give 5,000 → add one now
    assert policy.decide(obs(0, **{"d-a100": po(5, 4040)})).targets["d-a100"] == 6
    # 6 instances (6,000) for 4,400 / 0.8 = 5,500: surplus 8% < 10% tolerance → keep 6
    assert policy.decide(obs(15, **{"d-a100": po(6, 4400)})).targets["d-a100"] == 6


def test_lookahead_projects_a_rising_trend_and_ignores_a_falling_one() -> None:
    cfg = AutoscalerConfig(
        smoothing=1.0,
        utilization_target=0.8,
        lookahead_s=120,
        trend_smoothing=1.0,
        max_scale_up_step=100,
        scale_down_window_s=0,
    )
    policy = MosaicAutoscaler([decode_pool(hi=64)], cfg)
    policy.decide(obs(0, **{"d-a100": po(3, 1000)}))
    # slope (2,500 − 1,000)/15 s = 100 tok/s²; 120 s ahead: 2,500 + 12,000 = 14,500 / 800 = 18.1 → 19
    assert policy.decide(obs(15, **{"d-a100": po(3, 2500)})).targets["d-a100"] == 19
    # falling: no projection; 1,000 / 800 = 1.25 → 2 (damped: at most 25% of 19 removed → 15)
    assert policy.decide(obs(30, **{"d-a100": po(19, 1000)})).targets["d-a100"] == 15


def test_the_starting_size_holds_scale_in_for_one_window() -> None:
    # One interval's rate at start-up is not evidence of a lull (on the Azure trace it scaled 2+2 → 1+1 at
    # 15 s and missed the SLO for two minutes): the size the policy took over counts as a recommendation.
    policy = MosaicAutoscaler([decode_pool()], CFG)
    # 800 tok/s needs 800/800 = 1 instance, but the window (300 s) still holds the starting 4
    assert policy.decide(obs(0, **{"d-a100": po(4, 800)})).targets["d-a100"] == 4
    assert policy.decide(obs(150, **{"d-a100": po(4, 800)})).targets["d-a100"] == 4
    # after one window: scale in, damped (at most 25% of 4 = 1 per cycle)
    assert policy.decide(obs(301, **{"d-a100": po(4, 800)})).targets["d-a100"] == 3


def test_no_scale_in_within_the_delay_after_an_add() -> None:
    """scale_down_delay_after_add_s: a spike buys an instance at 0 s; demand falls back while it cold-starts
    (ready at 120 s). The window alone (60 s) removes it at 75 s, a cold start paid for nothing; a 240 s
    delay keeps it to 240 s (120 s of service). The window's history is not held meanwhile, so scale-in
    comes right when the delay ends; a worker moving from starting back to ready (provisioned unchanged)
    does not restart the delay."""
    for delay, last_three in ((0.0, 60), (240.0, 225)):
        cfg = dataclasses.replace(CFG, scale_down_window_s=60, scale_down_delay_after_add_s=delay)
        policy = MosaicAutoscaler([decode_pool()], cfg)
        assert policy.decide(obs(0, **{"d-a100": po(2, 2400)})).targets["d-a100"] == 3  # 2,400/800
        targets = {}
        for t in range(15, 400, 15):  # 1,600/800 = 2 from here on; the third is ready from 120 s
            ready, starting = (3, 0) if t >= 120 else (2, 1)
            if t == 180:
                ready, starting = 2, 1  # one worker unhealthy for a cycle (live: counted as starting)
            targets[t] = policy.decide(obs(t, **{"d-a100": po(ready, 1600, starting)})).targets["d-a100"]
        assert max(t for t, n in targets.items() if n == 3) == last_three, (delay, targets)
        assert targets[last_three + 15] == 2


def test_a_one_interval_spike_is_smoothed_but_a_sustained_rise_buys_at_once() -> None:
    smoothed = MosaicAutoscaler(
        [decode_pool()], AutoscalerConfig(utilization_target=0.8, scale_down_window_s=0)
    )
    raw = MosaicAutoscaler(
        [decode_pool()], AutoscalerConfig(smoothing=1.0, utilization_target=0.8, scale_down_window_s=0)
    )
    loads = [2800, 4000, 4000]  # 2,800/800 = 3.5 → 4 instances; 4,000/800 = 5
    got = {
        name: [
            p.decide(obs(i * 15.0, **{"d-a100": po(4, load)})).targets["d-a100"]
            for i, load in enumerate(loads)
        ]
        for name, p in (("smoothed", smoothed), ("raw", raw))
    }
    # smoothed level (α = 0.3): 2,800 → 0.3·4,000 + 0.7·2,800 = 3,160 (needs 3,950 ≤ 4,000: keep 4)
    # → 0.3·4,000 + 0.7·3,160 = 3,412 (needs 4,265 > 4,000: buy the fifth)
    assert got["smoothed"] == [4, 4, 5]
    assert got["raw"] == [4, 5, 5]  # the unsmoothed signal buys on the first sample


def test_an_idle_pool_at_min_zero_reaches_zero_and_a_lone_idle_interval_removes_nothing() -> None:
    """The smoothed level only decays (0.7 per cycle) and any remainder rounds up to one instance: an idle
    `min_replicas: 0` pool stayed at 1 for ever. An idle interval (no token, no arrival, nothing waiting)
    recommends 0; the scale-down window still holds the capacity the load before it needed."""
    cfg = AutoscalerConfig(utilization_target=0.8, scale_down_window_s=60, max_scale_down_fraction=1.0)
    policy = MosaicAutoscaler([decode_pool(lo=0)], cfg)

    def step(t: float, ready: int, load: float) -> int:
        return policy.decide(obs(t, **{"d-a100": po(ready, load)})).targets["d-a100"]

    assert step(0, 2, 1600) == 2  # 1,600 / 800
    assert step(15, 2, 0) == 2  # one idle interval: the window (60 s) holds 2
    assert step(30, 2, 1600) == 2  # and the load resumes on its smoothed level
    targets = {t: step(t, 2, 0.0) for t in range(45, 200, 15)}
    # the last loaded recommendation (30 s) leaves the window after 90 s: zero at the next cycle, not 1
    assert targets[90] == 2 and targets[105] == 0 and set(targets.values()) == {0, 2}


def test_an_interval_without_tokens_is_not_idle_while_something_runs() -> None:
    """A mixed instance busy with one long prefill for a whole interval decodes nothing: not idle (its busy
    fraction, or its prompt tokens), so a window of 0 does not scale it away under its request."""
    cfg = AutoscalerConfig(utilization_target=0.8, scale_down_window_s=0, max_scale_down_fraction=1.0)
    for busy in (
        PoolObservation(ready=1, gpu_utilization=1.0),
        PoolObservation(ready=1, prompt_tokens_per_s=9000.0),
    ):
        policy = MosaicAutoscaler([decode_pool(lo=0)], cfg)
        assert policy.decide(obs(0, **{"d-a100": po(1, 400)})).targets["d-a100"] == 1
        assert policy.decide(obs(15, **{"d-a100": busy})).targets["d-a100"] == 1
    policy = MosaicAutoscaler([decode_pool(lo=0)], cfg)
    assert policy.decide(obs(0, **{"d-a100": po(1, 400)})).targets["d-a100"] == 1
    assert policy.decide(obs(15, **{"d-a100": PoolObservation(ready=1)})).targets["d-a100"] == 0  # idle


def test_backlog_acts_at_once_through_the_smoothing() -> None:
    cfg = AutoscalerConfig(utilization_target=0.8, queue_drain_s=30, default_output_tokens=200)
    policy = MosaicAutoscaler([decode_pool()], cfg)
    assert policy.decide(obs(0, **{"d-a100": po(2, 1600)})).targets["d-a100"] == 2  # 1,600/800 = 2
    # the same token rate (a saturated pool), but 300 requests wait: level 1,600 + 300 · 200 / 30 = 3,600
    # → 3,600 / 800 = 4.5 → 5, in the same cycle
    queued = Observation(
        now=15, pools={"d-a100": po(2, 1600, waiting=100)}, admission_queue={"llama-3-8b": 200}
    )
    assert policy.decide(queued).targets["d-a100"] == 5


def test_smoothing_must_be_a_weight() -> None:
    with pytest.raises(ValueError, match="smoothing"):
        AutoscalerConfig(smoothing=0.0)


# -- the backlog projected to when new capacity is ready (backlog_lead_s) ----------------------------------


def backlog_obs(
    waiting: int, ready: int, starting_in: tuple[float, ...], starting: int | None = None
) -> Observation:
    pool = PoolObservation(
        ready=ready,
        starting=len(starting_in) if starting is None else starting,
        num_waiting=waiting,
        starting_ready_in_s=starting_in,
    )
    # 1 req/s x 100 output tokens: a decode level of 100 tok/s
    return Observation(
        now=15, pools={"d": pool}, request_rate=1.0, mean_input_tokens=50, mean_output_tokens=100
    )


def backlog_demand(lead: float, observation: Observation) -> float:
    cfg = AutoscalerConfig(smoothing=1.0, utilization_target=1.0, queue_drain_s=10.0, backlog_lead_s=lead)
    policy = MosaicAutoscaler([decode_pool("d", tps=50.0, lo=0)], cfg)
    return policy.decide(observation).signal["llama-3-8b/decode_demand_tps"]


def test_without_a_lead_the_backlog_is_the_queue_now() -> None:
    # 10 waiting x 100 tokens = 1,000 tokens over 10 s on top of 100 tok/s
    assert backlog_demand(0.0, backlog_obs(10, 1, (10.0,))) == 100 + 1_000 / 10


def test_the_queue_grows_until_capacity_comes_up() -> None:
    # 1 ready (50 tok/s) against 100 tok/s: +50 tok/s for 10 s until the starting one is up, then flat:
    # 1,000 + 500 = 1,500 tokens at the 30 s lead
    assert backlog_demand(30.0, backlog_obs(10, 1, (10.0,))) == 100 + 1_500 / 10


def test_a_queue_starting_instances_will_clear_buys_nothing_more() -> None:
    # 2 ready (100 tok/s) = the level; 2 more up in 5 s drain 100 tok/s: 1,000 tokens gone by 15 s < 30 s
    assert backlog_demand(30.0, backlog_obs(10, 2, (5.0, 5.0))) == 100


def test_a_starting_instance_without_an_estimate_counts_at_the_lead() -> None:
    # one starting, no ready-time estimate: nothing arrives before the lead, +50 tok/s for 30 s
    assert backlog_demand(30.0, backlog_obs(10, 1, (), starting=1)) == 100 + 2_500 / 10


def test_each_model_is_sized_on_its_own_arrivals_and_latency() -> None:
    """Two models: the fleet-wide rate (10 req/s) would size both; per model, 9 and 1 req/s. Model b's TPOT
    breach boosts b only."""
    a = PoolSpec("a-dec", "a", "decode", "A100-80GB", 3.67, 0, 32, decode_tps_capacity=1000.0)
    b = PoolSpec("b-dec", "b", "decode", "A100-80GB", 3.67, 0, 32, decode_tps_capacity=1000.0)
    cfg = AutoscalerConfig(smoothing=1.0, utilization_target=1.0, tpot_slo_s=0.05)
    observation = Observation(
        now=15,
        pools={"a-dec": PoolObservation(ready=1), "b-dec": PoolObservation(ready=1)},
        request_rate=10.0,
        mean_input_tokens=100,
        mean_output_tokens=100,
        tpot_p90_s=0.2,
        models={
            "a": ModelObservation(9.0, 100, 100, None, 0.04),
            "b": ModelObservation(1.0, 100, 100, None, 0.2),
        },
    )
    decision = MosaicAutoscaler([a, b], cfg).decide(observation)
    assert decision.signal["a/decode_demand_tps"] == 900  # 9 req/s x 100 tokens, no breach
    assert decision.signal["b/decode_demand_tps"] == 100 * 1.2  # 1 x 100, severe breach (> 1.5 x SLO)
    assert decision.targets == {"a-dec": 1, "b-dec": 1}
    # without per-model signals both read the fleet's: 10 x 100 tokens, boosted by the fleet's TPOT
    fleet_wide = MosaicAutoscaler([a, b], cfg).decide(dataclasses.replace(observation, models={}))
    assert fleet_wide.signal["a/decode_demand_tps"] == fleet_wide.signal["b/decode_demand_tps"] == 1000 * 1.2


def test_dynamo_plans_each_model_on_its_own_arrivals() -> None:
    """Two models, each its own decode pool: model-b gets 50 req/s × 100 output tokens = 5,000 tok/s (5
    instances of 1,000), model-a nothing. Before, the fleet-wide rate sized the one cheapest pool across
    both models (model-a's) and left model-b's at its minimum: {dec-a: 5, dec-b: 1}."""
    a = PoolSpec("dec-a", "model-a", "decode", "L4", 1.0, 1, 20, decode_tps_capacity=1000)
    b = PoolSpec("dec-b", "model-b", "decode", "L4", 2.0, 1, 20, decode_tps_capacity=1000)
    planner = DynamoPlanner([a, b], interval_s=15, utilization_target=1.0)
    models = {"model-a": ModelObservation(0.0, 100, 100), "model-b": ModelObservation(50.0, 100, 100)}
    pools = {"dec-a": PoolObservation(ready=1), "dec-b": PoolObservation(ready=1)}
    for t in (0.0, 15.0):
        obs = Observation(
            t, pools, request_rate=50.0, mean_input_tokens=100, mean_output_tokens=100, models=models
        )
        decision = planner.decide(obs)
    assert dict(decision.targets) == {"dec-a": 1, "dec-b": 5}


def test_dynamo_counts_a_pool_held_at_its_size() -> None:
    """The cheapest decode pool is held at 1 (min = max = 1: a pool nobody scales, as the live controller
    pins it): its 2,000 tok/s count, the managed pool buys the other 8,000 (8 of 1,000). Before, the whole
    need went to the held pool, was clamped to 1, and the managed pool stayed at its minimum."""
    held = PoolSpec("static-h100", "m", "decode", "H100", 1.0, 1, 1, decode_tps_capacity=2000)
    managed = PoolSpec("dec-l4", "m", "decode", "L4", 1.0, 1, 20, decode_tps_capacity=1000)
    planner = DynamoPlanner([held, managed], interval_s=15, utilization_target=1.0)
    pools = {"static-h100": PoolObservation(ready=1), "dec-l4": PoolObservation(ready=1)}
    for t in (0.0, 15.0):
        obs = Observation(t, pools, request_rate=100.0, mean_input_tokens=100, mean_output_tokens=100)
        decision = planner.decide(obs)
    assert dict(decision.targets) == {"static-h100": 1, "dec-l4": 8}


def test_found_dynamo_planner_raises_a_pool_under_its_minimum_before_its_first_plan() -> None:
    """Found by tests/cluster/test_sim_properties.py: before its first plan (one interval) and after any
    interval it skips (no request finished), the planner returned the provisioned count as the target,
    even under `min_replicas`; every driver leaves raising such a pool to the policy (`within_bounds`), so
    a fleet starting at 0 with min 1 stayed at 0 under Dynamo (forever when nothing could finish: every
    request failed in the admission queue), where HPA and Mosaic raise it at once."""
    planner = DynamoPlanner([decode_pool(lo=1), prefill_pool(lo=2)], interval_s=180)
    assert planner.decide(dyn_obs(0, 0, 0, 10)).targets == {"d-a100": 1, "p-h100": 2}
    assert planner.decide(dyn_obs(180, 0, 0, 10)).targets == {"d-a100": 1, "p-h100": 2}
