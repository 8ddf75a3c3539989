"""The planner: profiles + workload + GPU offers → the cheapest fleet, its routing hints and baselines.

`make_plan(PlanInput)` builds a `MixProblem` (one instance option per selected profile), solves it with
`solve_mix`, and adds Mélange's comparison (the best single GPU type and the savings against it). Beyond
Mélange: P/D profiles (role prefill/decode) sized together with mixed ones, several models sharing GPU
availability, min/max GPUs per type, and a time-varying plan (one fleet per window against one static fleet
that serves every window). `what_if` repeats it over SLOs and rate scales.

Online callers (the autoscaler) use `cheapest_mix` (demand per bucket → fleet) or `cheapest_capacity`
(one scalar resource, e.g. decode tokens/s, per-instance capacity by type → fleet).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from placement.binpacking import (
    Demand,
    GpuOffer,
    InstanceOption,
    MixProblem,
    MixSolution,
    PlacementError,
    Variant,
)
from placement.catalog import Catalog, CatalogError, load_catalog
from placement.profiles import Role, Slo, ThroughputProfile, bucket_label, read_structured
from placement.solver import SingleType, UnservableError, best_single_type, single_type_fleets, solve_mix
from placement.workload import ModelWorkload, Window

Mode = Literal["auto", "mixed", "pd"]


def canonical_gpu(name: str, catalog: Catalog) -> str:
    try:
        return catalog.gpu(name).name
    except CatalogError:
        return name


def canonical_model(name: str, catalog: Catalog) -> str:
    try:
        return catalog.model(name).name
    except CatalogError:
        return name


def load_gpu_offers(
    source: str | Path | Sequence[str] | Mapping[str, Any], catalog: Catalog | None = None
) -> dict[str, GpuOffer]:
    """GPU offers from a YAML/JSON file, a mapping, or a list of names (costs default to the catalog's).

    ```yaml
    gpus:
      A10G: {}                              # catalog price ($1.01/h)
      A100-80GB: {cost_per_hour: 3.67, max: 4, min: 0}
    ```
    `max` is availability (GPUs one can get); a list `gpus: [A10G, L4]` takes every default.
    """
    catalog = catalog or load_catalog()
    origin = "--gpus"
    if isinstance(source, str | Path) and Path(source).is_file():
        origin = str(source)
        source = read_structured(source, PlacementError)
    elif isinstance(source, str):
        source = [s.strip() for s in source.split(",") if s.strip()]
    if isinstance(source, Mapping) and "gpus" in source:
        extra = sorted(set(source) - {"gpus", "schema"})
        if extra:
            raise PlacementError(f"{origin}: unknown key(s) {extra}; expected 'gpus'")
        source = source["gpus"]
    if isinstance(source, list | tuple):
        rows: dict[str, Any] = {str(n): {} for n in source}
    elif isinstance(source, Mapping):
        rows = dict(source)
    else:
        raise PlacementError(f"{origin}: expected a mapping of GPU types or a list of names")
    if not rows:
        raise PlacementError(f"{origin}: no GPU types given")
    offers: dict[str, GpuOffer] = {}
    for raw, row in rows.items():
        row = row or {}
        if not isinstance(row, Mapping) or set(row) - {"cost_per_hour", "min", "max"}:
            raise PlacementError(f"{origin}: GPU {raw}: allowed keys are cost_per_hour, min, max")
        name = canonical_gpu(raw, catalog)
        cost = row.get("cost_per_hour")
        if cost is None:
            try:
                cost = catalog.gpu(name).cost_per_hour
            except CatalogError:
                raise PlacementError(
                    f"{origin}: GPU {raw} is not in the catalog: give cost_per_hour"
                ) from None
        try:
            offers[name] = GpuOffer(
                name, float(cost), int(row.get("min", 0)), None if row.get("max") is None else int(row["max"])
            )
        except (TypeError, ValueError) as exc:
            raise PlacementError(f"{origin}: GPU {raw}: {exc}") from None
    return offers


def _relevant(target: Slo, role: Role) -> Slo:
    """The limits that bind an instance of this role: prefill → TTFT, decode → TPOT, mixed → all."""
    if role is Role.PREFILL:
        return Slo(ttft_ms=target.ttft_ms, e2e_ms=None)
    if role is Role.DECODE:
        return Slo(tpot_ms=target.tpot_ms)
    return target


def select_profiles(
    profiles: Sequence[ThroughputProfile], target: Slo | None, mode: Mode = "auto"
) -> tuple[list[ThroughputProfile], list[str]]:
    """One profile per (model, GPU, tp, role): the loosest one measured at or under the target SLO.

    With no target every profile is used as given, and two for the same key is an error (which SLO?).
    `mode` keeps mixed only, P/D only, or both ("auto": the solver picks per bucket).
    """
    keep = {"auto": set(Role), "mixed": {Role.MIXED}, "pd": {Role.PREFILL, Role.DECODE}}[mode]
    by_key: dict[tuple[str, str, int, Role], list[ThroughputProfile]] = {}
    for p in profiles:
        if p.role in keep:
            by_key.setdefault(p.key, []).append(p)
    chosen, notes = [], []
    for key, group in by_key.items():
        label = (
            f"{key[0]}/{key[1]}"
            + (f"/tp{key[2]}" if key[2] > 1 else "")
            + ("" if key[3] is Role.MIXED else f"/{key[3].value}")
        )
        if target is None:
            if len(group) > 1:
                raise PlacementError(
                    f"{len(group)} profiles for {label} (SLOs {[_slo_text(p.slo) for p in group]}): give the SLO to choose"
                )
            chosen.append(group[0])
            continue
        need = _relevant(target, key[3])
        fit = [p for p in group if p.slo.within(need)]
        if not fit:
            notes.append(
                f"{label}: no profile at or under {_slo_text(need)} (have {', '.join(_slo_text(p.slo) for p in group)}); not used"
            )
            continue
        best = max(
            fit,
            key=lambda p: tuple(
                math.inf if v is None else v for v in (p.slo.tpot_ms, p.slo.ttft_ms, p.slo.e2e_ms)
            ),
        )
        if _relevant(best.slo, key[3]) != need:
            notes.append(
                f"{label}: profile measured at {_slo_text(best.slo)} used for {_slo_text(need)} (conservative)"
            )
        chosen.append(best)
    return chosen, notes


def _slo_text(slo: Slo) -> str:
    parts = [
        f"{n} {v:g} ms"
        for n, v in (("TPOT", slo.tpot_ms), ("TTFT", slo.ttft_ms), ("E2E", slo.e2e_ms))
        if v is not None
    ]
    return ", ".join(parts) or "no SLO"


@dataclass(frozen=True, slots=True)
class PlanInput:
    offers: Mapping[str, GpuOffer]
    profiles: tuple[ThroughputProfile, ...]
    workloads: tuple[ModelWorkload, ...]
    slo: Slo | None = None
    mode: Mode = "auto"
    variant: Variant = Variant.CONTINUOUS
    slice_factor: int = 4
    engine: str = "auto"
    time_limit_s: float = 10.0
    drop_unservable: bool = False


@dataclass(frozen=True, slots=True)
class Grid:
    """A model's bucket edges; None for Mélange inputs (buckets known only by index)."""

    input_edges: tuple[int, ...] | None
    output_edges: tuple[int, ...] | None
    shape: tuple[int, int]

    def cell(self, b: int) -> tuple[int, int]:
        return divmod(b, self.shape[1])

    def label(self, b: int) -> str:
        i, j = self.cell(b)
        if self.input_edges is None or self.output_edges is None:
            return f"in#{i} out#{j}"
        return f"in {bucket_label(self.input_edges, i)} out {bucket_label(self.output_edges, j)}"


@dataclass(frozen=True, slots=True)
class Dropped:
    model: str
    label: str
    rate: float  # req/s left out (peak over windows)


@dataclass(frozen=True, slots=True)
class Plan:
    """The fleet that serves every window, the single-type baselines, and (time-varying) one per window."""

    solution: MixSolution
    singles: tuple[SingleType, ...]
    grids: Mapping[str, Grid]
    problem: MixProblem
    durations_s: tuple[float, ...]
    per_window: tuple[MixSolution, ...] = ()
    dropped: tuple[Dropped, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def best_single(self) -> SingleType | None:
        return best_single_type(self.singles)

    @property
    def savings(self) -> float | None:
        """(best single − plan) / best single, in [0, 1); None when no single type can serve."""
        best = self.best_single
        if best is None or best.solution is None or best.solution.cost_per_hour <= 0:
            return None
        return (best.solution.cost_per_hour - self.solution.cost_per_hour) / best.solution.cost_per_hour


def build_problem(
    inp: PlanInput, catalog: Catalog | None = None
) -> tuple[MixProblem, dict[str, Grid], list[Dropped], list[str]]:
    """Options from the selected profiles, demand per window from the workloads (edges must agree)."""
    catalog = catalog or load_catalog()
    chosen, notes = select_profiles(inp.profiles, inp.slo, inp.mode)
    offers = dict(inp.offers)
    grids: dict[str, Grid] = {}
    options: list[InstanceOption] = []
    for p in chosen:
        gpu, model = canonical_gpu(p.gpu, catalog), canonical_model(p.model, catalog)
        if gpu not in offers:
            continue
        grid = Grid(p.input_edges, p.output_edges, p.shape)
        if grids.setdefault(model, grid) != grid:
            raise PlacementError(
                f"profiles of {model} use different bucket edges ({p.gpu} differs): re-profile on one grid"
            )
        options.append(InstanceOption(model, gpu, p.flat_rates(), p.tp, p.role))
    for name in offers:
        if not any(o.gpu == name for o in options):
            notes.append(f"{name}: no usable profile, not considered")
    if not options:
        why = (
            "; ".join(notes[:3])
            or f"profiles are for GPUs {sorted({p.gpu for p in inp.profiles})}, offered {sorted(offers)}"
        )
        raise PlacementError(f"no usable profile for the offered GPUs: {why}")
    windows, dropped = _demand(inp.workloads, grids, catalog, options, inp.drop_unservable)
    return MixProblem(offers, tuple(options), windows), grids, dropped, notes


def _demand(
    workloads: Sequence[ModelWorkload],
    grids: Mapping[str, Grid],
    catalog: Catalog,
    options: Sequence[InstanceOption],
    drop: bool,
) -> tuple[tuple[tuple[Demand, ...], ...], list[Dropped]]:
    counts = {len(w.windows) for w in workloads}
    if len(counts) != 1:
        raise PlacementError(
            f"models have different numbers of windows {sorted(counts)}: give them the same windows"
        )
    per_window: list[list[Demand]] = [[] for _ in range(counts.pop())]
    dropped: list[Dropped] = []
    for wl in workloads:
        model = canonical_model(wl.model, catalog)
        grid = grids.get(model)
        if grid is None:
            raise PlacementError(f"workload model {wl.model!r} has no profile among the offered GPUs")
        if (wl.input_edges, wl.output_edges) != (grid.input_edges, grid.output_edges):
            raise PlacementError(
                f"workload of {wl.model} uses bucket edges {list(wl.input_edges)} × {list(wl.output_edges)}, its profiles {list(grid.input_edges or ())} × {list(grid.output_edges or ())}"
            )
        unserved = _unservable_buckets(model, options, grid.shape[0] * grid.shape[1])
        outside = max(w.out_of_range for w in wl.windows)
        if outside > 0:
            if not drop:
                raise PlacementError(
                    f"{wl.model}: {outside:g} req/s fall outside the profiled lengths; extend the profile or pass --drop-unservable"
                )
            dropped.append(Dropped(model, "outside the profiled lengths", outside))
        for k, w in enumerate(wl.windows):
            rates = list(w.rates)
            for b in unserved:
                if rates[b] > 0 and drop:
                    rates[b] = 0.0
            per_window[k].append(Demand(model, tuple(rates)))
        if drop:
            for b in unserved:
                peak = max(w.rates[b] for w in wl.windows)
                if peak > 0:
                    dropped.append(Dropped(model, grid.label(b), peak))
    return tuple(tuple(w) for w in per_window), dropped


def _unservable_buckets(model: str, options: Sequence[InstanceOption], n: int) -> list[int]:
    out = []
    for b in range(n):
        roles = {o.role for o in options if o.model == model and o.rates[b] > 0}
        if Role.MIXED not in roles and not {Role.PREFILL, Role.DECODE} <= roles:
            out.append(b)
    return out


def make_plan(inp: PlanInput, catalog: Catalog | None = None) -> Plan:
    problem, grids, dropped, notes = build_problem(inp, catalog)
    durations = tuple(w.duration_s for w in inp.workloads[0].windows)
    settings = {
        "variant": inp.variant,
        "slice_factor": inp.slice_factor,
        "engine": inp.engine,
        "time_limit_s": inp.time_limit_s,
    }
    return solve_plan(problem, grids, durations, dropped, notes, **settings)


def solve_plan(
    problem: MixProblem,
    grids: Mapping[str, Grid],
    durations: Sequence[float],
    dropped: Sequence[Dropped] = (),
    notes: Sequence[str] = (),
    **settings: Any,
) -> Plan:
    """Solve a built problem (Mosaic's or Mélange's) with `solve_mix` settings; add baselines and windows."""
    kwargs: dict[str, Any] = dict(settings)
    try:
        solution = solve_mix(problem, **kwargs)
    except UnservableError as exc:
        where = ", ".join(
            f"{u.model} {grids[u.model].label(u.bucket)} ({u.rate:g} req/s)" for u in exc.buckets[:4]
        )
        more = f" and {len(exc.buckets) - 4} more" if len(exc.buckets) > 4 else ""
        raise PlacementError(
            f"no GPU type serves {where}{more} within the SLO; pass --drop-unservable to plan the rest"
        ) from None
    singles = tuple(single_type_fleets(problem, **kwargs))
    per_window: tuple[MixSolution, ...] = ()
    if len(problem.windows) > 1:
        per_window = tuple(solve_mix(replace(problem, windows=(w,)), **kwargs) for w in problem.windows)
    return Plan(
        solution,
        singles,
        grids,
        problem,
        tuple(durations),
        per_window,
        tuple(dropped),
        (*notes, *solution.notes),
    )


@dataclass(frozen=True, slots=True)
class WhatIfRow:
    slo: Slo | None
    rate_scale: float
    rate: float  # peak total req/s
    plan: Plan | None
    error: str = ""


def what_if(
    inp: PlanInput, slos: Sequence[Slo | None], rate_scales: Sequence[float], catalog: Catalog | None = None
) -> list[WhatIfRow]:
    """`make_plan` for every (SLO, rate scale) pair; a row that cannot be planned carries the reason."""
    rows = []
    for slo in slos:
        for scale in rate_scales:
            scaled = replace(inp, slo=slo, workloads=tuple(w.scaled(scale) for w in inp.workloads))
            peak = max(
                sum(w.windows[k].total for w in scaled.workloads)
                for k in range(len(scaled.workloads[0].windows))
            )
            try:
                rows.append(WhatIfRow(slo, scale, peak, make_plan(scaled, catalog)))
            except PlacementError as exc:
                rows.append(WhatIfRow(slo, scale, peak, None, str(exc)))
    return rows


def cheapest_mix(
    demand: Mapping[str, Sequence[float]],
    profiles: Sequence[ThroughputProfile],
    offers: Mapping[str, GpuOffer],
    *,
    slo: Slo | None = None,
    mode: Mode = "auto",
    variant: Variant = Variant.CONTINUOUS,
    time_limit_s: float = 1.0,
) -> MixSolution:
    """Online entry point: the cheapest fleet for `demand` (model → req/s per bucket, profile bucket order).

    To only add capacity, pass offers whose `min_gpus` are the GPUs already running. Raises PlacementError
    (UnservableError, InfeasibleError) with a one-line reason.
    """
    catalog = load_catalog()
    workloads = []
    for model, rates in demand.items():
        match = [p for p in profiles if canonical_model(p.model, catalog) == canonical_model(model, catalog)]
        if not match:
            raise PlacementError(f"no profile for model {model!r}")
        workloads.append(
            ModelWorkload(model, match[0].input_edges, match[0].output_edges, (Window(1.0, tuple(rates)),))
        )
    inp = PlanInput(offers, tuple(profiles), tuple(workloads), slo, mode, variant, time_limit_s=time_limit_s)
    problem, _, _, _ = build_problem(inp, catalog)
    return solve_mix(problem, variant=variant, time_limit_s=time_limit_s)


def cheapest_capacity(
    need: float,
    per_instance: Mapping[str, float],
    offers: Mapping[str, GpuOffer],
    *,
    time_limit_s: float = 1.0,
) -> MixSolution:
    """The cheapest integer mix whose summed capacity covers `need` (one resource, e.g. decode tokens/s).

    `per_instance[gpu]` is what one instance of that GPU type provides (0 = cannot). A one-bucket bin-packing
    solved exactly; counts come back as `solution.gpus`.
    """
    if not math.isfinite(need) or need < 0:
        raise PlacementError(f"capacity need must be a finite number ≥ 0, got {need}")
    options = tuple(
        InstanceOption("capacity", g, (float(c),)) for g, c in per_instance.items() if g in offers
    )
    problem = MixProblem(dict(offers), options, ((Demand("capacity", (float(need),)),),))
    return solve_mix(problem, variant=Variant.CONTINUOUS, time_limit_s=time_limit_s)
