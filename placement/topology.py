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

    @property
    def label(self) -> str:
        """`model/GPU[/tpN][/dpN][/role]`: what the plan's placement prints, and distinct per kind."""
        return (
            f"{self.model}/{self.gpu}"
            + (f"/tp{self.tp}" if self.tp > 1 else "")
            + (f"/dp{self.dp}" if self.dp > 1 else "")
            + ("" if self.role is Role.MIXED else f"/{self.role.value}")
        )


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
            groups += [Group(f"{kind.label}#{i}", {kind: 1}) for i in range(n)]
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
        free_in: dict[tuple[str, str], int] = {}  # (domain, GPU) → free GPUs
        for x in nodes:
            free_in[(x.domain, x.gpu)] = free_in.get((x.domain, x.gpu), 0) + x.free
        domains = sorted({x.domain for x in nodes})
        for g in groups:
            want = g.gpus_by_type
            if not any(all(free_in.get((d, gpu), 0) >= n for gpu, n in want.items()) for d in domains):
                best = max(domains, key=lambda d: sum(v for (dd, _), v in free_in.items() if dd == d))
                have = ", ".join(f"{free_in.get((best, gpu), 0)}× {gpu}" for gpu in sorted(want))
                wanted = ", ".join(f"{n}× {gpu}" for gpu, n in sorted(want.items()))
                raise TopologyError(
                    f"group {g.name} needs {wanted} in one domain; the roomiest domain {best} has {have} free"
                )


def _lone_instances(groups: Sequence[Group]) -> dict[InstanceKind, list[int]]:
    """Groups of one instance and no anchors (every mixed instance of `groups_from_counts`), by kind. One
    instance sits on one node, so such a group never spreads or splits a pair and always has one domain: the
    model places them as a count per (kind, node), not a variable per (group, node) — 1,000 mixed instances
    on 200 nodes is 200 variables, not 200,000 — and hands them out to their groups afterwards."""
    lone: dict[InstanceKind, list[int]] = {}
    for gi, g in enumerate(groups):
        present = [k for k, n in g.members.items() if n > 0]
        if not g.anchors and sum(g.members.values()) == 1:
            lone.setdefault(present[0], []).append(gi)
    return lone


def _no_node_for(g: Group, kind: InstanceKind) -> TopologyError:
    return TopologyError(
        f"group {g.name}: no {kind.gpu} node has {kind.gpus} free GPUs for an instance of tp {kind.tp}"
        + (f" × dp {kind.dp}" if kind.dp > 1 else "")
    )


