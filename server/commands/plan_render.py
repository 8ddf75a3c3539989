"""Readable tables for `mosaic plan` (rich). The JSON form is `placement.plan_report.plan_to_dict`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table


def _money(x: float | None) -> str:
    return "—" if x is None else f"${x:,.2f}"


def _gpus(g: Mapping[str, int] | None) -> str:
    return "—" if not g else ", ".join(f"{n}× {name}" for name, n in sorted(g.items()))


def render_plan(doc: Mapping[str, Any], console: Console) -> None:
    """Print the plan document (`plan_to_dict` output) as tables."""
    gap = f"gap {doc['gap']:.2%}" if doc["status"] != "optimal" else "proven optimal"
    variant = doc["variant"] + (
        f" (slice factor {doc['slice_factor']})" if doc["variant"] == "sliced" else ""
    )
    console.print(
        f"[bold]Cheapest fleet[/bold]: {_money(doc['cost_per_hour'])}/h  ·  {_gpus(doc['gpus'])}  ·  "
        f"{doc['status']} ({gap})  ·  {variant}  ·  {doc['engine']}  ·  {doc['wall_s'] * 1000:.0f} ms"
    )
    table = Table(title="Instances")
    for col in ("model", "GPU", "tp", "role", "instances", "GPUs", "$/h", "load"):
        table.add_column(
            col, justify="right" if col in ("tp", "instances", "GPUs", "$/h", "load") else "left"
        )
    for row in doc["instances"]:
        if row["count"]:
            table.add_row(
                row["model"],
                row["gpu"],
                str(row["tp"]),
                row["role"],
                str(row["count"]),
                str(row["gpus"]),
                _money(row["cost_per_hour"]),
                f"{row['load']:.3f}",
            )
    console.print(table)
    _singles(doc, console)
    _assignment(doc, console)
    if doc.get("time_varying"):
        _time_varying(doc["time_varying"], console)
    if doc.get("what_if"):
        _what_if(doc["what_if"], console)
    if doc.get("placement"):
        render_placement(doc["placement"], console)
    for d in doc.get("dropped", []):
        reason = d.get("reason", "no GPU type serves it within the SLO")
        what = d["model"] if d["bucket"] == reason else f"{d['model']} {d['bucket']}"
        console.print(f"[yellow]dropped[/yellow]: {what} ({d['rate']:g} req/s) — {reason}")
    for note in doc.get("notes", []):
        console.print(f"note: {note}")


def _singles(doc: Mapping[str, Any], console: Console) -> None:
    best, savings = doc["single_type"]["best"], doc.get("savings")
    table = Table(title="Single GPU type (Mélange's baseline)")
    for col in ("GPU", "fleet", "$/h", ""):
        table.add_column(col)
    for row in doc["single_type"]["all"]:
        mark = "best" if best and row["gpu"] == best["gpu"] else ""
        table.add_row(
            row["gpu"],
            _gpus(row["gpus"]) if row["gpus"] else row["reason"],
            _money(row["cost_per_hour"]),
            mark,
        )
    console.print(table)
    if best and savings:
        console.print(
            f"Savings against {best['gpu']} alone: {_money(savings['per_hour'])}/h ({savings['fraction']:.1%})"
        )
    elif not best:
        console.print("No single GPU type can serve the whole workload; the mix is the only answer.")


def _assignment(doc: Mapping[str, Any], console: Console) -> None:
    rows = doc["assignment"]
    if not rows:
        return
    title = "Routing hints: share of each bucket's requests per instance type"
    if doc.get("time_varying"):  # one table per window would drown the reader: show the busiest
        busiest = max(doc["time_varying"]["windows"], key=lambda w: w["rate"])["index"]
        rows = [r for r in rows if r.get("window") == busiest]
        title += f" (busiest window {busiest}; every window in --json)"
    table = Table(title=title)
    for col in ("model", "input tokens", "output tokens", "req/s", "shares"):
        table.add_column(col)
    for r in rows[:60]:
        inp = f"[{r['input'][0]}, {r['input'][1]})" if "input" in r else f"#{r['bucket'][0]}"
        out = f"[{r['output'][0]}, {r['output'][1]})" if "output" in r else f"#{r['bucket'][1]}"
        shares = ", ".join(f"{k.split('/', 1)[1]} {v:.0%}" for k, v in r["shares"].items())
        table.add_row(r["model"], inp, out, f"{r['rate']:.3g}", shares)
    console.print(table)
    if len(rows) > 60:
        console.print(f"… {len(rows) - 60} more buckets in --json")


def _time_varying(tv: Mapping[str, Any], console: Console) -> None:
    table = Table(title=f"Time-varying plan ({tv['hours']:.3g} h)")
    for col in ("window", "start", "req/s", "fleet", "$/h", "status"):
        table.add_column(col)
    for w in tv["windows"]:
        table.add_row(
            str(w["index"]),
            f"{w['start_s'] / 3600:.2f} h",
            f"{w['rate']:.3g}",
            _gpus(w["gpus"]),
            _money(w["cost_per_hour"]),
            w["status"],
        )
    console.print(table)
    dyn, st = tv["dynamic"], tv["static"]
    console.print(
        f"Per-window fleets: {dyn['gpu_hours']:.1f} GPU-h, {_money(dyn['cost'])}  ·  one static fleet for the peak "
        f"({_gpus(st['gpus'])}): {st['gpu_hours']:.1f} GPU-h, {_money(st['cost'])}  ·  saves {tv['savings_fraction']:.1%}"
    )


def _what_if(rows: list[Mapping[str, Any]], console: Console) -> None:
    table = Table(title="What if")
    for col in ("TPOT ms", "TTFT ms", "rate ×", "req/s", "fleet", "$/h", "best single", "savings"):
        table.add_column(col)
    for r in rows:
        head = [
            "—" if r["tpot_ms"] is None else f"{r['tpot_ms']:g}",
            "—" if r["ttft_ms"] is None else f"{r['ttft_ms']:g}",
            f"{r['rate_scale']:g}",
            f"{r['rate']:.3g}",
        ]
        if r["status"] == "error":
            table.add_row(*head, f"[red]{r['error']}[/red]", "", "", "")
            continue
        best = r["best_single"]
        single = "—" if best is None else f"{best['gpu']} {_money(best['cost_per_hour'])}"
        saving = "—" if r["savings_fraction"] is None else f"{r['savings_fraction']:.1%}"
        table.add_row(*head, _gpus(r["gpus"]), _money(r["cost_per_hour"]), single, saving)
    console.print(table)


def render_placement(p: Mapping[str, Any], console: Console) -> None:
    table = Table(
        title=f"Placement on nodes ({p['status']}, {p['cross_domain_pairs']} cross-domain P/D pairs, {len(p['fragmented_nodes'])} fragmented nodes)"
    )
    for col in ("node", "domain", "instances"):
        table.add_column(col)
    for node in p["nodes"]:
        table.add_row(node["name"], node["domain"], ", ".join(node["instances"]) or "—")
    console.print(table)
