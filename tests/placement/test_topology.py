"""Topology-aware placement: domains, node capacity, whole-node tensor parallelism, fragmentation, and the
explanations an inventory that is short gets."""

from __future__ import annotations

from collections import Counter

import pytest

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

PRE = InstanceKind("m", "A100-80GB", 1, Role.PREFILL)
DEC = InstanceKind("m", "L4", 1, Role.DECODE)
MIX = InstanceKind("m", "A100-80GB", 1, Role.MIXED)
TP2 = InstanceKind("m", "A100-80GB", 2, Role.MIXED)


def gpus_used(placement: object, nodes: list[Node]) -> dict[str, int]:
    used = {n.name: n.used for n in nodes}
    for p in placement.instances:  # type: ignore[attr-defined]
        used[p.node] += p.kind.tp
    return used


def test_pd_group_lands_in_the_domain_that_holds_it() -> None:
    nodes = [
        Node("a0", "A100-80GB", 4, "rack-a"),
        Node("l0", "L4", 4, "rack-a"),
        Node("a1", "A100-80GB", 4, "rack-b"),
        Node("l1", "L4", 2, "rack-b"),
    ]
    group = Group("g", {PRE: 2, DEC: 4})  # rack-b has only 2 L4: the group fits only rack-a
    placed = place_instances(nodes, [group])
    assert placed.status == "optimal"
    assert placed.group_domains == {"g": ("rack-a",)}
    assert placed.cross_domain_pairs == 0
    assert Counter(p.node for p in placed.instances) == {"a0": 2, "l0": 4}
    assert placed.fragmented_nodes == ("a0",)  # 2 of its 4 GPUs used; l0 is full


def test_capacity_is_honoured_and_a_split_group_minimises_cross_pairs() -> None:
    # rack-a: 2 A100 + 2 L4, rack-b: 2 L4 only. The 2 prefills must go to rack-a; 4 decodes need both racks.
    # Cross pairs = P·D − Σ_d P_d·D_d = 2·4 − (2·2 + 0·2) = 4 (the 2 decodes in rack-b pair with both prefills).
    nodes = [
        Node("a0", "A100-80GB", 2, "rack-a"),
        Node("l0", "L4", 2, "rack-a"),
        Node("l1", "L4", 2, "rack-b"),
    ]
    placed = place_instances(nodes, [Group("g", {PRE: 2, DEC: 4})])
    assert placed.cross_domain_pairs == 4
    assert placed.group_domains["g"] == ("rack-a", "rack-b")
    assert all(used <= n.gpus for n, used in zip(nodes, gpus_used(placed, nodes).values(), strict=True))
    with pytest.raises(
        TopologyError,
        match="group g needs 2× A100-80GB, 4× L4 in one domain; the roomiest domain rack-a has 2× A100-80GB, 2× L4 free",
    ):
        place_instances(nodes, [Group("g", {PRE: 2, DEC: 4})], same_domain="require")


def test_fewer_fragmented_nodes_fill_partly_used_nodes_first() -> None:
    # n0 already runs 2 of 4 GPUs; two new instances fill it (0 fragmented) rather than open n1 (2 fragmented).
    nodes = [Node("n0", "A100-80GB", 4, "r", used=2), Node("n1", "A100-80GB", 4, "r")]
    placed = place_instances(nodes, groups_from_counts({MIX: 2}))
    assert {p.node for p in placed.instances} == {"n0"}
    assert placed.fragmented_nodes == ()
    # four instances on two empty 4-GPU nodes: one full node, not 2 + 2
    nodes = [Node("n0", "A100-80GB", 4, "r"), Node("n1", "A100-80GB", 4, "r")]
    placed = place_instances(nodes, groups_from_counts({MIX: 4}))
    assert len({p.node for p in placed.instances}) == 1 and placed.fragmented_nodes == ()


