"""Topology in the cluster simulator: instances placed on the node inventory, cross-domain KV transfers
slower, decisions clipped when the inventory is short, topology time series in the report, determinism."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from scheduler.autoscaler.factory import build_policy
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import FleetConfigError, load_fleet, parse_fleet, pool_specs
from simulator.cluster_report import build_report

REPO = Path(__file__).resolve().parents[2]
NODES = {
    "nodes": [
        {"name": "h-a", "gpu": "H100", "gpus": 2, "domain": "rack-a"},
        {"name": "a-a", "gpu": "A100-80GB", "gpus": 2, "domain": "rack-a"},
        {"name": "h-b", "gpu": "H100", "gpus": 4, "domain": "rack-b"},
        {"name": "a-b", "gpu": "A100-80GB", "gpus": 4, "domain": "rack-b"},
    ]
}
FLEET = {
    "model": "llama-3-8b",
    "slo": {"ttft_ms": 3000, "tpot_ms": 100},
    "cold_start_s": 60,
    "decision_interval_s": 10,
    "kv_link_gbps": 25,
    "kv_link_cross_domain_gbps": 2,
    "autoscaler": {"pd_ratio": 1.0, "scale_down_window_s": 60},
    "nodes": NODES,
    "pools": [
        {
            "name": "prefill-h100",
            "gpu": "H100",
            "role": "prefill",
            "replicas": 1,
            "min_replicas": 1,
            "max_replicas": 6,
        },
        {
            "name": "decode-a100",
            "gpu": "A100-80GB",
            "role": "decode",
            "replicas": 1,
            "min_replicas": 1,
            "max_replicas": 6,
        },
    ],
}


def burst(n: int, rate: float, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, rng.randint(200, 2000), rng.randint(20, 300)))
    return out


def simulate(
    fleet_data: dict, requests: list[SimRequest], policy: str = "mosaic"
) -> tuple[dict, ClusterSimulator]:
    fleet = parse_fleet(fleet_data)
    scaling = build_policy(
        policy, pool_specs(fleet), fleet.autoscaler_config(), {p.name: p.replicas for p in fleet.pools}
    )
    sim = ClusterSimulator(fleet, scaling, policy)
    return build_report(sim.run(requests), wall_s=1.0), sim


def one_request_fleet(cross: bool) -> dict:
    # one H100 in rack-a; the A100 is in rack-a (same domain) or only in rack-b (forced cross-domain)
    nodes = [
        {"name": "h-a", "gpu": "H100", "gpus": 1, "domain": "rack-a"},
        {
            "name": "a-b" if cross else "a-a",
            "gpu": "A100-80GB",
            "gpus": 1,
            "domain": "rack-b" if cross else "rack-a",
        },
    ]
    return {**FLEET, "kv_link_cross_domain_gbps": 1, "nodes": {"nodes": nodes}}


def test_cross_domain_kv_transfer_is_slower_by_the_bandwidth_difference() -> None:
    intra, _ = simulate(one_request_fleet(cross=False), [SimRequest(0.0, 1000, 50)], "fixed")
    cross, _ = simulate(one_request_fleet(cross=True), [SimRequest(0.0, 1000, 50)], "fixed")
    assert intra["topology"]["kv_transfers"] == {"intra_domain": 1, "cross_domain": 0}
    assert cross["topology"]["kv_transfers"] == {"intra_domain": 0, "cross_domain": 1}
    assert cross["topology"]["samples"][0]["cross_domain_pairs"] == 1
    # 1,000 tokens · 128 KiB = 131.072 MB: 131.072 ms at 1 GB/s across, 5.243 ms at 25 GB/s within → +125.829 ms
    delta = cross["latency_ms"]["ttft"]["p50"] - intra["latency_ms"]["ttft"]["p50"]
    assert delta == pytest.approx(125.829, abs=0.01)


def test_scale_ups_land_in_one_domain_and_capacity_holds() -> None:
    report, sim = simulate(FLEET, burst(1500, 25, seed=2))
    top = report["topology"]
    ups = [e for e in report["scale_events"] if e["after"] > e["before"]]
    assert ups and not top["shortfalls"]
    assert top["max_cross_domain_pairs"] == 0  # every prefill/decode pair shared a domain at every sample
    assert top["kv_transfers"]["cross_domain"] == 0
    assert all(s["used_gpus"] <= s["total_gpus"] == 12 for s in top["samples"])
    assert report["requests"]["completed"] == 1500 and report["requests"]["aborted_by_scale_in"] == 0
    assert sim.topology.placer is not None and sim.topology.placer.instances() == []  # all freed at the end


def test_short_inventory_clips_scale_ups_and_reports_the_shortfall() -> None:
    small = {
        **FLEET,
        "nodes": {
            "nodes": [
                {"name": "h", "gpu": "H100", "gpus": 1, "domain": "r"},
                {"name": "a", "gpu": "A100-80GB", "gpus": 1, "domain": "r"},
            ]
        },
    }
    report, _ = simulate(small, burst(1500, 25, seed=2))
    top = report["topology"]
    assert top["shortfalls"], "the burst wants more than 1 + 1 instances"
    first = top["shortfalls"][0]
    assert first["placed"] < first["requested"]
    assert "not enough free GPUs" in first["why"]
    replicas = [r[p] for r in report["replicas"] for p in ("prefill-h100", "decode-a100")]
    assert max(replicas) == 1  # never more instances than the inventory holds
    assert report["scale_events"] == []  # every scale-up was clipped to nothing
    assert report["requests"]["completed"] + report["requests"]["failed"] == 1500


def test_initial_replicas_that_do_not_fit_are_a_config_error() -> None:
    fleet = {**FLEET, "pools": [{**FLEET["pools"][0], "replicas": 7, "max_replicas": 8}, FLEET["pools"][1]]}
    with pytest.raises(
        FleetConfigError, match=r"initial replicas do not fit .*H100-SXM: need 7 GPUs, 6 free"
    ):
        simulate(fleet, [])


def test_a_node_gpu_no_pool_runs_and_the_catalog_lacks_is_refused_as_a_typo() -> None:
    """As `mosaic plan --nodes` refuses it; it read as "not enough free GPUs" for the pools' GPUs."""
    nodes = {"nodes": [*NODES["nodes"], {"name": "h9", "gpu": "H1OO", "gpus": 8, "domain": "rack-a"}]}
    with pytest.raises(
        FleetConfigError,
        match=r"^nodes: nodes\[\d+\] \(h9\): GPU 'H1OO' is neither in the catalog nor offered "
        r"\(A100-80GB, H100-SXM\)$",
    ):
        simulate({**FLEET, "nodes": nodes}, [])
    # a GPU the catalog knows is kept though no pool runs it (a shared cluster's other nodes)
    known = {"nodes": [*NODES["nodes"], {"name": "l9", "gpu": "L4", "gpus": 8, "domain": "rack-a"}]}
    simulate({**FLEET, "nodes": known}, [])


