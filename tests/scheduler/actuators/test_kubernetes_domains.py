"""The kubernetes actuator over a pool with one Deployment per network domain, against the real client with
recorded API responses: scale-up split by the placement's domains (or balanced without an inventory),
scale-in from the domain the topology ranks first, replicas summed, failures reported per Deployment."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import RESTResponse

from placement.profiles import Role
from placement.topology import InstanceKind
from scheduler.actuators.base import ActuatorCallFailed
from scheduler.actuators.kubernetes import DomainScale, KubernetesActuator, PlacedScaleAction
from scheduler.topology import Inventory, TopologyPlacer
from tests.scheduler.actuators.test_actuators import _forbidden, _Recorded, _scale_object

BASE = "https://k8s.test/apis/apps/v1/namespaces/llm/deployments"
DOMAINS = {
    "p": {"rack-1": "mosaic-p-rack-1", "rack-2": "mosaic-p-rack-2"},
    "d": {"rack-1": "mosaic-d-rack-1", "rack-2": "mosaic-d-rack-2"},
}
# rack-1: 2 H100 + 2 L4; rack-2: 2 H100 + 4 L4 (one GPU per instance)
NODES = {
    "nodes": [
        {"name": "h1", "gpu": "H100-SXM", "gpus": 2, "domain": "rack-1"},
        {"name": "l1", "gpu": "L4", "gpus": 2, "domain": "rack-1"},
        {"name": "h2", "gpu": "H100-SXM", "gpus": 2, "domain": "rack-2"},
        {"name": "l2", "gpu": "L4", "gpus": 4, "domain": "rack-2"},
    ]
}


class Cluster:
    """Deployments' scale subresources behind the real AppsV1Api: every call recorded as (method, name, body)."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = dict(replicas)
        self.calls: list[tuple[str, str, int | None]] = []
        self.forbid_patch: set[str] = set()
        self.forbid_all: set[str] = set()
        self.api_client = client.ApiClient(client.Configuration(host="https://k8s.test"))
        self.api_client.rest_client.request = self._request
        self.apps = client.AppsV1Api(self.api_client)

    def _request(
        self,
        method: str,
        url: str,
        headers: Any = None,
        body: Any = None,
        post_params: Any = None,
        _request_timeout: Any = None,
    ) -> Any:
        path, _, query = url.partition("?")
        assert path.startswith(BASE + "/") and path.endswith("/scale"), url
        assert query == ("fieldManager=mosaic-autoscaler" if method == "PATCH" else ""), url
        name = path[len(BASE) + 1 : -len("/scale")]
        self.calls.append((method, name, body["spec"]["replicas"] if body else None))
        if name in self.forbid_all or (method == "PATCH" and name in self.forbid_patch):
            return RESTResponse(_Recorded(403, _forbidden(method, name)))
        if method == "PATCH":
            self.replicas[name] = body["spec"]["replicas"]
        return RESTResponse(_Recorded(200, _scale_object(name, self.replicas[name])))

    def patches(self) -> list[tuple[str, int | None]]:
        return [(name, n) for method, name, n in self.calls if method == "PATCH"]


@pytest.fixture
def cluster() -> Iterator[Any]:
    made: list[Cluster] = []

    def make(**replicas: int) -> Cluster:
        made.append(Cluster({f"mosaic-{k.replace('_', '-')}": v for k, v in replicas.items()}))
        return made[-1]

    yield make
    for c in made:
        c.api_client.close()


def _placer() -> TopologyPlacer:
    kinds = {
        "p": InstanceKind("m", "H100-SXM", 1, Role.PREFILL),
        "d": InstanceKind("m", "L4", 1, Role.DECODE),
    }
    return TopologyPlacer(Inventory.from_data(NODES), kinds)


def _nodes(placer: TopologyPlacer) -> dict[str, list[str]]:
    return {n["node"]: n["instances"] for n in placer.describe()}


def test_replicas_is_the_sum_of_the_domain_deployments(cluster: Any) -> None:
    c = cluster(p_rack_1=1, p_rack_2=2, d_rack_1=0, d_rack_2=0)
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS)
    assert actuator.replicas("p") == 3  # 1 + 2
    assert c.calls == [("GET", "mosaic-p-rack-1", None), ("GET", "mosaic-p-rack-2", None)]
    assert not actuator.places("p")  # no inventory: nothing to place


