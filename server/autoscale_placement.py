"""Topology-aware placement in the live autoscaler: `autoscaler.nodes` → a `TopologyPlacer` the controller
consults at every decision (docs/autoscaling-live.md, "Topology-aware placement").

`autoscaler.nodes` is a node inventory in the `mosaic plan --nodes` format: a path (relative to the config
file's folder) or the mapping inline. Each decision's scale-ups are placed together by the planner's
topology solver around the instances already placed (`scheduler.topology`); a decision the inventory
cannot hold is clipped to what fits, and the shortfall is logged, counted
(`mosaic_autoscaler_placement_shortfall_total{pool}`) and recorded in the decision (`placement.shortfall`).

Who records which instance sits where:
- an actuator that `places(pool)` (the embedded one, for its simulated pools) receives the nodes of the
  decision's new instances (`assign_nodes`) and records its workers itself (it knows which worker it
  starts and which it stops);
- the kubernetes actuator places the pools that have one Deployment per network domain
  (`autoscaler.kubernetes.domains`): it adds each new replica to the Deployment of the domain the solver
  chose and picks the domain a scale-in removes from (`scheduler.actuators.kubernetes`). Those domains
  must exist in the inventory, and every domain where the inventory has the pool's GPU type needs a
  Deployment (the solver may place the pool there): `check_domains`, one-line ConfigError;
- for every other pool (dry-run, kubernetes pools with one Deployment, launched vLLM, unmanaged pools) the
  book keeps *computed* slots `pool#n`: the placement the solver would give, shown on `/admin/autoscaler`
  and in the decisions (`mosaic autoscale --json`), never pinned on the backend (a Deployment's scale
  subresource cannot choose nodes; see the docs for the Kubernetes mapping). Scale-in releases the slots
  `TopologyPlacer.removal_order` ranks first. Computed slots change only once the action applied: `plan`
  keeps the solver's nodes pending and `commit` assigns them (or releases slots) by the action's
  after − before, so a refused or failed action leaves the book as it was; and at every cycle
  `reconcile` brings each such pool's slots to its real count (the actuator's desired count, else the
  registry's), so a Deployment scaled by hand or an action that changed less than asked is caught up.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from placement.catalog import Catalog
from placement.profiles import Role, read_structured
from placement.topology import InstanceKind, TopologyError
from scheduler.autoscaler.signals import PoolSpec
from scheduler.topology import Inventory, TopologyPlacer, pool_gpus
from server.config import ConfigError, MosaicConfig

log = logging.getLogger("mosaic.autoscaler")


def config_inventory(config: MosaicConfig, catalog: Catalog) -> Inventory | None:
    """`autoscaler.nodes` read and validated (ConfigError with one line); node GPUs in catalog spelling."""
    spec = config.autoscaler.nodes
    if spec is None:
        return None
    data: object = spec
    origin = "autoscaler.nodes"
    if isinstance(spec, str):
        path = config.resolve_path(spec)
        data, origin = read_structured(path, ConfigError), f"autoscaler.nodes: {path}"
    try:
        inventory = Inventory.from_data(data, origin, catalog, pool_gpus(config.pools, catalog))
    except TopologyError as exc:
        raise ConfigError(str(exc)) from None
    return inventory.in_catalog_names(catalog)


def check_domains(
    domains: Mapping[str, Mapping[str, str]], inventory: Inventory, gpus: Mapping[str, str]
) -> None:
    """`autoscaler.kubernetes.domains` against the inventory (module docstring); `gpus`: pool → catalog GPU."""
    known = sorted({n.domain for n in inventory.nodes})
    for pool, by_domain in sorted(domains.items()):
        loc = f"autoscaler.kubernetes.domains.{pool}"
        unknown = sorted(set(by_domain) - set(known))
        if unknown:
            raise ConfigError(
                f"{loc}: domain {unknown[0]!r} is not in autoscaler.nodes (domains: {', '.join(known)})"
            )
        gpu = gpus.get(pool)
        unmapped = sorted({n.domain for n in inventory.nodes if n.gpu == gpu} - set(by_domain))
        if unmapped:
            raise ConfigError(
                f"{loc}: autoscaler.nodes has {gpu} nodes in {', '.join(unmapped)}, where pool {pool} has no "
                "Deployment; map every domain the topology solver may place it in"
            )


class PlacementMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.shortfall = Counter(
            "mosaic_autoscaler_placement_shortfall",
            "Instances a decision wanted that the node inventory could not hold (the decision was clipped)",
            ["pool"],
            registry=registry,
        )
        self.cross = Gauge(
            "mosaic_autoscaler_cross_domain_pairs",
            "Prefill/decode instance pairs of one model placed in different network domains",
            registry=registry,
        )
        self.fragmented = Gauge(
            "mosaic_autoscaler_fragmented_nodes", "Nodes partly used by placed instances", registry=registry
        )


class PlacementBook:
    """The controller's topology state (module docstring)."""

    def __init__(self, placer: TopologyPlacer, metrics: PlacementMetrics, keep: int = 100) -> None:
        self.placer = placer
        self.metrics = metrics
        self.shortfalls: deque[dict[str, Any]] = deque(maxlen=keep)
        self._seq = 0
        self._pending: dict[str, list[tuple[str, str]]] = {}  # computed nodes of the last plan's scale-ups

    @classmethod
    def from_config(
        cls, config: MosaicConfig, specs: Sequence[PoolSpec], catalog: Catalog, registry: CollectorRegistry
    ) -> PlacementBook | None:
        inventory = config_inventory(config, catalog)
        if inventory is None:
            return None
        check_domains(config.autoscaler.kubernetes.domains, inventory, {s.name: s.gpu for s in specs})
        pools = {p.name: p for p in config.pools}
        kinds = {
            s.name: InstanceKind(s.model, s.gpu, pools[s.name].tp, Role(s.role), pools[s.name].dp)
            for s in specs
        }
        metrics = PlacementMetrics(registry)
        for s in specs:  # each series from the start: increase() misses a counter's first step
            metrics.shortfall.labels(s.name)
        return cls(TopologyPlacer(inventory, kinds), metrics, config.autoscaler.history)

    def seed(self, counts: Mapping[str, int], places: Any) -> None:
        """Computed slots for the instances running at startup in pools the actuator does not place."""
        want = {p: n for p, n in counts.items() if not places(p)}
        placed = self.placer.place(want)
        self._assign(placed.nodes)
        for pool, short in sorted(placed.shortfall.items()):
            self._short(0.0, pool, want[pool], want[pool] - short, placed.explanation, startup=True)
        self._gauges()

    def plan(
        self, targets: Mapping[str, int], provisioned: Mapping[str, int], actuator: Any, now: float
    ) -> tuple[dict[str, int], dict[str, Any]]:
        """Targets clipped to the inventory, nodes handed to a placing actuator or kept pending as computed
        slots (assigned by `commit` once the action applied). Returns (targets, the decision's `placement`
        record)."""
        places = getattr(actuator, "places", None) or (lambda pool: False)
        out = dict(targets)
        adds = {p: t - provisioned[p] for p, t in targets.items() if p in provisioned and t > provisioned[p]}
        record: dict[str, Any] = {}
        if adds:
            placed = self.placer.place(adds)
            for pool in sorted(placed.shortfall):
                out[pool] = provisioned[pool] + placed.granted[pool]
                self._short(now, pool, adds[pool], placed.granted[pool], placed.explanation)
            for pool, nodes in placed.nodes.items():
                if places(pool):
                    actuator.assign_nodes(pool, nodes)
            self._pending = {p: list(n) for p, n in placed.nodes.items() if not places(p)}
            record["new"] = {p: [list(x) for x in n] for p, n in sorted(placed.nodes.items()) if n}
            record["new_cross_domain_pairs"] = placed.cross_domain_pairs  # with each other and the running
            if placed.shortfall:
                record["shortfall"] = {**placed.shortfall, "why": placed.explanation}
        self._gauges()
        # the fleet as placed so far (a placing actuator records its new workers when it starts them);
        # `commit` refreshes it once the actions ran
        record["fleet"] = self.placer.summary().as_dict()
        return out, record

    def commit(self, actions: Sequence[Any], places: Any, record: dict[str, Any] | None = None) -> None:
        """Computed slots follow what the actions did (module docstring): an action that changed the count
        (no error, after ≠ before) assigns the pending nodes of a scale-up (the rest placed alone) or
        releases the slots `removal_order` ranks first; any other leaves the book as it was."""
        pending, self._pending = self._pending, {}
        for a in actions:
            if places(a.pool) or a.error is not None or a.after == a.before or a.before < 0:
                continue
            if a.after > a.before:
                nodes = pending.get(a.pool, [])[: a.after - a.before]
                self._assign({a.pool: nodes})
                self._fill(a.pool, a.after - a.before - len(nodes))
            else:
                self._drop(a.pool, a.before - a.after)
        self._gauges()
        if record is not None:
            record["fleet"] = self.placer.summary().as_dict()

    def reconcile(self, counts: Mapping[str, int], places: Any) -> None:
        """Each pool's computed slots brought to its real count (`counts`), pools the actuator places left
        alone: extra slots released, missing ones placed where they fit (a shortfall was reported when
        the decision or the startup asked for them)."""
        for pool, n in sorted(counts.items()):
            if places(pool):
                continue
            have = len(self.placer.instances(pool))
            if have > n:
                self._drop(pool, have - n)
            elif have < n:
                self._fill(pool, n - have)
        self._gauges()

    def _fill(self, pool: str, n: int) -> None:
        if n > 0:
            self._assign(self.placer.place({pool: n}).nodes)

    def _drop(self, pool: str, n: int) -> None:
        for slot in self.placer.removal_order(self.placer.instances(pool))[:n]:
            self.placer.release(slot)

    def _assign(self, nodes: Mapping[str, Sequence[tuple[str, str]]]) -> None:
        for pool, slots in sorted(nodes.items()):
            for node, _ in slots:
                self._seq += 1
                self.placer.assign(f"{pool}#{self._seq}", pool, node)

    def _short(
        self, now: float, pool: str, wanted: int, placed: int, why: str | None, startup: bool = False
    ) -> None:
        self.metrics.shortfall.labels(pool).inc(wanted - placed)
        self.shortfalls.append({"at": now, "pool": pool, "requested": wanted, "placed": placed, "why": why})
        log.warning(
            "autoscaler: pool %s: the node inventory holds %d of the %d instances %s: %s",
            pool,
            placed,
            wanted,
            "running at startup" if startup else "the decision adds",
            why,
        )

    def _gauges(self) -> None:
        summary = self.placer.summary()
        self.metrics.cross.set(summary.cross_domain_pairs)
        self.metrics.fragmented.set(len(summary.fragmented_nodes))

    def describe(self) -> dict[str, Any]:
        """For `/admin/autoscaler`: the inventory's nodes with what sits on them, the summary, shortfalls."""
        inv = self.placer.inventory
        return {
            "same_domain": inv.same_domain,
            "max_group_gpus": inv.max_group_gpus,
            **self.placer.summary().as_dict(),
            "nodes": self.placer.describe(),
            "shortfalls": list(self.shortfalls),
        }
