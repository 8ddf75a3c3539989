"""The planner: profiles + workload + GPU offers → the cheapest fleet, its routing hints and baselines.

`make_plan(PlanInput)` builds a `MixProblem` (one instance option per selected profile), solves it with
`solve_mix`, and adds Mélange's comparison (the best single GPU type and the savings against it). Beyond
Mélange: P/D profiles (role prefill/decode) sized together with mixed ones, several models sharing GPU
availability, min/max GPUs per type, and a time-varying plan (one fleet per window against one static fleet
that serves every window). `what_if` repeats it over SLOs and rate scales.

Online callers (the autoscaler) use `cheapest_mix` (demand per bucket → fleet) or `cheapest_capacity`
(one scalar resource, e.g. decode tokens/s, per-instance capacity by type → fleet). GPU offers are read by
`placement.offers`, profiles chosen per SLO by `placement.profile_select` (both re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from placement.binpacking import (
    Demand,
    GpuOffer,
    InstanceOption,
    MixProblem,
    MixSolution,
    PlacementError,
    Variant,
)
from placement.catalog import Catalog, load_catalog
from placement.offers import canonical_gpu, canonical_model, load_gpu_offers
from placement.profile_select import Mode, one_slo_per_role, select_profiles
from placement.profiles import Role, Slo, ThroughputProfile, bucket_label
from placement.solver import SingleType, UnservableError, best_single_type, single_type_fleets, solve_mix
from placement.workload import ModelWorkload, Window

__all__ = [
    "Dropped",
    "Grid",
    "Mode",
    "Plan",
    "PlanInput",
    "WhatIfRow",
    "build_problem",
    "canonical_gpu",
    "canonical_model",
    "cheapest_capacity",
    "cheapest_mix",
    "load_gpu_offers",
    "make_plan",
    "select_profiles",
    "solve_plan",
    "what_if",
]


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


OUTSIDE = "outside the profiled lengths"
NOT_SERVED = "no GPU type serves it within the SLO"


@dataclass(frozen=True, slots=True)
class Dropped:
    model: str
    label: str
    rate: float  # req/s left out (peak over windows)
    reason: str = NOT_SERVED  # OUTSIDE or NOT_SERVED


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
    chosen, notes = select_profiles(inp.profiles, inp.slo, inp.mode, catalog)
    offers = dict(inp.offers)
    grids: dict[str, Grid] = {}
    options: list[InstanceOption] = []
    kept: list[ThroughputProfile] = []  # the profiles the options come from
    unoffered: list[str] = []  # noted after the reasons an offered GPU has no option
    for p in chosen:
        gpu, model = canonical_gpu(p.gpu, catalog), canonical_model(p.model, catalog)
        if gpu not in offers:
            if gpu not in catalog.gpus:  # a typo would leave the GPU it meant without a profile, quietly
                raise PlacementError(
                    f"profile {model} on GPU {p.gpu!r}: that GPU is neither in the catalog nor offered"
                    f" ({', '.join(sorted(offers))})"
                )
            unused = f"{gpu}: profiled but not offered; its profiles are not used"
            unoffered += [unused] if unused not in unoffered else []
            continue
        grid = Grid(p.input_edges, p.output_edges, p.shape)
        if grids.setdefault(model, grid) != grid:
            raise PlacementError(
                f"profiles of {model} use different bucket edges ({p.gpu} differs): re-profile on one grid"
            )
        option = InstanceOption(model, gpu, p.flat_rates(), p.tp, p.role)
        if any(o.key == option.key for o in options):  # select_profiles keeps one per key: a safeguard
            raise PlacementError(
                f"two profiles make option {option.key}: give one per model, GPU, tp and role"
            )
        options.append(option)
        kept.append(p)
    for name, offer in offers.items():
        if not any(o.gpu == name for o in options):
            if offer.min_gpus > 0:  # a floor is paid for whatever serves: never let its cost vanish
                raise PlacementError(
                    f"{name}: min {offer.min_gpus} GPU(s) must be paid for, but it has no usable profile"
                    f"{_at_slo(inp.slo)}: add one or drop its min"
                )
            notes.append(f"{name}: no usable profile, not considered")
    if not options:
        why = (
            "; ".join((notes + unoffered)[:3])
            or f"profiles are for GPUs {sorted({p.gpu for p in inp.profiles})}, offered {sorted(offers)}"
        )
        raise PlacementError(f"no usable profile for the offered GPUs: {why}")
    notes += unoffered
    if inp.slo is None:  # the plan holds at the profiles' own SLO: those it can use must agree on it
        models = {canonical_model(w.model, catalog) for w in inp.workloads}
        notes.append(
            one_slo_per_role([p for p in kept if canonical_model(p.model, catalog) in models] or kept)
        )
    windows, dropped = _demand(inp.workloads, grids, catalog, options, inp.drop_unservable)
    peak = max(sum(w.windows[k].total for w in inp.workloads) for k in range(len(windows)))
    check_something_left(windows, peak)
    return MixProblem(offers, tuple(options), windows), grids, dropped, notes


def _at_slo(slo: Slo | None) -> str:
    if slo is None:
        return ""
    parts = [f"{k} {v:g} ms" for k, v in (("TPOT", slo.tpot_ms), ("TTFT", slo.ttft_ms)) if v is not None]
    return f" at {', '.join(parts)}" if parts else ""


def check_something_left(windows: Sequence[Sequence[Demand]], peak: float) -> None:
    """After dropping, some demand must remain: a $0 "optimal" fleet for nothing would read as an answer.

    `peak` is the busiest window's total req/s before dropping."""
    if peak > 0 and all(r <= 0 for w in windows for d in w for r in d.rates):
        raise PlacementError(f"all {peak:.3g} req/s fall outside the profiles/SLO; nothing left to plan")


