"""How `solve_mix` drives an engine on a built model: the order of attempts, bounds, hints and fallbacks.

Sliced model, engine CP-SAT (the default): `placement.count_search` branches on the instance counts over
the LP relaxation; at each integral fleet, whole slices are first placed near the LP's shares (a cheap
depth-first rounding) and otherwise CP-SAT decides whether they fit (`mip_engines.fit_slices`, whose
"infeasible" is a proof). That proves most instances optimal in tens of milliseconds of CPU; if the search
gives up (node or time limit, undecided leaf), CP-SAT on the full model finishes with the search's bound
as a cut and its best fleet as a hint. Sliced model on SCIP: the continuous optimum's bound, a rounded
fleet, then SCIP. Continuous model: SCIP directly. Every result is verified again by `solver._finish`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from placement.binpacking import (
    LOAD_TOL,
    EngineResult,
    MixProblem,
    Path,
    Status,
    Variant,
    needed_instances,
    window_loads,
)
from placement.count_search import MAX_NODES, Leaf, Undecided, search_counts
from placement.mip_engines import fit_slices, solve_cp_sat, solve_mip

SEARCH_SHARE = 0.5  # of the time limit, for the count search before CP-SAT takes over
FIT_SHARE = 0.25  # of the search's time, at most, for one leaf's CP-SAT fit (a hard one means: give up)
SEARCH_NODES = MAX_NODES  # LPs the count search may solve (tests lower it to reach the fallback)
# CP-SAT's portfolio for the hard tail: up to 8 workers, never more than the machine has cores
EXACT_WORKERS = max(1, min(8, os.cpu_count() or 1))


def run_engine(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    engine: str,
    variant: Variant,
    limit: float,
) -> EngineResult:
    """One engine result for `solve_mix` (see the module docstring for the order), within `limit` seconds.

    `engine` is already resolved: "lp-branch" (continuous, auto), "cp-sat" (sliced, auto) or "scip".
    """
    deadline = time.perf_counter() + limit
    if variant is Variant.CONTINUOUS:
        if engine == "lp-branch":
            # The same count search; at an integral fleet the LP's own real shares are the answer, if they
            # pass the float check. If the search gives up, SCIP finishes with its bound.
            leaf = _real_shares_fit(problem, paths, coefs)
            found = search_counts(
                problem, paths, coefs, units, limit * SEARCH_SHARE, leaf, max_nodes=SEARCH_NODES
            )
            if found.status in (Status.OPTIMAL, Status.INFEASIBLE):
                return found
            left = max(deadline - time.perf_counter(), 0.05)
            exact = solve_mip(
                problem, paths, coefs, units, left, integral_shares=False, lower_bound=found.bound
            )
            return _best(exact, found if found.counts else None, found.wall_s)
        return solve_mip(problem, paths, coefs, units, limit, backend=engine.upper(), integral_shares=False)
    if engine == "cp-sat":
        # Branch and bound on the counts over the LP relaxation, CP-SAT deciding whether whole slices fit
        # each integral fleet; if it gives up, CP-SAT on the full model finishes with its bound and fleet.
        fit = _slices_fit(problem, paths, coefs, units, limit * SEARCH_SHARE * FIT_SHARE)
        found = search_counts(problem, paths, coefs, units, limit * SEARCH_SHARE, fit, max_nodes=SEARCH_NODES)
        if found.status in (Status.OPTIMAL, Status.INFEASIBLE):
            return found
        left = max(deadline - time.perf_counter(), 0.05)
        seed = found if found.counts else None
        exact = _cp_sat_exact(
            problem, paths, coefs, units, left, workers=EXACT_WORKERS, lower_bound=found.bound, hint=seed
        )
        return _best(exact, seed, found.wall_s)
    # SCIP on the sliced model: the continuous optimum (same model, real shares) is a lower bound. Rounding
    # its shares to whole slices often meets it, which proves optimality at once; else SCIP solves the sliced
    # model with the bound as a cut, and the rounded fleet stands in if SCIP runs out of time.
    relax = solve_mip(problem, paths, coefs, units, limit * 0.4, backend="SCIP", integral_shares=False)
    if relax.status is Status.INFEASIBLE:
        return relax
    lower = relax.bound
    hint = (
        _round_shares(problem, paths, coefs, units, relax)
        if relax.status in (Status.OPTIMAL, Status.FEASIBLE)
        else None
    )
    if (
        hint is not None
        and lower is not None
        and hint.objective is not None
        and hint.objective <= lower * (1 + 1e-9) + 1e-9
    ):
        return replace(
            hint,
            wall_s=relax.wall_s,
            notes=("optimal: whole slices from the continuous optimum meet its bound",),
        )
    left = max(deadline - time.perf_counter(), 0.05)
    exact = solve_mip(problem, paths, coefs, units, left, backend=engine.upper(), lower_bound=lower)
    return _best(exact, hint, relax.wall_s)


def _real_shares_fit(
    problem: MixProblem, paths: Sequence[Path], coefs: Sequence[Mapping[int, float]]
) -> Leaf:
    """The continuous leaf: the LP's real shares at an integral fleet, if no option is overloaded in floats."""

    def fit(counts: tuple[int, ...], real: Sequence[Mapping[int, float]], _left: float) -> EngineResult:
        shares = tuple({o: min(1.0, max(0.0, v)) for o, v in r.items()} for r in real)
        cost = sum(problem.option_cost(opt) * n for opt, n in zip(problem.options, counts, strict=True))
        found = EngineResult(Status.OPTIMAL, counts, shares, cost, cost, 0.0, "lp-branch")
        if _violations(problem, paths, coefs, found):
            raise Undecided("LP shares overload a count by float dust")
        return found

    return fit


