"""The simulator brings pools back from zero: arrivals refused or queued for want of a worker still count
as demand at the next decision."""

from __future__ import annotations

from typing import Any

from scheduler.autoscaler.factory import build_policy
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import parse_fleet, pool_specs


def fleet(prefill: int, decode: int) -> dict[str, Any]:
    return {
        "model": "llama-3-8b",
        "slo": {"ttft_ms": 2000, "tpot_ms": 100},
        "cold_start_s": 30,
        "decision_interval_s": 15,
        "pools": [
            {
                "name": "prefill-h100",
                "gpu": "H100",
                "role": "prefill",
                "replicas": prefill,
                "min_replicas": 0,
                "max_replicas": 4,
            },
            {
                "name": "decode-a100",
                "gpu": "A100-80GB",
                "role": "decode",
                "replicas": decode,
                "min_replicas": 0,
                "max_replicas": 4,
            },
        ],
    }


def five_per_second(seconds: int) -> list[SimRequest]:
    return [SimRequest(i / 5, 512, 64) for i in range(5 * seconds)]


def run(data: dict[str, Any], reqs: list[SimRequest]) -> tuple[ClusterSimulator, Any]:
    parsed = parse_fleet(data)
    policy = build_policy(
        "mosaic", pool_specs(parsed), parsed.autoscaler_config(), {p.name: p.replicas for p in parsed.pools}
    )
    sim = ClusterSimulator(parsed, policy, "mosaic")
    return sim, sim.run(reqs)


def test_both_pools_at_zero_scale_up_at_the_first_decision() -> None:
    _, result = run(fleet(0, 0), five_per_second(120))
    first = [e for e in result.scale_events if e["t"] == 15.0]
    assert {e["pool"] for e in first} == {"prefill-h100", "decode-a100"}
    assert all(e["before"] == 0 and e["after"] >= 1 for e in first)
    # the requests that arrived before the instances were ready were held (no worker at all is retryable)
    # and most of the trace is served once they are
    assert len(result.completed) > 0.7 * 600


def test_decode_at_zero_holds_pd_requests_until_it_is_back() -> None:
    """Prefill up, decode at 0: P/D requests wait in the admission queue for the empty decode pool (the
    router's `empty_pool`, retryable) instead of being refused as `wrong_role`; their arrivals bring decode
    back at the first decision and every request is served."""
    _, result = run(fleet(1, 0), five_per_second(120))
    assert result.failed == {}
    assert len(result.completed) == 600
    ups = [e for e in result.scale_events if e["pool"] == "decode-a100" and e["after"] > e["before"]]
    assert ups and ups[0]["t"] == 15.0 and ups[0]["before"] == 0
    # the first request arrived at 0 and waited for decode: bought at 15 s, ready after the 30 s cold start
    first = min(result.completed)
    assert first[0] == 0.0 and 45.0 <= first[1] < 47.0


def test_a_pool_configured_with_max_zero_is_not_waited_for() -> None:
    """`max_replicas: 0` means the pool never has a worker: P/D requests are refused at once, as before."""
    data = fleet(1, 0)
    data["pools"][1]["max_replicas"] = 0
    _, result = run(data, five_per_second(20))
    assert result.failed == {"pool_stays_empty": 100}


def test_without_a_policy_nothing_waits_for_an_empty_pool() -> None:
    """No autoscaler (`fixed`): a pool at zero stays there, so P/D requests are refused at once."""
    parsed = parse_fleet(fleet(1, 0))
    result = ClusterSimulator(parsed, None, "fixed").run(five_per_second(20))
    assert result.failed == {"pool_stays_empty": 100}


def test_idle_pools_go_to_zero_and_come_back() -> None:
    """`min_replicas: 0` pools go to zero once the load has stopped for a scale-down window (the smoothed
    demand only decays, and its remainder rounded up to one instance kept each pool at 1 for ever), and
    come back for the next request, which is served."""
    reqs = [*five_per_second(60), SimRequest(1805.0, 512, 64)]
    _, result = run(fleet(1, 1), reqs)
    assert result.failed == {} and len(result.completed) == 301
    for pool in ("prefill-h100", "decode-a100"):
        events = [e for e in result.scale_events if e["pool"] == pool]
        to_zero = [e["t"] for e in events if e["after"] == 0]
        back = [e["t"] for e in events if e["before"] == 0 and e["after"] > 0]
        assert len(to_zero) == 1 and len(back) == 1, events
        # not before a scale-down window (300 s) of idle recommendations after the load ended at ~60 s
        assert 60 + 300 <= to_zero[0] < 1805 and back[0] == 1815.0
    # the idle stretch is billed for neither pool: about an hour less than two pools at one instance
    assert sum(result.instance_seconds.values()) / 3600 < 0.6
