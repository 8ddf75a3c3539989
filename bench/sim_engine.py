"""Engine model speed: simulated engine steps per wall-second and simulated time / wall time.

1,000 requests on one H100 Llama-3-8B engine (vLLM defaults: max_num_seqs 256, 8,192 tokens per step,
block 16), ShareGPT-like lengths: prompts log-normal (mean ≈ 205 tokens, capped at 2,048), outputs at the
engine's natural EOS law (gamma, mean 204) under max_tokens 2,048. Two arrival patterns:

- burst: all 1,000 at t = 0 (the batch stays full: the heaviest steps);
- poisson: 20 requests/s (about 70% of this engine's throughput on that mix).

Each scenario runs `--repeat` times; the median wall time is reported, with the median CPU time of the
process beside it (on a shared machine, wall time includes waiting for a core; the load average at the
start is recorded). Target (issue 2): ≥ 1,000× real time.
Writes bench/results/sim_engine.json and one line in BENCHMARKS.md.

    .venv/bin/python bench/sim_engine.py [--requests 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import append_line, write_result
from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from simulator.engine import Engine, EngineConfig, run_offline
from simulator.requests import EngineRequest


def workload(n: int, rate: float | None, seed: int = 0) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        prompt = min(2048, max(4, round(rng.lognormvariate(4.75, 1.0))))  # mean e^(4.75 + 0.5) ≈ 190 → ≈ 205
        out.append((t, EngineRequest(f"r{i}", prompt, 2048)))
        if rate:
            t += rng.expovariate(rate)
    return out


def run(n: int, rate: float | None, repeat: int) -> dict[str, Any]:
    catalog = load_catalog()
    perf = PerfModel(catalog.gpu("H100"), catalog.model("llama-3-8b"))
    walls, cpus, result = [], [], {}
    for _ in range(repeat):
        arrivals = workload(n, rate)
        engine = Engine(perf, EngineConfig(), seed=0)
        t0, c0 = time.perf_counter(), time.process_time()
        records = run_offline(engine, arrivals)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        walls.append(wall)
        cpus.append(cpu)
        c = engine.counters
        sim = max(r.finished for r in records)
        result = {
            "requests": len(records), "steps": c.steps, "sim_seconds": round(sim, 3),
            "generated_tokens": c.generation_tokens, "prompt_tokens": c.prompt_tokens, "preemptions": c.preemptions,
            "mean_ttft_s": round(statistics.mean(r.ttft for r in records), 4),  # type: ignore[misc]
        }  # fmt: skip
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    result.update(
        wall_seconds=round(wall, 4),
        wall_seconds_all=[round(w, 4) for w in walls],
        cpu_seconds=round(cpu, 4),
        steps_per_wall_s=round(result["steps"] / wall),
        sim_over_wall=round(result["sim_seconds"] / wall, 1),
        sim_over_cpu=round(result["sim_seconds"] / cpu, 1),
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    scenarios = {
        "burst": run(args.requests, None, args.repeat),
        "poisson_20rps": run(args.requests, 20.0, args.repeat),
    }
    payload = {"load_average_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count(), "gpu": "H100-SXM", "model": "llama-3-8b", "engine": "EngineConfig() defaults", "scenarios": scenarios,
               "target_sim_over_wall": 1000}  # fmt: skip
    path = write_result("sim_engine", payload)
    for name, s in scenarios.items():
        print(f"{name:>14}: {s['requests']} req, {s['steps']} steps, {s['sim_seconds']:.1f} s simulated in "
              f"{s['wall_seconds']:.3f} s wall ({s['cpu_seconds']:.3f} s CPU) → {s['steps_per_wall_s']:,} steps/s, "
              f"{s['sim_over_wall']:,}× real time ({s['sim_over_cpu']:,}× per CPU second)")  # fmt: skip
    b, p = scenarios["burst"], scenarios["poisson_20rps"]
    cmd = " ".join(["python bench/sim_engine.py", *sys.argv[1:]])
    append_line(
        "sim_engine", cmd,
        f"{args.requests} req on one H100 llama-3-8b engine: burst {b['sim_over_wall']:,}× real time "
        f"({b['steps_per_wall_s']:,} steps/s; {b['sim_over_cpu']:,}× per CPU s), Poisson 20 req/s "
        f"{p['sim_over_wall']:,}× ({p['steps_per_wall_s']:,} steps/s; {p['sim_over_cpu']:,}× per CPU s); target ≥ "
        f"1,000×; load avg {payload['load_average_1m']} on {payload['cpu_count']} cores",
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
