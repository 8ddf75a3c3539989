"""Topology-aware instance placement (CP-SAT): put planned instances on nodes, P/D groups in one domain.

Inputs: nodes (name, GPU type, GPU count, network domain such as a switch or RDMA group, GPUs already in
use) and groups of instances (a P/D group = its prefill and decode instances, which exchange KV caches and
should share a domain; a mixed instance is a group of its own). An instance of tensor-parallel degree tp
and data-parallel size dp (engines behind one vLLM server) takes tp · dp GPUs of one node of its GPU type.

Model. y[g,r,n] = instances of kind r (model, GPU, tp, dp, role) of group g on node n.

    Σ_n y[g,r,n] = count[g,r]                                 every instance placed
    used_n + Σ_{g,r} tp_r · dp_r · y[g,r,n] ≤ gpus_n          node capacity
    cross_g = P_g · D_g − Σ_d P_gd · D_gd                     prefill/decode pairs split across domains
    frag_n ≥ [node n partly used] ; spread_g = domains g touches − 1
    minimise 10⁴ · Σ cross + 10³ · Σ spread + 10 · Σ frag + Σ [node n used]

With `same_domain="require"` every group must sit in exactly one domain (hard); "prefer" only penalises.

Online use (the autoscaler adding instances to a running fleet): instances already running are `Node.used`
(they stay where they are), and a group's `anchors` are the prefill/decode instances already placed per
domain that its new members will pair with; the cross term then counts new-with-anchor pairs too:
cross_g = (P_g + A^P)(D_g + A^D) − Σ_d (P_gd + A^P_d)(D_gd + A^D_d), less the anchors' own cross pairs
(a constant). `deterministic=True` solves with one CP-SAT worker, so a seeded simulation replays exactly.
An inventory that cannot hold the instances raises `TopologyError` saying what is short (GPUs of a type,
per-node room for an instance's GPUs, a domain's room for a group). `place_instances` is pure and safe to call online.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ortools.sat.python import cp_model

from placement.binpacking import PlacementError
from placement.catalog import Catalog, load_catalog
from placement.counts import MAX_PLAN_INSTANCES, whole_number
from placement.offers import canonical_gpu
from placement.profiles import Role

W_CROSS, W_SPREAD, W_FRAG, W_NODE = 10_000, 1_000, 10, 1


class TopologyError(PlacementError):
    """The inventory cannot hold the instances; the message says what is short."""


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    gpu: str
    gpus: int
    domain: str
    used: int = 0  # GPUs already taken (running instances)

    @property
    def free(self) -> int:
        return max(0, self.gpus - self.used)


@dataclass(frozen=True, slots=True)
class InstanceKind:
    model: str
    gpu: str
    tp: int = 1
    role: Role = Role.MIXED
    dp: int = 1  # engines per instance (a data-parallel vLLM server), each on `tp` GPUs of the same node

    @property
    def gpus(self) -> int:
        """GPUs one instance takes, all on one node: tp × dp."""
        return self.tp * self.dp


@dataclass(frozen=True, slots=True)
class Group:
    """Instances that should share a domain: kind → how many."""

    name: str
    members: Mapping[InstanceKind, int]
    # domain → (prefill, decode) instances already placed that this group's new members pair with
    anchors: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def gpus_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k, n in self.members.items():
            out[k.gpu] = out.get(k.gpu, 0) + n * k.gpus
        return out


@dataclass(frozen=True, slots=True)
class PlacedInstance:
    group: str
    kind: InstanceKind
    node: str
    domain: str


@dataclass(frozen=True, slots=True)
class Placement:
    status: str  # optimal | feasible
    instances: tuple[PlacedInstance, ...]
    cross_domain_pairs: int
    fragmented_nodes: tuple[str, ...]
    group_domains: Mapping[str, tuple[str, ...]]
    wall_s: float
    notes: tuple[str, ...] = field(default=())


def groups_from_counts(counts: Mapping[InstanceKind, int], max_group_gpus: int | None = None) -> list[Group]:
    """P/D instances of each model dealt into groups (at most `max_group_gpus` GPUs each when given, one per
    model otherwise), prefill and decode spread evenly; every mixed instance is its own group."""
    groups: list[Group] = []
    models = sorted({k.model for k, n in counts.items() if n > 0 and k.role is not Role.MIXED})
    for model in models:
        kinds = {k: n for k, n in counts.items() if k.model == model and k.role is not Role.MIXED and n > 0}
        gpus = sum(k.gpus * n for k, n in kinds.items())
        n_groups = 1 if not max_group_gpus else max(1, math.ceil(gpus / max_group_gpus))
        n_groups = min(
            n_groups,
            min(sum(n for k, n in kinds.items() if k.role is r) for r in (Role.PREFILL, Role.DECODE)) or 1,
        )
        members: list[dict[InstanceKind, int]] = [{} for _ in range(n_groups)]
        for kind, n in sorted(kinds.items(), key=lambda kv: (kv[0].role.value, kv[0].gpu, kv[0].gpus)):
            for g in range(n_groups):
                share = n // n_groups + (1 if g < n % n_groups else 0)
                if share:
                    members[g][kind] = share
        groups += [Group(f"{model}/pd{g}", m) for g, m in enumerate(members)]
    for kind, n in sorted(counts.items(), key=lambda kv: (kv[0].model, kv[0].gpu, kv[0].gpus)):
        if kind.role is Role.MIXED:
            groups += [Group(f"{kind.model}/{kind.gpu}#{i}", {kind: 1}) for i in range(n)]
    return groups


def _precheck(nodes: Sequence[Node], groups: Sequence[Group], require: bool) -> None:
    need: dict[str, int] = {}
    for g in groups:
        for gpu, n in g.gpus_by_type.items():
            need[gpu] = need.get(gpu, 0) + n
    short = []
    for gpu, n in sorted(need.items()):
        free = sum(x.free for x in nodes if x.gpu == gpu)
        if free < n:
            short.append(f"{gpu}: need {n} GPUs, {free} free")
    if short:
        raise TopologyError("not enough free GPUs — " + "; ".join(short))
    slots: dict[tuple[str, int], int] = {}
    for g in groups:
        for k, n in g.members.items():
            slots[(k.gpu, k.gpus)] = slots.get((k.gpu, k.gpus), 0) + n
    for (gpu, size), n in sorted(slots.items()):
        room = sum(x.free // size for x in nodes if x.gpu == gpu)
        if room < n:
            largest = max((x.free for x in nodes if x.gpu == gpu), default=0)
            raise TopologyError(
                f"{n} instances of {size} GPUs on {gpu} need {size} free GPUs on one node each; nodes hold only {room} (largest free block {largest})"
            )
    if require:
        domains = sorted({x.domain for x in nodes})
        for g in groups:
            fits = [
                d
                for d in domains
                if all(
                    sum(x.free for x in nodes if x.domain == d and x.gpu == gpu) >= n
                    for gpu, n in g.gpus_by_type.items()
                )
            ]
            if not fits:
                want = ", ".join(f"{n}× {gpu}" for gpu, n in sorted(g.gpus_by_type.items()))
                best = max(domains, key=lambda d: sum(x.free for x in nodes if x.domain == d))
                have = ", ".join(
                    f"{sum(x.free for x in nodes if x.domain == best and x.gpu == gpu)}× {gpu}"
                    for gpu in sorted(g.gpus_by_type)
                )
                raise TopologyError(
                    f"group {g.name} needs {want} in one domain; the roomiest domain {best} has {have} free"
                )


def place_instances(
    nodes: Sequence[Node],
    groups: Sequence[Group],
    *,
    same_domain: Literal["prefer", "require"] = "prefer",
    time_limit_s: float = 5.0,
    deterministic: bool = False,
) -> Placement:
    """Place every group's instances on nodes (see the module docstring); raises TopologyError if impossible."""
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise TopologyError("node names must be unique")
    if any(x.gpus < 0 or x.used < 0 or x.used > x.gpus for x in nodes):
        raise TopologyError("every node needs 0 ≤ used ≤ gpus")
    require = same_domain == "require"
    _precheck(nodes, groups, require)
    started = time.perf_counter()
    m = cp_model.CpModel()
    domains = sorted({x.domain for x in nodes} | {d for g in groups for d in g.anchors})
    y: dict[tuple[int, InstanceKind, int], cp_model.IntVar] = {}
    for gi, g in enumerate(groups):
        for kind, count in g.members.items():
            cells = []
            for ni, node in enumerate(nodes):
                if node.gpu == kind.gpu and node.free >= kind.gpus:
                    y[(gi, kind, ni)] = var = m.new_int_var(
                        0, min(count, node.free // kind.gpus), f"y{gi}_{ni}"
                    )
                    cells.append(var)
            if not cells:
                raise TopologyError(
                    f"group {g.name}: no {kind.gpu} node has {kind.gpus} free GPUs for an instance of tp {kind.tp}"
                    + (f" × dp {kind.dp}" if kind.dp > 1 else "")
                )
            m.add(sum(cells) == count)
    used_vars, frag_vars = [], []
    for ni, node in enumerate(nodes):
        terms = [kind.gpus * v for (_, kind, nn), v in y.items() if nn == ni]
        used, full, frag = m.new_bool_var(f"u{ni}"), m.new_bool_var(f"f{ni}"), m.new_bool_var(f"x{ni}")
        used_vars.append(used)
        frag_vars.append(frag)
        if not terms:  # nothing can land here: its state is what it is
            m.add(used == int(node.used > 0))
            m.add(frag == int(0 < node.used < node.gpus))
            continue
        load = sum(terms)
        m.add(load <= node.free)
        total = node.used + load
        m.add(total == 0).only_enforce_if(~used)
        m.add(total >= 1).only_enforce_if(used)
        m.add(total == node.gpus).only_enforce_if(full)
        m.add(frag >= used - full)
    cross_terms, spread_terms, shared_terms = [], [], []
    for gi, g in enumerate(groups):
        in_domain = []
        for d in domains:
            cells = [v for (gg, _, ni), v in y.items() if gg == gi and nodes[ni].domain == d]
            z = m.new_bool_var(f"z{gi}_{d}")
            if cells:
                m.add(sum(cells) == 0).only_enforce_if(~z)
            else:
                m.add(z == 0)
            in_domain.append(z)
        m.add(sum(in_domain) == 1) if require else m.add(sum(in_domain) >= 1)
        spread_terms.append(sum(in_domain) - 1)
        pre = sum(n for k, n in g.members.items() if k.role is Role.PREFILL)
        dec = sum(n for k, n in g.members.items() if k.role is Role.DECODE)
        a_pre = sum(a[0] for a in g.anchors.values())
        a_dec = sum(a[1] for a in g.anchors.values())
        # new-with-anchor pairs: a new prefill in domain d pairs across with A^D − A^D_d decodes (and vice versa)
        if (pre and a_dec) or (dec and a_pre):
            for d in domains:
                ap, ad = g.anchors.get(d, (0, 0))
                for role, other in ((Role.PREFILL, a_dec - ad), (Role.DECODE, a_pre - ap)):
                    cells = [
                        v
                        for (gg, k, ni), v in y.items()
                        if gg == gi and k.role is role and nodes[ni].domain == d
                    ]
                    if other and cells:
                        cross_terms.append(other * sum(cells))
        if pre and dec:
            cross_terms.append(pre * dec)
            for d in domains:
                p = sum(
                    v
                    for (gg, k, ni), v in y.items()
                    if gg == gi and k.role is Role.PREFILL and nodes[ni].domain == d
                )
                q = sum(
                    v
                    for (gg, k, ni), v in y.items()
                    if gg == gi and k.role is Role.DECODE and nodes[ni].domain == d
                )
                pv, qv, prod = (
                    m.new_int_var(0, pre, ""),
                    m.new_int_var(0, dec, ""),
                    m.new_int_var(0, pre * dec, ""),
                )
                m.add(pv == p)
                m.add(qv == q)
                m.add_multiplication_equality(prod, [pv, qv])
                shared_terms.append(prod)
    cross = sum(cross_terms) - sum(shared_terms)
    m.minimize(
        W_CROSS * cross + W_SPREAD * sum(spread_terms) + W_FRAG * sum(frag_vars) + W_NODE * sum(used_vars)
    )
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1 if deterministic else 8
    code = solver.solve(m)
    wall = time.perf_counter() - started
    if code == cp_model.INFEASIBLE:
        raise TopologyError(_explain(nodes, groups, require))
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TopologyError(f"no placement found within {time_limit_s:g} s; raise the time limit")
    placed = []
    for (gi, kind, ni), v in sorted(y.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        placed += [PlacedInstance(groups[gi].name, kind, nodes[ni].name, nodes[ni].domain)] * int(
            solver.value(v)
        )
    group_domains = {g.name: tuple(sorted({p.domain for p in placed if p.group == g.name})) for g in groups}
    fragmented = tuple(nodes[i].name for i, f in enumerate(frag_vars) if solver.value(f))
    return Placement(
        "optimal" if code == cp_model.OPTIMAL else "feasible",
        tuple(placed),
        int(solver.value(cross)) if cross_terms else 0,
        fragmented,
        group_domains,
        wall,
    )


def _explain(nodes: Sequence[Node], groups: Sequence[Group], require: bool) -> str:
    """Capacity per domain and type against the groups' needs, for the infeasible case the prechecks miss."""
    per_domain: dict[str, dict[str, int]] = {}
    for x in nodes:
        per_domain.setdefault(x.domain, {}).setdefault(x.gpu, 0)
        per_domain[x.domain][x.gpu] += x.free
    have = "; ".join(
        f"{d}: " + ", ".join(f"{n}× {g}" for g, n in sorted(c.items())) for d, c in sorted(per_domain.items())
    )
    mode = "with every group in one domain" if require else "on whole nodes"
    return (
        f"the groups do not fit {mode} together (free per domain — {have}); add nodes or relax --same-domain"
    )


def nodes_from_dict(
    data: object,
    origin: str = "<nodes>",
    catalog: Catalog | None = None,
    known_gpus: Collection[str] | None = None,
) -> tuple[list[Node], int | None, str]:
    """`{nodes: [{name, gpu, gpus, domain, used?}], max_group_gpus?: N, same_domain?: prefer|require}`.

    GPU names go through the catalog's canonical names (aliases and case, as --gpus and profiles do);
    `gpus` (≥ 1), `used` (≥ 0 and ≤ gpus) and `max_group_gpus` (≥ 1) must be whole numbers, node names
    unique. Given `known_gpus` (the offered types), a GPU neither in the catalog nor among them is refused
    as a typo; without, it is kept, and no instance lands on its nodes. Errors name the file and the node."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise TopologyError(f"{origin}: expected a mapping with a non-empty 'nodes' list")
    extra = sorted(set(data) - {"schema", "nodes", "max_group_gpus", "same_domain"})
    if extra:
        raise TopologyError(f"{origin}: unknown key(s) {extra}")
    catalog = catalog or load_catalog()
    nodes: list[Node] = []
    names: set[str] = set()
    for i, row in enumerate(data["nodes"]):
        if (
            not isinstance(row, dict)
            or not {"name", "gpu", "gpus"} <= set(row)
            or set(row) - {"name", "gpu", "gpus", "domain", "used"}
        ):
            raise TopologyError(f"{origin}: nodes[{i}]: needs name, gpu, gpus (and optional domain, used)")
        where = f"{origin}: nodes[{i}]"
        name = str(row["name"])
        if name in names:
            raise TopologyError(f"{where} ({name}): node names must be unique; {name} is given twice")
        names.add(name)
        gpu = canonical_gpu(str(row["gpu"]), catalog)
        if known_gpus is not None and gpu not in known_gpus and gpu not in catalog.gpus:
            offered = ", ".join(sorted(known_gpus)) or "none"
            raise TopologyError(
                f"{where} ({name}): GPU {row['gpu']!r} is neither in the catalog nor offered ({offered})"
            )
        gpus = whole_number(row["gpus"], f"{where}.gpus", 1, TopologyError, MAX_PLAN_INSTANCES)
        used = whole_number(row.get("used", 0), f"{where}.used", 0, TopologyError, MAX_PLAN_INSTANCES)
        if used > gpus:
            raise TopologyError(f"{where} ({name}): used ({used}) must be ≤ gpus ({gpus})")
        nodes.append(Node(name, gpu, gpus, str(row.get("domain", "default")), used))
    same = data.get("same_domain", "prefer")
    if same not in ("prefer", "require"):
        raise TopologyError(f"{origin}: same_domain must be prefer or require, got {same!r}")
    cap = data.get("max_group_gpus")
    if cap is not None:
        cap = whole_number(cap, f"{origin}: max_group_gpus", 1, TopologyError, MAX_PLAN_INSTANCES)
    return nodes, cap, str(same)
