"""Autoscaling policies on the same traces in the cluster simulator, compared at equal SLO attainment.

For each trace, every policy is run over its main knob; a policy's best run is the one with the fewest
GPU-hours among those with ≥ 99% of requests within both TTFT and TPOT SLOs and no request aborted by
scale-in. Reported: GPU-hours, $, utilisation, scale events, aborted requests, and the ratios
Mosaic / best-tuned HPA and Mosaic / Dynamo-style planner (bars: ≤ 0.80 and ≤ 0.95).

Traces: a synthetic diurnal + burst curve (`loadgen.diurnal`), and the real Azure LLM inference trace 2023
(conversation) from ../shared/data when present, else a small Azure-format fixture from tests/. Every
autoscaler starts from the same running fleet (2 prefill + 2 decode); static provisioning starts and stays
at its size.

    python bench/autoscale_eval.py [--quick]   (every mode's --quick writes <name>_quick.json; the default
                                               mode without ../shared/data's Azure trace writes
                                               autoscale_eval_fixture.json; neither draws the README's plot)
    python bench/autoscale_eval.py --pd-gate-sweep [--quick]
    python bench/autoscale_eval.py --grid 0.60,0.61,...,0.70 [--observed-context] [--quick]
    python bench/autoscale_eval.py --load-sweep 1,2,4 [--grid ...] [--observed-context] [--quick]
    python bench/autoscale_eval.py --seeds 1,2,3,4,5,6,7,8,9,10 [--grid ...] [--crowd-oracle] [--quick]
    python bench/autoscale_eval.py --mooncake 1,2 [--observed-context] [--quick]

`--mosaic-knob NAME=VALUE` (an `AutoscalerConfig` field, repeatable) gives Mosaic's runs in `--grid`,
`--seeds` or `--load-sweep` that knob too (the planner's runs are unchanged); `--grid` with `--seeds` or
`--load-sweep` replaces their standard grid. Such a variant writes `<name>_grid.json` /
`<name>_knobs_<knob>-<value>.json` (both suffixes with both) with the flags in its BENCHMARKS.md line, and
leaves the standard results alone: every row in docs/autoscaling.md has the command that reproduces it.

`--grid` is a sensitivity check of the comparison itself: the two target-driven families (Mosaic and the
Dynamo-style planner) over the given utilisation targets instead of the standard grid, on every trace,
each family's best run and the ratio. A finer grid around where 99% is lost shows whether the standard
grid's spacing decides the result. It writes `bench/results/autoscale_grid.json` and leaves
`autoscale_eval.json` alone.

`--observed-context` (with `--grid` or `--load-sweep`) runs Mosaic with the knob of that name: decode
capacity at the observed mean context instead of the pools' configured 1,024 tokens, the P/D ratio
profiled at the window's context (the planner always sizes decode at its forecast context). It writes
`autoscale_grid_observed_context.json` / `autoscale_load_observed_context.json`.

`--load-sweep` asks whether that comparison depends on fleet size: on the compressed day only, at each
multiplier k of its mean rate (same shape, burst and seed; k = 1 is the standard trace), the two
target-driven families over the standard grid, each family's best run, the ratio and every run's peak
instances per pool. The fleet is FLEET's with each pool's max_replicas times k (a run that reaches a
maximum is flagged), and every run starts from the same 2 prefill + 2 decode: at the trough where the
day starts that is about what k = 4 needs and more than k = 1 does, so no multiplier starts short. It
writes `bench/results/autoscale_load.json` and leaves `autoscale_eval.json` alone.

`--seeds` asks whether the compressed-day comparison is one draw's luck: the same day (shape, burst, rate)
drawn with each seed (arrival times and lengths; 7 is the standard trace), the two target-driven families
over the standard grid on each, each family's best run and the ratio per seed, and over all seeds the
mean ratio, the ratio of summed best GPU-hours, and how many seeds meet the 0.95 bar (a seed where a
family passes no target counts as not met). It writes `bench/results/autoscale_seeds.json` and leaves
`autoscale_eval.json` alone.

`--crowd-oracle` (with `--seeds`) bounds what any timing of Mosaic's prefill could gain on the flash
crowd: Mosaic's runs get an oracle that knows the crowd in advance and holds the prefill instances its
busiest minute needs (read from the trace) from one cold start before it to its end, on top of the policy's
own decisions (`crowd_oracle`, `with_crowd_oracle`; the planner's runs are unchanged). It writes
`bench/results/autoscale_seeds_crowd_oracle.json`.

`--mooncake 1,2` runs every family, as the full run does, on a third real trace: the Mooncake conversation
trace (Kimi's service, FAST'25, the first 4,000 requests: 22 minutes, inter-arrival CV 2.87) at each speed-up,
served by Qwen2.5-7B (32k context: the 3,671 requests that fit) with TTFT ≤ 5 s (prompts average 9.2k tokens);
the rest of FLEET as above. It writes `bench/results/autoscale_mooncake.json` (skipped without ../shared/data);
with `--observed-context` (Mosaic's runs with that knob) `autoscale_mooncake_observed_context.json`.

`--pd-gate-sweep` measures conditional disaggregation (the router's P/D gate, `pd_max_prefill_wait_s`,
docs/routing.md) in this evaluation: the Mosaic, Dynamo-style and static families over their whole grids,
with the gate off and at each bound in `PD_GATE_BOUNDS` (the same routing config for every family), each
family's best run per setting, and how many requests the gate sent decode-only. It writes
`bench/results/autoscale_pd_gate.json` and leaves `autoscale_eval.json` alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import ROOT, SHARED_DATA, append_line, write_result
from loadgen.diurnal import Burst, DiurnalSpec, diurnal_trace
from loadgen.formats import open_trace
from scheduler.autoscaler.factory import build_policy
from scheduler.autoscaler.policy import AutoscalerConfig
from scheduler.autoscaler.signals import ScalingDecision
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import FleetConfig, parse_fleet, pool_specs
from simulator.cluster_report import build_report
from simulator.trace_adapter import sim_requests

SLO_TARGET = 0.99
FLEET: dict[str, Any] = {
    "model": "llama-3-8b",
    "slo": {"ttft_ms": 2000, "tpot_ms": 60},
    "cold_start_s": 120,
    "decision_interval_s": 15,
    "scrape_interval_s": 1,
    "pools": [
        {
            "name": "prefill-h100",
            "gpu": "H100",
            "role": "prefill",
            "replicas": 2,
            "min_replicas": 1,
            "max_replicas": 16,
        },
        {
            "name": "decode-a100",
            "gpu": "A100-80GB",
            "role": "decode",
            "replicas": 2,
            "min_replicas": 1,
            "max_replicas": 24,
        },
    ],
}


COMPRESSED_DAY = "diurnal+burst"


STANDARD_SEED = 7
# The draw of the compressed day Mosaic's P/D ratio is profiled on: held out from every evaluated draw
# (--seeds uses 1-10), as a user profiles on yesterday's traffic. Profiling on the evaluated trace itself
# handed Mosaic that day's exact length ratio, output lengths included, which a live gateway learns only
# as requests complete and the planner has to learn online (seed 7's window gave 1.415, other draws
# 1.33-1.37; with 1.348 Mosaic's 0.65 run failed on seed 7). Fixed before the held-out results were seen.
PROFILE_SEED = 0


def day_period(quick: bool) -> float:
    return 1200.0 if quick else 3600.0


def flash_crowd(quick: bool) -> Burst:
    """The compressed day's flash crowd: 1.8x the curve for 5 minutes, on the way down from the peak."""
    return Burst(0.62 * day_period(quick), 300, 1.8)


