"""`mosaic plan`: the cheapest GPU mix that meets the SLO, and where to put it (docs/placement.md).

    mosaic plan --workload W --gpus G --profile P [--profile P2 ...] --slo-tpot-ms T [--nodes N] [--json]
    mosaic plan --trace T --gpus G --profile P ... [--window-s 3600] [--rate R]
    mosaic plan --melange F [--variant continuous] [--json]
    ... [--what-if tpot_ms=40,120 --what-if rate_scale=0.5,1,2]

Input assembly only: the model lives in `placement.planner`, the JSON in `placement.plan_report`, the
tables in `plan_render`. A trace is binned on the profiles' bucket edges with the load generator's readers.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import replace
from typing import Any, Literal

import typer
from rich.console import Console

from placement.binpacking import PlacementError, Variant
from placement.catalog import Catalog, CatalogError, load_catalog
from placement.counts import MAX_PLAN_INSTANCES
from placement.melange import MELANGE_MODEL, MelangeInput, load_melange
from placement.offers import canonical_gpu
from placement.plan_report import instance_counts, placement_to_dict, plan_to_dict
from placement.planner import (
    Grid,
    Plan,
    PlanInput,
    WhatIfRow,
    canonical_model,
    drop_unserved,
    load_gpu_offers,
    make_plan,
    select_profiles,
    solve_plan,
    what_if,
)
from placement.profiles import ProfileError, Slo, ThroughputProfile, load_profile, read_structured
from placement.topology import groups_from_counts, nodes_from_dict, place_instances
from placement.workload import ModelWorkload, WorkloadError, histogram_from_requests, load_workload
from server.commands.common import check_number, fail, number_error
from server.commands.plan_render import render_plan

WHAT_IF_KEYS = ("tpot_ms", "ttft_ms", "rate_scale", "rate")


def parse_what_if(specs: list[str]) -> dict[str, list[float]]:
    """`key=v1,v2` specs → {key: [values]}; keys tpot_ms, ttft_ms, rate_scale, rate."""
    out: dict[str, list[float]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in WHAT_IF_KEYS:
            raise PlacementError(
                f"--what-if {spec!r}: expected KEY=V1,V2 with KEY one of {', '.join(WHAT_IF_KEYS)}"
            )
        try:
            vals = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise PlacementError(f"--what-if {spec!r}: values must be numbers") from None
        if not vals:
            raise PlacementError(f"--what-if {spec!r}: give one or more values > 0")
        for v in vals:
            if message := number_error(f"--what-if {key}", v):
                raise PlacementError(message)
        out.setdefault(key, []).extend(vals)
    if "rate" in out and "rate_scale" in out:
        raise PlacementError("--what-if: give rate or rate_scale, not both")
    return out


def _trace_workload(
    path: str,
    fmt: str | None,
    model: str | None,
    profiles: list[ThroughputProfile],
    slo: Slo | None,
    window_s: float | None,
    rate: float | None,
    *,
    offered: Collection[str],
    mode: Literal["auto", "mixed", "pd"],
    catalog: Catalog,
) -> ModelWorkload:
    """The trace binned on the bucket grid of the profiles the plan can use: those of offered GPUs, of the
    `mode`'s roles, at the SLO (a profile the plan would not use gave the grid, and refused a trace the plan
    itself could serve)."""
    try:
        from loadgen.formats import open_trace
        from loadgen.trace import TraceError
    except ImportError:  # pragma: no cover - loadgen ships with Mosaic; kept for partial installs
        fail("--trace needs the load generator's trace readers (loadgen), which are not installed")
    chosen, notes = select_profiles(profiles, slo, mode, catalog)
    chosen = [p for p in chosen if canonical_gpu(p.gpu, catalog) in offered]
    if not chosen:
        raise PlacementError(f"no usable profile: {'; '.join(notes) or 'none given'}")
    models = sorted({canonical_model(p.model, catalog) for p in chosen})
    if model is None and len(models) != 1:
        raise PlacementError(f"profiles cover models {models}: say which one the trace is with --model")
    name = canonical_model(model or models[0], catalog)
    grid = next((p for p in chosen if canonical_model(p.model, catalog) == name), None)
    if grid is None:
        raise PlacementError(f"no profile for model {model!r}; the profiles cover {', '.join(models)}")
    try:
        trace = open_trace(path, fmt)
        rows = ((r.arrival_s, r.input_tokens, r.output_tokens) for r in trace)
        return histogram_from_requests(
            rows,
            name,
            grid.input_edges,
            grid.output_edges,
            window_s=window_s,
            rate=rate,
            end_s=_trace_end(trace.source) if trace.format == "synthetic" else None,
            start_s=0.0 if trace.format == "synthetic" else None,
        )
    except TraceError as exc:  # the readers' hint names replay's and simulate's --format
        raise PlacementError(str(exc).replace("; use --format", "; use --trace-format")) from None


def _trace_end(spec: str) -> float | None:
    """A synthetic trace's end when its spec fixes it (duration=S without n=N); None otherwise."""
    from loadgen import synthetic

    parsed = synthetic.parse_spec(spec)
    return parsed.duration_s if parsed.n is None else None


