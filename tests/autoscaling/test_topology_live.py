"""Topology-aware placement in the live controller (`autoscaler.nodes`): the embedded actuator starts a
decision's new prefill and decode workers in one domain and records each worker's node; the dry-run and
kubernetes paths keep the computed placement (shown, never pinned); a short inventory clips the decision
with a reason, a metric and a log line; the config key's path is relative to the config file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from placement.catalog import load_catalog
from scheduler.actuators.kubernetes import KubernetesActuator
from server.autoscale_placement import config_inventory
from server.autoscaler_setup import controller_for
from server.config import ConfigError, MosaicConfig, load_config, validate_config
from server.gateway import Gateway
from server.runner import start_gateway_server

ADMIN = {"Authorization": "Bearer adm"}
# rack-a holds one prefill and one decode; rack-b two more prefills and three more decodes
NODES = {
    "nodes": [
        {"name": "h-a", "gpu": "H100-SXM", "gpus": 1, "domain": "rack-a"},
        {"name": "l-a", "gpu": "L4", "gpus": 1, "domain": "rack-a"},
        {"name": "h-b", "gpu": "H100-SXM", "gpus": 2, "domain": "rack-b"},
        {"name": "l-b", "gpu": "L4", "gpus": 3, "domain": "rack-b"},
    ]
}


def pd_config(policy: str, actuator: str = "embedded", nodes: Any = None, **extra: Any) -> dict[str, Any]:
    def pool(name: str, gpu: str, role: str, seed: int) -> dict[str, Any]:
        return {
            "name": name,
            "model": "llama-3-8b",
            "gpu": gpu,
            "role": role,
            "min_replicas": 1,
            "max_replicas": 6,
            "endpoints": {"simulated": {"replicas": 1, "seed": seed, "time_scale": 20}},
        }

    return {
        "pools": [pool("prefill", "H100-SXM", "prefill", 0), pool("decode", "L4", "decode", 10)],
        "auth": {"admin_keys": ["adm"]},
        "autoscaler": {
            "enabled": True,
            "actuator": actuator,
            "policy": policy,
            "interval_s": 3600,  # the tests run cycles themselves
            "nodes": NODES if nodes is None else nodes,
            **extra,
        },
    }


async def _embedded(cfg: MosaicConfig) -> dict[str, Any]:
    running = await start_gateway_server(cfg, "127.0.0.1", 0)
    out: dict[str, Any] = {}
    try:
        ctl = running.gateway.autoscaler
        assert ctl is not None
        ctl.build()
        out["initial"] = ctl.describe()["topology"]
        await ctl.cycle()
        actuator = ctl.actuator.by_pool["decode"]  # type: ignore[union-attr]
        await actuator.settle()
        out["events"] = [e for e in actuator.events if e["event"] == "started"]
        out["decision"] = ctl.decisions[-1]
        out["workers"] = sorted(r.id for r in running.gateway.registry.records())
        async with httpx.AsyncClient(base_url=running.url) as client:
            out["admin"] = (await client.get("/admin/autoscaler", headers=ADMIN)).json()
    finally:
        await running.stop()
    return out


def test_embedded_scale_up_starts_prefill_and_decode_in_one_domain() -> None:
    out = asyncio.run(_embedded(validate_config(pd_config("static:prefill=2,decode=3"))))
    # the running 1 + 1 fill rack-a exactly (no fragmented node); the new 1 P + 2 D go together to rack-b
    initial = {n["node"]: n["instances"] for n in out["initial"]["nodes"]}
    assert initial == {"h-a": ["prefill/sim-0"], "l-a": ["decode/sim-0"], "h-b": [], "l-b": []}
    started = sorted((e["pool"], e["node"], e["domain"]) for e in out["events"])
    assert started == [("decode", "l-b", "rack-b"), ("decode", "l-b", "rack-b"), ("prefill", "h-b", "rack-b")]
    assert len(out["workers"]) == 5
    placement = out["decision"]["placement"]
    assert placement["new"] == {
        "decode": [["l-b", "rack-b"], ["l-b", "rack-b"]],
        "prefill": [["h-b", "rack-b"]],
    }
    assert "shortfall" not in placement
    # new P (rack-b) × running D (rack-a) = 1, new Ds (rack-b) × running P (rack-a) = 2; new with new: 0
    assert placement["new_cross_domain_pairs"] == 3
    topo = out["admin"]["topology"]
    # P·D = 2·3 = 6 pairs; within a domain: rack-a 1·1 + rack-b 1·2 = 3 → 3 across
    assert (topo["pd_pairs"], topo["cross_domain_pairs"]) == (6, 3)
    assert {n["node"]: n["used"] for n in topo["nodes"]} == {"h-a": 1, "l-a": 1, "h-b": 1, "l-b": 2}
    assert topo["fragmented_nodes"] == 2  # h-b 1/2, l-b 2/3


async def _dry_run(cfg: MosaicConfig) -> dict[str, Any]:
    running = await start_gateway_server(cfg, "127.0.0.1", 0)
    try:
        ctl = running.gateway.autoscaler
        assert ctl is not None
        await ctl.cycle()
        metric = running.gateway.metrics.registry.get_sample_value
        return {
            "actions": [(a["pool"], a["before"], a["after"]) for a in ctl.actions],
            "decision": ctl.decisions[-1],
            "shortfall": metric("mosaic_autoscaler_placement_shortfall_total", {"pool": "decode"}),
            # every pool's series from the start, so Prometheus' increase() sees a first shortfall
            "prefill_shortfall": metric("mosaic_autoscaler_placement_shortfall_total", {"pool": "prefill"}),
            "cross": metric("mosaic_autoscaler_cross_domain_pairs", {}),
            "topology": ctl.describe()["topology"],
            "workers": len(running.gateway.registry.records()),
        }
    finally:
        await running.stop()


def test_short_inventory_clips_the_decision_with_a_reason_a_metric_and_a_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = validate_config(pd_config("static:prefill=2,decode=6", actuator="dry-run"))
    with caplog.at_level("WARNING", logger="mosaic.autoscaler"):
        out = asyncio.run(_dry_run(cfg))
    # 4 L4 GPUs in all, 1 taken: decode 1 → 4 (not 6); prefill 1 → 2 as asked; nothing really started
    assert sorted(out["actions"]) == [("decode", 1, 4), ("prefill", 1, 2)]
    assert out["decision"]["targets"] == {"prefill": 2, "decode": 6}  # what the policy wanted, kept
    assert out["decision"]["placement"]["shortfall"] == {
        "decode": 2,
        "why": "not enough free GPUs — L4: need 5 GPUs, 3 free",
    }
    assert (out["shortfall"], out["prefill_shortfall"]) == (2.0, 0.0)
    assert (
        out["topology"]["shortfalls"][0]["requested"] == 5 and out["topology"]["shortfalls"][0]["placed"] == 3
    )
    assert (
        out["cross"]
        == out["topology"]["cross_domain_pairs"]
        == out["decision"]["placement"]["fleet"]["cross_domain_pairs"]
    )
    assert out["workers"] == 2  # dry run: the placement is computed, nothing pinned or started
    assert any("holds 3 of the 5 instances" in r.getMessage() for r in caplog.records)


def test_nodes_path_is_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "nodes.yaml").write_text(json.dumps(NODES))
    (tmp_path / "gw.yaml").write_text(
        json.dumps(pd_config("static:prefill=1,decode=2", "dry-run", "nodes.yaml"))
    )
    out = asyncio.run(_dry_run(load_config(tmp_path / "gw.yaml")))
    # the running 1 + 1 fill rack-a; the one new decode can only go to rack-b
    assert out["decision"]["placement"]["new"] == {"decode": [["l-b", "rack-b"]]}
    assert len(out["topology"]["nodes"]) == 4


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        pytest.param(
            "/nonexistent/nodes.yaml", "cannot read", id="missing nodes file → one-line ConfigError"
        ),
        pytest.param({"nodes": []}, "non-empty 'nodes' list", id="empty inventory → one-line ConfigError"),
    ],
)
def test_bad_inventory_is_one_config_error(nodes: Any, message: str) -> None:
    # what the controller's builder (server.autoscaler_setup.controller_for) raises at gateway startup
    cfg = validate_config(pd_config("static:prefill=1,decode=1", "dry-run", nodes))
    with pytest.raises(ConfigError, match=message):
        config_inventory(cfg, load_catalog())


class FakeAppsApi:
    """The scale subresource of two Deployments (read and patch), recording the calls."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = dict(replicas)
        self.calls: list[tuple[str, str, int | None]] = []

    def read_namespaced_deployment_scale(
        self, name: str, namespace: str, _request_timeout: Any = None
    ) -> Any:
        self.calls.append(("read", name, None))
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas[name]))

    def patch_namespaced_deployment_scale(
        self,
        name: str,
        namespace: str,
        body: dict[str, Any],
        field_manager: str | None = None,
        _request_timeout: Any = None,
    ) -> Any:
        self.calls.append(("patch", name, body["spec"]["replicas"]))
        self.replicas[name] = body["spec"]["replicas"]


