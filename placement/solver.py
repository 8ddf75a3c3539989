"""Solve a `MixProblem` exactly: pick the engine, run it under a time limit, verify, explain failures.

`solve_mix(problem)` is the call the planner and the autoscaler make: the cheapest fleet (instances per
option, GPUs per type) that serves every window of demand, the bucket → option fractions (routing hints),
status, gap, bound and wall time. Every answer is re-checked in floating point: an option whose load
exceeds its count is repaired upward (and the status downgraded to `feasible`), never hidden.

Engine choice ("auto") follows `bench/placement_scale.py` (docs/placement.md has the table): CP-SAT for
the sliced model, SCIP for the continuous one (CP-SAT has no real variables). How each engine is driven
(count search, bounds, hints, fallbacks) lives in `placement.engine_pipeline`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from placement.binpacking import (
    LOAD_TOL,
    EngineResult,
    MixProblem,
    MixSolution,
    Path,
    PlacementError,
    Status,
    Unservable,
    Variant,
    check_problem,
    load_coefficients,
    needed_instances,
    serving_paths,
    window_loads,
)
from placement.engine_pipeline import run_engine
from placement.mip_engines import count_bounds

ENGINES = ("auto", "cp-sat", "scip")
DEFAULT_TIME_LIMIT_S = 10.0


class UnservableError(PlacementError):
    """Some bucket has demand but no option serves it within the SLO; `.buckets` lists them."""

    def __init__(self, message: str, buckets: Sequence[Unservable]) -> None:
        super().__init__(message)
        self.buckets = tuple(buckets)


class InfeasibleError(PlacementError):
    """No fleet within the GPU/instance caps serves the demand; the message says what is short.

    `fixes` maps a capped GPU type to (GPUs it would need, $/h) when lifting its cap alone suffices.
    """

    def __init__(self, message: str, fixes: Mapping[str, tuple[int, float]] | None = None) -> None:
        super().__init__(message)
        self.fixes = dict(fixes or {})


MAX_TIME_LIMIT_S = 86_400.0  # a day: longer is a typo, and past ~9e15 s SCIP's millisecond limit overflows


def default_engine(variant: Variant) -> str:
    """auto: CP-SAT-checked count search for the sliced model, the LP count search (SCIP behind it) else."""
    return "cp-sat" if variant is Variant.SLICED else "lp-branch"


def solve_mix(
    problem: MixProblem,
    *,
    variant: Variant = Variant.CONTINUOUS,
    slice_factor: int = 4,
    engine: str = "auto",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    drop_unservable: bool = False,
    explain: bool = True,
) -> MixSolution:
    """The cheapest fleet for `problem` (see `placement.binpacking` for the model).

    Raises UnservableError when a bucket with demand has no serving option (unless `drop_unservable`, which
    solves the rest and lists them in `.unservable`), InfeasibleError when the caps cannot be met, and
    PlacementError for malformed input. A time limit always applies; on expiry the incumbent comes back
    with status `feasible` and its gap.
    """
    check_problem(problem)
    if engine not in ENGINES:
        raise PlacementError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    if slice_factor < 1:
        raise PlacementError(f"slice factor must be ≥ 1, got {slice_factor}")
    if not 0 < time_limit_s <= MAX_TIME_LIMIT_S:  # also refuses NaN; SCIP takes whole milliseconds
        raise PlacementError(
            f"time limit must be > 0 s and ≤ {MAX_TIME_LIMIT_S:g} s (a day), got {time_limit_s}"
        )
    engine = default_engine(variant) if engine == "auto" else engine
    if engine == "cp-sat" and variant is Variant.CONTINUOUS:
        raise PlacementError("CP-SAT has no continuous variables: use engine scip or the sliced variant")
    paths, unservable = serving_paths(problem)
    if unservable and not drop_unservable:
        worst = ", ".join(f"{u.model} bucket {u.bucket} ({u.rate:g} req/s)" for u in unservable[:5])
        raise UnservableError(
            f"{len(unservable)} bucket(s) with demand no GPU type serves within the SLO: {worst}", unservable
        )
    units = slice_factor if variant is Variant.SLICED else 1
    coefs = load_coefficients(problem, paths, units)
    _check_bounds(problem, paths, coefs, units)
    result = run_engine(problem, paths, coefs, units, engine, variant, time_limit_s)
    if result.status is Status.INFEASIBLE:
        if not explain:  # explain_infeasible's own probes: one level only, never recursive
            raise InfeasibleError("no fleet within the caps serves the demand")
        raise explain_infeasible(
            problem, variant=variant, slice_factor=slice_factor, time_limit_s=min(time_limit_s, 5.0)
        )
    if result.status is Status.UNKNOWN:
        raise PlacementError(
            f"no solution found within the {time_limit_s:g} s time limit ({engine}); raise --time-limit"
        )
    return _finish(problem, paths, coefs, units, result, variant, slice_factor, unservable)


def _check_bounds(
    problem: MixProblem, paths: Sequence[Path], coefs: Sequence[Mapping[int, float]], units: int
) -> None:
    for o, (lb, ub) in enumerate(count_bounds(problem, paths, coefs, units)):
        if lb > ub:
            opt = problem.options[o]
            raise InfeasibleError(f"{opt.key}: min_instances {lb} exceeds what the caps allow ({ub})")


def _finish(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    r: EngineResult,
    variant: Variant,
    slice_factor: int,
    unservable: Sequence[Unservable],
) -> MixSolution:
    loads = window_loads(problem, paths, coefs, r.shares)
    peak = [
        max((v for (_, o), v in loads.items() if o == idx), default=0.0)
        for idx in range(len(problem.options))
    ]
    counts = list(r.counts)
    status, notes = r.status, list(r.notes)
    for o, load in enumerate(peak):
        need = needed_instances(load)
        if need > counts[o]:  # the engine's tolerance let an option overload: add what the load needs
            notes.append(
                f"{problem.options[o].key}: load {load:.6f} > {counts[o]} instances, raised to {need}"
            )
            counts[o], status = need, Status.FEASIBLE
    if status is not Status.OPTIMAL:
        _trim(problem, counts, peak)
    if not any(counts) and max(peak, default=0.0) > 0:
        # the load check forgives LOAD_TOL of an instance as float noise: a whole demand that small fits in none
        raise PlacementError(
            f"the demand is too small to plan: its busiest window needs {max(peak):.3g} of an instance, "
            f"below the planner's resolution ({LOAD_TOL:g}); check the rates"
        )
    opts = problem.options
    cost = sum(problem.option_cost(opt) * n for opt, n in zip(opts, counts, strict=True))
    bound = cost if status is Status.OPTIMAL else min(cost, r.bound if r.bound is not None else 0.0)
    gpus: dict[str, int] = {}
    for opt, n in zip(opts, counts, strict=True):
        if n:
            gpus[opt.gpu] = gpus.get(opt.gpu, 0) + n * opt.tp
    fractions: list[dict[tuple[str, int], dict[str, float]]] = [{} for _ in problem.windows]
    for p, s in zip(paths, r.shares, strict=True):
        fractions[p.window][(p.model, p.bucket)] = {opts[o].key: v / units for o, v in s.items() if v > 1e-12}
    return MixSolution(
        status=status,
        variant=variant,
        slice_factor=slice_factor if variant is Variant.SLICED else 0,
        engine=r.engine,
        counts={opt.key: n for opt, n in zip(opts, counts, strict=True)},
        gpus=gpus,
        cost_per_hour=cost,
        gap=0.0 if status is Status.OPTIMAL or cost <= 0 else max(0.0, (cost - bound) / cost),
        bound=bound,
        wall_s=r.wall_s,
        fractions=tuple(fractions),
        loads={opt.key: load for opt, load in zip(opts, peak, strict=True)},
        unservable=tuple(unservable),
        notes=tuple(notes),
    )


def _trim(problem: MixProblem, counts: list[int], peak: Sequence[float]) -> None:
    """Drop instances an incumbent carries beyond its load, while every min cap still holds."""
    for o, opt in enumerate(problem.options):
        offer = problem.gpus[opt.gpu]
        floor = max(needed_instances(peak[o]), opt.min_instances)
        while counts[o] > floor:
            gpus = sum(c * x.tp for c, x in zip(counts, problem.options, strict=True) if x.gpu == opt.gpu)
            if gpus - opt.tp < offer.min_gpus:
                break
            counts[o] -= 1


def explain_infeasible(problem: MixProblem, **settings: Any) -> InfeasibleError:
    """Say which caps bind: for each capped GPU type, the GPUs it would need if only its cap were lifted."""
    caps = {n: g.max_gpus for n, g in problem.gpus.items() if g.max_gpus is not None}
    cap_text = ", ".join(f"{g} ≤ {c}" for g, c in sorted(caps.items())) or "none"
    fixes: dict[str, tuple[int, float]] = {}
    for name in sorted(caps):
        lifted = replace(problem, gpus={**problem.gpus, name: replace(problem.gpus[name], max_gpus=None)})
        try:
            sol = solve_mix(lifted, explain=False, **settings)
        except PlacementError:
            continue
        fixes[name] = (sol.gpus.get(name, 0), sol.cost_per_hour)
    if fixes:
        ways = ", or ".join(f"{g} to {n} (${c:.2f}/h)" for g, (n, c) in fixes.items())
        return InfeasibleError(
            f"no fleet within the caps ({cap_text}) serves the demand; raising one cap would: {ways}", fixes
        )
    free = MixProblem(
        {n: replace(g, max_gpus=None) for n, g in problem.gpus.items()},
        tuple(replace(o, max_instances=None) for o in problem.options),
        problem.windows,
    )
    try:
        uncapped = solve_mix(free, explain=False, **settings)
    except PlacementError as exc:
        return InfeasibleError(f"no fleet serves the demand even without caps: {exc}")
    fleet = ", ".join(f"{n}× {g}" for g, n in sorted(uncapped.gpus.items()))
    return InfeasibleError(
        f"no fleet within the caps ({cap_text}) serves the demand, nor with any one cap lifted; without caps: {fleet} (${uncapped.cost_per_hour:.2f}/h)"
    )


@dataclass(frozen=True, slots=True)
class SingleType:
    """The cheapest fleet using one GPU type only, or why there is none."""

    gpu: str
    solution: MixSolution | None
    reason: str = ""


def single_type_fleets(problem: MixProblem, **kwargs: object) -> list[SingleType]:
    """For every offered GPU type, `solve_mix` restricted to its options (Mélange's baselines).

    GPU floors (`min_gpus`) hold in every baseline as in the mix: the baseline of type T is T plus the
    other types' floors, exactly (their GPUs are paid for, so they serve load too). A baseline is thus
    the mix restricted, never cheaper than it, and the savings against it are ≥ 0."""
    out: list[SingleType] = []
    floors = {n: replace(g, max_gpus=g.min_gpus) for n, g in problem.gpus.items() if g.min_gpus > 0}
    for name in problem.gpus:
        options = tuple(o for o in problem.options if o.gpu == name)
        if not options:
            out.append(SingleType(name, None, "no profile"))
            continue
        gpus = {**floors, name: problem.gpus[name]}
        options = tuple(o for o in problem.options if o.gpu in gpus)
        sub = MixProblem(gpus, options, problem.windows)
        try:
            out.append(SingleType(name, solve_mix(sub, **kwargs)))  # type: ignore[arg-type]
        except UnservableError as exc:
            out.append(SingleType(name, None, f"cannot serve {len(exc.buckets)} bucket(s) within the SLO"))
        except InfeasibleError as exc:
            need = exc.fixes.get(name)
            cap = problem.gpus[name].max_gpus
            reason = (
                f"needs {need[0]} GPUs, {cap} available (${need[1]:.2f}/h uncapped)" if need else str(exc)
            )
            out.append(SingleType(name, None, reason))
        except PlacementError as exc:
            out.append(SingleType(name, None, str(exc)))
    return out


def best_single_type(singles: Sequence[SingleType]) -> SingleType | None:
    feasible = [s for s in singles if s.solution is not None]
    return min(feasible, key=lambda s: s.solution.cost_per_hour if s.solution else math.inf, default=None)
