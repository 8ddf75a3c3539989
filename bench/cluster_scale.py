"""Cluster-simulator scale: a 100,000-request trace over 120 instances (40 prefill H100 + 80 decode A100).

Reports simulated requests per wall-second and simulated-time / wall-time (the speed-up over real time),
with the same trace replayed on a 12-instance fleet at a tenth of the rate as the baseline measured in
the same run (so the ratio shows how cost grows with fleet size, independent of the machine's speed).
Bar (issue 7): 100,000 requests over 100+ instances in under 2 minutes on a 2-core machine.

    python bench/cluster_scale.py [--requests N]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import append_line, write_result
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import parse_fleet


def fleet(prefill: int, decode: int) -> dict[str, Any]:
    return {
        "model": "llama-3-8b",
        "slo": {"ttft_ms": 2000, "tpot_ms": 100},
        "pools": [
            {"name": "prefill-h100", "gpu": "H100", "role": "prefill", "replicas": prefill,
             "max_replicas": prefill},
            {"name": "decode-a100", "gpu": "A100-80GB", "role": "decode", "replicas": decode, "max_replicas": decode},
        ],
    }


def trace(n: int, rate: float, seed: int = 1) -> list[SimRequest]:
    """ShareGPT-like lengths: log-normal prompts (median 600) and outputs (median 180)."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, min(6000, max(4, int(rng.lognormvariate(6.4, 0.9)))),
                              min(1500, max(2, int(rng.lognormvariate(5.2, 0.8))))))
    return out


def measure(n: int, rate: float, prefill: int, decode: int) -> dict[str, Any]:
    reqs = trace(n, rate)
    sim = ClusterSimulator(parse_fleet(fleet(prefill, decode)), None, "fixed")
    started = time.perf_counter()
    result = sim.run(reqs)
    wall = time.perf_counter() - started
    return {
        "requests": n, "instances": prefill + decode, "rate": rate, "wall_s": round(wall, 2),
        "simulated_s": round(result.end_s, 1), "completed": len(result.completed),
        "sim_requests_per_wall_s": round(n / wall, 1), "speedup_vs_real_time": round(result.end_s / wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args()
    # ~60% of the big fleet's decode capacity: 80 A100s · ~5.7k tok/s · 0.6 / ~250 output tokens ≈ 1,100 req/s
    big = measure(args.requests, 1100.0, 40, 80)
    small = measure(args.requests // 10, 110.0, 4, 8)
    ratio = round(big["sim_requests_per_wall_s"] / small["sim_requests_per_wall_s"], 3)
    write_result("cluster_scale", {"big": big, "baseline_small": small, "per_request_speed_ratio": ratio,
                                   "bar_s": 120, "meets_bar": big["wall_s"] < 120})
    append_line("cluster_scale", f"python bench/cluster_scale.py --requests {args.requests}",
                f"{big['requests']} req over {big['instances']} instances in {big['wall_s']} s wall "
                f"({big['sim_requests_per_wall_s']} req/s, {big['speedup_vs_real_time']}x real time); "
                f"per-request speed vs 12 instances: {ratio}x")
    print(big, small, ratio)


if __name__ == "__main__":
    main()