def test_same_seed_same_topology() -> None:
    a, _ = simulate(FLEET, burst(800, 20, seed=5))
    b, _ = simulate(FLEET, burst(800, 20, seed=5))
    assert a["topology"] == b["topology"] and a["scale_events"] == b["scale_events"]


def test_no_inventory_no_topology_section() -> None:
    plain = {k: v for k, v in FLEET.items() if k != "nodes"}
    report, _ = simulate(plain, burst(50, 5, seed=1), "fixed")
    assert report["topology"] is None


def test_nodes_file_is_read_relative_to_the_fleet_file(tmp_path: Path) -> None:
    (tmp_path / "inv").mkdir()
    (tmp_path / "inv" / "nodes.yaml").write_text(json.dumps(NODES))
    (tmp_path / "fleet.yaml").write_text(json.dumps({**FLEET, "nodes": "inv/nodes.yaml"}))
    assert load_fleet(tmp_path / "fleet.yaml").nodes == NODES
    (tmp_path / "bad.yaml").write_text(json.dumps({**FLEET, "nodes": "missing.yaml"}))
    with pytest.raises(FleetConfigError, match=r"missing\.yaml: cannot read"):
        load_fleet(tmp_path / "bad.yaml")


def test_the_documented_example_fleet_loads_and_places() -> None:
    fleet = load_fleet(REPO / "docs/examples/fleet-pd-topology.yaml")
    report = build_report(ClusterSimulator(fleet, None).run([SimRequest(0.0, 500, 10)]), wall_s=1.0)
    first = report["topology"]["samples"][0]
    assert first["used_gpus"] == 5 + 1 + 2  # 5 GPUs taken on h100-r1, 1 prefill, 2 decode
    assert first["cross_domain_pairs"] == 0 and first["total_gpus"] == 24
