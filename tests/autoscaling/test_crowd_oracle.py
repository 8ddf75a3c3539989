"""`bench/autoscale_eval.py --crowd-oracle`: the bound it measures is what an oracle that knows the flash
crowd would stand up — the prefill its busiest minute needs, from one cold start before it to its end —
applied on top of the policy's own decisions, nothing else changed."""

from __future__ import annotations

import math

from bench.autoscale_eval import FLEET, crowd_oracle, flash_crowd, with_crowd_oracle
from scheduler.autoscaler.signals import Observation, PoolObservation, ScalingDecision
from simulator.cluster import SimRequest
from simulator.cluster_config import parse_fleet, pool_specs


def test_the_oracle_holds_what_the_crowds_busiest_minute_needs_from_a_cold_start_before_it() -> None:
    fleet = parse_fleet(FLEET)
    cap = next(s for s in pool_specs(fleet) if s.role == "prefill").prefill_tps_capacity
    crowd = flash_crowd(quick=False)
    busiest = 2.4 * cap * 60  # prompt tokens in the crowd's second minute: 2.4 instances' worth
    reqs = [
        SimRequest(crowd.start_s - 1, 10**6, 10),  # before the crowd: not counted however large
        SimRequest(crowd.start_s + 5, int(cap * 60), 10),  # first minute: one instance's worth
        SimRequest(crowd.start_s + 70, int(busiest / 2), 10),
        SimRequest(crowd.start_s + 100, int(busiest / 2), 10),
        SimRequest(crowd.start_s + crowd.duration_s, 10**6, 10),  # after its end
    ]
    oracle = crowd_oracle(fleet, reqs, quick=False)
    assert oracle == {
        "pool": "prefill-h100",
        "count": math.ceil(2.4 - 1e-9),
        "from_s": crowd.start_s - 120,  # the fleet's cold start
        "to_s": crowd.start_s + crowd.duration_s,
    }


class _Fixed:
    def decide(self, obs: Observation) -> ScalingDecision:
        return ScalingDecision(obs.now, {"prefill-h100": 1, "decode-a100": 2}, {"prefill-h100": "why"})


def test_the_oracle_raises_only_its_pool_and_only_inside_its_window() -> None:
    oracle = {"pool": "prefill-h100", "count": 3, "from_s": 100.0, "to_s": 200.0}
    policy = with_crowd_oracle(_Fixed(), oracle)
    pools = {"prefill-h100": PoolObservation(ready=1), "decode-a100": PoolObservation(ready=2)}
    seen = {t: policy.decide(Observation(t, pools)).targets for t in (99.0, 100.0, 150.0, 200.0, 201.0)}
    assert seen == {
        99.0: {"prefill-h100": 1, "decode-a100": 2},
        100.0: {"prefill-h100": 3, "decode-a100": 2},
        150.0: {"prefill-h100": 3, "decode-a100": 2},
        200.0: {"prefill-h100": 3, "decode-a100": 2},
        201.0: {"prefill-h100": 1, "decode-a100": 2},
    }
    assert policy.decide(Observation(150.0, pools)).reasons == {"prefill-h100": "why"}  # kept as they were
