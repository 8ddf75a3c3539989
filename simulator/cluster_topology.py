"""Topology in the cluster simulator: where instances sit, how fast P/D KV moves, what the report shows.

With `nodes:` in the fleet file (the `mosaic plan --nodes` format) every instance is placed on a node by
`scheduler.topology.TopologyPlacer`: the initial replicas at t = 0 (a fleet that does not fit is a config
error), and each decision's additions together, through the planner's CP-SAT topology solver, around the
instances already running. A decision the inventory cannot hold is clipped to what fits; the shortfall
is kept (`shortfalls`: t, pool, requested, placed, why). Scale-in picks its victims by
`TopologyPlacer.removal_order` within the pool; an instance's GPUs are freed when it is removed. An
instance takes tp × dp GPUs of one node (`InstanceKind.gpus`: its dp engines of tp GPUs each).

Without an inventory, an instance's domain is its pool's `domain:` (None: unknown).

KV transfer time of a P/D request = prompt KV bytes / bandwidth, where the bandwidth is `kv_link_gbps`
when both instances are in one domain (or either domain is unknown) and `kv_link_cross_domain_gbps`
(default: `kv_link_gbps`) when their domains differ.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from placement.catalog import Catalog
from placement.profiles import Role
from placement.topology import InstanceKind, TopologyError
from scheduler.topology import Inventory, TopologyPlacer, pool_gpus
from simulator.cluster_config import FleetConfig, FleetConfigError


def fleet_inventory(fleet: FleetConfig, catalog: Catalog) -> Inventory | None:
    """The fleet's `nodes:` as an `Inventory`, node GPU names in the catalog's spelling; None when unset."""
    if fleet.nodes is None:
        return None
    try:
        inventory = Inventory.from_data(fleet.nodes, "nodes", catalog, pool_gpus(fleet.pools, catalog))
    except TopologyError as exc:
        raise FleetConfigError(str(exc)) from None
    return inventory.in_catalog_names(catalog)


@dataclass(slots=True)
class SimTopology:
    """The simulator's topology state (module docstring)."""

    fleet: FleetConfig
    placer: TopologyPlacer | None
    pool_domains: Mapping[str, str | None]
    _queued: dict[str, deque[tuple[str, str]]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    shortfalls: list[dict[str, Any]] = field(default_factory=list)
    transfers: dict[str, int] = field(default_factory=lambda: {"intra_domain": 0, "cross_domain": 0})

    @classmethod
    def build(cls, fleet: FleetConfig, catalog: Catalog) -> SimTopology:
        inventory = fleet_inventory(fleet, catalog)
        placer = None
        if inventory is not None:
            kinds = {
                p.name: InstanceKind(
                    catalog.model(p.model or fleet.model).name,
                    catalog.gpu(p.gpu).name,
                    p.tp,
                    Role(p.role),
                    p.dp,
                )
                for p in fleet.pools
            }
            placer = TopologyPlacer(inventory, kinds)
        return cls(fleet, placer, {p.name: p.domain for p in fleet.pools})

    # ------------------------------------------------------------------ placement
    def place_initial(self) -> None:
        """Nodes for the fleet's initial replicas; a fleet the inventory cannot hold is a config error."""
        if self.placer is None:
            return
        want = {p.name: p.replicas for p in self.fleet.pools}
        placed = self.placer.place(want)
        if placed.shortfall:
            short = ", ".join(
                f"{p} {placed.granted.get(p, 0)}/{n}" for p, n in sorted(placed.requested.items())
            )
            raise FleetConfigError(
                f"nodes: the initial replicas do not fit ({short} placed): {placed.explanation}"
            )
        self._queue(placed.nodes)

    def clip(self, targets: Mapping[str, int], provisioned: Mapping[str, int], now: float) -> dict[str, int]:
        """Targets with every scale-up placed (nodes queued for `next_node`) and clipped to what fits."""
        out = dict(targets)
        if self.placer is None:
            return out
        adds = {p: t - provisioned[p] for p, t in targets.items() if t > provisioned[p]}
        if not adds:
            return out
        placed = self.placer.place(adds)
        for pool in sorted(placed.shortfall):
            out[pool] = provisioned[pool] + placed.granted.get(pool, 0)
            self.shortfalls.append(
                {
                    "t": round(now, 3),
                    "pool": pool,
                    "requested": adds[pool],
                    "placed": placed.granted.get(pool, 0),
                    "why": placed.explanation,
                }
            )
        self._queue(placed.nodes)
        return out

    def _queue(self, nodes: Mapping[str, tuple[tuple[str, str], ...]]) -> None:
        for pool, slots in nodes.items():
            self._queued.setdefault(pool, deque()).extend(slots)

    def start(self, instance: str, pool: str) -> str | None:
        """Record a new instance on its queued node; its domain (the pool's without an inventory)."""
        if self.placer is None:
            return self.pool_domains.get(pool)
        node, domain = self._queued[pool].popleft()
        self.placer.assign(instance, pool, node)
        return domain

    def remove(self, instance: str) -> None:
        if self.placer is not None:
            self.placer.release(instance)

    def victims_first(self, candidates: list[str]) -> list[str]:
        return self.placer.removal_order(candidates) if self.placer is not None else candidates

    # ------------------------------------------------------------------ transfers and reporting
    def bandwidth_gbps(self, prefill_domain: str | None, decode_domain: str | None) -> float:
        cross = prefill_domain is not None and decode_domain is not None and prefill_domain != decode_domain
        self.transfers["cross_domain" if cross else "intra_domain"] += 1
        if cross and self.fleet.kv_link_cross_domain_gbps is not None:
            return self.fleet.kv_link_cross_domain_gbps
        return self.fleet.kv_link_gbps

    def sample(self, now: float, pairing: Collection[str]) -> None:
        if self.placer is not None:
            self.samples.append({"t": round(now, 3), **self.placer.summary(pairing).as_dict()})

    def report(self) -> dict[str, Any] | None:
        """The report's `topology` section (None when no instance has a known domain)."""
        if self.placer is None and not any(self.pool_domains.values()):
            return None
        out: dict[str, Any] = {
            "kv_link_gbps": self.fleet.kv_link_gbps,
            "kv_link_cross_domain_gbps": self.fleet.kv_link_cross_domain_gbps or self.fleet.kv_link_gbps,
            "kv_transfers": dict(self.transfers),
        }
        if self.placer is not None:
            inv = self.placer.inventory
            out |= {
                "nodes": len(inv.nodes),
                "domains": sorted({n.domain for n in inv.nodes}),
                "same_domain": inv.same_domain,
                "max_cross_domain_pairs": max((s["cross_domain_pairs"] for s in self.samples), default=0),
                "max_fragmented_nodes": max((s["fragmented_nodes"] for s in self.samples), default=0),
                "shortfalls": self.shortfalls,
                "samples": self.samples,
            }
        return out