async def _kubernetes(api: FakeAppsApi) -> dict[str, Any]:
    data = pd_config("static:prefill=2,decode=6", actuator="kubernetes")
    for pool in data["pools"]:
        pool["endpoints"] = {"static": ["http://127.0.0.1:9"]}
    cfg = validate_config(data)
    gw = Gateway(cfg)
    try:
        ctl = controller_for(
            cfg,
            gw.registry,
            gw.metrics.registry,
            managed=frozenset({"prefill", "decode"}),
            actuator_factory=lambda initial: KubernetesActuator(api, "llm", {"prefill": "p", "decode": "d"}),
        )
        await ctl.cycle()
        return {"decision": ctl.decisions[-1], "topology": ctl.describe()["topology"]}
    finally:
        await gw.stop()


def test_kubernetes_gets_counts_and_the_computed_placement_is_shown_not_pinned() -> None:
    api = FakeAppsApi({"p": 1, "d": 1})
    out = asyncio.run(_kubernetes(api))
    # the clipped counts reach the scale subresource (decode 6 → 4: the inventory's L4s), nothing else
    assert [c for c in api.calls if c[0] == "patch"] == [("patch", "d", 4), ("patch", "p", 2)]
    assert out["decision"]["placement"]["new"] == {
        "decode": [["l-b", "rack-b"], ["l-b", "rack-b"], ["l-b", "rack-b"]],
        "prefill": [["h-b", "rack-b"]],
    }
    slots = {n["node"]: n["instances"] for n in out["topology"]["nodes"]}
    assert slots == {
        "h-a": ["prefill#2"],
        "l-a": ["decode#1"],
        "h-b": ["prefill#6"],
        "l-b": ["decode#3", "decode#4", "decode#5"],
    }