def compressed_day(quick: bool, load: float = 1.0, seed: int = STANDARD_SEED) -> list[SimRequest]:
    """A compressed day: trough at 0.3x and peak at 1.7x the mean (16 req/s times `load`), one period,
    with a sustained flash crowd (1.8x for 5 minutes, longer than a cold start) on the way down from the
    peak. `seed` draws the arrivals and lengths."""
    period = day_period(quick)
    spec = DiurnalSpec(
        duration_s=period,
        mean_rate=16 * load,
        amplitude=0.7,
        period_s=period,
        bursts=(flash_crowd(quick),),
    )
    return [
        SimRequest(r.arrival_s or 0.0, r.input_tokens, r.output_tokens)
        for r in diurnal_trace(spec, seed=seed)
    ]


def traces(quick: bool) -> dict[str, list[SimRequest]]:
    """A diurnal curve with a sustained flash crowd (longer than a cold start), and a real trace."""
    out = {COMPRESSED_DAY: compressed_day(quick)}
    azure = SHARED_DATA / "traces" / "azure_llm_2023_conv.csv"
    if azure.exists():
        name, source, rate_scale = "azure-2023-conv (real, 4x speed)", azure, 4.0
    else:
        name, source, rate_scale = (
            "azure-format fixture",
            ROOT / "tests" / "cluster" / "fixtures" / "azure_conv.csv",
            1.0,
        )
    limit = 10_000 if quick else None
    out[name] = list(sim_requests(open_trace(source), rate_scale=rate_scale, max_requests=limit))
    return out


def profile_trace(trace_name: str, reqs: list[SimRequest], quick: bool) -> list[SimRequest]:
    """What Mosaic's P/D ratio is profiled on: for the compressed day a held-out draw (`PROFILE_SEED`);
    for a real trace, which has no second draw, the trace itself (its first 10%, a warm-up window)."""
    return compressed_day(quick, seed=PROFILE_SEED) if trace_name == COMPRESSED_DAY else reqs


