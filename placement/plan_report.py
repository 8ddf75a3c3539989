"""The stable JSON form of a plan (`mosaic plan --json`), schema `mosaic.plan/v1`; docs/placement.md documents it.

Keys are only ever added. Money is $/hour (`*_per_hour`) or $ over the planned time (`cost`), rates req/s,
times seconds. Fractions in `assignment[].shares` sum to 1 per bucket (prefill and decode shares are
reported separately under `prefill`/`decode` roles of the same bucket, each summing to the P/D share).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from placement.binpacking import MixSolution
from placement.planner import Plan, WhatIfRow
from placement.solver import SingleType
from placement.topology import InstanceKind, Node, Placement

PLAN_SCHEMA = "mosaic.plan/v1"


def _r(x: float, nd: int = 6) -> float:
    return round(x, nd)


def solution_summary(s: MixSolution) -> dict[str, Any]:
    return {
        "status": s.status.value,
        "cost_per_hour": _r(s.cost_per_hour),
        "gpus": dict(sorted(s.gpus.items())),
        "gap": _r(s.gap, 9),
        "bound_per_hour": _r(s.bound),
        "wall_s": _r(s.wall_s),
        "engine": s.engine,
    }


def instances(plan: Plan) -> list[dict[str, Any]]:
    s = plan.solution
    rows = []
    for opt in plan.problem.options:
        rows.append(
            {
                "key": opt.key,
                "model": opt.model,
                "gpu": opt.gpu,
                "tp": opt.tp,
                "role": opt.role.value,
                "count": s.counts[opt.key],
                "gpus": s.counts[opt.key] * opt.tp,
                "cost_per_hour": _r(s.counts[opt.key] * plan.problem.option_cost(opt)),
                "load": _r(s.loads[opt.key]),
            }
        )
    return rows


def assignment(plan: Plan, window: int = 0) -> list[dict[str, Any]]:
    """Routing hints: for each bucket with demand, the share of its requests each option takes."""
    out = []
    for (model, b), shares in sorted(plan.solution.fractions[window].items()):
        grid = plan.grids[model]
        i, j = grid.cell(b)
        rate = next(d.rates[b] for d in plan.problem.windows[window] if d.model == model)
        row: dict[str, Any] = {
            "model": model,
            "bucket": [i, j],
            "rate": _r(rate),
            "shares": {k: _r(v) for k, v in sorted(shares.items())},
        }
        if len(plan.problem.windows) > 1:
            row["window"] = window
        if grid.input_edges is not None and grid.output_edges is not None:
            row["input"] = [grid.input_edges[i], grid.input_edges[i + 1]]
            row["output"] = [grid.output_edges[j], grid.output_edges[j + 1]]
        out.append(row)
    return out


def single_types(singles: Sequence[SingleType]) -> list[dict[str, Any]]:
    rows = []
    for st in singles:
        sol = st.solution
        rows.append(
            {
                "gpu": st.gpu,
                "cost_per_hour": None if sol is None else _r(sol.cost_per_hour),
                "gpus": None if sol is None else dict(sol.gpus),
                "status": None if sol is None else sol.status.value,
                "reason": st.reason,
            }
        )
    return rows


def time_varying(plan: Plan) -> dict[str, Any] | None:
    if not plan.per_window:
        return None
    hours = [d / 3600.0 for d in plan.durations_s]
    start = 0.0
    windows = []
    for k, (sol, dur) in enumerate(zip(plan.per_window, plan.durations_s, strict=True)):
        rate = sum(d.total for d in plan.problem.windows[k])
        windows.append(
            {
                "index": k,
                "start_s": _r(start),
                "duration_s": _r(dur),
                "rate": _r(rate),
                **solution_summary(sol),
            }
        )
        start += dur
    dyn_gpu_h = sum(sum(s.gpus.values()) * h for s, h in zip(plan.per_window, hours, strict=True))
    dyn_cost = sum(s.cost_per_hour * h for s, h in zip(plan.per_window, hours, strict=True))
    static_gpu_h = sum(plan.solution.gpus.values()) * sum(hours)
    static_cost = plan.solution.cost_per_hour * sum(hours)
    return {
        "hours": _r(sum(hours)),
        "windows": windows,
        "dynamic": {"gpu_hours": _r(dyn_gpu_h), "cost": _r(dyn_cost)},
        "static": {
            "gpu_hours": _r(static_gpu_h),
            "cost": _r(static_cost),
            "gpus": dict(sorted(plan.solution.gpus.items())),
        },
        "savings_fraction": _r((static_cost - dyn_cost) / static_cost) if static_cost > 0 else 0.0,
    }


def what_if_rows(rows: Sequence[WhatIfRow]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        row: dict[str, Any] = {
            "tpot_ms": None if r.slo is None else r.slo.tpot_ms,
            "ttft_ms": None if r.slo is None else r.slo.ttft_ms,
            "rate_scale": r.rate_scale,
            "rate": _r(r.rate),
        }
        if r.plan is None:
            row |= {"status": "error", "error": r.error}
        else:
            best = r.plan.best_single
            row |= solution_summary(r.plan.solution)
            row["best_single"] = (
                None
                if best is None or best.solution is None
                else {"gpu": best.gpu, "cost_per_hour": _r(best.solution.cost_per_hour)}
            )
            row["savings_fraction"] = None if r.plan.savings is None else _r(r.plan.savings)
        out.append(row)
    return out


def plan_to_dict(
    plan: Plan, *, what_if: Sequence[WhatIfRow] | None = None, placement: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    s = plan.solution
    best = plan.best_single
    return {
        "schema": PLAN_SCHEMA,
        **solution_summary(s),
        "variant": s.variant.value,
        "slice_factor": s.slice_factor,
        "instances": instances(plan),
        "assignment": [row for w in range(len(plan.problem.windows)) for row in assignment(plan, w)],
        "single_type": {
            "best": None
            if best is None or best.solution is None
            else {
                "gpu": best.gpu,
                "cost_per_hour": _r(best.solution.cost_per_hour),
                "gpus": dict(best.solution.gpus),
            },
            "all": single_types(plan.singles),
        },
        "savings": None
        if plan.savings is None or best is None or best.solution is None
        else {"per_hour": _r(best.solution.cost_per_hour - s.cost_per_hour), "fraction": _r(plan.savings)},
        "dropped": [
            {"model": d.model, "bucket": d.label, "rate": _r(d.rate), "reason": d.reason}
            for d in plan.dropped
        ],
        "time_varying": time_varying(plan),
        "what_if": None if what_if is None else what_if_rows(what_if),
        "placement": None if placement is None else dict(placement),
        "notes": list(plan.notes),
    }


def placement_to_dict(placement: Placement, nodes: Sequence[Node]) -> dict[str, Any]:
    """Where each instance goes: per node, `model/GPU[/tpN][/dpN][/role] ×n` strings; groups → domains."""
    per_node: dict[str, dict[str, int]] = {n.name: {} for n in nodes}
    for p in placement.instances:
        label = p.kind.label
        per_node[p.node][label] = per_node[p.node].get(label, 0) + 1
    return {
        "status": placement.status,
        "cross_domain_pairs": placement.cross_domain_pairs,
        "fragmented_nodes": list(placement.fragmented_nodes),
        "groups": {g: list(d) for g, d in placement.group_domains.items()},
        "nodes": [
            {
                "name": n.name,
                "domain": n.domain,
                "gpu": n.gpu,
                "gpus": n.gpus,
                "instances": [f"{k} ×{c}" for k, c in sorted(per_node[n.name].items())],
            }
            for n in nodes
        ],
        "wall_s": _r(placement.wall_s),
    }


def instance_counts(plan: Plan) -> dict[InstanceKind, int]:
    """The plan's fleet as topology instance kinds (what `place_instances` places)."""
    out: dict[InstanceKind, int] = {}
    for opt in plan.problem.options:
        n = plan.solution.counts[opt.key]
        if n:
            kind = InstanceKind(opt.model, opt.gpu, opt.tp, opt.role)
            out[kind] = out.get(kind, 0) + n
    return out