def _slices_fit(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    most_s: float = math.inf,
) -> Leaf:
    """The count search's leaf test: do whole slices fit exactly these counts? (CP-SAT, one worker)

    The rounded-down scaling is a relaxation, so its "infeasible" is a proof; a solution it finds counts
    only if it also passes the float check, else the rounded-up model (a restriction) must find one.
    """

    def fit(counts: tuple[int, ...], real: Sequence[Mapping[int, float]], left: float) -> EngineResult | None:
        if left <= 0:
            raise Undecided("time limit")
        rounded = _slices_near(problem, paths, coefs, units, counts, real)
        if rounded is not None:
            return rounded
        for round_up in (False, True):
            r = fit_slices(problem, paths, coefs, units, counts, min(left, most_s), round_up=round_up)
            if r.status is Status.INFEASIBLE and not round_up:
                return None
            if r.status is Status.UNKNOWN:
                raise Undecided("a whole-slice fit check ran out of time")
            if r.status in (Status.OPTIMAL, Status.FEASIBLE) and not _violations(problem, paths, coefs, r):
                return replace(r, status=Status.OPTIMAL)
        raise Undecided("whole slices fit only up to float dust")

    return fit


ROUNDING_STEPS = 2000  # depth-first steps placing the LP-split paths' slices before CP-SAT is asked


def _slices_near(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    counts: Sequence[int],
    real: Sequence[Mapping[int, float]],
) -> EngineResult | None:
    """Whole slices for `counts` near the LP's real shares, or None (not a proof: CP-SAT decides then).

    A basic LP solution splits only a few paths: the others keep their whole slices, and the slices of the
    split ones are placed depth-first (biggest loads first, each path's options by its LP share) wherever
    the counts still have room, checked in floating point like every answer. Mixed paths only (P/D pairs go
    to CP-SAT).
    """
    if any(p.prefill and p.decode for p in paths) or len(problem.windows) != 1:
        return None
    # Paths the LP serves in whole slices keep them; the split ones are placed anew, all their slices.
    whole = [
        {o: float(round(v)) for o, v in r.items()}
        if all(abs(v - round(v)) <= 1e-9 for v in r.values())
        else dict.fromkeys(r, 0.0)
        for r in real
    ]
    room = [float(n) for n in counts]
    for a, s in zip(coefs, whole, strict=True):
        for o, v in s.items():
            room[o] -= a[o] * v
    if any(r < -LOAD_TOL * max(1.0, n) for r, n in zip(room, counts, strict=True)):
        return None
    todo = [i for i, s in enumerate(whole) if sum(s.values()) < units]
    todo.sort(key=lambda i: -max(coefs[i].values()))
    prefer = {i: sorted(whole[i], key=lambda o: -real[i][o]) for i in todo}
    if not _place_depth_first(todo, whole, prefer, coefs, room, counts, units):
        return None
    if any(sum(w.values()) != units for w in whole):  # every bucket whole
        return None
    r = EngineResult(Status.OPTIMAL, tuple(counts), tuple(whole), None, None, 0.0, "lp-branch")
    if _violations(problem, paths, coefs, r):
        return None
    cost = sum(problem.option_cost(opt) * n for opt, n in zip(problem.options, counts, strict=True))
    return replace(r, objective=cost, bound=cost)


def _place_depth_first(
    todo: Sequence[int],
    whole: list[dict[int, float]],
    prefer: Mapping[int, Sequence[int]],
    coefs: Sequence[Mapping[int, float]],
    room: list[float],
    counts: Sequence[int],
    units: int,
) -> bool:
    """Fill each path in `todo` up to `units` slices in `whole`, depth-first with backtracking.

    Iterative, with the placed slices as the explicit stack: a slice factor of thousands means thousands of
    levels, past Python's recursion limit. A path's slices go on its options in `prefer` order, never
    revisiting an earlier option for a later slice (no order is tried twice). At most ROUNDING_STEPS option
    tries; False when they run out or no placement exists. `whole` and `room` are updated in place.
    """
    placed: list[tuple[int, int]] = []  # (position in todo, option index in prefer) of each slice put
    t, k, steps = 0, 0, 0
    while True:
        while t < len(todo) and sum(whole[todo[t]].values()) >= units:
            t, k = t + 1, 0
        if t == len(todo):
            return True
        i = todo[t]
        while k < len(prefer[i]):
            o = prefer[i][k]
            steps += 1
            if steps > ROUNDING_STEPS:
                return False
            if room[o] - coefs[i][o] >= -LOAD_TOL * max(1.0, counts[o]):
                whole[i][o] += 1
                room[o] -= coefs[i][o]
                placed.append((t, k))
                break
            k += 1
        else:  # no option left for this slice: take back the last slice placed and try its next option
            if not placed:
                return False
            t, k = placed.pop()
            i, o = todo[t], prefer[todo[t]][k]
            whole[i][o] -= 1
            room[o] += coefs[i][o]
            k += 1


