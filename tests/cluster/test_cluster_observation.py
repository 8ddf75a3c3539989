"""The simulator's `Observation` is measured as the live gateway measures it (`server.gateway_signals`).

Request rate from arrivals; mean input/output lengths from requests *completed* in the interval (the gateway
learns them from the worker's `usage` when a request finishes): a trace request's output length is not
known at its arrival, so requests still in flight must not move the observed means.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from scheduler.autoscaler.signals import Observation, ScalingDecision
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import parse_fleet

FLEET = {
    "model": "llama-3-8b",
    "slo": {"ttft_ms": 3000, "tpot_ms": 100},
    "decision_interval_s": 10,
    "pools": [
        {
            "name": "mixed-h100",
            "gpu": "H100",
            "role": "mixed",
            "replicas": 2,
            "min_replicas": 2,
            "max_replicas": 2,
        },
    ],
}
SHORT_IN, SHORT_OUT = 100, 10
LONG_IN, LONG_OUT = 2000, 3000


@dataclass
class Recorder:
    """A policy that never changes the fleet and keeps every observation it is shown."""

    seen: list[Observation] = field(default_factory=list)

    def decide(self, obs: Observation) -> ScalingDecision:
        self.seen.append(obs)
        return ScalingDecision(obs.now, {name: po.provisioned for name, po in obs.pools.items()})


def simulate(requests: list[SimRequest]) -> tuple[dict[float, Observation], ClusterSimulator]:
    rec = Recorder()
    sim = ClusterSimulator(parse_fleet(FLEET), rec, "recorder")  # type: ignore[arg-type]
    sim.run(requests)
    return {round(o.now, 6): o for o in rec.seen}, sim


def test_in_flight_long_outputs_do_not_move_the_observed_means() -> None:
    # short requests (100 in, 10 out) at 4/s for 40 s; at 21 s a burst of 20 requests of 2,000 in and
    # 3,000 out, which take far longer than the 9 s left to the decision at 30 s to complete
    # (one more short request at 60 s keeps decisions coming until the burst has completed)
    short = [SimRequest(0.25 * i, SHORT_IN, SHORT_OUT) for i in range(160)] + [
        SimRequest(60.0, SHORT_IN, SHORT_OUT)
    ]
    burst = [SimRequest(21.0 + 0.01 * i, LONG_IN, LONG_OUT) for i in range(20)]
    obs, sim = simulate(sorted(short + burst, key=lambda r: r.arrival_s))
    at30 = obs[30.0]
    # arrivals count at once (the gateway's request rate is `requests_received`): 40 short + 20 long in 10 s
    assert at30.request_rate == pytest.approx(6.0)
    # ... but only completed requests give lengths: the burst, not yet finished, is invisible in them
    assert at30.mean_output_tokens == pytest.approx(SHORT_OUT)
    assert at30.mean_input_tokens == pytest.approx(SHORT_IN)
    assert not any(r[0] >= 21.0 and r[5] == LONG_OUT and r[0] + r[3] <= 30.0 for r in sim.result.completed)
    # once the burst completes, its lengths show, in the interval it completes in
    assert any(o.mean_output_tokens > SHORT_OUT for t, o in obs.items() if t > 30.0)
    done_long = sum(1 for r in sim.result.completed if r[5] == LONG_OUT)
    assert done_long == 20


def test_an_interval_with_no_completion_observes_no_lengths() -> None:
    # only long requests, all arriving in the first interval: none completes by 10 s, so the means are the
    # "not observed" 0.0 (the gateway omits them and policies fall back to their defaults or keep the last)
    # (they take ~26 s; a short request at 45 s keeps decisions coming past their completion)
    tail = [SimRequest(45.0, SHORT_IN, SHORT_OUT)]
    obs, _ = simulate([SimRequest(1.0 + 0.1 * i, LONG_IN, LONG_OUT) for i in range(10)] + tail)
    at10 = obs[10.0]
    assert at10.request_rate == pytest.approx(1.0)
    assert (at10.mean_input_tokens, at10.mean_output_tokens) == (0.0, 0.0)
    later = [o for t, o in sorted(obs.items()) if o.mean_output_tokens]
    assert later and later[0].mean_output_tokens == pytest.approx(LONG_OUT)
    assert later[0].mean_input_tokens == pytest.approx(LONG_IN)


@dataclass
class GrowOnce:
    """Adds two instances at the first decision, then holds; keeps every observation."""

    seen: list[Observation] = field(default_factory=list)

    def decide(self, obs: Observation) -> ScalingDecision:
        self.seen.append(obs)
        grow = 2 if len(self.seen) == 1 else 0
        return ScalingDecision(obs.now, {name: po.provisioned + grow for name, po in obs.pools.items()})


def test_starting_instances_carry_their_expected_ready_time() -> None:
    data = {
        **FLEET,
        "cold_start_s": 45,
        "pools": [{**FLEET["pools"][0], "min_replicas": 1, "max_replicas": 4}],
    }
    policy = GrowOnce()
    ClusterSimulator(parse_fleet(data), policy, "grow-once").run(  # type: ignore[arg-type]
        [SimRequest(0.5 * i, SHORT_IN, SHORT_OUT) for i in range(200)]
    )
    by_time = {round(o.now, 6): o.pools["mixed-h100"] for o in policy.seen}
    # bought at 10 s with a 45 s cold start: ready at 55 s
    assert by_time[10.0].starting_ready_in_s == ()
    assert by_time[20.0].starting == 2 and by_time[20.0].starting_ready_in_s == (35.0, 35.0)
    assert by_time[50.0].starting_ready_in_s == (5.0, 5.0)
    assert by_time[60.0].starting == 0 and by_time[60.0].ready == 4


def test_ttft_is_observed_at_the_first_token_not_at_completion() -> None:
    # one request of 3,000 output tokens (~22 s of decode) at 1 s: its first token comes within the first
    # interval, its completion two intervals later (a short request at 45 s keeps decisions coming)
    obs, sim = simulate([SimRequest(1.0, SHORT_IN, LONG_OUT), SimRequest(45.0, SHORT_IN, SHORT_OUT)])
    (_, ttft, _, e2e, _, _) = next(r for r in sim.result.completed if r[5] == LONG_OUT)
    assert 10.0 < 1.0 + e2e < 30.0
    # the gateway times TTFT on the first byte relayed: the latency net sees it while the request decodes
    assert obs[10.0].ttft_p90_s == pytest.approx(ttft)
    assert obs[10.0].mean_output_tokens == 0.0  # not completed: no lengths yet
    done = next(o for t, o in sorted(obs.items()) if o.mean_output_tokens == LONG_OUT)
    assert done.ttft_p90_s is None  # counted once, when it was observed


@dataclass
class ShrinkOnce:
    """Scales every pool in by one at the first decision, then holds; keeps every observation."""

    seen: list[Observation] = field(default_factory=list)

    def decide(self, obs: Observation) -> ScalingDecision:
        self.seen.append(obs)
        shrink = 1 if len(self.seen) == 1 else 0
        return ScalingDecision(obs.now, {name: po.provisioned - shrink for name, po in obs.pools.items()})


def test_gpu_utilization_averages_the_ready_instances_only() -> None:
    # Two instances, each with one request in flight at 10 s: A (1,600 output tokens from 0 s, done ~12 s)
    # and B (1,500 from 8 s, done ~19 s; the two short requests at 0.1 and 0.2 s put it on the other
    # instance). Scaling in at 10 s drains B (tie on in-flight requests, then by id): busy for ~9 s more,
    # but draining, so the HPA's average over ready pods leaves it out. A alone is ready and busy ~1.8 s of
    # the 10. Before, the pool's busy time over the ready count read (9 + 1.8) / 10, clamped to 1.0.
    data = {**FLEET, "pools": [{**FLEET["pools"][0], "min_replicas": 1}]}
    policy = ShrinkOnce()
    sim = ClusterSimulator(parse_fleet(data), policy, "shrink-once")  # type: ignore[arg-type]
    sim.run(
        [
            SimRequest(0.0, SHORT_IN, 1600),
            SimRequest(0.1, SHORT_IN, SHORT_OUT),
            SimRequest(0.2, SHORT_IN, SHORT_OUT),
            SimRequest(8.0, SHORT_IN, 1500),
            SimRequest(45.0, SHORT_IN, SHORT_OUT),
        ]
    )
    done = {r[5]: r[0] + r[3] for r in sim.result.completed}
    assert 10.0 < done[1600] < 13.0 and 17.0 < done[1500] < 20.0
    at20 = {round(o.now, 6): o for o in policy.seen}[20.0].pools["mixed-h100"]
    assert at20.ready == 1
    assert at20.gpu_utilization == pytest.approx((done[1600] - 10.0) / 10.0, abs=0.01)


def test_gpu_utilization_weighs_an_instance_by_the_time_it_was_ready() -> None:
    """1 → 2 instances at 10 s with a 5 s cold start, under a flood that keeps every ready instance busy:
    at 20 s both were busy all the time they were ready, so the pool reads 1.0 (as the live reader's busy
    scrapes over ready scrapes). Counting the new one as ready for the whole interval read 0.75."""
    data = {
        **FLEET,
        "cold_start_s": 5,
        "pools": [{**FLEET["pools"][0], "replicas": 1, "min_replicas": 1, "max_replicas": 2}],
    }
    policy = GrowOnce()  # +2 at the first decision, bounded by max_replicas 2
    ClusterSimulator(parse_fleet(data), policy, "grow-once").run(  # type: ignore[arg-type]
        [SimRequest(i * 0.025, 500, 400) for i in range(1600)]
    )
    at20 = {round(o.now, 6): o for o in policy.seen}[20.0].pools["mixed-h100"]
    assert at20.ready == 2
    assert at20.gpu_utilization == pytest.approx(1.0, abs=0.01)
