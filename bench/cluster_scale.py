"""Cluster-simulator scale: a 100,000-request trace over 120 instances (40 prefill H100 + 80 decode A100).

Two runs of 100,000 requests, each reporting simulated requests per wall-second and simulated-time /
wall-time (the speed-up over real time):

- **fixed**: 40 + 80 instances, no autoscaler, no KV ledger, a steady 1,100 req/s; with the same trace on
  a 12-instance fleet at a tenth of the rate as the baseline measured in the same run (the ratio shows how
  cost grows with fleet size, independent of the machine's speed).
- **autoscaled**: the Mosaic policy and the router's KV ledger (`KvLedger` as the reserve plugin, the
  `kv-best-fit` scorer, as `mosaic serve` runs with `kv.enabled`) over a rate that swings 400 → 1,600 →
  400 req/s (a half sine, 80% of the requests) and stays at 400 for the rest, starting from 20 + 40
  instances (max 60 + 120): decisions every 5 s, 30 s cold starts, a 30 s scale-down window and soft
  scale-in, so the figure covers decisions, instances starting, draining and removal, and the ledger's
  reservations. Time is compressed (a real 120 s cold start is about as long as the whole trace at these
  rates); the report gives the peak instance count and the scale events.

Bar (issue 7): 100,000 requests over 100+ instances in under 2 minutes on a 2-core machine.

    python bench/cluster_scale.py [--requests N] [--only fixed|autoscaled]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import append_line, write_result
from scheduler.autoscaler.factory import build_policy
from scheduler.kv.ledger import KvLedger
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import parse_fleet, pool_specs


def fleet(prefill: int, decode: int) -> dict[str, Any]:
    return {
        "model": "llama-3-8b",
        "slo": {"ttft_ms": 2000, "tpot_ms": 100},
        "pools": [
            {
                "name": "prefill-h100",
                "gpu": "H100",
                "role": "prefill",
                "replicas": prefill,
                "max_replicas": prefill,
            },
            {
                "name": "decode-a100",
                "gpu": "A100-80GB",
                "role": "decode",
                "replicas": decode,
                "max_replicas": decode,
            },
        ],
    }


def autoscaled_fleet(prefill: int, decode: int) -> dict[str, Any]:
    return {
        **fleet(prefill, decode),
        "cold_start_s": 30,
        "decision_interval_s": 5,
        "routing": {"policy": "mosaic", "plugins": [{"type": "kv-best-fit"}]},
        "autoscaler": {"utilization_target": 0.8, "pd_ratio": 0.5, "scale_down_window_s": 30},
        "pools": [
            {
                "name": "prefill-h100",
                "gpu": "H100",
                "role": "prefill",
                "replicas": prefill,
                "min_replicas": 1,
                "max_replicas": 3 * prefill,
            },
            {
                "name": "decode-a100",
                "gpu": "A100-80GB",
                "role": "decode",
                "replicas": decode,
                "min_replicas": 1,
                "max_replicas": 3 * decode,
            },
        ],
    }


def trace(n: int, rate: float, seed: int = 1, swing: tuple[float, float] | None = None) -> list[SimRequest]:
    """ShareGPT-like lengths: log-normal prompts (median 600) and outputs (median 180). With `swing` =
    (low, high) the rate follows one half sine from low up to high and back, then stays low (`rate` unused)."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    # the half sine carries 80% of the requests (its mean rate is low + (high − low)·2/π), the rest arrive
    # at the low rate after it, long enough for the scale-down window to release what the peak bought
    span = 0.8 * n / (swing[0] + (swing[1] - swing[0]) * 2 / math.pi) if swing else 0.0
    for _ in range(n):
        if swing:
            low, high = swing
            rate = low + (high - low) * math.sin(math.pi * min(1.0, t / span))
        t += rng.expovariate(rate)
        out.append(
            SimRequest(
                t,
                min(6000, max(4, int(rng.lognormvariate(6.4, 0.9)))),
                min(1500, max(2, int(rng.lognormvariate(5.2, 0.8)))),
            )
        )
    return out