def _cp_sat_exact(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    limit: float,
    *,
    workers: int,
    lower_bound: float | None = None,
    hint: EngineResult | None = None,
) -> EngineResult:
    """CP-SAT on the rounded-down (relaxed) scaling; if float dust overloads an option, the rounded-up one."""
    deadline = time.perf_counter() + limit
    kw: dict[str, Any] = {"workers": workers, "lower_bound": lower_bound, "hint": hint}
    exact = solve_cp_sat(problem, paths, coefs, units, limit, **kw)
    if exact.status not in (Status.OPTIMAL, Status.FEASIBLE) or not _violations(problem, paths, coefs, exact):
        return exact
    # The relaxation's answer overloads some option by float dust: solve the rounded-up model, whose answers
    # are all truly feasible; the relaxation's bound still bounds the true optimum.
    restricted = solve_cp_sat(
        problem, paths, coefs, units, max(deadline - time.perf_counter(), 0.05), round_up=True, **kw
    )
    if restricted.status not in (Status.OPTIMAL, Status.FEASIBLE):
        return replace(
            exact,
            status=Status.FEASIBLE,
            notes=("rounded-up model found no solution in time; counts repaired",),
        )
    assert exact.bound is not None and restricted.objective is not None
    proven = restricted.status is Status.OPTIMAL and restricted.objective <= exact.bound * (1 + 1e-9) + 1e-6
    return replace(
        restricted,
        status=Status.OPTIMAL if proven else Status.FEASIBLE,
        bound=exact.bound,
        wall_s=exact.wall_s + restricted.wall_s,
    )


def _best(exact: EngineResult, hint: EngineResult | None, extra_s: float) -> EngineResult:
    """The exact engine's answer, or the rounded hint when the engine ran out of time with nothing better."""
    exact = replace(exact, wall_s=exact.wall_s + extra_s)
    if exact.status is Status.OPTIMAL or hint is None or hint.objective is None:
        return exact
    if exact.objective is None or hint.objective < exact.objective:
        return replace(
            hint, status=Status.FEASIBLE, bound=exact.bound, wall_s=exact.wall_s, engine=exact.engine
        )
    return exact


def _round_shares(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    relax: EngineResult,
) -> EngineResult | None:
    """Whole slices from real shares (largest remainder per path), counts from the loads; None if a cap breaks."""
    shares: list[dict[int, float]] = []
    for p, real in zip(paths, relax.shares, strict=True):
        first = p.mixed + (p.prefill if p.prefill and p.decode else ())
        whole = _largest_remainder({o: real.get(o, 0.0) for o in first}, units)
        if p.prefill and p.decode:
            target = sum(whole.get(o, 0) for o in p.prefill)
            whole |= _largest_remainder({o: real.get(o, 0.0) for o in p.decode}, target)
        shares.append({o: float(v) for o, v in whole.items()})
    loads = window_loads(problem, paths, coefs, shares)
    counts = [opt.min_instances for opt in problem.options]
    for (_, o), load in loads.items():
        counts[o] = max(counts[o], needed_instances(load))
    if not _within_caps(problem, counts):
        return None
    cost = sum(problem.option_cost(opt) * n for opt, n in zip(problem.options, counts, strict=True))
    return EngineResult(Status.OPTIMAL, tuple(counts), tuple(shares), cost, cost, 0.0, "scip+rounding")


def _largest_remainder(real: Mapping[int, float], total: int) -> dict[int, int]:
    scale = sum(real.values())
    if total == 0 or scale <= 0:
        return {o: 0 for o in real} | ({next(iter(real)): total} if real and total else {})
    exact = {o: v * total / scale for o, v in real.items()}
    whole = {o: math.floor(v) for o, v in exact.items()}
    for o in sorted(exact, key=lambda o: exact[o] - whole[o], reverse=True)[: total - sum(whole.values())]:
        whole[o] += 1
    return whole


def _within_caps(problem: MixProblem, counts: Sequence[int]) -> bool:
    for opt, n in zip(problem.options, counts, strict=True):
        if opt.max_instances is not None and n > opt.max_instances:
            return False
    for name, offer in problem.gpus.items():
        used = sum(n * opt.tp for opt, n in zip(problem.options, counts, strict=True) if opt.gpu == name)
        if used < offer.min_gpus or (offer.max_gpus is not None and used > offer.max_gpus):
            return False
    return True


def _violations(
    problem: MixProblem, paths: Sequence[Path], coefs: Sequence[Mapping[int, float]], r: EngineResult
) -> int:
    loads = window_loads(problem, paths, coefs, r.shares)
    return sum(1 for (_, o), load in loads.items() if needed_instances(load) > r.counts[o])
