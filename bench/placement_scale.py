"""Placement solver scale: Mosaic's symmetry-free model vs Mélange's binary-slice ILP (PuLP + CBC).

    .venv/bin/python bench/placement_scale.py [--cbc-time-limit 20] [--quick] [--spread-seeds 40]

Instances (GPU types × buckets × slice factor, up to 12 × 100 × 16) are derived from Mosaic's roofline perf
model for Llama-3-8B at a 120 ms TPOT SLO (Mélange's loose SLO): for each (GPU, tp) option and bucket (its upper lengths), the
largest decode batch B whose step stays within 0.8 · TPOT and whose contexts fit the KV cache, giving
rate = 1 / (prefill(in) + out · step(B) / B) req/s, times a seeded ±10 % profiling noise. Prices are the
catalog's $/GPU-h times a seeded factor in [0.5, 1.5] (prices differ by provider; it also keeps one type from
dominating every instance), × tp per instance. Demand: a seeded, heavy-tailed histogram (most requests short) at a fixed total rate. Buckets
no option serves get no demand (counted in the JSON).

For every instance, in one run:
- Mosaic sliced (the same model as Mélange, integer slice counts) with engine cp-sat (LP branch and bound on
  the counts, CP-SAT fit checks, CP-SAT fallback: placement/engine_pipeline.py) and with engine scip;
- Mosaic continuous with engine auto (the same count search, SCIP behind it) and on SCIP alone;
- Mélange's own formulation (one binary per (slice, GPU type), as melange-release/melange/solver.py writes
  it, binaries only where the throughput is > 0 so CBC is not handed divisions by zero) on CBC with a limit.
Bars (issue 5): the same or a lower cost everywhere; at 36 buckets × 4 types × slice factor 4 Mosaic proves
optimality in < 100 ms where the binary formulation runs to its time limit; the largest instance < 2 s.
Then Mosaic alone on --spread-seeds (40) more 36 × 4 × 4 seeds: the CPU-time median, p90 and max, so four
seeds cannot pass for reliability. Times are reported as wall and as process CPU time (all threads): the dev machine's 2 cores are shared, so
the CPU figure is the one that does not depend on other people's load; bars are checked on both.
Writes bench/results/placement_scale.json and appends one line to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pulp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from placement.binpacking import Demand, GpuOffer, InstanceOption, MixProblem, Variant  # noqa: E402
from placement.catalog import load_catalog  # noqa: E402
from placement.perf_model import PerfModel  # noqa: E402
from placement.solver import solve_mix  # noqa: E402

# (GPU, tp) options in the order instances take them: Mélange's four first, then the rest of the catalog.
OPTIONS = [
    ("A10G", 1),
    ("A100-80GB", 1),
    ("H100-SXM", 1),
    ("L4", 1),
    ("L40S", 1),
    ("A40", 1),
    ("A100-40GB", 1),
    ("H200", 1),
    ("T4", 2),
    ("A10G", 2),
    ("L4", 2),
    ("L40S", 2),
    ("A100-80GB", 2),
    ("H100-SXM", 2),
]
# (types, input buckets, output buckets, slice factor, seeds)
SIZES = [
    (2, 2, 2, 1, 1),
    (4, 6, 6, 4, 4),
    (4, 6, 6, 16, 1),
    (8, 8, 8, 8, 1),
    (12, 10, 10, 4, 1),
    (12, 10, 10, 16, 2),
]
QUICK_SIZES = [(2, 2, 2, 1, 1), (4, 6, 6, 4, 1), (12, 10, 10, 16, 1)]
TPOT_S = 0.120
TOTAL_RATE = 150.0  # req/s


def edges(n: int, top: int) -> list[int]:
    """n log-spaced buckets over [1, top]; 6 buckets reproduce Mélange's profiling grid 25 … 2000."""
    if n == 6 and top == 2000:
        return [1, 26, 101, 251, 501, 1001, 2001]
    pts = sorted({round(16 * (top / 16) ** (i / (n - 1))) for i in range(n)})
    return [1, *(p + 1 for p in pts)]