def _melange_plan(
    mi: MelangeInput,
    variant: Variant | None,
    slice_factor: int | None,
    engine: str,
    time_limit_s: float,
    scales: list[float],
    drop_unservable: bool = False,
) -> tuple[Plan, list[WhatIfRow] | None]:
    settings: dict[str, Any] = {
        "variant": variant or Variant.SLICED,
        "slice_factor": mi.slice_factor if slice_factor is None else slice_factor,
        "engine": engine,
        "time_limit_s": time_limit_s,
    }
    grids = {MELANGE_MODEL: Grid(None, None, mi.shape)}
    base, dropped = drop_unserved(mi.problem, grids) if drop_unservable else (mi.problem, [])
    plan = solve_plan(base, grids, (3600.0,), dropped, notes=mi.notes, **settings)
    if not scales:
        return plan, None
    rows = []
    for scale in scales:
        demand = tuple(replace(d, rates=tuple(r * scale for r in d.rates)) for d in base.windows[0])
        problem = replace(base, windows=(demand,))
        total = sum(d.total for d in demand)
        try:
            rows.append(WhatIfRow(None, scale, total, solve_plan(problem, grids, (3600.0,), **settings)))
        except PlacementError as exc:
            rows.append(WhatIfRow(None, scale, total, None, str(exc)))
    return plan, rows


def _what_if_axes(
    spec: dict[str, list[float]], base: Slo | None, peak: float
) -> tuple[list[Slo | None], list[float]]:
    tpots: list[float | None] = [*spec.get("tpot_ms", [])] or [base.tpot_ms if base else None]
    ttfts: list[float | None] = [*spec.get("ttft_ms", [])] or [base.ttft_ms if base else None]
    slos: list[Slo | None] = []
    for tp in tpots:
        for tf in ttfts:
            slos.append(
                None
                if tp is None and tf is None and base is None
                else Slo(tpot_ms=tp, ttft_ms=tf, e2e_ms=base.e2e_ms if base else None)
            )
    if "rate" in spec:
        return slos, [r / peak for r in spec["rate"]]
    return slos, spec.get("rate_scale") or [1.0]


def run_plan(opts: dict[str, Any]) -> dict[str, Any]:
    """Everything `mosaic plan` does short of printing; returns the plan document (schema mosaic.plan/v1)."""
    spec = parse_what_if(opts["what_if"] or [])
    variant = Variant(opts["variant"]) if opts["variant"] else None
    _refuse_flags_that_do_not_apply(opts)
    if opts["melange"]:
        if opts["workload"] or opts["trace"] or opts["profile"] or opts["gpus"]:
            raise PlacementError(
                "--melange takes the whole problem from its file: drop --workload/--trace/--gpus/--profile"
            )
        if "tpot_ms" in spec or "ttft_ms" in spec or "rate" in spec:
            raise PlacementError(
                "--what-if with --melange varies rate_scale only (the file holds one profile per GPU)"
            )
        mi = load_melange(opts["melange"])
        plan, rows = _melange_plan(
            mi,
            variant,
            opts["slice_factor"],
            opts["engine"],
            opts["time_limit"],
            spec.get("rate_scale", []),
            opts["drop_unservable"],
        )
    else:
        plan, rows = _mosaic_plan(opts, spec, variant)
    placement = None
    if opts["nodes"]:
        catalog = load_catalog(opts["catalog"]) if opts["catalog"] else load_catalog()
        nodes, cap, same = nodes_from_dict(
            read_structured(opts["nodes"], PlacementError),
            opts["nodes"],
            catalog,
            known_gpus=plan.problem.gpus,  # a node GPU nobody offers and the catalog lacks is a typo
        )
        same_domain: Literal["prefer", "require"] = (
            "require" if (opts["same_domain"] or same) == "require" else "prefer"
        )
        placed = place_instances(
            nodes,
            groups_from_counts(instance_counts(plan), cap),
            same_domain=same_domain,
            time_limit_s=opts["time_limit"],
        )
        placement = placement_to_dict(placed, nodes)
    return plan_to_dict(plan, what_if=rows, placement=placement)


