"""Cost-aware buying and selling of capacity across pools of different GPU types.

Capacity is in the unit the caller chooses (decode tokens/s, prompt tokens/s). Adding buys the cheapest
capacity first (lowest $/h per unit, i.e. cheapest-meeting-profile); removing sells the priciest first,
and only while the capacity left still covers what is required (the consolidation check: removing one of
N instances is allowed only if load × N/(N−1) stays under target).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from scheduler.autoscaler.signals import PoolSpec

CapacityOf = Callable[[PoolSpec], float]


def rebalance(
    pools: Sequence[PoolSpec], current: Mapping[str, int], required: float, capacity_of: CapacityOf
) -> dict[str, int]:
    """Counts per pool covering `required` capacity, moved from `current` by the cheapest changes.

    Pools are first clamped to their [min, max]. If capacity falls short, instances are added one at a time
    to the pool with the lowest cost per unit that has headroom; if it exceeds, instances are removed from
    the pool with the highest cost per unit while the rest still covers `required`.
    """
    counts = {p.name: min(max(current.get(p.name, 0), p.min_replicas), p.max_replicas) for p in pools}
    by_unit_cost = sorted(pools, key=lambda p: (p.cost_per_hour / capacity_of(p), p.name))
    total = sum(counts[p.name] * capacity_of(p) for p in pools)
    while total < required:
        cheapest = next((p for p in by_unit_cost if counts[p.name] < p.max_replicas), None)
        if cheapest is None:
            break  # every pool at max: the shortfall is reported by the caller
        counts[cheapest.name] += 1
        total += capacity_of(cheapest)
    for pool in reversed(by_unit_cost):
        cap = capacity_of(pool)
        while counts[pool.name] > pool.min_replicas and total - cap >= required:
            counts[pool.name] -= 1
            total -= cap
    return counts


def capacity(pools: Sequence[PoolSpec], counts: Mapping[str, int], capacity_of: CapacityOf) -> float:
    return sum(counts.get(p.name, 0) * capacity_of(p) for p in pools)