@pytest.mark.parametrize(
    ("nodes", "groups", "message"),
    [
        pytest.param(
            [Node("l0", "L4", 8, "a"), Node("l1", "L4", 8, "b", used=0)],
            [Group("g", {DEC: 20})],
            "not enough free GPUs — L4: need 20 GPUs, 16 free",
            id="too few GPUs of a type → the shortfall",
        ),
        pytest.param(
            [Node("a0", "A100-80GB", 4, "a", used=1), Node("a1", "A100-80GB", 4, "a", used=1)],
            [Group("g", {TP2: 3})],
            "3 instances of 2 GPUs on A100-80GB need 2 free GPUs on one node each; nodes hold only 2 (largest free block 3)",
            id="6 GPUs free but in blocks of 3 → only 2 tp-2 instances fit",
        ),
        pytest.param(
            [Node("a0", "A100-80GB", 8, "a")],
            [Group("g", {DEC: 1})],
            "L4: need 1 GPUs, 0 free",
            id="a GPU type the inventory lacks",
        ),
    ],
)
def test_short_inventories_say_what_is_short(nodes: list[Node], groups: list[Group], message: str) -> None:
    with pytest.raises(TopologyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        place_instances(nodes, groups)


def test_groups_that_fit_alone_but_not_together_get_the_domain_summary() -> None:
    # Each group needs 3 A100 + 1 L4 in one domain. Only rack-a has L4s, so both groups need rack-a, which has
    # 4 A100 for their 6. Per type the inventory suffices (8 A100, 2 L4), and each group alone fits rack-a.
    nodes = [
        Node("a0", "A100-80GB", 4, "rack-a"),
        Node("l0", "L4", 2, "rack-a"),
        Node("a1", "A100-80GB", 4, "rack-b"),
    ]
    kinds = {InstanceKind("m", "A100-80GB", 1, Role.PREFILL): 3, InstanceKind("m", "L4", 1, Role.DECODE): 1}
    groups = [Group("g1", kinds), Group("g2", kinds)]
    with pytest.raises(
        TopologyError,
        match=r"do not fit with every group in one domain together \(free per domain — rack-a: 4× A100-80GB, 2× L4; rack-b: 4× A100-80GB\)",
    ):
        place_instances(nodes, groups, same_domain="require")
    # preferring (not requiring) one domain: rack-a's 4 A100 take 3 prefills of one group and 1 of the other,
    # whose 2 remaining prefills go to rack-b and pair across with its decode in rack-a: 2 cross pairs
    placed = place_instances(nodes, groups)
    assert placed.cross_domain_pairs == 2


def test_tensor_parallel_instances_stay_on_one_node() -> None:
    nodes = [Node("a0", "A100-80GB", 3, "r"), Node("a1", "A100-80GB", 3, "r")]
    placed = place_instances(nodes, groups_from_counts({TP2: 2}))
    assert sorted(p.node for p in placed.instances) == ["a0", "a1"]  # one per node: 2 + 2 > 3


def test_data_parallel_instances_take_tp_times_dp_gpus_of_one_node() -> None:
    dp2 = InstanceKind("m", "A100-80GB", 2, Role.MIXED, dp=2)  # two engines of tp 2: 4 GPUs
    assert dp2.gpus == 4
    nodes = [Node("a0", "A100-80GB", 4, "r"), Node("a1", "A100-80GB", 6, "r", used=3)]
    placed = place_instances(nodes, groups_from_counts({dp2: 1}))
    assert [p.node for p in placed.instances] == ["a0"]  # a1 has 3 free: not room for 4
    with pytest.raises(TopologyError, match=r"A100-80GB: need 8 GPUs, 7 free"):  # counted as 4 each
        place_instances(nodes, groups_from_counts({dp2: 2}))
    roomy = [
        Node("a0", "A100-80GB", 6, "r"),
        Node("a1", "A100-80GB", 6, "r", used=3),
    ]  # 9 free, one block of 4+
    with pytest.raises(
        TopologyError, match=r"2 instances of 4 GPUs on A100-80GB need 4 free GPUs on one node"
    ):
        place_instances(roomy, groups_from_counts({dp2: 2}))


def test_a_large_mixed_fleet_is_placed_whole_nodes_first_within_the_limit() -> None:
    """Before: every mixed instance had a variable per node and domain, and building the model scanned all of
    them per group: 271 instances on 200 nodes found no placement within 5 s, and 5,400 on 2,000 nodes ran
    out of memory. Lone instances are now a count per (kind, node)."""
    nodes = [Node(f"n{i:03d}", "A100-80GB", 8, f"rack-{i % 10}") for i in range(200)]
    l4 = [Node(f"l{i:03d}", "L4", 4, f"rack-{i % 10}", used=i % 4) for i in range(50)]
    counts = {MIX: 1_000, TP2: 100, InstanceKind("m", "L4", 1, Role.MIXED): 75}
    groups = groups_from_counts(counts)
    assert len(groups) == 1_175
    placed = place_instances(nodes + l4, groups, same_domain="require", deterministic=True)
    assert placed.status == "optimal"
    # each instance once, under its own group's name, on a node of its GPU with room for it
    assert Counter(p.group for p in placed.instances) == {g.name: 1 for g in groups}
    assert all(p.kind == next(iter(g.members)) for p, g in zip(placed.instances, groups, strict=True))
    used = gpus_used(placed, nodes + l4)
    assert all(used[n.name] <= n.gpus for n in nodes + l4)
    # 1,200 A100 GPUs fill 150 whole nodes; the 75 L4s exactly fill the 37 partly used L4 nodes (39 + 24 + 12
    # free GPUs), none opened: nothing fragmented, and the solver proves it
    assert sum(1 for n in nodes if used[n.name] == 8) == 150
    assert sum(1 for n in nodes if used[n.name] == 0) == 50
    assert placed.fragmented_nodes == ()
    assert all(used[n.name] == (4 if n.used else 0) for n in l4)
    assert {g: len(d) for g, d in placed.group_domains.items()} == {g.name: 1 for g in groups}
    assert placed.cross_domain_pairs == 0


def test_the_time_limit_covers_building_the_model() -> None:
    nodes = [Node(f"n{i}", "A100-80GB", 8, "r") for i in range(4)] + [Node("l", "L4", 4, "r")]
    with pytest.raises(
        TopologyError, match=r"no placement found within 1e-06 s \(building the model took it all\)"
    ):
        place_instances(nodes, groups_from_counts({PRE: 3, DEC: 3}), time_limit_s=1e-6)


def test_groups_from_counts_deals_pd_instances_evenly() -> None:
    groups = groups_from_counts({PRE: 3, DEC: 7, MIX: 2}, max_group_gpus=5)
    pd = [g for g in groups if "/pd" in g.name]
    # 10 P/D GPUs / 5 per group → 2 groups: prefill 2 + 1, decode 4 + 3
    assert [dict(g.members) for g in pd] == [{DEC: 4, PRE: 2}, {DEC: 3, PRE: 1}]
    assert sum(1 for g in groups if "/pd" not in g.name) == 2  # each mixed instance alone
    # named by their kind: before, tp 1 and tp 2 instances of one GPU had the same names (m/A100-80GB#0)
    assert [g.name for g in groups_from_counts({MIX: 1, TP2: 2})] == [
        "m/A100-80GB#0",
        "m/A100-80GB/tp2#0",
        "m/A100-80GB/tp2#1",
    ]
    assert len(groups_from_counts({PRE: 1, DEC: 9}, max_group_gpus=2)) == 1  # never a group without a prefill


def test_nodes_file_errors() -> None:
    nodes, cap, same = nodes_from_dict(
        {
            "nodes": [{"name": "n", "gpu": "L4", "gpus": 8, "domain": "a"}],
            "max_group_gpus": 16,
            "same_domain": "require",
        }
    )
    assert nodes == [Node("n", "L4", 8, "a")] and cap == 16 and same == "require"
    with pytest.raises(TopologyError, match=r"nodes\[0\]: needs name, gpu, gpus"):
        nodes_from_dict({"nodes": [{"name": "n"}]}, "n.yaml")
    with pytest.raises(TopologyError, match="same_domain"):
        nodes_from_dict({"nodes": [{"name": "n", "gpu": "L4", "gpus": 1}], "same_domain": "always"})
    with pytest.raises(TopologyError, match="unique"):
        place_instances([Node("n", "L4", 1, "a"), Node("n", "L4", 1, "a")], [])


def test_node_gpu_names_are_made_canonical_like_gpus_and_profiles() -> None:
    nodes, _, _ = nodes_from_dict(
        {"nodes": [{"name": "a", "gpu": "a10g", "gpus": 4}, {"name": "b", "gpu": "h100", "gpus": 8}]}
    )
    assert [n.gpu for n in nodes] == ["A10G", "H100-SXM"]
    unknown, _, _ = nodes_from_dict({"nodes": [{"name": "c", "gpu": "MyGPU", "gpus": 2}]})
    assert unknown[0].gpu == "MyGPU"  # not in the catalog: kept as written
