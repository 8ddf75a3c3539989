"""Partition KV heads across tensor-parallel ranks so the most loaded rank holds the fewest ragged pages.

Under TP every rank holds H/tp KV heads of *every* layer (vLLM shards the KV heads of each layer evenly) and
page tables never span ranks, so each rank groups its own heads (sorted chunking, `placement.kv_layout`).
Stock vLLM gives rank r the contiguous heads [r·H/tp, (r+1)·H/tp) of each layer. Any other assignment with
H/tp heads per layer per rank is realisable by permuting, per layer, the KV heads (with their query heads,
and the matching rows/columns of the q/k/v and o projections) before sharding: the *implied weight
permutation* reported here.

CP-SAT model (heads sorted by budget descending, b_0 ≥ b_1 ≥ … ≥ b_{n-1}, b_n = 0):

    x[i,r] ∈ {0,1}     head i on rank r;            Σ_r x[i,r] = 1;   Σ_{i∈layer l} x[i,r] = H/tp
    c[i,r] = Σ_{j≤i} x[j,r]                        heads of rank r among the i+1 largest
    k[i,r] ∈ ℤ, H_p·k[i,r] ≥ c[i,r]                 k = ceil(c/H_p) = groups rank r has opened so far
    cost_r = H_p · Σ_i (b_i − b_{i+1}) · k[i,r]     = H_p · Σ_{group leaders} b  (Abel summation)
    minimise  z · M + Σ_r cost_r   with z ≥ cost_r  (min-max first, then the sum of per-group maxima)

Because b_i − b_{i+1} ≥ 0 the minimisation pushes each k to its least value ceil(c/H_p), so cost_r equals the
sorted-chunking cost of rank r's heads exactly. When H_p does not divide a rank's heads, one group is short
(rem heads) and sorted chunking puts it where it costs least: the model picks that position per rank
(one-hot), and H_p·k becomes w[i,r], the heads of the groups opened among the rank's c largest, which is
H_p·ceil(c/H_p) before the short group and P + rem + H_p·ceil((c − P − rem)⁺/H_p) from it on (P its start). A lower bound on the max is the single-rank sorted cost / tp
(the union of per-rank groupings is one partition of all heads, never better than global sorted chunking).
Budgets are scaled to integers (×10⁴). One search worker, bounded by both a deterministic-time and a wall-time
limit of `time_limit_s` (small instances are solved to optimality and replay exactly; on large ones the
greedy start is often already the best found, reported as status GREEDY or FEASIBLE).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from placement.kv_layout import group_cost, sorted_chunking

SCALE = 10_000  # budget units per 1.0 of retention in the integer model


@dataclass(frozen=True, slots=True)
class TpPartition:
    tp: int
    heads_per_group: int
    rank_of: tuple[tuple[int, ...], ...]  # [layer][head] → rank
    rank_groups: tuple[tuple[tuple[int, ...], ...], ...]  # per rank: groups of flat head indices
    rank_cost: tuple[float, ...]  # per rank: Σ_g |g|·B_g of its groups
    contiguous_rank_cost: tuple[float, ...]  # the same for vLLM's stock contiguous sharding
    lower_bound: float  # global sorted-chunking cost / tp
    status: str  # OPTIMAL | FEASIBLE | GREEDY (CP-SAT found nothing better than its heuristic start)

    @property
    def max_cost(self) -> float:
        return max(self.rank_cost)

    @property
    def contiguous_max_cost(self) -> float:
        return max(self.contiguous_rank_cost)

    def permutation(self) -> list[list[int]]:
        """Per layer: original KV head indices in their new order (rank 0's heads first, then rank 1's, …).

        Weight row k of the permuted k/v projection (and the query heads of KV head k) is original head perm[k].
        """
        perm = []
        for row in self.rank_of:
            perm.append([h for r in range(self.tp) for h in range(len(row)) if row[h] == r])
        return perm


def tp_partition(
    budgets: np.ndarray, tp: int, heads_per_group: int, time_limit_s: float = 5.0
) -> TpPartition:
    """Assign the heads of `budgets` [L, H] to `tp` ranks minimising the most loaded rank's grouped cost."""
    b2 = np.asarray(budgets, dtype=np.float64)
    if b2.ndim != 2:
        raise ValueError(f"budgets must be [layers, heads], got shape {b2.shape}")
    layers, heads = b2.shape
    if tp < 1 or heads % tp:
        raise ValueError(f"tp={tp} must divide the {heads} KV heads per layer")
    if heads_per_group < 1:
        raise ValueError(f"heads per group must be ≥ 1, got {heads_per_group}")
    flat = b2.ravel().tolist()
    contiguous = contiguous_assignment(layers, heads, tp)
    lower = group_cost(sorted_chunking(flat, heads_per_group), flat) / tp
    if tp == 1:
        return _result(b2, tp, heads_per_group, contiguous, contiguous, lower, "OPTIMAL")
    # Hint CP-SAT with the better of the greedy deal and stock contiguous sharding; keep the best of all three.
    start = min(
        (_greedy(b2, tp, heads_per_group), contiguous), key=lambda a: _score(b2, a, tp, heads_per_group)
    )
    assign, status = _solve(b2, tp, heads_per_group, start, time_limit_s)
    if assign is None or _score(b2, assign, tp, heads_per_group) > _score(b2, start, tp, heads_per_group):
        assign, status = start, "GREEDY"
    return _result(b2, tp, heads_per_group, assign, contiguous, lower, status)