class _FakeSource:
    """What the embedded actuator reads of a simulated pool when choosing victims."""

    def __init__(self, n: int) -> None:
        self.workers = {i: object() for i in range(n)}
        self.draining: set[int] = set()
        self.ready_at: dict[int, float] = {}
        self.domains: dict[int, str] = {}  # the actuator lists each placed worker with its node's domain

    def clock(self) -> float:
        return 100.0

    def endpoint_name(self, index: int) -> str:
        return f"sim-{index}"


class _NoRecords:
    def get(self, worker_id: str) -> None:
        return None


def test_embedded_scale_in_removes_the_cross_domain_worker_first() -> None:
    from placement.profiles import Role
    from placement.topology import InstanceKind
    from scheduler.topology import Inventory, TopologyPlacer
    from server.embedded_actuator import EmbeddedActuator

    # 1 prefill fits only rack-a; of 3 decodes rack-a holds 2, so one sits in rack-b (listed first: sim-0)
    inventory = Inventory.from_data(
        {
            "nodes": [
                {"name": "l-b", "gpu": "L4", "gpus": 1, "domain": "rack-b"},
                {"name": "h-a", "gpu": "H100-SXM", "gpus": 1, "domain": "rack-a"},
                {"name": "l-a", "gpu": "L4", "gpus": 2, "domain": "rack-a"},
            ]
        }
    )
    kinds = {
        "p": InstanceKind("m", "H100-SXM", 1, Role.PREFILL),
        "d": InstanceKind("m", "L4", 1, Role.DECODE),
    }
    placer = TopologyPlacer(inventory, kinds)
    sources = {"p": _FakeSource(1), "d": _FakeSource(3)}
    act = EmbeddedActuator(sources, _NoRecords(), placer=placer)  # type: ignore[arg-type]
    assert [placer.node_of(f"d/sim-{i}") for i in range(3)] == ["l-b", "l-a", "l-a"]
    assert sources["d"].domains == {0: "rack-b", 1: "rack-a", 2: "rack-a"}
    assert placer.summary().cross_domain_pairs == 1
    # idle workers: without topology the newest (sim-2) goes first; with it, the cross-domain sim-0
    assert EmbeddedActuator(sources, _NoRecords())._victims("d", [0, 1, 2], 1) == [2]  # type: ignore[arg-type]
    assert act._victims("d", [0, 1, 2], 1) == [0]
    assert act.places("d") and not act.places("elsewhere")