def max_rate(perf: PerfModel, kv_tokens: int, inp: int, out: int) -> float:
    """req/s one instance sustains for (inp, out) within the TPOT SLO (see the module docstring)."""
    ctx = inp + out // 2
    cap = min(256, kv_tokens // (inp + out))
    lo, hi = 0, cap
    while lo < hi:  # largest batch whose decode step stays under 0.8 · TPOT
        mid = (lo + hi + 1) // 2
        if perf.step_time_totals(0, 0.0, mid, mid * ctx, mid) <= 0.8 * TPOT_S:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return 0.0
    step = perf.step_time_totals(0, 0.0, lo, lo * ctx, lo)
    return 1.0 / (perf.prefill_time([inp]) + out * step / lo)


def make_instance(n_types: int, n_in: int, n_out: int, seed: int) -> tuple[MixProblem, int]:
    rng = random.Random(seed * 1000 + n_types * 100 + n_in)
    catalog = load_catalog()
    model = catalog.model("llama-3-8b")
    ins = edges(n_in, 2000 if n_in <= 6 else 8192)
    outs = edges(n_out, 2000 if n_out <= 6 else 2048)
    gpus: dict[str, GpuOffer] = {}
    options = []
    for gpu_name, tp in OPTIONS[:n_types]:
        gpu = catalog.gpu(gpu_name)
        perf = PerfModel(gpu, model, tp)
        kv = perf.kv_capacity_tokens() if perf.fits() else 0
        # prices differ by provider and month: each instance draws its own within ±50 % of the catalog's
        gpus.setdefault(gpu.name, GpuOffer(gpu.name, round(gpu.cost_per_hour * rng.uniform(0.5, 1.5), 2)))
        rates = tuple(
            round(max_rate(perf, kv, ins[i + 1] - 1, outs[j + 1] - 1) * rng.uniform(0.9, 1.1), 4)
            if kv
            else 0.0
            for i in range(n_in)
            for j in range(n_out)
        )
        options.append(InstanceOption("llama-3-8b", gpu.name, rates, tp))
    weights = [
        math.exp(-0.25 * i - 0.25 * j) * rng.uniform(0.3, 1.7) for i in range(n_in) for j in range(n_out)
    ]
    servable = [any(o.rates[b] > 0 for o in options) for b in range(len(weights))]
    weights = [w if ok else 0.0 for w, ok in zip(weights, servable, strict=True)]
    total = sum(weights)
    demand = Demand("llama-3-8b", tuple(TOTAL_RATE * w / total for w in weights))
    return MixProblem(gpus, tuple(options), ((demand,),)), servable.count(False)


def melange_cbc(problem: MixProblem, k: int, time_limit_s: float) -> dict[str, Any]:
    """Mélange's binary-slice ILP on CBC (melange-release solver.py), timed from model build to answer."""
    started = time.perf_counter()
    (demand,) = problem.windows[0]
    opts = problem.options
    slices = [(b, rate / k) for b, rate in enumerate(demand.rates) if rate > 0 for _ in range(k)]
    prob = pulp.LpProblem("GpuAllocation", pulp.LpMinimize)
    x = [
        {g: pulp.LpVariable(f"x_{s}_{g}", cat=pulp.LpBinary) for g, o in enumerate(opts) if o.rates[b] > 0}
        for s, (b, _) in enumerate(slices)
    ]
    y = [pulp.LpVariable(f"y_{g}", lowBound=0, cat=pulp.LpInteger) for g in range(len(opts))]
    prob += pulp.lpSum(problem.option_cost(o) * y[g] for g, o in enumerate(opts))
    for row in x:
        prob += pulp.lpSum(row.values()) == 1
    for g, o in enumerate(opts):
        prob += (
            pulp.lpSum(x[s][g] * (rate / o.rates[b]) for s, (b, rate) in enumerate(slices) if g in x[s])
            <= y[g]
        )
    prob.solve(pulp.PULP_CBC_CMD(msg=0, timeLimit=time_limit_s))
    wall = time.perf_counter() - started
    status = {1: "optimal", 2: "feasible (time limit)"}.get(
        prob.sol_status, pulp.LpStatus[prob.status].lower()
    )
    cost = None
    if prob.sol_status in (1, 2):
        cost = sum(problem.option_cost(o) * round(y[g].value() or 0) for g, o in enumerate(opts))
    return {"status": status, "cost_per_hour": cost, "wall_s": wall, "binaries": sum(len(r) for r in x)}


def mosaic(problem: MixProblem, variant: Variant, k: int, engine: str) -> dict[str, Any]:
    """One solve, timed from model build to verified answer: wall time, and the CPU time of all threads
    (on a shared, loaded machine the CPU time is the steadier figure)."""
    cpu, started = time.process_time(), time.perf_counter()
    sol = solve_mix(problem, variant=variant, slice_factor=k, engine=engine, time_limit_s=30.0)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {
        "status": sol.status.value,
        "cost_per_hour": sol.cost_per_hour,
        "gap": sol.gap,
        "wall_s": wall,
        "cpu_s": cpu,
        "gpus": sum(sol.gpus.values()),
        "engine": sol.engine,
        "notes": list(sol.notes),
    }


def run(sizes: list[tuple[int, int, int, int, int]], cbc_limit: float) -> list[dict[str, Any]]:
    rows = []
    for n_types, n_in, n_out, k, seeds in sizes:
        for seed in range(seeds):
            problem, unservable = make_instance(n_types, n_in, n_out, seed)
            row: dict[str, Any] = {
                "types": n_types,
                "buckets": n_in * n_out,
                "slice_factor": k,
                "seed": seed,
                "unservable_buckets": unservable,
            }
            row["load_avg_1m"] = os.getloadavg()[0]
            row["mosaic_sliced_cp_sat"] = mosaic(problem, Variant.SLICED, k, "cp-sat")
            row["mosaic_sliced_scip"] = mosaic(problem, Variant.SLICED, k, "scip")
            row["mosaic_continuous"] = mosaic(problem, Variant.CONTINUOUS, k, "auto")
            row["mosaic_continuous_scip"] = mosaic(problem, Variant.CONTINUOUS, k, "scip")
            row["melange_cbc"] = melange_cbc(problem, k, cbc_limit)
            cbc = row["melange_cbc"]
            ours = row["mosaic_sliced_cp_sat"]
            row["cost_ok"] = (
                cbc["cost_per_hour"] is None or ours["cost_per_hour"] <= cbc["cost_per_hour"] + 1e-6
            )
            row["time_ratio_cbc_over_mosaic"] = cbc["wall_s"] / ours["wall_s"]
            rows.append(row)
            print(
                f"{n_types:>2} types × {n_in * n_out:>3} buckets × k={k:<2} seed {seed}: "
                f"mosaic {ours['cost_per_hour']:.2f} {ours['status']} {ours['wall_s'] * 1000:.0f} ms ({ours['cpu_s'] * 1000:.0f} ms CPU; scip {row['mosaic_sliced_scip']['wall_s'] * 1000:.0f} ms)"
                f" | continuous {row['mosaic_continuous']['cost_per_hour']:.2f} {row['mosaic_continuous']['wall_s'] * 1000:.0f} ms"
                f" (scip {row['mosaic_continuous_scip']['wall_s'] * 1000:.0f} ms)"
                f" | CBC {cbc['cost_per_hour'] if cbc['cost_per_hour'] is None else round(cbc['cost_per_hour'], 2)} {cbc['status']} {cbc['wall_s']:.1f} s",
                flush=True,
            )
    return rows


def spread(seeds: int) -> dict[str, Any]:
    """Mosaic alone (sliced, default engine) on `seeds` more 36 × 4 × 4 instances: how reliable is < 100 ms?

    The bar instances are only four seeds; this draws seeds 0 … seeds−1 of the same size (no CBC) and
    reports the CPU-time distribution, so a lucky four cannot pass for reliability.
    """
    cpu: list[float] = []
    for seed in range(seeds):
        problem, _ = make_instance(4, 6, 6, seed)
        m = mosaic(problem, Variant.SLICED, 4, "auto")
        if m["status"] != "optimal":
            raise SystemExit(f"36×4×4 seed {seed}: {m['status']}")
        cpu.append(m["cpu_s"])
    ordered = sorted(cpu)
    return {
        "seeds": seeds,
        "all_optimal": True,
        "cpu_median_s": statistics.median(cpu),
        "cpu_p90_s": ordered[int(0.9 * (len(ordered) - 1))],
        "cpu_max_s": ordered[-1],
        "over_100ms_cpu": sum(c >= 0.1 for c in cpu),
        "slowest_seed": cpu.index(ordered[-1]),
    }


def bars(rows: list[dict[str, Any]]) -> dict[str, Any]:
    bar_rows = [r for r in rows if (r["types"], r["buckets"], r["slice_factor"]) == (4, 36, 4)]
    limited = [r for r in bar_rows if r["melange_cbc"]["status"] != "optimal"]
    size = max(
        (r["types"] * r["buckets"] * r["slice_factor"], r["types"], r["buckets"], r["slice_factor"])
        for r in rows
    )[1:]
    largest_rows = [r for r in rows if (r["types"], r["buckets"], r["slice_factor"]) == size]
    ours = [r["mosaic_sliced_cp_sat"] for r in rows]
    return {
        "same_or_lower_cost_everywhere": all(r["cost_ok"] for r in rows),
        "continuous_never_dearer": all(
            r["mosaic_continuous"]["cost_per_hour"] <= r["mosaic_sliced_cp_sat"]["cost_per_hour"] + 1e-6
            for r in rows
        ),
        "mosaic_optimal_everywhere": all(o["status"] == "optimal" for o in ours),
        "36x4x4_instances": len(bar_rows),
        "36x4x4_cbc_hit_time_limit": len(limited),
        "36x4x4_mosaic_max_wall_s": max(
            (r["mosaic_sliced_cp_sat"]["wall_s"] for r in bar_rows), default=None
        ),
        "36x4x4_mosaic_max_cpu_s": max((r["mosaic_sliced_cp_sat"]["cpu_s"] for r in bar_rows), default=None),
        "36x4x4_under_100ms_wall_where_cbc_hit_limit": all(
            r["mosaic_sliced_cp_sat"]["wall_s"] < 0.1 for r in limited
        )
        if limited
        else None,
        "36x4x4_under_100ms_cpu_where_cbc_hit_limit": all(
            r["mosaic_sliced_cp_sat"]["cpu_s"] < 0.1 for r in limited
        )
        if limited
        else None,
        "36x4x4_all_under_100ms_cpu": all(r["mosaic_sliced_cp_sat"]["cpu_s"] < 0.1 for r in bar_rows),
        "largest": "×".join(map(str, size)),
        "largest_max_wall_s": max(r["mosaic_sliced_cp_sat"]["wall_s"] for r in largest_rows),
        "largest_max_cpu_s": max(r["mosaic_sliced_cp_sat"]["cpu_s"] for r in largest_rows),
        "largest_under_2s_wall": all(r["mosaic_sliced_cp_sat"]["wall_s"] < 2.0 for r in largest_rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cbc-time-limit", type=float, default=20.0, help="CBC time limit per instance (s)")
    ap.add_argument("--quick", action="store_true", help="three sizes only")
    ap.add_argument(
        "--spread-seeds", type=int, default=40, help="extra 36×4×4 seeds solved by Mosaic alone (0: none)"
    )
    args = ap.parse_args()
    started = time.perf_counter()
    rows = run(QUICK_SIZES if args.quick else SIZES, args.cbc_time_limit)
    result = {
        "bench": "placement_scale",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "settings": {
            "tpot_ms": TPOT_S * 1000,
            "total_rate": TOTAL_RATE,
            "cbc_time_limit_s": args.cbc_time_limit,
            "model": "llama-3-8b",
        },
        "rows": rows,
        "bars": bars(rows),
        "spread_36x4x4": spread(args.spread_seeds) if args.spread_seeds > 0 else None,
        "total_wall_s": time.perf_counter() - started,
    }
    out = ROOT / "bench" / "results" / "placement_scale.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    b = result["bars"]
    limited = [
        r["mosaic_sliced_cp_sat"]
        for r in rows
        if (r["types"], r["buckets"], r["slice_factor"]) == (4, 36, 4)
        and r["melange_cbc"]["status"] != "optimal"
    ]
    times = (
        ", ".join(f"{m['wall_s'] * 1000:.0f} ms ({m['cpu_s'] * 1000:.0f} ms CPU)" for m in limited) or "none"
    )
    load = sum(r["load_avg_1m"] for r in rows) / len(rows)
    every = ", ".join(
        f"seed {r['seed']} {r['mosaic_sliced_cp_sat']['cpu_s'] * 1000:.0f}"
        for r in rows
        if (r["types"], r["buckets"], r["slice_factor"]) == (4, 36, 4)
    )
    summary = (
        f"same-or-lower cost than Mélange's binary ILP on {len(rows)}/{len(rows)} instances: "
        f"{b['same_or_lower_cost_everywhere']}, all proven optimal: {b['mosaic_optimal_everywhere']}; "
        f"36 buckets×4 types×k4: CBC hit its {args.cbc_time_limit:g} s limit on {len(limited)}/{b['36x4x4_instances']}, "
        f"Mosaic proved those optimal in {times}; all 36×4×4 CPU ms: {every}; "
        f"largest {b['largest']}: {b['largest_max_wall_s']:.2f} s wall ({b['largest_max_cpu_s']:.2f} s CPU); "
        f"machine load avg {load:.1f} on {os.cpu_count()} cores"
    )
    sp = result["spread_36x4x4"]
    if sp:
        summary += (
            f"; 36×4×4 over {sp['seeds']} seeds (Mosaic alone): CPU median {sp['cpu_median_s'] * 1000:.0f} ms, "
            f"p90 {sp['cpu_p90_s'] * 1000:.0f} ms, max {sp['cpu_max_s'] * 1000:.0f} ms (seed {sp['slowest_seed']}), "
            f"{sp['over_100ms_cpu']} ≥ 100 ms"
        )
    print(summary)
    bench_md = ROOT / "BENCHMARKS.md"
    if not bench_md.exists():
        bench_md.write_text("| date | bench | command | result |\n|---|---|---|---|\n")
    cmd = (
        "python bench/placement_scale.py"
        + (" --quick" if args.quick else "")
        + f" --cbc-time-limit {args.cbc_time_limit:g}"
        + (f" --spread-seeds {args.spread_seeds}" if args.spread_seeds != 40 else "")
    )
    with bench_md.open("a") as fh:
        fh.write(f"| {result['date'][:10]} | placement_scale | `{cmd}` | {summary} |\n")


if __name__ == "__main__":
    main()