def drop_unserved(problem: MixProblem, grids: Mapping[str, Grid]) -> tuple[MixProblem, list[Dropped]]:
    """`problem` without the buckets no option serves (for inputs built elsewhere, e.g. Mélange's),
    and what was left out, as `--drop-unservable` reports it."""
    dropped: list[Dropped] = []
    windows = [list(w) for w in problem.windows]
    for model, grid in grids.items():
        unserved = _unservable_buckets(model, problem.options, grid.shape[0] * grid.shape[1])
        for b in unserved:
            peak = max((d.rates[b] for w in windows for d in w if d.model == model), default=0.0)
            if peak > 0:
                dropped.append(Dropped(model, grid.label(b), peak))
        for w in windows:
            for i, d in enumerate(w):
                if d.model == model:
                    w[i] = replace(d, rates=tuple(0.0 if b in unserved else r for b, r in enumerate(d.rates)))
    peak = max(sum(d.total for d in w) for w in problem.windows)
    check_something_left(windows, peak)
    return replace(problem, windows=tuple(tuple(w) for w in windows)), dropped


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
    given_as: dict[str, str] = {}  # canonical model → the name the workload wrote
    for wl in workloads:
        model = canonical_model(wl.model, catalog)
        if model in given_as:  # its demand would be counted twice, and its routing hints only once
            raise PlacementError(
                f"model {wl.model} appears twice in the workload (also as {given_as[model]})"
            )
        given_as[model] = wl.model
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
            dropped.append(Dropped(model, OUTSIDE, outside, OUTSIDE))
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
    floors = {n: g.min_gpus for n, g in problem.gpus.items() if g.min_gpus > 0}
    if floors and len(problem.gpus) > 1:
        held = ", ".join(f"{n} ≥ {m}" for n, m in sorted(floors.items()))
        notes = (*notes, f"single-type baselines keep the GPU floors ({held}), as the mix does")
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
            covered = ", ".join(sorted({canonical_model(p.model, catalog) for p in profiles})) or "none"
            raise PlacementError(f"no profile for model {model!r}; the profiles cover {covered}")
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
    # GPUs held by a floor (`min_gpus`: already running) stay in the mix, costed, even where they provide
    # nothing (capacity 0): dropping their option dropped the floor and its cost
    held = {g: 0.0 for g, o in offers.items() if o.min_gpus > 0 and g not in per_instance}
    options = tuple(
        InstanceOption("capacity", g, (float(c),)) for g, c in {**per_instance, **held}.items() if g in offers
    )
    problem = MixProblem(dict(offers), options, ((Demand("capacity", (float(need),)),),))
    return solve_mix(problem, variant=Variant.CONTINUOUS, time_limit_s=time_limit_s)
