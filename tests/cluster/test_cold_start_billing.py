"""Cold starts are billed: an instance is paid for from the decision that bought it, whether it is cancelled
while still starting or becomes ready late. And the simulator clamps a policy's targets to the pool bounds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from scheduler.autoscaler.baselines import StaticPolicy
from scheduler.autoscaler.signals import Observation, ScalingDecision
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import parse_fleet

POOL = "mixed-a100"


def fleet(replicas: int = 1, min_replicas: int = 1, max_replicas: int = 3) -> dict[str, Any]:
    return {
        "model": "llama-3-8b",
        "slo": {"ttft_ms": 2000, "tpot_ms": 100},
        "cold_start_s": 60,
        "decision_interval_s": 10,
        "pools": [
            {
                "name": POOL,
                "gpu": "A100-80GB",
                "role": "mixed",
                "replicas": replicas,
                "min_replicas": min_replicas,
                "max_replicas": max_replicas,
            }
        ],
    }


# small requests every 5 s until 150 s keep the decisions coming
TRICKLE = [SimRequest(5.0 * k, 100, 10) for k in range(31)]


class Scripted:
    """Targets by decision time; the current count otherwise."""

    def __init__(self, script: Mapping[float, int]) -> None:
        self.script = dict(script)

    def decide(self, obs: Observation) -> ScalingDecision:
        po = obs.pools[POOL]
        return ScalingDecision(obs.now, {POOL: self.script.get(round(obs.now, 3), po.provisioned)})


def test_cancelled_and_late_instances_are_billed_from_their_start() -> None:
    # 10 s: buy one (cold until 70 s); 20 s: cancel it while starting; 30 s: buy one again (ready at 90 s)
    sim = ClusterSimulator(parse_fleet(fleet()), Scripted({10.0: 2, 20.0: 1, 30.0: 2}), "scripted")
    result = sim.run(TRICKLE)
    assert result.scale_events == [
        {"t": 10.0, "pool": POOL, "before": 1, "after": 2},
        {"t": 20.0, "pool": POOL, "before": 2, "after": 1},
        {"t": 30.0, "pool": POOL, "before": 1, "after": 2},
    ]
    assert sum(result.failed.values()) == 0
    end = result.end_s
    assert end > 90  # the second one became ready and served before the end
    created = sorted((i.created, i.removed) for i in sim._instances.values())
    assert created == [(0.0, end), (10.0, 20.0), (30.0, end)]
    # the initial instance for the whole run + 10 s of the cancelled one + the late one from 30 s
    expected = end + 10.0 + (end - 30.0)
    assert result.instance_seconds == {"A100-80GB": pytest.approx(expected, abs=1e-9)}
    assert result.billed_seconds == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    ("replicas", "keep", "events"),
    [
        pytest.param(1, -3, [], id="a negative count at min_replicas: nothing to do"),
        pytest.param(
            2, -3, [{"t": 10.0, "pool": POOL, "before": 2, "after": 1}], id="a negative count: down to min"
        ),
        pytest.param(2, 0, [{"t": 10.0, "pool": POOL, "before": 2, "after": 1}], id="zero below min=1: min"),
        pytest.param(
            1, 10, [{"t": 10.0, "pool": POOL, "before": 1, "after": 3}], id="above max_replicas: up to max"
        ),
    ],
)
def test_targets_are_clamped_to_the_pool_bounds(replicas: int, keep: int, events: list[dict]) -> None:
    sim = ClusterSimulator(parse_fleet(fleet(replicas=replicas)), StaticPolicy({POOL: keep}), "static")
    result = sim.run(TRICKLE)
    assert result.scale_events == events
    counts = [r[POOL] for r in result.replicas]
    assert min(counts) >= 1 and max(counts) <= 3


def test_a_pool_below_min_is_not_raised_past_the_target() -> None:
    # replicas 0 under min_replicas 1 with a target of -3: nothing is bought (a scale-up is placed by the
    # topology for the target; the clamp only stops a scale-in below min and anything above max)
    sim = ClusterSimulator(parse_fleet(fleet(replicas=0)), StaticPolicy({POOL: -3}), "static")
    result = sim.run([SimRequest(0.0, 100, 10)])
    assert result.scale_events == []
