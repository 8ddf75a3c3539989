"""Head layout for ragged paging: group KV heads of similar budget into page tables of H_p heads.

With ragged paging (Tangram, arXiv 2606.06302) every group g of heads has its own page table, and a page holds
`block_size` tokens of all |g| heads of the group. A group's table grows with the *largest* budget among its
heads, so for a request of T tokens the group costs |g| · B_g · T head-tokens with B_g = max_{h∈g} b_h and
b_h = μ_h + α·σ_h. The layout problem is to partition the heads into groups of H_p minimising

    cost = Σ_g |g| · max_{h∈g} b_h                   (the "sum of group maxima", in head-budget units)

against the ideal Σ_h b_h (no padding) and the monolithic n · max_h b_h (one budget for every head).

**Sorted chunking is optimal** when every group has H_p heads: sort budgets descending and cut consecutive
chunks. Proof by exchange: the group holding the largest head b_1 pays H_p · b_1 whatever its other members
are; filling it with the next H_p − 1 largest heads never raises another group's maximum (swapping a larger
head out of a later group for a smaller one only lowers that group's max). Induct on the remaining heads.
When H_p does not divide n, one group has n mod H_p heads; the same argument shows an optimal partition is
contiguous in sorted order for a fixed order of group sizes, so trying every position of the short group
(G choices) is optimal too. `tests/kv/test_kv_layout.py` checks both against exhaustive search.

Heads are numbered flat: f = layer · H + head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from placement.kv_profile import HeadProfile


@dataclass(frozen=True, slots=True)
class HeadGroups:
    """A partition of flat head indices into page-table groups, each with its budget B_g = max member budget."""

    heads_per_group: int
    members: tuple[tuple[int, ...], ...]
    budgets: tuple[float, ...]

    @property
    def num_groups(self) -> int:
        return len(self.members)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(m) for m in self.members)

    @property
    def cost(self) -> float:
        """Σ_g |g| · B_g, in head-budget units (multiply by T tokens for head-tokens)."""
        return float(sum(len(m) * b for m, b in zip(self.members, self.budgets, strict=True)))


@dataclass(frozen=True, slots=True)
class LayoutReport:
    """Padding of three groupings against the ideal Σ_h b_h (all in head-budget units)."""

    heads: int
    heads_per_group: int
    alpha: float
    ideal: float
    monolithic: float
    adjacent: float
    sorted: float

    @staticmethod
    def waste(cost: float, ideal: float) -> float:
        """(cost − ideal) / cost: the fraction of reserved KV that is padding (Tangram's residual_waste_fraction)."""
        return 0.0 if cost <= 0 else (cost - ideal) / cost

    @staticmethod
    def over_allocation(cost: float, ideal: float) -> float:
        """cost / ideal − 1: reserved KV beyond the ideal, relative to the ideal."""
        return 0.0 if ideal <= 0 else cost / ideal - 1.0

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            "heads": self.heads,
            "heads_per_group": self.heads_per_group,
            "alpha": self.alpha,
            "ideal": self.ideal,
        }
        for name in ("monolithic", "adjacent", "sorted"):
            cost = getattr(self, name)
            out[f"{name}_cost"] = cost
            out[f"{name}_waste"] = self.waste(cost, self.ideal)
            out[f"{name}_over_allocation"] = self.over_allocation(cost, self.ideal)
        # Fraction of the full (uncompressed) KV that sorted grouping reclaims against adjacent heads.
        out["sorted_saves_of_full_kv_vs_adjacent"] = (
            (self.adjacent - self.sorted) / self.heads if self.heads else 0.0
        )
        return out


def group_cost(groups: Sequence[Sequence[int]], budgets: Sequence[float]) -> float:
    """Σ_g |g| · max_{h∈g} budgets[h]."""
    return float(sum(len(g) * max(budgets[h] for h in g) for g in groups if g))


def sorted_chunking(budgets: Sequence[float], heads_per_group: int) -> list[list[int]]:
    """Optimal partition of heads into groups of `heads_per_group` (one shorter group when it doesn't divide).

    Returns groups of indices into `budgets`, groups in descending budget order, each group's members in
    descending budget order (ties broken by index, so the result is deterministic).
    """
    if heads_per_group < 1:
        raise ValueError(f"heads per group must be ≥ 1, got {heads_per_group}")
    order = sorted(range(len(budgets)), key=lambda i: (-budgets[i], i))
    n = len(order)
    if n == 0:
        return []
    full, rem = divmod(n, heads_per_group)
    if rem == 0:
        return [order[i : i + heads_per_group] for i in range(0, n, heads_per_group)]
    best: list[list[int]] | None = None
    best_cost = float("inf")
    for pos in range(full + 1):  # position of the short group among the full + 1 groups
        sizes = [heads_per_group] * pos + [rem] + [heads_per_group] * (full - pos)
        groups, start = [], 0
        for size in sizes:
            groups.append(order[start : start + size])
            start += size
        cost = group_cost(groups, budgets)
        if cost < best_cost - 1e-12:
            best, best_cost = groups, cost
    assert best is not None
    return best


def adjacent_grouping(n: int, heads_per_group: int) -> list[list[int]]:
    """Consecutive flat heads (layer-major) in groups of `heads_per_group`: the layout without clustering."""
    if heads_per_group < 1:
        raise ValueError(f"heads per group must be ≥ 1, got {heads_per_group}")
    return [list(range(i, min(n, i + heads_per_group))) for i in range(0, n, heads_per_group)]


def make_groups(
    groups: Sequence[Sequence[int]], budgets: Sequence[float], heads_per_group: int
) -> HeadGroups:
    members = tuple(tuple(int(h) for h in g) for g in groups if g)
    return HeadGroups(heads_per_group, members, tuple(float(max(budgets[h] for h in g)) for g in members))


def sorted_groups(profile: HeadProfile, heads_per_group: int, alpha: float = 2.0) -> HeadGroups:
    """The clustered layout a compression worker uses: sorted chunking of μ + α·σ budgets."""
    budgets = profile.budgets(alpha).ravel().tolist()
    return make_groups(sorted_chunking(budgets, heads_per_group), budgets, heads_per_group)


def adjacent_groups(profile: HeadProfile, heads_per_group: int, alpha: float = 2.0) -> HeadGroups:
    budgets = profile.budgets(alpha).ravel().tolist()
    return make_groups(adjacent_grouping(len(budgets), heads_per_group), budgets, heads_per_group)


def layout_report(profile: HeadProfile, heads_per_group: int, alpha: float = 2.0) -> LayoutReport:
    """Ideal, monolithic, adjacent and sorted costs of the μ + α·σ budgets of `profile`."""
    b = profile.budgets(alpha).ravel()
    return layout_report_from_budgets(b, heads_per_group, alpha)


def layout_report_from_budgets(budgets: np.ndarray, heads_per_group: int, alpha: float) -> LayoutReport:
    b = [float(x) for x in np.asarray(budgets, dtype=np.float64).ravel()]
    n = len(b)
    return LayoutReport(
        heads=n,
        heads_per_group=heads_per_group,
        alpha=alpha,
        ideal=float(sum(b)),
        monolithic=float(n * max(b)) if b else 0.0,
        adjacent=group_cost(adjacent_grouping(n, heads_per_group), b),
        sorted=group_cost(sorted_chunking(b, heads_per_group), b),
    )
