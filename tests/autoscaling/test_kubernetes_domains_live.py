"""Per-domain Deployments in the live controller (`autoscaler.kubernetes.domains` with `autoscaler.nodes`):
`mosaic autoscale` hands the controller's topology placer to the kubernetes actuator, so the prefill and decode
replicas one decision adds land in one domain's Deployments; the mapping is checked against the pools and the
inventory with one-line errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from scheduler.topology import Inventory
from server.autoscale_placement import check_domains
from server.commands.autoscale import _run, kubernetes_deployments, kubernetes_domains
from server.config import ConfigError, load_config, validate_config
from tests.autoscaling.test_topology_live import FakeAppsApi, pd_config

# Both racks have room for one more prefill and one more decode; the running pair sits in rack-a.
NODES = {
    "nodes": [
        {"name": "h-a", "gpu": "H100-SXM", "gpus": 2, "domain": "rack-a"},
        {"name": "l-a", "gpu": "L4", "gpus": 2, "domain": "rack-a"},
        {"name": "h-b", "gpu": "H100-SXM", "gpus": 2, "domain": "rack-b"},
        {"name": "l-b", "gpu": "L4", "gpus": 2, "domain": "rack-b"},
    ]
}
DOMAINS = {
    "prefill": {"rack-a": "mosaic-prefill-rack-a", "rack-b": "mosaic-prefill-rack-b"},
    "decode": {"rack-a": "mosaic-decode-rack-a", "rack-b": "mosaic-decode-rack-b"},
}


def _config(policy: str, domains: Any = DOMAINS, nodes: Any = NODES) -> dict[str, Any]:
    data = pd_config(policy, actuator="kubernetes", nodes=nodes, interval_s=0.05)
    data["autoscaler"]["kubernetes"] = {"namespace": "llm", "domains": domains}
    for pool in data["pools"]:
        pool["endpoints"] = {"static": ["http://127.0.0.1:9"]}
    return data


def _decisions(
    tmp_path: Path, data: dict[str, Any], api: FakeAppsApi, capsys: pytest.CaptureFixture[str]
) -> list[Any]:
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump(data))
    asyncio.run(_run(load_config(tmp_path / "gw.yaml"), 1, True, api))
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_one_decisions_prefill_and_decode_land_in_one_domains_deployments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeAppsApi(
        {
            "mosaic-prefill-rack-a": 1,
            "mosaic-prefill-rack-b": 0,
            "mosaic-decode-rack-a": 1,
            "mosaic-decode-rack-b": 0,
        }
    )
    (decision,) = _decisions(tmp_path, _config("static:prefill=2,decode=2"), api, capsys)
    # The new prefill and decode join the running pair in rack-a (0 cross-domain pairs; rack-b would make
    # 2 of the 4 pairs cross): each pool's rack-a Deployment 1 → 2, rack-b untouched.
    assert [c for c in api.calls if c[0] == "patch"] == [
        ("patch", "mosaic-decode-rack-a", 2),
        ("patch", "mosaic-prefill-rack-a", 2),
    ]
    steps = {a["pool"]: (a["before"], a["after"], a["applied"], a["domains"]) for a in decision["actions"]}
    assert steps == {
        "decode": (
            1,
            2,
            True,
            [
                {
                    "domain": "rack-a",
                    "deployment": "mosaic-decode-rack-a",
                    "before": 1,
                    "after": 2,
                    "error": None,
                }
            ],
        ),
        "prefill": (
            1,
            2,
            True,
            [
                {
                    "domain": "rack-a",
                    "deployment": "mosaic-prefill-rack-a",
                    "before": 1,
                    "after": 2,
                    "error": None,
                }
            ],
        ),
    }
    # every Deployment is read through the scale subresource, never another one
    assert {c[1] for c in api.calls} == set(api.replicas)


def test_without_an_inventory_the_domains_are_balanced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = FakeAppsApi(
        {
            "mosaic-prefill-rack-a": 1,
            "mosaic-prefill-rack-b": 0,
            "mosaic-decode-rack-a": 1,
            "mosaic-decode-rack-b": 0,
        }
    )
    data = _config("static:prefill=2,decode=3")
    del data["autoscaler"]["nodes"]
    _decisions(tmp_path, data, api, capsys)
    # decode 1 → 3: rack-b (0), then rack-a (1 = 1, by name); prefill 1 → 2: rack-b
    assert [c for c in api.calls if c[0] == "patch"] == [
        ("patch", "mosaic-decode-rack-a", 2),
        ("patch", "mosaic-decode-rack-b", 1),
        ("patch", "mosaic-prefill-rack-b", 1),
    ]


def test_managed_pools_split_between_deployments_and_domains() -> None:
    data = _config("static:prefill=1,decode=1", domains={"decode": DOMAINS["decode"]})
    for pool in data["pools"]:  # found in the cluster, as the chart writes them
        pool["endpoints"] = {"kubernetes": {"label_selector": f"mosaic.dev/pool={pool['name']}"}}
    cfg = validate_config(data)
    # prefill keeps one Deployment named after the pool; decode is its two per-domain Deployments
    assert kubernetes_deployments(cfg) == {"prefill": "prefill"}
    assert kubernetes_domains(cfg) == {"decode": DOMAINS["decode"]}


@pytest.mark.parametrize(
    ("domains", "message"),
    [
        pytest.param(
            {"x": {"rack-a": "d"}}, "autoscaler.kubernetes.domains.x: no pool named 'x'", id="unknown pool"
        ),
        pytest.param(
            {"decode": {}}, "autoscaler.kubernetes.domains.decode: map at least one domain", id="no domain"
        ),
        pytest.param(
            {"prefill": {"rack-a": "same"}, "decode": {"rack-a": "same"}},
            "autoscaler.kubernetes.domains.decode.rack-a: Deployment 'same' is already mapped by domains.prefill.rack-a",
            id="one Deployment for two pools",
        ),
    ],
)
def test_bad_domain_mapping_is_one_config_error(domains: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(_config("static:prefill=1,decode=1", domains=domains))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_pool_in_both_mappings_is_refused() -> None:
    data = _config("static:prefill=1,decode=1")
    data["autoscaler"]["kubernetes"]["deployments"] = {"decode": "mosaic-decode"}
    with pytest.raises(ConfigError, match=r"pool 'decode' is also in autoscaler\.kubernetes\.deployments"):
        validate_config(data)


@pytest.mark.parametrize(
    ("domains", "message"),
    [
        pytest.param(
            {"decode": {"rack-a": "a", "rack-c": "c"}},
            "autoscaler.kubernetes.domains.decode: domain 'rack-c' is not in autoscaler.nodes (domains: rack-a, rack-b)",
            id="a domain the inventory does not have",
        ),
        pytest.param(
            {"decode": {"rack-a": "a"}},
            "autoscaler.kubernetes.domains.decode: autoscaler.nodes has L4 nodes in rack-b, where pool decode has "
            "no Deployment; map every domain the topology solver may place it in",
            id="a domain with the pool's GPUs and no Deployment",
        ),
    ],
)
def test_domains_are_checked_against_the_inventory(domains: Any, message: str) -> None:
    inventory = Inventory.from_data(NODES)
    with pytest.raises(ConfigError) as err:
        check_domains(domains, inventory, {"prefill": "H100-SXM", "decode": "L4"})
    assert str(err.value) == message
    check_domains({"decode": {"rack-a": "a", "rack-b": "b"}}, inventory, {"decode": "L4"})  # complete: fine


def test_mosaic_autoscale_exits_2_on_a_domain_missing_from_the_inventory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _config("static:prefill=1,decode=1", domains={"decode": {"rack-a": "a", "rack-z": "z"}})
    (tmp_path / "gw.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(typer.Exit) as exc:
        asyncio.run(_run(load_config(tmp_path / "gw.yaml"), 1, True, FakeAppsApi({})))
    assert exc.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == "error: autoscaler.kubernetes.domains.decode: domain 'rack-z' is not in autoscaler.nodes (domains: rack-a, rack-b)"
    )