def measure(n: int, rate: float, prefill: int, decode: int) -> dict[str, Any]:
    reqs = trace(n, rate)
    sim = ClusterSimulator(parse_fleet(fleet(prefill, decode)), None, "fixed")
    started = time.perf_counter()
    result = sim.run(reqs)
    wall = time.perf_counter() - started
    return {
        "requests": n,
        "instances": prefill + decode,
        "rate": rate,
        "wall_s": round(wall, 2),
        "simulated_s": round(result.end_s, 1),
        "completed": len(result.completed),
        "sim_requests_per_wall_s": round(n / wall, 1),
        "speedup_vs_real_time": round(result.end_s / wall, 2),
    }


def measure_autoscaled(n: int, swing: tuple[float, float], prefill: int, decode: int) -> dict[str, Any]:
    """The Mosaic policy and the KV ledger in the loop (module docstring)."""
    reqs = trace(n, 0.0, swing=swing)
    cfg = parse_fleet(autoscaled_fleet(prefill, decode))
    policy = build_policy(
        "mosaic", pool_specs(cfg), cfg.autoscaler_config(), {p.name: p.replicas for p in cfg.pools}
    )
    ledger = KvLedger()
    sim = ClusterSimulator(cfg, policy, "mosaic", reserve=[ledger])
    started = time.perf_counter()
    result = sim.run(reqs)
    wall = time.perf_counter() - started
    events = result.scale_events
    peak = max(sum(v for k, v in row.items() if k != "t") for row in result.replicas)
    return {
        "requests": n,
        "rate_swing": list(swing),
        "start_instances": prefill + decode,
        "peak_instances": peak,
        "instances_started": sum(max(0, e["after"] - e["before"]) for e in events),
        "instances_scaled_in": sum(max(0, e["before"] - e["after"]) for e in events),
        "scale_events": len(events),
        "decisions": len(result.replicas) - 1,
        "ledger_reservations_refused": ledger.stats.refused,
        "wall_s": round(wall, 2),
        "simulated_s": round(result.end_s, 1),
        "completed": len(result.completed),
        "failed": sum(result.failed.values()),
        "aborted_by_scale_in": result.aborted_by_scale_in,
        "sim_requests_per_wall_s": round(n / wall, 1),
        "speedup_vs_real_time": round(result.end_s / wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--only", choices=("fixed", "autoscaled"), help="run one of the two (default: both)")
    args = parser.parse_args()
    payload: dict[str, Any] = {"bar_s": 120}
    lines = []
    if args.only != "autoscaled":
        # ~60% of the big fleet's decode capacity: 80 A100s · ~5.7k tok/s · 0.6 / ~250 output tokens ≈ 1,100 req/s
        big = measure(args.requests, 1100.0, 40, 80)
        small = measure(args.requests // 10, 110.0, 4, 8)
        ratio = round(big["sim_requests_per_wall_s"] / small["sim_requests_per_wall_s"], 3)
        payload.update(
            {
                "big": big,
                "baseline_small": small,
                "per_request_speed_ratio": ratio,
                "meets_bar": big["wall_s"] < 120,
            }
        )
        lines.append(
            f"fixed: {big['requests']} req over {big['instances']} instances in {big['wall_s']} s wall "
            f"({big['sim_requests_per_wall_s']} req/s, {big['speedup_vs_real_time']}x real time); "
            f"per-request speed vs 12 instances: {ratio}x"
        )
        print(big, small, ratio)
    if args.only != "fixed":
        auto = measure_autoscaled(args.requests, (400.0, 1600.0), 20, 40)
        payload.update({"autoscaled": auto, "autoscaled_meets_bar": auto["wall_s"] < 120})
        lines.append(
            f"Mosaic autoscaler + KV ledger: {auto['requests']} req, {auto['start_instances']} → "
            f"peak {auto['peak_instances']} instances ({auto['instances_started']} started, "
            f"{auto['instances_scaled_in']} scaled in, {auto['decisions']} decisions) in {auto['wall_s']} s "
            f"wall ({auto['sim_requests_per_wall_s']} req/s)"
        )
        print(auto)
    name = "cluster_scale" if args.only is None else f"cluster_scale_{args.only}"
    write_result(name, payload)
    command = f"python bench/cluster_scale.py --requests {args.requests}" + (
        f" --only {args.only}" if args.only else ""
    )
    append_line(name, command, "; ".join(lines))


if __name__ == "__main__":
    main()
