"""OR-Tools back ends for the bin-packing model of `placement.binpacking`: CP-SAT, and SCIP/HiGHS via pywraplp.

Each back end builds the same model from the `Path`s and load coefficients and returns an `EngineResult`
(counts, shares, status, objective, bound, wall time); `placement.solver` verifies it in floating point.

CP-SAT needs integer coefficients. The load row Σ a·s ≤ N is scaled by S and the coefficients rounded
*down*: Σ ⌊S·a⌋·s ≤ S·N admits every truly feasible assignment, so its optimum is a lower bound on the true
optimum. If that optimum also passes the float check, it is optimal for the real model; otherwise the
rounded-*up* model (a restriction: its solutions are all truly feasible) is solved, and the two costs bound
the answer (`solver.solve_mix` does this). Costs enter the objective in micro-dollars per hour. CP-SAT only
takes integer shares, so it serves the sliced variant; the MIP engines serve both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

from ortools.linear_solver import pywraplp
from ortools.sat.python import cp_model

from placement.binpacking import EngineResult, MixProblem, Path, Status

COST_SCALE = 1_000_000  # CP-SAT objective unit: micro-dollars per hour
MAX_SCALED = 2**52  # keep every scaled load row exactly representable as a double (CP-SAT's LP uses them)


def count_bounds(
    problem: MixProblem, paths: Sequence[Path], coefs: Sequence[Mapping[int, float]], units: int
) -> list[tuple[int, int]]:
    """(lb, ub) of N_o: ub is the most any optimum needs (all its paths on o in the worst window), capped."""
    worst: dict[tuple[int, int], float] = {}
    for p, a in zip(paths, coefs, strict=True):
        for o in p.options:
            worst[(p.window, o)] = worst.get((p.window, o), 0.0) + a[o] * units
    bounds = []
    for o, opt in enumerate(problem.options):
        need = max((v for (_, oo), v in worst.items() if oo == o), default=0.0)
        offer = problem.gpus[opt.gpu]
        # A GPU minimum may have to be met by this option alone, whatever its load.
        # Any load at all needs an instance: ⌈need − 1e-9⌉ alone is 0 for a load under 1e-9 of one.
        ub = max(opt.min_instances, math.ceil(need - 1e-9), int(need > 0), -(-offer.min_gpus // opt.tp))
        gpu_cap = offer.max_gpus
        if opt.max_instances is not None:
            ub = min(ub, opt.max_instances)
        if gpu_cap is not None:
            ub = min(ub, gpu_cap // opt.tp)
        bounds.append((opt.min_instances, max(ub, 0)))
    return bounds


def _share_rows(paths: Sequence[Path], problem: MixProblem) -> list[tuple[list[int], list[int], list[int]]]:
    """Per path: (mixed, prefill, decode) option lists used in the serve and P/D rows."""
    rows = []
    for p in paths:
        pd = bool(p.prefill and p.decode)
        rows.append((list(p.mixed), list(p.prefill) if pd else [], list(p.decode) if pd else []))
    return rows


def _group_by_window(paths: Sequence[Path]) -> dict[tuple[int, int], list[int]]:
    rows: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(paths):
        for o in p.options:
            rows.setdefault((p.window, o), []).append(i)
    return rows


def solve_cp_sat(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    time_limit_s: float,
    *,
    round_up: bool = False,
    workers: int = 8,
    lower_bound: float | None = None,
    hint: EngineResult | None = None,
    fixed_counts: Sequence[int] | None = None,
) -> EngineResult:
    """Sliced model on CP-SAT; `round_up=False` is the relaxation (lower bound), True the restriction.

    `fixed_counts` pins N (a feasibility question: do whole slices fit in this fleet?); `hint` seeds the
    search; `lower_bound` adds the cut objective ≥ bound.
    """
    started = time.perf_counter()
    m = cp_model.CpModel()
    bounds = count_bounds(problem, paths, coefs, units)
    if fixed_counts is not None:
        bounds = [(n, n) for n in fixed_counts]
    counts = [m.new_int_var(lb, ub, f"n{o}") for o, (lb, ub) in enumerate(bounds)]
    shares = _sliced_rows(m, problem, paths, coefs, units, counts, round_up)
    _gpu_rows(problem, m, counts)
    micro = [problem.option_cost(opt) * COST_SCALE for opt in problem.options]
    objective = sum(round(c) * counts[o] for o, c in enumerate(micro))
    if lower_bound is not None:  # a valid cut: the sliced optimum costs at least the continuous one
        # less what rounding the costs to micro-dollars can take off any fleet within the count bounds
        slack = sum(abs(round(c) - c) * ub for c, (_, ub) in zip(micro, bounds, strict=True)) + 1
        m.add(objective >= math.floor(lower_bound * COST_SCALE * (1 - 1e-9) - slack))
    if hint is not None:
        for var, value in zip(counts, hint.counts, strict=True):
            m.add_hint(var, value)
        for vars_, values in zip(shares, hint.shares, strict=True):
            for o, var in vars_.items():
                m.add_hint(var, round(values.get(o, 0.0)))
    m.minimize(objective)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit_s, 0.001)
    solver.parameters.num_workers = workers
    code = solver.solve(m)
    wall = time.perf_counter() - started
    status = {
        cp_model.OPTIMAL: Status.OPTIMAL,
        cp_model.FEASIBLE: Status.FEASIBLE,
        cp_model.INFEASIBLE: Status.INFEASIBLE,
    }.get(code, Status.UNKNOWN)
    if status in (Status.INFEASIBLE, Status.UNKNOWN):
        return EngineResult(status, (), (), None, None, wall, "cp-sat")
    return EngineResult(
        status,
        tuple(int(solver.value(c)) for c in counts),
        tuple({o: float(solver.value(v)) for o, v in s.items()} for s in shares),
        solver.objective_value / COST_SCALE,
        solver.best_objective_bound / COST_SCALE,
        wall,
        "cp-sat",
    )


def fit_slices(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    counts: Sequence[int],
    time_limit_s: float,
    *,
    round_up: bool = False,
) -> EngineResult:
    """Do whole slices fit exactly `counts`? A CP-SAT feasibility model (no objective, counts constant).

    Same scaling as `solve_cp_sat` (rounded down: its INFEASIBLE is a proof; rounded up: every solution is
    truly feasible). Presolve is off: on these small, tight packing models it cost more than it saved
    (measured on bench/placement_scale.py's leaves). The caller checks the GPU caps of `counts`.
    """
    started = time.perf_counter()
    m = cp_model.CpModel()
    shares = _sliced_rows(m, problem, paths, coefs, units, counts, round_up)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit_s, 0.001)
    solver.parameters.num_workers = 1
    solver.parameters.cp_model_presolve = False
    code = solver.solve(m)
    wall = time.perf_counter() - started
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        status = Status.INFEASIBLE if code == cp_model.INFEASIBLE else Status.UNKNOWN
        return EngineResult(status, (), (), None, None, wall, "cp-sat")
    cost = sum(problem.option_cost(opt) * n for opt, n in zip(problem.options, counts, strict=True))
    values = tuple({o: float(solver.value(v)) for o, v in s.items()} for s in shares)
    return EngineResult(Status.OPTIMAL, tuple(counts), values, cost, cost, wall, "cp-sat")


def _scale(
    coefs: Sequence[Mapping[int, float]], rows: Mapping[tuple[int, int], list[int]], units: int
) -> float:
    """A power of two ≤ 10⁹ keeping every scaled load row exactly representable (see MAX_SCALED)."""
    peak = max((sum(coefs[i][o] * units for i in idx) for (_, o), idx in rows.items()), default=1.0)
    return float(min(10**9, 2 ** math.floor(math.log2(MAX_SCALED / max(peak + 1.0, 1.0)))))


def _sliced_rows(
    m: cp_model.CpModel,
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    counts: Sequence[cp_model.IntVar] | Sequence[int],
    round_up: bool,
) -> list[dict[int, cp_model.IntVar]]:
    """Integer shares per path with the serve and P/D rows, and the scaled load rows against `counts`."""
    shares = [{o: m.new_int_var(0, units, f"s{i}_{o}") for o in p.options} for i, p in enumerate(paths)]
    for s, (mixed, pre, dec) in zip(shares, _share_rows(paths, problem), strict=True):
        m.add(sum(s[o] for o in mixed + pre) == units)
        if pre:
            m.add(sum(s[o] for o in dec) == sum(s[o] for o in pre))
    rows = _group_by_window(paths)
    scale = _scale(coefs, rows, units)
    rnd = math.ceil if round_up else math.floor
    for (_, o), idx in rows.items():
        m.add(sum(int(rnd(scale * coefs[i][o])) * shares[i][o] for i in idx) <= int(scale) * counts[o])
    return shares


def _gpu_rows(problem: MixProblem, m: cp_model.CpModel, counts: Sequence[cp_model.IntVar]) -> None:
    for name, offer in problem.gpus.items():
        used = [(o, opt.tp) for o, opt in enumerate(problem.options) if opt.gpu == name]
        if not used or (offer.min_gpus == 0 and offer.max_gpus is None):
            continue
        total = sum(tp * counts[o] for o, tp in used)
        m.add(total >= offer.min_gpus)
        if offer.max_gpus is not None:
            m.add(total <= offer.max_gpus)


def build_linear(
    solver: pywraplp.Solver,
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    *,
    integral_counts: bool,
    integral_shares: bool,
) -> tuple[list[pywraplp.Variable], list[dict[int, pywraplp.Variable]], pywraplp.LinearExpr]:
    """The model of `placement.binpacking` in a pywraplp solver: (counts N_o, shares per path, cost).

    With both flags False it is the LP relaxation (GLOP) that `placement.count_search` branches on.
    """
    bounds = count_bounds(problem, paths, coefs, units)
    make_count = solver.IntVar if integral_counts else solver.NumVar
    counts = [make_count(lb, ub, f"n{o}") for o, (lb, ub) in enumerate(bounds)]
    make = solver.IntVar if integral_shares else solver.NumVar
    shares = [{o: make(0, units, f"s{i}_{o}") for o in p.options} for i, p in enumerate(paths)]
    for s, (mixed, pre, dec) in zip(shares, _share_rows(paths, problem), strict=True):
        solver.Add(solver.Sum([s[o] for o in mixed + pre]) == units)
        if pre:
            solver.Add(solver.Sum([s[o] for o in dec]) == solver.Sum([s[o] for o in pre]))
    for (_, o), idx in _group_by_window(paths).items():
        # Rows in milli-instances: SCIP drops matrix entries below 1e-9, and a tiny bucket's load can be that small.
        solver.Add(solver.Sum([1000.0 * coefs[i][o] * shares[i][o] for i in idx]) <= 1000.0 * counts[o])
    for name, offer in problem.gpus.items():
        used = [(o, opt.tp) for o, opt in enumerate(problem.options) if opt.gpu == name]
        if used and (offer.min_gpus > 0 or offer.max_gpus is not None):
            total = solver.Sum([tp * counts[o] for o, tp in used])
            solver.Add(total >= offer.min_gpus)
            if offer.max_gpus is not None:
                solver.Add(total <= offer.max_gpus)
    objective = solver.Sum([problem.option_cost(opt) * counts[o] for o, opt in enumerate(problem.options)])
    return counts, shares, objective


_MIP_STATUS = {
    pywraplp.Solver.OPTIMAL: Status.OPTIMAL,
    pywraplp.Solver.FEASIBLE: Status.FEASIBLE,
    pywraplp.Solver.INFEASIBLE: Status.INFEASIBLE,
}


def solve_mip(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    time_limit_s: float,
    *,
    backend: str = "SCIP",
    integral_shares: bool = True,
    lower_bound: float | None = None,
    hint: EngineResult | None = None,
) -> EngineResult:
    """Either variant on a MIP solver through pywraplp (`backend` SCIP), with a gap target of 0.

    `hint` (a known fleet, e.g. CP-SAT's incumbent) seeds the search with a primal solution.
    """
    started = time.perf_counter()
    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:  # pragma: no cover - depends on the OR-Tools build
        raise RuntimeError(f"OR-Tools in this environment has no {backend} solver")
    counts, shares, objective = build_linear(
        solver, problem, paths, coefs, units, integral_counts=True, integral_shares=integral_shares
    )
    if lower_bound is not None:
        solver.Add(objective >= lower_bound * (1 - 1e-9) - 1e-9)
    solver.Minimize(objective)
    solver.SuppressOutput()
    if hint is not None and hint.counts:
        pairs = list(zip(counts, map(float, hint.counts), strict=True))
        for vars_, values in zip(shares, hint.shares, strict=True):
            pairs += [(var, values.get(o, 0.0)) for o, var in vars_.items()]
        solver.SetHint([v for v, _ in pairs], [x for _, x in pairs])
    solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, 1e-9)
    params.SetDoubleParam(params.PRIMAL_TOLERANCE, 1e-9)
    code = solver.Solve(params)
    wall = time.perf_counter() - started
    status = _MIP_STATUS.get(code, Status.UNKNOWN)
    name = backend.lower()
    if status in (Status.INFEASIBLE, Status.UNKNOWN):
        return EngineResult(status, (), (), None, None, wall, name)
    share_values = []
    for s in shares:
        values = {o: min(float(units), max(0.0, v.solution_value())) for o, v in s.items()}
        share_values.append({o: float(round(v)) for o, v in values.items()} if integral_shares else values)
    return EngineResult(
        status,
        tuple(round(c.solution_value()) for c in counts),
        tuple(share_values),
        solver.Objective().Value(),
        solver.Objective().BestBound(),
        wall,
        name,
    )
