"""Kubernetes API calls are bounded: every client call carries `_request_timeout`, and a listing whose thread
hangs anyway counts as a failed re-list (last good view kept, next resync retries) instead of blocking the
pool's loop or the gateway's startup forever. The clients are the real `kubernetes` API classes with their
REST layer replaced by recorded answers (as in tests/scheduler/actuators/test_actuators.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from kubernetes.client.rest import RESTResponse

from scheduler.actuators.base import ActuatorCallFailed
from scheduler.actuators.kubernetes import REQUEST_TIMEOUT_S, KubernetesActuator
from scheduler.fleet import Role, capacity_for
from server.config import HealthConfig, KubernetesSource, ScrapeConfig, validate_config
from server.discovery import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    KubernetesDiscovery,
    NodeLabelCache,
    api_lister,
    load_kubernetes_config,
)
from server.metrics import GatewayMetrics
from server.registry import PoolInfo, Registry
from tests.gateway.serverkit import GatewayThread
from tests.scheduler.actuators.test_actuators import _Recorded, _scale_object

FIXTURES = Path(__file__).parent / "fixtures"
SLICES = json.loads((FIXTURES / "endpointslices.json").read_text())
PODS = json.loads((FIXTURES / "pods.json").read_text())
NODES = json.loads((FIXTURES / "nodes.json").read_text())
PODS_NODES = json.loads((FIXTURES / "pods_nodes.json").read_text())


class RecordedApi:
    """The real CoreV1Api / DiscoveryV1Api / AppsV1Api over one ApiClient whose REST layer answers from
    recorded objects; every call's (method, path, _request_timeout) is kept. `hang` blocks calls whose path
    contains it until `release` is set (an API server that accepted the connection and never answers)."""

    def __init__(self) -> None:
        self.api_client = client.ApiClient(client.Configuration(host="https://k8s.test"))
        self.api_client.rest_client.request = self._request
        self.calls: list[tuple[str, str, Any]] = []
        self.hang: str | None = None
        self.release = threading.Event()

    def _request(
        self,
        method: str,
        url: str,
        headers: Any = None,
        body: Any = None,
        post_params: Any = None,
        _request_timeout: Any = None,
    ) -> Any:
        path = url.removeprefix("https://k8s.test").split("?")[0]
        self.calls.append((method, path, _request_timeout))
        if self.hang is not None and self.hang in path:
            self.release.wait(30)
        if path.endswith("/endpointslices"):
            return RESTResponse(_Recorded(200, SLICES))
        if path.endswith("/pods"):
            return RESTResponse(_Recorded(200, PODS))
        if path == "/api/v1/nodes":
            return RESTResponse(_Recorded(200, NODES))
        name = path.split("/deployments/")[1].split("/")[0]
        return RESTResponse(_Recorded(200, _scale_object(name, 2)))

    def lister(self, request_timeout: tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) -> Any:
        return api_lister(
            client.CoreV1Api(self.api_client), client.DiscoveryV1Api(self.api_client), request_timeout
        )


@pytest.fixture
def api() -> Iterator[RecordedApi]:
    recorded = RecordedApi()
    yield recorded
    recorded.release.set()  # never leave a test's thread blocked
    recorded.api_client.close()


@pytest.mark.parametrize(
    ("resource", "domain_label", "paths"),
    [
        (
            "endpointslices",
            "topology.kubernetes.io/zone",
            ["/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"],
        ),
        ("pods", "topology.kubernetes.io/zone", ["/api/v1/namespaces/llm/pods", "/api/v1/nodes"]),
    ],
)
def test_every_discovery_call_carries_a_request_timeout(
    api: RecordedApi, resource: str, domain_label: str, paths: list[str]
) -> None:
    cfg = KubernetesSource(
        namespace="llm",
        label_selector="a=b",
        resource=resource,  # type: ignore[arg-type]
        port="http",
        domain_label=domain_label,
    )
    source = KubernetesDiscovery(cfg, api.lister())
    endpoints = asyncio.run(source.list())
    assert endpoints  # the recorded objects parse
    assert [(m, p) for m, p, _ in api.calls] == [("GET", p) for p in paths]
    assert {t for _, _, t in api.calls} == {(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)}


def test_the_actuator_reads_and_patches_with_a_request_timeout(api: RecordedApi) -> None:
    actuator = KubernetesActuator(client.AppsV1Api(api.api_client), "llm", {"d": "vllm-d"})
    action = actuator.scale("d", 4, now=1.0)
    assert action.applied and (action.before, action.after) == (2, 4)
    assert [(m, t) for m, _, t in api.calls] == [("GET", REQUEST_TIMEOUT_S), ("PATCH", REQUEST_TIMEOUT_S)]


def test_a_hung_actuator_call_is_reported_not_raised(api: RecordedApi) -> None:
    """The client's own read timeout fires in urllib3; here the REST layer raises what urllib3 would."""
    import urllib3

    def timed_out(*args: Any, **kwargs: Any) -> Any:
        raise urllib3.exceptions.ReadTimeoutError(None, "/scale", "Read timed out. (read timeout=20.0)")

    api.api_client.rest_client.request = timed_out
    action = KubernetesActuator(client.AppsV1Api(api.api_client), "llm", {"d": "vllm-d"}).scale(
        "d", 3, now=0.0
    )
    assert (action.applied, action.before, action.after) == (False, -1, -1)
    assert action.error == (
        "reading deployments/vllm-d/scale in namespace llm: ReadTimeoutError: "
        "None: Read timed out. (read timeout=20.0)"
    )


