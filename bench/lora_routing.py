"""LoRA routing: what the `lora-affinity` scorer's weight does to TTFT on a fleet whose `--max-loras` slots
are contended.

    .venv/bin/python bench/lora_routing.py [--quick] [--weights 0 2 4 8] [--max-loras 1 2]

**Scenario.** The gateway in-process (`server.runner.start_gateway_server`: `create_app`, uvicorn on
127.0.0.1) with one embedded simulated pool of `--workers` H100 Llama-3-8B workers, each serving the same
`--adapters` LoRA adapters (`endpoints.simulated.lora_modules`) with `max_loras` slots. The load is
`mosaic replay`'s own code path (`loadgen.replay.run_replay_async`) against the gateway's URL: a synthetic
Poisson trace (`--rate` simulated requests/s, prompts uniform 64–256 tokens, outputs uniform 16–64,
`ignore_eos`), each request naming one adapter drawn uniformly (`--lora-modules`, seeded), so every
request crosses the real HTTP path and the deployed router — the `mosaic` policy with all its scorers —
with only `routing.weights.lora-affinity` changed between runs. Weight 0 is the baseline (the router then
ignores which adapters a worker runs); 2 is the default. Each (max_loras, weight) run starts a fresh
gateway and fleet with the same seeds and replays the same trace (same arrival times, lengths and adapter
per request).

**Time.** Workers run the engine model `--time-scale` times faster than real time, and the gateway's scrape
interval is divided by it too (`vllm:lora_requests_info` is read once per simulated second, as a default
deployment reads it once per second), so one run of `--duration` simulated seconds takes duration /
time_scale of wall time. Latencies are reported in simulated milliseconds: the wall time measured by the
load generator × time_scale. The gateway's and the load generator's own CPU time is scaled up with it
(≈ 1–3 ms of wall per request, more on a busy machine), the same in every run, so it adds to every
weight's TTFT alike and makes the ratios conservative; `send_lag_p99_ms` in the JSON says how late the
generator was (wall ms).

**Reported** per (max_loras, weight): completed and failed requests, throughput (simulated req/s), TTFT
mean/p50/p99 and E2E latency mean (simulated ms), and the mean queue time of the workers' own
`vllm:request_queue_time_seconds` (time a request waited in vLLM's queue; simulated seconds, from each
worker's /metrics at the end); per max_loras, the ratios default (weight 2) / baseline (weight 0) of TTFT
mean, p50 and p99 and queue time (< 1: the default is faster), pooled and per seed, and the weight with
the lowest mean TTFT.

**Limits.** The simulator charges no time for an adapter: no adapter load or swap, no LoRA compute
overhead (punica/SGMV kernels), no `--max-cpu-loras` cache; only vLLM's `max_loras` slot rule is modelled
(a waiting request of an adapter not among the running ones is skipped while `max_loras` adapters run), so
the figures measure how much routing avoids waiting for a slot, not how much it saves in adapter loads.
Every worker serves every adapter (the `adapter` filter removes nobody). A few hundred requests per weight: the mean
and p50 ratios repeat, the p99 ratio does not (`--quick`, 120 requests, gave ×0.52 to ×1.16 on three
tries); the per-seed ratios in the JSON show the spread. Runs share this machine's cores with
whatever else runs (wall-clock latencies), so figures move a little between runs.

Writes bench/results/lora_routing.json and one line in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import numpy as np
from rich.console import Console

from bench._common import append_line, write_result
from loadgen.replay import ReplayRequest, run_replay_async
from loadgen.schedule import ScheduleOptions
from server.config import MosaicConfig, validate_config
from server.runner import start_gateway_server

MODEL, GPU = "llama-3-8b", "H100"
DEFAULT_WEIGHT = 2.0  # lora-affinity's weight in every routing profile (docs/routing.md)
INPUT, OUTPUT = "uniform:64:256", "uniform:16:64"
_QUEUE_RE = re.compile(r"^vllm:request_queue_time_seconds_(sum|count)\{[^}]*\} ([0-9.eE+-]+)$", re.M)


def gateway_config(
    weight: float, workers: int, adapters: int, max_loras: int, time_scale: float, seed: int
) -> MosaicConfig:
    pool = {
        "name": "h100",
        "model": MODEL,
        "gpu": GPU,
        "role": "mixed",
        "endpoints": {
            "simulated": {
                "replicas": workers,
                "time_scale": time_scale,
                "seed": seed,
                "lora_modules": adapter_names(adapters),
                "max_loras": max_loras,
            }
        },
    }
    return validate_config(
        {
            "models": [{"name": MODEL}],
            "pools": [pool],
            "routing": {"weights": {"lora-affinity": weight}},
            # once per simulated second, as a real deployment scrapes once per second
            "scrape": {"interval_s": 1.0 / time_scale, "stale_after_s": 5.0 / time_scale},
        },
        "bench lora_routing",
    )


def adapter_names(n: int) -> list[str]:
    return [f"lora-{i}" for i in range(n)]


async def worker_queue_time(urls: list[str]) -> tuple[float, int]:
    """Σ and count of `vllm:request_queue_time_seconds` over the workers (each a fresh fleet's)."""
    total, count = 0.0, 0
    async with httpx.AsyncClient(timeout=10) as http:
        for url in urls:
            text = (await http.get(url.rstrip("/") + "/metrics")).text
            for kind, value in _QUEUE_RE.findall(text):
                if kind == "sum":
                    total += float(value)
                else:
                    count += int(float(value))
    return total, count


async def run_once(
    args: argparse.Namespace, weight: float, max_loras: int, seed: int, lora: bool = True
) -> dict[str, Any]:
    """One fresh gateway and fleet, one replay. `lora=False`: every request names the base model (the
    reference floor: the same trace with no slot to wait for)."""
    ts = args.time_scale
    cfg = gateway_config(weight, args.workers, args.adapters, max_loras, ts, seed)
    gw = await start_gateway_server(cfg, "127.0.0.1", 0)
    n = round(args.rate * args.duration)
    # wall-clock arrivals: the simulated rate × time_scale
    spec = f"synthetic:rate={args.rate * ts:g},n={n},input={INPUT},output={OUTPUT},seed={seed}"
    req = ReplayRequest(
        spec,
        gw.url,
        MODEL,
        schedule=ScheduleOptions(seed=seed),
        timeout_s=120.0,
        seed=seed,
        progress=False,
        lora_modules=tuple(adapter_names(args.adapters)) if lora else (),
    )
    t0 = time.perf_counter()
    try:
        with open(os.devnull, "w") as sink:
            out = await run_replay_async(req, Console(file=sink))
        urls = [r.url for r in gw.gateway.registry.records()]
        q_sum, q_count = await worker_queue_time(urls)
    finally:
        await gw.stop()
    wall = time.perf_counter() - t0
    s = out.report["summary"]
    ok = [r for r in out.report["requests"] if r["success"]]
    run = {
        "seed": seed,
        "sent": s["sent"],
        "completed": s["completed"],
        "errors": s["errors"],
        "duration_s": s["duration_s"] * ts,
        "ttft_ms": [r["ttft_ms"] * ts for r in ok],
        "e2el_ms": [r["e2el_ms"] * ts for r in ok],
        "queue_s": (q_sum, q_count),
        "send_lag_p99_ms": round(s["send_lag_ms"]["p99"], 2),  # wall ms
        "requests_by_model": s["requests_by_model"],
        "wall_s": round(wall, 1),
    }
    row = aggregate([run])
    label = f"max_loras {max_loras} weight {weight:g}" if lora else "no adapter (base model)"
    print(
        f"  {label} seed {seed}: {row['completed']}/{row['sent']} ok  {row['throughput_rps']:.2f} req/s  "
        f"TTFT mean {row['ttft_mean_ms']:.0f} p50 {row['ttft_p50_ms']:.0f} p99 {row['ttft_p99_ms']:.0f} ms  "
        f"queue {row['queue_mean_ms']} ms  lag p99 {run['send_lag_p99_ms']} ms  ({run['wall_s']} s)",
        flush=True,
    )
    return run


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests pooled over the runs (repeats with different seeds): one row of the results."""
    ttft = np.array([x for r in runs for x in r["ttft_ms"]])
    e2el = np.array([x for r in runs for x in r["e2el_ms"]])
    q_sum = sum(r["queue_s"][0] for r in runs)
    q_count = sum(r["queue_s"][1] for r in runs)
    completed = sum(r["completed"] for r in runs)
    errors: dict[str, int] = {}
    sent_by_model: dict[str, int] = {}
    for r in runs:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
        for m, counts in r["requests_by_model"].items():
            sent_by_model[m] = sent_by_model.get(m, 0) + counts["sent"]
    return {
        "runs": len(runs),
        "sent": sum(r["sent"] for r in runs),
        "completed": completed,
        "errors": errors,
        "throughput_rps": round(completed / sum(r["duration_s"] for r in runs), 3),  # per simulated s
        "ttft_mean_ms": round(float(ttft.mean()), 1) if ttft.size else None,
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1) if ttft.size else None,
        "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1) if ttft.size else None,
        "e2el_mean_ms": round(float(e2el.mean()), 1) if e2el.size else None,
        "queue_mean_ms": round(1000 * q_sum / q_count, 1) if q_count else None,
        "sent_by_model": dict(sorted(sent_by_model.items())),
        "send_lag_p99_ms_max": max(r["send_lag_p99_ms"] for r in runs),  # wall ms, worst run
        "wall_s": round(sum(r["wall_s"] for r in runs), 1),
    }


def ratios(
    rows: dict[str, dict[str, Any]], base: str = "0", default: str = f"{DEFAULT_WEIGHT:g}"
) -> dict[str, float | None]:
    b, d = rows[base], rows[default]
    return {  # None where the baseline is 0 (strict JSON has no NaN)
        f"{k}_default_over_baseline": round(d[k] / b[k], 3) if b[k] else None
        for k in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "queue_mean_ms")
        if d.get(k) is not None and b.get(k) is not None
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "config": {
            "workers": args.workers,
            "gpu": GPU,
            "model": MODEL,
            "adapters": args.adapters,
            "max_loras": args.max_loras,
            "weights": args.weights,
            "rate_rps": args.rate,
            "duration_s": args.duration,
            "requests": round(args.rate * args.duration),
            "input": INPUT,
            "output": OUTPUT,
            "time_scale": args.time_scale,
            "seeds": [args.seed + r for r in range(args.repeat)],
            "load_avg_at_start": list(os.getloadavg()),
        },
        "runs": {},
        "ratios": {},
    }
    print("== reference: the same traces naming the base model (no max_loras slot to wait for)", flush=True)
    seeds = [args.seed + r for r in range(args.repeat)]
    floor = aggregate([await run_once(args, DEFAULT_WEIGHT, 1, seed, lora=False) for seed in seeds])
    results["no_adapter"] = floor
    # Offered load if each worker ran one request at a time: arrivals × unloaded service time / workers (the
    # floor run's mean E2E latency is nearly the unloaded service time: it queues little). max_loras 1 with
    # every adapter on every worker approaches that serialisation when the router ignores adapters.
    results["config"]["one_at_a_time_load"] = round(
        args.rate * floor["e2el_mean_ms"] / 1000 / args.workers, 3
    )
    for ml in args.max_loras:
        print(
            f"== max_loras {ml}: {args.workers} × {GPU}, {args.adapters} adapters, {args.rate:g} req/s",
            flush=True,
        )
        raw: dict[str, list[dict[str, Any]]] = {f"{w:g}": [] for w in args.weights}
        # repeat-major: every weight sees each seed once, close together in time (the machine's load drifts)
        for seed in seeds:
            for w in args.weights:
                raw[f"{w:g}"].append(await run_once(args, w, ml, seed))
        rows = {w: aggregate(runs) for w, runs in raw.items()}
        results["runs"][str(ml)] = rows
        ratio: dict[str, Any] = {}
        if "0" in rows and f"{DEFAULT_WEIGHT:g}" in rows:
            ratio = ratios(rows)
            # the same ratios per seed: how much of the pooled ratio one trace moves
            ratio["per_seed"] = [
                ratios({"0": aggregate([b]), f"{DEFAULT_WEIGHT:g}": aggregate([d])})
                for b, d in zip(raw["0"], raw[f"{DEFAULT_WEIGHT:g}"], strict=True)
            ]
        ratio["best_weight_by_ttft_mean"] = float(min(rows, key=lambda k: rows[k]["ttft_mean_ms"]))
        results["ratios"][str(ml)] = ratio
        for w, row in rows.items():
            print(
                f"  pooled weight {w}: TTFT mean {row['ttft_mean_ms']:.0f} p50 {row['ttft_p50_ms']:.0f} "
                f"p99 {row['ttft_p99_ms']:.0f} ms  queue {row['queue_mean_ms']} ms  {row['throughput_rps']:.2f} req/s",
                flush=True,
            )
        print(f"  default/baseline: {ratio}", flush=True)
    return results


def summary_line(results: dict[str, Any]) -> str:
    parts = []
    for ml, rows in results["runs"].items():
        r = results["ratios"].get(ml, {})
        base, dflt = rows.get("0"), rows.get(f"{DEFAULT_WEIGHT:g}")
        if base is None or dflt is None:
            continue
        parts.append(
            f"max_loras {ml}: TTFT p50 {base['ttft_p50_ms']:.0f}→{dflt['ttft_p50_ms']:.0f} ms "
            f"(×{r['ttft_p50_ms_default_over_baseline']:.2f}), p99 {base['ttft_p99_ms']:.0f}→{dflt['ttft_p99_ms']:.0f} ms "
            f"(×{r['ttft_p99_ms_default_over_baseline']:.2f}), mean ×{r['ttft_mean_ms_default_over_baseline']:.2f} "
            f"(weight 0→2); lowest mean TTFT at weight {r['best_weight_by_ttft_mean']:g}"
        )
    c = results["config"]
    floor = results["no_adapter"]
    return (
        f"{c['workers']}×{c['gpu']}, {c['adapters']} adapters, {c['rate_rps']:g} req/s × {c['duration_s']:g} s "
        f"(simulated; one-at-a-time load {c['one_at_a_time_load']:.2f}): "
        + "; ".join(parts)
        + f"; no-adapter floor TTFT p50 {floor['ttft_p50_ms']:.0f} p99 {floor['ttft_p99_ms']:.0f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter run, weights 0 and 2, max_loras 1 only")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--max-loras", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 2.0, 4.0, 8.0])
    ap.add_argument("--rate", type=float, default=6.0, help="simulated requests per second")
    ap.add_argument("--duration", type=float, default=30.0, help="simulated seconds of arrivals")
    ap.add_argument("--time-scale", type=float, default=5.0, help="simulated seconds per wall second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=2, help="runs per weight, seeds seed, seed+1, ... (pooled)")
    ap.add_argument("--dry-run", action="store_true", help="print only: no JSON or BENCHMARKS.md line")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.weights, args.max_loras, args.repeat = 20.0, [0.0, 2.0], [1], 1
    results = asyncio.run(main_async(args))
    line = summary_line(results)
    print(line)
    if args.dry_run:
        return
    path = write_result("lora_routing", results)
    cmd = "python " + " ".join(["bench/lora_routing.py", *sys.argv[1:]])
    append_line("lora_routing", cmd, line)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
