"""Topology-aware placement of the instances an autoscaler adds, over a node inventory (pure, floor 2).

`TopologyPlacer` keeps which node each running instance occupies and answers two questions per decision:

- **Where do the instances a decision adds go?** `place(adds)` runs the planner's CP-SAT topology solver
  (`placement.topology.place_instances`) on the free capacity only: every instance already placed is
  `Node.used` (it never moves), and a model's new prefill and decode instances form one group anchored to
  the P/D instances of that model already placed per domain, so the solver minimises the fleet's
  cross-domain P/D pairs (new with new, and new with running), then domains a group spreads over, then
  fragmented nodes. When the inventory cannot hold the whole decision, it is clipped to what fits
  (`ScaleUpPlacement.granted` ≤ `requested`) and `explanation` says what was short (the solver's own
  message for the full request); nothing raises.
- **Which instance does a scale-in remove?** `removal_order(candidates)` sorts the policy's pool's
  candidates (already in the caller's order, e.g. fewest in-flight requests first; the sort is stable) by,
  in this order: most cross-domain P/D pairs removed with it, fragmentation change of its node (a full node
  made partial is worst, a partial node emptied best), GPUs left on its node (emptying nodes first).

The caller records what it did with `assign(instance, pool, node)` and `release(instance)`; `summary()`
gives the fleet's cross-domain P/D pairs and fragmented nodes for reports and metrics. A pair of one
prefill and one decode instance of a model is *cross-domain* when their nodes' domains differ (the router
pairs any prefill with any decode, so this count over P·D pairs is the expected share of KV transfers
that cross domains). Deterministic: the solver runs single-worker, inputs are sorted.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from placement.catalog import Catalog, CatalogError
from placement.offers import canonical_gpu
from placement.profiles import Role
from placement.topology import (
    Group,
    InstanceKind,
    Node,
    TopologyError,
    groups_from_counts,
    nodes_from_dict,
    place_instances,
)


def pool_gpus(pools: Iterable[Any], catalog: Catalog) -> set[str]:
    """The catalog names of the GPUs `pools` (anything with a `.gpu`) run on; an unknown name as given (the
    pools' own validation refuses it)."""
    return {canonical_gpu(str(p.gpu), catalog) for p in pools}


@dataclass(frozen=True, slots=True)
class Inventory:
    """A node inventory as `mosaic plan --nodes` reads it (`placement.topology.nodes_from_dict`)."""

    nodes: tuple[Node, ...]
    max_group_gpus: int | None = None
    same_domain: Literal["prefer", "require"] = "prefer"

    @classmethod
    def from_data(
        cls,
        data: object,
        origin: str = "<nodes>",
        catalog: Catalog | None = None,
        known_gpus: Collection[str] | None = None,
    ) -> Inventory:
        """Given `known_gpus` (the pools' GPUs), a node GPU neither in the catalog nor among them is refused
        as a typo, as `mosaic plan --nodes` refuses it (else its nodes would only read as "no free GPUs")."""
        nodes, cap, same = nodes_from_dict(data, origin, catalog, known_gpus)  # names unique, 0 ≤ used ≤ gpus
        return cls(tuple(nodes), cap, "require" if same == "require" else "prefer")

    def in_catalog_names(self, catalog: Catalog) -> Inventory:
        """Node GPU names in the catalog's spelling (`H100` → `H100-SXM`), as pools use; a GPU the catalog
        does not know keeps its name (no pool runs it, so its nodes stay empty)."""
        canonical = {}
        for node in self.nodes:
            with contextlib.suppress(CatalogError):
                canonical[node.gpu] = catalog.gpu(node.gpu).name
        nodes = tuple(dataclasses.replace(n, gpu=canonical.get(n.gpu, n.gpu)) for n in self.nodes)
        return dataclasses.replace(self, nodes=nodes)


@dataclass(frozen=True, slots=True)
class ScaleUpPlacement:
    """Nodes for the instances a decision adds. `nodes[pool]` has one (node, domain) per granted instance."""

    requested: Mapping[str, int]
    granted: Mapping[str, int]
    nodes: Mapping[str, tuple[tuple[str, str], ...]]
    explanation: str | None = None  # set when something was clipped: what the inventory is short of
    cross_domain_pairs: int = 0  # P/D pairs the new instances form across domains (with new and running)

    @property
    def shortfall(self) -> dict[str, int]:
        return {
            p: n - self.granted.get(p, 0) for p, n in self.requested.items() if n > self.granted.get(p, 0)
        }


@dataclass(frozen=True, slots=True)
class TopologySummary:
    cross_domain_pairs: int  # Σ_model P·D − Σ_d P_d·D_d over the counted instances
    pd_pairs: int  # Σ_model P·D
    fragmented_nodes: tuple[str, ...]  # 0 < used < gpus
    used_gpus: int
    total_gpus: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "cross_domain_pairs": self.cross_domain_pairs,
            "pd_pairs": self.pd_pairs,
            "fragmented_nodes": len(self.fragmented_nodes),
            "used_gpus": self.used_gpus,
            "total_gpus": self.total_gpus,
        }


