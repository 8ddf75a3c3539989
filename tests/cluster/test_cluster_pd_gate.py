"""Conditional disaggregation in the cluster simulator: under a burst that saturates the one prefill worker
while the decode pool has spare compute, prefilling the overflow on the decode workers cuts TTFT p99."""

from __future__ import annotations

import random
from typing import Any

from scheduler.autoscaler.signals import Observation, ScalingDecision
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import parse_fleet
from simulator.cluster_report import build_report

# A fixed fleet: 1 H100 prefill (27,959 prompt tok/s) and 3 A100 decode (12,020 prompt tok/s each when
# they prefill locally), Llama-3-8B.
FLEET: dict[str, Any] = {
    "model": "llama-3-8b",
    "slo": {"ttft_ms": 2000, "tpot_ms": 100},
    "pools": [
        {"name": "prefill-h100", "gpu": "H100", "role": "prefill", "replicas": 1},
        {"name": "decode-a100", "gpu": "A100-80GB", "role": "decode", "replicas": 3},
    ],
}


def burst(seed: int = 5) -> list[SimRequest]:
    """30 s of Poisson arrivals at 40 req/s, prompts 1,000-1,400 tokens (≈ 48k tok/s: 1.7× the prefill
    worker), short outputs (16-64 tokens), so the decode pool has spare compute for the overflow."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while t < 30.0:
        t += rng.expovariate(40.0)
        out.append(SimRequest(t, rng.randint(1000, 1400), rng.randint(16, 64)))
    return out


def run(gate: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    sim = ClusterSimulator(parse_fleet({**FLEET, "routing": gate}), None, "fixed")
    paths: dict[str, int] = {}
    route = sim.router.route

    def counting(*args: Any, **kwargs: Any) -> Any:
        decision = route(*args, **kwargs)
        path = getattr(decision, "path", "reject")
        paths[path] = paths.get(path, 0) + 1
        return decision

    sim.router.route = counting  # type: ignore[method-assign]
    return build_report(sim.run(burst()), wall_s=1.0), paths


def test_gate_cuts_ttft_p99_under_a_prefill_saturating_burst() -> None:
    off, off_paths = run({})
    on, on_paths = run({"pd_max_prefill_wait_s": 0.5})
    n = len(burst())
    assert off["requests"]["completed"] == on["requests"]["completed"] == n  # every request completes
    # Off, decode-only happens only once the prefill worker is at capacity (demand ≥ 1.5 × 256 requests,
    # ~16 s of queue: measured 107 of 1,228); on, every request that finds the queue over 0.5 s (469).
    assert on_paths["decode-only"] >= 3 * off_paths.get("decode-only", 0)
    # Off, the prefill queue grows by ~20k tok/s for 30 s: the last prompts wait ~16 s (measured p99
    # 15.7 s, 17% within SLO). On, the overflow runs on the decode workers: measured p99 1.8 s, 99.8%.
    p99_off, p99_on = off["latency_ms"]["ttft"]["p99"], on["latency_ms"]["ttft"]["p99"]
    assert p99_off > 5_000, p99_off
    assert p99_on < p99_off / 4, (p99_on, p99_off)
    assert on["slo"]["attainment"] > off["slo"]["attainment"]


def test_gate_run_is_deterministic() -> None:
    assert run({"pd_max_prefill_wait_s": 0.5}) == run({"pd_max_prefill_wait_s": 0.5})


def test_decode_instance_waiting_on_a_slow_transfer_takes_new_work_at_once() -> None:
    # One prefill and one decode instance over a slow link (0.1 GB/s): an 8,000-token prompt's KV
    # (131 KiB/token, 1.05 GB) takes ~10.5 s to land; a 16-token prompt sent 0.5 s later lands in ~0.02 s.
    # The decode instance, idle while it waits for the first transfer, must start the second as soon as it
    # lands: before, it slept until the first transfer's landing and the short request's TTFT was ~10 s.
    fleet = {
        **FLEET,
        "kv_link_gbps": 0.1,
        "pools": [{**FLEET["pools"][0]}, {**FLEET["pools"][1], "replicas": 1}],
    }
    sim = ClusterSimulator(parse_fleet(fleet), None, "fixed")
    result = sim.run([SimRequest(0.0, 8000, 16), SimRequest(0.5, 16, 16)])
    ttft = {r[4]: r[1] for r in result.completed}
    assert 10.0 < ttft[8000] < 12.0
    assert ttft[16] < 0.2


class PrefillOff:
    """Scales the prefill pool to zero at every decision; the decode pool stays."""

    def decide(self, obs: Observation) -> ScalingDecision:
        return ScalingDecision(
            obs.now, {n: 0 if n == "prefill-h100" else po.provisioned for n, po in obs.pools.items()}
        )


def test_a_draining_prefill_instance_retires_when_its_unfetched_hold_times_out() -> None:
    # An 8,000-token prompt's KV over a 0.002 GB/s link takes ~525 s to land; the prefill instance holds
    # its blocks for at most 30 s (the P/D hold timeout) and is told to drain at 10 s. It retires when the
    # hold times out (~30.3 s), not when the decode side's transfer lands: before, nothing woke the idle
    # instance at the expiry and it stayed billed until the landing released the hold (534.6 s in all).
    fleet = {
        **FLEET,
        "kv_link_gbps": 0.002,
        "decision_interval_s": 10,
        "pools": [
            {**FLEET["pools"][0], "replicas": 2, "min_replicas": 0, "max_replicas": 2},
            {**FLEET["pools"][1], "replicas": 1, "min_replicas": 1, "max_replicas": 1},
        ],
    }
    result = ClusterSimulator(parse_fleet(fleet), PrefillOff(), "prefill-off").run(  # type: ignore[arg-type]
        [SimRequest(0.0, 8000, 16)]
    )
    assert result.end_s > 500
    # the idle one retires at 10 s; the holding one at its prefill's end (~0.3 s) + 30 s
    assert 40.0 < result.instance_seconds["H100-SXM"] < 41.0