def test_scale_up_adds_each_replica_to_the_domain_of_its_node(cluster: Any) -> None:
    c = cluster(p_rack_1=1, p_rack_2=0, d_rack_1=1, d_rack_2=0)
    placer = _placer()
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS, placer)
    assert actuator.places("d") and actuator.replicas("d") == 1 and actuator.replicas("p") == 1
    # the running replicas are placed on their domain's nodes (best fit)
    assert _nodes(placer) == {"h1": ["p@rack-1#2"], "l1": ["d@rack-1#1"], "h2": [], "l2": []}
    c.calls.clear()
    actuator.assign_nodes("d", [("l2", "rack-2"), ("l2", "rack-2"), ("l1", "rack-1")])
    action = actuator.scale("d", 4, now=30.0)
    assert isinstance(action, PlacedScaleAction)
    assert (action.pool, action.before, action.after, action.applied, action.error) == ("d", 1, 4, True, None)
    # rack-1: 1 + 1 = 2, rack-2: 0 + 2 = 2; Deployments patched in domain order, reads first
    assert action.domains == (
        DomainScale("rack-1", "mosaic-d-rack-1", 1, 2),
        DomainScale("rack-2", "mosaic-d-rack-2", 0, 2),
    )
    assert c.calls == [
        ("GET", "mosaic-d-rack-1", None),
        ("GET", "mosaic-d-rack-2", None),
        ("PATCH", "mosaic-d-rack-1", 2),
        ("PATCH", "mosaic-d-rack-2", 2),
    ]
    assert _nodes(placer) == {
        "h1": ["p@rack-1#2"],
        "l1": ["d@rack-1#1", "d@rack-1#5"],  # slots are numbered in the order the nodes were handed over
        "h2": [],
        "l2": ["d@rack-2#3", "d@rack-2#4"],
    }
    # the next read sees what was patched, and the placer already matches it: nothing re-placed
    assert actuator.replicas("d") == 4 and len(placer.instances("d")) == 4


def test_replicas_beyond_the_handed_nodes_are_placed_around_them(cluster: Any) -> None:
    c = cluster(p_rack_1=0, p_rack_2=0, d_rack_1=1, d_rack_2=0)
    placer = _placer()
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS, placer)
    actuator.replicas("d")
    # one node handed over (l1's last free GPU) for two new replicas: the second is placed alone, seeing l1 full
    actuator.assign_nodes("d", [("l1", "rack-1")])
    action = actuator.scale("d", 3, now=0.0)
    assert (action.before, action.after, action.applied, action.error) == (1, 3, True, None)
    assert c.patches() == [("mosaic-d-rack-1", 2), ("mosaic-d-rack-2", 1)]
    assert _nodes(placer) == {"h1": [], "l1": ["d@rack-1#1", "d@rack-1#2"], "h2": [], "l2": ["d@rack-2#3"]}


def test_scale_up_without_handed_nodes_places_alone_and_refuses_past_the_inventory(cluster: Any) -> None:
    c = cluster(p_rack_1=2, p_rack_2=1, d_rack_1=0, d_rack_2=0)
    placer = _placer()
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS, placer)
    # 4 H100 GPUs in all, 3 taken: p 3 → 5 places one (h2, rack-2) and refuses one
    action = actuator.scale("p", 5, now=0.0)
    assert (action.before, action.after, action.applied) == (3, 4, True)
    assert action.error == (
        "the node inventory has no room for 1 of 2 replicas: not enough free GPUs — H100-SXM: need 2 GPUs, 1 free"
    )
    assert c.patches() == [("mosaic-p-rack-2", 2)]


@pytest.mark.parametrize(
    ("with_inventory", "patched"),
    [
        # decodes: rack-1 2, rack-2 1; the one prefill sits in rack-1, so rack-2's decode is its only
        # cross-domain pair: the topology removes it, emptying rack-2
        pytest.param(True, [("mosaic-d-rack-2", 0)], id="with an inventory: the cross-domain decode goes"),
        # without one: the domain with the most replicas (rack-1: 2 → 1)
        pytest.param(False, [("mosaic-d-rack-1", 1)], id="without one: the fullest domain gives one back"),
    ],
)
def test_scale_in_removes_from_the_domain_ranked_first(
    cluster: Any, with_inventory: bool, patched: list[tuple[str, int]]
) -> None:
    c = cluster(p_rack_1=1, p_rack_2=0, d_rack_1=2, d_rack_2=1)
    placer = _placer() if with_inventory else None
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS, placer)
    actuator.replicas("p")  # the prefill placed (the controller reads every pool each cycle)
    action = actuator.scale("d", 2, now=60.0)
    assert (action.before, action.after, action.applied) == (3, 2, True)
    assert c.patches() == patched
    if placer is not None:
        assert placer.summary().cross_domain_pairs == 0  # 1 P × 2 D, all in rack-1
        assert _nodes(placer)["l2"] == []


def test_scale_in_re_ranks_after_each_removal(cluster: Any) -> None:
    c = cluster(p_rack_1=1, p_rack_2=1, d_rack_1=1, d_rack_2=2)
    placer = _placer()
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS, placer)
    actuator.replicas("p")
    # cross-domain pairs per decode: rack-1's 1 (with rack-2's P), each of rack-2's 1 (with rack-1's P): a tie,
    # broken by fragmentation: removing rack-1's empties l1 (partial → empty), rack-2's leaves l2 partial.
    # Then 2 rack-2 decodes remain, each 1 cross pair; removing one keeps l2 partial (1/4) → rack-2 2 → 1.
    action = actuator.scale("d", 1, now=0.0)
    assert action.domains == (
        DomainScale("rack-1", "mosaic-d-rack-1", 1, 0),
        DomainScale("rack-2", "mosaic-d-rack-2", 2, 1),
    )