TRACE_ONLY = (
    ("--rate", "rate"),
    ("--window-s", "window_s"),
    ("--model", "model"),
    ("--trace-format", "trace_format"),
)
NOT_MELANGE = (
    ("--slo-tpot-ms", "slo_tpot_ms", "its throughputs are already measured within the SLO"),
    ("--slo-ttft-ms", "slo_ttft_ms", "its throughputs are already measured within the SLO"),
    ("--mode", "mode", "it has one mixed instance type per GPU"),
)


def _refuse_flags_that_do_not_apply(opts: dict[str, Any]) -> None:
    """A flag the chosen input ignores would change nothing while looking as if it did: refuse it."""
    if not opts["trace"] and (opts["workload"] or opts["melange"]):
        for flag, key in TRACE_ONLY:
            if opts[key] is not None:
                raise PlacementError(f"{flag} applies to --trace only")
    if opts["melange"]:
        for flag, key, why in NOT_MELANGE:
            if opts[key] is not None and not (key == "mode" and opts[key] == "auto"):
                raise PlacementError(f"{flag} does not apply to --melange: {why}")
    if opts["same_domain"] is not None and not opts["nodes"]:
        raise PlacementError("--same-domain applies with --nodes only")


def _mosaic_plan(
    opts: dict[str, Any], spec: dict[str, list[float]], variant: Variant | None
) -> tuple[Plan, list[WhatIfRow] | None]:
    if not opts["gpus"] or not opts["profile"]:
        raise PlacementError("give --gpus and at least one --profile (or --melange FILE)")
    if bool(opts["workload"]) == bool(opts["trace"]):
        raise PlacementError("give exactly one of --workload or --trace")
    catalog = load_catalog(opts["catalog"]) if opts["catalog"] else load_catalog()
    profiles = [load_profile(p) for p in opts["profile"]]
    slo = None
    if opts["slo_tpot_ms"] is not None or opts["slo_ttft_ms"] is not None:
        slo = Slo(tpot_ms=opts["slo_tpot_ms"], ttft_ms=opts["slo_ttft_ms"])
    offers = load_gpu_offers(opts["gpus"], catalog)
    if opts["workload"]:
        workloads = load_workload(opts["workload"])
    else:
        workloads = (
            _trace_workload(
                opts["trace"],
                opts["trace_format"],
                opts["model"],
                profiles,
                slo,
                opts["window_s"],
                opts["rate"],
                offered=set(offers),
                mode=opts["mode"],
                catalog=catalog,
            ),
        )
    inp = PlanInput(
        offers=offers,
        profiles=tuple(profiles),
        workloads=workloads,
        slo=slo,
        mode=opts["mode"],
        variant=variant or Variant.CONTINUOUS,
        slice_factor=4 if opts["slice_factor"] is None else opts["slice_factor"],
        engine=opts["engine"],
        time_limit_s=opts["time_limit"],
        drop_unservable=opts["drop_unservable"],
    )
    plan = make_plan(inp, catalog)
    if not spec:
        return plan, None
    peak = max(sum(w.windows[k].total for w in workloads) for k in range(len(workloads[0].windows)))
    slos, scales = _what_if_axes(spec, slo, peak)
    return plan, what_if(inp, slos, scales, catalog)


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command(
        workload: str = typer.Option(
            None,
            "--workload",
            help="Workload file (mosaic.workload/v1): rate + histogram per model, or windows.",
        ),
        trace: str = typer.Option(
            None,
            "--trace",
            help="A trace file (any format `mosaic replay` reads), binned on the profiles' edges.",
        ),
        trace_format: str = typer.Option(
            None, "--trace-format", help="Force the trace format (azure, mooncake, sharegpt, ...)."
        ),
        model: str = typer.Option(
            None, "--model", help="Model the trace belongs to (when profiles cover several)."
        ),
        rate: float = typer.Option(
            None, "--rate", help="req/s for a trace without times; for a timed trace, the peak window's rate."
        ),
        window_s: float = typer.Option(
            None, "--window-s", help="Time-varying plan: windows of this many seconds of the trace."
        ),
        gpus: str = typer.Option(
            None,
            "--gpus",
            help="GPU types: a YAML/JSON file (costs, min, max) or a comma list (catalog prices).",
        ),
        profile: list[str] = typer.Option(
            None,
            "--profile",
            help="Throughput profile file (mosaic.profile/v1); repeat per GPU type/role/SLO.",
        ),
        slo_tpot_ms: float = typer.Option(
            None, "--slo-tpot-ms", help="TPOT SLO in ms: picks the loosest profile at or under it."
        ),
        slo_ttft_ms: float = typer.Option(None, "--slo-ttft-ms", help="TTFT SLO in ms."),
        melange: str = typer.Option(None, "--melange", help="Solve a Mélange input JSON as is."),
        mode: str = typer.Option("auto", "--mode", help="auto (mixed and P/D), mixed, or pd."),
        variant: str = typer.Option(
            None, "--variant", help="continuous (default) or sliced (Mélange's; default with --melange)."
        ),
        slice_factor: int = typer.Option(
            None,
            "--slice-factor",
            help="Slices per bucket in the sliced variant (default 4; --melange: the file's).",
        ),
        engine: str = typer.Option("auto", "--engine", help="auto, cp-sat or scip."),
        time_limit: float = typer.Option(10.0, "--time-limit", help="Solver time limit per solve, seconds."),
        drop_unservable: bool = typer.Option(
            False, "--drop-unservable", help="Plan without buckets no GPU type serves (listed in the output)."
        ),
        nodes: str = typer.Option(
            None, "--nodes", help="Node inventory YAML: place the planned instances topology-aware."
        ),
        same_domain: str = typer.Option(
            None, "--same-domain", help="prefer (default) or require P/D groups in one network domain."
        ),
        catalog: str = typer.Option(None, "--catalog", help="GPU/model catalog overrides (YAML)."),
        what_if_spec: list[str] = typer.Option(
            None,
            "--what-if",
            help="Compare: tpot_ms=40,120 | ttft_ms=... | rate_scale=0.5,1,2 | rate=10,30 (repeatable).",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON (schema mosaic.plan/v1)."),
    ) -> None:
        """Cheapest GPU mix that meets the SLO (Mélange's bin-packing, solved exactly), and where to put it."""
        opts = dict(locals())
        opts["what_if"] = opts.pop("what_if_spec")
        if mode not in ("auto", "mixed", "pd"):
            fail(f"--mode must be auto, mixed or pd, got {mode!r}")
        if variant not in (None, "continuous", "sliced"):
            fail(f"--variant must be continuous or sliced, got {variant!r}")
        if same_domain not in (None, "prefer", "require"):
            fail(f"--same-domain must be prefer or require, got {same_domain!r}")
        for name, value in (
            ("--slo-tpot-ms", slo_tpot_ms),
            ("--slo-ttft-ms", slo_ttft_ms),
            ("--rate", rate),
            ("--window-s", window_s),
            ("--time-limit", time_limit),
        ):
            check_number(name, value)
        check_number("--slice-factor", slice_factor, 1, inclusive=True)
        if slice_factor is not None and slice_factor > MAX_PLAN_INSTANCES:  # the solvers' integer range
            fail(f"--slice-factor must be ≤ {MAX_PLAN_INSTANCES:,} (the planner's limit), got {slice_factor}")
        try:
            doc = run_plan(opts)
        except (PlacementError, ProfileError, WorkloadError, CatalogError) as exc:
            fail(str(exc))
        if as_json:
            try:
                text = json.dumps(doc, indent=2, allow_nan=False)  # strict JSON: no Infinity or NaN
            except ValueError as exc:
                fail(f"the plan holds a value JSON cannot carry ({exc}); check the input for huge numbers")
            typer.echo(text)
        else:
            render_plan(doc, Console(width=max(100, Console().width)))
