"""Discovery: static URLs, and Kubernetes EndpointSlices / pods parsed from recorded API objects.

`fixtures/endpointslices.json` and `fixtures/pods.json` are API list objects as `kubectl get -o json`
prints them (camelCase), covering ready, not-ready, terminating, nil conditions, duplicate addresses
across slices, IPv6, FQDN slices, pending and failed pods.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from scheduler.fleet import Role, WorkerState, capacity_for
from server.config import HealthConfig, KubernetesSource, ScrapeConfig
from server.discovery import (
    Endpoint,
    KubernetesDiscovery,
    NodeLabelCache,
    StaticSource,
    endpoints_from_pods,
    endpoints_from_slices,
)
from server.metrics import GatewayMetrics
from server.registry import PoolInfo, Registry

FIXTURES = Path(__file__).parent / "fixtures"
SLICES = json.loads((FIXTURES / "endpointslices.json").read_text())
PODS = json.loads((FIXTURES / "pods.json").read_text())
P = "vllm-decode-a100-6d5f7b9c4-"


def _offline_registry() -> Registry:
    """A registry whose probes never leave the process (every worker answers 503 to /health)."""
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503)))
    return Registry(ScrapeConfig(), HealthConfig(), GatewayMetrics(), client=client)


def test_endpointslices_honour_ready_and_terminating() -> None:
    eps = {e.name: e for e in endpoints_from_slices(SLICES, "http")}
    assert eps == {
        # ready → routable; the duplicate in the second slice collapses into one endpoint
        P + "2kq8x": Endpoint(P + "2kq8x", "http://10.42.0.17:8000", ready=True, terminating=False),
        # ready: false → starting (never routed until it turns ready)
        P + "9zt4m": Endpoint(P + "9zt4m", "http://10.42.1.23:8000", ready=False, terminating=False),
        # terminating (still serving) → draining, never ready
        P + "c7w1v": Endpoint(P + "c7w1v", "http://10.42.2.9:8000", ready=False, terminating=True),
        # nil conditions → ready and not terminating (the API's contract)
        P + "h3r6p": Endpoint(P + "h3r6p", "http://10.42.3.4:8000", ready=True, terminating=False),
        # IPv6 addresses are bracketed in the URL; the FQDN slice is skipped
        P + "v6pod": Endpoint(P + "v6pod", "http://[fd00:10:42::5]:8000", ready=True, terminating=False),
    }


@pytest.mark.parametrize(
    ("port", "expected_port"),
    [
        pytest.param(9000, 9000, id="a numeric port is used as given"),
        pytest.param("http", 8000, id="a named port is looked up in the slice's ports"),
        pytest.param("grpc", None, id="a port name the slice lacks → no endpoints"),
    ],
)
def test_endpointslice_ports(port: int | str, expected_port: int | None) -> None:
    eps = endpoints_from_slices(SLICES, port)
    if expected_port is None:
        assert eps == []
    else:
        assert {e.url.rsplit(":", 1)[1] for e in eps} == {str(expected_port)}


def test_pods_ready_terminating_pending_failed() -> None:
    eps = endpoints_from_pods(PODS, "http")
    assert eps == [
        Endpoint("vllm-prefill-h100-0", "http://10.42.5.11:8000", ready=True, terminating=False),
        Endpoint("vllm-prefill-h100-1", "http://10.42.6.12:8000", ready=False, terminating=False),
        # deletionTimestamp set → terminating even though its Ready condition is still True
        Endpoint("vllm-prefill-h100-2", "http://10.42.7.13:8000", ready=False, terminating=True),
        # -3 is Pending without an IP and -4 Failed (evicted): both skipped
    ]


def test_kubernetes_source_relists_and_registry_reconciles() -> None:
    """Periodic re-list: a pod that starts terminating turns draining; one that disappears is dropped."""
    listings: list[dict[str, Any]] = [PODS, {"items": [PODS["items"][0], {**PODS["items"][2]}]}]
    calls: list[tuple[str, str, str]] = []

    def lister(resource: str, namespace: str, selector: str) -> dict[str, Any]:
        calls.append((resource, namespace, selector))
        return listings[min(len(calls) - 1, 1)]

    cfg = KubernetesSource(
        namespace="mosaic", label_selector="mosaic.dev/pool=prefill-h100", port="http", resource="pods"
    )
    source = KubernetesDiscovery(cfg, lister=lister)

    async def run() -> None:
        reg = _offline_registry()
        reg.add_pool(
            PoolInfo(
                "prefill-h100", "llama-3-8b", "H100-SXM", Role.PREFILL, capacity_for("H100", "llama-3-8b")
            ),
            source,
        )
        await source.start()
        await reg.resync("prefill-h100")
        states = {r.id: r.state() for r in reg.records()}
        assert states == {
            "prefill-h100/vllm-prefill-h100-0": WorkerState.STARTING,  # ready in k8s, not yet health-checked
            "prefill-h100/vllm-prefill-h100-1": WorkerState.STARTING,
            "prefill-h100/vllm-prefill-h100-2": WorkerState.DRAINING,
        }
        await reg.resync("prefill-h100")
        assert sorted(r.id for r in reg.records()) == [
            "prefill-h100/vllm-prefill-h100-0",
            "prefill-h100/vllm-prefill-h100-2",
        ]
        # pods carry only their node's name: the node listing (the nodes with the domain label) gives it
        # (test_discovery_domains); listed once, not at every resync (NodeLabelCache)
        pods = ("pods", "mosaic", "mosaic.dev/pool=prefill-h100")
        assert calls == [pods, ("nodes", "", "topology.kubernetes.io/zone"), pods]
        await reg.stop()
        await reg._client.aclose()

    asyncio.run(run())


def test_failed_listing_keeps_last_good_endpoints() -> None:
    def lister(resource: str, namespace: str, selector: str) -> dict[str, Any]:
        raise RuntimeError("apiserver unavailable")

    async def run() -> None:
        reg = _offline_registry()
        cfg = KubernetesSource(label_selector="x=y")
        reg.add_pool(
            PoolInfo("p", "llama-3-8b", "L4", Role.MIXED, capacity_for("L4", "llama-3-8b")),
            KubernetesDiscovery(cfg, lister=lister),
        )
        reg.sync_pool("p", [Endpoint("a", "http://10.0.0.1:8000")])
        await reg.resync("p")  # raises inside; the listing must survive
        assert [r.id for r in reg.records()] == ["p/a"]
        await reg.stop()
        await reg._client.aclose()

    asyncio.run(run())


def test_static_source_names_by_host_port() -> None:
    eps = asyncio.run(StaticSource(["http://10.0.0.5:8000", "https://gpu.example:443"]).list())
    assert [e.name for e in eps] == ["10.0.0.5:8000", "gpu.example:443"]
    assert all(e.ready and not e.terminating for e in eps)


def _dual_stack(terminating_v6: bool = False) -> dict[str, Any]:
    """One pod behind a dual-stack Service: an IPv4 and an IPv6 EndpointSlice, one targetRef."""

    def slice_of(family: str, addr: str, terminating: bool) -> dict[str, Any]:
        return {
            "addressType": family,
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {
                    "addresses": [addr],
                    "conditions": {"ready": not terminating, "terminating": terminating},
                    "targetRef": {"kind": "Pod", "name": "vllm-decode-0"},
                }
            ],
        }

    return {"items": [slice_of("IPv6", "fd00::5", terminating_v6), slice_of("IPv4", "10.0.0.5", False)]}


def test_a_dual_stack_pod_is_one_worker_at_its_ipv4_address() -> None:
    # two endpoints of one name made the registry replace the worker's record at every listing
    assert endpoints_from_slices(_dual_stack(), "http") == [Endpoint("vllm-decode-0", "http://10.0.0.5:8000")]
    (only,) = endpoints_from_slices(_dual_stack(terminating_v6=True), "http")
    assert only.url == "http://10.0.0.5:8000" and only.terminating and not only.ready


def test_a_worker_back_in_the_next_listing_keeps_its_in_flight_requests() -> None:
    """Missing from one listing (a slice rewritten, a partial list), back in the next under the same id and
    URL, with 300 requests still running there: the same record, its in-flight count intact. Before, it
    came back as a fresh record (starting, 0 in flight) and the router over-sent to a busy worker."""

    async def main() -> tuple[tuple[str, int], tuple[str, int], int]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200)))
        reg = Registry(ScrapeConfig(), HealthConfig(), GatewayMetrics(), client=client)
        reg.add_pool(
            PoolInfo("p", "llama-3-8b", "H100-SXM", Role.MIXED, capacity_for("H100", "llama-3-8b")), None
        )
        a = Endpoint("vllm-0", "http://10.0.0.5:8000")
        try:
            reg.sync_pool("p", [a])
            await asyncio.sleep(0.05)  # its first health check: ready
            tickets = [reg.track("p/vllm-0", 500) for _ in range(300)]
            reg.sync_pool("p", [])
            reg.sync_pool("p", [a])
            view = reg.view().get("p/vllm-0")
            back = (view.state.value, view.inflight_requests)
            for ticket in tickets:
                ticket.done()
            reg.sync_pool("p", [])  # gone with nothing running: not kept
            reg.sync_pool("p", [Endpoint("vllm-0", "http://10.0.0.6:8000")])  # a new pod under the old name
            fresh = reg.view().get("p/vllm-0")
            return back, (fresh.state.value, fresh.inflight_requests), len(reg._departed)
        finally:
            await reg.stop()
            await client.aclose()

    back, fresh, departed = asyncio.run(main())
    assert back == ("ready", 300)
    assert fresh == ("starting", 0) and departed == 0


def test_a_worker_that_left_takes_its_error_series_with_it() -> None:
    """`mosaic_upstream_errors_total{worker}` and `mosaic_scrape_errors_total{worker}` were never removed:
    an autoscaled fleet exported one series per pod it ever had. A worker still running requests keeps them
    until those end."""

    async def main() -> list[set[str]]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500)))
        metrics = GatewayMetrics()
        reg = Registry(ScrapeConfig(), HealthConfig(), metrics, client=client)
        reg.add_pool(
            PoolInfo("p", "llama-3-8b", "H100-SXM", Role.MIXED, capacity_for("H100", "llama-3-8b")), None
        )

        def workers() -> set[str]:
            return {
                s.labels["worker"]
                for fam in metrics.registry.collect()
                if fam.name in ("mosaic_upstream_errors", "mosaic_scrape_errors")
                for s in fam.samples
            }

        a, b = Endpoint("vllm-0", "http://10.0.0.5:8000"), Endpoint("vllm-1", "http://10.0.0.6:8000")
        seen = []
        try:
            reg.sync_pool("p", [a, b])
            await reg.scrape_once()  # both answer 500: a scrape error each
            reg.report_failure("p/vllm-0", "connect")
            ticket = reg.track("p/vllm-1", 100)
            seen.append(workers())
            reg.sync_pool("p", [])  # vllm-0 gone; vllm-1 gone with a request still running there
            seen.append(workers())
            ticket.done()
            reg.sync_pool("p", [])
            seen.append(workers())
        finally:
            await reg.stop()
            await client.aclose()
        return seen

    assert asyncio.run(main()) == [{"p/vllm-0", "p/vllm-1"}, {"p/vllm-1"}, set()]


def test_node_labels_are_relisted_for_a_new_node_but_not_for_an_unlabelled_one() -> None:
    listings = [
        {"items": [{"metadata": {"name": "n1", "labels": {"rack": "r1"}}}]},
        {"items": [{"metadata": {"name": "n1", "labels": {"rack": "r1"}}}, {"metadata": {"name": "n2", "labels": {"rack": "r2"}}}]},
    ]  # fmt: skip
    fetched: list[int] = []

    async def fetch() -> dict[str, Any]:
        fetched.append(1)
        return listings[min(len(fetched), 2) - 1]

    async def run() -> list[dict[str, str]]:
        cache = NodeLabelCache(ttl_s=600, clock=lambda: 0.0)
        out = []
        for nodes in ({"n1"}, {"n1"}, {"n1", "n2"}, {"n1", "n2"}, {"n1", "n2", "n3"}, {"n3"}):
            labels = await cache.get("rack", nodes, fetch)
            out.append({n: labels[n]["rack"] for n in sorted(labels)})
        return out

    seen = asyncio.run(run())
    # n2 appears (a node just added): relisted once; n3 is missing from the listing too (no label): relisted
    # once to find out, then known absent
    assert len(fetched) == 3
    assert seen == [{"n1": "r1"}] * 2 + [{"n1": "r1", "n2": "r2"}] * 4


def test_a_scrape_that_fails_after_its_worker_left_brings_no_series_back() -> None:
    """A terminating pod's scrape hangs, then fails; discovery had dropped the worker meanwhile and
    forgotten its series, which the late failure re-created for good."""

    async def slow_failure(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.2)
        return httpx.Response(500)

    async def main() -> set[str]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(slow_failure))
        metrics = GatewayMetrics()
        reg = Registry(ScrapeConfig(), HealthConfig(), metrics, client=client)
        reg.add_pool(
            PoolInfo("p", "llama-3-8b", "H100-SXM", Role.MIXED, capacity_for("H100", "llama-3-8b")), None
        )
        try:
            reg.sync_pool("p", [Endpoint("vllm-0", "http://10.0.0.5:8000")])
            scrape = asyncio.ensure_future(reg.scrape_once())
            await asyncio.sleep(0.05)
            reg.sync_pool("p", [])  # gone while its scrape is in flight
            await scrape
            reg.report_failure("p/vllm-0", "connect")  # a late request failure: the same
        finally:
            await reg.stop()
            await client.aclose()
        return {
            s.labels["worker"]
            for fam in metrics.registry.collect()
            if fam.name in ("mosaic_upstream_errors", "mosaic_scrape_errors")
            for s in fam.samples
        }

    assert asyncio.run(main()) == set()


def test_a_failing_node_listing_is_logged_once_and_not_retried_at_every_resync(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    fetched: list[float] = []
    failing = [False]

    async def fetch() -> dict[str, Any]:
        fetched.append(now[0])
        if failing[0]:
            raise RuntimeError("403 Forbidden")
        return {"items": [{"metadata": {"name": "n1", "labels": {"rack": "r1"}}}]}

    async def run() -> list[Any]:
        cache = NodeLabelCache(ttl_s=60, retry_s=30, clock=lambda: now[0])
        seen = [await cache.get("rack", {"n1"}, fetch)]
        failing[0] = True
        for t in (61, 62, 70, 95, 100):  # stale from 60 s; 3 pools resync at each
            now[0] = t
            seen += [await cache.get("rack", {"n1"}, fetch) for _ in range(3)]
        failing[0] = False
        now[0] = 130
        seen.append(await cache.get("rack", {"n1"}, fetch))
        return seen

    with caplog.at_level("WARNING", logger="mosaic.discovery"):
        seen = asyncio.run(run())
    assert all(s == {"n1": {"rack": "r1"}} for s in seen)  # the last listing throughout
    assert fetched == [0, 61, 95, 130]  # a failure is retried after 30 s, not at every pool's resync
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1  # once per run of failures


def test_a_worker_back_in_the_next_listing_brings_its_lora_adapters_back() -> None:
    """Its adapters go from the index when it leaves the listing and come back with its record (the
    index is rebuilt on both changes), without waiting for the next /v1/models read."""
    models = {
        "object": "list",
        "data": [{"id": "llama-3-8b", "parent": None}, {"id": "sql", "parent": "llama-3-8b"}],
    }

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=models) if request.url.path == "/v1/models" else httpx.Response(200)

    async def main() -> list[dict[str, str]]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        reg = Registry(ScrapeConfig(models_interval_s=3600), HealthConfig(), GatewayMetrics(), client=client)
        reg.add_pool(
            PoolInfo("p", "llama-3-8b", "H100-SXM", Role.MIXED, capacity_for("H100", "llama-3-8b")), None
        )
        a = Endpoint("vllm-0", "http://10.0.0.5:8000")
        seen = []
        try:
            reg.sync_pool("p", [a])
            await asyncio.sleep(0.05)  # its first health check: ready, adapters read
            seen.append(dict(reg.adapter_models()))
            ticket = reg.track("p/vllm-0", 500)
            reg.sync_pool("p", [])
            seen.append(dict(reg.adapter_models()))
            reg.sync_pool("p", [a])
            seen.append(dict(reg.adapter_models()))
            ticket.done()
            return seen
        finally:
            await reg.stop()
            await client.aclose()

    assert asyncio.run(main()) == [{"sql": "llama-3-8b"}, {}, {"sql": "llama-3-8b"}]
