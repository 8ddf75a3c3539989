"""The JSON report of a cluster simulation (schema `mosaic.simulate/v1`) and its plots.

```
schema, policy, trace_requests, simulated_s, wall_s, sim_requests_per_wall_s,
requests: {completed, failed, failed_by_reason, aborted_by_scale_in},
slo: {ttft_ms, tpot_ms, attainment_ttft, attainment_tpot, attainment},   # fractions of all requests
goodput_rps,                                    # requests meeting both SLOs per simulated second
latency_ms: {ttft|tpot|e2e: {mean, p50, p90, p99}},
gpu_hours: {by_gpu, total}, cost_usd: {by_gpu, total}, utilization,   # busy GPU-seconds / billed
preemptions, scale_events: [{t, pool, before, after}], replicas: [{t, pool: n, ...}],
topology: null | {kv_link_gbps, kv_link_cross_domain_gbps, kv_transfers: {intra_domain, cross_domain},
          # with `nodes:` (simulator/cluster_topology.py):
          nodes, domains, same_domain, max_cross_domain_pairs, max_fragmented_nodes,
          shortfalls: [{t, pool, requested, placed, why}],
          samples: [{t, cross_domain_pairs, pd_pairs, fragmented_nodes, used_gpus, total_gpus}]},
trace: {rows, skipped, dropped, dropped_by_reason, ...}   # `mosaic simulate`: the reader's counts (replay's)
```
TTFT and TPOT are per request as the load generator defines them (vLLM's benchmark): TPOT = (e2e − TTFT) /
(output − 1). Failed requests count against attainment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from simulator.cluster import SimResult

SCHEMA = "mosaic.simulate/v1"


def _stats(values: np.ndarray) -> dict[str, float | None]:
    if values.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": round(float(values.mean()), 3),
        "p50": round(float(np.percentile(values, 50)), 3),
        "p90": round(float(np.percentile(values, 90)), 3),
        "p99": round(float(np.percentile(values, 99)), 3),
    }


def build_report(result: SimResult, wall_s: float) -> dict[str, Any]:
    slo = result.fleet.slo
    rows = result.completed
    total = result.requests_total
    ttft = np.array([r[1] for r in rows]) * 1e3
    tpot = np.array([r[2] for r in rows if r[2] is not None]) * 1e3
    e2e = np.array([r[3] for r in rows]) * 1e3
    ok_ttft = sum(1 for r in rows if r[1] * 1e3 <= slo.ttft_ms)
    ok_tpot = sum(1 for r in rows if r[2] is None or r[2] * 1e3 <= slo.tpot_ms)
    ok_both = sum(
        1 for r in rows if r[1] * 1e3 <= slo.ttft_ms and (r[2] is None or r[2] * 1e3 <= slo.tpot_ms)
    )
    hours = {gpu: round(s / 3600, 4) for gpu, s in sorted(result.instance_seconds.items())}
    cost = {gpu: round(c, 4) for gpu, c in sorted(result.cost_usd.items())}
    span = max(result.end_s, 1e-9)
    return {
        "schema": SCHEMA,
        "policy": result.policy,
        "trace_requests": total,
        "simulated_s": round(result.end_s, 3),
        "wall_s": round(wall_s, 3),
        "sim_requests_per_wall_s": round(total / wall_s, 1) if wall_s > 0 else None,
        "requests": {
            "completed": len(rows),
            "failed": sum(result.failed.values()),
            "failed_by_reason": dict(sorted(result.failed.items())),
            "aborted_by_scale_in": result.aborted_by_scale_in,
        },
        "slo": {
            "ttft_ms": slo.ttft_ms,
            "tpot_ms": slo.tpot_ms,
            "attainment_ttft": round(ok_ttft / total, 5) if total else None,
            "attainment_tpot": round(ok_tpot / total, 5) if total else None,
            "attainment": round(ok_both / total, 5) if total else None,
        },
        "goodput_rps": round(ok_both / span, 4),
        "latency_ms": {"ttft": _stats(ttft), "tpot": _stats(tpot), "e2e": _stats(e2e)},
        "gpu_hours": {"by_gpu": hours, "total": round(sum(result.instance_seconds.values()) / 3600, 4)},
        "cost_usd": {"by_gpu": cost, "total": round(sum(result.cost_usd.values()), 4)},
        "utilization": round(result.busy_seconds / result.billed_seconds, 4)
        if result.billed_seconds
        else None,
        "preemptions": result.preemptions,
        "scale_events": result.scale_events,
        "replicas": result.replicas,
        "topology": result.topology,
    }


def write_plots(report: dict[str, Any], result: SimResult, directory: Path) -> list[Path]:
    """`replicas.png` (instances per pool over time) and `latency.png` (TTFT/TPOT of requests by arrival)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(8, 3.5))
    samples = report["replicas"]
    for pool in (k for k in samples[0] if k != "t") if samples else ():
        ax.step([s["t"] / 60 for s in samples], [s[pool] for s in samples], where="post", label=pool)
    ax.set_xlabel("time (min)")
    ax.set_ylabel("instances")
    ax.set_title(f"replicas — policy {report['policy']}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    paths.append(directory / "replicas.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.5))
    rows = result.completed
    ax.scatter([r[0] / 60 for r in rows], [r[1] * 1e3 for r in rows], s=2, label="TTFT (ms)")
    ax.scatter([r[0] / 60 for r in rows if r[2]], [r[2] * 1e3 for r in rows if r[2]], s=2, label="TPOT (ms)")
    ax.axhline(report["slo"]["ttft_ms"], color="C0", ls="--", lw=0.8)
    ax.axhline(report["slo"]["tpot_ms"], color="C1", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("arrival (min)")
    ax.set_title("latency by arrival (dashed: SLO)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    paths.append(directory / "latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
