"""`scheduler.topology.TopologyPlacer`: scale-ups placed in one domain around running instances, running
instances never moved, capacity respected, decisions clipped with an explanation, scale-in victims chosen
by topology, deterministic."""

from __future__ import annotations

import random

import pytest

from placement.profiles import Role
from placement.topology import InstanceKind, TopologyError
from scheduler.topology import Inventory, TopologyPlacer

PRE = InstanceKind("llama-3-8b", "H100-SXM", 1, Role.PREFILL)
DEC = InstanceKind("llama-3-8b", "A100-80GB", 1, Role.DECODE)
KINDS = {"prefill": PRE, "decode": DEC}


def inventory(**extra: object) -> Inventory:
    return Inventory.from_data(
        {
            "nodes": [
                {"name": "h-a", "gpu": "H100-SXM", "gpus": 2, "domain": "rack-a"},
                {"name": "a-a", "gpu": "A100-80GB", "gpus": 2, "domain": "rack-a"},
                {"name": "h-b", "gpu": "H100-SXM", "gpus": 4, "domain": "rack-b"},
                {"name": "a-b", "gpu": "A100-80GB", "gpus": 4, "domain": "rack-b"},
            ],
            **extra,
        }
    )


def commit(placer: TopologyPlacer, placed: object, prefix: str = "") -> list[str]:
    ids = []
    for pool, slots in placed.nodes.items():  # type: ignore[attr-defined]
        for node, _ in slots:
            iid = f"{prefix}{pool}-{len(placer.instances())}"
            placer.assign(iid, pool, node)
            ids.append(iid)
    return ids


def test_prefill_and_decode_added_together_land_in_one_domain() -> None:
    placer = TopologyPlacer(inventory(), KINDS)
    placed = placer.place({"prefill": 2, "decode": 3})  # rack-a holds only 2 + 2: the group goes to rack-b
    assert placed.granted == {"prefill": 2, "decode": 3} and placed.explanation is None
    assert {d for slots in placed.nodes.values() for _, d in slots} == {"rack-b"}
    assert placed.cross_domain_pairs == 0


def test_a_decode_only_addition_joins_the_running_prefill_domain() -> None:
    placer = TopologyPlacer(inventory(), KINDS)
    placer.assign("p0", "prefill", "h-a")
    placer.assign("d0", "decode", "a-a")
    placed = placer.place({"decode": 1})  # anchors: 1 P + 1 D in rack-a; a-a still has one free GPU
    assert placed.nodes == {"decode": (("a-a", "rack-a"),)}
    commit(placer, placed)
    placed = placer.place(
        {"decode": 1}
    )  # rack-a is full now: the only room is rack-b, one cross pair (1 P × 1 D)
    assert placed.nodes == {"decode": (("a-b", "rack-b"),)}
    assert placed.cross_domain_pairs == 1


def test_running_instances_never_move_and_capacity_is_respected() -> None:
    rng = random.Random(7)
    placer = TopologyPlacer(inventory(), KINDS)
    where: dict[str, str] = {}
    for step in range(12):
        adds = {"prefill": rng.randint(0, 2), "decode": rng.randint(0, 2)}
        for iid in commit(placer, placer.place(adds), prefix=f"s{step}-"):
            where[iid] = placer.node_of(iid)  # type: ignore[assignment]
        if step % 3 == 2:  # scale in one of each pool, the placer's preferred victim
            for pool in KINDS:
                victims = placer.removal_order(placer.instances(pool))
                if victims:
                    placer.release(victims[0])
                    where.pop(victims[0])
        assert {i: placer.node_of(i) for i in where} == where  # nobody moved
        for node in placer.describe():
            assert node["used"] <= node["gpus"]
            assert node["used"] == len(node["instances"])  # tp 1: one GPU per instance


def test_short_inventory_clips_the_decision_and_says_why() -> None:
    placer = TopologyPlacer(inventory(), KINDS)
    placed = placer.place({"prefill": 4, "decode": 8})  # 6 A100 GPUs in all
    assert placed.requested == {"decode": 8, "prefill": 4}
    assert placed.granted == {"decode": 6, "prefill": 4}
    assert placed.shortfall == {"decode": 2}
    assert placed.explanation == "not enough free GPUs — A100-80GB: need 8 GPUs, 6 free"
    assert sum(len(s) for s in placed.nodes.values()) == 10


def test_require_mode_clips_to_what_fits_in_one_domain() -> None:
    placer = TopologyPlacer(inventory(same_domain="require"), KINDS)
    placed = placer.place({"prefill": 5, "decode": 5})  # no domain holds 5 + 5; rack-b holds 4 + 4
    assert placed.granted == {"prefill": 4, "decode": 4}
    assert "in one domain" in (placed.explanation or "")
    assert {d for slots in placed.nodes.values() for _, d in slots} == {"rack-b"}


def test_full_inventory_grants_nothing_and_never_raises() -> None:
    placer = TopologyPlacer(inventory(), {"decode": DEC})
    commit(placer, placer.place({"decode": 6}))
    placed = placer.place({"decode": 2})
    assert placed.granted == {"decode": 0} and placed.nodes == {"decode": ()}
    assert placed.explanation == "not enough free GPUs — A100-80GB: need 2 GPUs, 0 free"


def test_scale_in_prefers_cross_domain_then_emptying_a_partial_node() -> None:
    placer = TopologyPlacer(inventory(), KINDS)
    placer.assign("p0", "prefill", "h-a")
    placer.assign("d-a", "decode", "a-a")
    placer.assign("d-b1", "decode", "a-b")
    placer.assign("d-b2", "decode", "a-b")
    # the prefill sits in rack-a: both rack-b decodes form a cross pair each, d-a none
    assert placer.removal_order(["d-a", "d-b1", "d-b2"])[-1] == "d-a"
    assert placer.summary().cross_domain_pairs == 2 and placer.summary().pd_pairs == 3
    placer.release("p0")
    placer.assign("p1", "prefill", "h-b")
    # now d-a is the cross one, and removing it also empties a-a (fragmented 1/2 → empty)
    assert placer.removal_order(["d-b1", "d-b2", "d-a"])[0] == "d-a"
    assert placer.summary().fragmented_nodes == ("a-a", "h-b", "a-b")


def test_same_inputs_same_placement() -> None:
    def run() -> list[dict[str, object]]:
        placer = TopologyPlacer(inventory(), KINDS)
        for adds in ({"prefill": 1, "decode": 1}, {"decode": 2}, {"prefill": 2, "decode": 3}):
            commit(placer, placer.place(adds))
        return placer.describe()

    assert run() == run()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param({"nodes": []}, "non-empty 'nodes' list", id="empty inventory is refused"),
        pytest.param(
            {"nodes": [{"name": "x", "gpu": "L4", "gpus": 1}, {"name": "x", "gpu": "L4", "gpus": 1}]},
            "unique",
            id="duplicate node names are refused",
        ),
        pytest.param({"nodes": [{"name": "x", "gpu": "L4"}]}, "needs name, gpu, gpus", id="missing gpus"),
    ],
)
def test_bad_inventory_is_one_clear_error(data: dict[str, object], message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        Inventory.from_data(data)