def profiled_pd_ratio(fleet: FleetConfig, reqs: list[SimRequest], observed_context: bool = False) -> float:
    """Prefill instances per decode instance from a profiling window (the first 10% of `reqs`, see
    `profile_trace`), with decode capacity at the context the policy sizes at (the window's mean with
    `observed_context`)."""
    window = reqs[: max(1, len(reqs) // 10)]
    mean_in = sum(r.input_tokens for r in window) / len(window)
    mean_out = sum(r.output_tokens for r in window) / len(window)
    specs = {s.role: s for s in pool_specs(fleet)}
    decode = specs["decode"].decode_tps_at(mean_in + mean_out / 2 if observed_context else None)
    return (mean_in / specs["prefill"].prefill_tps_capacity) / (mean_out / decode)


def static_peak_counts(fleet: FleetConfig, reqs: list[SimRequest], factor: float) -> dict[str, int]:
    """Static provisioning for the peak minute of the trace, times `factor`."""
    specs = {s.role: s for s in pool_specs(fleet)}
    per_min: dict[int, list[SimRequest]] = {}
    for r in reqs:
        per_min.setdefault(int(r.arrival_s // 60), []).append(r)
    peak = max(per_min.values(), key=len)
    rate = len(peak) / 60
    mean_in = sum(r.input_tokens for r in peak) / len(peak)
    mean_out = sum(r.output_tokens for r in peak) / len(peak)
    return {
        "prefill-h100": max(1, math.ceil(factor * rate * mean_in / specs["prefill"].prefill_tps_capacity)),
        "decode-a100": max(1, math.ceil(factor * rate * mean_out / specs["decode"].decode_tps_capacity)),
    }


def crowd_oracle(fleet: FleetConfig, reqs: list[SimRequest], quick: bool) -> dict[str, Any]:
    """`--crowd-oracle`: what an oracle that knows the flash crowd in advance would stand up for it — the
    prefill instances its busiest minute's prompt tokens/s needs (read from the trace itself), held from
    one cold start before the crowd (bought then, ready as it starts) to its end."""
    crowd = flash_crowd(quick)
    end = crowd.start_s + crowd.duration_s
    per_min: dict[int, int] = {}
    for r in reqs:
        if crowd.start_s <= r.arrival_s < end:
            key = int((r.arrival_s - crowd.start_s) // 60)
            per_min[key] = per_min.get(key, 0) + r.input_tokens
    prefill = next(s for s in pool_specs(fleet) if s.role == "prefill")
    need = max(per_min.values(), default=0) / 60 / prefill.prefill_tps_capacity
    return {
        "pool": prefill.name,
        "count": max(1, math.ceil(need)),
        "from_s": crowd.start_s - fleet.cold_start_s,
        "to_s": end,
    }


def with_crowd_oracle(policy: Any, oracle: dict[str, Any]) -> Any:
    """`policy` whose decisions keep `oracle["pool"]` at ≥ `oracle["count"]` over the oracle's window (a
    bench-side analysis wrapper; the policy itself is unchanged)."""
    decide = policy.decide

    def decide_with_oracle(obs: Any) -> ScalingDecision:
        decision = decide(obs)
        if not oracle["from_s"] <= obs.now <= oracle["to_s"]:
            return decision
        targets = dict(decision.targets)
        targets[oracle["pool"]] = max(targets[oracle["pool"]], oracle["count"])
        return ScalingDecision(decision.now, targets, decision.reasons, decision.signal)

    policy.decide = decide_with_oracle
    return policy


def mosaic_run(
    fleet: FleetConfig, profile: list[SimRequest], target: float, observed_context: bool = False
) -> tuple[str, str, dict[str, Any]]:
    """Mosaic at one utilisation target; its other knobs fixed, not tuned: the P/D ratio profiled on the
    first 10% of `profile` (`profile_trace`), a scale-in window of one cold start (an instance is kept as long as re-buying it
    would take), no trend lookahead (on these traces projecting the trend bought instances for noise and
    steps: see docs/autoscaling.md)."""
    return (
        "mosaic",
        "mosaic",
        {
            "utilization_target": target,
            "pd_ratio": round(profiled_pd_ratio(fleet, profile, observed_context), 3),
            "scale_down_window_s": FLEET["cold_start_s"],
            **({"observed_context": True} if observed_context else {}),
        },
    )


def standard_grid(quick: bool) -> tuple[float, ...]:
    """The utilisation targets both target-driven families get."""
    return (0.5, 0.7) if quick else (0.5, 0.55, 0.6, 0.65, 0.7, 0.8, 0.9, 1.0)


def candidates(
    fleet: FleetConfig,
    trace_name: str,
    reqs: list[SimRequest],
    quick: bool,
    observed_context: bool = False,
) -> list[tuple[str, str, dict[str, Any]]]:
    """(family, policy spec, autoscaler overrides) for every knob value tried (`observed_context`: Mosaic's
    runs with that knob)."""
    runs: list[tuple[str, str, dict[str, Any]]] = []
    grid = standard_grid(quick)
    for u in grid:
        runs.append(mosaic_run(fleet, profile_trace(trace_name, reqs, quick), u, observed_context))
    # HPA on GPU utilisation over the same span and step count as the planner's grid (8 targets)
    for t in (0.7,) if quick else (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        runs.append(("hpa-util", f"hpa-util:{t}", {}))
    for t in (1, 4) if quick else (0.5, 1, 2, 4, 8):
        runs.append(("hpa-waiting", f"hpa-waiting:{t}", {}))
    for u in (0.4, 0.8) if quick else (0.3, 0.4, *grid):
        runs.append(("dynamo", "dynamo:180", {"utilization_target": u}))
    for f in (1.0, 1.5) if quick else (1.0, 1.25, 1.5, 2.0):
        counts = static_peak_counts(fleet, reqs, f)
        runs.append(
            ("static-peak", "static:" + ",".join(f"{k}={v}" for k, v in counts.items()), {"factor": f})
        )
    return runs


def run_one(args: tuple[str, str, str, dict[str, Any], list[SimRequest]]) -> dict[str, Any]:
    trace_name, family, spec, overrides, reqs = args
    knobs = {
        k: v
        for k, v in overrides.items()
        if k not in ("factor", "routing", "max_replicas", "crowd_oracle", "fleet")
    }
    base = {**FLEET, **overrides.get("fleet", {})}  # --mooncake: its model and SLO
    routing = {**base.get("routing", {}), **overrides.get("routing", {})}  # shared by every family
    maxima = overrides.get("max_replicas", {})  # per pool, --load-sweep
    pools = [{**p, "max_replicas": maxima.get(p["name"], p["max_replicas"])} for p in base["pools"]]
    fleet = parse_fleet({**base, "pools": pools, "autoscaler": knobs, "routing": routing})
    policy = build_policy(
        spec, pool_specs(fleet), fleet.autoscaler_config(), {p.name: p.replicas for p in fleet.pools}
    )
    if "crowd_oracle" in overrides:
        policy = with_crowd_oracle(policy, overrides["crowd_oracle"])
    if family == "static-peak":  # start (and stay) at the static size; autoscalers start at FLEET's replicas
        counts = {k: int(v) for k, v in (item.split("=") for item in spec.split(":", 1)[1].split(","))}
        fleet = fleet.model_copy(
            update={"pools": [p.model_copy(update={"replicas": counts[p.name]}) for p in fleet.pools]}
        )
    sim = ClusterSimulator(fleet, policy, spec)
    paths: dict[str, int] = {}
    route = sim.router.route

    def counting_route(*a: Any, **kw: Any) -> Any:  # dispatched paths, retried rejects counted per try
        decision = route(*a, **kw)
        path = getattr(decision, "path", "rejected")
        paths[path] = paths.get(path, 0) + 1
        return decision

    sim.router.route = counting_route  # type: ignore[method-assign]
    started = time.perf_counter()
    result = sim.run(reqs)
    report = build_report(result, time.perf_counter() - started)
    report["family"], report["knobs"], report["trace"], report["paths"] = family, overrides, trace_name, paths
    return report


def best_of(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [
        r
        for r in reports
        if r["slo"]["attainment"] >= SLO_TARGET and r["requests"]["aborted_by_scale_in"] == 0
    ]
    return min(ok, key=lambda r: r["gpu_hours"]["total"]) if ok else None


# P/D gate bounds tried by --pd-gate-sweep (seconds of the prefill pool's best queue wait; None = off).
PD_GATE_BOUNDS: tuple[float | None, ...] = (None, 0.5, 1.0)
PD_GATE_FAMILIES = ("mosaic", "dynamo", "static-peak")


def pd_gate_sweep(quick: bool, workers: int) -> None:
    """Each family's grid with the P/D gate off and at each bound; best runs and decode-only counts."""
    base = parse_fleet(FLEET)
    summary: dict[str, Any] = {}
    lines = []
    for trace_name, reqs in traces(quick).items():
        jobs = [
            (trace_name, fam, spec, {**ov, "routing": {"pd_max_prefill_wait_s": bound}}, reqs)
            for bound in PD_GATE_BOUNDS
            for fam, spec, ov in candidates(base, trace_name, reqs, quick)
            if fam in PD_GATE_FAMILIES
        ]
        with ProcessPoolExecutor(max_workers=workers) as pool:
            reports = list(pool.map(run_one, jobs))
        per_bound: dict[str, Any] = {}
        for bound in PD_GATE_BOUNDS:
            at = [r for r in reports if r["knobs"]["routing"]["pd_max_prefill_wait_s"] == bound]
            fams = {}
            for fam in PD_GATE_FAMILIES:
                runs = [r for r in at if r["family"] == fam]
                best = best_of(runs)
                fams[fam] = {
                    "best": None
                    if best is None
                    else {k: v for k, v in _row(best).items() if k != "replicas"},
                    "runs": [
                        {
                            "knobs": {k: v for k, v in r["knobs"].items() if k != "routing"},
                            "attainment": r["slo"]["attainment"],
                            "gpu_hours": r["gpu_hours"]["total"],
                            "ttft_p99_ms": r["latency_ms"]["ttft"]["p99"],
                            "tpot_p99_ms": r["latency_ms"]["tpot"]["p99"],
                            "decode_only": r["paths"].get("decode-only", 0),
                        }
                        for r in runs
                    ],
                }
            ratio = _ratio(fams["mosaic"]["best"], fams["dynamo"]["best"])
            per_bound["off" if bound is None else str(bound)] = {"families": fams, "mosaic_vs_dynamo": ratio}
            best_gh = {f: (v["best"] or {}).get("gpu_hours") for f, v in fams.items()}
            lines.append(f"{trace_name} gate {bound}: best GPU-h {best_gh}, Mosaic/Dynamo {ratio}")
        summary[trace_name] = per_bound
    name = _quick_name("autoscale_pd_gate", quick)
    write_result(
        name,
        {"slo_target": SLO_TARGET, "fleet": FLEET, "bounds": list(PD_GATE_BOUNDS), "traces": summary},
    )
    command = "python bench/autoscale_eval.py --pd-gate-sweep" + (" --quick" if quick else "")
    append_line(name, command, "; ".join(lines))
    for line in lines:
        print(line)


def target_jobs(
    trace_name: str,
    reqs: list[SimRequest],
    grid: tuple[float, ...],
    extra: dict[str, Any] | None = None,
    quick: bool = False,
    mosaic_extra: dict[str, Any] | None = None,
) -> list[tuple[str, str, str, dict[str, Any], list[SimRequest]]]:
    """`run_one` jobs for Mosaic and the Dynamo-style planner at each target in `grid`, `extra` overrides
    added to each, `mosaic_extra` to Mosaic's only (`--mosaic-knob`)."""
    base = parse_fleet(FLEET)
    extra = extra or {}
    jobs = []
    for u in grid:
        profile = profile_trace(trace_name, reqs, quick)
        _, spec, ov = mosaic_run(base, profile, u, bool(extra.get("observed_context")))
        jobs.append((trace_name, "mosaic", spec, {**ov, **extra, **(mosaic_extra or {})}, reqs))
    jobs += [(trace_name, "dynamo", "dynamo:180", {"utilization_target": u, **extra}, reqs) for u in grid]
    return jobs


def peak_replicas(r: dict[str, Any]) -> dict[str, int]:
    """The most instances each pool had at once (starting ones included, draining ones not)."""
    return {p["name"]: max(s[p["name"]] for s in r["replicas"]) for p in FLEET["pools"]}


def target_families(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Mosaic's and the planner's best run and every run (target, attainment, GPU-h, peaks), the ratio,
    and one line's worth of (target, GPU-h) per family."""
    fams = {}
    for fam in ("mosaic", "dynamo"):
        runs = [r for r in reports if r["family"] == fam]
        best = best_of(runs)
        fams[fam] = {
            "best": None if best is None else {k: v for k, v in _row(best).items() if k != "replicas"},
            "best_peak": None if best is None else peak_replicas(best),
            "runs": [
                {
                    "target": r["knobs"]["utilization_target"],
                    "attainment": r["slo"]["attainment"],
                    "gpu_hours": r["gpu_hours"]["total"],
                    "peak": peak_replicas(r),
                }
                for r in runs
            ],
        }
    best = {
        f: v["best"] and (v["best"]["knobs"]["utilization_target"], v["best"]["gpu_hours"])
        for f, v in fams.items()
    }
    return {
        "families": fams,
        "mosaic_vs_dynamo": _ratio(fams["mosaic"]["best"], fams["dynamo"]["best"]),
        "best": best,
    }


def grid_sensitivity(
    grid: tuple[float, ...],
    quick: bool,
    workers: int,
    observed_context: bool = False,
    mosaic_knobs: dict[str, Any] | None = None,
) -> None:
    """Mosaic and the Dynamo-style planner over `grid` on every trace (module docstring, `--grid`); with
    `observed_context` both size decode at the observed (forecast) context."""
    extra = {"observed_context": True} if observed_context else {}
    summary: dict[str, Any] = {}
    lines = []
    for trace_name, reqs in traces(quick).items():
        jobs = target_jobs(trace_name, reqs, grid, extra, quick, mosaic_knobs)
        with ProcessPoolExecutor(max_workers=workers) as pool:
            reports = list(pool.map(run_one, jobs))
        summary[trace_name] = target_families(reports)
        best, ratio = summary[trace_name]["best"], summary[trace_name]["mosaic_vs_dynamo"]
        lines.append(f"{trace_name}: best (target, GPU-h) {best}, Mosaic/Dynamo {ratio}")
    payload = {"slo_target": SLO_TARGET, "fleet": FLEET, "grid": list(grid), "traces": summary, **extra}
    name, flag = "autoscale_grid", f"--grid {_join(grid)}"
    if observed_context:
        name, flag = "autoscale_grid_observed_context", flag + " --observed-context"
    _record(*_variant(name, flag, None, mosaic_knobs, payload), quick, payload, lines)


def scaled_maxima(load: float) -> dict[str, int]:
    """Each pool's max_replicas times `load` (--load-sweep)."""
    return {p["name"]: math.ceil(p["max_replicas"] * load) for p in FLEET["pools"]}


def load_sweep(
    loads: tuple[float, ...],
    quick: bool,
    workers: int,
    grid: tuple[float, ...] | None = None,
    mosaic_knobs: dict[str, Any] | None = None,
    observed_context: bool = False,
) -> None:
    """Mosaic and the planner over the standard grid (or `grid`, `--grid`) on the compressed day at each
    load (`--load-sweep`); `mosaic_knobs` (`--mosaic-knob`) added to Mosaic's runs; `observed_context`
    (`--observed-context`): Mosaic sizes decode at the observed context, its P/D ratio profiled there."""
    custom_grid, grid = grid, grid or standard_grid(quick)
    summary: dict[str, Any] = {}
    lines = []
    for k in loads:
        reqs = compressed_day(quick, k)
        maxima = scaled_maxima(k)
        extra: dict[str, Any] = {"max_replicas": maxima}
        if observed_context:
            extra["observed_context"] = True
        jobs = target_jobs(COMPRESSED_DAY, reqs, grid, extra, quick, mosaic_knobs)
        with ProcessPoolExecutor(max_workers=workers) as pool:
            reports = list(pool.map(run_one, jobs))
        out = target_families(reports)
        at_max = [
            f"{r['family']}@{r['knobs']['utilization_target']}:{name}"
            for r in reports
            for name, n in peak_replicas(r).items()
            if n >= maxima[name]
        ]
        peaks = {f: v["best_peak"] for f, v in out["families"].items()}
        summary[f"{k:g}"] = {"requests": len(reqs), "max_replicas": maxima, "runs_at_max": at_max, **out}
        lines.append(
            f"x{k:g} ({len(reqs)} requests): best (target, GPU-h) {out['best']}, peaks {peaks}, "
            f"Mosaic/Dynamo {out['mosaic_vs_dynamo']}" + (f", at max: {at_max}" if at_max else "")
        )
    payload = {"slo_target": SLO_TARGET, "fleet": FLEET, "grid": list(grid), "trace": COMPRESSED_DAY}
    payload["loads"] = summary
    name, flag = "autoscale_load", f"--load-sweep {_join(loads)}"
    if observed_context:
        name, flag = name + "_observed_context", flag + " --observed-context"
        payload["observed_context"] = True
    _record(*_variant(name, flag, custom_grid, mosaic_knobs, payload), quick, payload, lines)


def seed_sweep(
    seeds: tuple[int, ...],
    quick: bool,
    workers: int,
    mosaic_knobs: dict[str, Any] | None = None,
    grid: tuple[float, ...] | None = None,
    oracle: bool = False,
) -> None:
    """Mosaic and the planner over the standard grid (or `grid`, `--grid`) on the compressed day drawn
    with each seed (`--seeds`); per seed the best runs and the ratio, over all seeds the aggregates (module
    docstring). `mosaic_knobs` (`--mosaic-knob`): extra autoscaler knobs for Mosaic's runs."""
    custom_grid, grid = grid, grid or standard_grid(quick)
    per_seed: dict[str, Any] = {}
    lines = []
    for seed in seeds:
        reqs = compressed_day(quick, seed=seed)
        extra = dict(mosaic_knobs or {})
        if oracle:
            extra["crowd_oracle"] = crowd_oracle(parse_fleet(FLEET), reqs, quick)
        jobs = target_jobs(COMPRESSED_DAY, reqs, grid, quick=quick, mosaic_extra=extra)
        with ProcessPoolExecutor(max_workers=workers) as pool:
            reports = list(pool.map(run_one, jobs))
        out = target_families(reports)
        per_seed[str(seed)] = {"requests": len(reqs), **out}
        if oracle:
            per_seed[str(seed)]["crowd_oracle"] = extra["crowd_oracle"]
        lines.append(
            f"seed {seed}: best (target, GPU-h) {out['best']}, Mosaic/Dynamo {out['mosaic_vs_dynamo']}"
        )
    aggregate = seed_aggregate(per_seed)
    lines.append(
        f"over {len(seeds)} seeds: mean ratio {aggregate['mean_ratio']} (95% CI "
        f"{aggregate['mean_ratio_ci95']}), summed GPU-h ratio "
        f"{aggregate['summed_ratio']}, ≤ 0.95 on {aggregate['seeds_meeting_bar']} of {len(seeds)}"
    )
    payload = {"slo_target": SLO_TARGET, "fleet": FLEET, "grid": list(grid), "trace": COMPRESSED_DAY}
    payload |= {"seeds": per_seed, "aggregate": aggregate}
    name, flag = "autoscale_seeds", f"--seeds {','.join(map(str, seeds))}"
    if oracle:
        name, flag = name + "_crowd_oracle", flag + " --crowd-oracle"
    _record(*_variant(name, flag, custom_grid, mosaic_knobs, payload), quick, payload, lines)


def seed_aggregate(per_seed: dict[str, Any], bar: float = 0.95) -> dict[str, Any]:
    """Mean of the per-seed ratios and ratio of the summed best GPU-hours, over the seeds where both
    families passed some target; `seeds_meeting_bar` counts the rest as not met."""
    ratios = [v["mosaic_vs_dynamo"] for v in per_seed.values()]
    both = [v["best"] for v in per_seed.values() if v["mosaic_vs_dynamo"] is not None]
    mosaic, planner = sum(b["mosaic"][1] for b in both), sum(b["dynamo"][1] for b in both)
    known = [r for r in ratios if r is not None]
    return {
        "seeds": len(ratios),
        "seeds_compared": len(known),
        "mean_ratio": round(sum(known) / len(known), 3) if known else None,
        "summed_ratio": round(mosaic / planner, 3) if planner else None,
        "mean_ratio_ci95": _bootstrap_ci(known),
        "seeds_meeting_bar": sum(1 for r in known if r <= bar),
        "min_ratio": min(known, default=None),
        "max_ratio": max(known, default=None),
    }


def _bootstrap_ci(values: list[float], resamples: int = 10_000) -> list[float] | None:
    """95% percentile-bootstrap interval of the mean (fixed RNG seed, so a rerun prints the same)."""
    if len(values) < 2:
        return None
    means = np.random.default_rng(0).choice(values, size=(resamples, len(values))).mean(axis=1)
    return [round(float(q), 3) for q in np.percentile(means, [2.5, 97.5])]


def _join(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:g}" for v in values)


def _variant(
    name: str,
    flag: str,
    grid: tuple[float, ...] | None,
    mosaic_knobs: dict[str, Any] | None,
    payload: dict[str, Any],
) -> tuple[str, str]:
    """Result name and command flags of a sweep run off its standard grid (`--grid`: `<name>_grid`) or
    with Mosaic knobs (`--mosaic-knob`: `<name>_knobs_<knob>-<value>`, the knobs recorded), so the
    standard results stay as they are and every documented variant has its own file and the command that
    reproduces it."""
    if grid:
        name, flag = name + "_grid", flag + f" --grid {_join(grid)}"
    if mosaic_knobs:
        payload["mosaic_knobs"] = mosaic_knobs
        name += "_knobs_" + "_".join(f"{k}-{_knob_text(v)}" for k, v in mosaic_knobs.items())
        flag += "".join(f" --mosaic-knob {k}={_knob_text(v)}" for k, v in mosaic_knobs.items())
    return name, flag


def _quick_name(name: str, quick: bool) -> str:
    """A --quick run's result name: the committed standard results come from full runs only."""
    return f"{name}_quick" if quick else name


def _knob_text(value: Any) -> str:
    return str(int(value)) if isinstance(value, bool) else f"{value:g}"


def _record(name: str, flag: str, quick: bool, payload: dict[str, Any], lines: list[str]) -> None:
    """`bench/results/<name>.json` (`<name>_quick.json` for a --quick run, which must not replace the
    standard result), one BENCHMARKS.md line with the command, and the lines printed."""
    name = _quick_name(name, quick)
    write_result(name, payload)
    command = f"python bench/autoscale_eval.py {flag}" + (" --quick" if quick else "")
    append_line(name, command, "; ".join(lines))
    for line in lines:
        print(line)


def usage_error(message: str) -> SystemExit:
    """Print `message` to stderr; the SystemExit to raise (status 2, as argparse's own usage errors)."""
    print(message, file=sys.stderr)
    return SystemExit(2)


def parse_knobs(items: list[str]) -> dict[str, float]:
    """`NAME=VALUE` items → Mosaic autoscaler knobs; a name AutoscalerConfig lacks or a value that is not a
    finite number exits with one line."""
    names = {f.name for f in dataclasses.fields(AutoscalerConfig)}
    knobs: dict[str, float] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or name not in names:
            raise usage_error(
                f"error: --mosaic-knob wants NAME=VALUE with NAME an autoscaler knob, got {item!r}"
            )
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise usage_error(f"error: --mosaic-knob {name}: {value!r} is not a finite number")
        kinds = {f.name: f.type for f in dataclasses.fields(AutoscalerConfig)}
        if kinds[name] in (bool, "bool"):  # a switch: 1 or 0 (true/false read as numbers above fail)
            if number not in (0.0, 1.0):
                raise usage_error(f"error: --mosaic-knob {name}: {value!r} is not 0 or 1")
            knobs[name] = bool(number)
            continue
        knobs[name] = int(number) if kinds[name] in (int, "int") and number.is_integer() else number
    return knobs


def parse_grid(text: str) -> tuple[float, ...]:
    return _parse_floats(text, "--grid", "targets in (0, 1]", lambda u: 0 < u <= 1)


def parse_loads(text: str) -> tuple[float, ...]:
    return _parse_floats(text, "--load-sweep", "positive multipliers", lambda k: 0 < k < math.inf)


def parse_seeds(text: str) -> tuple[int, ...]:
    error = f"error: --seeds: comma-separated non-negative integers, got {text!r}"
    try:
        seeds = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise usage_error(error) from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise usage_error(error)
    return seeds


def _parse_floats(text: str, flag: str, what: str, ok: Callable[[float], bool]) -> tuple[float, ...]:
    error = f"error: {flag}: comma-separated {what}, got {text!r}"
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise usage_error(error) from None
    if not values or not all(ok(v) for v in values):
        raise usage_error(error)
    return values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="shorter traces and fewer knob values")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--pd-gate-sweep", action="store_true", help="measure the router's P/D gate (see above)"
    )
    parser.add_argument(
        "--grid", help="comma-separated utilisation targets: Mosaic vs Dynamo-style only (see above)"
    )
    parser.add_argument(
        "--load-sweep",
        help="comma-separated multipliers of the compressed day's rate: Mosaic vs Dynamo-style (see above)",
    )
    parser.add_argument(
        "--seeds", help="comma-separated seeds of the compressed day: Mosaic vs Dynamo-style (see above)"
    )
    parser.add_argument(
        "--observed-context",
        action="store_true",
        help="with --grid or --load-sweep: Mosaic sizes decode at the observed context (see above)",
    )
    parser.add_argument(
        "--mosaic-knob",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="with --grid, --seeds or --load-sweep: an extra autoscaler knob for Mosaic's runs "
        "(repeatable), e.g. scale_down_delay_after_add_s=240",
    )
    parser.add_argument(
        "--crowd-oracle",
        action="store_true",
        help="with --seeds: Mosaic's runs hold the prefill the flash crowd needs from one cold start "
        "before it (an oracle bound, see above)",
    )
    parser.add_argument(
        "--mooncake",
        metavar="SCALES",
        help="comma-separated speed-ups of the Mooncake conversation trace: every family on it (see above)",
    )
    args = parser.parse_args()
    if args.mooncake and (args.seeds or args.load_sweep or args.grid or args.pd_gate_sweep):
        raise usage_error(
            "error: --mooncake is a run of its own; give it alone (with --observed-context, --quick, --workers)"
        )
    if args.crowd_oracle and not args.seeds:
        raise usage_error("error: --crowd-oracle applies to --seeds")
    if args.seeds and args.load_sweep:
        raise usage_error("error: --seeds and --load-sweep are separate sweeps; run one at a time")
    if args.observed_context and (args.seeds or not (args.grid or args.load_sweep or args.mooncake)):
        raise usage_error("error: --observed-context applies to --grid, --load-sweep or --mooncake")
    if args.mosaic_knob and not (args.grid or args.seeds or args.load_sweep):
        raise usage_error("error: --mosaic-knob applies to --grid, --seeds or --load-sweep")
    knobs = parse_knobs(args.mosaic_knob) or None
    grid = parse_grid(args.grid) if args.grid else None
    if args.seeds:
        seed_sweep(parse_seeds(args.seeds), args.quick, args.workers, knobs, grid, args.crowd_oracle)
        return
    if args.load_sweep:
        load_sweep(parse_loads(args.load_sweep), args.quick, args.workers, grid, knobs, args.observed_context)
        return
    if grid:
        grid_sensitivity(grid, args.quick, args.workers, args.observed_context, knobs)
        return
    if args.pd_gate_sweep:
        pd_gate_sweep(args.quick, args.workers)
        return
    if args.mooncake:
        mooncake_eval(parse_loads(args.mooncake), args.quick, args.workers, args.observed_context)
        return
    base = parse_fleet(FLEET)
    summary: dict[str, Any] = {}
    lines = []
    for trace_name, reqs in traces(args.quick).items():
        summary[trace_name] = every_family(base, trace_name, reqs, args.quick, args.workers)
        ratios = summary[trace_name]["ratios"]
        lines.append(
            f"{trace_name}: Mosaic/HPA {ratios['mosaic_vs_best_hpa']}, Mosaic/Dynamo "
            f"{ratios['mosaic_vs_dynamo']} GPU-h at ≥99% SLO"
        )
    # The standard results (bench/results/autoscale_eval.json and the README's plot) come from the full run
    # on the real trace; a --quick run, or one on the fixture (no ../shared/data), writes its own name and no
    # plot: the README's "Reproduce" line overwrote the committed results with a quick run's.
    standard = not args.quick and "azure-format fixture" not in summary
    name = (
        "autoscale_eval" if standard else "autoscale_eval_quick" if args.quick else "autoscale_eval_fixture"
    )
    write_result(name, {"slo_target": SLO_TARGET, "fleet": FLEET, "traces": summary})
    if standard:
        _plot_replicas(summary)
    command = "python bench/autoscale_eval.py" + (" --quick" if args.quick else "")
    append_line(name, command, "; ".join(lines))
    for line in lines:
        print(line)


def every_family(
    fleet: FleetConfig,
    trace_name: str,
    reqs: list[SimRequest],
    quick: bool,
    workers: int,
    fleet_overrides: dict[str, Any] | None = None,
    observed_context: bool = False,
) -> dict[str, Any]:
    """Every family over its knob on one trace: each family's runs and best run, and Mosaic's ratios to the
    best-tuned HPA, the Dynamo-style planner and static provisioning. `fleet_overrides` (a FLEET section
    replaced, `--mooncake`'s model and SLO) go to every run; `observed_context` to Mosaic's."""
    jobs = []
    for fam, spec, ov in candidates(fleet, trace_name, reqs, quick, observed_context):
        jobs.append(
            (trace_name, fam, spec, {**ov, "fleet": fleet_overrides} if fleet_overrides else ov, reqs)
        )
    with ProcessPoolExecutor(max_workers=workers) as pool:
        reports = list(pool.map(run_one, jobs))
    families: dict[str, Any] = {}
    for fam in dict.fromkeys(r["family"] for r in reports):
        runs = [r for r in reports if r["family"] == fam]
        best = best_of(runs)
        families[fam] = {
            "best": None if best is None else _row(best),
            "best_attainment_if_none_met": None if best else max(r["slo"]["attainment"] for r in runs),
            "runs": [_row(r) for r in runs],
        }
    mosaic = families["mosaic"]["best"]
    hpa = [families[f]["best"] for f in ("hpa-util", "hpa-waiting") if families[f]["best"]]
    best_hpa = min(hpa, key=lambda r: r["gpu_hours"]) if hpa else None
    ratios = {
        "mosaic_vs_best_hpa": _ratio(mosaic, best_hpa),
        "mosaic_vs_dynamo": _ratio(mosaic, families["dynamo"]["best"]),
        "mosaic_vs_static_peak": _ratio(mosaic, families["static-peak"]["best"]),
    }
    return {"requests": len(reqs), "families": families, "ratios": ratios}


# --mooncake: the Mooncake conversation trace (Kimi's service, FAST'25; ../shared/data) needs a long-context
# model: Qwen2.5-7B (32k), its requests that fit the context (3,671 of the first 4,000), and a TTFT SLO of
# 5 s (prompts run to 32k tokens, mean 9.2k; one of 32k takes ~2 s to prefill on an H100 alone).
MOONCAKE_TRACE = "mooncake_fast25_conversation_first4000.jsonl"
MOONCAKE_FLEET = {"model": "qwen2.5-7b", "slo": {"ttft_ms": 5000, "tpot_ms": 60}}


def mooncake_requests(scale: float) -> list[SimRequest] | None:
    """The Mooncake conversation trace at `scale`× its speed, the requests that fit Qwen2.5-7B's context;
    None when ../shared/data is absent."""
    path = SHARED_DATA / "traces" / MOONCAKE_TRACE
    if not path.exists():
        return None
    context = 32768
    return [
        r
        for r in sim_requests(open_trace(path), rate_scale=scale)
        if r.input_tokens + r.output_tokens <= context
    ]


def mooncake_eval(scales: tuple[float, ...], quick: bool, workers: int, observed_context: bool) -> None:
    """`--mooncake`: every family on the Mooncake conversation trace at each rate scale (a third, real trace
    with bursts: inter-arrival CV 2.87, against the Azure trace's 1.09), Mosaic with `observed_context`
    when asked (this trace's contexts average ~9.4k tokens, the pools' configured 1,024 far from it)."""
    fleet = parse_fleet({**FLEET, **MOONCAKE_FLEET})
    summary: dict[str, Any] = {}
    lines = []
    for scale in scales:
        reqs = mooncake_requests(scale)
        if reqs is None:
            print(f"skipped: ../shared/data/traces/{MOONCAKE_TRACE} is absent")
            return
        name = f"mooncake-conversation (real, {scale:g}x speed)"
        summary[name] = every_family(fleet, name, reqs, quick, workers, MOONCAKE_FLEET, observed_context)
        fams, ratios = summary[name]["families"], summary[name]["ratios"]
        bests = {f: fams[f]["best"] for f in ("mosaic", "dynamo")}
        lines.append(
            f"{name}: Mosaic/HPA {ratios['mosaic_vs_best_hpa']}, Mosaic/Dynamo {ratios['mosaic_vs_dynamo']} "
            + ", ".join(
                f"{f} best {b['gpu_hours']:.3f} GPU-h"
                if b
                else f"{f} none ≥99% (best {fams[f]['best_attainment_if_none_met']:.1%})"
                for f, b in bests.items()
            )
        )
    result = _quick_name("autoscale_mooncake" + ("_observed_context" if observed_context else ""), quick)
    fleet_used = {**FLEET, **MOONCAKE_FLEET}
    write_result(
        result,
        {
            "slo_target": SLO_TARGET,
            "fleet": fleet_used,
            "observed_context": observed_context,
            "traces": summary,
        },
    )
    command = "python bench/autoscale_eval.py --mooncake " + ",".join(f"{x:g}" for x in scales)
    command += (" --observed-context" if observed_context else "") + (" --quick" if quick else "")
    append_line(result, command, "; ".join(lines))
    for line in lines:
        print(line)


def _row(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "policy": r["policy"],
        "knobs": r["knobs"],
        "attainment": r["slo"]["attainment"],
        "gpu_hours": r["gpu_hours"]["total"],
        "cost_usd": r["cost_usd"]["total"],
        "utilization": r["utilization"],
        "scale_events": len(r["scale_events"]),
        "aborted": r["requests"]["aborted_by_scale_in"],
        "failed": r["requests"]["failed"],
        "ttft_p99_ms": r["latency_ms"]["ttft"]["p99"],
        "tpot_p99_ms": r["latency_ms"]["tpot"]["p99"],
        "wall_s": r["wall_s"],
        "replicas": r["replicas"],
    }


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or not b["gpu_hours"]:
        return None
    return round(a["gpu_hours"] / b["gpu_hours"], 3)


def _plot_replicas(summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace_name = next(iter(summary))
    fams = summary[trace_name]["families"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, pool in zip(axes, ("prefill-h100", "decode-a100"), strict=True):
        for fam in ("mosaic", "hpa-waiting", "dynamo", "static-peak"):
            best = fams.get(fam, {}).get("best")
            if not best:
                continue
            samples = best["replicas"]
            ax.step([s["t"] / 60 for s in samples], [s[pool] for s in samples], where="post", label=fam)
        ax.set_title(f"{pool} — {trace_name}")
        ax.set_xlabel("time (min)")
    axes[0].set_ylabel("instances")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "img" / "autoscale_replicas.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