@pytest.fixture
def silent_api_server() -> Iterator[tuple[str, list[socket.socket]]]:
    """An "API server" on 127.0.0.1 that accepts connections and never answers; yields its URL and the
    connections it accepted."""
    srv = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end
            while True:
                accepted.append(srv.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}", accepted
    srv.close()
    for conn in accepted:
        conn.close()


def test_a_hung_api_server_costs_one_read_timeout_not_four(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, silent_api_server: tuple[str, list[socket.socket]]
) -> None:
    """Through the real config loading and REST layer: urllib3's default Retry(3) re-sent a GET whose read
    timed out three more times, so one call on a hung API server took 4 × its read timeout (80 s with the
    actuator's 20 s), blocking the controller's cycle and the discovery thread that long."""
    url, accepted = silent_api_server
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(kubeconfig))
    from kubernetes.config import kube_config

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))  # $KUBECONFIG, read at import
    saved = client.Configuration._default  # the process-wide default the loader sets: restored after
    try:
        apps = load_kubernetes_config(False, "the test").AppsV1Api()
        actuator = KubernetesActuator(apps, "llm", {"d": "vllm-d"}, request_timeout=(2.0, 0.5))
        started = time.monotonic()
        with pytest.raises(ActuatorCallFailed, match=r"^reading deployments/vllm-d/scale in namespace llm: "):
            actuator.replicas("d")
        elapsed = time.monotonic() - started
    finally:
        client.Configuration.set_default(saved)
    assert 0.5 <= elapsed < 1.5, elapsed  # one read timeout; the four tries took 2.0 s
    assert len(accepted) == 1


def test_a_hung_listing_times_out_and_a_second_is_not_stacked_behind_it(api: RecordedApi) -> None:
    api.hang = "/endpointslices"
    cfg = KubernetesSource(namespace="llm", label_selector="a=b", port="http")
    source = KubernetesDiscovery(cfg, api.lister(), call_timeout_s=0.2)

    async def run() -> None:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"timed out after 0\.2 s"):
            await source.list()
        assert time.monotonic() - start < 2.0
        # the first call's thread is still blocked: the next listing fails at once, no second thread
        with pytest.raises(TimeoutError, match="still blocked"):
            await source.list()
        assert len(api.calls) == 1
        api.release.set()  # the API answers again (or the client's own read timeout fired)
        api.hang = None
        for _ in range(100):
            await asyncio.sleep(0.01)
            try:
                endpoints = await source.list()
                break
            except TimeoutError:
                continue
        assert {e.name for e in endpoints} >= {"vllm-decode-a100-6d5f7b9c4-2kq8x"}

    asyncio.run(run())


