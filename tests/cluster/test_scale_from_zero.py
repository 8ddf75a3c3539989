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


def test_decode_at_zero_refused_requests_still_count_as_arrivals() -> None:
    """Prefill up, decode at 0: the router refuses P/D requests at once (no_worker_for_role, not
    retryable), so nothing queues; the refused arrivals alone must bring decode back."""
    _, result = run(fleet(1, 0), five_per_second(120))
    assert result.failed.get("wrong_role", 0) > 0  # refused at once, before decode came back
    ups = [e for e in result.scale_events if e["pool"] == "decode-a100" and e["after"] > e["before"]]
    assert ups and ups[0]["t"] == 15.0 and ups[0]["before"] == 0
    assert len(result.completed) > 0.5 * 600