def place_instances(
    nodes: Sequence[Node],
    groups: Sequence[Group],
    *,
    same_domain: Literal["prefer", "require"] = "prefer",
    time_limit_s: float = 5.0,
    deterministic: bool = False,
) -> Placement:
    """Place every group's instances on nodes (see the module docstring); raises TopologyError if impossible.
    `time_limit_s` bounds the whole call, building the model included."""
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise TopologyError("node names must be unique")
    if any(x.gpus < 0 or x.used < 0 or x.used > x.gpus for x in nodes):
        raise TopologyError("every node needs 0 ≤ used ≤ gpus")
    require = same_domain == "require"
    started = time.perf_counter()
    _precheck(nodes, groups, require)
    m = cp_model.CpModel()
    domains = sorted({x.domain for x in nodes} | {d for g in groups for d in g.anchors})
    lone = _lone_instances(groups)
    lone_groups = {gi for members in lone.values() for gi in members}
    # y[g,r,n] for the groups whose domains matter; x[r,n] for the lone instances of kind r
    y: dict[tuple[int, InstanceKind, int], cp_model.IntVar] = {}
    x: dict[tuple[InstanceKind, int], cp_model.IntVar] = {}
    on_node: dict[int, list[cp_model.LinearExprT]] = {}
    in_domain_cells: dict[tuple[int, str], list[cp_model.IntVar]] = {}
    role_cells: dict[tuple[int, Role, str], list[cp_model.IntVar]] = {}

    def cells_for(kind: InstanceKind, count: int, name: str) -> list[tuple[int, cp_model.IntVar]]:
        out = []
        for ni, node in enumerate(nodes):
            if node.gpu == kind.gpu and node.free >= kind.gpus:
                var = m.new_int_var(0, min(count, node.free // kind.gpus), f"{name}_{ni}")
                on_node.setdefault(ni, []).append(kind.gpus * var)
                out.append((ni, var))
        return out

    for ri, (kind, members) in enumerate(sorted(lone.items(), key=lambda kv: kv[1][0])):
        cells = cells_for(kind, len(members), f"x{ri}")
        if not cells:
            raise _no_node_for(groups[members[0]], kind)
        x.update({(kind, ni): var for ni, var in cells})
        m.add(sum(var for _, var in cells) == len(members))
    for gi, g in enumerate(groups):
        if gi in lone_groups:
            continue
        for kind, count in g.members.items():
            cells = cells_for(kind, count, f"y{gi}")
            if not cells:
                raise _no_node_for(g, kind)
            for ni, var in cells:
                y[(gi, kind, ni)] = var
                in_domain_cells.setdefault((gi, nodes[ni].domain), []).append(var)
                role_cells.setdefault((gi, kind.role, nodes[ni].domain), []).append(var)
            m.add(sum(var for _, var in cells) == count)
    used_vars, frag_vars = [], []
    # per GPU type: (GPUs in use after placing, Σ size·used, Σ size·full) over its nodes that can take an instance
    by_type: dict[
        str, tuple[list[cp_model.LinearExprT], list[cp_model.LinearExprT], list[cp_model.LinearExprT]]
    ]
    by_type = {}
    for ni, node in enumerate(nodes):
        terms = on_node.get(ni)
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
        totals, opened, filled = by_type.setdefault(node.gpu, ([], [], []))
        totals.append(total)
        opened.append(node.gpus * used)
        filled.append(node.gpus * full)
    # Redundant, and what lets CP-SAT prove a packing optimal on many identical nodes: the nodes in use hold
    # at least the GPUs in use, and the full ones at most. Without them its bound stays at "no node used" and a
    # 1,100-instance fleet of two sizes was still "feasible" after 20 s.
    for totals, opened, filled in by_type.values():
        m.add(sum(opened) >= sum(totals))
        m.add(sum(filled) <= sum(totals))
    cross_terms, spread_terms, shared_terms = [], [], []
    for gi, g in enumerate(groups):
        if gi in lone_groups:
            continue
        in_domain = []
        for d in domains:
            cells = in_domain_cells.get((gi, d), [])
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
                    cells = role_cells.get((gi, role, d), [])
                    if other and cells:
                        cross_terms.append(other * sum(cells))
        if pre and dec:
            cross_terms.append(pre * dec)
            for d in domains:
                pv, qv, prod = (
                    m.new_int_var(0, pre, ""),
                    m.new_int_var(0, dec, ""),
                    m.new_int_var(0, pre * dec, ""),
                )
                m.add(pv == sum(role_cells.get((gi, Role.PREFILL, d), [])))
                m.add(qv == sum(role_cells.get((gi, Role.DECODE, d), [])))
                m.add_multiplication_equality(prod, [pv, qv])
                shared_terms.append(prod)
    cross = sum(cross_terms) - sum(shared_terms)
    m.minimize(
        W_CROSS * cross + W_SPREAD * sum(spread_terms) + W_FRAG * sum(frag_vars) + W_NODE * sum(used_vars)
    )
    left = time_limit_s - (time.perf_counter() - started)
    if left <= 0:
        raise TopologyError(
            f"no placement found within {time_limit_s:g} s (building the model took it all); raise the time limit"
        )
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = left
    solver.parameters.num_workers = 1 if deterministic else 8
    code = solver.solve(m)
    wall = time.perf_counter() - started
    if code == cp_model.INFEASIBLE:
        raise TopologyError(_explain(nodes, groups, require))
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TopologyError(f"no placement found within {time_limit_s:g} s; raise the time limit")
    placed: list[tuple[int, int, PlacedInstance]] = []
    for (gi, kind, ni), v in y.items():
        node = nodes[ni]
        placed += [(gi, ni, PlacedInstance(groups[gi].name, kind, node.name, node.domain))] * int(
            solver.value(v)
        )
    for kind, members in lone.items():
        waiting = iter(members)  # each lone group takes the next instance of its kind, nodes in order
        for ni, node in enumerate(nodes):
            if (kind, ni) in x:
                for _ in range(int(solver.value(x[(kind, ni)]))):
                    gi = next(waiting)
                    placed.append((gi, ni, PlacedInstance(groups[gi].name, kind, node.name, node.domain)))
    placed.sort(key=lambda row: (row[0], row[1]))
    instances = tuple(p for _, _, p in placed)
    touched: dict[str, set[str]] = {g.name: set() for g in groups}
    for p in instances:
        touched[p.group].add(p.domain)
    fragmented = tuple(nodes[i].name for i, f in enumerate(frag_vars) if solver.value(f))
    return Placement(
        "optimal" if code == cp_model.OPTIMAL else "feasible",
        instances,
        int(solver.value(cross)) if cross_terms else 0,
        fragmented,
        {name: tuple(sorted(d)) for name, d in touched.items()},
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

    GPU names go through the catalog's canonical names (aliases and case, as --gpus and profiles do), then
    take the offered type's own spelling when one of `known_gpus` is that type (a Mélange file's "A100");
    `gpus` (≥ 1), `used` (≥ 0 and ≤ gpus) and `max_group_gpus` (≥ 1) must be whole numbers, node names
    unique. Given `known_gpus` (the offered types), a GPU neither in the catalog nor among them is refused
    as a typo; without, it is kept, and no instance lands on its nodes. Errors name the file and the node."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise TopologyError(f"{origin}: expected a mapping with a non-empty 'nodes' list")
    extra = sorted(set(data) - {"schema", "nodes", "max_group_gpus", "same_domain"})
    if extra:
        raise TopologyError(f"{origin}: unknown key(s) {extra}")
    catalog = catalog or load_catalog()
    # the plan's own spelling of each offered type: a Mélange file names its GPUs as it likes ("A100"), and
    # a node's A100 or A100-80GB is that type
    spelled: dict[str, str] = {}
    for offered_name in known_gpus or ():
        spelled.setdefault(canonical_gpu(offered_name, catalog), offered_name)
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
        gpu = spelled.get(gpu, gpu)
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