def test_a_hung_relist_keeps_the_last_good_view(api: RecordedApi) -> None:
    """The registry's re-list of a pool whose API call hangs returns within the bound and changes nothing."""
    cfg = KubernetesSource(namespace="llm", label_selector="a=b", port="http")
    source = KubernetesDiscovery(cfg, api.lister(), call_timeout_s=0.2)

    async def run() -> None:
        probes = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503)))
        reg = Registry(ScrapeConfig(), HealthConfig(), GatewayMetrics(), client=probes)
        reg.add_pool(
            PoolInfo("d", "llama-3-8b", "A100-80GB", Role.DECODE, capacity_for("A100", "llama-3-8b")), source
        )
        await reg.resync("d")
        before = sorted(r.id for r in reg.records())
        assert len(before) == 5
        api.hang = "/endpointslices"
        start = time.monotonic()
        await asyncio.wait_for(reg.resync("d"), 5)  # before the fix: blocked until the API answered
        assert time.monotonic() - start < 2.0
        assert sorted(r.id for r in reg.records()) == before
        api.release.set()
        await reg.stop()
        await probes.aclose()

    asyncio.run(run())


class HangingThenOk:
    """A pool source over a lister that hangs until released (startup against a hung API server)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, resource: str, namespace: str, selector: str) -> dict[str, Any]:
        self.release.wait(30)
        return {"items": []}


def test_gateway_starts_despite_a_hung_api_server_and_is_ready_once_discovery_answers() -> None:
    """Registry.start waits for the first listing: with a hung API it used to never start. Now the listing
    times out, the gateway serves (not ready: discovery never answered), and turns ready once it does."""
    lister = HangingThenOk()
    k8s = {"namespace": "llm", "label_selector": "a=b", "port": 8000, "resync_s": 0.3}
    cfg = validate_config(
        {
            "pools": [{"name": "k", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"kubernetes": k8s}}],
            "health": {"interval_s": 60},
            "scrape": {"interval_s": 60},
        }
    )
    source = KubernetesDiscovery(cfg.pools[0].endpoints.kubernetes, lister, call_timeout_s=0.3)  # type: ignore[arg-type]
    start = time.monotonic()
    try:
        with GatewayThread(cfg, sources={"k": source}) as gw:
            assert time.monotonic() - start < 10
            with httpx.Client(base_url=gw.url, timeout=5) as http:
                ready = http.get("/ready")
                assert ready.status_code == 503
                body = ready.json()
                assert body["discovery_synced"] is False
                assert "timed out" in body["unsynced_pools"]["k"] or "blocked" in body["unsynced_pools"]["k"]
                lister.release.set()
                deadline = time.monotonic() + 10
                while (ready := http.get("/ready")).status_code != 200 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert ready.status_code == 200, ready.text
                assert ready.json()["unsynced_pools"] == {}
    finally:
        lister.release.set()


def test_pools_share_one_node_listing_of_the_labelled_nodes_from_the_api_cache(api: RecordedApi) -> None:
    """Every pool listed every node of the cluster at every resync (3 pools: 3 full node lists per round,
    per gateway); now the pools of a process share one listing of the nodes carrying the domain label,
    served from the API server's cache, until it is stale or a worker's node is one it did not show."""
    seen: list[str] = []
    request = api.api_client.rest_client.request

    def recording(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(url)
        if url.split("?")[0].endswith("/pods"):  # pods with their nodeName
            return RESTResponse(_Recorded(200, PODS_NODES))
        return request(method, url, *args, **kwargs)

    api.api_client.rest_client.request = recording
    now = [0.0]
    shared = NodeLabelCache(ttl_s=60, clock=lambda: now[0])
    sources = [
        KubernetesDiscovery(
            KubernetesSource(namespace="llm", label_selector=f"pool={i}", resource="pods", port="http",
                             domain_label="mosaic.dev/rdma-group"),
            api.lister(),
            nodes=shared,
        )
        for i in range(3)
    ]  # fmt: skip

    async def rounds() -> list[list[str | None]]:
        out = []
        for t in (0.0, 30.0, 61.0):
            now[0] = t
            for source in sources:
                out.append(sorted(str(e.domain) for e in await source.list()))
        return out

    domains = asyncio.run(rounds())
    nodes = [u for u in seen if "/nodes" in u]
    assert len(nodes) == 2  # at 0 s and when stale at 61 s; not per pool, not at 30 s
    assert set(nodes) == {
        "https://k8s.test/api/v1/nodes?labelSelector=mosaic.dev/rdma-group&resourceVersion=0"
    }
    assert domains == [["ib-a", "ib-a"]] * 9  # every pool, every round: both pods' nodes are in group ib-a