def contiguous_assignment(layers: int, heads: int, tp: int) -> list[list[int]]:
    """Stock vLLM sharding as [layer][head] → rank: rank r holds heads [r·H/tp, (r+1)·H/tp) of every layer
    (`tp` divides `heads`)."""
    return [[h // (heads // tp) for h in range(heads)] for _ in range(layers)]


def _score(b2: np.ndarray, assign: list[list[int]], tp: int, hp: int) -> tuple[float, float]:
    costs = [rank_cost(b2, assign, r, hp)[1] for r in range(tp)]
    return max(costs), sum(costs)


def rank_cost(
    b2: np.ndarray, rank_of: Sequence[Sequence[int]], rank: int, heads_per_group: int
) -> tuple[list[list[int]], float]:
    heads = b2.shape[1]
    mine = [layer * heads + h for layer, row in enumerate(rank_of) for h, r in enumerate(row) if r == rank]
    flat = b2.ravel()
    local = [float(flat[f]) for f in mine]
    groups = [[mine[i] for i in g] for g in sorted_chunking(local, heads_per_group)]
    return groups, group_cost(groups, flat.tolist())


def _result(
    b2: np.ndarray,
    tp: int,
    hp: int,
    assign: list[list[int]],
    contiguous: list[list[int]],
    lower: float,
    status: str,
) -> TpPartition:
    groups, costs, cont = [], [], []
    for r in range(tp):
        g, c = rank_cost(b2, assign, r, hp)
        groups.append(tuple(tuple(x) for x in g))
        costs.append(c)
        cont.append(rank_cost(b2, contiguous, r, hp)[1])
    return TpPartition(
        tp, hp, tuple(tuple(row) for row in assign), tuple(groups), tuple(costs), tuple(cont), lower, status
    )


def _greedy(b2: np.ndarray, tp: int, hp: int) -> list[list[int]]:
    """Deal the global sorted-chunking groups, largest first, each to the least loaded rank with layer quota.

    A group whose heads no single rank can take (layer quotas) is split head by head over ranks with quota.
    Each rank then holds mostly whole global groups, so the sum over ranks stays near the global optimum.
    """
    layers, heads = b2.shape
    quota = heads // tp
    used = [[0] * tp for _ in range(layers)]
    load = [0.0] * tp
    assign = [[0] * heads for _ in range(layers)]
    flat = b2.ravel().tolist()
    for group in sorted_chunking(flat, hp):
        need: dict[int, int] = {}
        for f in group:
            need[f // heads] = need.get(f // heads, 0) + 1
        fits = [r for r in range(tp) if all(used[layer][r] + k <= quota for layer, k in need.items())]
        for f in group:
            layer, h = divmod(f, heads)
            cands = fits or [r for r in range(tp) if used[layer][r] < quota]
            r = min(cands, key=lambda r: (load[r], r))
            assign[layer][h] = r
            used[layer][r] += 1
        for r in {assign[f // heads][f % heads] for f in group}:
            load[r] += hp * max(flat[f] for f in group if assign[f // heads][f % heads] == r)
    return assign


def _solve(
    b2: np.ndarray, tp: int, hp: int, hint: list[list[int]], time_limit_s: float
) -> tuple[list[list[int]] | None, str]:
    layers, heads = b2.shape
    n = layers * heads
    # A group never holds more than a rank's heads: a larger H_p groups exactly as H_p = the rank's heads do
    # (one group per rank, cost |g|·max either way), and keeps CP-SAT's domains (H_p · groups · budget) small
    # (H_p = 10¹⁶ overflowed them).
    hp = min(hp, n // tp)
    order = sorted(range(n), key=lambda f: (-b2.flat[f], f))
    ib = [round(float(b2.flat[f]) * SCALE) for f in order] + [0]
    m = cp_model.CpModel()
    x = [[m.new_bool_var(f"x{i}_{r}") for r in range(tp)] for i in range(n)]
    for i in range(n):
        m.add_exactly_one(x[i])
    quota = heads // tp
    by_layer: dict[int, list[int]] = {}
    for i, f in enumerate(order):
        by_layer.setdefault(f // heads, []).append(i)
    for idx in by_layer.values():
        for r in range(tp):
            m.add(sum(x[i][r] for i in idx) == quota)
    # Ranks are interchangeable: pin the largest head to the rank the hint puts it on.
    m.add(x[0][hint[order[0] // heads][order[0] % heads]] == 1)
    per_rank = n // tp
    max_groups = -(-per_rank // hp)
    full, rem = divmod(per_rank, hp)
    costs = []
    for r in range(tp):
        terms = []
        prev = None
        # A short group (rem heads) when hp does not divide a rank's heads: at the group position the solver
        # picks (sorted chunking tries each), its start P = hp · position among the rank's heads.
        start = None
        if rem:
            at = [m.new_bool_var(f"s{p}_{r}") for p in range(full + 1)]
            m.add_exactly_one(at)
            start = hp * sum(p * at[p] for p in range(full + 1))
        for i in range(n):
            c = m.new_int_var(0, per_rank, f"c{i}_{r}")
            m.add(c == (prev if prev is not None else 0) + x[i][r])
            prev = c
            delta = ib[i] - ib[i + 1]
            if delta <= 0:
                continue
            k = m.new_int_var(0, max_groups, f"k{i}_{r}")
            m.add(hp * k >= c)
            if start is None:
                terms.append(hp * delta * k)
                continue
            # w = heads in the groups opened among the rank's c largest: hp·ceil(c/hp) up to the short group
            # (c ≤ P); past it, P + rem + hp·ceil((c − P − rem)⁺/hp). `after` may only be false when c ≤ P,
            # and being true when c ≤ P never lowers w, so the minimisation sets it exactly.
            after = m.new_bool_var(f"a{i}_{r}")
            m.add(c <= start).only_enforce_if(~after)
            k2 = m.new_int_var(0, max_groups, f"k2{i}_{r}")
            m.add(hp * k2 >= c - start - rem)
            w = m.new_int_var(0, hp * max_groups, f"w{i}_{r}")
            m.add(w >= hp * k).only_enforce_if(~after)
            m.add(w >= start + rem + hp * k2).only_enforce_if(after)
            terms.append(delta * w)
        cost = m.new_int_var(0, hp * max_groups * ib[0] + 1, f"cost{r}")
        m.add(cost == sum(terms)) if terms else m.add(cost == 0)
        costs.append(cost)
    z = m.new_int_var(0, hp * max_groups * ib[0] + 1, "z")
    for c in costs:
        m.add(z >= c)
    m.minimize(z * (tp * hp * max_groups * ib[0] + 1) + sum(costs))
    for i, f in enumerate(order):
        layer, h = divmod(f, heads)
        for r in range(tp):
            m.add_hint(x[i][r], hint[layer][h] == r)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.max_time_in_seconds = time_limit_s
    st = solver.solve(m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, solver.status_name(st)
    assign = [[0] * heads for _ in range(layers)]
    for i, f in enumerate(order):
        layer, h = divmod(f, heads)
        assign[layer][h] = next(r for r in range(tp) if solver.value(x[i][r]))
    return assign, solver.status_name(st)