def test_scale_up_without_an_inventory_balances_the_domains(cluster: Any) -> None:
    c = cluster(p_rack_1=0, p_rack_2=0, d_rack_1=1, d_rack_2=0)
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS)
    action = actuator.scale("d", 4, now=0.0)
    # fewest first, ties by name: rack-2 (0) → rack-1 (1 = 1) → rack-2 (2 > 1): 2 + 2
    assert c.patches() == [("mosaic-d-rack-1", 2), ("mosaic-d-rack-2", 2)]
    assert (action.before, action.after) == (1, 4)


def test_a_refused_patch_is_reported_and_only_what_applied_is_placed(cluster: Any) -> None:
    c = cluster(p_rack_1=1, p_rack_2=0, d_rack_1=1, d_rack_2=0)
    c.forbid_patch.add("mosaic-d-rack-2")
    placer = _placer()
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS, placer)
    actuator.replicas("d")
    actuator.assign_nodes("d", [("l2", "rack-2"), ("l2", "rack-2"), ("l1", "rack-1")])
    action = actuator.scale("d", 4, now=5.0)
    assert (action.before, action.after, action.applied) == (1, 2, False)
    refused = (
        "patching deployments/mosaic-d-rack-2/scale in namespace llm to 2 replicas: 403 Forbidden: "
        + _forbidden("PATCH", "mosaic-d-rack-2")["message"]
    )
    assert action.error == refused
    assert action.domains == (
        DomainScale("rack-1", "mosaic-d-rack-1", 1, 2),
        DomainScale("rack-2", "mosaic-d-rack-2", 0, 0, refused),
    )
    assert len(placer.instances("d")) == 2 and _nodes(placer)["l2"] == []
    # the next cycle reads 2 and may retry with fresh nodes
    assert actuator.replicas("d") == 2


def test_a_refused_scale_in_puts_the_slot_back(cluster: Any) -> None:
    c = cluster(p_rack_1=1, p_rack_2=0, d_rack_1=2, d_rack_2=1)
    c.forbid_patch.add("mosaic-d-rack-2")
    placer = _placer()
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS, placer)
    actuator.replicas("p")
    action = actuator.scale("d", 2, now=0.0)
    assert (action.before, action.after, action.applied, action.error) == (
        3,
        3,
        False,
        "patching deployments/mosaic-d-rack-2/scale in namespace llm to 0 replicas: 403 Forbidden: "
        + _forbidden("PATCH", "mosaic-d-rack-2")["message"],
    )
    assert len(placer.instances("d")) == 3 and len(_nodes(placer)["l2"]) == 1


def test_an_unreadable_deployment_is_reported_without_raising(cluster: Any) -> None:
    c = cluster(p_rack_1=1, p_rack_2=0, d_rack_1=1, d_rack_2=0)
    c.forbid_all.add("mosaic-d-rack-2")
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS, _placer())
    with pytest.raises(ActuatorCallFailed) as raised:
        actuator.replicas("d")  # the controller logs it and leaves the pool unmanaged this cycle
    assert str(raised.value) == (
        "reading deployments/mosaic-d-rack-2/scale in namespace llm: 403 Forbidden: "
        + _forbidden("GET", "mosaic-d-rack-2")["message"]
    )
    action = actuator.scale("d", 3, now=0.0)
    assert (action.before, action.after, action.applied, action.error) == (-1, -1, False, str(raised.value))
    assert c.patches() == []


def test_replicas_a_hand_scaled_deployment_are_reconciled_with_the_placer(cluster: Any) -> None:
    c = cluster(p_rack_1=0, p_rack_2=0, d_rack_1=3, d_rack_2=1)
    placer = _placer()
    actuator = KubernetesActuator(c.apps, "llm", {}, DOMAINS, placer)
    assert actuator.replicas("d") == 4
    # l1 holds 2 L4s: the third rack-1 replica has no room in the model
    assert actuator.unplaced == {"d": 1}
    assert _nodes(placer)["l1"] == ["d@rack-1#1", "d@rack-1#2"]
    c.replicas["mosaic-d-rack-1"] = 1  # someone ran kubectl scale
    assert actuator.replicas("d") == 2 and actuator.unplaced == {"d": 0}
    assert len(_nodes(placer)["l1"]) == 1
    # scale-in takes the unplaced replica first
    c.replicas["mosaic-d-rack-1"] = 3
    actuator.replicas("d")
    actuator.scale("d", 3, now=0.0)
    assert c.patches() == [("mosaic-d-rack-1", 2)]


def test_a_pool_cannot_be_both_one_deployment_and_per_domain(cluster: Any) -> None:
    c = cluster()
    with pytest.raises(ValueError, match="both one Deployment and per-domain"):
        KubernetesActuator(c.apps, "llm", {"d": "mosaic-d"}, DOMAINS)