@dataclass(slots=True)
class _Placed:
    pool: str
    node: str


class TopologyPlacer:
    """See module docstring. `kinds` maps each pool to the instance kind it runs (model, GPU, tp, role)."""

    def __init__(
        self, inventory: Inventory, kinds: Mapping[str, InstanceKind], *, time_limit_s: float = 2.0
    ) -> None:
        self.inventory = inventory
        self.kinds = dict(kinds)
        self.time_limit_s = time_limit_s
        self._nodes = {n.name: n for n in inventory.nodes}
        self._placed: dict[str, _Placed] = {}
        self._used = {n.name: n.used for n in inventory.nodes}

    # ------------------------------------------------------------------ state
    def assign(self, instance: str, pool: str, node: str) -> None:
        if instance in self._placed:
            raise ValueError(f"instance {instance} is already placed")
        gpus = self.kinds[pool].gpus
        if self._used[node] + gpus > self._nodes[node].gpus:
            raise ValueError(f"node {node} has no room for {instance} ({gpus} GPUs)")
        self._placed[instance] = _Placed(pool, node)
        self._used[node] += gpus

    def release(self, instance: str) -> None:
        """Free the instance's GPUs (unknown instances are ignored: they were never placed)."""
        placed = self._placed.pop(instance, None)
        if placed is not None:
            self._used[placed.node] -= self.kinds[placed.pool].gpus

    def node_of(self, instance: str) -> str | None:
        placed = self._placed.get(instance)
        return placed.node if placed is not None else None

    def domain_of(self, instance: str) -> str | None:
        node = self.node_of(instance)
        return self._nodes[node].domain if node is not None else None

    def instances(self, pool: str | None = None) -> list[str]:
        return sorted(i for i, p in self._placed.items() if pool is None or p.pool == pool)

    def free_nodes(self) -> list[Node]:
        """The inventory with every placed instance counted as used (what the solver may still fill)."""
        return [dataclasses.replace(n, used=self._used[n.name]) for n in self.inventory.nodes]

    # ------------------------------------------------------------------ scale-up
    def place(self, adds: Mapping[str, int]) -> ScaleUpPlacement:
        """Nodes for `adds` (pool → new instances); clipped to what fits, never raising (module docstring)."""
        want = {p: n for p, n in sorted(adds.items()) if n > 0}
        unknown = sorted(p for p in want if p not in self.kinds)
        if unknown:
            raise KeyError(f"pools without an instance kind: {unknown}")
        granted = dict(want)
        explanation: str | None = None
        while sum(granted.values()) > 0:
            try:
                placement = place_instances(
                    self.free_nodes(),
                    self._groups(granted),
                    same_domain=self.inventory.same_domain,
                    time_limit_s=self.time_limit_s,
                    deterministic=True,
                )
            except TopologyError as exc:
                explanation = explanation or str(exc)
                granted = self._clip(granted, want)
                continue
            nodes = self._split(placement, granted)
            return ScaleUpPlacement(want, granted, nodes, explanation, placement.cross_domain_pairs)
        return ScaleUpPlacement(want, {p: 0 for p in want}, {p: () for p in want}, explanation)

    def _groups(self, counts: Mapping[str, int]) -> list[Group]:
        by_kind: dict[InstanceKind, int] = {}
        for pool, n in counts.items():
            if n > 0:
                kind = self.kinds[pool]
                by_kind[kind] = by_kind.get(kind, 0) + n
        groups = groups_from_counts(by_kind, self.inventory.max_group_gpus)
        out = []
        for g in groups:
            models = {k.model for k in g.members if k.role is not Role.MIXED}
            anchors = self._anchors(next(iter(models))) if models else {}
            out.append(dataclasses.replace(g, anchors=anchors))
        return out

    def _anchors(self, model: str) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = {}
        for placed in self._placed.values():
            kind = self.kinds[placed.pool]
            if kind.model == model and kind.role in (Role.PREFILL, Role.DECODE):
                cell = out.setdefault(self._nodes[placed.node].domain, [0, 0])
                cell[0 if kind.role is Role.PREFILL else 1] += 1
        return {d: (c[0], c[1]) for d, c in sorted(out.items())}

    def _split(self, placement: Any, granted: Mapping[str, int]) -> dict[str, tuple[tuple[str, str], ...]]:
        """Each pool's (node, domain) per granted instance; pools of one kind share its placed slots in
        name order (the solver sees one kind)."""
        slots: dict[InstanceKind, list[tuple[str, str]]] = {}
        for p in placement.instances:
            slots.setdefault(p.kind, []).append((p.node, p.domain))
        out = {}
        for pool in sorted(granted):
            bucket = slots.get(self.kinds[pool], [])
            out[pool], slots[self.kinds[pool]] = tuple(bucket[: granted[pool]]), bucket[granted[pool] :]
        return out

    def _clip(self, granted: dict[str, int], want: Mapping[str, int]) -> dict[str, int]:
        """One fewer instance: from a pool on a GPU type short of free GPUs if any, else the pool that kept
        the largest share of its request (so P and D are clipped alike), ties by name."""
        free: dict[str, int] = {}
        for node in self.free_nodes():
            free[node.gpu] = free.get(node.gpu, 0) + node.free
        need: dict[str, int] = {}
        for pool, n in granted.items():
            k = self.kinds[pool]
            need[k.gpu] = need.get(k.gpu, 0) + n * k.gpus
        short = {g for g, n in need.items() if n > free.get(g, 0)}
        pools = [p for p, n in granted.items() if n > 0 and (not short or self.kinds[p].gpu in short)]
        victim = max(sorted(pools), key=lambda p: (granted[p] / want[p], granted[p]))
        return {**granted, victim: granted[victim] - 1}

    # ------------------------------------------------------------------ scale-in
    def removal_order(self, candidates: Sequence[str]) -> list[str]:
        """`candidates` (instance ids of one pool, in the caller's preference) best-to-remove first."""
        counts = self._pd_counts(None)

        def key(instance: str) -> tuple[int, int, int]:
            placed = self._placed.get(instance)
            if placed is None:
                return (0, 0, 1 << 30)
            kind, node = self.kinds[placed.pool], self._nodes[placed.node]
            used = self._used[node.name]
            after = used - kind.gpus
            frag_delta = int(0 < after < node.gpus) - int(0 < used < node.gpus)
            cross = 0
            if kind.role in (Role.PREFILL, Role.DECODE):
                per_domain = counts.get(kind.model, {})
                other = 1 if kind.role is Role.PREFILL else 0
                total_other = sum(c[other] for c in per_domain.values())
                cross = total_other - per_domain.get(node.domain, (0, 0))[other]
            return (-cross, frag_delta, after)

        return sorted(candidates, key=key)

    # ------------------------------------------------------------------ reporting
    def _pd_counts(self, counted: Collection[str] | None) -> dict[str, dict[str, tuple[int, int]]]:
        out: dict[str, dict[str, list[int]]] = {}
        for instance, placed in self._placed.items():
            if counted is not None and instance not in counted:
                continue
            kind = self.kinds[placed.pool]
            if kind.role in (Role.PREFILL, Role.DECODE):
                cell = out.setdefault(kind.model, {}).setdefault(self._nodes[placed.node].domain, [0, 0])
                cell[0 if kind.role is Role.PREFILL else 1] += 1
        return {m: {d: (c[0], c[1]) for d, c in ds.items()} for m, ds in out.items()}

    def summary(self, pairing: Collection[str] | None = None) -> TopologySummary:
        """Fleet topology now; `pairing` limits the P/D pair count to those instances (e.g. not draining)."""
        cross = pairs = 0
        for per_domain in self._pd_counts(pairing).values():
            p = sum(c[0] for c in per_domain.values())
            d = sum(c[1] for c in per_domain.values())
            pairs += p * d
            cross += p * d - sum(c[0] * c[1] for c in per_domain.values())
        frag = tuple(n.name for n in self.inventory.nodes if 0 < self._used[n.name] < n.gpus)
        return TopologySummary(
            cross, pairs, frag, sum(self._used.values()), sum(n.gpus for n in self.inventory.nodes)
        )

    def describe(self) -> list[dict[str, Any]]:
        """Per node: domain, GPU type, GPUs used/total and the instances on it (admin and dry-run output)."""
        on: dict[str, list[str]] = {}
        for instance, placed in sorted(self._placed.items()):
            on.setdefault(placed.node, []).append(instance)
        return [
            {
                "node": n.name,
                "domain": n.domain,
                "gpu": n.gpu,
                "gpus": n.gpus,
                "used": self._used[n.name],
                "instances": on.get(n.name, []),
            }
            for n in self.inventory.nodes
        ]
