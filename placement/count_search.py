"""Best-first branch and bound over the instance counts N only, on the LP relaxation (GLOP).

Why: the models of `placement.binpacking` have few integer counts (one per option) and many shares. Their
LP relaxation (N and shares real) is tight up to the integrality of N, and an LP of a few hundred columns
re-solves in well under a millisecond when only the bounds of N change. So the search branches on N alone:

- A node is a box of bounds on N; its bound is the box's LP optimum, *lifted* to the next achievable cost
  when every option costs a whole number of some unit g (prices in cents: an LP bound of $59.013 means no
  fleet in the box costs less than $59.02). Lifting keeps a margin of 1e-3 · g (and 1e-7 relative) below
  the LP value, so GLOP's tolerances can only weaken a bound, never overstate it.
- Best first: the open node with the lowest bound is expanded next. If its LP optimum has integral N*,
  `leaf(N*)` decides whether the variant's shares fit exactly that fleet (whole slices: a CP-SAT
  feasibility question; real shares: the LP itself). A fit becomes the incumbent; a proven misfit removes
  the single point N* from the box, which splits into at most 2·G boxes (N_j = N*_j for j < o, and
  N_o ≤ N*_o − 1 or N_o ≥ N*_o + 1). Otherwise the most fractional N_o is branched on (floor / ceil).
- The search ends when no open node can beat the incumbent (status optimal, bound = cost), when the root
  LP is infeasible (infeasible), or it gives up — node or time limit, an LP GLOP did not solve, a leaf the
  callback could not decide — and returns the incumbent (if any) with the best bound proven so far, for
  an exact engine to finish with that bound as a cut.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from functools import reduce

from ortools.linear_solver import pywraplp

from placement.binpacking import EngineResult, MixProblem, Path, Status
from placement.mip_engines import build_linear

MAX_NODES = 5000  # LPs per search; at ~0.2–1.5 ms each this stays well inside any sensible time limit
INTEGRAL_TOL = 1e-6  # an LP count this close to an integer is that integer (the leaf check is exact)


class Undecided(Exception):
    """Raised by a leaf callback that cannot tell whether the fleet fits (time limit, float dust)."""


Leaf = Callable[[tuple[int, ...], Sequence[Mapping[int, float]], float], EngineResult | None]
Box = tuple[tuple[int, int], ...]
Solved = tuple[float, list[float], list[dict[int, float]]]  # (lifted bound, N, shares) of a box's LP


def cost_unit(costs: Sequence[float]) -> float:
    """g > 0 when every cost is a whole number of micro-dollars: the gcd of them, in dollars; else 0."""
    micro = [round(c * 1_000_000) for c in costs]
    if any(
        abs(m - c * 1_000_000) > 1e-6  # absorbs the float error of c · 10⁶ (1.01 · 10⁶ is 1010000.0000000001)
        for m, c in zip(micro, costs, strict=True)
    ):
        return 0.0
    unit = reduce(math.gcd, micro, 0)
    return unit / 1_000_000 if unit else 0.0


def lifted(bound: float, unit: float) -> float:
    """The least achievable cost ≥ `bound` (see the module docstring), with a margin for LP tolerances."""
    margin = 1e-7 * max(1.0, abs(bound))
    if unit <= 0:
        return bound - margin
    return math.ceil((bound - max(margin, 1e-3 * unit)) / unit) * unit


def search_counts(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    units: int,
    time_limit_s: float,
    leaf: Leaf,
    *,
    max_nodes: int = MAX_NODES,
) -> EngineResult:
    """The cheapest fleet whose counts pass `leaf`, by the search above (engine name `lp-branch`).

    `leaf(counts, lp_shares, seconds_left)` returns a verified EngineResult with exactly those counts, None
    when the shares provably do not fit them, or raises `Undecided`. Status: optimal, infeasible, feasible
    (gave up with an incumbent; `bound` is proven) or unknown (gave up without one).
    """
    started = time.perf_counter()
    deadline = started + time_limit_s
    solver = pywraplp.Solver.CreateSolver("GLOP")
    # GLOP's presolve redoes its work on every bound change; without it each re-solve starts from the last
    # basis (measured: the 12 × 100 benchmark instances 99 → 66 ms CPU, none slower)
    solver.SetSolverSpecificParametersAsString("use_preprocessing: false")
    counts, shares, objective = build_linear(
        solver, problem, paths, coefs, units, integral_counts=False, integral_shares=False
    )
    solver.Minimize(objective)
    costs = [problem.option_cost(opt) for opt in problem.options]
    unit = cost_unit(costs)
    root: Box = tuple((int(v.lb()), int(v.ub())) for v in counts)
    best: EngineResult | None = None
    nodes = 0

    def solve(box: Box) -> Solved | None:
        """(lifted bound, N, shares) of the box's LP; None if infeasible; Undecided if GLOP failed."""
        nonlocal nodes
        nodes += 1
        for var, (lo, hi) in zip(counts, box, strict=True):
            var.SetBounds(lo, hi)
        code = solver.Solve()
        if code == pywraplp.Solver.INFEASIBLE:
            return None
        if code != pywraplp.Solver.OPTIMAL:
            raise Undecided(f"GLOP status {code}")
        values = [v.solution_value() for v in counts]
        real: list[dict[int, float]] = []
        if all(abs(x - round(x)) <= INTEGRAL_TOL for x in values):  # a leaf: its shares are needed
            real = [{o: v.solution_value() for o, v in s.items()} for s in shares]
        return lifted(solver.Objective().Value(), unit), values, real

    def beats(bound: float) -> bool:
        """Could a fleet of cost ≥ bound be strictly cheaper than the incumbent?"""
        if best is None or best.objective is None:
            return True
        return bound < best.objective - (unit / 2 if unit > 0 else 1e-9 * max(1.0, best.objective))

    def result(status: Status, bound: float | None, note: str = "") -> EngineResult:
        """The answer; `note` (why the search stopped short) reaches the plan's notes, so only when it did."""
        wall = time.perf_counter() - started
        if best is None:
            return EngineResult(status, (), (), None, bound, wall, "lp-branch", (note,) if note else ())
        return EngineResult(
            status,
            best.counts,
            best.shares,
            best.objective,
            bound,
            wall,
            "lp-branch",
            (note,) if note else (),
        )

    # Open nodes: (bound, order, box, LP solution or None). Children inherit their parent's bound and are
    # solved only when they reach the top (many are pruned first); a solved node whose own bound is no longer
    # the lowest goes back in. Ties go to the newest node (depth first among equals).
    heap: list[tuple[float, int, Box, Solved | None]] = []
    order = itertools.count(0, -1)
    # The bound of the node popped and not yet settled (back on the heap, pruned or split into children):
    # it is the lowest open bound, so a give-up while it is in hand must count it (else the bound overstates)
    in_hand = math.inf
    try:
        first = solve(root)
        if first is None:
            return result(Status.INFEASIBLE, None)
        heapq.heappush(heap, (first[0], next(order), root, first))
        while heap:
            bound, _, box, solved = heap[0]
            if not beats(bound):
                break  # every open node bounds at least the incumbent: proven optimal
            if nodes >= max_nodes or time.perf_counter() > deadline:
                raise Undecided("node or time limit")
            heapq.heappop(heap)
            in_hand = bound
            if solved is None:
                solved = solve(box)
                if solved is None or not beats(solved[0]):
                    in_hand = math.inf
                    continue
                if heap and solved[0] > heap[0][0]:
                    heapq.heappush(heap, (solved[0], next(order), box, solved))
                    in_hand = math.inf
                    continue
            _, values, real = solved
            whole = [round(x) for x in values]
            if all(abs(x - n) <= INTEGRAL_TOL for x, n in zip(values, whole, strict=True)):
                found = leaf(tuple(whole), real, deadline - time.perf_counter())
                if found is not None and (best is None or beats(found.objective or math.inf)):
                    best = found
                children = _without_point(box, whole) if found is None else []
            else:
                o = max(range(len(values)), key=lambda j: abs(values[j] - round(values[j])))
                lo, hi = box[o]
                children = [
                    _with(box, o, (lo, math.floor(values[o]))),
                    _with(box, o, (math.ceil(values[o]), hi)),
                ]
            for child in children:
                heapq.heappush(heap, (bound, next(order), child, None))
            in_hand = math.inf
    except Undecided as why:
        open_bound = min((h[0] for h in heap), default=math.inf)
        open_bound = min(open_bound, in_hand)  # the node in hand had the lowest bound when it was popped
        incumbent = best.objective if best is not None and best.objective is not None else math.inf
        bound = min(open_bound, incumbent)
        status = Status.FEASIBLE if best is not None else Status.UNKNOWN
        return result(status, None if math.isinf(bound) else bound, f"count search gave up: {why}")
    if best is None:
        return result(Status.INFEASIBLE, None)
    return result(Status.OPTIMAL, best.objective)


def _with(box: Box, o: int, span: tuple[int, int]) -> Box:
    return tuple(span if j == o else b for j, b in enumerate(box))


def _without_point(box: Box, point: Sequence[int]) -> list[Box]:
    """Disjoint boxes covering `box` minus `point` (which lies in it)."""
    out: list[Box] = []
    fixed = list(box)
    for o, n in enumerate(point):
        lo, hi = box[o]
        if lo <= n - 1:
            out.append((*fixed[:o], (lo, n - 1), *box[o + 1 :]))
        if n + 1 <= hi:
            out.append((*fixed[:o], (n + 1, hi), *box[o + 1 :]))
        fixed[o] = (n, n)
    return out
