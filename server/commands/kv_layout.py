"""`mosaic kv-layout`: head groups for ragged paging (H heads per page table) and their TP partition.

    mosaic kv-layout --profile profile.npz --heads-per-group 4 [--tp 2] [--alpha 2] [--json]

Reads a per-head retention profile (Tangram `.npz`, or JSON/CSV: `placement/kv_profile.py`), groups heads by
sorted chunking of μ + α·σ (optimal for the sum of group maxima), and reports the padding of three layouts
against the ideal: monolithic (one budget for every head), adjacent heads, sorted groups. With `--tp N` it
partitions heads over N tensor-parallel ranks with CP-SAT (min-max per-rank pages) and prints the per-layer
KV-head permutation that realises it. `--json` output is stable for scripts (keys below).
"""

from __future__ import annotations

import json
from typing import Any

import typer

from placement.kv_layout import layout_report, sorted_groups
from placement.kv_profile import HeadProfile, ProfileError, load_head_profile
from placement.kv_tp import TpPartition, tp_partition
from placement.solver import MAX_TIME_LIMIT_S
from server.commands.common import check_number, fail


def layout_payload(
    profile: HeadProfile, heads_per_group: int, alpha: float, tp: int, time_limit_s: float
) -> dict[str, Any]:
    """The `--json` document: profile facts, layout report, groups, and the TP partition (or null)."""
    report = layout_report(profile, heads_per_group, alpha)
    groups = sorted_groups(profile, heads_per_group, alpha)
    h = profile.kv_heads
    out: dict[str, Any] = {
        "profile": profile.name,
        "layers": profile.layers,
        "kv_heads": h,
        "sink": profile.sink,
        "window": profile.window,
        "heads_per_group": heads_per_group,
        "alpha": alpha,
        "report": report.as_dict(),
        "groups": [
            {"budget": round(b, 6), "members": [[f // h, f % h] for f in m]}
            for m, b in zip(groups.members, groups.budgets, strict=True)
        ],
        "tp": None,
    }
    if tp > 1:
        part = tp_partition(profile.budgets(alpha), tp, heads_per_group, time_limit_s)
        out["tp"] = tp_payload(part, h)
    return out


def tp_payload(part: TpPartition, heads: int) -> dict[str, Any]:
    return {
        "tp": part.tp,
        "status": part.status,
        "rank_cost": [round(c, 6) for c in part.rank_cost],
        "max_cost": round(part.max_cost, 6),
        "contiguous_rank_cost": [round(c, 6) for c in part.contiguous_rank_cost],
        "contiguous_max_cost": round(part.contiguous_max_cost, 6),
        "lower_bound": round(part.lower_bound, 6),
        "rank_groups": [[[[f // heads, f % heads] for f in g] for g in rank] for rank in part.rank_groups],
        "groups_per_rank": [len(r) for r in part.rank_groups],
        "permutation": part.permutation(),
    }


def render(doc: dict[str, Any]) -> str:
    r = doc["report"]
    lines = [
        f"profile {doc['profile']}: {doc['layers']} layers × {doc['kv_heads']} KV heads = {r['heads']} heads, "
        f"sink {doc['sink']}, window {doc['window']}; budgets μ + {doc['alpha']:g}·σ, {doc['heads_per_group']} heads per page table",
        f"{'layout':<12}{'cost':>10}{'waste':>9}{'over-alloc':>12}",
        f"{'ideal':<12}{r['ideal']:>10.3f}{'':>9}{'':>12}",
    ]
    for name in ("monolithic", "adjacent", "sorted"):
        lines.append(
            f"{name:<12}{r[name + '_cost']:>10.3f}{r[name + '_waste']:>9.1%}{r[name + '_over_allocation']:>12.1%}"
        )
    lines.append(
        f"sorted groups reclaim {r['sorted_saves_of_full_kv_vs_adjacent']:.1%} of the full KV against adjacent heads; "
        f"{len(doc['groups'])} groups, budgets {doc['groups'][-1]['budget']:.3f}–{doc['groups'][0]['budget']:.3f}"
    )
    tp = doc["tp"]
    if tp is not None:
        lines.append(
            f"TP {tp['tp']} ({tp['status']}): per-rank cost {', '.join(f'{c:.3f}' for c in tp['rank_cost'])} "
            f"(max {tp['max_cost']:.3f}, lower bound {tp['lower_bound']:.3f}); "
            f"stock contiguous sharding max {tp['contiguous_max_cost']:.3f}"
        )
        lines.append("KV-head permutation per layer (new order → original head):")
        for layer, perm in enumerate(tp["permutation"]):
            lines.append(f"  layer {layer}: {perm}")
    lines.append(
        "cost = Σ_g |g|·max budget (head-budget units; × tokens = head-tokens); waste = (cost − ideal)/cost"
    )
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    @app.command("kv-layout")
    def kv_layout(
        profile: str = typer.Option(
            ..., "--profile", help="Per-head retention profile: Tangram .npz, .json or .csv."
        ),
        heads_per_group: int = typer.Option(
            ..., "--heads-per-group", help="Heads per page table (H_p), e.g. 4."
        ),
        tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks to partition head groups over."),
        alpha: float = typer.Option(2.0, "--alpha", help="Budget per head = μ + α·σ."),
        time_limit: float = typer.Option(
            5.0, "--time-limit", help="CP-SAT limit for the TP partition, seconds."
        ),
        as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        """Group KV heads into page tables (sorted chunking) and partition them across TP ranks."""
        if heads_per_group < 1:
            fail(f"--heads-per-group must be ≥ 1, got {heads_per_group}")
        if tp < 1:
            fail(f"--tp must be ≥ 1, got {tp}")
        check_number("--alpha", alpha, inclusive=True)
        check_number("--time-limit", time_limit)
        if time_limit > MAX_TIME_LIMIT_S:  # the planner's bound: CP-SAT ran unbounded past 1e300 s
            fail(f"--time-limit must be ≤ {MAX_TIME_LIMIT_S:g} s (a day), got {time_limit:g}")
        try:
            prof = load_head_profile(profile)
        except ProfileError as exc:
            fail(str(exc))
        if prof.kv_heads % tp:
            fail(f"--tp {tp} must divide the profile's {prof.kv_heads} KV heads per layer")
        doc = layout_payload(prof, heads_per_group, alpha, tp, time_limit)
        typer.echo(json.dumps(doc) if as_json else render(doc))
