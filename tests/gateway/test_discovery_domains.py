"""Network domains of workers (`Endpoint.domain` → `WorkerView.domain`), for the router's pd-domain-affinity.

Recorded API objects (`kubectl get -o json` shape): `fixtures/endpointslices_zones.json` (endpoints with
`zone` and `nodeName`, one on a node without a zone), `fixtures/nodes.json` (node labels: zone and a custom
`mosaic.dev/rdma-group`), `fixtures/pods_nodes.json` (pods with `spec.nodeName`). Static pools: per-URL
`{url, domain}` items and the pool's `domain:`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from scheduler.fleet import Role, capacity_for
from server.config import EndpointsConfig, HealthConfig, KubernetesSource, ScrapeConfig, validate_config
from server.discovery import KubernetesDiscovery, StaticSource, endpoints_from_pods, endpoints_from_slices
from server.metrics import GatewayMetrics
from server.registry import PoolInfo, Registry

FIXTURES = Path(__file__).parent / "fixtures"
SLICES = json.loads((FIXTURES / "endpointslices_zones.json").read_text())
NODES = json.loads((FIXTURES / "nodes.json").read_text())
PODS = json.loads((FIXTURES / "pods_nodes.json").read_text())
NODE_LABELS = {n["metadata"]["name"]: n["metadata"]["labels"] for n in NODES["items"]}


def _domains(endpoints: list[Any]) -> dict[str, str | None]:
    return {e.name: e.domain for e in endpoints}


@pytest.mark.parametrize(
    ("label", "node_labels", "expected"),
    [
        pytest.param(
            "topology.kubernetes.io/zone",
            None,
            {"vllm-prefill-h100-0": "rack-1", "vllm-prefill-h100-1": "rack-2", "vllm-prefill-h100-2": None},
            id="default zone label is read from the endpoint's zone field, no node listing",
        ),
        pytest.param(
            "mosaic.dev/rdma-group",
            NODE_LABELS,
            {"vllm-prefill-h100-0": "ib-a", "vllm-prefill-h100-1": "ib-a", "vllm-prefill-h100-2": None},
            id="a custom label is read from the endpoint's node (nodeName) labels",
        ),
        pytest.param(
            "mosaic.dev/rdma-group",
            None,
            {"vllm-prefill-h100-0": None, "vllm-prefill-h100-1": None, "vllm-prefill-h100-2": None},
            id="a custom label without node labels → unknown (the zone field is not that label)",
        ),
        pytest.param(
            None,
            NODE_LABELS,
            {"vllm-prefill-h100-0": None, "vllm-prefill-h100-1": None, "vllm-prefill-h100-2": None},
            id="domain_label null → domains off",
        ),
    ],
)
def test_endpointslice_domains(label: str | None, node_labels: Any, expected: dict[str, str | None]) -> None:
    assert _domains(endpoints_from_slices(SLICES, "http", "http", label, node_labels)) == expected


def test_pod_domains_come_from_the_node() -> None:
    eps = endpoints_from_pods(PODS, "http", "http", "topology.kubernetes.io/zone", NODE_LABELS)
    assert _domains(eps) == {"vllm-decode-a100-0": "rack-1", "vllm-decode-a100-1": "rack-2"}
    assert _domains(endpoints_from_pods(PODS, "http")) == {
        "vllm-decode-a100-0": None,
        "vllm-decode-a100-1": None,
    }


def _offline_registry() -> Registry:
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503)))
    return Registry(ScrapeConfig(), HealthConfig(), GatewayMetrics(), client=client)


def _view_domains(reg: Registry) -> dict[str, str | None]:
    return {w.id: w.domain for w in reg.view().workers}


@pytest.mark.parametrize(
    ("cfg", "fixture", "expected_calls", "expected"),
    [
        pytest.param(
            {"label_selector": "kubernetes.io/service-name=vllm-prefill-h100", "port": "http"},
            SLICES,
            ["endpointslices"],
            {
                "p/vllm-prefill-h100-0": "rack-1",
                "p/vllm-prefill-h100-1": "rack-2",
                "p/vllm-prefill-h100-2": None,
            },
            id="EndpointSlices with the default label: zone field, one API call",
        ),
        pytest.param(
            {"label_selector": "app=vllm-decode-a100", "port": "http", "resource": "pods"},
            PODS,
            ["pods", "nodes"],
            {"p/vllm-decode-a100-0": "rack-1", "p/vllm-decode-a100-1": "rack-2"},
            id="pods: the node listing gives the zone",
        ),
    ],
)
def test_kubernetes_discovery_to_fleet_view(
    cfg: dict[str, Any], fixture: dict[str, Any], expected_calls: list[str], expected: dict[str, str | None]
) -> None:
    calls: list[str] = []

    def lister(resource: str, namespace: str, selector: str) -> dict[str, Any]:
        calls.append(resource)
        return NODES if resource == "nodes" else fixture

    async def run() -> None:
        reg = _offline_registry()
        info = PoolInfo("p", "llama-3-8b", "H100-SXM", Role.PREFILL, capacity_for("H100", "llama-3-8b"))
        source = KubernetesDiscovery(KubernetesSource(**cfg), lister=lister)
        reg.add_pool(info, source)
        await source.start()
        await reg.resync("p")
        assert _view_domains(reg) == expected
        assert calls == expected_calls
        await reg.stop()
        await reg._client.aclose()

    asyncio.run(run())


def test_failed_node_listing_leaves_domains_unknown() -> None:
    def lister(resource: str, namespace: str, selector: str) -> dict[str, Any]:
        if resource == "nodes":
            raise RuntimeError("403 Forbidden: nodes is forbidden")
        return PODS

    cfg = KubernetesSource(label_selector="app=vllm-decode-a100", port="http", resource="pods")
    source = KubernetesDiscovery(cfg, lister=lister)
    asyncio.run(source.start())
    eps = asyncio.run(source.list())
    assert [(e.name, e.ready, e.domain) for e in eps] == [
        ("vllm-decode-a100-0", True, None),
        ("vllm-decode-a100-1", True, None),
    ]


def test_static_domains_per_url_and_per_pool() -> None:
    """`static: [{url, domain}]` sets one URL's domain; the pool's `domain:` covers URLs without one."""
    config = validate_config(
        {
            "models": [{"name": "llama-3-8b"}],
            "pools": [
                {
                    "name": "p",
                    "model": "llama-3-8b",
                    "gpu": "H100-SXM",
                    "role": "mixed",
                    "domain": "rack-1",
                    "endpoints": {
                        "static": [
                            "http://10.0.0.1:8000",
                            {"url": "http://10.0.0.2:8000/", "domain": "rack-2"},
                        ]
                    },
                }
            ],
        },
        "test",
    )
    pool = config.pools[0]
    assert pool.endpoints.static == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert pool.endpoints.static_domains == {"http://10.0.0.2:8000": "rack-2"}

    async def run() -> None:
        reg = _offline_registry()
        info = PoolInfo(
            "p", "llama-3-8b", "H100-SXM", Role.PREFILL, capacity_for("H100", "llama-3-8b"), pool.domain
        )
        reg.add_pool(info, StaticSource(pool.endpoints.static or [], pool.endpoints.static_domains))
        await reg.resync("p")
        assert _view_domains(reg) == {"p/10.0.0.1:8000": "rack-1", "p/10.0.0.2:8000": "rack-2"}
        await reg.stop()
        await reg._client.aclose()

    asyncio.run(run())


def test_static_item_with_unknown_key_is_refused() -> None:
    with pytest.raises(ValueError, match=r"give a URL or \{url, domain\}"):
        EndpointsConfig.model_validate({"static": [{"url": "http://10.0.0.1:8000", "zone": "rack-1"}]})
